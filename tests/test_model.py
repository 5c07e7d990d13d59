"""Model-level properties on the tiny config: attention paths agree, DSA == dense for short sequences,
causality (no gradient and no value leaks from future tokens), segments, parameter count of 671B."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from flax import nnx

from dsv32_jax import RunOptions, Transformer, load_preset


@pytest.fixture(scope="session")
def tiny():
    cfg = load_preset("tiny").replace(initializer_range=0.2)  # large weights: attention far from uniform
    return Transformer(cfg, rngs=nnx.Rngs(3))


def tokens(rng, b=2, t=40, v=256):
    return jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)


def run(model, toks, **opts):
    model.options = RunOptions(**opts)
    return model(toks, return_aux=True)


def test_sparse_dense_mha_agree_and_selection_is_active(tiny, rng):
    toks = tokens(rng)
    sparse, aux = run(tiny, toks)
    dense_mqa, _ = run(tiny, toks, attention="dense")
    dense_mha, _ = run(tiny, toks, attention="dense", mla_mode="mha")
    no_dsa, _ = run(tiny, toks, dsa=False)
    assert rel_err(dense_mqa, sparse) < 1e-5
    assert rel_err(dense_mha, sparse) < 1e-5
    assert rel_err(no_dsa, sparse) > 1e-2, "40 tokens with index_topk 8: selection must change the output"
    for mtp_a, mtp_b in zip(aux["mtp_logits"], run(tiny, toks, attention="dense")[1]["mtp_logits"]):
        assert rel_err(mtp_a, mtp_b) < 1e-5


def test_short_sequences_equal_dense_attention(tiny, rng):
    toks = tokens(rng, t=tiny.config.index_topk)  # every query sees <= index_topk keys
    assert rel_err(run(tiny, toks)[0], run(tiny, toks, dsa=False)[0]) < 1e-5


def test_a_covering_topk_attends_densely_and_equals_the_gathered_selection(tiny, rng, monkeypatch):
    """index_topk >= S: mqa_attend's sparse path computes eq. 2 as dense attention over the visible keys (no
    [T, k, 576] gather), equal to attention.sparse_mla over the indexer's selection, which is every visible key;
    with S > index_topk it gathers (attention.sparse_mla is called)."""
    from dsv32_jax.model import attention, mla

    layer, k = tiny.layers[0].attn, tiny.config.index_topk
    calls = []
    real = attention.sparse_mla
    monkeypatch.setattr(attention, "sparse_mla", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for t, gathers in ((k, False), (k + 5, True)):
        toks = tokens(rng, t=t)
        x = tiny.layers[0].attn_norm(tiny.embed_tokens(toks))
        pos = tiny.positions(toks)
        c_q, q_nope, q_pe, c_kv, k_pe = layer.latents(x, pos, RunOptions())
        q_i, k_i, w_i = layer.indexer_inputs(x, c_q, pos)
        q_lat = jnp.concatenate([jnp.einsum("bthd,chd->bthc", q_nope, layer.kv_up()[0]), q_pe], -1)
        kv_lat = jnp.concatenate([c_kv, k_pe], -1)
        calls.clear()
        o, aux = mla.mqa_attend(q_lat, q_i, w_i, pos.q_index, pos.q_segment, kv_lat, k_i, pos.kv_segment,
                                cfg=tiny.config, opts=RunOptions())
        assert bool(calls) == gathers, (t, calls)
        gathered, _ = real(q_lat, kv_lat, aux["topk"], tiny.config.softmax_scale, tiny.config.kv_lora_rank)
        assert rel_err(o, gathered) < 1e-5
        if not gathers:  # every visible key selected: key j of query i for j <= i, -1 beyond
            sel = np.sort(np.asarray(aux["topk"]), -1)
            want = np.where(np.arange(t)[None, :] <= np.arange(t)[:, None], np.arange(t)[None, :], -1)
            np.testing.assert_array_equal(sel, np.broadcast_to(np.sort(want, -1), sel.shape))


def test_fp8_kv_cache_simulation(tiny, rng):
    """fp8_kv quantizes the cached latent c_kv (its values become e4m3 codes times a power-of-two scale) and
    perturbs the first layer's attention output by quantization noise only."""
    toks = tokens(rng)
    layer = tiny.layers[0]
    x = layer.attn_norm(tiny.embed_tokens(toks))
    pos = tiny.positions(toks)
    exact = layer.attn(x, pos, RunOptions())[0]
    err = rel_err(layer.attn(x, pos, RunOptions(fp8_kv=True))[0], exact)
    assert 0 < err < 0.1, err
    c_kv = np.asarray(layer.attn.latents(x, pos, RunOptions(fp8_kv=True))[3])
    amax = np.abs(c_kv).max(-1, keepdims=True)
    scale = 2.0 ** np.ceil(np.log2(amax / 448))
    np.testing.assert_array_equal((c_kv / scale).astype(jnp.float8_e4m3fn).astype(np.float32) * scale, c_kv)


def test_fp8_indexer_path(tiny, rng):
    toks = tokens(rng)
    exact, aux_e = run(tiny, toks)
    fp8, aux_f = run(tiny, toks, indexer_fp8=True)
    assert np.all(np.isfinite(np.asarray(fp8)))
    sel_e, sel_f = np.asarray(aux_e["topk"][0]), np.asarray(aux_f["topk"][0])  # layer 0: same inputs
    overlap = np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(sel_e.reshape(-1, 8), sel_f.reshape(-1, 8))])
    print(f"layer-0 selection overlap fp8 vs exact: {overlap:.3f}")
    assert overlap > 0.8


def test_gradient_causality(tiny, rng):
    """d output[t] / d input[s] is exactly zero for every s > t (nanodo's trick), through MLA, DSA and MoE."""
    tiny.options = RunOptions()
    t = 24
    toks = tokens(rng, b=1, t=t)
    pos = tiny.positions(toks)
    h0 = tiny.embed_tokens(toks)
    for q in (3, 11, 17):
        g = jax.grad(lambda h: jnp.sum(tiny.backbone(h, pos)[0][0, q]))(h0)
        g = np.abs(np.asarray(g))[0].sum(-1)
        assert np.all(g[q + 1:] == 0), f"output {q} has gradient from future inputs"
        assert g[q] > 0 and np.count_nonzero(g[: q + 1]) >= min(q + 1, tiny.config.index_topk)


def test_value_causality_through_selection(tiny, rng):
    """Changing future tokens changes neither past logits nor past top-k selections (the selection is
    discrete and detached, so gradients alone could not reveal leakage through it)."""
    tiny.options = RunOptions()
    toks = tokens(rng, b=1)
    other = toks.at[:, 25:].set((toks[:, 25:] + 7) % 256)
    la, aux_a = tiny(toks, return_aux=True)
    lb, aux_b = tiny(other, return_aux=True)
    np.testing.assert_array_equal(np.asarray(la)[:, :25], np.asarray(lb)[:, :25])
    for layer in range(tiny.config.num_hidden_layers):
        np.testing.assert_array_equal(np.asarray(aux_a["topk"][layer])[:, :25], np.asarray(aux_b["topk"][layer])[:, :25])
    assert not np.array_equal(np.asarray(la)[:, 25:], np.asarray(lb)[:, 25:])


@pytest.mark.heavy  # >= 20 s on 2 AMD EPYC cores (2026-12-01): out of make test's 15 minutes
def test_segments_isolate_packed_documents(tiny, rng):
    """Two documents packed in one row give the same logits as each run alone (positions restart)."""
    tiny.options = RunOptions()
    a, b = tokens(rng, b=1, t=19), tokens(rng, b=1, t=21)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.asarray([[0] * 19 + [1] * 21])
    positions = jnp.asarray([list(range(19)) + list(range(21))])
    out = np.asarray(tiny(packed, positions=positions, segment_ids=seg))
    assert rel_err(out[:, :19], tiny(a)) < 1e-5
    assert rel_err(out[:, 19:], tiny(b)) < 1e-5


def test_routing_replay_through_the_model(tiny, rng):
    tiny.options = RunOptions()
    toks = tokens(rng)
    _, aux = tiny(toks, return_aux=True)
    routing = {k: v for k, v in aux["routing"].items() if v is not None}
    assert set(routing) == {1, 2, 3}  # MTP layer = checkpoint layer num_hidden_layers
    _, aux2 = tiny(toks, routing=routing, return_aux=True)
    for k, v in routing.items():
        np.testing.assert_array_equal(np.asarray(aux2["routing"][k]), np.asarray(v))


def test_bad_tokens_are_rejected(tiny):
    with pytest.raises(ValueError, match="vocab_size"):
        tiny(jnp.asarray([[0, 256]], jnp.int32))
    with pytest.raises(ValueError, match="batch, seq"):
        tiny(jnp.asarray([0, 1], jnp.int32))


def count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def test_parameter_count_671b_without_memory():
    cfg = load_preset("deepseek_v32_671b")
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    state = nnx.state(model, nnx.Param)
    main = count(state) - count(nnx.state(model.mtp, nnx.Param))
    indexers = sum(count(nnx.state(layer.attn.indexer, nnx.Param)) for layer in model.layers)
    assert main / 1e9 == pytest.approx(671.88, abs=0.005)
    assert (main - indexers) / 1e9 == pytest.approx(671.03, abs=0.005)
    assert indexers / cfg.num_hidden_layers / 1e6 == pytest.approx(13.96, abs=0.005)
    assert count(nnx.state(model.mtp, nnx.Param)) / 1e9 == pytest.approx(11.62, abs=0.005)
