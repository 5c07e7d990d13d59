"""The sparse stage's objective (eq. 4) splits its gradient exactly: the indexer learns from the KL alone (times
indexer_weight), every other parameter from the LM loss alone (the KL's inputs are detached). The stage-level run
(tests/test_train.py) cannot tell a KL left out of the loss: the main model's attention adapts to the selection and
the KL falls nearly as far (ratio 0.885-0.891 against 0.675-0.856)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from flax import nnx
from test_microbatch import random_batch, tiny_config

from dsv32_jax.train import losses, steps
from dsv32_jax.train.trainer import Trainer


def test_sparse_objective_trains_the_indexer_on_the_kl_and_the_rest_on_the_lm_loss(tmp_path, rng):
    """Gradients of `steps.lm_objective` (sparse stage, indexer_weight 0.7, no MTP / balance terms) against the
    gradients of its two parts computed apart: indexer leaves = d (0.7 x KL) (non-zero), all others = d LM loss.
    The KL part is differentiated with its weight inside, as the objective is: with the scatter-free key gradient
    (`indexer_loss.selected_scores`, the default) 0.7 x d KL rounds differently from d (0.7 x KL) where a float32
    sum nearly cancels (2.4e-9 on one entry of 2048), and the bounds stay rtol 1e-4 / atol 1e-9. Mutations: the KL left out of the sparse loss (train/steps.py `loss = loss + 0.0 * kl`): the indexer check
    fails; the attention target of the sparse KL not detached (indexer_loss.py `sparse_indexer_kl`'s p_all without
    stop_gradient): the KL reaches the main parameters and the LM-only check fails. 16-17 s on 2 cores."""
    c = tiny_config("sparse", mtp=False)
    c.loss.mtp_weight, c.loss.balance_weight, c.loss.indexer_weight = 0.0, 0.0, 0.7
    trainer = Trainer(c, str(tmp_path / "w"), allocate=False)
    model, _ = trainer._build()
    batch = {k: jnp.asarray(v) for k, v in random_batch(rng, trainer.cfg.vocab_size).items()}
    weights = steps.LossWeights.from_config(c.loss)
    graphdef, params = nnx.split(model)

    def part(fn):
        return jax.jit(jax.grad(lambda p: fn(nnx.merge(graphdef, p))))(params)

    def objective(m):
        return steps.lm_objective(m, batch, stage="sparse", weights=weights, model_cfg=trainer.cfg)[0]

    def lm(m):
        return losses.lm_loss(m(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"]),
                              batch)

    def kl(m):
        _, aux = m(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"], return_aux=True)
        return 0.7 * losses.indexer_kl(aux, (batch["segment_ids"] > 0).astype(jnp.float32))[0]

    g, g_lm, g_kl = (dict(nnx.traversals.flatten_mapping(nnx.to_pure_dict(part(f)))) for f in (objective, lm, kl))
    n_indexer = 0
    for path, value in g.items():
        value = np.asarray(value)
        if "indexer" in map(str, path):
            n_indexer += 1
            np.testing.assert_allclose(value, np.asarray(g_kl[path]), rtol=1e-4, atol=1e-9, err_msg=str(path))
            assert not np.any(np.asarray(g_lm[path])), f"{path}: the LM loss reaches the indexer"
        else:
            np.testing.assert_allclose(value, np.asarray(g_lm[path]), rtol=1e-4, atol=1e-9, err_msg=str(path))
    assert n_indexer > 0
    assert max(float(np.abs(np.asarray(v)).max()) for p, v in g_kl.items() if "indexer" in map(str, p)) > 1e-6


def test_config_indexer_fp8_selects_with_the_fp8_indexer(tmp_path, rng):
    """config.indexer_fp8 reaches the step: the sparse stage's program quantizes the indexer to e4m3 (the production
    selection; without it, none), and the loss stays finite. Mutation caught: run_options without indexer_fp8 (the
    flag ignored)."""
    def traced(fp8):
        c = tiny_config("sparse", mtp=False)
        c.indexer_fp8 = fp8
        trainer = Trainer(c, str(tmp_path / f"w{fp8}"), allocate=False)
        assert trainer.options.indexer_fp8 is fp8
        model, _ = trainer._build()
        batch = {k: jnp.asarray(v) for k, v in random_batch(rng, trainer.cfg.vocab_size).items()}
        weights = steps.LossWeights.from_config(c.loss)
        objective = lambda m: steps.lm_objective(m, batch, stage="sparse", weights=weights, model_cfg=trainer.cfg)
        text = str(jax.make_jaxpr(lambda m: objective(m)[0])(model))
        return text, float(objective(model)[0])

    text_fp8, loss_fp8 = traced(True)
    text_exact, loss_exact = traced(False)
    assert "f8_e4m3fn" in text_fp8 and "f8_e4m3fn" not in text_exact
    assert np.isfinite(loss_fp8) and np.isfinite(loss_exact)


@pytest.mark.parametrize("field,default,other,bad", [("kl_key_grad", "dense", "segment_sum", "sorted"),
                                                     ("mla_bwd", "stored", "recompute", "fused"),
                                                     ("mla_bwd", "stored", "atomic", "fused"),
                                                     ("mla_fwd", "triton", "mosaic_gpu", "cutlass"),
                                                     ("mla_pds", "triton", "mosaic_gpu", "cutlass"),
                                                     ("mla_dqkv", "triton", "mosaic_gpu", "cutlass")])
def test_config_run_option_reaches_the_model_and_is_checked(field, default, other, bad):
    """config.kl_key_grad / mla_bwd / mla_fwd / mla_pds / mla_dqkv become the RunOptions field of the same name in the
    sparse stage (with its default when unset); an unknown value is refused by name. Mutation caught: the trainer ignoring the field.
    What mla_bwd selects is checked in tests/test_kernels.py (test_kernel_attention_stored_mla_backward)."""
    from dsv32_jax import RunOptions
    from dsv32_jax.train.trainer import run_options
    c = tiny_config("sparse", mtp=False)
    assert getattr(run_options(c), field) == default
    setattr(c, field, other)
    assert getattr(run_options(c), field) == other
    with pytest.raises(ValueError, match=f"RunOptions.{field} must be one of"):
        RunOptions(**{field: bad})


@pytest.mark.parametrize("stage", ["grpo", "agent"])
def test_post_training_stages_build_their_model_with_the_configs_run_options(stage, tmp_path, monkeypatch):
    """The GRPO and agent learners build their model with every run-option field of the config, as the LM stages
    do: before, the agent stage dropped remat, scan_layers, kl_key_grad and the kernel choices, and GRPO the last
    two, silently (a remat=full agent run held every block's activations). The learner is stopped where it builds
    the model (a stand-in Transformer records the options). Mutant: either learner back on its own RunOptions."""
    import importlib

    from dsv32_jax.train import trainer
    from dsv32_jax.train.config import default_config
    module = importlib.import_module("dsv32_jax.train." + {"grpo": "grpo", "agent": "agent_grpo"}[stage])
    learner = {"grpo": "GRPOLearner", "agent": "AgentLearner"}[stage]

    class Built(Exception):
        pass

    def stand_in(cfg, *, options, **kw):
        raise Built(options)

    monkeypatch.setattr(trainer, "Transformer", stand_in)  # build_policy: the learners' one model builder
    c = default_config()
    c.stage, c.mesh, c.attention, c.attn_chunk = stage, "", "kernel", 16
    fields = dict(remat="full", scan_layers=True, kl_key_grad="segment_sum", mla_bwd="atomic",
                  mla_fwd="mosaic_gpu_pingpong", mla_pds="mosaic_gpu", mla_dqkv="triton", indexer_fp8=True)
    for k, v in fields.items():
        setattr(c, k, v)
    with pytest.raises(Built) as built:
        getattr(module, learner)(c, str(tmp_path))
    options = built.value.args[0]
    assert {k: getattr(options, k) for k in fields} == fields
    assert (options.attention, options.attn_chunk, options.dsa, options.indexer_loss) == ("kernel", 16, True, None)


@pytest.mark.parametrize("chunk", [pytest.param(5, marks=pytest.mark.heavy),  # 33 s on 2 cores
                                   pytest.param(64, marks=pytest.mark.heavy)])  # 27 s
def test_token_chunked_heads_give_the_same_objective_without_vocab_sized_buffers(chunk, tmp_path, rng):
    """config.loss.token_chunk: the LM and MTP heads' cross-entropy chunk by chunk (losses.chunked_token_nll) gives
    the unchunked objective's loss, metrics and gradients (float32 rounding; chunk 5 does not divide the sequence,
    chunk 64 covers it in one), and the traced objective's largest vocabulary-sized array is one chunk's logits.
    Mutations caught: the chunks' values put back in the wrong order (loss off by 1.1e-2), the MTP heads given the
    unshifted targets (4.3e-4)."""
    c = tiny_config("sparse", mtp=True)
    trainer = Trainer(c, str(tmp_path / "w"), allocate=False)
    model, _ = trainer._build()
    batch = {k: jnp.asarray(v) for k, v in random_batch(rng, trainer.cfg.vocab_size).items()}
    graphdef, params = nnx.split(model)
    base = steps.LossWeights.from_config(c.loss)

    def run(token_chunk):
        weights = dataclasses.replace(base, token_chunk=token_chunk)

        def objective(p):
            return steps.lm_objective(nnx.merge(graphdef, p), batch, stage="sparse", weights=weights,
                                      model_cfg=trainer.cfg)
        (loss, (metrics, _, _)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return loss, metrics, grads, jax.make_jaxpr(objective)(params)

    loss, metrics, grads, _ = run(0)
    loss_c, metrics_c, grads_c, jaxpr_c = run(chunk)
    assert base.mtp_weight > 0 and "mtp_loss" in metrics_c
    assert rel_err(loss_c, loss) < 1e-6
    for key in ("lm_loss", "mtp_loss"):
        assert rel_err(metrics_c[key], metrics[key]) < 1e-6, key
    flat = lambda g: jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])  # noqa: E731
    assert rel_err(flat(grads_c), flat(grads)) < 1e-5
    b, t = batch["tokens"].shape
    size = -(-t // -(-t // chunk))  # positions per chunk (chunk 64: all 16 in one)
    vocab_sized = [math.prod(v.aval.shape) for e in _all_eqns(jaxpr_c.jaxpr) for v in e.outvars
                   if getattr(v.aval, "shape", ())[-1:] == (trainer.cfg.vocab_size,)]
    assert max(vocab_sized) == b * size * trainer.cfg.vocab_size  # the largest: one chunk's logits


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
                    yield from _all_eqns(getattr(v, "jaxpr", v))


@pytest.mark.parametrize("attention,mla_mode", [("dense", "mqa"), ("dense", "mha")])
def test_reference_attention_gives_the_indexer_the_sparse_paths_kl(attention, mla_mode, tmp_path, rng):
    """The sparse stage with the masked dense reference (config.attention="dense") or the decompressed MHA mode:
    eq. 4's KL and its indexer gradient as with attention="sparse" (they were absent: the indexer got no gradient
    and the logged KL read 0)."""
    c = tiny_config("sparse", mtp=False)
    c.loss.mtp_weight, c.loss.balance_weight = 0.0, 0.0
    trainer = Trainer(c, str(tmp_path / "w"), allocate=False)
    model, _ = trainer._build()
    batch = {k: jnp.asarray(v) for k, v in random_batch(rng, trainer.cfg.vocab_size).items()}
    mask = (batch["segment_ids"] > 0).astype(jnp.float32)
    graphdef, params = nnx.split(model)
    base = model.options

    def kl_and_grad(options):
        def kl(p):
            m = nnx.merge(graphdef, p)
            m.options = options
            _, aux = m(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                       return_aux=True)
            return losses.indexer_kl(aux, mask)[0]

        value, grad = jax.jit(jax.value_and_grad(kl))(params)
        flat = dict(nnx.traversals.flatten_mapping(nnx.to_pure_dict(grad)))
        return float(value), {p: np.asarray(v) for p, v in flat.items() if "indexer" in map(str, p)}

    want, g_want = kl_and_grad(base.replace(attention="sparse"))
    got, g_got = kl_and_grad(base.replace(attention=attention, mla_mode=mla_mode))
    assert want > 1e-6 and rel_err(got, want) < 1e-5, (got, want)
    assert g_got.keys() == g_want.keys() and len(g_want) > 0
    for path in g_want:
        np.testing.assert_allclose(g_got[path], g_want[path], rtol=1e-4, atol=1e-9, err_msg=str(path))


def test_the_sparse_objective_weighs_each_term_by_its_config_weight(tmp_path, rng):
    """loss = lm_loss + indexer_weight * indexer_kl + mtp_weight * mtp_loss + balance_weight * balance_loss, each
    term as the objective logs it, at weights far from 1 (a step that added the MTP loss unweighted passed every
    test at the default weights: tests/mutate.sh survivor, 2026-11-30); the warm-up stage's loss is the KL alone."""
    c = tiny_config("sparse", mtp=True)
    trainer = Trainer(c, str(tmp_path / "w"), allocate=False)
    model, _ = trainer._build()
    batch = {k: jnp.asarray(v) for k, v in random_batch(rng, trainer.cfg.vocab_size).items()}
    weights = steps.LossWeights(indexer_weight=0.3, mtp_weight=0.7, balance_weight=0.05)
    loss, (m, _, _) = steps.lm_objective(model, batch, stage="sparse", weights=weights, model_cfg=trainer.cfg)
    terms = {k: float(m[k]) for k in ("lm_loss", "indexer_kl", "mtp_loss", "balance_loss")}
    assert all(v > 0 for v in terms.values()), terms
    want = terms["lm_loss"] + 0.3 * terms["indexer_kl"] + 0.7 * terms["mtp_loss"] + 0.05 * terms["balance_loss"]
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    warm, (mw, _, _) = steps.lm_objective(model, batch, stage="warmup", weights=weights, model_cfg=trainer.cfg)
    np.testing.assert_allclose(float(warm), float(mw["indexer_kl"]), rtol=1e-6)


@pytest.mark.parametrize("chunk", [4, 5, 12, 64])
def test_chunked_token_nll_equals_the_whole_heads_per_position(chunk):
    """losses.chunked_token_nll(h, kernel, targets, chunk) = token_nll(h @ kernel, targets) at every position,
    for chunks that divide the 12 positions, that do not, and that cover them in one; a reassembly in the wrong
    order was caught only by a heavy test (tests/mutate.sh survivor, 2026-11-30)."""
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((2, 12, 8)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((8, 20)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 20, (2, 12)), jnp.int32)
    np.testing.assert_allclose(np.asarray(losses.chunked_token_nll(h, kernel, targets, chunk)),
                               np.asarray(losses.token_nll(h @ kernel, targets)), rtol=1e-5, atol=1e-6)


def test_a_bf16_head_s_gradient_sums_in_float32_over_the_loss_chunks():
    """chunked_token_nll with a bf16 LM head (param_dtype bfloat16): the head was cast to float32 inside the lax.map
    over token chunks, so its gradient summed over the chunks in the map's bf16 carry (256 chunks: 4.3e-2 off the
    float32 gradient, every column; audit 2026-12-07). Now it is the float32 gradient rounded once (1.4e-3)."""
    from dsv32_jax.train.losses import chunked_token_nll

    rng = np.random.default_rng(0)
    b, t, d, v = 2, 2048, 32, 256
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    h = bf(rng.standard_normal(d) + 0.5 * rng.standard_normal((b, t, d)))
    w = bf(0.02 * rng.standard_normal((d, v)))
    targets = jnp.asarray(np.where(rng.random((b, t)) < 0.3, 7, rng.integers(0, v, (b, t))))

    def grad(dtype, chunk):
        loss = lambda w_: jnp.sum(chunked_token_nll(jnp.asarray(h, jnp.bfloat16), w_, targets, chunk))  # noqa: E731
        return np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(w, dtype)).astype(jnp.float32), np.float64)

    want = grad(jnp.float32, 16)
    floor = np.linalg.norm(bf(want) - want) / np.linalg.norm(want)  # the float32 gradient rounded to bf16 once
    err = np.linalg.norm(grad(jnp.bfloat16, 16) - want) / np.linalg.norm(want)  # 256 chunks
    assert err < 2 * floor, (err, floor)
