"""The argument checks of `contract/validate.py`, one promise each: every check runs and its refusal names the argument.

The success path of these checks is the public ops' per-call overhead (benchmarks/dispatch_overhead.py), so it is
written for speed (a dtype compared by identity, a few CPU values compared one by one, messages built only on
failure). These tests hold each check to its refusal, so a faster path cannot drop one silently;
tests/ops/test_bad_input.py does the same through every public op, argument by argument.
"""

from __future__ import annotations

import enum
import random

import pytest
import torch

from dsa_indexer import ops
from dsa_indexer.contract import validate as v
from dsa_indexer.testing import forbid_host_syncs

CPU, META = torch.device("cpu"), torch.device("meta")


def _rows() -> int:
    return random.randint(2, 9)


# (what is wrong, the value, the check's arguments, what the message says)
TENSOR_REFUSALS = [
    ("not a tensor", lambda r: [0.0] * r, dict(), r"x must be a torch.Tensor, got list"),
    ("dtype", lambda r: torch.zeros(r, 4), dict(dtype=torch.int32), r"x must have dtype int32, got float32"),
    ("dtype of several", lambda r: torch.zeros(r, 4),
     dict(dtype=(torch.int32, torch.int64)), r"x must have dtype int32 or int64, got float32"),
    ("dims", lambda r: torch.zeros(r), dict(ndim=2), r"x must have 2 dims, got shape \[\d+\]"),
    ("shape", lambda r: torch.zeros(r, 4), dict(shape=(None, 5)), r"x must have shape \[\*, 5\], got \[\d+, 4\]"),
    ("shape's dims", lambda r: torch.zeros(r, 4), dict(shape=(None,)), r"x must have shape \[\*\], got \[\d+, 4\]"),
    ("device", lambda r: torch.zeros(r, device=META), dict(device=CPU), r"x is on meta but the other inputs are on cpu"),
    ("contiguity", lambda r: torch.zeros(4, r).t(), dict(contiguous=True), r"x must be contiguous"),
]


@pytest.mark.parametrize("wrong,make,check,message", TENSOR_REFUSALS, ids=[case[0] for case in TENSOR_REFUSALS])
def test_each_tensor_check_refuses_naming_the_argument(wrong, make, check, message):
    with pytest.raises(v.IndexerInputError, match=message):
        v.tensor("x", make(_rows()), **check)


def test_a_tensor_that_passes_every_check_is_returned_as_is():
    r = _rows()
    x = torch.randn(r, 4)
    assert v.tensor("x", x, dtype=torch.float32, ndim=2, shape=(r, None), device=CPU, contiguous=True) is x
    ints = x.int()
    assert v.tensor("x", ints, dtype=(torch.int64, torch.int32), ndim=2, shape=(None, 4), device=CPU) is ints


class _Width(enum.IntEnum):
    WIDE = 2048


@pytest.mark.parametrize("value", [0, -1, True, False, 4.0, "4", None, 2**31, 2**40])
def test_index_count_refuses_what_is_not_a_positive_int32_count(value):
    with pytest.raises(v.IndexerInputError, match=r"\bk\b"):
        v.index_count("k", value)


@pytest.mark.parametrize("value", [1, 2**31 - 1, _Width.WIDE])
def test_index_count_takes_positive_ints_up_to_the_int32_limit(value):
    assert v.index_count("k", value) == value


@pytest.mark.parametrize("count", [1, 5, 16, 17, 40], ids=lambda n: f"{n}-values")
def test_a_range_check_refuses_any_one_value_out_of_range(count):
    """Wherever the bad value sits (the few-values path compares them one by one), at either bound; values at the
    bounds' edges pass. Up to 16 CPU values are read as Python numbers, more by one reduction."""
    low, high = random.randint(-3, 3), random.randint(10, 20)
    values = [random.randint(low, high - 1) for _ in range(count)]
    values[0], values[-1] = low, high - 1  # both edges inside
    v.in_range("ends", torch.tensor(values, dtype=torch.int32), low, high, "columns")
    for bad in (low - 1, high):
        at = random.randrange(count)
        wrong = values[:at] + [bad] + values[at + 1:]
        lo, hi = min(wrong), max(wrong)
        with pytest.raises(v.IndexerInputError,
                           match=rf"ends values must lie in \[{low}, {high}\) \(columns\); got range \[{lo}, {hi}\]"):
            v.in_range("ends", torch.tensor(wrong, dtype=torch.int32), low, high, "columns")


def test_a_range_check_reads_no_values_of_a_tensor_standing_for_a_device_one():
    """CPU tensors standing for device ones (`forbid_host_syncs`): the few-values path is not taken, so the range
    is not read (as on a GPU without DSA_INDEXER_CHECK_RANGES); on the CPU it is."""
    out_of_range = torch.tensor([5, 99], dtype=torch.int32)
    with forbid_host_syncs():
        v.in_range("ends", out_of_range, 0, 10, "columns")
    with pytest.raises(v.IndexerInputError, match="ends"):
        v.in_range("ends", out_of_range, 0, 10, "columns")


def test_the_public_op_still_runs_every_check_of_its_declaration():
    """One bad argument of each kind through `ops.topk_indices`, the op that benchmarks/dispatch_overhead.py times:
    type, dtype, dims, shape, device, count, range; each refusal names its argument."""
    r, c = _rows(), random.randint(8, 64)
    logits = torch.randn(r, c)
    ends = torch.randint(1, c + 1, (r,), dtype=torch.int32)
    k = random.randint(1, c)
    ops.topk_indices(logits, k, ends)  # the valid call the cases below change in one place
    cases = [
        ("logits", lambda: ops.topk_indices(logits.tolist(), k, ends)),
        ("logits", lambda: ops.topk_indices(logits.double(), k, ends)),
        ("logits", lambda: ops.topk_indices(logits[0], k, ends)),
        ("k", lambda: ops.topk_indices(logits, 0, ends)),
        ("k", lambda: ops.topk_indices(logits, float(k), ends)),
        ("ends", lambda: ops.topk_indices(logits, k, ends.long())),
        ("ends", lambda: ops.topk_indices(logits, k, ends[:-1])),
        ("ends", lambda: ops.topk_indices(logits, k, ends.to(META))),
        ("ends", lambda: ops.topk_indices(logits, k, ends + c)),
        ("ends", lambda: ops.topk_indices(logits, k, ends - c - 1)),
        ("starts", lambda: ops.topk_indices(logits, k, ends, ends + 1)),
    ]
    for name, call in cases:
        with pytest.raises(v.IndexerInputError, match=rf"\b{name}\b"):
            call()
