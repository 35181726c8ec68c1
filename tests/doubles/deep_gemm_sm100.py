"""A TEST DOUBLE of ``deep_gemm`` 2.x on an sm100 GPU (DeepGEMM at commit 54e2261: csrc/apis/gemm.hpp,
attention.hpp, layout.hpp, smxx_layout.hpp), not DeepGEMM: plain Python functions with the real functions' names,
parameter lists and the argument checks DeepGEMM's C++ makes on sm100 (dtype, shape and strides of the scale
tensors, the recipe), which then decode the packed inputs with the unpacking written here, independently of the
adapter's packing, and compute with the reference kernel (the GEMM) or in float64 here (the logits). They test how the adapters lay the data out for the real
API; they say nothing about DeepGEMM's kernels (no sm100 GPU was available to run them)."""

import types

import torch

from dsa_indexer.backends.reference import kernels as ref

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# --- independent decoders -------------------------------------------------------------------------------------------
def unpack_ue8m0_words(words: torch.Tensor, groups: int) -> torch.Tensor:
    """int32 words of 4 ue8m0 bytes each -> fp32 scales [..., groups] (byte j of word w is group 4w + j)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = []
    for g in range(groups):
        byte = (w[..., g // 4] >> (8 * (g % 4))) & 0xFF
        out.append(torch.ldexp(torch.ones(byte.shape, dtype=torch.float64), byte - 127).float())
    return torch.stack(out, dim=-1)


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., D/2] packed FP4 -> fp32 [..., D]: low nibble first, bit 3 the sign, bits 0-2 index E2M1."""
    u = packed.view(torch.uint8).to(torch.int64)
    out = torch.empty(*u.shape[:-1], u.shape[-1] * 2)
    for part, nib in ((0, u & 0xF), (1, u >> 4)):
        mag = torch.tensor(E2M1)[nib & 7]
        out[..., part::2] = torch.where((nib & 8) != 0, -mag, mag)
    return out


def tma_mn(mn: int) -> int:
    return (mn + 3) // 4 * 4


def random_pow2(shape, gen, low=-20, high=4):
    return torch.exp2(torch.randint(low, high, shape, generator=gen).float())


# --- the test double --------------------------------------------------------------------------------------------------
class FakeDeepGemmSm100(types.ModuleType):
    """A stand-in for ``deep_gemm`` 2.x on an sm100 GPU (see the module docstring): argument checks as DeepGEMM's, then
    the math on the independently decoded inputs."""

    def __init__(self):
        super().__init__("deep_gemm")
        self.__version__ = "0.0-fake-sm100"
        self.calls = []

    def fp8_fp4_gemm_nt(self, a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
                        disable_ue8m0_cast=False):
        (a_fp8, sfa), (b_fp8, sfb) = a, b
        self.calls.append(("fp8_fp4_gemm_nt", recipe))
        m, k = a_fp8.shape
        n = b_fp8.shape[0]
        # transform_sf_into_required_layout on sm100 with int scales: recipe (1, 1, gran_k) and check_sf_layout
        assert recipe == (1, 1, 128), recipe
        for sf, mn in ((sfa, m), (sfb, n)):
            assert sf.dtype == torch.int32
            assert sf.shape == (mn, -(-k // (128 * 4))), (sf.shape, mn, k)
            assert sf.stride(-2) == 1 or mn == 1
            assert sf.stride(-1) == tma_mn(mn)
        sa = unpack_ue8m0_words(sfa, k // 128)
        sb_rows = unpack_ue8m0_words(sfb, k // 128)
        # The per-row b scales must be the 128 x 128 block scales broadcast: take one row per block.
        blocks = sb_rows[::128]
        assert torch.equal(sb_rows, blocks.repeat_interleave(128, 0)[:n])
        d.copy_(ref.gemm_fp8_blockscale(a_fp8, sa, b_fp8, blocks, d.dtype))

    fp8_gemm_nt = fp8_fp4_gemm_nt

    def fp8_fp4_mqa_logits(self, q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True,
                           max_seqlen_k=0, logits_dtype=torch.float32):
        (q_fp, q_sf), (kv_fp, kv_sf) = q, kv
        self.calls.append(("fp8_fp4_mqa_logits", q_sf is not None))
        assert q_sf is not None, "this double only takes the FP4 form"
        seq_len, heads, half = q_fp.shape
        assert heads in (8, 16, 32, 64) and half * 2 in (64, 128)
        assert q_fp.dtype == torch.int8 and q_fp.is_contiguous()
        assert q_sf.dtype == torch.int32 and q_sf.shape == (seq_len, heads) and q_sf.is_contiguous()
        keys = kv_fp.shape[0]
        assert kv_fp.dtype == torch.int8 and kv_fp.shape == (keys, half) and kv_fp.is_contiguous()
        assert kv_sf.dtype == torch.int32 and kv_sf.shape == (keys,) and kv_sf.is_contiguous()
        assert weights.dtype == torch.float32 and weights.shape == (seq_len, heads) and weights.stride(1) == 1
        for bound in (cu_seq_len_k_start, cu_seq_len_k_end):
            assert bound.dtype == torch.int32 and bound.shape == (seq_len,) and bound.is_contiguous()
        # The adapter's contract needs DeepGEMM's own -inf outside [ks, ke) and logits indexed from column 0.
        assert clean_logits and max_seqlen_k == 0 and logits_dtype == torch.float32
        blocks = half * 2 // 32
        qv = decode_e2m1(q_fp) * unpack_ue8m0_words(q_sf[..., None], blocks).repeat_interleave(32, -1)
        kvv = decode_e2m1(kv_fp) * unpack_ue8m0_words(kv_sf[..., None], blocks).repeat_interleave(32, -1)
        scores = torch.einsum("shd,nd->shn", qv.double(), kvv.double()).clamp_min(0)
        logits = (scores * weights.double()[..., None]).sum(1).float()
        cols = torch.arange(keys)
        visible = (cols >= cu_seq_len_k_start.long()[:, None]) & (cols < cu_seq_len_k_end.long()[:, None])
        # DeepGEMM's result: a view of rows padded to a multiple of 256 columns (garbage, 7.0 here, past N).
        out = torch.full((seq_len, -(-keys // 256) * 256 or 256), 7.0)
        out[:, :keys] = torch.where(visible, logits, float("-inf"))
        return out[:, :keys]

    # --- paged FP4 logits (DeepGEMM 54e2261 csrc/apis/attention.hpp: fp8_fp4_paged_mqa_logits) -----------------
    def get_num_sms(self):
        return 148

    def get_paged_mqa_logits_metadata(self, context_lens, block_kv, num_sms):
        assert context_lens.dtype == torch.int32 and context_lens.dim() == 2 and context_lens.is_contiguous()
        assert block_kv == 64 and num_sms == self.get_num_sms()
        self.calls.append(("get_paged_mqa_logits_metadata", tuple(context_lens.shape)))
        return torch.full((num_sms + 1, 2), 5, dtype=torch.int32)  # opaque to callers; checked to be passed back

    def fp8_fp4_paged_mqa_logits(self, q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                 max_context_len, clean_logits=False, logits_dtype=torch.float32, indices=None):
        q_fp, q_sf = q
        self.calls.append(("fp8_fp4_paged_mqa_logits", q_sf is not None, clean_logits))
        assert q_sf is not None, "this double only takes the FP4 form"
        batch, next_n, heads, half = q_fp.shape
        assert heads in (8, 16, 32, 64) and half * 2 in (64, 128)
        assert q_fp.dtype == torch.int8 and q_fp.is_contiguous()
        assert q_sf.dtype == torch.int32 and q_sf.shape == (batch, next_n, heads) and q_sf.is_contiguous()
        pages, block_kv = kv_cache.shape[0], kv_cache.shape[1]
        assert kv_cache.dtype == torch.uint8 and kv_cache.shape[2:] == (1, half + 4) and block_kv in (32, 64)
        assert kv_cache.is_contiguous()
        assert weights.dtype == torch.float32 and weights.shape == (batch * next_n, heads)
        assert context_lens.dtype == torch.int32 and context_lens.shape == (batch, next_n)
        assert block_table.dtype == torch.int32 and block_table.shape[0] == batch
        assert schedule_meta.shape == (self.get_num_sms() + 1, 2) and bool((schedule_meta == 5).all())
        assert not clean_logits and logits_dtype == torch.float32 and indices is None
        blocks = half * 2 // 32
        qv = decode_e2m1(q_fp) * unpack_ue8m0_words(q_sf[..., None], blocks).repeat_interleave(32, -1)
        # Each page: block_kv x half value bytes, then block_kv int32 scale words.
        page_bytes = kv_cache.reshape(pages, -1)
        values = decode_e2m1(page_bytes[:, : block_kv * half].reshape(pages, block_kv, half))
        words = page_bytes[:, block_kv * half:].contiguous().view(torch.int32)
        keys = values * unpack_ue8m0_words(words[..., None], blocks).repeat_interleave(32, -1)
        # DeepGEMM's result: rows padded to a multiple of 256 columns, garbage past each row's length (7.0 here).
        padded = -(-max_context_len // 256) * 256
        out = torch.full((batch * next_n, padded), 7.0)
        for b in range(batch):
            length = int(context_lens[b, -1])  # DeepGEMM schedules request b by its last row's length
            k = keys[block_table[b, : -(-length // block_kv)].long()].reshape(-1, half * 2)[:length].double()
            scores = torch.einsum("nhd,kd->nhk", qv[b].double(), k).clamp_min(0)
            row_logits = (scores * weights[b * next_n:(b + 1) * next_n, :, None].double()).sum(1)
            for j in range(next_n):
                seen = int(context_lens[b, j])
                out[b * next_n + j, :seen] = row_logits[j, :seen].float()
        return out[:, :max_context_len]
