"""Lightning indexer scoring + top-k selection, chunked over queries (the model's composition, eq. 1).

Same contract as `dsv32_jax.indexer.indexer_topk`: k = min(topk, S) keys per query among the visible ones
(causal and same segment), -1 for empty slots. Kernel path: `hadamard_quant` for q and k (fp8=True), q scales
folded into w, `indexer_logits` with per-row key ranges [segment start, q_index + 1) (blocks outside are skipped
and read as -inf), then the radix-select `topk`; query chunks of `q_chunk` rows keep at most chunk x S logits live
(a 128K prefill with chunk 128 holds 64 MB of fp32 logits). The exact (fp8=False) scores run in plain JAX.
Segments must be contiguous runs of keys (packed documents), which is what the model produces.
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv32_jax import indexer as ref_indexer
from dsv32_jax.attention import map_query_chunks
from dsv32_jax.kernels._dispatch import resolve_impl
from dsv32_jax.kernels.hadamard_quant import hadamard_quant
from dsv32_jax.kernels.indexer_logits import indexer_logits
from dsv32_jax.kernels.topk import topk as kernel_topk


def _key_ranges(q_index, q_segment, kv_segment):
    """[start, end) of the keys visible to each query: its segment's first key up to itself."""
    s = kv_segment.shape[1]
    same = kv_segment[:, None, :] == q_segment[:, :, None]
    start = jnp.argmax(same, axis=-1).astype(jnp.int32)  # first key of the query's segment
    end = jnp.clip(q_index.astype(jnp.int32) + 1, 0, s)
    return jnp.where(jnp.any(same, axis=-1), start, end), end


def indexer_topk(q, k, w, q_index, q_segment, kv_segment, topk: int, *, fp8: bool = False,
                 q_chunk: int | None = 128, impl: str | None = None, logits_dtype=jnp.float32):
    """q [B, T, H_I, D], k [B, S, D], w [B, T, H_I] (constants folded) -> top-k key indices [B, T, min(topk, S)].

    Backends: pallas_gpu, interpret (the GPU kernels above); pallas_tpu, interpret_tpu (their TPU kernels);
    elsewhere the reference `dsv32_jax.indexer.indexer_topk`.
    """
    impl = resolve_impl(impl, ("pallas_gpu", "interpret", "pallas_tpu", "interpret_tpu"))
    if impl == "reference":
        return ref_indexer.indexer_topk(q, k, w, q_index, q_segment, kv_segment, topk, fp8=fp8, q_chunk=q_chunk)
    k_eff = min(topk, k.shape[1])
    starts, ends = _key_ranges(q_index, q_segment, kv_segment)
    if fp8:
        q, q_scale = hadamard_quant(q, impl=impl)
        k, k_scale = hadamard_quant(k, impl=impl)
        w = w.astype(jnp.float32) * q_scale

    def chunk_fn(q_c, w_c, st_c, en_c):
        if fp8:
            logits = indexer_logits(q_c, k, k_scale, w_c, starts=st_c, ends=en_c, out_dtype=logits_dtype, impl=impl)
        else:
            col = jnp.arange(k.shape[1], dtype=jnp.int32)[None, None, :]
            inside = (col >= st_c[..., None]) & (col < en_c[..., None])
            logits = jnp.where(inside, ref_indexer.index_scores(q_c, k, w_c), -jnp.inf)
        return kernel_topk(logits, k_eff, impl=impl)

    return map_query_chunks(chunk_fn, q_chunk, (q, w, starts, ends))
