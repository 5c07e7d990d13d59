"""The loop that every training stage shares: resume from the workdir's latest checkpoint, step until
config.steps, log metrics (metrics.jsonl, TensorBoard, tqdm), save checkpoints, stop cleanly on SIGTERM / SIGINT,
and trace the steps config.profile names with jax.profiler (each step annotated with its number).

A stage (train/trainer.py's Trainer, train/grpo.py's GRPOLearner) provides:
    step                        the number of finished steps (after restore)
    restore_checkpoint(m, s)    load step s from CheckpointManager m
    run_step() -> dict          one training step; host-side scalar metrics
    save_checkpoint(m, s, f)    save step s (forced: f)
(run_step raises DataExhausted when finite data, data.num_epochs, has run out: the loop stops there with the last
finished step saved), and may provide prepare(stop): work before step 1 that checkpoints its own progress and returns early once
`stop.requested` (train/agent_grpo.py: the recall stage and cold start); run_loop calls it at step 0.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Protocol

import jax
import numpy as np
from absl import logging

from dsv32_jax.train import checkpointing
from dsv32_jax.train.metrics import MetricsWriter, Progress


class DataExhausted(Exception):
    """The stage's data ran out (a finite data.num_epochs) before config.steps. run_loop stops at the last finished
    step (saved); before the first step of a fresh run it is an error (one epoch holds no full batch)."""


class DataError(ValueError):
    """A record the stage's data pipeline refused mid-run (a missing text field, invalid JSON deep in a file; the
    message names the file and line). run_loop saves the last finished step and re-raises it."""


class NonFinite(RuntimeError):
    """A step's loss or gradient norm is NaN or infinite (a diverged update, broken data): run_loop stops before
    logging or saving that step, so neither metrics.jsonl nor a checkpoint holds it."""


# the metrics whose non-finite value stops a run: the objectives and the update's size (the LM stages, GRPO, the
# agent stage's updates, its recall / cold-start SFT)
GUARDED = ("loss", "lm_loss", "grad_norm", "sft_loss", "recall_loss")


def check_finite(metrics: dict, where: str, saved: Callable[[], str]) -> None:
    """Raises NonFinite naming `where` (e.g. "step 7"), the guarded metrics that are NaN / inf, and `saved()`
    (`saved_note`: the checkpoints there are; called only then)."""
    bad = {k: float(np.asarray(v)) for k, v in metrics.items() if k in GUARDED and not np.all(np.isfinite(v))}
    if bad:
        values = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise NonFinite(f"{where}: {values} is not finite; the run stopped without logging or saving it. {saved()}")


def saved_note(steps: list[int], directory: str, what: str = "step") -> str:
    """What NonFinite says of the checkpoints in `directory` (`steps`, ascending): the latest holds the parameters
    the non-finite loss was computed on (a step's loss is that of the parameters the previous step saved), so unless
    the batch is at fault they diverged already and an earlier one is the one to resume from."""
    if not steps:
        return "No checkpoint was saved: lower optimizer.lr or lengthen optimizer.warmup_steps, or check the data."
    earlier = f" (saved: {', '.join(map(str, steps[-4:-1]))})" if len(steps) > 1 else " (none is saved)"
    return (f"The last checkpoint, {what} {steps[-1]} in {directory}, holds the parameters this loss was computed on: "
            f"unless the batch is at fault they have diverged already; resume from an earlier {what}{earlier} by "
            "moving the later ones away, with a lower optimizer.lr or a longer optimizer.warmup_steps, or check the "
            "data")


class Stage(Protocol):
    step: int

    def restore_checkpoint(self, mngr, step: int) -> None: ...

    def run_step(self) -> dict: ...

    def save_checkpoint(self, mngr, step: int, force: bool) -> bool: ...


class StepProfiler:
    """config.profile: a jax.profiler trace of steps [start, start + steps) (1-based step numbers) into `dir`
    (default <workdir>/profile). A resumed run traces what is left of that window; a run stopped inside it closes
    the trace. Every process traces its own devices (one file per host in the same run directory)."""

    def __init__(self, profile, workdir: str):
        profile = {} if profile is None else profile  # (a config without the section: off)
        self.first = int(profile.get("start", 2))
        self.last = self.first + int(profile.get("steps", 0)) - 1
        self.dir = profile.get("dir", "") or os.path.join(workdir, "profile")
        self.active, self.traced = False, []

    def before(self, step: int) -> None:
        """Called before step number `step` runs."""
        if not self.active and self.first <= step <= self.last:
            jax.profiler.start_trace(self.dir)
            self.active = True
            logging.info("profiling step%s into %s", f" {step}" if step == self.last else f"s {step}-{self.last}",
                         self.dir)

    def after(self, step: int) -> None:
        """Called once step number `step` has finished (its metrics on the host)."""
        if self.active:
            self.traced.append(step)
            if step >= self.last:
                self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            logging.info("profile of steps %s written to %s", ", ".join(map(str, self.traced)), self.dir)


class NewOutputs:
    """What run_loop is about to create in `workdir` (the workdir itself, metrics.jsonl, tb/, checkpoints/) that is
    not there yet. remove() takes those away again once a run has failed before logging or saving any step (they
    are then an empty metrics.jsonl, an event file without a scalar, a checkpoints directory without a step): a run
    refused before its first step (a bad record in the first batch, a failed compile) leaves the workdir as it
    found it, not as the shell of a run."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.new_workdir = not os.path.lexists(workdir)
        self.new = [name for name in ("metrics.jsonl", "tb", checkpointing.CHECKPOINTS_DIR)
                    if not os.path.lexists(os.path.join(workdir, name))]

    def remove(self) -> None:
        """Call only when no step was logged or saved here (metrics.jsonl and tb/ go whatever they hold)."""
        for name in self.new:
            path = os.path.join(self.workdir, name)
            try:
                if name == "tb":
                    shutil.rmtree(path)
                elif name == "metrics.jsonl":
                    os.remove(path)
                else:
                    os.rmdir(path)  # (refuses a directory that holds anything)
            except OSError:
                pass
        if self.new_workdir:
            try:
                os.rmdir(self.workdir)
            except OSError:
                pass


def run_loop(stage: Stage, *, workdir: str, config, keys, desc: str,
             show: Callable[[dict], bool] = lambda metrics: False) -> list[dict]:
    """Runs `stage` until config.steps (resuming from its latest checkpoint); returns one dict per step run here
    ({"step": n, metric: float}). show(metrics) -> True also prints that step's console line."""
    main = jax.process_index() == 0
    fresh = NewOutputs(workdir) if main else None
    writer = MetricsWriter(workdir, enabled=main)
    profiler = StepProfiler(config.get("profile"), workdir)
    history = []
    try:
        with checkpointing.manager(workdir, config.checkpoint) as mngr, checkpointing.StopSignal() as stop:
            latest = checkpointing.latest_step(mngr)
            if latest is not None:
                stage.restore_checkpoint(mngr, latest)
                logging.info("resumed from %s step %d", mngr.directory, latest)
            step = stage.step
            writer.resume_at(step)
            if step > config.steps:
                logging.warning("%s holds a checkpoint at step %d, past config.steps=%d: nothing to run",
                                mngr.directory, step, config.steps)
            prepare = getattr(stage, "prepare", None)
            if prepare is not None and step == 0 < config.steps:
                prepare(stop)
            with Progress(config.steps, step, keys=keys, log_every=config.log_every, enabled=main, desc=desc) as bar:
                while step < config.steps and not stop.requested:
                    profiler.before(step + 1)
                    with jax.profiler.StepTraceAnnotation(desc, step_num=step + 1):
                        try:
                            metrics = stage.run_step()
                        except DataExhausted as e:
                            if step == 0:
                                raise DataExhausted(f"{e} before the first step: one epoch holds no full batch "
                                                    "(data.batch_size x data.seq_len tokens)") from None
                            if checkpointing.latest_step(mngr) != step:
                                stage.save_checkpoint(mngr, step, force=True)
                            logging.warning("%s at step %d of config.steps=%d: stopped there (checkpoint saved "
                                            "in %s)", e, step, config.steps, mngr.directory)
                            break
                        except DataError as e:
                            if step and checkpointing.latest_step(mngr) != step:
                                stage.save_checkpoint(mngr, step, force=True)
                                mngr.wait_until_finished()
                            raise DataError(f"{e} (reading step {step + 1}'s batch; "
                                            + (f"step {step} is saved in {mngr.directory})" if step else
                                               "no step was run)")) from None
                    check_finite(metrics, f"step {step + 1}",
                                 lambda: saved_note(checkpointing.saved_steps(mngr), str(mngr.directory)))
                    step += 1
                    profiler.after(step)
                    writer.write(step, metrics)
                    history.append({"step": step, **{k: float(v) for k, v in metrics.items()}})
                    bar.update(step, metrics, force_line=show(metrics))
                    stage.save_checkpoint(mngr, step, force=stop.requested or step == config.steps)
            mngr.wait_until_finished()
            if stop.requested:
                logging.info("stopped by a signal at step %d (checkpoint saved in %s)", step, mngr.directory)
    except BaseException:
        if fresh is not None and not history:
            writer.close()
            fresh.remove()
        raise
    finally:  # (a failed restore or step closes the metrics files, and the trace, too)
        profiler.close()
        writer.close()
    return history
