"""The contract every backend implements and the model builds on; it imports nothing above it.

- `cache`: the index-K cache layout (``paged64_fp8_e4m3``), its views and stores, `indices_to_slots`.
- `quant`: the fp8 activation layouts (`Fp8GroupLayout`, `QuantizedActivation`) and the q_lora reuse rules.
- `validate`: argument checks that raise `IndexerInputError` naming the argument.
- `specs`: the ops' names, the facts of their problems (`PROBLEM_KEYS`) and their fake (meta) results, from which
  `dsa_indexer.ops` builds each custom op, its fake and its `Problem` once.
"""
