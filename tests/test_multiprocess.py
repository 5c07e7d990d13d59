"""Multi-process training with jax.distributed on localhost (CPU, gloo collectives): 2 processes x 4 devices give
the losses and gradient norms of 1 process x 8 devices for the dense and sparse stages (same mesh, the batch's
rows split over the processes: data.shards = 2, each process reading its own document shard), and a checkpoint
written by the 2 processes (parameters, optimizer state, both shards' data positions) is resumed by 1 process,
continuing exactly like the uninterrupted 1-process run."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = "fsdp:2,tensor:2,expert:2"
STEPS = 3  # the 2-process run stops at 2 (a checkpoint), the resumed run does step 3

SCRIPT = r"""
import json, os, sys
pid, nproc, port, root, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
if nproc > 1:
    jax.distributed.initialize(f"localhost:{port}", nproc, pid)
sys.path.insert(0, os.getcwd())
from tests.test_train import load_config
from dsv32_jax.train import data as data_lib
from dsv32_jax.train.trainer import Trainer

out = {}
for stage in ("dense", "sparse"):
    config = load_config(f"{stage}_tiny", steps=steps, log_every=1000, mesh="%s", init_from="", **{
        "data.seq_len": 32, "data.batch_size": 8, "data.shards": 2, "checkpoint.every": 2,
        "checkpoint.use_async": False, "optimizer.warmup_steps": 1, "optimizer.lr": 1e-3})
    config.model_overrides = {"initializer_range": 0.3, "index_topk": 8}
    trainer = Trainer(config, os.path.join(root, stage))
    it = data_lib.make_iterator(data_lib.DataConfig(**config.data.to_dict()), vocab_size=trainer.cfg.vocab_size,
                                process_index=jax.process_index(), process_count=jax.process_count())
    try:
        out[stage] = [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.fit(it)]
    finally:
        it.close()
print("RESULT " + json.dumps({"process": jax.process_index(), "devices": jax.device_count(),
                              "local_devices": jax.local_device_count(), "out": out}), flush=True)
""" % MESH


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run(nproc: int, root: str, steps: int) -> list[dict]:
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(pid), str(nproc), port, root, str(steps)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid in range(nproc)]
    results = []
    for pid, proc in enumerate(procs):
        try:
            stdout, stderr = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, f"process {pid}/{nproc} failed:\n{stderr[-4000:]}"
        line = [x for x in stdout.splitlines() if x.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT "):]))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiprocess")
    ref = _run(1, str(root / "one"), STEPS)
    two = _run(2, str(root / "two"), STEPS - 1)
    resumed = _run(1, str(root / "two"), STEPS)  # the 2-process workdir, continued by 1 process
    return ref[0], two, resumed[0], root


def test_two_processes_match_one_process_with_eight_devices(runs):
    ref, two, _, _ = runs
    assert ref["devices"] == 8 and ref["local_devices"] == 8
    assert [r["process"] for r in two] == [0, 1]
    assert all(r["devices"] == 8 and r["local_devices"] == 4 for r in two)
    for stage in ("dense", "sparse"):
        want = np.asarray(ref["out"][stage][:STEPS - 1])
        for r in two:  # every process sees the same global metrics
            got = np.asarray(r["out"][stage])
            print(stage, "1 x 8 (step, loss, grad norm):", want.tolist(), f"2 x 4 (process {r['process']}):",
                  got.tolist())
            np.testing.assert_array_equal(got[:, 0], want[:, 0])
            np.testing.assert_allclose(got[:, 1:], want[:, 1:], rtol=1e-5)
        assert want[0, 1] != want[1, 1]  # the steps saw different data and the loss moved


def test_two_process_checkpoint_resumes_on_one_process(runs):
    ref, _, resumed, root = runs
    for stage in ("dense", "sparse"):
        assert os.path.isdir(os.path.join(root, "two", stage, "checkpoints", str(STEPS - 1)))
        got = np.asarray(resumed["out"][stage])
        want = np.asarray(ref["out"][stage][STEPS - 1:])
        print(stage, "resumed on 1 process:", got.tolist(), "uninterrupted:", want.tolist())
        np.testing.assert_array_equal(got[:, 0], [STEPS])
        np.testing.assert_allclose(got[:, 1:], want[:, 1:], rtol=1e-5)
        with open(os.path.join(root, "two", stage, "checkpoints", str(STEPS - 1), "data", "metadata")) as f:
            data = json.load(f)
        assert data["num_shards"] == 2 and sorted(data["shards"]) == ["0", "1"]  # both processes' positions
