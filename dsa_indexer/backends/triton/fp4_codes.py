"""Triton helpers that read V4's FP4 keys as stored (`contract/cache.py`): packed e2m1 (element 2i in the low nibble
of byte i, a nibble ``sign << 3 | code``) and one ue8m0 byte per block of 32 dims. Shared by the paged FP4 logits
(`logits_fp4.py`, the 68-byte pages) and the ragged logits over gathered FP4 rows (`logits.py`), so both score a key
with the same arithmetic: per block, the e2m1 values are exact in fp8 e4m3 (and e4m3fnuz) and are made as fp8 bits
by integer arithmetic, one fp8 dot of K = 32 with q's same dims, then times the block's scale in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ue8m0_value(byte):
    """A ue8m0 byte as fp32 ``2^(byte - 127)`` built from its bits (0: 2^-127, a subnormal; 255: NaN)."""
    e = byte.to(tl.int32)
    bits = tl.where(e == 0, 0x400000, (e << 23) | tl.where(e == 255, 0x400000, 0))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_fp8_bits(nibble, FNUZ: tl.constexpr):
    """A nibble ``sign << 3 | code`` as the bits of the same value in fp8 e4m3fn (``FNUZ``: e4m3fnuz), by integer
    arithmetic (no fp32 decode and conversion): code = 2 * e + m is ``2^(e - 1) * (1 + m / 2)``
    for e >= 1, i.e. e4m3 exponent field e + 6 (fnuz: + 7) and mantissa m << 2, which is ``(code + 12) << 2`` (fnuz:
    ``+ 14``); code 1 (0.5) is exponent field 6 (fnuz: 7), code 0 is 0 with no sign (fnuz's 0x80 is NaN)."""
    nibble = nibble.to(tl.int32)
    code = nibble & 7
    bias: tl.constexpr = 14 if FNUZ else 12
    half: tl.constexpr = 0x38 if FNUZ else 0x30
    mag = tl.where(code >= 2, (code + bias) << 2, code * half)
    return (mag | tl.where(code != 0, (nibble & 8) << 4, 0)).to(tl.uint8)


@triton.jit
def fp4_block_scores(value_rows, scale_rows, key_ok, q_t, blk: tl.constexpr, BLOCK: tl.constexpr):
    """Block ``blk`` (dims [32 blk, 32 blk + 32)) of a tile of keys against q's same dims ``q_t`` [32, cols]:
    ``value_rows`` / ``scale_rows`` [TILE] point at each key's packed bytes and its scale bytes. The e2m1 values as
    fp8 bits (exact), one fp8 dot, then the block's scale per key in fp32: [TILE, cols].

    The nibbles are interleaved back into dim order in registers (join + reshape). Loading each byte twice instead
    (column j < 16 the low nibble of byte j, j >= 16 the high one of byte j - 16, with q's dims permuted to match)
    measured slower on the H200: 306 against 233 ms for the 128K-token V4 prefill's logits."""
    half: tl.constexpr = BLOCK // 2  # a block's 32 values are 16 packed bytes
    offs = blk * half + tl.arange(0, half)
    packed = tl.load(value_rows[:, None] + offs[None, :], mask=key_ok[:, None], other=0)
    fnuz: tl.constexpr = q_t.dtype == tl.float8e4b8
    bits = tl.reshape(tl.join(e2m1_fp8_bits(packed & 0xF, fnuz), e2m1_fp8_bits(packed >> 4, fnuz)),
                      (packed.shape[0], BLOCK))
    scale = ue8m0_value(tl.load(scale_rows + blk, mask=key_ok, other=127))
    return tl.dot(bits.to(q_t.dtype, bitcast=True), q_t) * scale[:, None]


@triton.jit
def q_block_t(q_ptr, q_row, col_ok, blk: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """q's dims [32 blk, 32 blk + 32) of the program's (row, head) columns (``q_row``: each column's row of the
    [rows * heads, D] q), K-major: [32, cols] fp8."""
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    return tl.trans(tl.load(q_ptr + q_row[:, None] * D + offs[None, :], mask=col_ok[:, None], other=0.0))


@triton.jit
def fp4_key_scores(value_rows, scale_rows, key_ok, q_t0, q_t1, q_t2, q_t3, BLOCK: tl.constexpr):
    """A key tile's fp32 scores against all of q's columns: the four blocks' scaled dots summed (D = 4 blocks)."""
    scores = fp4_block_scores(value_rows, scale_rows, key_ok, q_t0, 0, BLOCK)
    scores += fp4_block_scores(value_rows, scale_rows, key_ok, q_t1, 1, BLOCK)
    scores += fp4_block_scores(value_rows, scale_rows, key_ok, q_t2, 2, BLOCK)
    scores += fp4_block_scores(value_rows, scale_rows, key_ok, q_t3, 3, BLOCK)
    return scores
