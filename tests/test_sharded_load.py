"""Sharded loading (issue #33): `from_pretrained(orbax_dir, mesh=...)` restores every parameter straight into its
sharding, so each process of a multi-process run reads from the checkpoint only the slices its devices hold (FP8
codes dequantized slice by slice). One process with 8 CPU devices converts a synthetic FP8 checkpoint (hf-to-orbax
--dtype=float8 --mesh=fsdp:8) and loads it on an fsdp:8 mesh (the reference values and the 1-process byte count);
then 2 processes x 4 devices (jax.distributed on localhost) load it on the same 8-device mesh: every local shard
equals the reference bit for bit, and each process reads (/proc/self/io rchar around the load) what its devices
hold plus the fixed metadata overhead of a 1-process load -- about half of the checkpoint, not all of it."""

import os

import pytest
from conftest import run_processes


SCRIPT = r"""
import json, os, sys, time
pid, nproc, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={8 // nproc}"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
if nproc > 1:
    jax.distributed.initialize(f"localhost:{port}", nproc, pid)
import numpy as np
import jax.numpy as jnp
from flax import nnx
sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import dsv32_jax
from dsv32_jax.checkpoint import orbax_io

ckpt = os.path.join(work, "orbax")
if nproc == 1:
    from make_synthetic_checkpoint import make_synthetic_checkpoint
    from dsv32_jax.checkpoint.convert import hf_to_orbax
    cfg = dsv32_jax.load_preset("tiny").replace(vocab_size=4096, hidden_size=128, intermediate_size=256,
                                                moe_intermediate_size=64, num_hidden_layers=2)
    make_synthetic_checkpoint(os.path.join(work, "hf"), cfg, seed=0)
    hf_to_orbax(os.path.join(work, "hf"), ckpt, dtype="float8", include_mtp=True, mesh="fsdp:8", progress=False)


def rchar():
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])


def load():
    model = dsv32_jax.from_pretrained(ckpt, dtype=jnp.float32, mesh="fsdp:8")
    return jax.block_until_ready(dict(nnx.traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model)))))


load()  # first load: imports, compilations (reads of the Python installation would count otherwise)
before = rchar()
t0 = time.perf_counter()
flat = load()
seconds = time.perf_counter() - t0
read = rchar() - before

reader = orbax_io.ParamsReader(ckpt)
needed = 0  # bytes of the stored leaves this process's devices hold (distinct slices; FP8 scales whole)
for path, x in flat.items():
    stored = reader.dtype(path)
    needed += sum(int(np.prod([len(range(*s.indices(n))) for s, n in zip(idx, x.shape)]))
                  for idx in {tuple((s.start, s.stop) for s in sh.index): sh.index
                              for sh in x.addressable_shards}.values()) * stored.itemsize
    if stored == orbax_io.FP8_DTYPE:
        needed += int(np.prod(reader.shape(orbax_io.scale_path(path)))) * 4
total = sum(int(np.prod(reader.shape(p))) * reader.dtype(p).itemsize for p in reader.leaves)
ref_file = os.path.join(work, "reference.npz")
names = {"/".join(map(str, p)): p for p in flat}
if nproc == 1:
    np.savez(ref_file, **{k: np.asarray(flat[p]) for k, p in names.items()})
    checked = len(names)
else:
    ref = np.load(ref_file)
    checked = 0
    for k, p in names.items():
        for sh in flat[p].addressable_shards:
            np.testing.assert_array_equal(np.asarray(sh.data), ref[k][sh.index], err_msg=k)
        checked += 1
sharded = sum(not x.sharding.is_fully_replicated for x in flat.values())
print("RESULT " + json.dumps({"process": jax.process_index(), "devices": jax.device_count(),
                              "local_devices": jax.local_device_count(), "read": read, "needed": needed,
                              "total": total, "seconds": seconds, "checked": checked, "leaves": len(flat),
                              "sharded_leaves": sharded}), flush=True)
"""


def _run(nproc: int, work: str) -> list[dict]:
    return run_processes(SCRIPT, nproc, work)


@pytest.mark.heavy
@pytest.mark.xdist_group("multiprocess")
def test_two_processes_each_read_their_half_and_load_the_same_values(tmp_path):
    work = str(tmp_path)
    one = _run(1, work)[0]
    two = _run(2, work)
    assert one["devices"] == 8 and one["needed"] == one["total"]
    assert [r["process"] for r in two] == [0, 1] and all(r["local_devices"] == 4 for r in two)
    overhead = one["read"] - one["total"]  # metadata (orbax _METADATA, OCDBT manifest, config.json) of one load
    print(f"1 process: read {one['read']} bytes, checkpoint {one['total']} bytes of parameters, {one['seconds']:.2f} s")
    for r in two:
        assert r["checked"] == r["leaves"] == one["leaves"] and r["sharded_leaves"] > r["leaves"] // 2
        print(f"process {r['process']} of 2: read {r['read']} bytes = {r['read'] / one['read']:.2f} of the "
              f"1-process read; holds {r['needed']} bytes = {r['needed'] / r['total']:.2f} of the parameters; "
              f"{r['seconds']:.2f} s")
        # what its devices hold (about half: the replicated norms / scales are read by both) + the same metadata
        assert r["needed"] < 0.6 * r["total"]
        assert r["read"] <= r["needed"] + 1.25 * overhead + 64 * 1024, r
        assert r["read"] < 0.7 * one["read"], r
