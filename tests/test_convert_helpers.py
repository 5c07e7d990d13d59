"""Shared helpers of the checkpoint-conversion tests (no tests here): synthetic checkpoints, an independent numpy dequantization,
checkpoint surgery for the bad-input tests, and bitwise checkpoint comparison."""

from __future__ import annotations

import json
import os
import shutil
import sys

import ml_dtypes
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from make_synthetic_checkpoint import make_synthetic_checkpoint  # noqa: E402,F401

from dsv32_jax.checkpoint.safetensors_io import write_safetensors  # noqa: E402
from dsv32_jax.checkpoint.safetensors_io import HFCheckpoint, SafetensorsFile  # noqa: E402

INDEX = "model.safetensors.index.json"
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def numpy_dequantized_copy(src: str, dst: str) -> None:
    """F32 single-file copy of an HF checkpoint, FP8 weights dequantized block by block in plain numpy
    (independent of the library's kernels): W[i, j] = float(code[i, j]) * S[i // 128, j // 128]."""
    os.makedirs(dst, exist_ok=True)
    ckpt = HFCheckpoint(src)
    out = {}
    for name in sorted(ckpt.names()):
        if name.endswith("_scale_inv"):
            continue
        a = np.asarray(ckpt.get(name))
        if a.dtype == FP8:
            s = np.asarray(ckpt.get(name + "_scale_inv"), np.float32)
            w = a.astype(np.float32)
            for i in range(s.shape[0]):
                for j in range(s.shape[1]):
                    w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= s[i, j]
            out[name] = w
        else:
            out[name] = a.astype(np.float32)
    write_safetensors(os.path.join(dst, "model.safetensors"), out)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg.pop("quantization_config", None)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))


def read_all(path: str) -> dict[str, np.ndarray]:
    f = SafetensorsFile(path)
    return {n: np.array(f.get(n)) for n in f.keys()}


def shard_of(ckpt_dir: str, name: str) -> str:
    index = json.load(open(os.path.join(ckpt_dir, INDEX)))
    return index["weight_map"][name]


def edit_checkpoint(ckpt_dir: str, edit) -> None:
    """Applies edit(tensors: dict[name, array]) -> None to the union of all shards' tensors, then rewrites the shards
    (each tensor stays in its shard; new tensors go to the last shard) and the index."""
    index_path = os.path.join(ckpt_dir, INDEX)
    index = json.load(open(index_path))
    shards = sorted(set(index["weight_map"].values()))
    by_shard = {s: read_all(os.path.join(ckpt_dir, s)) for s in shards}
    tensors = {n: a for s in shards for n, a in by_shard[s].items()}
    home = {n: s for s in shards for n in by_shard[s]}
    edit(tensors)
    for s in shards:
        part = {n: a for n, a in tensors.items() if home.get(n, shards[-1]) == s}
        write_safetensors(os.path.join(ckpt_dir, s), part)
    index["weight_map"] = {n: home.get(n, shards[-1]) for n in sorted(tensors)}
    index["metadata"]["total_size"] = int(sum(a.nbytes for a in tensors.values()))
    json.dump(index, open(index_path, "w"))


def copy_checkpoint(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def compare_checkpoints(a_dir: str, b_dir: str) -> list[str]:
    """Names whose dtype or bytes differ (and names present in only one); [] when bit-identical."""
    a, b = HFCheckpoint(a_dir), HFCheckpoint(b_dir)
    diff = sorted(set(a.names()) ^ set(b.names()))
    for n in sorted(set(a.names()) & set(b.names())):
        if a.location[n].dtype_name(n) != b.location[n].dtype_name(n):
            diff.append(n)
        elif not np.array_equal(np.asarray(a.get(n)).view(np.uint8), np.asarray(b.get(n)).view(np.uint8)):
            diff.append(n)
    return diff


def leftovers(out: str) -> list[str]:
    """Temporary / partial directories next to `out` (none may remain after a failed conversion)."""
    parent, base = os.path.split(os.path.abspath(out))
    return sorted(p for p in os.listdir(parent) if p.startswith(base + ".") or p == base)
