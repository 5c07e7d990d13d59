"""Damaged checkpoints give one error that names the step or file and the read error, not orbax's teardown.

When one read of an orbax restore fails, orbax closes its event loop under the reads still in flight; each of them
then reported its end on stderr (unraisable errors, asyncio's "exception was never retrieved" records, each with the
whole TensorStore spec): 1,300 to 4,000 lines around a raw traceback, the read error itself somewhere in the middle.
A resumed training run (`train/checkpointing.restore`) and a sharded load of a converted checkpoint
(`orbax_io.ParamsReader.load`) are checked here; the damage is a truncated data file, as a full disk or an
interrupted copy leaves it. The restore runs in a subprocess: most of the noise came at interpreter exit."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from conftest import child_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A 24-leaf state (random, so that its data does not compress into the metadata's size) saved at steps 1 and 2; step
# 2's data files truncated to 10 bytes; restore step 2 (ResumeError), then step 1 (exact).
# argv: workdir, use_async ("1": the data lands in ocdbt.process_0/d and the metadata stays readable; "0": one
# merged d/ holds both, so the metadata read fails first).
_SCRIPT = r"""
import glob, os, sys
import jax, jax.numpy as jnp, ml_collections
from flax import nnx
from dsv32_jax.train import checkpointing

workdir, use_async = sys.argv[1], sys.argv[2] == "1"
cfg = ml_collections.ConfigDict(dict(every=1, keep=3, use_async=use_async))


class M(nnx.Module):
    def __init__(self, fill):
        self.ws = nnx.List([nnx.Param(jax.random.normal(jax.random.key(i), (64, 64)) + fill) for i in range(24)])


state = nnx.state(M(0))
sh = jax.tree.map(lambda x: jax.sharding.SingleDeviceSharding(jax.devices()[0]), state)
with checkpointing.manager(workdir, cfg) as mngr:
    for step in (1, 2):
        checkpointing.save(mngr, step, arrays={"params": state}, json={}, force=True)
pattern = os.path.join(workdir, "checkpoints", "2", "params", "ocdbt.process_*" if use_async else "", "d", "*")
files = glob.glob(pattern)
assert files, pattern
for f in files:
    os.truncate(f, 10)
target = nnx.state(M(100))
with checkpointing.manager(workdir, cfg) as mngr:
    try:
        checkpointing.restore(mngr, 2, arrays={"params": (target, sh)})
        print("RESTORED 2")
    except checkpointing.ResumeError as e:
        print("RESUME_ERROR", e)
    checkpointing.restore(mngr, 1, arrays={"params": (target, sh)})
print("STEP1", all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(target), jax.tree.leaves(state))))
"""


@pytest.mark.parametrize("use_async, cause", [
    ("1", r"\(ValueError: OUT_OF_RANGE: Error reading \"ws\.\d+/0\.0\" in OCDBT database"),
    ("0", r"\(.*/checkpoints/2/params: cannot read the orbax checkpoint metadata \(orbax read none"),
])
def test_an_unreadable_training_checkpoint_is_one_resume_error(tmp_path, use_async, cause):
    """Mutants guarded: `restore` without the ResumeError wrapping (a bare Exception with the TensorStore spec),
    without `quiet_failed_reads` (stderr of hundreds of lines), check_stored skipping unreadable metadata (an
    AttributeError on orbax's None), and ParamsReader accepting orbax's None metadata."""
    import re

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env["XLA_FLAGS"] = child_xla_flags()
    res = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "w"), use_async], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    error = next((x for x in lines if x.startswith("RESUME_ERROR")), None)
    assert error is not None, res.stdout
    step_dir = re.escape(str(tmp_path / "w" / "checkpoints" / "2"))
    assert re.fullmatch(rf"RESUME_ERROR {step_dir}: the checkpoint of step 2 cannot be read {cause}.*\); move that "
                        r"directory away to resume from step 1, or start a new --workdir", error), error
    assert lines[-1] == "STEP1 True"  # the earlier step still restores, into the same state
    noise = [x for x in res.stderr.splitlines() if "WARNING" not in x and not x.startswith("Error details:")]
    assert len(noise) <= 3 and "Traceback" not in res.stderr, res.stderr[-3000:]


@pytest.fixture
def restore_hooks(monkeypatch):
    """The filters quiet_failed_reads leaves after a failure, taken out again after the test."""
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    yield
    from dsv32_jax.checkpoint import orbax_io

    logging.getLogger("asyncio").removeFilter(orbax_io._orphaned_read)


_SHARDED = r"""
import glob, os, sys
import jax
from dsv32_jax.checkpoint import orbax_io
from dsv32_jax.checkpoint.convert import hf_to_orbax
from dsv32_jax.checkpoint.safetensors_io import CheckpointError

root, out = sys.argv[1], sys.argv[2]
hf_to_orbax(os.path.join(root, "tests", "fixtures", "hf_short"), out, dtype="float32")
reader = orbax_io.ParamsReader(out)  # (the metadata is read before the damage)
for f in glob.glob(os.path.join(out, "params", "**", "d", "*"), recursive=True):
    os.truncate(f, 10)
paths = sorted(reader.leaves)[:6]
sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
try:
    reader.load(paths, shardings={p: sharding for p in paths})
except CheckpointError as e:
    print("CHECKPOINT_ERROR", e)
"""


def test_a_sharded_load_of_a_damaged_checkpoint_names_the_read_error(tmp_path):
    """ParamsReader.load with shardings (what `from_pretrained(mesh=...)` and `config.init_from` use) reported
    orbax's wrapper: the array index and ~150 lines of TensorStore spec, without the cause (or, when a zarr.json is
    damaged, the cause with ~3,000 characters of specs appended). Mutant guarded: the message from str(e)."""
    out = str(tmp_path / "o")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env["XLA_FLAGS"] = child_xla_flags()
    res = subprocess.run([sys.executable, "-c", _SHARDED, ROOT, out], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    msg = next((x for x in res.stdout.splitlines() if x.startswith("CHECKPOINT_ERROR")), None)
    assert msg is not None, res.stdout
    assert msg.startswith(f"CHECKPOINT_ERROR {os.path.join(out, 'params')}: failed to read [") and "OUT_OF_RANGE" in msg
    assert "TensorStore(" not in msg and "tensorstore_spec" not in msg and len(msg) < 900, msg
    # the conversion's progress bar redraws once more on a slower machine: only what is not the bar counts
    noise = [x for x in res.stderr.splitlines() if x.strip() and not x.startswith("hf-to-orbax:")]
    assert "Traceback" not in res.stderr and len(noise) <= 3, res.stderr[-3000:]


def test_quiet_failed_reads_drops_only_orphaned_reads_and_restores_after_a_success(restore_hooks):
    from dsv32_jax.checkpoint import orbax_io

    seen = []
    sys.unraisablehook = seen.append
    asyncio_log = logging.getLogger("asyncio")

    class Unraisable:
        def __init__(self, exc, obj=None):
            self.exc_value, self.object = exc, obj

    with orbax_io.quiet_failed_reads():
        sys.unraisablehook(Unraisable(RuntimeError("Event loop is closed")))
        sys.unraisablehook(Unraisable(ImportError("sys.meta_path is None, Python is likely shutting down")))
        sys.unraisablehook(Unraisable(RuntimeError("something else")))
        assert orbax_io._orphaned_read in asyncio_log.filters
        assert not asyncio_log.filter(logging.LogRecord("asyncio", logging.ERROR, "", 0,
                                                        "Task exception was never retrieved\nfuture: ...", (), None))
    assert [str(u.exc_value) for u in seen] == ["something else"]
    assert sys.unraisablehook == seen.append and orbax_io._orphaned_read not in asyncio_log.filters
    with pytest.raises(ValueError), orbax_io.quiet_failed_reads():
        raise ValueError("a read failed")
    assert sys.unraisablehook != seen.append and orbax_io._orphaned_read in asyncio_log.filters


def test_read_error_text_is_the_innermost_cause_without_tensorstore_specs():
    """TensorStore appends each spec it was reading to the message's first line (~1,500 characters each: seen when
    a zarr.json is damaged); orbax raises a bare Exception from the read error."""
    from dsv32_jax.checkpoint.orbax_io import read_error_text

    cause = ValueError('OUT_OF_RANGE: Error reading "w/zarr.json": byte range [0, 9) [tensorstore_spec=\'{"a": '
                       '{"b": "/x/"}}\'] [tensorstore_spec[1]=\'{"c": 2}\']\nsecond line')
    try:
        try:
            raise cause
        except ValueError as e:
            raise Exception("Encountered error while reading array index: ... TensorStore({...})") from e
    except Exception as wrapped:
        assert read_error_text(wrapped) == 'ValueError: OUT_OF_RANGE: Error reading "w/zarr.json": byte range [0, 9)'
    assert read_error_text(RuntimeError("x" * 500), limit=20) == "RuntimeError: xxxxxx ..."
