"""Heavy conversion checks (`make test-slow`): peak memory on a multi-shard ~1 GB checkpoint, and a conversion killed
with SIGKILL half-way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_convert_helpers import ROOT, leftovers, make_synthetic_checkpoint

from dsv32_jax.checkpoint import orbax_io

pytestmark = pytest.mark.slow
sys.path.insert(0, os.path.join(ROOT, "bench"))


@pytest.fixture(scope="module")
def mid_small(tmp_path_factory):
    from convert import preset_config  # bench/convert.py

    path = str(tmp_path_factory.mktemp("mid") / "hf_mid_small")
    make_synthetic_checkpoint(path, preset_config("mid_small"), seed=0, shard_size_bytes=300_000_000)
    return path


def test_peak_memory_within_two_layers(tmp_path):
    """bench/convert.py: import (bf16) and export (--fp8) children stay under 2 x largest layer + fixed overhead."""
    out = tmp_path / "result.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "convert.py"), "--preset=mid_small",
                        f"--workdir={tmp_path}", "--shard_size_gb=0.3", f"--json={out}"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.load(open(out))
    print(json.dumps(res, indent=1))
    for phase in ("import", "export_fp8"):
        assert res[phase]["peak_rss_mib"] <= res[phase]["bound_mib"], phase


def test_killed_conversion_leaves_no_complete_directory(tmp_path, mid_small):
    out = str(tmp_path / "out")
    proc = subprocess.Popen([sys.executable, "-m", "dsv32_jax.checkpoint.convert", "hf-to-orbax", f"--hf_dir={mid_small}",
                             f"--out={out}", "--include_mtp", "--noprogress"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp = f"{out}.tmp-{proc.pid}"
    deadline = time.time() + 300
    while time.time() < deadline:  # wait until at least one layer has been written
        partial = os.path.join(tmp, orbax_io.PARAMS_DIR + ".partial_save")
        if os.path.isdir(partial) and len(os.listdir(partial)) >= 2:
            break
        assert proc.poll() is None, "conversion finished before it could be interrupted"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not os.path.exists(out)
    assert leftovers(out) == [os.path.basename(tmp)]
    assert not orbax_io.is_orbax_checkpoint(tmp) and not os.path.exists(os.path.join(tmp, orbax_io.META_FILE))
    # a new run is not disturbed by the stale temporary directory and produces a complete checkpoint
    r = subprocess.run([sys.executable, "-m", "dsv32_jax.checkpoint.convert", "hf-to-orbax", f"--hf_dir={mid_small}",
                        f"--out={out}", "--noprogress"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert orbax_io.is_orbax_checkpoint(out)
