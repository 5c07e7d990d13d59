"""Lightning indexer (DSA), eq. (1):  I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s]).

Weights w fold the head scale H_I^-1/2 and the dot scale D_I^-1/2. Two scoring paths:
  * exact   -- float32 dot products (what HF transformers, MaxText and Megatron train with);
  * fp8     -- production path: 128-dim Hadamard rotation, e4m3 codes with power-of-two (ue8m0) scales,
               one scale per (token, head) for q folded into w, one per token for k applied after the head sum.
One top-k selection per query token is shared by every MLA head; empty slots are -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv32_jax.model.attention import map_query_chunks, visible
from dsv32_jax.model.config import ModelConfig, is_int
from dsv32_jax.model.fp8 import act_quant, hadamard_rotate
from dsv32_jax.model.layers import Dense, LayerNorm
from dsv32_jax.model.rope import apply_rope_half, apply_rope_interleaved


def index_scores(q: jnp.ndarray, k: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """Exact eq. (1). q [B, C, H_I, D], k [B, S, D], w [B, C, H_I] (constants folded) -> [B, C, S] float32."""
    # the products as [B, S, C, H_I] (keys-major, heads minor): the head sum is then a reduction over the minor axis
    # and only the [B, S, C] sums are transposed. Computed as [B, C, H_I, S], XLA:GPU transposed all the products to
    # put the heads minor before reducing (BENCHMARKS.md, issue 31: 265 ms of a 755 ms two-layer prefill at 32K on
    # an H200 was that transpose).
    dots = jnp.einsum("bsd,bchd->bsch", k, q, preferred_element_type=jnp.float32)
    return jnp.sum(jax.nn.relu(dots) * w.astype(jnp.float32)[:, None], axis=-1).swapaxes(1, 2)


# Keys per block of `index_scores_in_range`: the selection's exact scores skip the blocks outside a chunk's key range.
SCORE_BLOCK = 2048


def key_block_range(lo, hi, block: int):
    """[first, last): the blocks of `block` keys that meet the key range [lo, hi) (none when it is empty)."""
    return jnp.where(hi > lo, lo // block, 0), jnp.where(hi > lo, (hi + block - 1) // block, 0)


def index_scores_in_range(q: jnp.ndarray, k: jnp.ndarray, w: jnp.ndarray, lo, hi, block: int | None = None):
    """`index_scores` on the blocks of `block` keys that meet [lo, hi) (int32 scalars, e.g. the smallest segment
    start and the largest causal end of a query chunk); the other columns are 0, and callers mask them (they are
    invisible to every query of the chunk). A causal step scores about half the keys: at 32K on an H200 the exact
    scores over every key were 430 of 2,140 ms of a 2-layer kernel step (BENCHMARKS.md, issue 31). For the
    selection only: the loop's trip count depends on the data, so its inputs are detached (no reverse mode)."""
    b, s, _ = k.shape
    block = block or SCORE_BLOCK
    if s <= block:
        return index_scores(q, k, w)
    q, k, w = jax.lax.stop_gradient((q, k, w))
    nblk = -(-s // block)
    k = jnp.pad(k, ((0, 0), (0, nblk * block - s), (0, 0)))
    lo = jnp.clip(jnp.asarray(lo, jnp.int32), 0, s)
    hi = jnp.clip(jnp.asarray(hi, jnp.int32), 0, s)
    first, last = key_block_range(lo, hi, block)

    def key_block(j, out):
        kb = jax.lax.dynamic_slice_in_dim(k, j * block, block, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(out, index_scores(q, kb, w), j * block, axis=2)

    out = jax.lax.fori_loop(first, last, key_block, jnp.zeros((b, q.shape[1], nblk * block), jnp.float32))
    return out[:, :, :s]


def quantize_keys(k: jnp.ndarray):
    """Indexer keys as cached in production: Hadamard-rotated e4m3 codes [B, S, D] and one scale per token [B, S]."""
    k_fp8, k_scale = act_quant(hadamard_rotate(k), block=k.shape[-1])
    return k_fp8, k_scale[..., 0]


def quantize_queries(q: jnp.ndarray, w: jnp.ndarray):
    """Hadamard-rotated e4m3 queries [B, T, H_I, D]; the per-(token, head) scale is folded into w' [B, T, H_I]."""
    q_fp8, q_scale = act_quant(hadamard_rotate(q), block=q.shape[-1])
    return q_fp8, w.astype(jnp.float32) * q_scale[..., 0]


def quantize_indexer(q: jnp.ndarray, k: jnp.ndarray, w: jnp.ndarray):
    """Returns (q_fp8 [B, T, H_I, D], k_fp8 [B, S, D], k_scale [B, S] f32, w' [B, T, H_I] f32)."""
    q_fp8, w_folded = quantize_queries(q, w)
    k_fp8, k_scale = quantize_keys(k)
    return q_fp8, k_fp8, k_scale, w_folded


def index_scores_fp8(q_fp8, k_fp8, k_scale, w_folded) -> jnp.ndarray:
    """FP8 eq. (1) (DeepGEMM fp8_mqa_logits semantics): I = s_k[s] * sum_j w'[t, j] ReLU(q_fp8 . k_fp8)."""
    dots = jnp.einsum("bchd,bsd->bchs", q_fp8.astype(jnp.float32), k_fp8.astype(jnp.float32),
                      preferred_element_type=jnp.float32)
    return jnp.einsum("bchs,bch->bcs", jax.nn.relu(dots), w_folded) * k_scale[:, None, :]


def select_topk(scores: jnp.ndarray, valid: jnp.ndarray, k: int) -> jnp.ndarray:
    """Top-k keys per query among the valid ones; slots beyond the valid count are -1. [B, C, S] -> [B, C, k].
    A NaN score is no candidate (as -inf): lax.top_k ranks NaN first, which cost a slot (-1) per NaN."""
    masked = jnp.where(valid & (scores > -jnp.inf), scores, -jnp.inf)
    vals, idx = jax.lax.top_k(masked, k)
    return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)


def check_query_keys(op: str, q_name: str, k_name: str, q, k, q_layout: str = "[B, T, H, D]"):
    """q [B, T, H, D] and k [B, S, D] of the same B and D, else a ValueError naming them; returns (B, T, H, D, S)."""
    if q.ndim != 4:
        raise ValueError(f"{op}: {q_name} must be {q_layout}, got shape {tuple(q.shape)}")
    b, t, h, d = q.shape
    if k.ndim != 3 or k.shape[0] != b or k.shape[2] != d:
        raise ValueError(f"{op}: {k_name} must be [B, S, D] = [{b}, S, {d}] for {q_name} {tuple(q.shape)}, got "
                         f"shape {tuple(k.shape)}")
    return b, t, h, d, k.shape[1]


def check_topk_args(op: str, q, k, w, q_index, q_segment, kv_segment, topk, *, fp8: bool, q_chunk, k_scale):
    """The argument contract of `indexer_topk` (and of the kernel composition `dsv32_jax.kernels.indexer_topk`):
    a ValueError naming the argument. Without it a kv_segment shorter than k clipped every causal range (a wrong
    selection, no error), [B, 1] query ids broadcast, and e4m3 codes with k_scale but fp8=False were scored as
    unrotated float keys."""
    b, t, h, d, s = check_query_keys(op, "q", "k", q, k, "[B, T, H_I, D]")
    for name, a, want in (("w", w, (b, t, h)), ("q_index", q_index, (b, t)), ("q_segment", q_segment, (b, t)),
                          ("kv_segment", kv_segment, (b, s)), ("k_scale", k_scale, (b, s))):
        if a is not None and tuple(jnp.shape(a)) != want:
            raise ValueError(f"{op}: {name} must have shape {want} for q {tuple(q.shape)} and k {tuple(k.shape)}, "
                             f"got {tuple(jnp.shape(a))}")
    codes = jnp.dtype(k.dtype) == jnp.dtype(jnp.float8_e4m3fn)
    if k_scale is not None and not (fp8 and codes):
        raise ValueError(f"{op}: k_scale goes with fp8=True and k given as e4m3 codes (`quantize_keys`); got fp8={fp8}"
                         f", k {k.dtype}")
    if codes and k_scale is None:
        raise ValueError(f"{op}: k is e4m3 codes ({k.dtype}): pass their k_scale [B, S] and fp8=True")
    if not is_int(topk) or topk < 1:
        raise ValueError(f"{op}: topk must be an integer >= 1, got {topk!r}")
    if q_chunk is not None and (not is_int(q_chunk) or q_chunk < 1):
        raise ValueError(f"{op}: q_chunk must be None or an integer >= 1, got {q_chunk!r}")


def indexer_topk(q, k, w, q_index, q_segment, kv_segment, topk: int, *, fp8: bool = False,
                 q_chunk: int | None = 128, k_scale=None) -> jnp.ndarray:
    """Scores eq. (1) and selects k = min(topk, S) keys per query, chunked over queries so that at most
    chunk x S scores are live. Causal/segment mask before selection, -1 for selected-but-invisible slots.

    With fp8, k may be given already quantized (codes from `quantize_keys`, e.g. a decode cache) with k_scale.
    No keys (S = 0) or no queries (T = 0) give an empty [B, T, min(topk, S)]."""
    check_topk_args("indexer_topk", q, k, w, q_index, q_segment, kv_segment, topk, fp8=fp8, q_chunk=q_chunk,
                    k_scale=k_scale)
    num_keys = k.shape[1]
    k_eff = min(topk, num_keys)
    if k_eff == 0 or q.shape[1] == 0:
        return jnp.full((q.shape[0], q.shape[1], k_eff), -1, jnp.int32)
    if fp8:
        q, w = quantize_queries(q, w)
        if k_scale is None:
            k, k_scale = quantize_keys(k)

    def chunk_fn(q_c, w_c, qi_c, qs_c):  # exact scores: only the key blocks up to the chunk's last causal key
        scores = (index_scores_fp8(q_c, k, k_scale, w_c) if fp8 else
                  index_scores_in_range(q_c, k, w_c, 0, jnp.max(qi_c).astype(jnp.int32) + 1))
        return select_topk(scores, visible(qi_c, qs_c, kv_segment), k_eff)

    return map_query_chunks(chunk_fn, q_chunk, (q, w, q_index, q_segment))


class Indexer(nnx.Module):
    """Lightning-indexer parameters: wq_b from the MLA query latent c_q, wk + LayerNorm from x, fp32 weights_proj."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        h, d = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Dense(cfg.q_lora_rank, h * d, ("q_lora", "index_heads"), rngs=rngs, dtype=dtype,
                          param_dtype=param_dtype, std=cfg.initializer_range)
        self.wk = Dense(cfg.hidden_size, d, ("embed", None), rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                        std=cfg.initializer_range)
        self.k_norm = LayerNorm(d, eps=1e-6, param_dtype=param_dtype)
        self.weights_proj = Dense(cfg.hidden_size, h, ("embed", None), rngs=rngs, dtype=jnp.float32,
                                  param_dtype=jnp.float32, std=cfg.initializer_range)
        self.n_heads, self.head_dim, self.rope_dim = h, d, cfg.qk_rope_head_dim
        self.rope = apply_rope_interleaved if cfg.indexer_rope_interleave else apply_rope_half

    def project(self, x: jnp.ndarray, c_q: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray):
        """x [B, T, D_model], c_q [B, T, q_lora] -> q [B, T, H_I, D], k [B, T, D], w [B, T, H_I] (f32).

        RoPE goes on the FIRST rope_dim dims of q and k ([rope | nope], opposite of MLA).
        """
        b, t, _ = x.shape
        r = self.rope_dim
        q = self.wq_b(c_q).reshape(b, t, self.n_heads, self.head_dim)
        q = jnp.concatenate([self.rope(q[..., :r], cos[:, :, None], sin[:, :, None]), q[..., r:]], axis=-1)
        k = self.k_norm(self.wk(x))
        k = jnp.concatenate([self.rope(k[..., :r], cos, sin), k[..., r:]], axis=-1)
        w = self.weights_proj(x.astype(jnp.float32)) * (self.n_heads**-0.5 * self.head_dim**-0.5)
        return q, k, w
