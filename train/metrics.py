"""Metrics sinks: JSONL (one object per step), TensorBoard event files, and a console progress line."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from absl import logging

from dsv32_jax.optional import require


class MetricsWriter:
    def __init__(self, workdir: str, total_steps: int, enabled: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self.total = total_steps
        self.start = time.time()
        self._tb = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._jsonl = open(self.path, "a")
        if tensorboard:
            try:
                summary_writer = require("tensorboardX", "tensorboard", "TensorBoard event files").SummaryWriter
                self._tb = summary_writer(os.path.join(workdir, "tb"))
            except ImportError as e:  # optional: metrics.jsonl is always written
                logging.info("%s; writing %s only", e, self.path)

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

    def console(self, step: int, metrics: dict, keys=("loss", "lm_loss", "indexer_kl", "captured_mass", "grad_norm",
                                                     "lr", "tokens_per_s", "step_time_s", "mfu")) -> None:
        if not self.enabled:
            return
        frac = min(step / max(self.total, 1), 1.0)
        bar = "#" * int(frac * 20) + "." * (20 - int(frac * 20))
        shown = " ".join(f"{k}={float(np.asarray(metrics[k])):.4g}" for k in keys if k in metrics)
        print(f"[{bar}] {step}/{self.total} {shown}", file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            if self._tb is not None:
                self._tb.close()


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
