"""Synthetic HF checkpoints in the official DeepSeek-V3.2 on-disk layout, for any config.

Every tensor of `dsv32_jax.checkpoint.hf.hf_inventory(cfg)` is written with deterministic random values (seeded per tensor
name, so any tensor can be regenerated on its own): F8_E4M3 weights (codes with magnitudes 0.5..120 and one +-448
per 128x128 block, as a real amax/448 quantization produces) with F32 `weight_scale_inv` blocks that are not powers
of two (uniform(0.5, 2) * 2^-scale_exp), BF16 everything else, F32 `e_score_correction_bias`, the indexer k_norm in
F32 or BF16, and the MTP layer(s) (`model.layers.{num_hidden_layers}`: enorm, hnorm, eh_proj, shared_head, its own
decoder block, and exact copies of the embedding and LM head). Shards are size-bounded and named
`model-0000N-of-0000M.safetensors`, with `model.safetensors.index.json` (metadata.total_size) and config.json
(with quantization_config when fp8). Tensors are generated and written one at a time, so multi-GB checkpoints need
little memory.

    python tools/make_synthetic_checkpoint.py --config=tiny --out=/tmp/synth_tiny [--no-fp8] [--seed=0]
        [--shard_size_mb=5000] [--k_norm_dtype=F32|BF16] [--float_dtype=BF16|F32] [--no-mtp]
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv32_jax.model.config import ModelConfig, load_preset  # noqa: E402
from dsv32_jax.checkpoint.convert import QUANTIZATION_CONFIG  # noqa: E402
from dsv32_jax.checkpoint.io_utils import OutputExistsError, Progress, atomic_output_dir  # noqa: E402
from dsv32_jax.model.fp8 import SCALE_SUFFIX  # noqa: E402
from dsv32_jax.checkpoint.hf import hf_inventory, tensor_specs  # noqa: E402
from dsv32_jax.checkpoint.safetensors_io import ShardedSafetensorsWriter  # noqa: E402
from dsv32_jax.checkpoint.orbax_io import write_json  # noqa: E402
from dsv32_jax.checkpoint.safetensors_io import DTYPES  # noqa: E402


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def fp8_codes(rng: np.random.Generator, shape) -> np.ndarray:
    """Random e4m3 codes: sign, exponent 2^-1..2^6, any mantissa (no NaN, no subnormals); one +-448 per block."""
    bits = rng.integers(0, 256, size=shape, dtype=np.uint8)
    bits &= 0xBF  # exponent field 0..7
    bits += 0x30  # -> 6..13, i.e. magnitudes 0.5 .. 120
    bits[::128, ::128] = np.where(rng.random(bits[::128, ::128].shape) < 0.5, 0x7E, 0xFE)  # +-448: the block amax
    return bits.view(ml_dtypes.float8_e4m3fn)


def block_scales(rng: np.random.Generator, shape, scale_exp: int) -> np.ndarray:
    s = rng.uniform(0.5, 2.0, size=shape).astype(np.float32) * np.float32(2.0**-scale_exp)
    m, _ = np.frexp(s)
    s[m == 0.5] *= np.float32(1.1)  # never an exact power of two
    return s


def float_tensor(rng: np.random.Generator, name: str, shape, kind: str) -> np.ndarray:
    dtype = DTYPES[kind]
    if name.endswith("e_score_correction_bias"):
        x = rng.standard_normal(shape, dtype=np.float32) * 0.05
    elif len(shape) == 1 and name.endswith(".bias"):  # indexer k_norm bias
        x = rng.standard_normal(shape, dtype=np.float32) * 0.1
    elif len(shape) == 1:  # norm weights
        x = 1.0 + rng.standard_normal(shape, dtype=np.float32) * 0.1
    elif name.endswith("embed_tokens.weight"):
        x = rng.standard_normal(shape, dtype=np.float32)
    else:
        fan_in = shape[-1]
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(fan_in**-0.5)
    return x.astype(dtype)


def synthetic_inventory(cfg: ModelConfig, include_mtp: bool = True, fp8: bool = True, k_norm_dtype: str = "F32",
                        float_dtype: str = "BF16"):
    """(name, shape, dtype) of every tensor the generator writes, in write order."""
    for name, shape, kind in hf_inventory(cfg, include_mtp=include_mtp, fp8=fp8):
        if ".indexer.k_norm." in name:
            kind = k_norm_dtype
        elif kind == "BF16":
            kind = float_dtype
        yield name, tuple(shape), kind


def make_synthetic_checkpoint(out: str, cfg: ModelConfig | str, *, seed: int = 0, fp8: bool = True,
                              include_mtp: bool = True, shard_size_bytes: int = 5 * 10**9, k_norm_dtype: str = "F32",
                              float_dtype: str = "BF16", scale_exp: int = 11, overwrite: bool = False,
                              progress: bool = False) -> dict:
    """Writes the checkpoint to `out` (atomically); returns {tensors, bytes, shards, files}."""
    cfg = load_preset(cfg) if isinstance(cfg, str) else cfg
    specs = tensor_specs(cfg, include_mtp)
    canonical = {s.path: s.hf_names[0] for s in specs if not s.alias}
    alias_of = {n: canonical[s.path] for s in specs if s.alias for n in s.hf_names}
    entries = list(synthetic_inventory(cfg, include_mtp, fp8, k_norm_dtype, float_dtype))
    kinds = dict((n, k) for n, _, k in entries)
    total = sum(int(np.prod(s)) * DTYPES[k].itemsize for _, s, k in entries)
    bar = Progress("synthetic", len(entries), total, enabled=progress)
    with atomic_output_dir(out, overwrite) as tmp:
        writer = ShardedSafetensorsWriter(tmp, entries, shard_size_bytes, metadata={"generator": "dsv32-synthetic"})
        for name, shape, kind in entries:
            source = alias_of.get(name, name)
            rng = _rng(seed, source)
            if kind == "F8_E4M3":
                x = fp8_codes(rng, shape)
            elif name.endswith(SCALE_SUFFIX):
                x = block_scales(rng, shape, scale_exp)
            else:
                x = float_tensor(rng, source, shape, kinds.get(source, kind))
                if x.dtype != DTYPES[kind]:
                    x = x.astype(DTYPES[kind])
            writer.add(name, x)
            bar.update(1, x.nbytes)
            del x
        writer.close()
        config = cfg.replace(quantization_config=QUANTIZATION_CONFIG if fp8 else None).to_hf()
        config["torch_dtype"] = "bfloat16" if float_dtype == "BF16" else "float32"
        write_json(os.path.join(tmp, "config.json"), config)
    bar.close()
    return {"tensors": len(entries), "bytes": total, "shards": len(writer.files), "files": writer.files}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny", help="preset name or config.json path")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--shard_size_mb", type=float, default=5000.0)
    p.add_argument("--k_norm_dtype", choices=["F32", "BF16"], default="F32")
    p.add_argument("--float_dtype", choices=["BF16", "F32"], default="BF16")
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    try:
        info = make_synthetic_checkpoint(a.out, a.config, seed=a.seed, fp8=a.fp8, include_mtp=a.mtp,
                                         shard_size_bytes=int(a.shard_size_mb * 1e6), k_norm_dtype=a.k_norm_dtype,
                                         float_dtype=a.float_dtype, overwrite=a.overwrite, progress=True)
    except OutputExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {a.out}: {info['tensors']} tensors, {info['bytes'] / 1e9:.3f} GB, {info['shards']} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
