"""Checkpointing and stop signals shared by the training loops (train/trainer.py, train/grpo.py).

A workdir's checkpoints live in W/checkpoints, one orbax CheckpointManager; each step holds named items: array
trees (nnx states, saved as pure dicts) and small JSON items. The trainer writes params, opt, data, meta; GRPO
writes params, opt, ref, meta (dsv32_jax/checkpoint/orbax_io.py reads 'params' and 'meta' of either).
"""

from __future__ import annotations

import contextlib
import json as json_lib
import os
import signal

import jax
import numpy as np

import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from dsv32_jax.model import sharding as shd

CHECKPOINTS_DIR = "checkpoints"


def manager(workdir: str, checkpoint_cfg) -> ocp.CheckpointManager:
    """The CheckpointManager of `workdir` configured by config.checkpoint (every, keep, use_async)."""
    c = checkpoint_cfg
    for field in ("every", "keep"):
        v = getattr(c, field)
        if field == "keep" and v is None:  # orbax: keep every checkpoint
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"config.checkpoint.{field} must be an integer >= 1"
                             + (" (None keeps every checkpoint)" if field == "keep" else "") + f", got {v!r}")
    options = ocp.CheckpointManagerOptions(save_interval_steps=c.every, max_to_keep=c.keep,
                                           enable_async_checkpointing=c.use_async)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, CHECKPOINTS_DIR)), options=options)


def latest_step(mngr: ocp.CheckpointManager) -> int | None:
    """The last finished checkpoint's step (None in a fresh workdir)."""
    return mngr.latest_step()


def _pure(tree):
    return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def save(mngr: ocp.CheckpointManager, step: int, *, arrays: dict, json: dict, force: bool = False) -> bool:
    """Saves `arrays` (name -> nnx.State or pytree of arrays) and `json` (name -> JSON-able object) as one step.
    Returns whether a checkpoint was started (the manager skips steps off its save interval unless force)."""
    items = {name: ocp.args.StandardSave(_pure(tree)) for name, tree in arrays.items()}
    items.update({name: ocp.args.JsonSave(obj) for name, obj in json.items()})
    return mngr.save(step, force=force, args=ocp.args.Composite(**items))


def allgather_json(obj) -> list:
    """Every process's JSON-able `obj`, in process order (a collective: all processes call it)."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json_lib.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
    return [json_lib.loads(bytes(rows[i, :int(sizes[i])])) for i in range(len(sizes))]


def restore_target(state, shardings):
    """Abstract restore target of an array tree: shapes and dtypes of `state`, placed with `shardings` (both
    nnx.State or matching pytrees), so each array is read straight into its shards. optax.MaskedNode (the
    placeholder of a parameter another optimizer group owns) stays as it is."""
    return shd.abstract_sharded(_pure(state), _pure(shardings))


def restore(mngr: ocp.CheckpointManager, step: int, *, arrays: dict, json: tuple = ()) -> dict:
    """Restores step `step`. `arrays`: name -> (nnx.State, its shardings); each of those states is updated in
    place. `json`: names of JSON items. Returns name -> restored value (pure dicts for the array items)."""
    items = {name: ocp.args.StandardRestore(restore_target(state, sh)) for name, (state, sh) in arrays.items()}
    items.update({name: ocp.args.JsonRestore() for name in json})
    restored = mngr.restore(step, args=ocp.args.Composite(**items))
    for name, (state, _) in arrays.items():
        nnx.replace_by_pure_dict(state, restored[name])
    return {name: restored[name] for name in items}


class StopSignal(contextlib.AbstractContextManager):
    """SIGTERM / SIGINT -> `requested` becomes True; the loop then saves the current step and returns (exit 0).
    A second SIGINT interrupts at once (KeyboardInterrupt). Outside the main thread no handler is installed."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self._old = {}

    def _handler(self, signum, _frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        logging.warning("signal %d: saving a checkpoint and stopping after this step", signum)
        self.requested = True

    def __enter__(self):
        for sig in self.SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: signals stay with their current handlers
                break
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
        return False
