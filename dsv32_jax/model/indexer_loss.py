"""Indexer training objectives of the two continued-pretraining stages (paper section 2.1.1).

Both return per-query values [B, T] (the trainer masks padding and averages):
  * eq. (3), dense warm-up: p_t = sum_h softmax_h(MLA logits)_t / H over all visible keys (stop-gradient),
    KL(p_t || softmax(I_t)); also the fraction of p_t captured by the indexer's top-k ("captured mass").
  * eq. (4), sparse stage: the same restricted to the selected set S_t: p_t = head-summed sparse attention
    probabilities on S_t, KL(p_t,S || softmax(I_t,S)).
Computed chunked over queries so memory stays O(chunk * S) (dense) or O(chunk * k) (sparse).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv32_jax.model.attention import gather_rows, map_query_chunks, masked_softmax, shared_across_chunks, visible
from dsv32_jax.model.indexer import index_scores, key_block_range, select_topk


def _kl(p: jnp.ndarray, scores: jnp.ndarray, valid: jnp.ndarray) -> jnp.ndarray:
    """KL(p || softmax(scores)) over valid entries of the last axis; 0 for rows with no valid entry.

    Summed as sum_s [p r - q expm1(r)], r = log p - log q, q = softmax(scores): the generalized KL sum p log(p/q) -
    sum p + sum q, equal to the KL for normalized p and q and, unlike sum p log(p/q), insensitive to first order to
    either's normalization error. A float32 p sums to 1 only to ~1e-7, which moves sum p log(p/q) by ~1e-7 per query,
    of the order of the KL itself once the indexer tracks the attention (~1e-4 over a row): measured against a
    float64 oracle at KL ~2e-4, 1.2e-3 to 1.8e-3 relative error that way, 3e-6 to 6e-6 this way (one term: p log p -
    p + q = q when p = 0). Its gradient w.r.t. the scores is q - p - q (sum q - sum p).
    q expm1(r) (= p - q) is taken as p - q where r > 1 (no cancellation there): q underflows to 0 far below the
    row's top scores (log q < -87) while expm1(r) overflows, and their product would be NaN (in the value, or in the
    gradient of the branch not taken where p = 0)."""
    _, log_z = masked_softmax(scores, valid)
    log_q = jnp.where(valid, scores - log_z[..., None], 0.0)
    pos = valid & (p > 0)
    r = jnp.log(jnp.where(pos, p, 1.0)) - log_q
    q = jnp.where(valid, jnp.exp(log_q), 0.0)
    p_minus_q = jnp.where(r > 1.0, p - q, q * jnp.expm1(jnp.minimum(r, 1.0)))
    return jnp.sum(jnp.where(pos, p * r - p_minus_q, q), axis=-1)


def dense_indexer_kl(q_lat, kv_lat, scale: float, q_idx, k_idx, w_idx, q_index, q_segment, kv_segment, topk: int,
                     *, q_chunk: int | None = 64, selection=None):
    """Eq. (3). q_lat [B, T, H, Dqk] / kv_lat [B, S, Dqk]: the MLA queries/keys in MQA mode (teacher, detached);
    q_idx [B, T, H_I, D], k_idx [B, S, D], w_idx [B, T, H_I]: indexer projections. Returns (kl, captured) [B, T].
    captured: the teacher's mass on the indexer's top-k, selected here from the exact scores, or `selection`
    [B, T, k] (key indices, -1 = empty) when given (e.g. the kernels' selection, FP8 with indexer_fp8)."""
    q_lat, kv_lat = jax.lax.stop_gradient(q_lat), jax.lax.stop_gradient(kv_lat)
    k_eff = min(topk, kv_lat.shape[1])
    k_read = shared_across_chunks(k_idx, q_idx.shape[1], q_chunk)  # (the keys' gradient sums in float32)

    def chunk_fn(ql, qi, wi, q_ix, q_seg, *given):
        mask = visible(q_ix, q_seg, kv_segment)
        logits = jnp.einsum("bchd,bsd->bchs", ql, kv_lat, preferred_element_type=jnp.float32) * scale
        probs, _ = masked_softmax(logits, mask[:, :, None, :])
        p = jax.lax.stop_gradient(jnp.mean(probs, axis=2))  # head sum, L1-normalized
        scores = index_scores(qi, k_read.astype(k_idx.dtype), wi)
        sel = given[0] if given else select_topk(jax.lax.stop_gradient(scores), mask, k_eff)
        captured = jnp.sum(jnp.where(sel >= 0, jnp.take_along_axis(p, jnp.maximum(sel, 0), axis=-1), 0.0), axis=-1)
        return _kl(p, scores, mask), captured

    extra = () if selection is None else (selection,)
    return map_query_chunks(chunk_fn, q_chunk, (q_lat, q_idx, w_idx, q_index, q_segment, *extra))


# Keys per block of the selected scores' dense key-gradient (bounds its [B, C, H_I, block] intermediate).
KEY_BLOCK = 4096


def _selected_scores_gathered(qi, wi, k_idx, idx, valid):
    """I_{t,s} = sum_h w_h relu(q_h . k_s) on the selected keys: qi [B, C, H_I, D], wi [B, C, H_I], k_idx [B, S, D],
    idx [B, C, K] (clamped in range), valid [B, C, K] -> [B, C, K] f32 (an invalid slot scores its clamped key;
    callers mask it)."""
    k_sel = gather_rows(k_idx, idx).astype(qi.dtype)  # [B, C, K, D] (keys given in float32: the same values)
    dots = jnp.einsum("bchd,bckd->bchk", qi, k_sel, preferred_element_type=jnp.float32)
    return jnp.einsum("bchk,bch->bck", jax.nn.relu(dots), wi.astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def selected_scores(qi, wi, k_idx, idx, valid, key_grad: str = "dense"):
    """`_selected_scores_gathered` with a backward that never scatters model-dtype rows (key_grad "dense" or
    "segment_sum"; "scatter" is autodiff of the gather, in `sparse_indexer_kl`). Autodiff of the gather transposes it
    into a scatter-add of [B, C, K, D] rows into the keys' gradient: on an H200 that scatter was two thirds of the
    small config's sparse-stage step (6.6 ms per 256 queries at 8K; BENCHMARKS.md, issue 31). Here the key
    gradient is dense over key blocks: the slots' cotangents become a [B, C, S] matrix (one scalar per selected
    pair), dK = sum_{c,h} [q_h . k_s > 0] w_h G[c, s] q_h, two matmuls per block of KEY_BLOCK keys, the same order of
    work as the indexer's dense scores in the forward; only the blocks between the chunk's smallest and largest
    selected key run (a causal step: about half; the others' dK is 0). key_grad "segment_sum": the slots' rows
    v[c, j] = sum_h [q_h . k_j > 0] w_h g[c, j] q_h in float32 ([B, C, K, D], O(T k) work), summed into the keys by
    one flat `segment_sum` over b * (S + 1) rows (invalid slots into a dropped row), the form of the sparse MLA
    backward's dKV reduction, which ran at about HBM speed in the same profile (27.5 ms for 116 GB of float32 rows),
    while autodiff's batched scatter-add of model-dtype rows ran at about 40 GB/s. dq and dw come from the gathered
    keys (no scatter)."""
    return _selected_scores_gathered(qi, wi, k_idx, idx, valid)


def _selected_scores_fwd(qi, wi, k_idx, idx, valid, key_grad):
    return _selected_scores_gathered(qi, wi, k_idx, idx, valid), (qi, wi, k_idx, idx, valid)


def _selected_scores_bwd(key_grad, res, g):
    qi, wi, k_idx, idx, valid = res
    b, c, _ = idx.shape
    s, d = k_idx.shape[1:]
    w32 = wi.astype(jnp.float32)
    g = jnp.where(valid, g, 0.0)  # [B, C, K] f32
    k_sel = gather_rows(k_idx, idx).astype(qi.dtype)
    dots = jnp.einsum("bchd,bckd->bchk", qi, k_sel, preferred_element_type=jnp.float32)
    dw = jnp.einsum("bchk,bck->bch", jax.nn.relu(dots), g)
    a_sel = jnp.where(dots > 0, w32[..., None] * g[:, :, None, :], 0.0)  # d scores / d dots  [B, C, H, K]
    dq = jnp.einsum("bchk,bckd->bchd", a_sel.astype(k_sel.dtype), k_sel, preferred_element_type=jnp.float32)
    if key_grad == "segment_sum":
        rows = jnp.einsum("bchk,bchd->bckd", a_sel.astype(qi.dtype), qi, preferred_element_type=jnp.float32)
        ids = jnp.where(valid, idx, s) + (jnp.arange(b, dtype=idx.dtype) * (s + 1))[:, None, None]
        dk = jax.ops.segment_sum(rows.reshape(-1, d), ids.reshape(-1), num_segments=b * (s + 1))
        dk = dk.reshape(b, s + 1, d)[:, :s]
        return (dq.astype(qi.dtype), dw.astype(wi.dtype), dk.astype(k_idx.dtype), None, None)
    # the slots' cotangents as a dense [B, C, S] matrix: one scalar per (query, selected key); invalid slots add 0
    dense_g = jax.vmap(lambda i, v: jnp.zeros((c, s), jnp.float32).at[jnp.arange(c)[:, None], i].add(v))(idx, g)
    block = min(KEY_BLOCK, s)
    nblk = -(-s // block)
    pad = nblk * block - s
    k_pad = jnp.pad(k_idx, ((0, 0), (0, pad), (0, 0)))
    g_pad = jnp.pad(dense_g, ((0, 0), (0, 0), (0, pad)))
    # the blocks holding a selected key: [first, last) (none when no slot is valid)
    lo = jnp.min(jnp.where(valid, idx, s)).astype(jnp.int32)
    hi = jnp.max(jnp.where(valid, idx + 1, 0)).astype(jnp.int32)
    first, last = key_block_range(lo, hi, block)

    def key_block(j, dk):
        kb = jax.lax.dynamic_slice_in_dim(k_pad, j * block, block, axis=1).astype(qi.dtype)  # [B, block, D]
        gb = jax.lax.dynamic_slice_in_dim(g_pad, j * block, block, axis=2)  # [B, C, block]
        dots_b = jnp.einsum("bchd,bsd->bchs", qi, kb, preferred_element_type=jnp.float32)
        a = jnp.where(dots_b > 0, w32[..., None] * gb[:, :, None, :], 0.0).astype(qi.dtype)
        dk_b = jnp.einsum("bchs,bchd->bsd", a, qi, preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(dk, dk_b, j * block, axis=1)

    dk = jax.lax.fori_loop(first, last, key_block, jnp.zeros((b, nblk * block, d), jnp.float32))[:, :s]
    return (dq.astype(qi.dtype), dw.astype(wi.dtype), dk.astype(k_idx.dtype), None, None)


selected_scores.defvjp(_selected_scores_fwd, _selected_scores_bwd)


def sparse_indexer_kl(head_probs, topk_idx, q_idx, k_idx, w_idx, *, q_chunk: int | None = 64,
                      key_grad: str = "dense"):
    """Eq. (4). head_probs [B, T, K]: sparse attention probabilities summed over heads on the selected slots
    (detached here); topk_idx [B, T, K] (-1 = empty). Indexer scores are recomputed on the selected keys only;
    key_grad (RunOptions.kl_key_grad): "dense" / "segment_sum", their backward is `selected_scores`'; "scatter",
    autodiff of the gather (a scatter-add of key rows, 2.6x slower in the small config's step on an H200)."""
    num_heads_sum = jnp.sum(head_probs, axis=-1, keepdims=True)
    p_all = jax.lax.stop_gradient(head_probs / jnp.where(num_heads_sum > 0, num_heads_sum, 1.0))
    num_keys = k_idx.shape[1]
    # the keys' gradient sums over the chunks in float32 (selected_scores reads float32 keys as the queries' dtype)
    k_read = shared_across_chunks(k_idx, q_idx.shape[1], q_chunk, gathered=True)

    def chunk_fn(p, idx, qi, wi):
        valid = (idx >= 0) & (idx < num_keys)
        if key_grad == "scatter":
            scores = _selected_scores_gathered(qi, wi, k_read, jnp.where(valid, idx, 0), valid)
        else:
            scores = selected_scores(qi, wi, k_read, jnp.where(valid, idx, 0), valid, key_grad)
        return _kl(p, scores, valid)

    return map_query_chunks(chunk_fn, q_chunk, (p_all, topk_idx, q_idx, w_idx))
