"""Sharded and multi-process training on CPU devices: the dense and sparse stages (with MTP, balance loss and the
bias update) give the same losses and gradient norms on 1 device, on 8 devices of one process
(fsdp:2,tensor:2,expert:2) and on 2 processes x 4 devices with jax.distributed on localhost (gloo collectives; the
batch's rows split over the processes: data.shards = 2, each process reading its own document shard); and a
checkpoint written by the 2 processes (parameters, optimizer state, both shards' data positions) is resumed by 1
process (sparse stage), continuing exactly like the uninterrupted run. Losses AND gradient norms are compared
(Adam's first steps are nearly sign-only, so equal losses alone would not catch a wrong gradient); few steps, since
float noise can later flip a near-tied routing / top-k choice. The sharded runs accumulate gradients over 2
microbatches (config.microbatches), the 1-device run takes each batch whole: the same step."""

import json
import os

import numpy as np
import pytest
from conftest import run_processes

MESH = "fsdp:2,tensor:2,expert:2"
STEPS = 3  # the 2-process run stops at 2 (a checkpoint), the resumed run does step 3

SCRIPT = r"""
import json, os, sys
pid, nproc, port, root, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
meshes = sys.argv[6].split(";")
stages = sys.argv[7].split(",")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={8 // nproc}"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
if nproc > 1:
    jax.distributed.initialize(f"localhost:{port}", nproc, pid)
sys.path.insert(0, os.getcwd())
from tests.test_train import load_config
from dsv32_jax.train import data as data_lib
from dsv32_jax.train.trainer import Trainer

out = {}
for stage in stages:
  for mesh in meshes:
    config = load_config(f"{stage}_tiny", steps=steps, log_every=1000, mesh=mesh, init_from="", **{
        "data.seq_len": 32, "data.batch_size": 8, "data.shards": 2, "checkpoint.every": 2,
        "checkpoint.use_async": False, "optimizer.warmup_steps": 1, "optimizer.lr": 1e-3,
        "loss.mtp_weight": 0.1, "loss.balance_weight": 1e-2, "loss.bias_update_speed": 1e-3,
        "microbatches": 1 if mesh == "fsdp:1" else 2})
    # 2 layers (a dense one and an MoE one) + the MTP layer: every kind of block, less to compile
    config.model_overrides = {"initializer_range": 0.3, "index_topk": 8, "num_hidden_layers": 2}
    trainer = Trainer(config, os.path.join(root, stage, mesh))
    i, n = trainer.data_shard
    it = data_lib.make_iterator(data_lib.DataConfig(**config.data.to_dict()), vocab_size=trainer.cfg.vocab_size,
                                process_index=i, process_count=n)
    try:
        out[f"{stage} {mesh}"] = [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.fit(it)]
    finally:
        it.close()
print("RESULT " + json.dumps({"process": jax.process_index(), "devices": jax.device_count(),
                              "local_devices": jax.local_device_count(), "out": out}), flush=True)
"""


def _run(nproc: int, root: str, steps: int, meshes=(MESH,), stages=("dense", "sparse")) -> list[dict]:
    return run_processes(SCRIPT, nproc, root, str(steps), ";".join(meshes), ",".join(stages))


@pytest.mark.heavy
@pytest.mark.xdist_group("multiprocess")
def test_one_device_eight_devices_and_two_processes_agree_and_resume_across(tmp_path):
    root = str(tmp_path)
    ref = _run(1, os.path.join(root, "one"), STEPS, meshes=("fsdp:1", MESH))[0]
    two = _run(2, os.path.join(root, "two"), STEPS - 1)
    # the 2-process sparse workdir (with MTP, DSA, MoE: the richest state) continued by 1 process
    resumed = _run(1, os.path.join(root, "two"), STEPS, stages=("sparse",))[0]
    assert ref["devices"] == 8 and ref["local_devices"] == 8
    assert [r["process"] for r in two] == [0, 1]
    assert all(r["devices"] == 8 and r["local_devices"] == 4 for r in two)
    for stage in ("dense", "sparse"):
        single = np.asarray(ref["out"][f"{stage} fsdp:1"])
        want = np.asarray(ref["out"][f"{stage} {MESH}"])
        print(stage, "1 device (step, loss, grad norm):", single.tolist(), "1 x 8:", want.tolist())
        np.testing.assert_array_equal(want[:, 0], [1, 2, 3])
        np.testing.assert_allclose(want[:, 1:], single[:, 1:], rtol=1e-5)
        assert want[0, 1] != want[1, 1]  # the steps saw different data and the loss moved
        for r in two:  # every process sees the same global metrics
            got = np.asarray(r["out"][f"{stage} {MESH}"])
            print(stage, f"2 x 4 (process {r['process']}):", got.tolist())
            np.testing.assert_array_equal(got[:, 0], want[:STEPS - 1, 0])
            np.testing.assert_allclose(got[:, 1:], want[:STEPS - 1, 1:], rtol=1e-5)
        # the 2-process checkpoint (step 2) holds both processes' data positions and resumes on 1 process
        ckpt = os.path.join(root, "two", stage, MESH, "checkpoints", str(STEPS - 1))
        with open(os.path.join(ckpt, "data", "metadata")) as f:
            data = json.load(f)
        assert data["num_shards"] == 2 and sorted(data["shards"]) == ["0", "1"]
        if stage != "sparse":
            continue
        got = np.asarray(resumed["out"][f"{stage} {MESH}"])
        print(stage, "resumed on 1 process:", got.tolist())
        np.testing.assert_array_equal(got[:, 0], [STEPS])
        np.testing.assert_allclose(got[:, 1:], want[STEPS - 1:, 1:], rtol=1e-5)


@pytest.mark.heavy
@pytest.mark.xdist_group("multiprocess")
def test_a_tensor_axis_across_processes_shares_the_batch_rows(tmp_path):
    """mesh tensor:2,expert:4 on 2 processes x 4 devices: the mesh's outermost axis of size > 1, tensor, spans the
    processes, so both processes' devices own all 8 rows of the batch (over expert). Each process used to load its
    process index's half (rows it does not own) and build a [4, 32] "global" batch of its own: another loss on each
    process (8.18 vs 8.36 at step 1), then a hang. Now both load row block 0 of 1 (trainer.data_shard) and the
    losses and gradient norms equal one device's."""
    mesh = "tensor:2,expert:4"
    ref = _run(1, os.path.join(str(tmp_path), "one"), 2, meshes=("fsdp:1",), stages=("dense",))[0]
    two = run_processes(SCRIPT, 2, os.path.join(str(tmp_path), "two"), "2", mesh, "dense", timeout=400)
    want = np.asarray(ref["out"]["dense fsdp:1"])
    for r in two:
        got = np.asarray(r["out"][f"dense {mesh}"])
        print(f"process {r['process']}:", got.tolist(), "1 device:", want.tolist())
        np.testing.assert_array_equal(got[:, 0], [1, 2])
        np.testing.assert_allclose(got[:, 1:], want[:, 1:], rtol=1e-5)
