"""Plain-JAX attention references for MLA with DSA.

Three implementations share one masking contract and one query-chunking mechanism:
  * `sparse_mla`  -- eq. (2): each query gathers only its k selected latent rows (O(T*k) work and memory
                     O(chunk*k)); this is the semantics the Pallas kernel reproduces.
  * `dense_mqa`   -- absorbed MQA mode over all keys with a [chunk, S] mask (top-k mask optional): a reference.
  * `dense_mha`   -- decompressed per-head MHA mode with the same mask: a reference.
Visibility (causal + same document/segment) is decided by `visible`; selection slots are -1 when empty.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp


def visible(q_index: jnp.ndarray, q_segment: jnp.ndarray, kv_segment: jnp.ndarray) -> jnp.ndarray:
    """[B, C, S] bool: key s is visible to a query at key index q_index iff s <= q_index and segments match."""
    s = jnp.arange(kv_segment.shape[1], dtype=jnp.int32)
    causal = s[None, None, :] <= q_index[:, :, None]
    return causal & (q_segment[:, :, None] == kv_segment[:, None, :])


def topk_to_mask(topk_idx: jnp.ndarray, num_keys: int) -> jnp.ndarray:
    """[B, C, K] selected key indices (-1 / out of range = empty slot) -> [B, C, S] bool selection mask."""
    b, c, _ = topk_idx.shape
    valid = (topk_idx >= 0) & (topk_idx < num_keys)
    idx = jnp.where(valid, topk_idx, num_keys)  # out of bounds -> dropped
    bi = jnp.arange(b)[:, None, None]
    ci = jnp.arange(c)[None, :, None]
    return jnp.zeros((b, c, num_keys), bool).at[bi, ci, idx].set(True, mode="drop")


def map_query_chunks(fn: Callable, chunk: int | None, per_query: tuple, shared: tuple = (), *, remat: bool = True):
    """Applies fn(*per_query_chunk, *shared) over chunks of the query axis (axis 1) with lax.map.

    Bounds memory to one chunk's intermediates, in training too: with remat (default) each chunk is a
    `jax.checkpoint`, so the backward pass saves only the chunk's inputs and recomputes its intermediates (the
    [chunk, H, S] logits of dense attention and eq. 3, the [chunk, k, 576] gathered rows of sparse attention)
    instead of keeping them for every chunk, i.e. O(T * S) or O(T * k * 576) memory. Costs one extra forward of
    fn in the backward. Padded query rows are computed and cropped.
    """
    t = per_query[0].shape[1]
    if chunk is None or t <= chunk:
        return fn(*per_query, *shared)
    n = math.ceil(t / chunk)
    pad = n * chunk - t

    def split(a):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape(a.shape[0], n, chunk, *a.shape[2:]).swapaxes(0, 1)

    def merge(o):
        o = o.swapaxes(0, 1)
        return o.reshape(o.shape[0], n * chunk, *o.shape[3:])[:, :t]

    body = jax.checkpoint(lambda xs, sh: fn(*xs, *sh)) if remat else (lambda xs, sh: fn(*xs, *sh))
    outs = jax.lax.map(lambda xs: body(xs, shared), tuple(split(a) for a in per_query))
    return jax.tree.map(merge, outs)


def shared_across_chunks(x: jnp.ndarray, t: int, chunk: int | None, *, gathered: bool = False) -> jnp.ndarray:
    """`x` (keys every query chunk reads) as the map_query_chunks callers close over it: in float32 when its gradient
    sums over several reads. Reverse mode sums a closed-over operand's cotangent over the chunks in the operand's own
    dtype (the lax.map's carry), and a gather's transpose scatter-adds its rows in their dtype: in bf16 the keys
    that many queries read lost their gradient's precision (sink keys that 2048 queries select: 47% off in one
    chunk, 3.7% over 256 chunks of 8; dense attention's early keys 3.5x the error of one chunk; audit, 2026-12-07).
    Callers read it cast back to the compute dtype (the same values), `gathered` ones after the gather. Float32
    when the T queries make several chunks, or (gathered) when there are several queries; as it is otherwise: a
    decode step (T = 1) converts no cache."""
    several = t > 1 if gathered else chunk is not None and t > chunk
    if not several or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.float32:
        return x
    return x.astype(jnp.float32)


def masked_softmax(logits: jnp.ndarray, valid: jnp.ndarray):
    """Softmax over the last axis restricted to `valid`; rows with no valid entry give zeros (never NaN).

    Returns (probabilities, log-sum-exp); lse is -inf for an empty row.
    """
    logits = jnp.where(valid, logits.astype(jnp.float32), -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(valid, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1)
    safe = jnp.where(denom > 0, denom, 1.0)  # empty rows: no 0/0 and no log(0) in the backward pass
    return p / safe[..., None], jnp.where(denom > 0, jnp.log(safe) + m[..., 0], -jnp.inf)


def gather_rows(kv: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
    """kv [B, S, D], idx [B, C, K] (already clamped in range) -> [B, C, K, D]."""
    return jax.vmap(lambda rows, i: rows[i])(kv, idx)


def sparse_mla(q, kv, topk_idx, scale: float, d_v: int, *, q_chunk: int | None = 64, return_probs: bool = False):
    """Gathered sparse MLA in absorbed MQA mode, eq. (2).

    q [B, T, H, Dqk] (Dqk = kv_lora_rank + rope dim), kv [B, S, Dqk] shared latent rows (value = first d_v dims),
    topk_idx [B, T, K] int (-1 or >= S: empty slot). Returns out [B, T, H, d_v] (q.dtype), lse [B, T, H] f32,
    and with return_probs also the attention probabilities summed over heads [B, T, K] f32 (eq. 4 target).
    No keys (S = 0) or no slots (K = 0): every row is empty (out 0, lse -inf).
    """
    num_keys = kv.shape[1]
    if num_keys == 0 or topk_idx.shape[-1] == 0:
        out = jnp.zeros((*q.shape[:-1], d_v), q.dtype), jnp.full(q.shape[:-1], -jnp.inf, jnp.float32)
        return (*out, jnp.zeros(topk_idx.shape, jnp.float32)) if return_probs else out

    kv_read = shared_across_chunks(kv, q.shape[1], q_chunk, gathered=True)

    def chunk_fn(q_c, idx_c):
        valid = (idx_c >= 0) & (idx_c < num_keys)
        rows = gather_rows(kv_read, jnp.where(valid, idx_c, 0)).astype(kv.dtype)  # [B, C, K, Dqk]
        rows = jnp.where(valid[..., None], rows, 0)  # an empty slot's stand-in row 0 adds no NaN (0 * NaN)
        logits = jnp.einsum("bchd,bckd->bchk", q_c, rows, preferred_element_type=jnp.float32) * scale
        probs, lse = masked_softmax(logits, valid[:, :, None, :])
        out = jnp.einsum("bchk,bckd->bchd", probs.astype(kv.dtype), rows[..., :d_v],
                         preferred_element_type=jnp.float32).astype(q.dtype)
        if return_probs:
            return out, lse, jnp.sum(probs, axis=2)
        return out, lse

    return map_query_chunks(chunk_fn, q_chunk, (q, topk_idx))


def _dense_mask(q_index, q_segment, kv_segment, topk_idx):
    mask = visible(q_index, q_segment, kv_segment)
    if topk_idx is not None:
        mask &= topk_to_mask(topk_idx, kv_segment.shape[1])
    return mask


def dense_mqa(q, kv, q_index, q_segment, kv_segment, scale: float, d_v: int, *, topk_idx=None,
              q_chunk: int | None = 256):
    """Absorbed MQA mode over every key with a dense mask (visibility, and the top-k set if given). Reference.

    q [B, T, H, Dqk], kv [B, S, Dqk] -> out [B, T, H, d_v], lse [B, T, H].
    """
    kv_read = shared_across_chunks(kv, q.shape[1], q_chunk)

    def chunk_fn(q_c, qi_c, qs_c, *idx_c):
        kv_c = kv_read.astype(kv.dtype)
        mask = _dense_mask(qi_c, qs_c, kv_segment, idx_c[0] if idx_c else None)
        logits = jnp.einsum("bchd,bsd->bchs", q_c, kv_c, preferred_element_type=jnp.float32) * scale
        probs, lse = masked_softmax(logits, mask[:, :, None, :])
        out = jnp.einsum("bchs,bsd->bchd", probs.astype(kv.dtype), kv_c[..., :d_v],
                         preferred_element_type=jnp.float32)
        return out.astype(q.dtype), lse

    per_query = (q, q_index, q_segment) + ((topk_idx,) if topk_idx is not None else ())
    return map_query_chunks(chunk_fn, q_chunk, per_query)


def dense_mha(q, k, v, q_index, q_segment, kv_segment, scale: float, *, topk_idx=None, q_chunk: int | None = 256):
    """Decompressed MHA mode: q [B, T, H, Dqk], k [B, S, H, Dqk], v [B, S, H, Dv] with a dense mask. Reference."""
    k_read, v_read = (shared_across_chunks(x, q.shape[1], q_chunk) for x in (k, v))

    def chunk_fn(q_c, qi_c, qs_c, *idx_c):
        mask = _dense_mask(qi_c, qs_c, kv_segment, idx_c[0] if idx_c else None)
        logits = jnp.einsum("bchd,bshd->bchs", q_c, k_read.astype(k.dtype), preferred_element_type=jnp.float32) * scale
        probs, lse = masked_softmax(logits, mask[:, :, None, :])
        out = jnp.einsum("bchs,bshd->bchd", probs.astype(v.dtype), v_read.astype(v.dtype),
                         preferred_element_type=jnp.float32)
        return out.astype(q.dtype), lse

    per_query = (q, q_index, q_segment) + ((topk_idx,) if topk_idx is not None else ())
    return map_query_chunks(chunk_fn, q_chunk, per_query)
