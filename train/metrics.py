"""Metrics sinks: JSONL (one object per step), TensorBoard event files (when tensorboardX is installed), and the
console progress bar (tqdm)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from absl import logging
from tqdm import tqdm

from dsv32_jax.checkpoint.io_utils import drop_partial_last_line, write_text_atomic

LM_KEYS = ("loss", "lm_loss", "indexer_kl", "captured_mass", "grad_norm", "lr", "eval_loss", "tokens_per_s",
           "step_time_s", "mfu")
_TB_MISSING_LOGGED = False


def _summary_writer(logdir: str):
    """A tensorboardX SummaryWriter, or None (said once per process) when tensorboardX is not installed."""
    global _TB_MISSING_LOGGED
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        if not _TB_MISSING_LOGGED:
            logging.info("TensorBoard events are off: tensorboardX is missing (pip install 'dsv32-jax[tensorboard]'); "
                         "metrics go to metrics.jsonl only")
            _TB_MISSING_LOGGED = True
        return None
    return SummaryWriter(logdir)


class MetricsWriter:
    """Appends one JSON object per step to <workdir>/metrics.jsonl and, if tensorboardX is importable, writes the
    same scalars as TensorBoard events under <workdir>/tb. enabled=False (non-zero processes) writes nothing."""

    def __init__(self, workdir: str, enabled: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        drop_partial_last_line(self.path)
        self._jsonl = open(self.path, "a")
        if tensorboard:
            self._tb = _summary_writer(os.path.join(workdir, "tb"))

    def resume_at(self, step: int) -> None:
        """Drops the rows of steps after `step` (where the run resumes): a run that failed or was killed after its
        last checkpoint logged steps it then runs again, and metrics.jsonl held those steps twice."""
        if not self.enabled:
            return
        self._jsonl.flush()
        with open(self.path) as f:
            lines = f.readlines()

        def after(line):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                return False
            return isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step

        keep = [line for line in lines if not after(line)]
        if len(keep) == len(lines):
            return
        self._jsonl.close()
        write_text_atomic(self.path, "".join(keep))
        self._jsonl = open(self.path, "a")

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": int(step)}
        row.update({k: float(np.asarray(v)) for k, v in metrics.items()})
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step":
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            if self._tb is not None:
                self._tb.close()
                self._tb = None


def format_metrics(metrics: dict, keys) -> dict:
    """The console subset of `metrics`, in `keys` order, as short strings (tqdm postfix)."""
    return {k: f"{float(np.asarray(metrics[k])):.4g}" for k in keys if k in metrics}


class Progress:
    """tqdm bar (on stderr) over the run's steps whose postfix shows the latest metrics (`keys`); every `log_every`
    steps, at the first and the last step (or when forced) the metrics are also written as a permanent line (on
    stdout), so logs keep a record. enabled=False (non-zero processes) shows nothing."""

    def __init__(self, total: int, initial: int = 0, *, keys=LM_KEYS, log_every: int = 0, enabled: bool = True,
                 desc: str = "train", file=None, line_file=None):
        self.keys, self.log_every, self.total = tuple(keys), log_every, total
        self.line_file = line_file if line_file is not None else sys.stdout
        self.bar = tqdm(total=total, initial=initial, desc=desc, disable=not enabled,
                        file=file if file is not None else sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def update(self, step: int, metrics: dict, force_line: bool = False) -> None:
        if self.bar.disable:
            return
        shown = format_metrics(metrics, self.keys)
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(step - self.bar.n)
        if force_line or step == 1 or step == self.total or (self.log_every and step % self.log_every == 0):
            line = " ".join(f"{k}={v}" for k, v in shown.items())
            self.bar.write(f"step {step}/{self.total} {line}", file=self.line_file)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_steps(path: str) -> list[dict]:
    """The rows of a metrics.jsonl in step order, the last one of each step (a resumed run re-logs the steps after
    its checkpoint). A line that is not a JSON object with an integer "step" raises ValueError naming the file
    and the line, except a last line cut off by a kill or a full disk (no newline, not JSON): skipped with a
    warning, as a resumed run cuts it."""
    rows = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if not line.endswith("\n"):  # (only the last line can lack its newline)
                    logging.warning("%s, line %d: cut off (no newline, not JSON): skipped", path, number)
                    break
                raise ValueError(f"{path}, line {number}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError(f"{path}, line {number}: not a metrics row (a JSON object with an integer 'step')")
            rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]
