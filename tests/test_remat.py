"""Rematerialization: per-block `RunOptions.remat` policies and the query-chunk remat of `map_query_chunks` change
what the backward pass keeps (checked with JAX's saved-residual analysis, independent of the backend), never the
values or gradients (fp32, relative error <= 1e-5 against no remat)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from dsv32_jax.model.attention import map_query_chunks, sparse_mla
from dsv32_jax.model.config import load_preset
from dsv32_jax.model.transformer import Transformer, _block_call
from dsv32_jax.model.options import REMAT_POLICIES, RunOptions
from dsv32_jax.train.optimizer import trainable_filter
from dsv32_jax.train.steps import LossWeights, lm_objective

STAGE_OPTIONS = {
    "warmup": dict(dsa=False, attention="dense", indexer_loss="dense"),
    "sparse": dict(attention="sparse", indexer_loss="sparse"),
}


def _residual_bytes(fn, *args) -> int:
    return sum(a.size * a.dtype.itemsize for a, desc in saved_residuals(fn, *args) if "from the argument" not in desc)


def _batch(rng, cfg, b=2, t=24):
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    seg = np.ones((b, t), np.int32)
    seg[1, 10:] = 2  # two packed documents in row 1
    pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    pos[1, 10:] -= 10
    return {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1), "segment_ids": jnp.asarray(seg),
            "positions": jnp.asarray(pos), "loss_mask": jnp.ones((b, t), jnp.float32)}


@pytest.mark.parametrize("stage,policies", [pytest.param("warmup", REMAT_POLICIES[1:], marks=pytest.mark.heavy),
                                            pytest.param("sparse", ("full",), marks=pytest.mark.heavy),  # 28 s
                                            pytest.param("sparse", REMAT_POLICIES[2:], marks=pytest.mark.slow)])
def test_block_remat_policies_keep_loss_and_gradients(rng, stage, policies):
    cfg = load_preset("tiny").replace(num_hidden_layers=2, index_topk=6)
    batch = _batch(rng, cfg)

    def grads(policy):
        model = Transformer(cfg, rngs=nnx.Rngs(0), options=RunOptions(**STAGE_OPTIONS[stage], remat=policy,
                                                                     attn_chunk=8, index_chunk=8))
        fn = nnx.grad(lambda m: lm_objective(m, batch, stage=stage, weights=LossWeights(), model_cfg=cfg),
                      argnums=nnx.DiffState(0, trainable_filter(stage)), has_aux=True)
        g, (metrics, _, _) = jax.jit(fn)(model)
        return jax.tree.leaves(nnx.to_pure_dict(g)), float(metrics["loss"])

    ref, ref_loss = grads("none")
    for policy in policies:  # the sparse stage's "dots" policies are slow-marked (make test-slow)
        got, loss = grads(policy)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), policy
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            assert rel_err(a, b) <= 1e-5, policy


def test_full_block_remat_keeps_only_the_block_input(rng):
    cfg = load_preset("tiny").replace(num_hidden_layers=1)
    t = 32
    h = jnp.asarray(rng.standard_normal((1, t, cfg.hidden_size)), jnp.float32)

    def saved(policy):
        opts = RunOptions(remat=policy, indexer_loss="sparse", attn_chunk=8, index_chunk=8)
        model = Transformer(cfg, rngs=nnx.Rngs(0), options=opts)
        graphdef, state = nnx.split(model.layers[0])
        pos = model.positions(jnp.zeros((1, t), jnp.int32))

        def f(state, h):
            out, aux = _block_call(policy)(nnx.merge(graphdef, state), h, pos, opts, None, None)
            return jnp.sum(out) + jnp.sum(aux["indexer_kl"])

        return _residual_bytes(f, state, h)

    none, full = saved("none"), saved("full")
    assert full <= 0.05 * none, (full, none)  # the activations of the block are recomputed, not kept
    assert none > 20 * h.size * 4  # without remat the block keeps many [T, ...] activations


def test_query_chunk_remat_bounds_saved_memory_and_keeps_gradients(rng):
    b, t, s, heads, d, k = 1, 64, 64, 4, 24, 16
    q = jnp.asarray(rng.standard_normal((b, t, heads, d)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
    idx = jnp.asarray(rng.integers(-1, s, (b, t, k)), jnp.int32)

    def loss(q, kv, remat):
        def chunk(q_c, i_c):
            return sparse_mla(q_c, kv, i_c, 0.3, 16, q_chunk=None)[0]
        return jnp.sum(map_query_chunks(chunk, 8, (q, idx), remat=remat) ** 2)

    with_remat = _residual_bytes(lambda q, kv: loss(q, kv, True), q, kv)
    without = _residual_bytes(lambda q, kv: loss(q, kv, False), q, kv)
    gathered = t * k * d * 4  # the [T, k, D] gathered rows that chunking without remat keeps for the backward
    assert without >= gathered and without > 4 * with_remat, (without, with_remat)
    assert with_remat <= 2 * (q.size + idx.size) * 4  # about the chunks' inputs
    g1 = jax.grad(lambda q, kv: loss(q, kv, True), argnums=(0, 1))(q, kv)
    g0 = jax.grad(lambda q, kv: loss(q, kv, False), argnums=(0, 1))(q, kv)
    for a, b_ in zip(g1, g0):
        assert rel_err(a, b_) <= 1e-6


def test_remat_option_is_validated():
    with pytest.raises(ValueError, match="RunOptions.remat must be one of"):
        RunOptions(remat="everything")
