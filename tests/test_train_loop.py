"""The shared training skeleton without training: learning-rate schedules vs their closed form, the loop's stop on
SIGTERM / SIGINT, metrics sinks without tensorboardX, the tqdm console line, and the entry point's newcomer paths
(no flags; a missing config.init_from)."""

import io
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from dsv32_jax.train import checkpointing, loop, metrics as metrics_lib
from dsv32_jax.train.config import InitFromError, check_init_from, default_config
from dsv32_jax.train.optimizer import learning_rate_schedule
from tests.test_train import ROOT, load_config


def reference_lr(step, lr, schedule, warmup, decay, final):
    """Linear warm-up 0 -> lr over `warmup` steps, then constant or cosine to lr * final at step `decay`."""
    if step < warmup:
        return lr * step / warmup
    if schedule == "constant":
        return lr
    t = min(step - warmup, max(decay - warmup, 1)) / max(decay - warmup, 1)
    return lr * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * t)))


def previous_schedule(cfg):
    """The schedule as it was built by hand before optax's warmup_cosine_decay_schedule (linear + cosine pieces)."""
    import optax
    warmup = max(int(cfg.warmup_steps), 0)
    if cfg.schedule == "constant":
        decay = optax.constant_schedule(cfg.lr)
    else:
        decay = optax.cosine_decay_schedule(cfg.lr, max(int(cfg.decay_steps) - warmup, 1), alpha=cfg.final_lr_fraction)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), decay], [warmup])


@pytest.mark.parametrize("schedule,lr,warmup,decay,final", [
    ("cosine", 1e-3, 10, 100, 0.1), ("cosine", 3e-3, 2, 300, 0.1), ("cosine", 1e-3, 0, 50, 0.0),
    ("cosine", 2e-4, 2000, 10000, 0.05), ("cosine", 1e-3, 5, 3, 0.1), ("constant", 1e-3, 5, 100, 0.1),
    ("constant", 3e-3, 0, 100, 0.1)])
def test_schedule_matches_the_closed_form_at_every_step(schedule, lr, warmup, decay, final):
    """float64: the closed form to 1e-7 relative; float32 (training): the previous hand-built schedule, same bits
    up to 1e-7 relative."""
    cfg = ml_collections.ConfigDict(dict(lr=lr, schedule=schedule, warmup_steps=warmup, decay_steps=decay,
                                         final_lr_fraction=final))
    steps = np.arange(max(decay, warmup) + 20)
    with jax.enable_x64(True):
        got = np.asarray(jax.vmap(learning_rate_schedule(cfg))(jnp.asarray(steps)))
        assert got.dtype == np.float64
    want = np.array([reference_lr(int(s), lr, schedule, warmup, decay, final) for s in steps])
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=0)
    new = np.asarray(jax.vmap(learning_rate_schedule(cfg))(jnp.asarray(steps, jnp.int32)))
    old = np.asarray(jax.vmap(previous_schedule(cfg))(jnp.asarray(steps, jnp.int32)))
    assert new.dtype == np.float32
    np.testing.assert_allclose(new, old, rtol=1e-7, atol=0)


@pytest.mark.parametrize("lr,warmup,hold,decay,final", [(3e-3, 10, 800, 1200, 0.1), (1e-3, 0, 5, 9, 0.0),
                                                        (2e-4, 3, 3, 50, 0.5)])
def test_hold_steps_start_the_cosine_later(lr, warmup, hold, decay, final):
    """hold_steps (warmup-stable-decay): warm-up to lr, lr until hold_steps, then the cosine to lr * final at
    decay_steps over decay_steps - hold_steps (float64 closed form, 1e-7 relative); hold_steps outside
    [warmup_steps, decay_steps) is refused naming config.optimizer."""
    cfg = ml_collections.ConfigDict(dict(lr=lr, schedule="cosine", warmup_steps=warmup, hold_steps=hold,
                                         decay_steps=decay, final_lr_fraction=final))

    def want(s):
        if s < warmup:
            return lr * s / warmup
        if s < hold:
            return lr
        t = min(s - hold, decay - hold) / (decay - hold)
        return lr * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * t)))

    steps = np.arange(decay + 20)
    with jax.enable_x64(True):
        got = np.asarray(jax.vmap(learning_rate_schedule(cfg))(jnp.asarray(steps)))
    np.testing.assert_allclose(got, [want(int(s)) for s in steps], rtol=1e-7, atol=0)
    for bad in (dict(hold_steps=decay), dict(hold_steps=warmup - 1) if warmup else dict(hold_steps=decay + 1)):
        with pytest.raises(ValueError, match="config.optimizer"):
            learning_rate_schedule(ml_collections.ConfigDict({**cfg.to_dict(), **bad}))


def test_unknown_schedule_names_the_field():
    cfg = default_config().optimizer
    cfg.schedule = "linear"
    with pytest.raises(ValueError, match="config.optimizer.schedule"):
        learning_rate_schedule(cfg)


class FakeStage:
    """A stage whose step sends a signal to this process at step `signal_at`."""

    def __init__(self, signum, signal_at):
        self.step, self.signum, self.signal_at, self.saved = 0, signum, signal_at, []

    def restore_checkpoint(self, mngr, step):
        raise AssertionError("fresh workdir: nothing to restore")

    def run_step(self):
        self.step += 1
        if self.step == self.signal_at:
            os.kill(os.getpid(), self.signum)
        return {"loss": 1.0 / self.step}

    def save_checkpoint(self, mngr, step, force):
        self.saved.append((step, force))
        return True


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_loop_stops_after_a_signal_and_saves_that_step(signum, tmp_path):
    config = load_config("dense_tiny", steps=10, log_every=1000)
    before = signal.getsignal(signum)
    stage = FakeStage(signum, signal_at=3)
    history = loop.run_loop(stage, workdir=str(tmp_path), config=config, keys=("loss",), desc="fake")
    assert [h["step"] for h in history] == [1, 2, 3]
    assert stage.saved == [(1, False), (2, False), (3, True)]  # the step after the signal is saved, forced
    assert signal.getsignal(signum) is before
    assert len(metrics_lib.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))) == 3


class ExhaustingStage(FakeStage):
    """A stage whose data runs out (a finite data.num_epochs) after `batches` steps; every `save_every` steps saved."""

    def __init__(self, batches, save_every=1000):
        super().__init__(None, signal_at=None)
        self.batches, self.save_every = batches, save_every

    def run_step(self):
        if self.step == self.batches:
            raise loop.DataExhausted("the training data ran out after data.num_epochs=1 epoch(s)")
        return super().run_step()

    def save_checkpoint(self, mngr, step, force):
        if force or step % self.save_every == 0:
            self.saved.append((step, force))
        return True


@pytest.mark.parametrize("save_every,saved", [(1000, [(3, True)]), (3, [(3, False)])])
def test_loop_stops_where_finite_data_runs_out_and_saves_that_step(save_every, saved, tmp_path, monkeypatch, caplog):
    """A finite data.num_epochs that ran out before config.steps ended the run in a bare StopIteration from grain,
    losing the steps since the last checkpoint (and a rerun resumed into the same crash). The loop stops at the last
    finished step, saves it unless it is saved already, and says so."""
    config = load_config("dense_tiny", steps=10, log_every=1000)
    stage = ExhaustingStage(batches=3, save_every=save_every)
    monkeypatch.setattr(checkpointing, "latest_step", lambda mngr: stage.saved[-1][0] if stage.saved else None)
    with caplog.at_level(logging.WARNING):
        history = loop.run_loop(stage, workdir=str(tmp_path), config=config, keys=("loss",), desc="fake")
    assert [h["step"] for h in history] == [1, 2, 3]
    assert stage.saved == saved
    assert "ran out after data.num_epochs=1 epoch(s) at step 3 of config.steps=10: stopped there" in caplog.text


def test_data_that_runs_out_before_the_first_step_is_an_error(tmp_path):
    config = load_config("dense_tiny", steps=10, log_every=1000)
    stage = ExhaustingStage(batches=0)
    with pytest.raises(loop.DataExhausted, match=r"epoch\(s\) before the first step: one epoch holds no full batch"):
        loop.run_loop(stage, workdir=str(tmp_path), config=config, keys=("loss",), desc="fake")
    assert stage.saved == []


def test_trainer_step_names_the_data_that_ran_out():
    """Trainer.run_step turns the data iterator's StopIteration into the loop's DataExhausted (a StopIteration
    escaping a generator frame above it would also become a RuntimeError)."""
    from types import SimpleNamespace

    from dsv32_jax.train.trainer import Trainer

    fake = SimpleNamespace(_data_iter=iter(()), config=load_config("dense_tiny", **{"data.num_epochs": 2}))
    with pytest.raises(loop.DataExhausted, match=r"^the training data ran out after data\.num_epochs=2 epoch\(s\)$"):
        Trainer.run_step(fake)


def test_trainer_step_reports_the_time_it_waited_for_its_batch():
    """data_wait_s is the time next() took (a reader 0.5 s slow shows it), apart from step_time_s, which times only
    the step (a step that sleeps 0.05 s); tokens_per_s is the step's."""
    import time as time_mod
    from types import SimpleNamespace

    from dsv32_jax.train.trainer import Trainer

    def slow():
        while True:
            time_mod.sleep(0.5)
            yield {"tokens": np.zeros((2, 4), np.int32)}

    def train_step(batch):
        time_mod.sleep(0.05)
        return {"loss": np.float32(1.0)}

    fake = SimpleNamespace(_data_iter=slow(), config=load_config("dense_tiny", **{"eval.every": 0}),
                           train_step=train_step, _tokens_per_step=8, _peak=None)
    m = Trainer.run_step(fake)
    assert m["data_wait_s"] >= 0.5 and 0.05 <= m["step_time_s"] < 0.5, m
    assert m["tokens_per_s"] == pytest.approx(8 / m["step_time_s"])


def test_finite_epochs_over_several_data_readers_are_refused(tmp_path, monkeypatch):
    """Several processes reading their own rows run out a few batches apart: one that stops would hang the others
    in the next collective, so a finite data.num_epochs is refused there (one reader: allowed)."""
    from types import SimpleNamespace

    from dsv32_jax.train import run as run_lib

    made = []
    monkeypatch.setattr(run_lib.data_lib, "make_iterator", lambda *a, **k: made.append(1))
    for shard, ok in (((0, 2), False), ((0, 1), True)):
        monkeypatch.setattr(run_lib, "Trainer", lambda *a, **k: SimpleNamespace(data_shard=shard,
                                                                                 cfg=SimpleNamespace(vocab_size=256)))
        config = load_config("dense_tiny", **{"data.num_epochs": 1})
        if ok:
            run_lib.setup(config, str(tmp_path / "w"))
            assert made == [1]
        else:
            with pytest.raises(run_lib.SetupError, match=r"^data\.num_epochs=1 with 2 processes reading their own "
                                                         r"rows: .*use data\.num_epochs=None"):
                run_lib.setup(config, str(tmp_path / "w"))
            assert made == [] and not os.path.exists(tmp_path / "w")


class RefusingStage(ExhaustingStage):
    def run_step(self):
        if self.step == self.batches:
            raise loop.DataError("training data: f.jsonl, line 8: text field 'text' missing (keys: ['txt'])")
        return FakeStage.run_step(self)


@pytest.mark.parametrize("batches,saved,where", [(3, [(3, True)], "step 3 is saved in"), (0, [], "no step was run")])
def test_a_refused_record_mid_run_saves_the_last_step_and_names_the_batch(batches, saved, where, tmp_path,
                                                                         monkeypatch):
    """A record the pipeline refuses deep in a file (the message names file and line) was a traceback that lost
    the steps since the last checkpoint: the loop saves the last finished step and re-raises it as one line."""
    config = load_config("dense_tiny", steps=10, log_every=1000)
    stage = RefusingStage(batches=batches)
    monkeypatch.setattr(checkpointing, "latest_step", lambda mngr: stage.saved[-1][0] if stage.saved else None)
    with pytest.raises(loop.DataError, match=rf"^training data: f\.jsonl, line 8: .* \(reading step {batches + 1}'s "
                                             rf"batch; {where}"):
        loop.run_loop(stage, workdir=str(tmp_path), config=config, keys=("loss",), desc="fake")
    assert stage.saved == saved


class DivergingStage(FakeStage):
    """A stage whose metric `key` turns NaN / inf at step `bad_at`; every step is saved."""

    def __init__(self, key, value, bad_at):
        super().__init__(None, signal_at=None)
        self.key, self.value, self.bad_at = key, value, bad_at

    def run_step(self):
        metrics = {"loss": 1.0, "grad_norm": 1.0, "tokens_per_s": float("inf")}  # (not guarded: may be inf)
        self.step += 1
        if self.step == self.bad_at:
            metrics[self.key] = self.value
        return metrics


@pytest.mark.parametrize("key,value,bad_at,where", [
    ("loss", float("nan"), 3, r"The last checkpoint, step 2 in .*checkpoints, holds the parameters this loss was "
                              r"computed on: .* resume from an earlier step \(saved: 1\)"),
    ("grad_norm", float("inf"), 2, r"The last checkpoint, step 1 in .* earlier step \(none is saved\)"),
    ("loss", float("nan"), 1, r"No checkpoint was saved"),
    # the warm-up's loss is the indexer KL alone: a NaN lm_loss beside it is still a NaN row; the three latest
    # earlier checkpoints are named
    ("lm_loss", float("nan"), 6, r"The last checkpoint, step 5 in .* earlier step \(saved: 2, 3, 4\) by moving"),
    ("sft_loss", float("-inf"), 2, r"The last checkpoint, step 1 in .* earlier step \(none is saved\)"),
])
def test_a_non_finite_loss_or_gradient_norm_stops_the_run_before_logging_or_saving_it(key, value, bad_at, where,
                                                                                      tmp_path, monkeypatch):
    """A diverged run (lr 1e30: loss NaN from step 2) ran to config.steps, exited 0, wrote NaN rows (not JSON) to
    metrics.jsonl and saved NaN weights that generation and the HF export then used (red-team audit). The loop
    stops at the first non-finite loss or gradient norm, naming the step and the last saved checkpoint."""
    config = load_config("dense_tiny", steps=10, log_every=1000)
    stage = DivergingStage(key, value, bad_at)
    monkeypatch.setattr(checkpointing, "saved_steps", lambda mngr: [s for s, _ in stage.saved])
    with pytest.raises(loop.NonFinite, match=rf"^step {bad_at}: {key}={value} is not finite; the run stopped "
                                             rf"without logging or saving it\. {where}"):
        loop.run_loop(stage, workdir=str(tmp_path / "w"), config=config, keys=("loss",), desc="fake")
    assert [s for s, _ in stage.saved] == list(range(1, bad_at))
    if bad_at > 1:
        rows = metrics_lib.read_jsonl(str(tmp_path / "w" / "metrics.jsonl"))
        assert [r["step"] for r in rows] == list(range(1, bad_at))
    else:  # (nothing was logged: the fresh workdir goes, as for a run refused at its first batch)
        assert not os.path.exists(tmp_path / "w")


def test_saved_steps_lists_the_finished_checkpoints_ascending_with_a_save_in_flight(tmp_path):
    """The non-finite note names the checkpoints there are: the last one it names is the newest (the one the loss
    came from), so the list is ascending and holds a save still in flight (async checkpointing)."""
    c = ml_collections.ConfigDict(dict(every=1, keep=4, use_async=True))
    mngr = checkpointing.manager(str(tmp_path), c)
    try:
        for step in (2, 5, 7, 9, 11):
            checkpointing.save(mngr, step, arrays={"params": {"w": np.full((256, 256), step, np.float32)}},
                               json={"meta": {"step": step}}, force=True)
        assert checkpointing.saved_steps(mngr) == [5, 7, 9, 11]  # (keep=4: step 2 went)
    finally:
        mngr.close()


@pytest.mark.heavy  # about 30 s on 2 cores (a CLI run end to end): out of make test's 15 minutes
def test_cli_a_diverged_run_exits_with_its_step_and_names_the_checkpoint_its_loss_came_from(tmp_path):
    """lr 1e30: step 1's update blows the weights up (finite, ~1e30), step 2's loss on them is NaN. The run stops
    there, unsaved; the message says checkpoint 1 holds the parameters that loss came from (it is no good state to
    resume: code review of the first form, which called it the last good checkpoint)."""
    res = cli([f"--config={ROOT}/configs/quickstart.py", "--workdir=w", "--config.steps=4", "--config.eval.every=0",
               "--config.data.seq_len=32", "--config.data.batch_size=2", "--config.optimizer.lr=1e30",
               "--config.optimizer.warmup_steps=0", "--config.checkpoint.every=1"], cwd=tmp_path, timeout=300)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert re.search(r"error: step 2: .*loss=nan.* is not finite; the run stopped without logging or saving it\. "
                     r"The last checkpoint, step 1 in .*, holds the parameters this loss was computed on: unless the "
                     r"batch is at fault they have diverged already; resume from an earlier step \(none is saved\)",
                     res.stderr), res.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "w" / "checkpoints")) == ["1"]
    with open(tmp_path / "w" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1]


@pytest.mark.parametrize("existing", [False, True])
def test_a_run_refused_before_its_first_step_leaves_the_workdir_as_it_found_it(existing, tmp_path, monkeypatch):
    """A run whose first batch held a refused record left an empty metrics.jsonl, an empty checkpoints/ and a
    TensorBoard file without a scalar in the workdir (created by the run). What the run created and did not use
    goes again: a fresh workdir is gone, an existing one keeps only what it held. A run that finished a step keeps
    its metrics and checkpoints."""
    config = load_config("dense_tiny", steps=10, log_every=1000)
    workdir = tmp_path / "w"
    if existing:
        workdir.mkdir()
        (workdir / "notes.txt").write_text("mine")
    for batches in (0, 3):
        stage = RefusingStage(batches=batches)
        monkeypatch.setattr(checkpointing, "latest_step", lambda mngr: stage.saved[-1][0] if stage.saved else None)
        with pytest.raises(loop.DataError):
            loop.run_loop(stage, workdir=str(workdir), config=config, keys=("loss",), desc="fake")
        if batches == 0:
            assert (sorted(os.listdir(workdir)) == ["notes.txt"]) if existing else not workdir.exists()
    left = sorted(os.listdir(workdir))
    assert "metrics.jsonl" in left and checkpointing.CHECKPOINTS_DIR in left
    assert [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")] == [1, 2, 3]


def test_setup_writes_nothing_and_a_run_refused_at_its_first_batch_leaves_no_workdir(tmp_path, monkeypatch):
    """setup() used to create the workdir, so run_loop found it existing and a run refused at its first batch left
    it behind, empty. setup writes nothing; the run creates the workdir with its first output and removes it again
    (loop.NewOutputs)."""
    from types import SimpleNamespace

    from dsv32_jax.train import run as run_lib

    config = load_config("dense_tiny", steps=10, log_every=1000, **{"eval.every": 0})
    workdir = tmp_path / "w"
    stage = RefusingStage(batches=0)
    monkeypatch.setattr(run_lib.data_lib, "make_iterator", lambda *a, **k: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(run_lib, "Trainer", lambda *a, **k: SimpleNamespace(
        data_shard=(0, 1), cfg=SimpleNamespace(vocab_size=256),
        fit=lambda it: loop.run_loop(stage, workdir=str(workdir), config=config, keys=("loss",), desc="fake")))
    run = run_lib.setup(config, str(workdir))
    assert not workdir.exists()
    with pytest.raises(loop.DataError, match="no step was run"):
        run()
    assert not workdir.exists()


def test_trainer_step_names_a_refused_record():
    from types import SimpleNamespace

    from dsv32_jax.train.data.sources import MissingFieldError
    from dsv32_jax.train.trainer import Trainer

    def refusing():  # (what the readers raise for a record without the text field: a KeyError)
        raise MissingFieldError("f.jsonl, line 8: text field 'text' missing")
        yield

    fake = SimpleNamespace(_data_iter=refusing(), config=load_config("dense_tiny"))
    with pytest.raises(loop.DataError, match=r"^training data: f\.jsonl, line 8: text field 'text' missing$"):
        Trainer.run_step(fake)


def test_trainer_step_names_a_data_pipeline_that_failed():
    """A grain worker process that died (the OOM killer's SIGKILL) raises a RuntimeError from next(): it is a
    DataError like a refused record, so the loop saves the last finished step before it stops."""
    from types import SimpleNamespace

    from dsv32_jax.train.trainer import Trainer

    def dying():
        raise RuntimeError("Worker 0 died with exit code -9")
        yield

    fake = SimpleNamespace(_data_iter=dying(), config=load_config("dense_tiny"))
    with pytest.raises(loop.DataError, match=r"^training data: the data pipeline failed: Worker 0 died with exit "
                                             r"code -9$"):
        Trainer.run_step(fake)


class PreparingStage(FakeStage):
    """A stage with work before step 1 (the agent's SFT stages) that a signal ends early."""

    def __init__(self, signum):
        super().__init__(signum, signal_at=None)
        self.prepared = []

    def prepare(self, stop):
        self.prepared.append(stop.requested)
        os.kill(os.getpid(), self.signum)
        self.prepared.append(stop.requested)


def test_loop_prepares_at_step_zero_and_a_signal_there_stops_the_run(tmp_path):
    """run_loop calls a stage's prepare(stop) before step 1 with the live stop signal (the agent's recall stage and
    cold start checkpoint their progress and return on it); a signal there runs no step."""
    config = load_config("dense_tiny", steps=10, log_every=1000)
    stage = PreparingStage(signal.SIGTERM)
    history = loop.run_loop(stage, workdir=str(tmp_path), config=config, keys=("loss",), desc="fake")
    assert stage.prepared == [False, True] and history == [] and stage.saved == []


def _traced_steps(directory, name="fake"):
    """The step numbers of the `name` step annotations in every trace under `directory` (jax.profiler's
    plugins/profile/<run>/<host>.trace.json.gz), one list per run directory."""
    import glob
    import gzip
    import json

    runs = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*")))
    out = []
    for run in runs:
        steps = []
        for f in glob.glob(os.path.join(run, "*.trace.json.gz")):
            events = json.load(gzip.open(f))["traceEvents"]
            steps += [int(e["args"]["step_num"]) for e in events if e.get("name") == name and "args" in e]
        out.append(sorted(steps))
    return out


class ProfiledStage(FakeStage):
    """A stage whose step runs a small XLA computation (something for the trace to hold)."""

    def run_step(self):
        jnp.ones((16, 16)).sum().block_until_ready()
        return super().run_step()


def test_profile_traces_the_configured_steps_and_a_resume_the_rest(tmp_path):
    """config.profile: steps [start, start + steps) are traced by jax.profiler, each step annotated with its number
    (TensorBoard's step view), into <workdir>/profile by default; a run resumed inside the window traces what is
    left of it; steps 0 (the default) traces nothing."""
    config = load_config("dense_tiny", steps=5, log_every=1000, **{"profile.start": 2, "profile.steps": 2})
    loop.run_loop(ProfiledStage(signal.SIGTERM, signal_at=None), workdir=str(tmp_path / "a"), config=config,
                  keys=("loss",), desc="fake")
    assert _traced_steps(tmp_path / "a" / "profile") == [[2, 3]]
    resumed = ProfiledStage(signal.SIGTERM, signal_at=None)
    resumed.step = 2  # (as if restored at step 2: steps 3-5 run here, step 3 is left of the window)
    config = load_config("dense_tiny", steps=5, log_every=1000,
                         **{"profile.start": 2, "profile.steps": 2, "profile.dir": str(tmp_path / "own")})
    loop.run_loop(resumed, workdir=str(tmp_path / "b"), config=config, keys=("loss",), desc="fake")
    assert _traced_steps(tmp_path / "own") == [[3]] and not os.path.exists(tmp_path / "b" / "profile")
    loop.run_loop(ProfiledStage(signal.SIGTERM, signal_at=None), workdir=str(tmp_path / "c"),
                  config=load_config("dense_tiny", steps=3, log_every=1000), keys=("loss",), desc="fake")
    assert not os.path.exists(tmp_path / "c" / "profile")


def test_a_signal_inside_the_profile_window_closes_the_trace(tmp_path):
    """A run stopped (SIGTERM) in the middle of the traced steps writes the trace of the steps it ran, and the
    profiler is free again afterwards (a second trace can start: an open one would raise)."""
    config = load_config("dense_tiny", steps=10, log_every=1000, **{"profile.start": 1, "profile.steps": 5})
    loop.run_loop(ProfiledStage(signal.SIGTERM, signal_at=2), workdir=str(tmp_path), config=config,
                  keys=("loss",), desc="fake")
    assert _traced_steps(tmp_path / "profile") == [[1, 2]]
    jax.profiler.start_trace(str(tmp_path / "again"))
    jax.profiler.stop_trace()


def test_second_sigint_interrupts():
    with checkpointing.StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_metrics_writer_without_tensorboardx(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # `import tensorboardX` raises ImportError
    monkeypatch.setattr(metrics_lib, "_TB_MISSING_LOGGED", False)
    with caplog.at_level(logging.INFO, logger="absl"):  # absl's logger, whatever level an earlier test left it at
        for run in ("a", "b"):
            writer = metrics_lib.MetricsWriter(str(tmp_path / run))
            writer.write(1, {"loss": np.float32(2.5)})
            writer.close()
    said = [r.getMessage() for r in caplog.records if "tensorboardX is missing" in r.getMessage()]
    assert len(said) == 1 and "pip install 'dsv32-jax[tensorboard]'" in said[0] and said[0].startswith(
        "TensorBoard events are off")
    assert metrics_lib.read_jsonl(str(tmp_path / "a" / "metrics.jsonl")) == [{"step": 1, "loss": 2.5}]
    assert not os.path.exists(tmp_path / "a" / "tb")


def test_progress_shows_the_console_metrics():
    bar_out, lines = io.StringIO(), io.StringIO()
    values = {"loss": 2.0, "lm_loss": 1.5, "indexer_kl": 0.25, "captured_mass": 0.75, "grad_norm": 3.0, "lr": 1e-3,
              "tokens_per_s": 1234.0, "other": 7.0}
    with metrics_lib.Progress(4, keys=metrics_lib.LM_KEYS, log_every=2, file=bar_out, line_file=lines) as bar:
        for step in range(1, 5):
            bar.update(step, values)
        assert bar.bar.postfix.split(", ") == ["loss=2", "lm_loss=1.5", "indexer_kl=0.25", "captured_mass=0.75",
                                               "grad_norm=3", "lr=0.001", "tokens_per_s=1234"]
    assert [line.split()[1] for line in lines.getvalue().splitlines()] == ["1/4", "2/4", "4/4"]
    assert "loss=2 lm_loss=1.5" in lines.getvalue() and "other" not in lines.getvalue()
    assert "4/4" in bar_out.getvalue()
    quiet_bar, quiet_lines = io.StringIO(), io.StringIO()  # non-zero processes
    with metrics_lib.Progress(4, enabled=False, log_every=1, file=quiet_bar, line_file=quiet_lines) as bar:
        bar.update(1, values)
    assert quiet_bar.getvalue() == "" and quiet_lines.getvalue() == ""


@pytest.mark.parametrize("name,previous", [("sparse_tiny", "configs/warmup_tiny.py"),
                                           ("warmup_tiny", "configs/dense_tiny.py"),
                                           ("sparse_small", "configs/warmup_small.py"),
                                           ("sparse_671b", "configs/warmup_671b.py")])
def test_missing_init_from_names_the_stage_to_run_first(name, previous, tmp_path):
    missing = str(tmp_path / "nowhere")
    config = load_config(name, init_from=missing)
    with pytest.raises(InitFromError) as e:
        check_init_from(config, name)
    msg = str(e.value)
    assert f"config.init_from='{missing}'" in msg and "no such file or directory" in msg
    assert f"--config={previous} --workdir={missing}" in msg
    assert "--config.init_from=''" in msg


@pytest.mark.parametrize("name", ["dense_tiny", "grpo_tiny"])
def test_missing_init_from_without_an_earlier_stage(name, tmp_path):
    missing = str(tmp_path / "ckpt")
    with pytest.raises(InitFromError, match=r"config.init_from='.*ckpt'.*HF checkpoint directory") as e:
        check_init_from(load_config(name, init_from=missing), name)
    assert "--config.init_from=''" in str(e.value)
    check_init_from(load_config(name, init_from=str(tmp_path)), name)  # exists: fine
    check_init_from(load_config(name, init_from=""), name)
    (tmp_path / "model.safetensors").write_bytes(b"x")  # a file (red-team audit: "not valid JSON")
    with pytest.raises(InitFromError, match=r"config\.init_from='.*model\.safetensors': a file, not a directory"):
        check_init_from(load_config(name, init_from=str(tmp_path / "model.safetensors")), name)


def cli(args, cwd, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "dsv32_jax.train.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("line,message", [
    ("c.optimizer.lrr = 5.0", r"line 6: config\.optimizer has no field 'lrr' \(did you mean 'lr'\?\)$"),
    ("c.grpo.group_sz = 3", r"line 6: config\.grpo has no field 'group_sz' \(did you mean 'group_size'\?\)$"),
    ("c.data.seqlen = 64", r"line 6: config\.data has no field 'seqlen' \(did you mean 'seq_len' or 'seed'\?\)$"),
    ("c.stpes = 3", r"line 6: config has no field 'stpes' \(did you mean 'steps'"),
])
def test_cli_a_config_file_that_sets_a_field_the_config_lacks_is_refused_by_line(line, message, tmp_path):
    """A misspelled field in an experiment file (`c.optimizer.lrr = 5.0`) was a new field nothing read: the run
    went on with the default lr, exit 0 (red-team audit; a misspelled --config.* flag was already refused). The
    config is locked: the file, its line, the section and the closest field names; no workdir."""
    path = tmp_path / "typo.py"
    path.write_text("from dsv32_jax.train.config import default_config\n\n\ndef get_config():\n"
                    f"    c = default_config()\n    {line}\n    return c\n")
    res = cli([f"--config={path}", "--workdir=w"], cwd=tmp_path, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert re.search(rf"^error: --config={re.escape(str(path))}, {message}", res.stderr.strip(), re.M), res.stderr
    assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize("body,message", [
    # set in a helper the file calls: the line of the assignment, not of the call
    ("def tweak(c):\n    c.optimizer.lrr = 5.0\n\n\ndef get_config():\n    c = default_config()\n    tweak(c)\n"
     "    return c\n", r"line 5: config\.optimizer has no field 'lrr' \(did you mean 'lr'\?\)$"),
    # a line that does not spell the section: none is guessed
    ("def get_config():\n    c = default_config()\n    setattr(c.optimizer, 'lrr', 5.0)\n    return c\n",
     r"line 6: the config has no field 'lrr'$"),
])
def test_cli_a_locked_field_set_in_a_helper_or_by_setattr_is_refused_by_its_line(body, message, tmp_path):
    path = tmp_path / "typo.py"
    path.write_text("from dsv32_jax.train.config import default_config\n\n\n" + body)
    res = cli([f"--config={path}", "--workdir=w"], cwd=tmp_path, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert re.search(rf"^error: --config={re.escape(str(path))}, {message}", res.stderr.strip(), re.M), res.stderr
    assert not os.path.exists(tmp_path / "w")


def test_the_free_form_config_dicts_take_any_key_and_the_sections_none():
    c = default_config()
    c.model_overrides = {"index_topk": 16}
    c.model_overrides.vocab_size = 512
    c.grpo.kl_weights.math = 0.1
    c.agent.kl_weights = {"code": 0.05}
    c.agent.env_kwargs.lookup = {"n": 3}
    assert c.model_overrides.to_dict() == {"index_topk": 16, "vocab_size": 512}
    for section in ("optimizer", "data", "grpo", "agent", "eval", "checkpoint", "loss", "profile"):
        with pytest.raises(AttributeError, match="cannot be added since the config is locked"):
            setattr(c[section], "no_such_field", 1)


def test_cli_missing_init_from_exits_with_a_message_not_a_traceback(tmp_path):
    res = cli([f"--config={ROOT}/configs/sparse_tiny.py", "--workdir=w"], cwd=tmp_path)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    assert "config.init_from='runs/demo/warmup'" in res.stderr and str(tmp_path / "runs/demo/warmup") in res.stderr
    assert "--config=configs/warmup_tiny.py --workdir=runs/demo/warmup" in res.stderr
    assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize("args,message", [
    (["--config.stpes=2"], r'error: --config\.stpes=2: config has no field \'stpes\' \(Did you mean "steps" instead'),
    (["--config.optimizer.zzz=1"], r"error: --config\.optimizer\.zzz=1: config\.optimizer has no field 'zzz'$"),
    (["--config.stage=foo"], r"error: config.stage must be one of .*got 'foo'"),
    (["--config.model=nosuch"], r"error: model preset 'nosuch' not found"),
    (["--config.data.source=jsonl", "--config.data.paths=nope.jsonl"], r"error: .*nope\.jsonl"),
    (["--config.dtype=bfloat61"], r"error: config\.dtype must be a floating-point dtype name .*got 'bfloat61'"),
    (["--config.optimizer.lr=-0.003"], r"error: config\.optimizer\.lr must be >= 0, got -0\.003"),
])
def test_cli_refused_configuration_is_one_line_and_leaves_no_workdir(args, message, tmp_path):
    """Every refused config value or input used to end in a Python traceback (only a missing init_from did not),
    after creating the workdir."""
    import re

    res = cli([f"--config={ROOT}/configs/quickstart.py", "--workdir=w", *args], cwd=tmp_path, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and re.search(message, res.stderr), res.stderr[-2000:]
    assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize("flags,message", [
    ((":1234", 0, 0), r"^--num_processes must be >= 1, got 0$"),
    (("", 2, 0), r"^--num_processes=2 needs --coordinator_address=host:port"),
    ((":1234", 2, 2), r"^--process_id must be in \[0, --num_processes=2\), got 2$"),
    ((":1234", 2, -1), r"^--process_id must be in \[0, --num_processes=2\), got -1$"),
])
def test_multihost_flags_are_checked_by_name(flags, message):
    """jax.distributed.initialize's own errors (a traceback: "coordinator_address should be defined") name no
    flag; main prints these (exit 2) before it initializes anything."""
    import re

    from dsv32_jax.train.main import multihost_flag_problem

    assert re.search(message, multihost_flag_problem(*flags))
    assert multihost_flag_problem("", 1, 0) is None and multihost_flag_problem("h:1", 4, 3) is None


_LR_ABC = r"^error: flag --config\.optimizer\.lr=abc: could not convert string to float"


@pytest.mark.parametrize("args,message,config_flag", [
    (["--config.stpes=2"], r'^error: --config\.stpes=2: config has no field \'stpes\' \(Did you mean "steps"', False),
    (["--config.optimizer.zzz=1"], r"^error: --config\.optimizer\.zzz=1: config\.optimizer has no field 'zzz'$",
     False),
    (["--config.optimizer.lr=abc"], _LR_ABC, False),
    (["--config.optimizer.lr=abc"], _LR_ABC, True),
    (["--workdirr=w"], r"^error: Unknown command line flag 'workdirr'", True),
])  # (the misspelled fields with --config: test_cli_refused_configuration_is_one_line_and_leaves_no_workdir)
def test_cli_refused_flag_is_one_line_with_or_without_config(args, message, config_flag, tmp_path):
    """Without --config, ml_collections applies the overrides to the default config file at import, before absl
    parses anything: a misspelled field was a traceback (exit 1) there; a value of the wrong type and an unknown
    flag were absl's "FATAL Flags parsing error" (exit 1) either way. Now one line naming the flag, exit 2."""
    import re

    pre = [f"--config={ROOT}/configs/quickstart.py"] if config_flag else []
    res = cli([*pre, "--workdir=w", *args], cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "FATAL" not in res.stderr, res.stderr[-2000:]
    assert re.search(message, res.stderr, re.M), res.stderr[-2000:]
    assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize("fields,message", [
    ({"data.paths": ("nope.jsonl",)}, r"^data source 'jsonl': file 'nope\.jsonl' does not exist$"),
    ({"data.paths": ("*.nojsonl",)}, r"^data source 'jsonl': no files match the pattern '\*\.nojsonl'$"),
    ({"data.tokenizer": "no_tokenizer"}, r"^tokenizer 'no_tokenizer': no_tokenizer not found"),
    ({"eval.every": 2, "eval.paths": ("held.jsonl",)},
     r"^config\.eval \(the held-out data\): data source 'jsonl': file 'held\.jsonl' does not exist$"),
    ({"eval.every": 2}, r"^config\.eval\.paths: held-out files are needed for data\.source='jsonl'"),
])
def test_setup_refuses_missing_data_inputs_before_it_builds_the_model(fields, message, tmp_path, monkeypatch):
    """A missing data file or tokenizer was found only once the model state had been built (12 s of compiles for
    the quickstart config), and a missing held-out file only at the first evaluation: a traceback after steps
    and checkpoints had been written. setup() checks both before it builds anything."""
    from dsv32_jax.train import run as run_lib

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"text": "one document"}\n')
    monkeypatch.setattr(run_lib, "Trainer", lambda *a, **k: pytest.fail("the model was built before the data check"))
    config = load_config("quickstart", **{"data.source": "jsonl", "data.paths": ("d.jsonl",), **fields})
    with pytest.raises(run_lib.SetupError, match=message):
        run_lib.setup(config, str(tmp_path / "w"))
    assert not os.path.exists(tmp_path / "w")
    config = load_config("quickstart", **{"data.source": "jsonl", "data.paths": ("d.jsonl",)})
    with pytest.raises(pytest.fail.Exception, match="built before the data check"):  # the inputs that exist pass
        run_lib.setup(config, str(tmp_path / "w"))


def test_setup_reads_the_held_out_batches_before_the_first_step(tmp_path, monkeypatch):
    """A held-out file whose records lack the text field passed the setup check (which only resolves paths) and
    ended the run in a KeyError traceback at its first evaluation, after steps and checkpoints. setup() now builds
    the trainer's evaluator (its batches are read then), and names config.eval."""
    from types import SimpleNamespace

    from dsv32_jax.train import eval as eval_lib
    from dsv32_jax.train import run as run_lib

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"text": "one document"}\n')
    (tmp_path / "held.jsonl").write_text('{"txt": "a b c"}\n')

    class FakeTrainer:  # the real evaluator's batches, without building a model
        def __init__(self, config, workdir):
            self.config, self.data_shard = config, (0, 1)

        def evaluator(self):
            cfg = eval_lib.eval_data_config(self.config.data.to_dict(), self.config.eval)
            return eval_lib.eval_batches(cfg, 256, self.config.eval.batches, shard=self.data_shard)

    monkeypatch.setattr(run_lib, "Trainer", FakeTrainer)
    read, make_iterator = [], run_lib.data_lib.make_iterator
    monkeypatch.setattr(run_lib.data_lib, "make_iterator", lambda cfg, **k: read.append(cfg.paths) or
                        make_iterator(cfg, **k))
    config = load_config("quickstart", **{"data.source": "jsonl", "data.paths": ("d.jsonl",), "eval.every": 2,
                                          "eval.paths": ("held.jsonl",)})
    with pytest.raises(run_lib.SetupError, match=r"^config\.eval \(the held-out data\): held\.jsonl, line 1: text "
                                                 r"field 'text' missing \(keys: \['txt'\]\)$"):
        run_lib.setup(config, str(tmp_path / "w"))
    assert read == [("held.jsonl",)] and not os.path.exists(tmp_path / "w")


@pytest.mark.heavy  # 30 s on 2 cores
def test_cli_without_flags_trains_the_quickstart_config(tmp_path):
    res = cli([], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics_lib.read_jsonl(str(tmp_path / "runs" / "quickstart" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert "done: 20 steps of stage sparse in runs/quickstart" in res.stdout
    assert "orbax" not in res.stderr  # orbax's INFO chatter stays off the console


def test_checkpoint_fields_are_checked_by_name(tmp_path):
    """every = 0 used to fail after a whole step with a bare ZeroDivisionError; keep = 0 kept no checkpoint at all
    (a restart began again at step 0)."""
    for every, keep, field in ((0, 3, "every"), (1, 0, "keep"), (2.5, 3, "every")):
        cfg = ml_collections.ConfigDict(dict(every=every, keep=keep, use_async=False))
        with pytest.raises(ValueError, match=rf"config\.checkpoint\.{field} must be an integer >= 1"):
            checkpointing.manager(str(tmp_path), cfg)
    with checkpointing.manager(str(tmp_path), ml_collections.ConfigDict(dict(every=1, keep=None, use_async=False))):
        pass


@pytest.mark.heavy  # >= 20 s on 2 AMD EPYC cores (2026-12-01): out of make test's 15 minutes
def test_resume_with_another_worker_count_is_refused_by_name(tmp_path):
    """The iterator state's format depends on data.worker_count (grain's worker processes keep their own): a
    resume with another count names the field instead of failing in grain with a bare KeyError; with the same
    count the run resumes."""
    from dsv32_jax.train import data as data_lib
    from dsv32_jax.train.trainer import DATA_STATE_KEY, Trainer

    overrides = {"steps": 1, "data.seq_len": 16, "data.batch_size": 2, "checkpoint.every": 1,
                 "checkpoint.use_async": False, "log_every": 1000}
    workdir = str(tmp_path / "run")

    def fit(**kw):
        config = load_config("dense_tiny", **{**overrides, **kw})
        trainer = Trainer(config, workdir)
        # (the iterator itself without worker processes: the check reads config.data, before the iterator is used)
        it = data_lib.make_iterator(data_lib.DataConfig(**{**config.data.to_dict(), "worker_count": 0}),
                                    vocab_size=trainer.cfg.vocab_size)
        try:
            return trainer.fit(it)
        finally:
            getattr(it, "close", lambda: None)()

    assert [h["step"] for h in fit()] == [1]
    with checkpointing.manager(workdir, load_config("dense_tiny", **overrides).checkpoint) as mngr:
        saved = mngr.restore(1, args=checkpointing.ocp.args.Composite(
            data=checkpointing.ocp.args.JsonRestore()))["data"]
    assert saved[DATA_STATE_KEY] == {"worker_count": 0}
    with pytest.raises(ValueError, match=r"step 1: its data state was saved with data\.worker_count=0 and this run "
                                         r"has 1"):
        fit(**{"steps": 2, "data.worker_count": 1})
    assert [h["step"] for h in fit(steps=2)] == [2]


@pytest.mark.heavy  # >= 20 s on 2 AMD EPYC cores (2026-12-01): out of make test's 15 minutes
def test_resume_into_another_configuration_is_refused_by_name(tmp_path):
    """A workdir resumed with a config that trains other parameters (here loss.mtp_weight 0 -> 0.1: the MTP layer
    joins the optimizer) or another model: orbax refused with both whole trees printed (hundreds of lines); now
    one ResumeError names the workdir, the item and a differing leaf, before anything is restored; a model or data
    change that keeps the shapes (rope_theta, data.seq_len) resumed silently and is named too. The original config
    still resumes."""
    from dsv32_jax.train import data as data_lib
    from dsv32_jax.train.trainer import Trainer

    overrides = {"steps": 1, "data.seq_len": 16, "data.batch_size": 2, "checkpoint.every": 1,
                 "checkpoint.use_async": False, "log_every": 1000}
    workdir = str(tmp_path / "run")

    def fit(model_overrides=None, **kw):
        config = load_config("dense_tiny", **{**overrides, **kw})
        if model_overrides:
            config.model_overrides = {**config.model_overrides, **model_overrides}
        trainer = Trainer(config, workdir)
        it = data_lib.make_iterator(data_lib.DataConfig(**config.data.to_dict()), vocab_size=trainer.cfg.vocab_size)
        try:
            return trainer.fit(it)
        finally:
            getattr(it, "close", lambda: None)()

    assert [h["step"] for h in fit()] == [1]
    with pytest.raises(checkpointing.ResumeError, match=rf"{workdir}: its checkpoint at step 1 does not match this "
                                                        r"run's 'opt': \d+ missing, e\.g\. '[^']*/mtp/"):
        fit(**{"steps": 2, "loss.mtp_weight": 0.1})
    # changes that keep every shape resumed silently into another run; now named before anything is built
    for kw, needle in (({"model_overrides": {"moe_intermediate_size": 48}}, r"model field moe_intermediate_size 32 "
                                                                           r"there, 48 here"),
                       ({"model_overrides": {"rope_theta": 5000.0}}, r"model field rope_theta 10000\.0 there, 5000\.0 "
                                                                     r"here"),
                       ({"data.seq_len": 8}, r"config\.data\.seq_len 16 there, 8 here"),
                       ({"data.seed": 3}, r"config\.data\.seed 0 there, 3 here")):
        with pytest.raises(checkpointing.ResumeError, match=rf"{workdir}: its checkpoint at step 1 was written with "
                                                            rf"another configuration \(.*{needle}"):
            fit(steps=2, **kw)
    assert [h["step"] for h in fit(steps=2)] == [2]


@pytest.mark.heavy  # >= 20 s on 2 AMD EPYC cores (2026-12-01): out of make test's 15 minutes
def test_a_run_from_init_from_resumes_without_it(tmp_path):
    """A stage started from config.init_from reloaded that checkpoint at every resume (then replaced it), and failed
    with "run that stage first" once it was deleted, though its own checkpoint holds everything it needs."""
    import shutil

    from dsv32_jax.train import data as data_lib
    from dsv32_jax.train.trainer import Trainer

    def fit(name, workdir, **kw):
        config = load_config(name, **{"data.seq_len": 16, "data.batch_size": 2, "checkpoint.every": 1,
                                      "checkpoint.use_async": False, "log_every": 1000, **kw})
        trainer = Trainer(config, workdir)
        it = data_lib.make_iterator(data_lib.DataConfig(**config.data.to_dict()), vocab_size=trainer.cfg.vocab_size)
        try:
            return [h["step"] for h in trainer.fit(it)]
        finally:
            getattr(it, "close", lambda: None)()

    dense, warm = str(tmp_path / "dense"), str(tmp_path / "warmup")
    assert fit("dense_tiny", dense, steps=1) == [1]
    assert fit("warmup_tiny", warm, steps=1, init_from=dense) == [1]
    shutil.rmtree(dense)
    assert fit("warmup_tiny", warm, steps=2, init_from=dense) == [2]


def test_metrics_writer_drops_the_steps_a_resume_runs_again(tmp_path):
    """A run that failed (or was killed) after its last checkpoint had logged steps it then ran again: metrics.jsonl
    held step 2 twice. resume_at(step) keeps the rows up to the checkpoint."""
    writer = metrics_lib.MetricsWriter(str(tmp_path), tensorboard=False)
    for step in (1, 2, 3):
        writer.write(step, {"loss": float(step)})
    writer.resume_at(1)
    writer.write(2, {"loss": 20.0})
    writer.close()
    assert metrics_lib.read_jsonl(str(tmp_path / "metrics.jsonl")) == [{"step": 1, "loss": 1.0},
                                                                      {"step": 2, "loss": 20.0}]


def test_metrics_writer_drops_a_partial_last_line_before_appending(tmp_path):
    """A kill inside a write leaves a line without its newline; the resumed run's rows were appended to it, and
    metrics.jsonl no longer read back."""
    writer = metrics_lib.MetricsWriter(str(tmp_path), tensorboard=False)
    writer.write(1, {"loss": 2.5})
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "lo')
    for step in (2, 3):
        writer = metrics_lib.MetricsWriter(str(tmp_path), tensorboard=False)
        writer.write(step, {"loss": 1.5})
        writer.close()
    assert metrics_lib.read_jsonl(str(tmp_path / "metrics.jsonl")) == [
        {"step": 1, "loss": 2.5}, {"step": 2, "loss": 1.5}, {"step": 3, "loss": 1.5}]


def test_metrics_readers_skip_a_cut_off_last_line_and_refuse_a_bad_one_inside(tmp_path, caplog):
    """read_steps (dsv32-plot, agent_report, the GRPO history): a metrics.jsonl whose last line a kill cut off (no
    newline, not JSON) reads as the rows before it, with a warning; the same line inside the file is refused naming
    the file and the line. Found by an audit: dsv32-plot refused such a run and agent_report skipped it."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    with caplog.at_level("WARNING"):
        assert metrics_lib.read_steps(str(path)) == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]
    assert f"{path}, line 3: cut off" in caplog.text
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 3, "lo\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not JSON"):
        metrics_lib.read_steps(str(path))


@pytest.mark.parametrize("text,name,message", [
    ("def get_config(:\n", "cfg.py", r"^error: --config=cfg\.py: line 1: SyntaxError: invalid syntax$"),
    ("import no_such_module_here\ndef get_config():\n    pass\n", "cfg.py",
     r"^error: --config=cfg\.py: ModuleNotFoundError: No module named 'no_such_module_here'$"),
    ('{"steps": 1}\n', "cfg.json",
     r"^error: --config=cfg\.json: not a Python config file defining get_config\(\) .*JSON and YAML"),
    ("from dsv32_jax.train.config import default_config\ndef get_config():\n    c = default_config()\n"
     "    c.optimizer.lr = 'fast'\n    return c\n", "cfg.py",
     r"^error: --config=cfg\.py, line 4: TypeError: Could not override field 'lr'"),
])
def test_cli_config_file_that_does_not_load_is_one_line_naming_file_and_line(text, name, message, tmp_path):
    """A config file with a syntax error or a failed import was a traceback (exit 1); a JSON file given as the
    config read "module 'config_config' has no attribute 'get_config'"; a field set to the wrong type inside the
    file printed ml_collections' whole traceback on one line. Found by an audit."""
    import re

    (tmp_path / name).write_text(text)
    res = cli([f"--config={name}", "--workdir=w"], cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and re.search(message, res.stderr, re.M), res.stderr[-2000:]
    assert not os.path.exists(tmp_path / "w")


def test_a_data_record_without_the_text_field_is_named_without_quotes(tmp_path, monkeypatch):
    """setup() wraps the data reader's KeyError in a SetupError: its str quoted the message ('"f.jsonl, line 1:
    ..."'), as Python prints a KeyError. Found by an audit."""
    from dsv32_jax.train import run as run_lib

    monkeypatch.chdir(tmp_path)
    (tmp_path / "body.jsonl").write_text('{"body": "one document"}\n')
    config = load_config("quickstart", **{"data.source": "jsonl", "data.paths": ("body.jsonl",), "steps": 1})
    message = r"^(?![\"'])\S*body\.jsonl, line 1: text field 'text' missing \(keys: \['body'\]\)$"
    with pytest.raises(run_lib.SetupError, match=message):
        run_lib.setup(config, str(tmp_path / "w"))
