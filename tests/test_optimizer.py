"""Separate optimizers (and clips) for the lightning indexer and the main model; fp32 master weights."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from dsv32_jax import Transformer, load_preset
from dsv32_jax.train.config import default_config
from dsv32_jax.train.optimizer import (group_config, group_norms, make_tx, param_groups, trainable_filter,
                                      with_master_weights)


def _cfg(**kw):
    c = default_config().optimizer
    c.schedule, c.warmup_steps = "constant", 0
    for k, v in kw.items():
        if k.startswith("indexer_"):
            c.indexer[k[len("indexer_"):]] = v
        else:
            c[k] = v
    return c


def _params():
    return {"layers": {"0": {"attn": {"indexer": {"wk": jnp.ones((4,), jnp.float32)},
                                      "wq": jnp.ones((3,), jnp.float32)}}},
            "embed": jnp.ones((2,), jnp.float32)}


def test_groups_and_indexer_overrides():
    assert param_groups(_params()) == {"layers": {"0": {"attn": {"indexer": {"wk": "indexer"}, "wq": "main"}}},
                                       "embed": "main"}
    c = _cfg(lr=2e-3, grad_clip=1.0, indexer_lr=1e-4)
    assert group_config(c, "main").lr == 2e-3 and group_config(c, "indexer").lr == 1e-4
    assert group_config(c, "indexer").grad_clip == 1.0  # not overridden: inherited
    with pytest.raises(ValueError, match="optimizer group must be one of"):
        group_config(c, "router")
    bad = _cfg()
    with bad.unlocked():
        bad.indexer.momentum = 0.9
    with pytest.raises(ValueError, match=r"config.optimizer.indexer.momentum: unknown field"):
        group_config(bad, "indexer")
    # an indexer override that breaks its schedule is named as the indexer group's (it was reported against the
    # main group's fields, which the user had set correctly)
    c = _cfg()
    c.indexer.schedule = "linear"
    with pytest.raises(ValueError, match=r"config.optimizer.indexer \(its own fields .*'schedule': 'linear'"):
        make_tx(c)


def test_each_group_is_clipped_by_its_own_norm(rng):
    """A huge indexer gradient must not shrink the main model's step (one shared clip would scale it by 1/100).
    eps = 1 makes AdamW's first step depend on the gradient's size: lr * g / (|g| + 1) per element."""
    lr, clip = 0.1, 1.0
    tx = make_tx(_cfg(lr=lr, grad_clip=clip, eps=1.0, b1=0.0, b2=0.0, weight_decay=0.0))
    params = _params()
    g_main_wq = rng.normal(size=3) * 0.1
    g_embed = rng.normal(size=2) * 0.1
    g_idx = rng.normal(size=4) * 50.0
    grads = {"layers": {"0": {"attn": {"indexer": {"wk": jnp.asarray(g_idx, jnp.float32)},
                                       "wq": jnp.asarray(g_main_wq, jnp.float32)}}},
             "embed": jnp.asarray(g_embed, jnp.float32)}
    updates, _ = tx.update(grads, tx.init(params), params)

    def adam_first_step(g, norm):  # b1 = b2 = 0 (no bias-correction effect): m = g, v = g^2
        g = g * min(1.0, clip / norm)
        return -lr * g / (np.abs(g) + 1.0)

    n_main = float(np.sqrt(np.sum(g_main_wq ** 2) + np.sum(g_embed ** 2)))
    n_idx = float(np.linalg.norm(g_idx))
    assert n_main < clip < n_idx
    np.testing.assert_allclose(updates["layers"]["0"]["attn"]["wq"], adam_first_step(g_main_wq, n_main), rtol=1e-5)
    np.testing.assert_allclose(updates["embed"], adam_first_step(g_embed, n_main), rtol=1e-5)
    np.testing.assert_allclose(updates["layers"]["0"]["attn"]["indexer"]["wk"], adam_first_step(g_idx, n_idx),
                               rtol=1e-5)
    norms = group_norms(grads)
    np.testing.assert_allclose([norms["main"], norms["indexer"]], [n_main, n_idx], rtol=1e-6)


def test_fp32_master_weights_keep_updates_that_bf16_rounds_away():
    """AdamW at lr 1e-4 moves a parameter of 1.0 by ~1e-4 a step, below bf16's half-ulp at 1 (2^-8): bf16 updates
    are lost, the fp32 master accumulates them and the bf16 parameter follows it."""
    steps, lr = 50, 1e-4
    p0 = {"w": jnp.ones((8,), jnp.bfloat16)}
    grads = {"w": jnp.ones((8,), jnp.bfloat16)}
    results = {}
    for master in ("float32", ""):
        tx = make_tx(_cfg(lr=lr, master_dtype=master), param_dtype=jnp.bfloat16)
        params, state = p0, tx.init(p0)
        for _ in range(steps):
            updates, state = tx.update(grads, state, params)
            params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
        assert params["w"].dtype == jnp.bfloat16
        results[master] = (params, state)
    params, state = results["float32"]
    assert state.master["w"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(state.master["w"], np.float64), 1.0 - steps * lr, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(state.master["w"].astype(jnp.bfloat16)))
    assert float(params["w"][0]) < 1.0
    np.testing.assert_array_equal(np.asarray(results[""][0]["w"], np.float32), 1.0)  # bf16 alone: stuck


def test_master_weights_off_for_fp32_params_and_needs_params():
    state = make_tx(_cfg(), param_dtype=jnp.float32).init(_params())
    assert not hasattr(state, "master")
    tx = with_master_weights(make_tx(_cfg()))
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update(_params(), tx.init(_params()))


@pytest.mark.heavy
def test_sparse_trainer_indexer_and_main_have_their_own_rates(tmp_path):
    """config.optimizer.indexer.lr = 0: one sparse step moves the main model and leaves the indexer untouched;
    the metrics report both groups' gradient norms and rates."""
    from flax import nnx

    from dsv32_jax.train.trainer import Trainer

    c = default_config()
    c.stage, c.mesh, c.steps = "sparse", "", 1
    c.data.seq_len, c.data.batch_size = 16, 2
    c.optimizer.schedule, c.optimizer.warmup_steps = "constant", 0
    c.optimizer.indexer.lr = 0.0
    c.model_overrides = ml_collections.ConfigDict({"index_topk": 8})
    trainer = Trainer(c, str(tmp_path / "w"))
    flat = lambda: nnx.traversals.flatten_mapping(nnx.to_pure_dict(trainer.ts.state[0]))  # noqa: E731
    before = {k: np.array(v) for k, v in flat().items()}
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, trainer.cfg.vocab_size, (2, 16)).astype(np.int32)
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, 1), "segment_ids": np.ones((2, 16), np.int32),
             "positions": np.tile(np.arange(16, dtype=np.int32), (2, 1)), "loss_mask": np.ones((2, 16), np.float32)}
    metrics = jax.device_get(trainer.train_step(batch))
    after = flat()
    moved = {k for k in before if not np.array_equal(before[k], np.asarray(after[k]))}
    assert moved and not any("indexer" in k for k in moved)
    assert float(metrics["lr_indexer"]) == 0.0 and float(metrics["lr"]) == pytest.approx(c.optimizer.lr)
    assert float(metrics["grad_norm/indexer"]) > 0 and float(metrics["grad_norm/main"]) > 0
    np.testing.assert_allclose(float(metrics["grad_norm"]) ** 2,
                               float(metrics["grad_norm/indexer"]) ** 2 + float(metrics["grad_norm/main"]) ** 2,
                               rtol=1e-4)


def _paths(tree):
    return {"/".join(map(str, k)) for k in nnx.traversals.flatten_mapping(nnx.to_pure_dict(tree))}


@pytest.mark.parametrize("stage,mtp,indexer,frozen", [
    ("sparse", True, True, set()), ("sparse", False, True, {"mtp"}), ("sparse", False, False, {"mtp", "indexer"}),
    ("dense", True, True, {"indexer"}), ("dense", False, True, {"mtp", "indexer"}),
    ("grpo", False, True, {"mtp"}), ("agent", False, False, {"mtp", "indexer"})])
def test_parameters_no_loss_reaches_stay_out_of_the_optimizer(stage, mtp, indexer, frozen):
    """trainable_filter(mtp=, indexer=): with weight decay, AdamW would otherwise shrink them every step."""
    model = Transformer(load_preset("tiny").replace(num_nextn_predict_layers=1), rngs=nnx.Rngs(0))
    everything = _paths(nnx.state(model, nnx.Param))
    kept = _paths(nnx.state(model, trainable_filter(stage, mtp=mtp, indexer=indexer)))
    part = lambda name: {p for p in everything if name in p.split("/")}  # noqa: E731
    assert part("mtp") and part("indexer") and kept <= everything
    assert everything - kept == set().union(*(part(name) for name in frozen))


def test_the_warmup_stage_trains_the_indexer_alone():
    """Eq. (3)'s dense warm-up trains only the lightning indexer, the rest frozen (a filter that let every parameter
    into the optimizer passed every test: tests/mutate.sh survivor, 2026-11-30)."""
    model = Transformer(load_preset("tiny").replace(num_nextn_predict_layers=1), rngs=nnx.Rngs(0))
    everything = _paths(nnx.state(model, nnx.Param))
    indexer = {p for p in everything if "indexer" in p.split("/")}
    assert indexer and _paths(nnx.state(model, trainable_filter("warmup"))) == indexer


@pytest.mark.heavy  # >= 20 s on 2 AMD EPYC cores (2026-12-01): out of make test's 15 minutes
def test_grpo_learner_with_weight_decay_leaves_the_mtp_layer_and_a_weightless_indexer_alone(tmp_path):
    """GRPO's policy is the main head (the MTP layers do not run) and grpo.indexer_weight = 0 gives the indexer no
    loss: with weight decay on, one update moves the rest and leaves both bitwise as they were."""
    from tests.test_grpo import learner
    from dsv32_jax.model import sharding as shd

    lrn = learner(tmp_path, 0, **{"optimizer.warmup_steps": 0, "optimizer.weight_decay": 0.5,
                                  "grpo.indexer_weight": 0.0})
    batch, _ = lrn.rollout(0)
    with shd.use_mesh(lrn.mesh):
        batch = jax.device_put(batch, lrn.batch_sharding)
        batch["logp_ref"] = lrn.steps.reference(lrn.ref, batch)
        before = {k: np.array(v) for k, v in nnx.traversals.flatten_mapping(nnx.to_pure_dict(lrn.state[0])).items()}
        state, _ = lrn.steps.train(lrn.state, batch)
    after = nnx.traversals.flatten_mapping(nnx.to_pure_dict(state[0]))
    frozen = [k for k in before if "mtp" in map(str, k) or "indexer" in map(str, k)]
    moved = [k for k in before if not np.array_equal(np.asarray(after[k]), before[k])]
    assert {k[0] for k in frozen} == {"mtp", "layers"} and moved and not set(moved) & set(frozen)
    assert len(moved) > len(before) // 2


@pytest.mark.heavy  # >= 20 s on 2 AMD EPYC cores (2026-12-01): out of make test's 15 minutes
def test_bf16_grpo_learner_with_master_weights_takes_a_step(tmp_path):
    """param_dtype bf16 with fp32 master weights: the float32 parameters (router, indexer weights_proj) had master
    "copies" that were the parameters' own buffers, and GRPO's donating step failed at step 0 ("donate the same
    buffer twice"); the trainer was spared only because it builds its state under jit."""
    from tests.test_grpo import learner
    from dsv32_jax.model import sharding as shd

    lrn = learner(tmp_path, 0, **{"optimizer.warmup_steps": 0, "param_dtype": "bfloat16"})
    batch, _ = lrn.rollout(0)
    with shd.use_mesh(lrn.mesh):
        batch = jax.device_put(batch, lrn.batch_sharding)
        batch["logp_ref"] = lrn.steps.reference(lrn.ref, batch)
        state, metrics = lrn.steps.train(lrn.state, batch)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0


def test_each_group_decays_its_weights_at_its_own_rate():
    """AdamW's decoupled weight decay with a zero gradient moves each parameter by -lr * weight_decay * p, at the
    group's own weight_decay: an indexer override of 0.5 beside a main 0 (and the reverse). A tx that gave the
    indexer the main group's decay (or put every parameter in one group) passed every test: tests/mutate.sh
    survivors, 2026-11-30."""
    lr = 0.1
    for main_wd, indexer_wd in ((0.0, 0.5), (0.5, 0.0)):
        tx = make_tx(_cfg(lr=lr, weight_decay=main_wd, indexer_weight_decay=indexer_wd, weight_decay_mask="all"))
        params = jax.tree.map(lambda x: 2.0 * x, _params())
        updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
        np.testing.assert_allclose(np.asarray(updates["layers"]["0"]["attn"]["indexer"]["wk"]), -lr * indexer_wd * 2.0,
                                   rtol=1e-6)
        for main in (updates["layers"]["0"]["attn"]["wq"], updates["embed"]):
            np.testing.assert_allclose(np.asarray(main), -lr * main_wd * 2.0, rtol=1e-6)


@pytest.mark.parametrize("warmup", [0, 10])
def test_the_cosine_schedule_ends_at_the_final_fraction(warmup):
    """schedule 'cosine': lr after warmup_steps, lr * final_lr_fraction at decay_steps and after (a schedule that
    decayed to 0 passed every test: tests/mutate.sh survivor, 2026-11-30), the half-way point of the cosine at
    their mean."""
    from dsv32_jax.train.optimizer import learning_rate_schedule

    c = _cfg(lr=1e-3, warmup_steps=warmup, decay_steps=110, final_lr_fraction=0.1)
    c.schedule = "cosine"
    sched = learning_rate_schedule(c)
    np.testing.assert_allclose(float(sched(warmup)), 1e-3, rtol=1e-6)
    for step in (110, 500):
        np.testing.assert_allclose(float(sched(step)), 1e-4, rtol=1e-5)
    np.testing.assert_allclose(float(sched((warmup + 110) / 2)), 1e-3 * (0.1 + 0.9 * 0.5), rtol=1e-3)


def test_fp32_master_weights_decay_the_master_not_the_rounded_parameter():
    """With bf16 parameters and fp32 master weights, AdamW's decoupled decay reads the fp32 master: 50 steps of
    lr 0.01, weight_decay 0.1 and zero gradients leave master = (1 - lr wd)^50 to float32 rounding. Decaying the
    bf16 parameter instead (off by its rounding every step: 2.9e-4 after 50) passed every test (tests/mutate.sh
    survivor, 2026-11-30)."""
    lr, wd, n = 0.01, 0.1, 50
    tx = make_tx(_cfg(lr=lr, weight_decay=wd, master_dtype="float32"), param_dtype=jnp.bfloat16)
    params = {"w": jnp.ones((4, 2), jnp.bfloat16)}
    state = tx.init(params)
    for _ in range(n):
        updates, state = tx.update({"w": jnp.zeros((4, 2), jnp.bfloat16)}, state, params)
        params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
    np.testing.assert_allclose(np.asarray(state.master["w"], np.float64), (1 - lr * wd) ** n, rtol=2e-6)
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(state.master["w"].astype(jnp.bfloat16)))


@pytest.mark.parametrize("mask", ["matrices", "all"])
def test_weight_decay_reaches_the_matrices_not_the_norms(mask):
    """weight_decay_mask "matrices" (the default, Megatron-LM's rule): with zero gradients one AdamW step moves every
    weight matrix and the embedding by exactly -lr * wd * p and leaves every norm scale and the indexer key norm's
    bias bitwise alone (they were decayed towards 0 with the rest: a scale decayed to 0 switches its layer's input
    off); "all" decays those too. Checked on the tiny model's own parameter tree, through nnx.Optimizer as the
    trainers build it, so the names the mask reads are the ones training sees."""
    lr, wd = 0.1, 0.5
    cfg = _cfg(lr=lr, weight_decay=wd, indexer_weight_decay=wd, weight_decay_mask=mask, master_dtype="")
    model = Transformer(load_preset("tiny"), rngs=nnx.Rngs(0))
    # (every value away from 0: the key norm's bias starts at 0, where decay is invisible)
    nnx.update(model, jax.tree.map(lambda x: x + 0.5, nnx.state(model, nnx.Param)))
    opt = nnx.Optimizer(model, make_tx(cfg), wrt=nnx.Param)
    before = nnx.traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    before = {k: np.array(v, np.float64) for k, v in before.items()}
    opt.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
    after = nnx.traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    norms = [k for k in before if k[-1] in ("scale", "bias")]
    assert len(norms) >= 16 and any(k[-1] == "bias" for k in norms) and any(k[-2] == "k_norm" for k in norms)
    for k, p in before.items():
        decayed = mask == "all" or k not in norms
        want = p * (1 - lr * wd) if decayed else p
        np.testing.assert_allclose(np.asarray(after[k], np.float64), want, rtol=1e-6, atol=0, err_msg=str(k))
        if not decayed:
            np.testing.assert_array_equal(np.asarray(after[k]), before[k], err_msg=str(k))


def test_an_unknown_weight_decay_mask_is_refused_by_name():
    with pytest.raises(ValueError, match=r"config\.optimizer\.weight_decay_mask must be one of \('matrices', 'all'\), "
                                         r"got 'norms'"):
        make_tx(_cfg(weight_decay_mask="norms"))


def test_the_decay_mask_reads_names_and_ranks():
    """decay_mask: a norm scale or bias stacked over layers ([L, D], as a scanned-layers layout stores it) is still
    not decayed (its name says what it is), a 1-D parameter of any name is not (Megatron-LM's rank rule), a matrix
    or a stacked matrix is."""
    from dsv32_jax.train.optimizer import decay_mask

    tree = {"norm": {"scale": jnp.ones((3, 8))}, "k_norm": {"bias": jnp.ones((3, 8))}, "gate": jnp.ones((8,)),
            "wq": {"kernel": jnp.ones((8, 4))}, "experts": {"w_up": jnp.ones((3, 8, 4))}, "embed": jnp.ones((5, 8))}
    assert decay_mask(tree) == {"norm": {"scale": False}, "k_norm": {"bias": False}, "gate": False,
                                "wq": {"kernel": True}, "experts": {"w_up": True}, "embed": True}
