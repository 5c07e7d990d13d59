"""Pallas kernels for DeepSeek Sparse Attention: one public function per op, backend dispatch by platform.

  hadamard_quant  -- 128-dim Hadamard rotation + e4m3 quantization with power-of-two scales (indexer q and k)
  indexer_logits  -- FP8 lightning-indexer logits, eq. (1) (DeepGEMM fp8_mqa_logits semantics), [start, end) ranges
  topk            -- exact per-row top-k by radix/threshold select (-1 in empty slots)
  indexer_topk    -- scoring + selection chunked over queries (the model's composition)
  sparse_mla      -- gathered sparse MLA forward/backward (eq. 2) and the head-summed probabilities (eq. 4)

Each takes impl=None|"reference"|"pallas_gpu"|"pallas_tpu"|"interpret"|"interpret_tpu", and the ops with a Mosaic GPU
kernel also "mosaic_gpu"|"interpret_mosaic_gpu" (see `_dispatch.IMPLS`).
"""

from dsv32_jax.kernels._dispatch import ENV_VAR, IMPLS, set_default_impl
from dsv32_jax.kernels.hadamard_quant import hadamard_quant
from dsv32_jax.kernels.indexer_logits import indexer_logits
from dsv32_jax.kernels.indexer_topk import indexer_topk
from dsv32_jax.kernels.sparse_mla import StoredTiles, sparse_mla
from dsv32_jax.kernels.topk import topk

__all__ = ["ENV_VAR", "IMPLS", "StoredTiles", "hadamard_quant", "indexer_logits", "indexer_topk", "set_default_impl",
           "sparse_mla", "topk"]
