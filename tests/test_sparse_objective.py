"""The sparse stage's objective (eq. 4) splits its gradient exactly: the indexer learns from the KL alone (times
indexer_weight), every other parameter from the LM loss alone (the KL's inputs are detached). The stage-level run
(tests/test_train.py) cannot tell a KL left out of the loss: the main model's attention adapts to the selection and
the KL falls nearly as far (ratio 0.885-0.891 against 0.675-0.856)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_microbatch import random_batch, tiny_config

from dsv32_jax.train import losses, steps
from dsv32_jax.train.trainer import Trainer


def test_sparse_objective_trains_the_indexer_on_the_kl_and_the_rest_on_the_lm_loss(tmp_path, rng):
    """Gradients of `steps.lm_objective` (sparse stage, indexer_weight 0.7, no MTP / balance terms) against the
    gradients of its two parts computed apart: indexer leaves = 0.7 x d KL (non-zero), all others = d LM loss.
    Mutations: the KL left out of the sparse loss (train/steps.py `loss = loss + 0.0 * kl`): the indexer check
    fails; the attention target of the sparse KL not detached (indexer_loss.py `sparse_indexer_kl`'s p_all without
    stop_gradient): the KL reaches the main parameters and the LM-only check fails. 16-17 s on 2 cores.
    The indexer leaves' absolute tolerance is 1e-6 of each leaf's largest entry: with the scatter-free key gradient
    (`indexer_loss.selected_scores`, two matmuls) 0.7 x g and the gradient of 0.7 x KL differ by fp32 rounding
    where a sum nearly cancels (one entry of 2048 in wk: 2.4e-9 of a leaf whose largest entry is 1.6e-2)."""
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
        return losses.indexer_kl(aux, (batch["segment_ids"] > 0).astype(jnp.float32))[0]

    g, g_lm, g_kl = (dict(nnx.traversals.flatten_mapping(nnx.to_pure_dict(part(f)))) for f in (objective, lm, kl))
    n_indexer = 0
    for path, value in g.items():
        value = np.asarray(value)
        if "indexer" in map(str, path):
            n_indexer += 1
            want = 0.7 * np.asarray(g_kl[path])  # atol: fp32 order of summation on entries that nearly cancel
            np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-6 * np.abs(want).max(), err_msg=str(path))
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
