"""Tests closing the gaps found by mutation testing round 6 of the model library (runs/mut6/log.tsv).

Every expected value comes from an independent source: float64 numpy written here from reference_spec.md and the
paper's equations, or a contract stated in a docstring. Each test names the mutant(s) it guards."""

import math
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import rel_err

from dsv32_jax import load_preset
from dsv32_jax.model.rope import apply_rope_half, apply_rope_interleaved, rope_angles


def numpy_yarn_inv_freq(dim, base, factor, orig, beta_fast, beta_slow):
    """reference_spec.md section 3, float64: base frequencies, the YaRN ramp between low and high."""
    f = 1.0 / base ** (np.arange(0, dim, 2) / dim)

    def corr(r):
        return dim * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    smooth = 1 - ramp
    return f / factor * (1 - smooth) + f * smooth


def hf_yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# --------------------------------------------------------------------------------------------------- RoPE


def test_rope_angles_scale_both_cos_and_sin_by_the_attention_factor(rng):
    """`rope_angles(p, f, a)` = (a cos(p f), a sin(p f)) (its docstring: the magnitude factor multiplies both).
    Mutant r06: the factor dropped from sin (every DeepSeek config has a = 1, so the HF parity cannot see it)."""
    inv = rng.uniform(1e-3, 1.0, 4).astype(np.float32)
    pos = jnp.asarray(rng.integers(0, 50, (2, 5)), jnp.int32)
    cos, sin = rope_angles(pos, inv, attention_factor=1.7)
    ang = np.asarray(pos, np.float64)[..., None] * inv.astype(np.float64)
    np.testing.assert_allclose(np.asarray(cos), 1.7 * np.cos(ang), atol=2e-5)
    np.testing.assert_allclose(np.asarray(sin), 1.7 * np.sin(ang), atol=2e-5)


def test_model_positions_use_the_yarn_table_and_attention_factor():
    """Transformer.positions on a YaRN config whose mscale differs from mscale_all_dim (HF's attention_factor =
    mscale(s, mscale) / mscale(s, mscale_all_dim) != 1): cos / sin = factor * cos / sin(p f'_i), with f' the spec's
    YaRN table in float64. Mutant t06: `rope_angles(positions, yarn_inv_freq(cfg))` without the factor."""
    from dsv32_jax import Transformer

    cfg = load_preset("tiny").replace(rope_mscale=0.5, rope_mscale_all_dim=1.0)
    want_factor = hf_yarn_mscale(cfg.rope_factor, 0.5) / hf_yarn_mscale(cfg.rope_factor, 1.0)
    assert abs(want_factor - 1) > 0.05
    fake = types.SimpleNamespace(config=cfg)  # positions() reads only self.config
    toks = jnp.zeros((1, 9), jnp.int32)
    given = jnp.asarray([[0, 3, 7, 20, 63, 64, 100, 500, 2000]], jnp.int32)
    pos = Transformer.positions(fake, toks, positions=given)
    f = numpy_yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor,
                            cfg.rope_original_max_position_embeddings, cfg.rope_beta_fast, cfg.rope_beta_slow)
    ang = np.asarray(given, np.float64)[..., None] * f
    np.testing.assert_allclose(np.asarray(pos.cos), want_factor * np.cos(ang), atol=5e-5)
    np.testing.assert_allclose(np.asarray(pos.sin), want_factor * np.sin(ang), atol=5e-5)
    np.testing.assert_array_equal(np.asarray(pos.q_index), np.arange(9)[None])


@pytest.mark.parametrize("rope", [apply_rope_interleaved, apply_rope_half])
def test_rope_keeps_a_bf16_input_in_bf16(rope, rng):
    """Both layouts return x's dtype (computed in float32, cast back, as every layer of the model does): a bf16
    model's q_pe / k_pe stay bf16, the dtype the latents, the cache and the kernels are built for. The values are
    the spec's rotation in float64, rounded once to bf16. Mutants r09 / r11: the final `.astype(x.dtype)` dropped
    (interleaved / rotate-half): a float32 q_pe promotes the whole MLA query to float32."""
    x = rng.standard_normal((3, 8)).astype(ml_dtypes.bfloat16)
    theta = rng.uniform(-3, 3, 4)
    out = rope(jnp.asarray(x), jnp.asarray(np.cos(theta), jnp.float32), jnp.asarray(np.sin(theta), jnp.float32))
    assert out.dtype == jnp.bfloat16
    xf = x.astype(np.float64)
    if rope is apply_rope_interleaved:
        z = (xf[:, 0::2] + 1j * xf[:, 1::2]) * np.exp(1j * theta)
        want = np.stack([z.real, z.imag], -1).reshape(3, 8)
    else:
        z = (xf[:, :4] + 1j * xf[:, 4:]) * np.exp(1j * theta)
        want = np.concatenate([z.real, z.imag], -1)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=0.02, rtol=0.01)


# ------------------------------------------------------------------------------------ DSA in MQA mode (eq. 1-4)


def _np_softmax(x, valid):
    x = np.where(valid, x, -np.inf)
    m = np.max(x, -1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(valid, np.exp(x - m), 0.0)
    d = e.sum(-1, keepdims=True)
    return e / np.where(d > 0, d, 1.0)


def _np_kl(p, logits, valid):
    q = _np_softmax(logits, valid)
    pos = valid & (p > 0)
    return np.sum(np.where(pos, p * (np.log(np.where(pos, p, 1)) - np.log(np.where(pos, q, 1))), 0), -1)


def _dsa_inputs(rng, cfg, b=2, t=13):
    """MQA-mode operands of one layer on the tiny config: two packed documents per row (segments 1 then 2)."""
    h, dqk, hi, di = cfg.num_attention_heads, cfg.kv_latent_dim, cfg.index_n_heads, cfg.index_head_dim
    q_lat = rng.standard_normal((b, t, h, dqk)) * 0.6
    kv_lat = rng.standard_normal((b, t, dqk))
    q_i = rng.standard_normal((b, t, hi, di))
    k_i = rng.standard_normal((b, t, di))
    w_i = rng.standard_normal((b, t, hi)) * 0.5
    seg = np.ones((b, t), np.int32)
    seg[0, 5:] = 2
    seg[1, 9:] = 2
    return q_lat, kv_lat, q_i, k_i, w_i, seg


def _np_dsa(q_i, k_i, w_i, seg, k):
    """float64 eq. (1) scores, visibility (s <= t, same segment), top-k sets (-1 past the visible count)."""
    b, t = seg.shape
    scores = np.einsum("bthd,bsd->bths", q_i, k_i)
    scores = np.einsum("bths,bth->bts", np.maximum(scores, 0), w_i)  # eq. 1: ReLU, weighted head sum
    vis = (np.arange(t)[None, None, :] <= np.arange(t)[None, :, None]) & (seg[:, :, None] == seg[:, None, :])
    sets = np.full((b, t, k), -1)
    for bi in range(b):
        for ti in range(t):
            cand = np.flatnonzero(vis[bi, ti])
            top = cand[np.argsort(-scores[bi, ti, cand])][:k]
            sets[bi, ti, :len(top)] = top
    return scores, vis, sets


def _yarn_softmax_scale(cfg):
    """reference_spec.md section 3: qk_head_dim^-1/2 * m^2, m = 0.1 mscale_all_dim ln(factor) + 1 (YaRN on)."""
    m = 0.1 * cfg.rope_mscale_all_dim * math.log(cfg.rope_factor) + 1.0
    return (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * m * m


def test_mqa_attend_sparse_stage_matches_a_float64_model_of_eq_1_2_4(rng):
    """`mqa_attend` with DSA and the sparse objective (attention="sparse", indexer_loss="sparse") on random
    operands of the tiny config against float64 numpy: the selection (eq. 1 top-k over the causal, same-document
    keys, -1 slots where fewer than k are visible), the output (eq. 2: softmax over the selected latent rows with
    the YaRN softmax scale, value = the first kv_lora_rank dims) and the KL (eq. 4: the head-summed attention on
    the selected set, L1-normalized, against softmax of the indexer scores on that set). Mutant m16: the eq. 4
    target passed through a softmax in `mqa_attend` (the KL functions' own tests call them directly, so only a
    test through `mqa_attend` sees what it hands them)."""
    from dsv32_jax import RunOptions
    from dsv32_jax.model.mla import mqa_attend

    cfg = load_preset("tiny")
    k = cfg.index_topk
    q_lat, kv_lat, q_i, k_i, w_i, seg = _dsa_inputs(rng, cfg)
    b, t = seg.shape
    idx = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    j = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    opts = RunOptions(attention="sparse", dsa=True, indexer_loss="sparse", attn_chunk=5, index_chunk=5)
    o_lat, aux = jax.jit(lambda *a: mqa_attend(*a, cfg=cfg, opts=opts))(
        j(q_lat), j(q_i), j(w_i), jnp.asarray(idx), jnp.asarray(seg), j(kv_lat), j(k_i), jnp.asarray(seg))

    scores, _, sets = _np_dsa(q_i, k_i, w_i, seg, k)
    got_sets = np.sort(np.where(np.asarray(aux["topk"]) < 0, 10**6, np.asarray(aux["topk"])), -1)
    np.testing.assert_array_equal(got_sets, np.sort(np.where(sets < 0, 10**6, sets), -1))

    valid = sets >= 0
    safe = np.where(valid, sets, 0)
    rows = np.take_along_axis(kv_lat[:, None], safe[..., None], axis=2)  # [B, T, K, Dqk]
    logits = np.einsum("bthd,btkd->bthk", q_lat, rows) * _yarn_softmax_scale(cfg)
    probs = _np_softmax(logits, valid[:, :, None, :])
    out = np.einsum("bthk,btkd->bthd", probs, rows[..., :cfg.kv_lora_rank])
    assert rel_err(o_lat, out) < 1e-4
    p = probs.sum(2) / cfg.num_attention_heads
    sel_scores = np.take_along_axis(scores, safe, -1)
    kl = _np_kl(p, sel_scores, valid)
    assert kl.max() > 0.05  # the indexer is far from the attention: a real signal to compare
    assert rel_err(aux["indexer_kl"], kl) < 1e-3


def test_attention_lse_is_the_natural_log_sum_exp_of_the_scaled_logits(rng):
    """sparse_mla and dense_mqa return lse [B, T, H] = log sum_s exp(scale q . k_s) over the valid / visible keys
    (natural log; -inf for a row with none), what the kernels' backward and the chunk-merging callers consume.
    float64 numpy, with logits large enough (|scale q.k| ~ 30) that a missing max shift is visible. Mutant a04:
    the row max not added back (`jnp.log(safe)` alone)."""
    from dsv32_jax.model.attention import dense_mqa, sparse_mla

    b, t, h, d = 1, 5, 2, 8
    q = rng.standard_normal((b, t, h, d)) * 4
    kv = rng.standard_normal((b, t, d)) * 2
    idx = np.array([[[0, -1, -1], [1, 0, -1], [2, 0, 1], [3, 1, -1], [4, 2, 0]]], np.int32)
    j = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    _, lse = sparse_mla(j(q), j(kv), jnp.asarray(idx), 0.7, 4, q_chunk=None)
    valid = idx >= 0
    rows = kv[0][np.where(valid, idx, 0)[0]][None]
    logits = np.where(valid[:, :, None, :], np.einsum("bthd,btkd->bthk", q, rows) * 0.7, -np.inf)
    m = logits.max(-1, keepdims=True)
    want = (np.log(np.exp(logits - m).sum(-1, keepdims=True)) + m)[..., 0]
    assert np.abs(want).max() > 10
    np.testing.assert_allclose(np.asarray(lse), want, rtol=1e-5, atol=1e-4)
    zeros = jnp.zeros((b, t), jnp.int32)
    _, lse_d = dense_mqa(j(q), j(kv), jnp.asarray(np.arange(t)[None], jnp.int32), zeros, zeros, 0.7, 4, q_chunk=None)
    causal = np.tril(np.ones((t, t), bool))[None, :, None, :]
    full = np.where(causal, np.einsum("bthd,bsd->bths", q, kv) * 0.7, -np.inf)
    m = full.max(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(lse_d), (np.log(np.exp(full - m).sum(-1, keepdims=True)) + m)[..., 0],
                               rtol=1e-5, atol=1e-4)


def test_kernel_entry_point_reference_impl_uses_the_given_softmax_scale(rng):
    """`dsv32_jax.kernels.sparse_mla(..., impl="reference")` (what attention="kernel" runs on a CPU, and the kernels'
    fallback) is eq. 2 with the caller's `scale` (the model passes the YaRN-corrected softmax_scale, not
    Dqk^-1/2): out and the head-summed probabilities against float64 numpy. Mutant k06: the reference branch
    called with `q.shape[-1] ** -0.5` (the kernel tests compare the kernels with `attention.sparse_mla` directly,
    never through this branch)."""
    from dsv32_jax import kernels

    b, t, h, d, s, d_v = 1, 3, 2, 10, 6, 8
    q = rng.standard_normal((b, t, h, d)) * 2
    kv = rng.standard_normal((b, s, d))
    idx = np.array([[[0, -1, 2], [1, 0, 5], [3, 4, 0]]], np.int32)
    out, _, probs = kernels.sparse_mla(jnp.asarray(q, jnp.float32), jnp.asarray(kv, jnp.float32), jnp.asarray(idx),
                                       0.9, d_v, impl="reference", return_probs=True)
    valid = idx >= 0
    rows = kv[0][np.where(valid, idx, 0)[0]][None]
    p = _np_softmax(np.einsum("bthd,btkd->bthk", q, rows) * 0.9, valid[:, :, None, :])
    np.testing.assert_allclose(np.asarray(out), np.einsum("bthk,btkd->bthd", p, rows[..., :d_v]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(probs), p.sum(2), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- norms


@pytest.mark.parametrize("scale", [1e-3, 1.0])
def test_rms_norm_matches_the_formula_with_its_epsilon(rng, scale):
    """RMSNorm = w * x * rsqrt(mean(x^2) + eps) (its docstring), float64; at x ~ 1e-3 the mean square is of eps's
    order (1e-6, every DeepSeek config), where eps changes the output by ~40%. Mutant y01: eps dropped."""
    from dsv32_jax.model.layers import RMSNorm

    x = rng.standard_normal((3, 16)) * scale
    w = rng.uniform(0.5, 1.5, 16)
    norm = RMSNorm(16, 1e-6, param_dtype=jnp.float32)
    norm.scale[...] = jnp.asarray(w, jnp.float32)
    want = w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x, jnp.float32)), np.float64), want, rtol=2e-5, atol=1e-7)


def test_rms_norm_casts_back_to_the_input_dtype(rng):
    """RMSNorm is "computed in float32 and cast back to the input dtype" (its docstring): a bf16 input gives a
    bf16 output, the float64 formula rounded once. Mutant y04: the final cast dropped (a float32 result, which
    turns every later bf16 activation of the block into float32)."""
    from dsv32_jax.model.layers import RMSNorm

    x = rng.standard_normal((3, 16)).astype(ml_dtypes.bfloat16)
    norm = RMSNorm(16, 1e-6, param_dtype=jnp.float32)
    out = norm(jnp.asarray(x))
    assert out.dtype == jnp.bfloat16
    xf = x.astype(np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float64), xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + 1e-6),
                               rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------------------ MoE


def test_local_experts_ignore_tokens_routed_to_experts_below_the_shard():
    """`ragged_experts(..., first_expert=f)` (one expert-parallel shard: experts [f, f + E_local)) adds only the
    assignments to its own experts; ids below f (another shard's experts) contribute zero, as ids above do (the
    contract of `_grouped_swiglu`: "others contribute zero"). float64 per-token loop. Mutant o11: the sort keeps
    `local < num_local` only, so an id below the shard (negative local id) lands in an expert's group."""
    from dsv32_jax.model.moe import ragged_experts

    rng = np.random.default_rng(11)
    n, d, i, e_local, first = 6, 8, 4, 2, 2
    x = rng.standard_normal((n, d))
    ids = np.array([[0, 2], [3, 1], [2, 3], [1, 0], [4, 5], [3, 0]], np.int32)  # experts 0..5; this shard: 2, 3
    wts = rng.uniform(0.2, 1.0, ids.shape)
    wg, wu, wd = rng.standard_normal((e_local, d, i)), rng.standard_normal((e_local, d, i)), rng.standard_normal((e_local, i, d))
    got = ragged_experts(*(jnp.asarray(a, jnp.float32) for a in (x,)), jnp.asarray(ids), jnp.asarray(wts, jnp.float32),
                         *(jnp.asarray(a, jnp.float32) for a in (wg, wu, wd)), jnp.asarray(first, jnp.int32))
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    want = np.zeros((n, d))
    for t in range(n):
        for j, e in enumerate(ids[t]):
            if first <= e < first + e_local:
                le = e - first
                want[t] += wts[t, j] * (silu(x[t] @ wg[le]) * (x[t] @ wu[le])) @ wd[le]
    assert rel_err(got, want) < 1e-5


def _np_group_limited_route(logits, bias, n_group, topk_group, k, scaling):
    """DeepSeek-V3 noaux_tc routing in float64 (reference_spec.md): sigmoid scores; score + bias ranks the groups
    (sum of each group's top 2) and, within the topk_group best groups only, the experts; the weights are the
    chosen experts' unbiased scores, normalized, times the scaling factor. Returns (sorted ids, their weights)."""
    s = 1 / (1 + np.exp(-logits))
    choice = s + bias
    n, e = choice.shape
    size = e // n_group
    ids, weights = [], []
    for i in range(n):
        g = choice[i].reshape(n_group, size)
        best = np.argsort(-np.sort(g, -1)[:, -2:].sum(-1), kind="stable")[:topk_group]
        cand = np.concatenate([np.arange(grp * size, (grp + 1) * size) for grp in best])
        top = np.sort(cand[np.argsort(-choice[i, cand], kind="stable")[:k]])
        ids.append(top)
        weights.append(s[i, top] / s[i, top].sum() * scaling)
    return np.array(ids), np.array(weights)


def test_group_limited_routing_with_negative_biased_scores(rng):
    """`route` when score + bias is negative for every expert (a load-balancing bias that has pushed all experts
    down; the bias only shifts the selection): the experts of the groups not kept must rank below every kept one,
    whatever the sign of the kept scores. float64 oracle of the group-limited selection. Mutant o13: the dropped
    groups filled with 0.0 instead of -inf (then they win over negative kept scores)."""
    from dsv32_jax.model.moe import route

    cfg = load_preset("tiny").replace(n_routed_experts=16, num_experts_per_tok=4)  # 4 groups of 4, keep 2
    logits = rng.standard_normal((32, 16)) * 2
    bias = -2.0 + rng.standard_normal(16) * 0.3
    w, ids = route(jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32), cfg)
    order = np.argsort(np.asarray(ids), -1)
    ids_s, w_s = np.take_along_axis(np.asarray(ids), order, -1), np.take_along_axis(np.asarray(w), order, -1)
    want_ids, want_w = _np_group_limited_route(logits, bias, cfg.n_group, cfg.topk_group, 4, cfg.routed_scaling_factor)
    np.testing.assert_array_equal(ids_s, want_ids)
    np.testing.assert_allclose(w_s, want_w, rtol=1e-5)


# ----------------------------------------------------------------------------------- transformer bookkeeping


def test_decode_cache_room_admits_a_write_that_fills_the_last_slot():
    """`_check_cache_room`: slots [index, index + T) must lie in a cache of `length` slots (its docstring), so a
    write ending exactly at the last slot is allowed and one slot further is not; a negative start is refused.
    Mutant t09: `start + num_tokens >= length` (a prompt + generation that exactly fills the cache refused)."""
    from dsv32_jax.model.transformer import _check_cache_room

    _check_cache_room(2, 3, 5)
    _check_cache_room(4, 1, 5)
    _check_cache_room(0, 5, 5)
    for index, t in ((2, 4), (5, 1), (-1, 1)):
        with pytest.raises(ValueError, match="cache"):
            _check_cache_room(index, t, 5)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_a_frequent_token_s_embedding_gradient_is_summed_in_float32(param_dtype):
    """A bf16 model's embedding gradient: the lookup's transpose scatter-added every occurrence of a token in bf16,
    so once the running sum was ~256 contributions large the next ones rounded away (a token seen 2040 times: its
    row's gradient 50% off, silently; audit 2026-12-07). Now each id's rows are summed in float32 and rounded once:
    within bf16 rounding (< 1e-2) of the float64 sum, for float32 and bfloat16 parameters; rare tokens too."""
    from flax import nnx

    from dsv32_jax import RunOptions, Transformer

    cfg = load_preset("tiny")
    tokens = jnp.asarray(np.r_[np.full(2040, 7), np.arange(8)].reshape(8, 256), jnp.int32)
    cot = np.random.default_rng(0).normal(size=(8, 256, cfg.hidden_size)) * 1e-3 + 1e-3
    model = Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=param_dtype,
                        options=RunOptions(dsa=False))
    grad = nnx.grad(lambda m: jnp.sum(m.embed_tokens(tokens).astype(jnp.float32) * jnp.asarray(cot, jnp.float32)))(
        model)["embed"][...]
    assert grad.dtype == param_dtype
    flat = np.asarray(tokens).ravel()
    for token in (7, 3):  # 2040 occurrences; one
        want = cot.reshape(-1, cfg.hidden_size)[flat == token].sum(0)
        assert rel_err(np.asarray(grad[token], np.float64), want) < 1e-2, token
    assert not np.any(np.asarray(grad[8:], np.float32))  # ids never seen: no gradient
