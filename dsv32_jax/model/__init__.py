"""The model: config and run options, RoPE, FP8 helpers, layers, the sharding rule table, attention references, the
lightning indexer and its KL losses, MLA with DSA, MoE, and the `Transformer` (with MTP) in `transformer.py`.

Imports only `dsv32_jax.kernels` and `dsv32_jax.optional` from outside this folder."""
