"""Integrations of the indexer into other libraries' models.

Each integration is a module that imports its host library only when used (``import dsa_indexer`` never needs
one): `dsa_indexer.integrations.transformers` swaps the indexers of Hugging Face transformers' DeepSeek-V3.2 and
DeepSeek-V4 models for this library's.
"""
