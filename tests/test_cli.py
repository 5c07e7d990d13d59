"""The training entry point as a newcomer meets it: the no-flag default runs, a missing `config.init_from` is a
one-line error naming the stage to run first, and resume / init messages reach the console without orbax's chatter."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.data.seq_len=32", "--config.data.batch_size=2", "--config.log_every=1"]


def cli(*args, cwd):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "dsv32_jax.train.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("stage, previous", [("warmup", "dense"), ("sparse", "warmup"), ("grpo", "sparse")])
def test_missing_init_from_names_the_stage_to_run_first(tmp_path, stage, previous):
    missing = str(tmp_path / "nothing_here")
    res = cli(f"--config={ROOT}/configs/{stage}_tiny.py", f"--config.init_from={missing}",
              f"--workdir={tmp_path / 'w'}", cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert f"config.init_from={missing!r} does not exist" in res.stderr
    assert f"Run the {previous} stage first" in res.stderr and f"configs/{previous}_tiny.py" in res.stderr
    assert "--config.init_from=''" in res.stderr
    assert not (tmp_path / "w").exists()  # nothing half-made


def test_default_run_then_resume_is_visible_and_quiet(tmp_path):
    """No --config: the demo's first stage (dense, random init, built-in data). Rerunning resumes and says so."""
    first = cli("--config.steps=2", *SMALL, f"--workdir={tmp_path / 'w'}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "config dense_tiny (stage dense)" in first.stdout
    second = cli("--config.steps=3", *SMALL, f"--workdir={tmp_path / 'w'}", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {tmp_path / 'w' / 'checkpoints'} step 2" in second.stderr
    for out in (first.stderr, second.stderr):  # orbax logs every file it writes at INFO: filtered out
        assert "checkpointer.py" not in out and "checkpoint_manager.py" not in out, out[-2000:]
