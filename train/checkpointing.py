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


def check_checkpoint_config(checkpoint_cfg) -> None:
    """config.checkpoint.every >= 1 and keep >= 1 or None (keep every checkpoint), as integers."""
    c = checkpoint_cfg
    for field in ("every", "keep"):
        v = getattr(c, field)
        if field == "keep" and v is None:  # orbax: keep every checkpoint
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"config.checkpoint.{field} must be an integer >= 1"
                             + (" (None keeps every checkpoint)" if field == "keep" else "") + f", got {v!r}")


def manager(workdir: str, checkpoint_cfg) -> ocp.CheckpointManager:
    """The CheckpointManager of `workdir` configured by config.checkpoint (every, keep, use_async)."""
    c = checkpoint_cfg
    check_checkpoint_config(c)
    options = ocp.CheckpointManagerOptions(save_interval_steps=c.every, max_to_keep=c.keep,
                                           enable_async_checkpointing=c.use_async)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, CHECKPOINTS_DIR)), options=options)


def latest_step(mngr: ocp.CheckpointManager) -> int | None:
    """The last finished checkpoint's step (None in a fresh workdir)."""
    return mngr.latest_step()


def saved_steps(mngr: ocp.CheckpointManager) -> list[int]:
    """The finished checkpoints' steps, ascending (after any save in flight)."""
    mngr.wait_until_finished()
    return sorted(mngr.all_steps())


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


class ResumeError(ValueError):
    """A workdir's checkpoint does not hold the arrays this run would restore (another model, stage or set of
    trained parameters; the message names the workdir, the item and the differing leaves), or cannot be read (a
    damaged file; the message names the step's directory and the read error)."""


def _leaves(tree) -> dict[tuple[str, ...], tuple]:
    """str path -> shape of an array tree's leaves (optax.MaskedNode placeholders hold none)."""
    import optax  # noqa: PLC0415

    from dsv32_jax.checkpoint.orbax_io import flatten  # noqa: PLC0415

    return {p: tuple(v.shape) for p, v in flatten(_pure(tree)) if not isinstance(v, optax.MaskedNode)}


def check_stored(mngr: ocp.CheckpointManager, step: int, arrays: dict) -> None:
    """Each array item of step `step` holds exactly the leaves (paths and shapes) of `arrays` (name -> target
    tree): orbax's own refusal of a mismatch prints both whole trees. Raises ResumeError."""
    from dsv32_jax.checkpoint.orbax_io import CheckpointError, ParamsReader  # noqa: PLC0415

    step_dir = os.fspath(ocp.step.standard_name_format().find_step(mngr.directory, step).path)
    workdir = os.path.dirname(os.path.normpath(os.fspath(mngr.directory)))
    for name, tree in arrays.items():
        if not os.path.isdir(os.path.join(step_dir, name)):
            raise ResumeError(f"{workdir}: its checkpoint at step {step} has no '{name}' item: written by another "
                              "stage? Resume it with its own config, or start a new --workdir")
        try:
            stored = {p: tuple(m.shape) for p, m in ParamsReader(step_dir, item=name).leaves.items()
                      if m is not None}  # (None: a MaskedNode placeholder)
        except CheckpointError as e:  # unreadable metadata
            raise ResumeError(f"{step_dir}: the checkpoint of step {step} cannot be read ({e}); "
                              + _earlier_step_advice(mngr, step)) from None
        want = _leaves(tree)
        missing = sorted(set(want) - set(stored))
        extra = sorted(set(stored) - set(want))
        reshaped = sorted(p for p in set(want) & set(stored) if want[p] != stored[p])
        if missing or extra or reshaped:
            parts = [f"{len(v)} {what}, e.g. '{'/'.join(v[0])}'" + (f" (stored {list(stored[v[0]])}, this run "
                                                                     f"{list(want[v[0]])})" if what == "of another "
                                                                     "shape" else "")
                     for v, what in ((missing, "missing"), (extra, "not in this run"), (reshaped, "of another shape"))
                     if v]
            raise ResumeError(
                f"{workdir}: its checkpoint at step {step} does not match this run's '{name}': " + "; ".join(parts)
                + ". The run that wrote it had another model (config.model, model_overrides), stage or set of "
                "trained parameters (loss.mtp_weight, loss.indexer_weight, grpo / agent indexer_weight): resume "
                "it with its own config, or start a new --workdir")


# config.data fields a resume must keep: the data state is a position in the stream these define
RESUME_DATA_FIELDS = ("source", "seq_len", "batch_size", "seed", "shuffle", "shuffle_window")
LEGACY_SHUFFLE_WINDOW = 512  # the window of every run whose checkpoint does not record one
# config.data fields a resume may change (a dataset moved, a field renamed), but whose change makes the restored
# iterator position a position in another stream: warned about by name
WARN_DATA_FIELDS = ("paths", "text_field", "tokenizer", "add_eos", "special_tokens")


def resume_point(workdir: str):
    """The latest finished checkpoint of `workdir` (an orbax_io.TrainingCheckpoint: step, model config, meta), the
    one a run there resumes from; None for a workdir without one."""
    from dsv32_jax.checkpoint import orbax_io  # noqa: PLC0415

    root = os.path.join(workdir, CHECKPOINTS_DIR)
    if not os.path.isdir(root):
        return None
    with ocp.CheckpointManager(os.path.abspath(root), options=ocp.CheckpointManagerOptions(create=False)) as mngr:
        if mngr.latest_step() is None:
            return None
    return orbax_io.training_checkpoint(workdir)


def check_resume(point, *, stage: str, model_cfg=None, data=None, ignore_model=()) -> None:
    """A run resuming `point` (resume_point) has the configuration that wrote it: the stage, the model (every field
    of its config but `ignore_model`; model_cfg None: not compared) and the data fields of RESUME_DATA_FIELDS
    (`data`: config.data; compared where the checkpoint recorded them). A change that keeps every array's shape
    (rope_theta, data.seq_len, data.seed) resumed silently into another run. Raises ResumeError naming each."""
    meta = point.meta
    problems = []
    if meta.get("stage", stage) != stage:
        problems.append(f"config.stage {meta['stage']!r} there, {stage!r} here")
    if model_cfg is not None:
        there, here = point.cfg.to_hf(), model_cfg.to_hf()
        keys = sorted(k for k in set(there) | set(here) if k not in ignore_model and there.get(k) != here.get(k))
        problems += [f"model field {k} {there.get(k)!r} there, {here.get(k)!r} here" for k in keys[:6]]
        if len(keys) > 6:
            problems.append(f"{len(keys) - 6} more model fields")
    recorded = meta.get("data_config")
    if data is not None and isinstance(recorded, dict):
        here = data_fingerprint(data)
        legacy = "special_tokens" not in recorded and recorded.get("tokenizer", "byte") != "byte"
        if legacy and "special_tokens" in here:  # (written before data.special_tokens: its tokenizer parsed them)
            recorded = dict(recorded, special_tokens="parse")
        if "shuffle_window" not in recorded and "shuffle_window" in here:  # (written before it was a config field:
            recorded = dict(recorded, shuffle_window=LEGACY_SHUFFLE_WINDOW)  # the default, the only value then)
        problems += [f"config.data.{k} {recorded[k]!r} there, {here.get(k)!r} here" for k in RESUME_DATA_FIELDS
                     if k in recorded and recorded[k] != here.get(k)
                     and (k != "shuffle_window" or here.get("shuffle"))]  # (no shuffle: no window)
        changed = [f"config.data.{k} {recorded[k]!r} there, {here.get(k)!r} here" for k in WARN_DATA_FIELDS
                   if k in recorded and recorded[k] != here.get(k)]
        if changed and not problems:
            logging.warning("%s: resuming step %d with other data (%s): the restored data position indexes this "
                            "run's stream, which is not the one it was saved in", point.workdir, point.step,
                            "; ".join(changed))
    if problems:
        raise ResumeError(f"{point.workdir}: its checkpoint at step {point.step} was written with another "
                          f"configuration ({'; '.join(problems)}): resume it with the config that wrote it, or "
                          "start a new --workdir")


def data_fingerprint(data) -> dict:
    """What check_resume compares of config.data (JSON values, as the checkpoint's meta records them); the
    tokenizer as the meta records it (`data.tokenizers.tokenizer_record`), so a relative spelling is no change."""
    from dsv32_jax.train.data.tokenizers import tokenizer_record  # noqa: PLC0415

    out = {k: data[k] for k in RESUME_DATA_FIELDS + WARN_DATA_FIELDS if k in data}
    if isinstance(out.get("tokenizer"), str):
        out["tokenizer"] = tokenizer_record(out["tokenizer"])
    return json_lib.loads(json_lib.dumps(out))


def _earlier_step_advice(mngr: ocp.CheckpointManager, step: int) -> str:
    earlier = [s for s in mngr.all_steps() if s < step]
    return ("move that directory away to resume from " + (f"step {max(earlier)}" if earlier else "scratch")
            + ", or start a new --workdir")


def restore(mngr: ocp.CheckpointManager, step: int, *, arrays: dict, json: tuple = ()) -> dict:
    """Restores step `step`. `arrays`: name -> (nnx.State, its shardings); each of those states is updated in
    place. `json`: names of JSON items. Returns name -> restored value (pure dicts for the array items). A stored
    tree that differs from a target raises ResumeError (`check_stored`)."""
    from dsv32_jax.checkpoint.orbax_io import innermost_cause, quiet_failed_reads, read_error_text  # noqa: PLC0415

    check_stored(mngr, step, {name: state for name, (state, _) in arrays.items()})
    items = {name: ocp.args.StandardRestore(restore_target(state, sh)) for name, (state, sh) in arrays.items()}
    items.update({name: ocp.args.JsonRestore() for name in json})
    try:
        with quiet_failed_reads():
            restored = mngr.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:
        if not isinstance(innermost_cause(e), (ValueError, OSError)):  # (TensorStore's read errors: ValueError)
            raise
        step_dir = os.fspath(ocp.step.standard_name_format().find_step(mngr.directory, step).path)
        raise ResumeError(f"{step_dir}: the checkpoint of step {step} cannot be read ({read_error_text(e)}); "
                          + _earlier_step_advice(mngr, step)) from e
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
