"""The training entry point as a newcomer meets it: the no-flag default runs, and rerunning it resumes with the
message on the console and without orbax's INFO chatter (tests/test_train_loop.py covers a missing init_from)."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.data.seq_len=32", "--config.data.batch_size=2", "--config.log_every=1"]


def cli(*args, cwd):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "dsv32_jax.train.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.heavy
def test_default_run_then_resume_is_visible_and_quiet(tmp_path):
    """No --config: configs/quickstart.py (random init, built-in data). Rerunning resumes and says so."""
    first = cli("--config.steps=2", *SMALL, f"--workdir={tmp_path / 'w'}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "config quickstart (stage sparse)" in first.stdout
    second = cli("--config.steps=3", *SMALL, f"--workdir={tmp_path / 'w'}", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {tmp_path / 'w' / 'checkpoints'} step 2" in second.stderr
    # summary.json covers the whole run (its "first" was the resumed run's first step, step 3)
    with open(tmp_path / "w" / "summary.json") as f:
        summary = json.load(f)
    with open(tmp_path / "w" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert summary["steps"] == 3 and [r["step"] for r in rows] == [1, 2, 3]
    assert summary["first"]["loss"] == rows[0]["loss"] and summary["last"]["loss"] == rows[-1]["loss"]
    # orbax logs every file it writes at INFO: filtered out. Its warnings stay (on a slow machine: "Waiting for
    # previous save to complete took 1.4 seconds"), so the check is on the INFO records' source files: ours only.
    ours = {f for d in ("dsv32_jax", "train") for _, _, fs in os.walk(os.path.join(ROOT, d)) for f in fs}
    for out in (first.stderr, second.stderr):
        sources = set(re.findall(r"I\d{4} \d\d:\d\d:[\d.]+ +\d+ ([\w.]+\.py):\d+\]", out))
        assert sources <= ours, (sources - ours, out[-2000:])


def test_sweep_scripts_share_one_run_spec(tmp_path):
    """tools/run_spec.sh, which the three sweep scripts source: `N` is a seed, `Np` the same seed perturbed by
    config.init_perturb=1e-6, anything else is refused, naming the script and the run, before a run starts."""
    spec = os.path.join(ROOT, "tools", "run_spec.sh")
    show = 'run_spec demo "$1" && echo "seed=$seed perturb=${perturb[*]}"'
    for run, want in [("0", "seed=0 perturb="), ("12", "seed=12 perturb="),
                      ("3p", "seed=3 perturb=--config.init_perturb=1e-6")]:
        got = subprocess.run(["bash", "-c", f"set -u; source {spec}; {show}", "_", run], capture_output=True,
                             text=True, timeout=30)
        assert got.returncode == 0 and got.stdout.strip() == want, (run, got.stdout, got.stderr)
    for bad in ["p", "3q", "-1", "3pp", " 3", ""]:
        got = subprocess.run(["bash", "-c", f"set -u; source {spec}; {show}", "_", bad], capture_output=True,
                             text=True, timeout=30)
        assert got.returncode == 2 and got.stdout == "" and f"demo: run '{bad}' is not a seed N or Np" in got.stderr
    for script in ["train_sweep.sh", "grpo_sweep.sh", "thinking_sweep.sh"]:  # refused before anything runs
        got = subprocess.run(["bash", os.path.join(ROOT, "tools", script), "0x", "1"], cwd=tmp_path,
                             env=dict(os.environ, PY="/nonexistent/python", SWEEP_DIR=str(tmp_path / "out")),
                             capture_output=True, text=True, timeout=30)
        assert got.returncode == 2, (script, got.stderr)
        assert f"tools/{script}: run '0x' is not a seed N or Np" in got.stderr
        assert not (tmp_path / "out").exists()
