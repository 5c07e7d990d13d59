"""Lightning indexer scoring + top-k selection, chunked over queries (the model's composition, eq. 1).

Same contract as `dsv32_jax.model.indexer.indexer_topk`: k = min(topk, S) keys per query among the visible ones
(causal and same segment), -1 for empty slots. Kernel path: `hadamard_quant` for q and k (fp8=True; k may come
already quantized with its scales, e.g. from a decode cache), q scales folded into w, `indexer_logits` with per-row
key ranges [segment start, q_index + 1) (blocks outside are skipped and read as -inf), then the threshold-select
`topk` on each row's first q_index + 1 columns (`lengths`); query chunks of `q_chunk` rows keep at most chunk x S
logits live (a 128K prefill with chunk 128 holds 64 MB of fp32 logits). The exact (fp8=False) scores run in plain
JAX on the key blocks that meet the chunk's [min start, max end) (`index_scores_in_range`), masked by
`attention.visible`.

The key range of a query is exact when every segment is one contiguous run of keys and each query's own slot
belongs to its segment (packed documents, the sampler's left padding, a decode cache). Otherwise (e.g. GRPO
layouts whose padding segment 0 reappears after EOS) the range is a superset of the visible keys, and a second
branch, chosen at run time by `lax.cond` on a cheap O(B S log S) check, masks the logits with `attention.visible`
before the top-k: one more elementwise pass over each chunk's logits. Both branches give the reference selection.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv32_jax.model import indexer as ref_indexer
from dsv32_jax.model.attention import map_query_chunks, visible
from dsv32_jax.kernels._dispatch import resolve_impl
from dsv32_jax.kernels.hadamard_quant import DIM as HADAMARD_DIM
from dsv32_jax.kernels.hadamard_quant import hadamard_quant
from dsv32_jax.kernels.indexer_logits import indexer_logits
from dsv32_jax.kernels.topk import topk as kernel_topk

BACKENDS = ("pallas_gpu", "interpret", "pallas_tpu", "interpret_tpu")


def _key_ranges(q_index, q_segment, kv_segment):
    """[start, end) of the keys visible to each query: its segment's first key up to itself (start = end when no
    key has the query's segment).

    The first key of each segment comes from a stable sort of the keys by segment and a binary search per query:
    O(S log S + T log S), never the [B, T, S] compare (16 GiB at 128K tokens, built outside the query chunks, and
    constant-folded for minutes at compile time when the segment ids are constants; audit, 2026-12-07)."""
    s = kv_segment.shape[1]
    end = jnp.clip(q_index.astype(jnp.int32) + 1, 0, s)
    if s == 0:
        return end, end
    order = jnp.argsort(kv_segment, axis=-1, stable=True).astype(jnp.int32)  # keys by segment, in key order within
    srt = jnp.take_along_axis(kv_segment, order, axis=-1)
    pos = jax.vmap(functools.partial(jnp.searchsorted, side="left"))(srt, q_segment.astype(srt.dtype))
    pos = jnp.minimum(pos, s - 1).astype(jnp.int32)
    found = jnp.take_along_axis(srt, pos, axis=-1) == q_segment
    start = jnp.take_along_axis(order, pos, axis=-1)  # the smallest key index of the query's segment
    return jnp.where(found, start, end), end


def _ranges_exact(q_segment, kv_segment, starts, ends):
    """Scalar bool: every [start, end) holds only keys of the query's segment (so range = visibility).

    True when each row's segment ids form contiguous runs (#boundaries == #distinct ids - 1) and the last key of
    every non-empty range, end - 1, is in the query's segment (the run then covers [start, end))."""
    srt = jnp.sort(kv_segment, axis=-1)
    distinct = 1 + jnp.sum(srt[:, 1:] != srt[:, :-1], axis=-1)
    boundaries = jnp.sum(kv_segment[:, 1:] != kv_segment[:, :-1], axis=-1)
    last = jnp.take_along_axis(kv_segment, jnp.maximum(ends - 1, 0), axis=1)
    covered = (ends <= starts) | (last == q_segment)
    return jnp.all(boundaries == distinct - 1) & jnp.all(covered)


def indexer_topk(q, k, w, q_index, q_segment, kv_segment, topk: int, *, fp8: bool = False,
                 q_chunk: int | None = 128, impl: str | None = None, logits_dtype=jnp.float32, k_scale=None):
    """q [B, T, H_I, D], k [B, S, D], w [B, T, H_I] (constants folded) -> top-k key indices [B, T, min(topk, S)].

    With fp8, k may be given already quantized (Hadamard-rotated e4m3 codes, `dsv32_jax.model.indexer.quantize_keys`)
    with k_scale [B, S] (a decode cache). Backends: pallas_gpu, interpret (the GPU kernels above); pallas_tpu,
    interpret_tpu (their TPU kernels); elsewhere the reference `dsv32_jax.model.indexer.indexer_topk`. The fp8 path
    quantizes with the `hadamard_quant` kernel, which needs D = 128: other D raise with an explicit impl and
    use the reference quantization with impl=None. Not differentiable (integer output).
    """
    ref_indexer.check_topk_args("indexer_topk", q, k, w, q_index, q_segment, kv_segment, topk, fp8=fp8,
                                q_chunk=q_chunk, k_scale=k_scale)
    if jnp.dtype(logits_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"indexer_topk: logits_dtype must be float32 or bfloat16, got {jnp.dtype(logits_dtype)}")
    reason = None
    if fp8 and q.shape[-1] != HADAMARD_DIM:
        reason = f"the fp8 path's hadamard_quant kernel needs D = {HADAMARD_DIM}, got D = {q.shape[-1]}"
    # impl=None: only the quantization falls back (hadamard_quant resolves on its own), the rest stays on kernels
    resolved = resolve_impl(impl, BACKENDS, op="indexer_topk", shapes={"q": q, "k": k, "w": w},
                            unsupported=reason if impl is not None else None)
    # no keys or no queries: the reference's empty selection, no kernel to run
    if resolved == "reference" or min(topk, k.shape[1]) == 0 or q.shape[1] == 0:
        return ref_indexer.indexer_topk(q, k, w, q_index, q_segment, kv_segment, topk, fp8=fp8, q_chunk=q_chunk,
                                        k_scale=k_scale)
    sub_impl = impl  # the caller's request goes to each kernel: explicit stays explicit, None resolves per op
    k_eff = min(topk, k.shape[1])
    q, k, w = jax.lax.stop_gradient((q, k, w))
    starts, ends = _key_ranges(q_index, q_segment, kv_segment)
    if fp8:
        q, q_scale = hadamard_quant(q, impl=sub_impl)
        if k_scale is None:
            k, k_scale = hadamard_quant(k, impl=sub_impl)
        w = w.astype(jnp.float32) * q_scale

    def chunk_fn(q_c, w_c, st_c, en_c, qi_c, qs_c, *, mask):
        if fp8:
            logits = indexer_logits(q_c, k, k_scale, w_c, starts=st_c, ends=en_c, out_dtype=logits_dtype,
                                    impl=sub_impl)
            if mask:
                logits = jnp.where(visible(qi_c, qs_c, kv_segment), logits, -jnp.inf)
        else:
            scores = ref_indexer.index_scores_in_range(q_c, k, w_c, jnp.min(st_c), jnp.max(en_c))
            logits = jnp.where(visible(qi_c, qs_c, kv_segment), scores, -jnp.inf)
            logits = logits.astype(logits_dtype)
        return kernel_topk(logits, k_eff, lengths=en_c, impl=sub_impl)  # keys >= end are never visible: the
        # top-k reads each row only up to its query (half of a causal chunk's logits on average)

    def run(mask):
        return map_query_chunks(functools.partial(chunk_fn, mask=mask), q_chunk,
                                (q, w, starts, ends, q_index, q_segment))

    if not fp8:
        return run(False)
    exact = _ranges_exact(q_segment, kv_segment, starts, ends)
    if not isinstance(exact, jax.core.Tracer):  # eager: trace only the branch that runs
        return run(not bool(exact))
    return jax.lax.cond(exact, lambda: run(False), lambda: run(True))
