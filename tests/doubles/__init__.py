"""Every test double of a vendor library, in one place and named as one: each module says which library and which
release or commit it follows, what it checks, and what it does not say (no double stands for the vendor's kernels).

- `torch_npu`: torch_npu's indexer, quant and RoPE ops under op-plugin's published schemas (tests/data).
- `aiter`: amd-aiter's ragged / paged logits, decode top-k and fused RMSNorm + quant, and a fake ``aiter`` package.
- `aiter_quant_gemm`: aiter's fused RMSNorm + fp8 quant and CK block-scale GEMM, for the q_lora reuse adapters.
- `deep_gemm_sm100`: DeepGEMM 2.x's sm100 GEMM / FP4 logits signatures and argument checks.
- `flashinfer`: flashinfer 0.7's ``top_k_ragged_transform``.
"""
