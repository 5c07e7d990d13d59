"""Indexer training objectives of the two continued-pretraining stages (paper section 2.1.1).

Both return per-query values [B, T] (the trainer masks padding and averages):
  * eq. (3), dense warm-up: p_t = sum_h softmax_h(MLA logits)_t / H over all visible keys (stop-gradient),
    KL(p_t || softmax(I_t)); also the fraction of p_t captured by the indexer's top-k ("captured mass").
  * eq. (4), sparse stage: the same restricted to the selected set S_t: p_t = head-summed sparse attention
    probabilities on S_t, KL(p_t,S || softmax(I_t,S)).
Computed chunked over queries so memory stays O(chunk * S) (dense) or O(chunk * k) (sparse).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv32_jax.model.attention import gather_rows, map_query_chunks, masked_softmax, visible
from dsv32_jax.model.indexer import index_scores, select_topk


def _kl(p: jnp.ndarray, scores: jnp.ndarray, valid: jnp.ndarray) -> jnp.ndarray:
    """sum_s p (log p - log softmax(scores)) over valid entries of the last axis; 0 for rows with no valid entry."""
    _, log_z = masked_softmax(scores, valid)
    log_q = jnp.where(valid, scores - log_z[..., None], 0.0)
    log_p = jnp.log(jnp.where(valid & (p > 0), p, 1.0))
    return jnp.sum(jnp.where(valid & (p > 0), p * (log_p - log_q), 0.0), axis=-1)


def dense_indexer_kl(q_lat, kv_lat, scale: float, q_idx, k_idx, w_idx, q_index, q_segment, kv_segment, topk: int,
                     *, q_chunk: int | None = 64, selection=None):
    """Eq. (3). q_lat [B, T, H, Dqk] / kv_lat [B, S, Dqk]: the MLA queries/keys in MQA mode (teacher, detached);
    q_idx [B, T, H_I, D], k_idx [B, S, D], w_idx [B, T, H_I]: indexer projections. Returns (kl, captured) [B, T].
    captured: the teacher's mass on the indexer's top-k, selected here from the exact scores, or `selection`
    [B, T, k] (key indices, -1 = empty) when given (e.g. the kernels' selection, FP8 with indexer_fp8)."""
    q_lat, kv_lat = jax.lax.stop_gradient(q_lat), jax.lax.stop_gradient(kv_lat)
    k_eff = min(topk, kv_lat.shape[1])

    def chunk_fn(ql, qi, wi, q_ix, q_seg, *given):
        mask = visible(q_ix, q_seg, kv_segment)
        logits = jnp.einsum("bchd,bsd->bchs", ql, kv_lat, preferred_element_type=jnp.float32) * scale
        probs, _ = masked_softmax(logits, mask[:, :, None, :])
        p = jax.lax.stop_gradient(jnp.mean(probs, axis=2))  # head sum, L1-normalized
        scores = index_scores(qi, k_idx, wi)
        sel = given[0] if given else select_topk(jax.lax.stop_gradient(scores), mask, k_eff)
        captured = jnp.sum(jnp.where(sel >= 0, jnp.take_along_axis(p, jnp.maximum(sel, 0), axis=-1), 0.0), axis=-1)
        return _kl(p, scores, mask), captured

    extra = () if selection is None else (selection,)
    return map_query_chunks(chunk_fn, q_chunk, (q_lat, q_idx, w_idx, q_index, q_segment, *extra))


def sparse_indexer_kl(head_probs, topk_idx, q_idx, k_idx, w_idx, *, q_chunk: int | None = 64):
    """Eq. (4). head_probs [B, T, K]: sparse attention probabilities summed over heads on the selected slots
    (detached here); topk_idx [B, T, K] (-1 = empty). Indexer scores are recomputed on the selected keys only."""
    num_heads_sum = jnp.sum(head_probs, axis=-1, keepdims=True)
    p_all = jax.lax.stop_gradient(head_probs / jnp.where(num_heads_sum > 0, num_heads_sum, 1.0))
    num_keys = k_idx.shape[1]

    def chunk_fn(p, idx, qi, wi):
        valid = (idx >= 0) & (idx < num_keys)
        k_sel = gather_rows(k_idx, jnp.where(valid, idx, 0))  # [B, C, K, D]
        dots = jnp.einsum("bchd,bckd->bchk", qi, k_sel, preferred_element_type=jnp.float32)
        scores = jnp.einsum("bchk,bch->bck", jax.nn.relu(dots), wi.astype(jnp.float32))
        return _kl(p, scores, valid)

    return map_query_chunks(chunk_fn, q_chunk, (p_all, topk_idx, q_idx, w_idx))
