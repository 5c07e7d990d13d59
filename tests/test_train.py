"""Training stages on the tiny config (CPU): warm-up (eq. 3) and sparse (eq. 4) acceptance, frozen weights,
exact resume after SIGKILL / SIGTERM, config files, curves (sharded and multi-process equivalence: test_multiprocess.py)."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx
from ml_collections import config_flags

from dsv32_jax.model import sharding as shd
from dsv32_jax.train import data as data_lib
from dsv32_jax.train.metrics import read_jsonl
from dsv32_jax.train.plot import find_runs, plot
from dsv32_jax.train.trainer import Trainer
from tests.learning import perturb_params, run_seed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name, **overrides):
    path = os.path.join(ROOT, "configs", f"{name}.py")
    module = config_flags.config_flags._LoadConfigModule(name, path)  # noqa: SLF001 (same loader as the CLI)
    config = module.get_config()
    config.eval.every = 0  # held-out evaluation off unless a test asks for it (tests/test_eval.py)
    return override(config, **overrides)


def override(config, **fields):
    """config with each dotted field ("optimizer.lr") set, in place."""
    for key, value in fields.items():
        target = config
        *parents, leaf = key.split(".")
        for p in parents:
            target = target[p]
        target[leaf] = value
    return config


def small_run(stage, workdir, steps, init_from="", **extra):
    """A quick run: random init with large weights so attention is peaked (no dense pre-training needed)."""
    config = load_config(f"{stage}_tiny", steps=steps, init_from=init_from, log_every=1000, **{
        "data.seq_len": 64, "data.batch_size": 4, "checkpoint.every": steps, "checkpoint.use_async": False,
        "optimizer.warmup_steps": 2, **extra})
    if not init_from:
        config.model_overrides = {"initializer_range": 0.3}
    trainer = Trainer(config, workdir)
    it = data_lib.make_iterator(data_lib.DataConfig(**config.data.to_dict()), vocab_size=trainer.cfg.vocab_size)
    return trainer, it


def window(history, key, first):
    vals = [h[key] for h in history]
    return float(np.mean(vals[:5] if first else vals[-5:]))


@pytest.fixture(scope="session")
def stages(tmp_path_factory):
    """Warm-up (80 steps) then sparse (40 steps) from it; seeds from the fixture's name (tests/learning.py), initial
    parameters optionally perturbed (DSV32_TEST_PERTURB)."""
    root = tmp_path_factory.mktemp("stages")
    seed = run_seed("tests/test_train.py::stages")
    warm, it = small_run("warmup", str(root / "warmup"), 80, **{"optimizer.lr": 3e-3, "seed": seed, "data.seed": seed})
    perturb_params(warm.ts.state[0])
    before = jax.device_get(nnx.to_pure_dict(warm.ts.state[0]))
    warm_hist = warm.fit(it)
    after = jax.device_get(nnx.to_pure_dict(warm.ts.state[0]))
    sparse, it = small_run("sparse", str(root / "sparse"), 40, init_from=str(root / "warmup"),
                           **{"optimizer.lr": 3e-3, "seed": seed, "data.seed": seed + 5})
    sparse_hist = sparse.fit(it)
    return dict(root=root, warm_hist=warm_hist, before=before, after=after, sparse_hist=sparse_hist)


@pytest.mark.heavy
@pytest.mark.xdist_group("stages")
def test_warmup_halves_indexer_kl_and_raises_captured_mass(stages):
    """Mean of the first vs the last 5 steps. Measured over DSV32_TEST_SEED=0..4 and 0..1 with DSV32_TEST_PERTURB=1e-6
    (2026-11-24, 2-core CPU), 7 runs: KL 2.94-3.36 -> 1.20-1.34 (ratio 0.39-0.45, bound 0.5); captured mass
    0.382-0.392 -> 0.461-0.495 (gain 0.076-0.106, bound 0.05). The warm-up is a regression onto a fixed target, so a
    1e-6 perturbation moves these figures by < 1e-4. Re-measured after the pipeline moved to grain's window shuffle
    (other batches), DSV32_TEST_SEED=0..2: KL 2.72-3.27 -> 1.19-1.28 (ratio 0.39-0.44), mass gain 0.080-0.105."""
    h = stages["warm_hist"]
    kl0, kl1 = window(h, "indexer_kl", True), window(h, "indexer_kl", False)
    m0, m1 = window(h, "captured_mass", True), window(h, "captured_mass", False)
    print(f"warm-up: KL {kl0:.4f} -> {kl1:.4f}, captured mass {m0:.3f} -> {m1:.3f}")
    assert kl1 <= 0.5 * kl0
    assert m1 > m0 + 0.05


@pytest.mark.heavy
@pytest.mark.xdist_group("stages")
def test_warmup_changes_only_the_indexer(stages):
    flat_before = dict(nnx.traversals.flatten_mapping(stages["before"]))
    flat_after = dict(nnx.traversals.flatten_mapping(stages["after"]))
    changed_indexer = 0
    for path, value in flat_before.items():
        same = np.array_equal(np.asarray(value), np.asarray(flat_after[path]))
        if "indexer" in [str(p) for p in path]:
            changed_indexer += not same
        else:
            assert same, f"frozen weight {path} changed during warm-up"
    assert changed_indexer > 0


@pytest.mark.heavy
@pytest.mark.xdist_group("stages")
def test_sparse_stage_lowers_lm_loss(stages):
    """Mean of the first vs the last 5 of 40 steps. Measured over DSV32_TEST_SEED=0..9 (2026-11-27, 2-core CPU):
    LM loss 7.85-8.31 -> 2.69-3.45, a drop of min 4.53, median 4.80, max 5.50 (bound: a drop of 3.5 and an end
    below 4.0); the sparse indexer KL of eq. 4 0.57-0.63 -> 0.39-0.52, a ratio of min 0.675, median 0.74, max 0.856
    (bound 0.93). Mutation: the KL's sign flipped in the sparse loss (train/steps.py `loss - indexer_weight * kl`):
    KL 0.62 -> 4.47, fails. The KL left out of the loss (`+ 0.0 * kl`) still passes here (ratio 0.885 and 0.891 at
    DSV32_TEST_SEED=0, 1: the main model's attention adapts to the selection), too close to the correct runs for a
    bound: tests/test_sparse_objective.py catches it exactly."""
    h = stages["sparse_hist"]
    lm0, lm1 = window(h, "lm_loss", True), window(h, "lm_loss", False)
    kl0, kl1 = window(h, "indexer_kl", True), window(h, "indexer_kl", False)
    print(f"sparse: LM loss {lm0:.4f} -> {lm1:.4f}, indexer KL {kl0:.4f} -> {kl1:.4f}")
    assert all(np.isfinite(x["indexer_kl"]) and np.isfinite(x["lm_loss"]) for x in h)
    assert lm1 < lm0 - 3.5 and lm1 < 4.0
    assert kl1 < 0.93 * kl0


@pytest.mark.heavy
@pytest.mark.xdist_group("stages")
def test_curves_png(stages, tmp_path):
    out = str(tmp_path / "curves.png")
    panels = plot(find_runs([str(stages["root"])]), out)
    assert {"indexer_kl", "captured_mass", "lm_loss"} <= set(panels)
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_curves_in_the_format_out_names_with_the_eval_loss(tmp_path):
    """`eval_loss` (the LM stages' held-out loss) had no panel, and a --out of another extension got PNG bytes (the
    temporary file's name said .png); a format matplotlib cannot write is a named error that leaves no file."""
    runs = {"r": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5, "eval_loss": 1.7}, {"step": 3, "loss": 1.2}]}
    for name, magic in (("c.pdf", b"%PDF"), ("c.svg", b"<?xml"), ("c.png", b"\x89PNG"), ("c", b"\x89PNG")):
        assert plot(runs, str(tmp_path / name)) == ["loss", "eval_loss"]
        assert (tmp_path / name).read_bytes().startswith(magic), name
    with pytest.raises(ValueError, match=r"^--out=.*c\.xyz: Format 'xyz' is not supported"):
        plot(runs, str(tmp_path / "c.xyz"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "c.pdf", "c.png", "c.svg"]


CLI = [sys.executable, "-m", "dsv32_jax.train.main", "--config=configs/dense_tiny.py", "--config.steps=10",
       "--config.checkpoint.every=2", "--config.data.seq_len=32", "--config.data.batch_size=4",
       "--config.log_every=1", "--config.optimizer.warmup_steps=2", "--config.eval.every=0"]


def losses_by_step(workdir):
    rows = {}
    for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")):
        rows[r["step"]] = r["loss"]  # resumed steps are re-logged: the last value counts
    return rows


def wait_for_checkpoint(workdir, step, proc, timeout=240):
    path = os.path.join(workdir, "checkpoints", str(step))
    start = time.time()
    while not os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA")):
        assert proc.poll() is None, "training exited before the checkpoint"
        assert time.time() - start < timeout
        time.sleep(0.2)


@pytest.mark.heavy
def test_resume_after_sigkill_and_sigterm_matches_uninterrupted(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1")  # a crash prints its Python stack
    ref = str(tmp_path / "ref")
    res = subprocess.run(CLI + [f"--workdir={ref}"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    run = str(tmp_path / "run")
    proc = subprocess.Popen(CLI + [f"--workdir={run}"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for_checkpoint(run, 4, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(losses_by_step(run))
    assert killed_at < 10
    proc = subprocess.Popen(CLI + [f"--workdir={run}"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    wait_for_checkpoint(run, 8, proc)
    proc.send_signal(signal.SIGTERM)  # graceful: saves the current step, exits 0
    assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()[-2000:]
    stopped_at = max(losses_by_step(run))
    assert os.path.isdir(os.path.join(run, "checkpoints", str(stopped_at)))
    res = subprocess.run(CLI + [f"--workdir={run}"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"resumed from {os.path.join(run, 'checkpoints')} step {stopped_at}" in res.stdout + res.stderr
    expected, got = losses_by_step(ref), losses_by_step(run)
    assert sorted(got) == list(range(1, 11))
    for step in range(1, 11):
        assert got[step] == expected[step], f"step {step}: {got[step]} != {expected[step]}"


EXPERIMENTS = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.py")) if not os.path.basename(p).startswith("_"))


@pytest.mark.parametrize("path", EXPERIMENTS)
def test_every_config_builds_its_sharded_state_abstractly(path):
    """Every experiment config parses and builds its (model, optimizer) state abstractly; for the mesh it names,
    the per-device footprint follows from the rule table (the 671B recipes are checked this way)."""
    name = os.path.splitext(os.path.basename(path))[0]
    config = load_config(name, init_from="")
    trainer = Trainer(config, "/nonexistent", allocate=False)
    _, state = trainer.abstract_state()
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.to_pure_dict(state[0])))
    assert params > 0
    if config.mesh:
        sizes = shd.parse_mesh_spec(config.mesh)
        assert -1 not in sizes.values(), "recipe meshes name every axis size"
        per_device = shd.per_device_bytes(state, sizes)
        total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(nnx.to_pure_dict(state)))
        print(f"{name}: {params / 1e9:.2f}B params, {per_device / 2**30:.2f} GiB/device on {config.mesh}")
        assert per_device < total / 8, "the rule table must actually shard the state"
        if name == "warmup_671b":  # bf16 weights, AdamW state for the indexers only: 1.14 GiB
            assert per_device < 2 * 2**30, "671B warm-up state must leave room for activations on 80 GB"
        elif name.endswith("671b"):  # fp32 master + AdamW for all 671B: 60 GiB at 128-way parameter sharding, 5.56
            # GiB with the routed experts split over seq as well (2048-way); the step's temp memory is on top
            # (BENCHMARKS.md, "The 671B recipes": 28.6 GiB for the full 61-layer step)
            assert per_device < 8 * 2**30, "671B state must leave an 80 GB device room for 128K activations"


@pytest.mark.slow
def test_bench_train_smoke(tmp_path):
    """bench/train_step.py --smoke; a case's flags reach the subprocess that runs it (each is recorded in the
    row: a flag the parent forgets to pass, as --mla_bwd_atomic once was, reads False)."""
    out = str(tmp_path / "steps")
    res = subprocess.run([sys.executable, "bench/train_step.py", "--smoke", "--steps=1", f"--out={out}",
                          "--cases=dense:64,sparse:64,sparse:64:mla_bwd_atomic+mla_pds_mgpu+indexer_fp8"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "longest context that fits (sparse): 64" in res.stdout
    with open(out) as f:
        rows = json.load(f)
    flagged = [r for r in rows if r.get("mla_bwd_atomic")]
    assert len(flagged) == 1 and flagged[0]["mla_pds_mgpu"] and flagged[0]["indexer_fp8"]
    assert not flagged[0]["mla_bwd_stored"]


COUNT_STEP_COMPILES = r"""
import logging, sys
sys.path.insert(0, "bench")
import jax
from train_step import make_trainer
compiles = []
class Count(logging.Handler):
    def emit(self, record):
        if "compilation of jit(lm_train_step)" in record.getMessage():
            compiles.append(record.getMessage())
logging.getLogger("jax._src.dispatch").addHandler(Count())
jax.config.update("jax_log_compiles", True)
import argparse
trainer, batch = make_trainer(argparse.Namespace(mode="sparse", model="tiny", dtype="float32", attention="kernel",
                                                 scan=False, layers=0, chunk=32, context=64))
for _ in range(3):
    jax.block_until_ready(trainer.train_step(batch))
print("COMPILES", len(compiles))
"""


@pytest.mark.heavy  # 20 s or more on 2 cores
def test_kernel_step_compiles_once():
    """A fresh process (nothing of Pallas imported yet) runs the sparse stage's step with attention="kernel" three
    times: it must compile once. Mutation (recorded in BUILD.md): without `RunOptions` importing the kernels up front
    (`dsv32_jax.model.options.import_kernels`), the lazy import inside the first trace registers new JAX config
    options, jit's cache key changes, and the second call compiles the whole step again (2 compiles; on an H200 the
    small config's second kernel step took 10-20 s more)."""
    res = subprocess.run([sys.executable, "-c", COUNT_STEP_COMPILES], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "COMPILES 1" in res.stdout, res.stdout[-500:]


@pytest.mark.heavy  # 20 s or more on 2 cores
@pytest.mark.parametrize("source", ["hf", "orbax"])
def test_training_starts_from_a_converted_checkpoint(source, tmp_path):
    """init_from an HF checkpoint directory or its orbax conversion (python -m dsv32_jax.checkpoint.convert hf-to-orbax)."""
    from dsv32_jax.checkpoint.convert import hf_to_orbax

    hf_dir = os.path.join(ROOT, "tests", "fixtures", "hf_long")
    init = hf_dir
    if source == "orbax":
        init = str(tmp_path / "orbax")
        hf_to_orbax(hf_dir, init, dtype="float32")
    config = load_config("sparse_tiny", steps=2, init_from=init, log_every=1000, **{
        "data.seq_len": 32, "data.batch_size": 2, "checkpoint.every": 2, "checkpoint.use_async": False})
    trainer = Trainer(config, str(tmp_path / "run"))
    assert trainer.cfg.hidden_size == 64 and trainer.cfg.index_n_heads == 8  # the fixture's config, not tiny's
    gold = np.load(os.path.join(hf_dir, "golden.npz"))
    np.testing.assert_allclose(np.asarray(trainer.model(jax.numpy.asarray(gold["tokens"]))), gold["logits"],
                               rtol=1e-4, atol=1e-4 * np.abs(gold["logits"]).max())
    it = data_lib.make_iterator(data_lib.DataConfig(**config.data.to_dict()), vocab_size=trainer.cfg.vocab_size)
    history = trainer.fit(it)
    assert len(history) == 2 and all(np.isfinite(h["loss"]) for h in history)


@pytest.mark.heavy  # 20 s or more on 2 cores
def test_init_from_a_workdir_uses_its_recorded_model_config(tmp_path):
    """A workdir trained with a non-default architecture (2 layers, index_topk 4) initializes a run whose config
    names the plain preset: the recorded architecture is built and its trained weights are loaded; overrides of
    non-shape fields still apply on top; a shape-changing override is refused naming the parameter."""
    base = {"data.seq_len": 32, "data.batch_size": 2, "checkpoint.every": 1, "checkpoint.use_async": False}
    first = load_config("dense_tiny", steps=1, log_every=1000, **base)
    first.model_overrides = {"num_hidden_layers": 2, "index_topk": 4}
    trainer = Trainer(first, str(tmp_path / "a"))
    trainer.fit(data_lib.make_iterator(data_lib.DataConfig(**first.data.to_dict()), vocab_size=trainer.cfg.vocab_size))
    trained = jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model)))

    second = Trainer(load_config("sparse_tiny", steps=1, init_from=str(tmp_path / "a"), log_every=1000, **base),
                     str(tmp_path / "b"))
    assert (second.cfg.num_hidden_layers, second.cfg.index_topk) == (2, 4)
    loaded = jax.device_get(nnx.to_pure_dict(nnx.state(second.model)))
    for path, value in nnx.traversals.flatten_mapping(trained).items():
        np.testing.assert_array_equal(nnx.traversals.flatten_mapping(loaded)[path], value, err_msg=str(path))

    third = load_config("sparse_tiny", steps=1, init_from=str(tmp_path / "a"), log_every=1000, **base)
    third.model_overrides = {"index_topk": 2}
    assert Trainer(third, str(tmp_path / "c")).cfg.index_topk == 2
    fourth = load_config("sparse_tiny", steps=1, init_from=str(tmp_path / "a"), log_every=1000, **base)
    fourth.model_overrides = {"num_hidden_layers": 3}
    with pytest.raises(ValueError, match=r"config.init_from=.*missing parameter 'layers/2/.*'.*config.model_overrides="
                                         r"\{'num_hidden_layers': 3\} change the architecture"):
        Trainer(fourth, str(tmp_path / "d"))
