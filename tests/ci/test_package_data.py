"""The wheel carries the CUDA sources: the CUDA backend builds csrc/ with nvcc at first use from the installed package
(backends/cuda/jit.py), so a file of csrc/ left out of pyproject's package-data leaves a pip-installed (not editable)
package with no CUDA kernels."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_every_cuda_source_is_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["dsa_indexer.backends.cuda"]
    package = ROOT / "dsa_indexer" / "backends" / "cuda"
    shipped = {path for pattern in patterns for path in package.glob(pattern)}
    sources = {path for path in (package / "csrc").iterdir() if path.is_file()}
    assert sources, "csrc/ holds the CUDA sources"
    assert sources <= shipped, f"not in package-data: {sorted(p.name for p in sources - shipped)}"
