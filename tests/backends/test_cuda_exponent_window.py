"""The CUDA top-k's exponent-window digits (``ExponentWindow<M>`` in csrc/topk_registers.cu): host-compiled with nvcc
and checked over every key prefix. Skipped where no nvcc is found (CI's machine); runs wherever the kernels can build.

What a window must hold for the select to stay exact: its bins are monotone in the key; each in-window bin is exactly
the keys sharing one prefix (at kShift), and prefix_of gives that prefix back; a key's low bits never move it to
another bin. M = 5 (window_bin, 2048 bins: the DSA_TOPK_SOLO_WINDOW variant's first level)."""

from __future__ import annotations

import subprocess

import pytest

from dsa_indexer.backends.cuda import jit, topk

HARNESS = r"""
#include "%(source)s"
#include <cstdio>
template <class W> int violations() {
  int bad = 0, last = -1;
  for (unsigned p = 0; p < (1u << (32 - W::kShift)); ++p) {
    const unsigned key = p << W::kShift;
    const int b = W::bin(key);
    if (b < 0 || b >= W::kBinCount || b < last) ++bad;
    last = b;
    unsigned q;
    if (W::prefix_of(b, q) && q != p) ++bad;
    if (W::bin(key | ((1u << W::kShift) - 1u)) != b) ++bad;
  }
  int in_window = 0;
  for (int b = 0; b < W::kBinCount; ++b) {
    unsigned q;
    if (W::prefix_of(b, q)) {
      ++in_window;
      if (W::bin(q << W::kShift) != b) ++bad;
    }
  }
  if (in_window != 2 * W::kPerSide) ++bad;
  return bad;
}
int main() {
  printf("%%d\n", violations<Window>());
  return 0;
}
"""


def test_every_key_prefix_lands_in_one_ordered_bin(tmp_path):
    nvcc = jit.find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc: the window is checked where the CUDA kernels can build")
    src = tmp_path / "window_check.cu"
    src.write_text(HARNESS % {"source": jit.CSRC / topk.REGISTERS_SOURCE})
    exe = tmp_path / "window_check"
    flags = ["-O1", "-std=c++17", "--expt-relaxed-constexpr", *jit.arch_flags((9, 0))]  # the kernels need sm90
    built = subprocess.run([nvcc, *flags, "-o", str(exe), str(src)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and ran.stdout.split() == ["0"], ran.stdout + ran.stderr
