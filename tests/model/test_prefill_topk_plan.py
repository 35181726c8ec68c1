"""The CUDA top-k's launch plan at prefill row shapes (issue 27), on the CPU: a prefill chunk (thousands of rows
wider than 8K) takes the prefill kernel; decode grids (a few hundred rows at most) keep the plans they had."""

import pytest

from dsa_indexer.backends.cuda import topk as cuda_topk

SMS = 132  # the H200's


@pytest.mark.parametrize("rows, cols", [(8193, 8193), (11000, 32768), (6000, 131072), (1024, 16384),
                                        (2048, 1 << 20), (132, 1 << 20)])
def test_prefill_chunks_take_the_prefill_kernel(rows, cols):
    assert cuda_topk.plan_for(rows, cols, SMS, 4) == cuda_topk.Plan("prefill", 1, cuda_topk.PREFILL_THREADS)


@pytest.mark.parametrize("rows, cols", [(1, 8192), (32, 32768), (64, 131072), (128, 131072), (256, 8192),
                                        (1023, 32768), (4096, 2048), (8192, 8192)])
def test_decode_grids_and_short_rows_keep_their_plans(rows, cols):
    got = cuda_topk.plan_for(rows, cols, SMS, 4)
    assert got is None or got.kernel != "prefill"
    if rows <= 256:  # the plan the decode grid had before the prefill kernel existed
        reg = cuda_topk.register_plan(rows, cols, SMS)
        assert got.kernel in ("registers", "stream", "routed") and reg is not None  # routed: the register clusters
        # beside the streaming kernel, each row to one of them by its own length


def test_few_rows_too_wide_for_every_cuda_kernel_stay_on_the_triton_top_k():
    assert cuda_topk.plan_for(131, 1 << 20, SMS, 4) is None
    assert cuda_topk.plan_for(4096, 1 << 24, SMS, 4) is None  # past the prefill kernel's 24-bit columns


def test_prefill_plan_is_a_pure_function_of_the_shape():
    cuda_topk.plan_for.cache_clear()
    for _ in range(3):
        cuda_topk.plan_for(8192, 8192, SMS, 4)
    assert cuda_topk.plan_for.cache_info().hits == 2
