"""Triton helpers that read V4's FP4 keys as stored (`contract/cache.py`): packed e2m1 (element 2i in the low nibble
of byte i, a nibble ``sign << 3 | code``) and one ue8m0 byte per block of 32 dims. Shared by the paged FP4 logits
(`logits_fp4.py`, the 68-byte pages) and the ragged logits over gathered FP4 rows (`logits.py`), so both score a key
with the same arithmetic: per block, the e2m1 values are exact in fp8 e4m3 (and e4m3fnuz), one fp8 dot of K = 32
with q's same dims, then times the block's scale in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e2m1_value(nibble):
    """A nibble ``sign << 3 | code`` as fp32 (code = 2 * exponent + mantissa bit, exponent bias 1; code 1 is the
    subnormal 0.5), built from its fp32 bits and converted to fp8 by the caller. Measured on the H200 against two
    other decodes (`benchmarks/results/fp4_decode_ab_h200.json`): fp32 arithmetic (shifts, an int-to-float conversion
    and multiplies) took 18% longer, building the fp8 bytes by integer arithmetic and bitcasting 36% longer."""
    nibble = nibble.to(tl.int32)
    code = nibble & 7
    # fp32 bits: code >= 2 is exponent field (code >> 1) + 126, mantissa bit 22 = code & 1, i.e. (code + 252) << 22;
    # code 1 is 0.5 (0x3F000000), code 0 is +0 (no -0: e4m3fnuz has none); the sign goes to bit 31.
    bits = tl.where(code >= 2, (code + 252) << 22, code * 0x3F000000) | tl.where(code != 0, (nibble & 8) << 28, 0)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def ue8m0_value(byte):
    """A ue8m0 byte as fp32 ``2^(byte - 127)`` built from its bits (0: 2^-127, a subnormal; 255: NaN)."""
    e = byte.to(tl.int32)
    bits = tl.where(e == 0, 0x400000, (e << 23) | tl.where(e == 255, 0x400000, 0))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp4_block_scores(value_rows, scale_rows, key_ok, q_t, blk: tl.constexpr, BLOCK: tl.constexpr):
    """Block ``blk`` (dims [32 blk, 32 blk + 32)) of a tile of keys against q's same dims ``q_t`` [32, cols]:
    ``value_rows`` / ``scale_rows`` [TILE] point at each key's packed bytes and its scale bytes. The e2m1 values as
    fp8 (exact), one fp8 dot, then the block's scale per key in fp32: [TILE, cols].

    The nibbles are interleaved back into dim order in registers (join + reshape). Loading each byte twice instead
    (column j < 16 the low nibble of byte j, j >= 16 the high one of byte j - 16, with q's dims permuted to match)
    measured slower on the H200: 306 against 233 ms for the 128K-token V4 prefill's logits."""
    half: tl.constexpr = BLOCK // 2  # a block's 32 values are 16 packed bytes
    offs = blk * half + tl.arange(0, half)
    packed = tl.load(value_rows[:, None] + offs[None, :], mask=key_ok[:, None], other=0)
    values = tl.reshape(tl.join(e2m1_value(packed & 0xF), e2m1_value(packed >> 4)), (packed.shape[0], BLOCK))
    scale = ue8m0_value(tl.load(scale_rows + blk, mask=key_ok, other=127))
    return tl.dot(values.to(q_t.dtype), q_t) * scale[:, None]


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
