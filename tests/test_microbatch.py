"""Gradient accumulation (config.microbatches): a step over N microbatches equals the un-split step (loss, metrics,
gradient norms, updated parameters, MoE bias update) in the dense, warm-up and sparse stages; on 8 simulated CPU
devices (subprocess) splitting the batch into microbatches moves no data (tests/test_multiprocess.py runs its
sharded and 2-process steps with 2 microbatches against the un-split single-device step); bad values are refused
at config time naming the fields."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import child_xla_flags
from flax import nnx

from dsv32_jax.train import steps
from dsv32_jax.train.config import check_batch_mesh, default_config
from dsv32_jax.train.optimizer import MasterState, group_config, learning_rate_schedule
from dsv32_jax.train.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, SEQ = 8, 16


def tiny_config(stage, mesh="", mtp=True):
    """One MoE layer (+ the MTP layer), with MTP, balance loss and the bias update on (every accumulated quantity).
    AdamW's eps = 1 and lr = 1: its first update is then ~ the gradient (not lr x its sign), large enough against
    the parameters' float32 rounding, so the updated parameters compare the gradients themselves."""
    c = default_config()
    c.stage, c.mesh, c.steps = stage, mesh, 1
    c.data.seq_len, c.data.batch_size = SEQ, BATCH
    c.optimizer.schedule, c.optimizer.warmup_steps, c.optimizer.eps, c.optimizer.lr = "constant", 0, 1.0, 1.0
    c.loss.mtp_weight, c.loss.balance_weight, c.loss.bias_update_speed = 0.3, 1e-2, 1e-2
    c.model_overrides = {"index_topk": 4, "num_hidden_layers": 1, "first_k_dense_replace": 0,
                         "initializer_range": 0.3, "num_nextn_predict_layers": int(mtp)}
    return c


def random_batch(rng, vocab):
    """Packed rows: documents of random lengths (segment ids, positions restarting, a few padding tails), so the
    token counts differ between microbatches and per-microbatch means would not average to the batch's."""
    tokens = rng.integers(0, vocab, (BATCH, SEQ)).astype(np.int32)
    seg = np.zeros((BATCH, SEQ), np.int32)
    pos = np.zeros((BATCH, SEQ), np.int32)
    for b in range(BATCH):
        end = SEQ - rng.integers(0, SEQ // 2) * (b % 3 == 0)
        cuts = sorted(rng.choice(np.arange(1, end), size=rng.integers(0, 3), replace=False))
        for i, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, end])):
            seg[b, lo:hi], pos[b, lo:hi] = i + 1, np.arange(hi - lo)
    loss_mask = ((seg > 0) & (np.roll(seg, -1, 1) == seg)).astype(np.float32)
    loss_mask[:, -1] = 0
    return {"tokens": tokens, "targets": np.roll(tokens, -1, 1), "segment_ids": seg, "positions": pos,
            "loss_mask": loss_mask}


def step_fn(trainer, graphdef, microbatches):
    c = trainer.config
    return jax.jit(lambda state, batch: steps.lm_train_step(
        state, batch, graphdef=graphdef, stage=trainer.stage, trainable=trainer.filter,
        weights=steps.LossWeights.from_config(c.loss), model_cfg=trainer.cfg,
        lr_schedule=learning_rate_schedule(c.optimizer),
        indexer_lr_schedule=learning_rate_schedule(group_config(c.optimizer, "indexer")), microbatches=microbatches))


def flat(state):
    return {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.traversals.flatten_mapping(nnx.to_pure_dict(state)).items()}


@pytest.mark.parametrize("stage,microbatches", [pytest.param("dense", 2, marks=pytest.mark.heavy), ("warmup", 2),
                                                pytest.param("sparse", 4, marks=pytest.mark.heavy)])  # 15 s, 37 s
def test_microbatched_step_equals_the_unsplit_step(tmp_path, rng, stage, microbatches):
    """The sparse stage with the MTP layer (every loss), the others without it (less to compile)."""
    trainer = Trainer(tiny_config(stage, mtp=stage == "sparse"), str(tmp_path / "w"), allocate=False)
    graphdef, state = nnx.split(trainer._build())  # eager init: no compile besides the two steps
    batch = {k: jnp.asarray(v) for k, v in random_batch(rng, trainer.cfg.vocab_size).items()}
    want_state, want = jax.device_get(step_fn(trainer, graphdef, 1)(state, batch))
    got_state, got = jax.device_get(step_fn(trainer, graphdef, microbatches)(state, batch))
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=1e-7, err_msg=key)
    assert want["grad_norm"] > 0 and (stage != "sparse" or want["mtp_loss"] > 0)
    before, want_p, got_p = flat(state[0]), flat(want_state[0]), flat(got_state[0])
    moved = [k for k in want_p if not np.array_equal(want_p[k], before[k])]
    assert any(k.endswith("ffn/bias") for k in moved) == (stage != "warmup")  # the bias update ran (from summed loads)
    for key in moved:  # the update agrees to 1e-4 of its size, beyond float32 rounding of the parameters
        update = want_p[key] - before[key]
        tol = 1e-4 * np.abs(update).max() + 4 * np.spacing(np.abs(before[key]).max())
        np.testing.assert_allclose(got_p[key] - before[key], update, rtol=0, atol=tol, err_msg=key)
    assert set(moved) == {k for k in got_p if not np.array_equal(got_p[k], before[k])}


SPLIT_SCRIPT = r"""
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
from dsv32_jax.model import sharding as shd
from dsv32_jax.train import steps

mesh = shd.make_mesh("fsdp:4,tensor:2")
bsh = steps.lm_batch_sharding(mesh)
batch = {k: jax.ShapeDtypeStruct((16, 8), jnp.int32, sharding=bsh) for k in steps.LM_BATCH_KEYS}


def contiguous(b):  # the naive split, microbatch i = rows [i B/2, (i + 1) B/2): moves rows between devices
    return {k: shd.constrain(x.reshape(2, 8, 8), (None, "batch", "seq")) for k, x in b.items()}


def collectives(fn):
    with shd.use_mesh(mesh):
        compiled = jax.jit(fn).lower(batch).compile()
    hlo = compiled.as_text()
    ops = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
    return [op for op in ops if op in hlo], tuple(compiled.output_shardings["tokens"].spec)


print("SPLIT", collectives(lambda b: steps.split_microbatches(b, 2)))
print("CONTIGUOUS", collectives(contiguous))
"""


def test_microbatch_split_keeps_every_row_on_its_device():
    """[16, 8] rows over fsdp:4 -> [2, 8, 8] microbatches still over fsdp:4, without any collective (taking
    contiguous halves instead needs one)."""
    env = dict(os.environ, XLA_FLAGS=child_xla_flags("--xla_force_host_platform_device_count=8"), JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", SPLIT_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    assert "SPLIT ([], (None, 'fsdp'" in res.stdout, res.stdout
    assert "CONTIGUOUS ([]" not in res.stdout, res.stdout  # the check sees data move when it does


@pytest.mark.parametrize("micro", [3, 0, 16])
def test_bad_microbatches_are_refused_naming_the_fields(micro):
    c = tiny_config("sparse", mesh="fsdp:4")
    c.microbatches = micro
    with pytest.raises(ValueError, match=rf"config.microbatches={micro} .* 2 rows per shard of "
                                         rf"config.data.batch_size=8 .*config.mesh='fsdp:4'"):
        check_batch_mesh(c, num_devices=4)
    c.microbatches = 2
    assert check_batch_mesh(c, num_devices=4)["fsdp"] == 4


@pytest.mark.heavy  # >= 20 s on 2 AMD EPYC cores (2026-12-01): out of make test's 15 minutes
def test_bf16_model_hands_its_master_weights_the_float32_accumulated_gradient(tmp_path, rng):
    """param_dtype bf16 with fp32 master weights (config.optimizer.master_dtype): the sum over microbatches reaches
    AdamW unrounded. Its first moment after one step is (1 - b1) x the float32 sum of the microbatches' gradients
    (each taken here on its own rows, in the parameters' dtype, as the scan does); rounding the sum to bf16 first
    (the old behaviour) is off by up to 2^-9 of it."""
    c = tiny_config("dense", mtp=False)
    c.param_dtype = "bfloat16"  # computing in float32 (c.dtype): the microbatches' bf16 gradients do not depend on
    # how XLA fuses the scan's body, and their float32 sum is exact
    c.optimizer.grad_clip = 0.0  # the moment then holds the gradient itself
    trainer = Trainer(c, str(tmp_path / "w"), allocate=False)
    model, optimizer = built = trainer._build()
    graphdef, state = nnx.split(built)
    assert isinstance(optimizer.opt_state, MasterState)
    batch = {k: jnp.asarray(v) for k, v in random_batch(rng, trainer.cfg.vocab_size).items()}
    new_state, _ = jax.device_get(step_fn(trainer, graphdef, 2)(state, batch))

    weights = steps.LossWeights.from_config(c.loss)
    totals = steps.losses.batch_totals(batch, 0)
    objective = lambda m, b, t: steps.lm_objective(m, b, t, stage="dense", weights=weights, model_cfg=trainer.cfg)
    micro = steps.split_microbatches(batch, 2)
    want = None
    for i in range(2):
        grads, _, _ = steps.accumulate_grads(model, jax.tree.map(lambda x: x[i], micro), totals, 1,
                                             trainable=trainer.filter, objective=objective, num_experts=None)
        grads = jax.tree.map(lambda g: np.asarray(g, np.float64), nnx.to_pure_dict(grads))
        want = grads if want is None else jax.tree.map(np.add, want, grads)
    b1 = c.optimizer.b1
    mu = nnx.to_pure_dict(new_state[1])["opt_state"]["inner"]["inner_states"]["main"]
    checked = close_total = 0
    for path, g in nnx.traversals.flatten_mapping(want).items():
        got = [np.asarray(v) for p, v in nnx.traversals.flatten_mapping(mu).items()
               if p[-len(path):] == path and "mu" in map(str, p)]
        assert len(got) == 1, path
        assert got[0].dtype == np.float32
        want_mu, nonzero = (1 - b1) * g, g != 0
        close = np.isclose(got[0], want_mu, rtol=2e-5, atol=0)[nonzero]
        # all but a rare bf16 rounding flip of one microbatch's gradient (its float32 forward differs from the
        # scan's in the last bits): rounding the sum to bf16 moves about half of the elements by up to 2^-9
        np.testing.assert_allclose(got[0], want_mu, rtol=2 ** -7, atol=2 ** -8 * np.abs(want_mu).max(),
                                   err_msg=str(path))
        close_total += close.sum()
        checked += close.size
    print(f"first moments equal to (1 - b1) x the float32 sum: {close_total} of {checked}")
    assert checked > 10_000 and close_total > 0.995 * checked
