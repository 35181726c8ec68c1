"""Backends: one folder per vendor. Each registers its implementations through the plugin hook and touches nothing else."""
