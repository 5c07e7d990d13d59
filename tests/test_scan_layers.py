"""RunOptions.scan_layers: runs of decoder blocks of one structure (the MoE blocks) as one lax.scan over their
stacked parameters. The scanned model equals the Python loop (fp32: logits, every per-layer aux output, loss and
every gradient leaf of the sparse stage's objective with the balance loss, relative error <= 1e-5), with block remat and with routing replay; the sharded version is checked in tests/test_seq_parallel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from flax import nnx

from dsv32_jax.model.config import load_preset
from dsv32_jax.model.transformer import Transformer, layer_runs
from dsv32_jax.model.options import RunOptions
from dsv32_jax.train.optimizer import trainable_filter
from dsv32_jax.train.steps import LossWeights, lm_objective

# 1 dense block, then 2 MoE blocks; no MTP block (it is never scanned)
CFG = load_preset("tiny").replace(num_hidden_layers=3, index_topk=6, num_nextn_predict_layers=0)


def _batch(rng, b=2, t=24):
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, t)), jnp.int32)
    seg = np.ones((b, t), np.int32)
    seg[1, 10:] = 2
    pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    pos[1, 10:] -= 10
    return {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1), "segment_ids": jnp.asarray(seg),
            "positions": jnp.asarray(pos), "loss_mask": jnp.ones((b, t), jnp.float32)}


def test_layer_runs_group_blocks_of_one_structure():
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    assert layer_runs(model.layers) == [(0, 1), (1, 3)]
    dense = Transformer(CFG.replace(first_k_dense_replace=3), rngs=nnx.Rngs(0))
    assert layer_runs(dense.layers) == [(0, 3)]


@pytest.mark.heavy
def test_scanned_blocks_equal_the_loop(rng):
    batch = _batch(rng, t=16)
    weights = LossWeights(balance_weight=0.01)

    def run(scan):
        opts = RunOptions(attention="sparse", indexer_loss="sparse", remat="full", scan_layers=scan, attn_chunk=8)
        model = Transformer(CFG, rngs=nnx.Rngs(0), options=opts)

        @jax.jit
        def fn(model):
            g, (metrics, _, _) = nnx.grad(
                lambda m: lm_objective(m, batch, stage="sparse", weights=weights, model_cfg=CFG),
                argnums=nnx.DiffState(0, trainable_filter("sparse")), has_aux=True)(model)
            logits, aux = model(batch["tokens"], batch["positions"], batch["segment_ids"], return_aux=True)
            return nnx.to_pure_dict(g), metrics["loss"], logits, aux

        g, loss, logits, aux = fn(model)
        return jax.tree.leaves(g), float(loss), logits, aux

    g_loop, l_loop, logits_loop, aux_loop = run(False)
    g_scan, l_scan, logits_scan, aux_scan = run(True)
    assert abs(l_scan - l_loop) <= 1e-5 * abs(l_loop)
    assert rel_err(logits_scan, logits_loop) <= 1e-5
    for name in ("topk", "routing"):
        for i in range(CFG.num_hidden_layers):
            a, b = aux_scan[name][i], aux_loop[name][i]
            assert (a is None) == (b is None), (name, i)
            if a is not None:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name}[{i}]")
    for i in range(CFG.num_hidden_layers):
        assert rel_err(aux_scan["indexer_kl"][i], aux_loop["indexer_kl"][i]) <= 1e-5, i
    assert len(g_scan) == len(g_loop) > 0
    for a, b in zip(g_scan, g_loop):
        assert rel_err(a, b) <= 1e-5


def test_scanned_blocks_replay_routing(rng):
    batch = _batch(rng)
    model = Transformer(CFG, rngs=nnx.Rngs(1), options=RunOptions(scan_layers=True))
    routing_of = jax.jit(lambda m, routing: m(batch["tokens"], routing=routing, return_aux=True)[1]["routing"])
    recorded = {i: ids for i, ids in routing_of(model, None).items() if ids is not None}
    assert sorted(recorded) == [1, 2]
    flipped = {i: jnp.flip(ids, axis=-1) for i, ids in recorded.items()}  # same experts: replay reproduces them
    replayed = {"routing": routing_of(model, flipped)}
    for i in recorded:
        np.testing.assert_array_equal(np.asarray(replayed["routing"][i]), np.asarray(flipped[i]))
    with pytest.raises(ValueError, match=r"layers \[2\] have no recorded routing"):
        jax.eval_shape(lambda m: m(batch["tokens"], routing={1: recorded[1]}), model)
