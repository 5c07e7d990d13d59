"""Checkpoint-conversion benchmark: peak host memory and throughput of `python -m dsv32_jax.checkpoint.convert` on a synthetic
multi-shard FP8 checkpoint of a mid-size config (several GB on disk; kept under --workdir, never in the repo).

Every conversion runs in a child process; its peak RSS is that child's ru_maxrss (os.wait4). The fixed overhead is
measured the same way on a child that converts the tiny config (interpreter + jax + orbax + tensorstore + jit
caches). The acceptance bound is  peak RSS <= 2 x largest layer + fixed overhead,  with "largest layer" = the bytes
of the biggest group (one decoder layer, stacked experts included) in the orbax checkpoint's dtype.

    python bench/convert.py                         # mid config, ~4 GB FP8 on disk, bf16 orbax (~8 GB)
    python bench/convert.py --preset=mid_small      # ~0.5 GB variant (what tests/test_convert_slow.py runs)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import numpy as np  # noqa: E402

from dsv32_jax.model.config import load_preset  # noqa: E402
from dsv32_jax.checkpoint.io_utils import write_text_atomic  # noqa: E402

PRESETS = {
    # hidden 2048, 8 layers (1 dense + 7 MoE) + MTP, 64 experts of width 1024: ~4.0 GB as FP8, ~8 GB as bf16
    "mid": dict(vocab_size=32768, hidden_size=2048, intermediate_size=8192, moe_intermediate_size=1024,
                num_hidden_layers=8, num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=1,
                num_experts_per_tok=6, n_group=8, topk_group=4, first_k_dense_replace=1, index_n_heads=16,
                index_head_dim=128, index_topk=256, num_nextn_predict_layers=1),
    # same shapes per tensor family, 3 layers and 16 experts: ~0.45 GB as FP8
    "mid_small": dict(vocab_size=32768, hidden_size=2048, intermediate_size=8192, moe_intermediate_size=1024,
                      num_hidden_layers=3, num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16,
                      n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                      index_n_heads=16, index_head_dim=128, index_topk=256, num_nextn_predict_layers=1),
}


def preset_config(name: str):
    return load_preset("small").replace(**PRESETS[name])


def stored_group_bytes(orbax_dir: str) -> dict[str, int]:
    """Bytes of each group (globals, layers.i, mtp.j) as stored in an orbax checkpoint (from its metadata)."""
    from dsv32_jax.checkpoint import orbax_io

    reader = orbax_io.ParamsReader(orbax_dir)
    out: dict[str, int] = {}
    for path, m in reader.leaves.items():
        key = orbax_io.group_of(path)
        out[key] = out.get(key, 0) + int(np.prod(m.shape)) * np.dtype(m.dtype).itemsize
    return out


def disk_group_bytes(hf_dir: str, num_hidden_layers: int) -> dict[str, int]:
    """Bytes of each group in an HF checkpoint (layer >= num_hidden_layers: MTP)."""
    from dsv32_jax.checkpoint.safetensors_io import HFCheckpoint

    ckpt = HFCheckpoint(hf_dir)
    out: dict[str, int] = {}
    for name in ckpt.names():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            layer = int(parts[2])
            key = f"layers.{layer}" if layer < num_hidden_layers else f"mtp.{layer - num_hidden_layers}"
        else:
            key = "globals"
        out[key] = out.get(key, 0) + ckpt.location[name].nbytes(name)
    return out


# Runs the command from a minimal launcher process: on exec, Linux folds the hiwater RSS of the exec-ing address
# space into the new program's ru_maxrss, so a child spawned (vfork + exec) directly by this process, which has
# imported jax and generated checkpoints, would report this process's peak instead of its own.
_LAUNCHER = """
import json, os, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
json.dump({"seconds": time.perf_counter() - start, "peak_rss": usage.ru_maxrss * 1024,
           "rc": os.waitstatus_to_exitcode(status)}, open(sys.argv[1], "w"))
"""


def run_child(args: list[str], env=None) -> dict:
    """Runs a command; returns its wall time, peak RSS (bytes) and output. Raises if it fails."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        proc = subprocess.run([sys.executable, "-c", _LAUNCHER, result.name, *args], cwd=ROOT,
                              env={**os.environ, **(env or {})}, capture_output=True, text=True)
        info = json.load(open(result.name)) if os.path.getsize(result.name) else {"rc": proc.returncode}
    if proc.returncode != 0 or info["rc"] != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({info['rc']}):\n{proc.stderr[-4000:]}")
    return {**info, "stdout": proc.stdout, "stderr": proc.stderr}


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="mid", choices=sorted(PRESETS))
    p.add_argument("--workdir", default="/tmp/dsv32_convert_bench")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float8"])
    p.add_argument("--shard_size_gb", type=float, default=1.0)
    p.add_argument("--no-export", dest="export", action="store_false", help="skip orbax-to-hf --fp8")
    p.add_argument("--keep", action="store_true", help="keep the converted outputs")
    p.add_argument("--json", default=None, help="also write the results to this file")
    a = p.parse_args(argv)

    from make_synthetic_checkpoint import make_synthetic_checkpoint

    cfg = preset_config(a.preset)
    os.makedirs(a.workdir, exist_ok=True)
    src = os.path.join(a.workdir, f"hf_{a.preset}")
    stamp = os.path.join(a.workdir, f"hf_{a.preset}.json")
    want = {"config": cfg.to_hf(), "shard_size_gb": a.shard_size_gb, "seed": 0}
    if not (os.path.isdir(src) and os.path.exists(stamp) and json.load(open(stamp)) == want):
        shutil.rmtree(src, ignore_errors=True)
        t = time.perf_counter()
        info = make_synthetic_checkpoint(src, cfg, seed=0, shard_size_bytes=int(a.shard_size_gb * 1e9),
                                         k_norm_dtype="F32", progress=True)
        print(f"generated {src}: {info['tensors']} tensors, {info['bytes'] / 1e9:.2f} GB, {info['shards']} shards "
              f"in {time.perf_counter() - t:.0f} s")
        write_text_atomic(stamp, json.dumps(want))
    src_bytes = dir_bytes(src)
    disk = disk_group_bytes(src, cfg.num_hidden_layers)
    print(f"config {a.preset}: {src_bytes / 1e9:.2f} GB on disk in {len(os.listdir(src)) - 2} shards; largest layer "
          f"on disk {max(disk.values()) / 1e9:.3f} GB")

    # fixed overhead: the same CLI on the tiny config
    tiny_src, tiny_out = os.path.join(a.workdir, "hf_tiny"), os.path.join(a.workdir, "orbax_tiny")
    if not os.path.isdir(tiny_src):
        make_synthetic_checkpoint(tiny_src, "tiny", seed=0)
    py = sys.executable
    # the tiny conversion with every tensor through the jitted kernels (as the big one does), so that the overhead
    # includes XLA's compiler and runtime
    tiny_args = ["convert", "hf-to-orbax", f"--hf_dir={tiny_src}", f"--out={tiny_out}", f"--dtype={a.dtype}",
                 "--include_mtp", "--overwrite", "--noprogress"]
    base = run_child([py, "-c", "from dsv32_jax.checkpoint import convert, fp8_weights; fp8_weights.JAX_MIN_ELEMENTS = 0; "
                      f"convert.cli({tiny_args!r})"])
    overhead = base["peak_rss"]
    print(f"fixed overhead (tiny conversion child, jitted kernels): peak RSS {overhead / 2**20:.0f} MiB")

    out = os.path.join(a.workdir, f"orbax_{a.preset}_{a.dtype}")
    imp = run_child([py, "-m", "dsv32_jax.checkpoint.convert", "hf-to-orbax", f"--hf_dir={src}", f"--out={out}",
                     f"--dtype={a.dtype}", "--include_mtp", "--overwrite"])
    out_bytes = dir_bytes(out)
    stored = stored_group_bytes(out)
    largest_group = max(stored, key=stored.get)
    largest = stored[largest_group]
    print(f"largest layer {largest_group}: {largest / 1e9:.3f} GB as {a.dtype} ({disk[largest_group] / 1e9:.3f} GB on "
          "disk)")
    results = {
        "preset": a.preset, "dtype": a.dtype, "source_gb": src_bytes / 1e9, "largest_layer": largest_group,
        "largest_layer_gb": largest / 1e9, "largest_layer_disk_gb": disk[largest_group] / 1e9,
        "overhead_mib": overhead / 2**20,
        "import": {"seconds": imp["seconds"], "peak_rss_mib": imp["peak_rss"] / 2**20,
                   "read_gb_per_s": src_bytes / 1e9 / imp["seconds"], "written_gb": out_bytes / 1e9,
                   "bound_mib": (2 * largest + overhead) / 2**20},
    }
    print(imp["stderr"].strip().splitlines()[-1] if imp["stderr"].strip() else "")
    if a.export:
        back = os.path.join(a.workdir, f"hf_back_{a.preset}")
        exp = run_child([py, "-m", "dsv32_jax.checkpoint.convert", "orbax-to-hf", f"--ckpt={out}", f"--out={back}", "--fp8",
                         f"--shard_size_gb={a.shard_size_gb}", "--overwrite"])
        back_bytes = dir_bytes(back)
        results["export_fp8"] = {"seconds": exp["seconds"], "peak_rss_mib": exp["peak_rss"] / 2**20,
                                 "read_gb_per_s": out_bytes / 1e9 / exp["seconds"],
                                 "write_gb_per_s": back_bytes / 1e9 / exp["seconds"], "written_gb": back_bytes / 1e9,
                                 "bound_mib": (2 * largest + overhead) / 2**20}
        if not a.keep:
            shutil.rmtree(back, ignore_errors=True)
    if not a.keep:
        shutil.rmtree(out, ignore_errors=True)
    results["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(json.dumps(results, indent=2))
    ok = results["import"]["peak_rss_mib"] <= results["import"]["bound_mib"] and (
        not a.export or results["export_fp8"]["peak_rss_mib"] <= results["export_fp8"]["bound_mib"])
    print("peak RSS within 2 x largest layer + fixed overhead:", "yes" if ok else "NO")
    if a.json:
        write_text_atomic(a.json, json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
