"""Streaming checkpoint conversion: HF safetensors (FP8 e4m3 + 128x128 weight_scale_inv, or BF16/F32) <-> the
dsv32-jax orbax checkpoint (see `dsv32_jax.checkpoint.orbax_io` for its layout), and training workdirs (W) -> HF, as an absl CLI:

    python -m dsv32_jax.checkpoint.convert hf-to-orbax --hf_dir=D --out=O [--dtype=bfloat16|float32|float8] [--include_mtp]
                                            [--mesh=fsdp:2,tensor:4] [--init_indexer=auto|load|fresh] [--overwrite]
    python -m dsv32_jax.checkpoint.convert orbax-to-hf --ckpt=O|W --out=D [--step=N] [--fp8] [--dtype=bfloat16|float32]
                                            [--shard_size_gb=5] [--overwrite]

Both directions are driven by one mapping table, `dsv32_jax.checkpoint.hf.tensor_specs`, and work one layer at a time:
hf-to-orbax reads every tensor through memory-mapped safetensors (dtypes from the file headers), dequantizes FP8
with its block scales (expanded and cropped for ragged edges such as kv_a_proj_with_mqa's 576 rows), transposes to
the Flax [in, out] layout, stacks the routed experts per layer ([E, in, out]), and hands each finished layer to
orbax (`ParamsWriter`), so the host holds about one layer. orbax-to-hf restores one layer at a time and streams
the HF tensors straight into pre-planned safetensors shards (`ShardedSafetensorsWriter`: the header of each shard is
computed from the mapping table up front, so a shard is written sequentially without ever holding it in memory).
With --fp8 the export re-quantizes each 128x128 block (scale = amax / 448 in float32, not rounded to a power of two;
codes = clip(w / scale) as e4m3); a float8 orbax checkpoint is exported bit-exactly (codes and scales as stored).

orbax-to-hf also exports a training run: --ckpt=W naming a training workdir (`python -m dsv32_jax.train.main --workdir=W`,
recognized by its W/checkpoints/ CheckpointManager directory and no dsv32_meta.json) exports the latest finished
step, or --step=N. Only the step's `params` item is read (one parameter at a time, as numpy on the host; the
optimizer state is never touched), and the model config is the `model_config` field of its `meta` item (the HF
config dict the trainer records at every save). Without --dtype every tensor keeps the dtype it was trained in
(float32 training -> F32 tensors); --dtype=bfloat16 / --fp8 convert as for any checkpoint. The MTP layer is
exported whenever the config has one (the trainer always builds and trains it). --step is an error for a
converted checkpoint, which holds a single set of weights.

Safety: the whole inventory (names, shapes, dtypes, scales) is checked from the headers before any data is
converted; every error names the file and the tensor and says what was expected. Values are checked too (NaN/Inf in
a weight, negative or non-finite scales, MTP copies of the embedding/LM head that differ from the originals).
Output goes to `<out>.tmp-<pid>` and is renamed into place only when complete; an existing non-empty output is
refused unless --overwrite. A killed conversion leaves only the `.tmp-<pid>` directory, without the marker file
(`dsv32_meta.json`, or `model.safetensors.index.json` for exports) that makes a directory look complete.

The numeric kernels (dequantize / cast / transpose / quantize) are jitted JAX on the host CPU: about 2x faster than
numpy for these memory-bound conversions on this machine, and bitwise identical (float32 products, round-to-nearest
casts).
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Mapping

import jax
import numpy as np

from dsv32_jax.checkpoint import orbax_io
from dsv32_jax.model import sharding as shd
from dsv32_jax.model.config import ConfigError, ModelConfig
from dsv32_jax.model.fp8 import SCALE_SUFFIX
from dsv32_jax.checkpoint.io_utils import (OutputExistsError, OutputPathError, Progress, atomic_output_dir,
                                           check_output_parent, copy_tokenizer_files)
from dsv32_jax.checkpoint.hf import TensorSpec, tensor_specs
from dsv32_jax.checkpoint.fp8_weights import BF16, BLOCK, F32, FP8, _quantize, fp8_blocks, convert_tensor, dequant_fp8, quantize_fp8
from dsv32_jax.checkpoint.validate import FLOAT_KINDS, _kernel_shape, check_hf_checkpoint
from dsv32_jax.checkpoint.safetensors_io import (DTYPE_NAMES, DTYPES, CheckpointError, HFCheckpoint, check_alias, check_finite,
                                      check_scale_values,
                                      ShardedSafetensorsWriter, _nbytes)

IMPORT_DTYPES = ("bfloat16", "float32", "float8")
EXPORT_DTYPES = ("bfloat16", "float32")
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [BLOCK, BLOCK], "scale_fmt": "ue8m0"}


# ============================================================================================ hf -> orbax
def _abstract_state(cfg: ModelConfig, param_dtype):
    from flax import nnx

    from dsv32_jax.model.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=param_dtype, param_dtype=param_dtype))
    state = nnx.state(abstract)
    leaves = {tuple(p): v for p, v in orbax_io.flatten_pure(nnx.to_pure_dict(state))}
    return leaves, orbax_io.param_axes(state)


def _groups(specs: list[TensorSpec]) -> list[tuple[str, list[TensorSpec]]]:
    """Specs by write/read group, in processing order. An alias (the MTP copy of embed / lm_head) goes with its
    MTP layer, not with the globals it points at."""
    out: dict[str, list] = {}
    group = "globals"
    for spec in specs:
        if not spec.alias:
            group = orbax_io.group_of(spec.path)
        out.setdefault(group, []).append(spec)
    return sorted(out.items(), key=lambda kv: orbax_io.group_sort_key(kv[0]))


def _ordered(specs: list[TensorSpec]) -> list[TensorSpec]:
    return [s for _, group in _groups(specs) for s in group]


def _stored_dtype(spec: TensorSpec, model_dtype: np.dtype, keep_fp8: bool, kinds: set[str]) -> np.dtype:
    """dtype of a non-FP8 leaf in the orbax checkpoint: the model's parameter dtype, except that nothing small is
    rounded below its source precision -- vectors (norm weights, k_norm, biases) whose source is F32 stay float32,
    and in float8 checkpoints every non-quantized tensor keeps its source precision (BF16 or F32)."""
    wide = bool(kinds - {"BF16", "F8_E4M3"})
    if model_dtype == F32:
        return F32
    if keep_fp8 and not spec.quantized:
        return F32 if wide else BF16
    if wide and len(spec.hf_shape) == 1:
        return F32
    return model_dtype


def _import_spec(ckpt: HFCheckpoint, spec: TensorSpec, keep_fp8: bool, dtype: np.dtype, progress: Progress):
    """The stored leaf (and its scale when keep_fp8) of one spec, read tensor by tensor."""
    stacked = len(spec.hf_names) > 1
    kshape = _kernel_shape(spec)
    if keep_fp8:
        codes = np.empty(kshape, FP8) if stacked else None
        scales = np.empty(fp8_blocks(kshape), F32) if stacked else None
    else:
        out = np.empty(kshape, dtype) if stacked else None
    for i, name in enumerate(spec.hf_names):
        src = ckpt.get(name)
        nbytes = src.nbytes
        kind = ckpt.location[name].dtype_name(name)
        scale = None
        if kind == "F8_E4M3":
            sname = name + SCALE_SUFFIX
            scale = np.asarray(ckpt.get(sname), F32)
            check_scale_values(ckpt, sname, scale)
            nbytes += ckpt.location[sname].nbytes(sname)
        if keep_fp8:
            if scale is not None:
                c, ok = convert_tensor(src, None, FP8, spec.transpose)
                check_finite(ok, ckpt, name)
                s = np.ascontiguousarray(scale.T) if spec.transpose else scale
            else:
                c, s, ok = _quantize(src, spec.transpose)
                check_finite(ok, ckpt, name)
            if stacked:
                codes[i], scales[i] = c, s
            else:
                codes, scales = c, s
        else:
            if scale is not None:
                y, ok = convert_tensor(src, scale, dtype, spec.transpose)
            else:
                y, ok = convert_tensor(src, None, dtype, spec.transpose)
            check_finite(ok, ckpt, name)
            if stacked:
                out[i] = y
            else:
                out = y
            del y
        del src
        progress.update(1 + (scale is not None), nbytes)
    if keep_fp8:
        return [(orbax_io.str_path(spec.path), codes), (orbax_io.scale_path(spec.path), scales)]
    return [(orbax_io.str_path(spec.path), out)]


def _source_bytes(ckpt: HFCheckpoint, specs: list[TensorSpec]) -> tuple[int, int]:
    n, total = 0, 0
    for spec in specs:
        for name in spec.hf_names:
            for t in (name, name + SCALE_SUFFIX):
                if t in ckpt:
                    n += 1
                    total += ckpt.location[t].nbytes(t)
    return n, total


# hf-to-orbax writes a group's converted tensors once they hold this many bytes (and at the group's end)
FLUSH_BYTES = 64 << 20


def hf_to_orbax(hf_dir: str, out: str, dtype: str = "bfloat16", include_mtp: bool = False, mesh=None,
                rules=None, overwrite: bool = False, progress: bool = True, init_indexer: str = "auto",
                seed: int = 0) -> dict:
    """Converts an HF checkpoint directory to a dsv32-jax orbax checkpoint at `out` (see module docstring).

    dtype: 'bfloat16' / 'float32' (FP8 dequantized) or 'float8' (FP8 codes + float32 block scales kept for the
    quantized tensors). include_mtp: also convert the MTP layer(s) (error if absent). mesh: a Mesh or spec string
    to write sharded arrays. init_indexer: as `from_pretrained`'s ("auto": a `deepseek_v3` checkpoint without
    indexer tensors, i.e. DeepSeek-V3.1-Terminus, where the warm-up starts, gets fresh lightning indexers); fresh
    indexers are `Transformer(cfg)`'s initialization from `seed` (V3.2's geometry unless config.json gives one),
    stored in the model dtype (never FP8) and recorded in dsv32_meta.json ("indexers"). Returns a summary dict
    (tensors, bytes, seconds, GB/s).
    """
    from dsv32_jax.checkpoint.hf import is_indexer_spec
    from dsv32_jax.checkpoint.loading import _fresh_indexers, resolve_init_indexer

    if dtype not in IMPORT_DTYPES:
        raise ValueError(f"--dtype must be one of {IMPORT_DTYPES} for hf-to-orbax, got {dtype!r}")
    check_output_parent(out)  # before the inventory checks and the fresh indexers' compile
    hf_dir = os.fspath(hf_dir)
    cfg = ModelConfig.from_hf(hf_dir)
    ckpt = HFCheckpoint(hf_dir)
    if include_mtp and cfg.num_nextn_predict_layers < 1:
        raise CheckpointError(f"{hf_dir}/config.json: include_mtp requested but num_nextn_predict_layers is "
                              f"{cfg.num_nextn_predict_layers}")
    fresh_indexers = resolve_init_indexer(init_indexer, ckpt, hf_dir) == "fresh"
    src_dtypes = check_hf_checkpoint(ckpt, cfg, include_mtp, include_indexer=not fresh_indexers)
    if isinstance(mesh, str):
        mesh = shd.make_mesh(mesh)
    keep_fp8 = dtype == "float8"
    model_cfg = cfg if include_mtp else cfg.replace(num_nextn_predict_layers=0)
    leaves, axes = _abstract_state(model_cfg, BF16 if keep_fp8 else np.dtype(dtype))
    specs = tensor_specs(cfg, include_mtp)
    main_names = {s.path: s.hf_names[0] for s in specs if not s.alias}
    missing = set(leaves) - set(main_names)
    if missing:  # the mapping table must cover the model exactly
        raise RuntimeError(f"tensor_specs does not cover model parameters {sorted(missing)[:3]}")
    fresh = None
    if fresh_indexers:  # one init of the indexers alone (jit keeps only them), in the stored float dtype
        fresh_dtype = BF16 if keep_fp8 else np.dtype(dtype)
        tree = jax.device_get(jax.jit(lambda: _fresh_indexers(model_cfg, seed, fresh_dtype, fresh_dtype, None,
                                                               None, None))())
        fresh = {tuple(p): np.asarray(v) for p, v in orbax_io.flatten_pure(tree)}
    n_total, bytes_total = _source_bytes(ckpt, specs)
    bar = Progress("hf-to-orbax", n_total, bytes_total, enabled=progress)
    with atomic_output_dir(out, overwrite, inputs=[hf_dir]) as tmp:
        copy_tokenizer_files(hf_dir, tmp)  # kept beside the weights, so that orbax-to-hf can export them again
        writer = orbax_io.ParamsWriter(tmp)
        for group, gspecs in _groups(specs):
            # a group is written in parts of at least FLUSH_BYTES (one partial save each), so that converting the
            # next large tensor (the globals' lm_head after embed_tokens) does not hold the previous one too
            subtree: dict = {}
            held = 0
            for spec in gspecs:
                if spec.alias:
                    bar.update(1, check_alias(ckpt, spec.hf_names[0], main_names[spec.path]))
                    continue
                if fresh is not None and is_indexer_spec(spec):
                    pairs = [(orbax_io.str_path(spec.path), fresh[tuple(spec.path)])]
                else:
                    target = _stored_dtype(spec, np.dtype(leaves[spec.path].dtype), keep_fp8,
                                           {src_dtypes[n] for n in spec.hf_names})
                    pairs = _import_spec(ckpt, spec, keep_fp8 and spec.quantized, target, bar)
                for path, value in pairs:
                    if mesh is not None:
                        leaf_axes = axes.get(spec.path, ()) if path[-1] == str(spec.path[-1]) else ()
                        value = jax.device_put(value, orbax_io.logical_sharding(leaf_axes, value.shape, mesh, rules))
                    orbax_io.set_leaf(subtree, path, value)
                    held += value.nbytes
                if held >= FLUSH_BYTES:
                    writer.write(group, subtree)
                    subtree, held = {}, 0
            if subtree:
                writer.write(group, subtree)
            del subtree
        writer.finalize()
        out_cfg = cfg.replace(quantization_config=(cfg.quantization_config or QUANTIZATION_CONFIG) if keep_fp8 else None)
        orbax_io.write_json(os.path.join(tmp, orbax_io.CONFIG_FILE), out_cfg.to_hf())
        meta = {
            "format": orbax_io.FORMAT_NAME, "version": orbax_io.FORMAT_VERSION, "dtype": dtype,
            "fp8": keep_fp8, "include_mtp": bool(include_mtp and cfg.num_nextn_predict_layers > 0),
            "groups": writer.groups, "source": os.path.abspath(hf_dir),
            "hf_dtypes": {s.hf_names[0]: src_dtypes[s.hf_names[0]] for s in specs
                          if not s.alias and s.hf_names[0] in src_dtypes},
            "indexers": {"fresh": True, "seed": int(seed)} if fresh_indexers else {"fresh": False},
            "mesh": None if mesh is None else {k: v for k, v in mesh.shape.items() if v > 1},
            "created_by": "python -m dsv32_jax.checkpoint.convert hf-to-orbax",
        }
        orbax_io.write_json(os.path.join(tmp, orbax_io.META_FILE), meta)
    bar.close()
    return {"tensors": bar.items, "bytes": bar.nbytes, "seconds": bar.elapsed,
            "gb_per_s": bar.nbytes / 1e9 / max(bar.elapsed, 1e-9), "out": os.path.abspath(out),
            "source": os.path.abspath(hf_dir)}


# ============================================================================================ orbax -> hf
def _export_kind(spec: TensorSpec, requested: str | None, src_dtypes: Mapping[str, str]) -> str:
    if spec.hf_dtype == "F32":  # e_score_correction_bias stays float32
        return "F32"
    if requested:
        return {"bfloat16": "BF16", "float32": "F32"}[requested]
    src = src_dtypes.get(spec.hf_names[0])
    if src in FLOAT_KINDS:
        return src
    return "BF16" if src == "F8_E4M3" else spec.hf_dtype


def _export_plan(specs, fp8: bool, requested, src_dtypes, alias_of) -> list[tuple[str, tuple, str]]:
    plan = []
    for spec in specs:
        ref = alias_of.get(spec.path, spec) if spec.alias else spec
        for name in spec.hf_names:
            if fp8 and spec.quantized:
                plan.append((name, tuple(spec.hf_shape), "F8_E4M3"))
                plan.append((name + SCALE_SUFFIX, tuple(-(-n // BLOCK) for n in spec.hf_shape), "F32"))
            else:
                plan.append((name, tuple(spec.hf_shape), _export_kind(ref, requested, src_dtypes)))
    return plan


def _source_dtypes(source: orbax_io.StoredParams) -> tuple[dict, str]:
    """(HF name -> safetensors dtype the export reproduces by default, config.json torch_dtype without --dtype):
    a converted checkpoint's dtypes recorded at import and its source's torch_dtype (config.json keeps it); a
    training run's dtypes as trained."""
    if not source.training:
        return source.meta.get("hf_dtypes") or {}, source.cfg.torch_dtype
    reader = source.reader
    dtypes = {s.hf_names[0]: DTYPE_NAMES.get(reader.dtype(s.path))
              for s in tensor_specs(source.cfg, source.has_mtp) if not s.alias and s.path in reader}
    default = "float32" if ("embed",) in reader and reader.dtype(("embed",)) == F32 else "bfloat16"
    return dtypes, default


def _recorded_tokenizer(source: orbax_io.StoredParams) -> str | None:
    """The tokenizer.json a training workdir's checkpoint names (its meta's "tokenizer",
    `train.data.tokenizers.tokenizer_record`), when that file exists; None for "byte" (no file) and for a converted
    checkpoint (its tokenizer files lie beside it)."""
    spec = source.meta.get("tokenizer") if source.training and isinstance(source.meta, dict) else None
    return spec if isinstance(spec, str) and spec.endswith(".json") and os.path.isfile(spec) else None


def orbax_to_hf(ckpt: str, out: str, fp8: bool = False, dtype: str | None = None, shard_size_gb: float = 5.0,
                overwrite: bool = False, progress: bool = True, step: int | None = None) -> dict:
    """Exports a dsv32-jax orbax checkpoint, or a training workdir's checkpoint, to HF layout: size-bounded
    safetensors shards + index + config.json.

    ckpt: a converted checkpoint (hf-to-orbax; has dsv32_meta.json) or a training workdir (`python -m dsv32_jax.train.main
    --workdir=W`; has checkpoints/): its latest finished step, or `step`; only the params item is read (one
    parameter at a time, on the host), the model config comes from the step's meta item.
    fp8: quantized tensors as F8_E4M3 + F32 128x128 weight_scale_inv (bit-exact from a float8 checkpoint, else
    re-quantized); dtype: 'bfloat16' / 'float32' for the other tensors (default: the source checkpoint's dtypes
    recorded at import, else the official ones; for a training workdir, the dtypes the parameters were trained in).
    """
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype must be one of {EXPORT_DTYPES} for orbax-to-hf (use --fp8 for FP8), got {dtype!r}")
    if not 0 < shard_size_gb < 1e9:  # (inf and nan refused: the byte count is an int)
        raise ValueError(f"--shard_size_gb must be a finite number of GB > 0, got {shard_size_gb}")
    check_output_parent(out)  # before the checkpoint is opened and checked
    ckpt = os.fspath(ckpt)
    source = orbax_io.open_params(ckpt, step)
    cfg, include_mtp, reader = source.cfg, source.has_mtp, source.reader
    src_dtypes, default_dtype = _source_dtypes(source)
    specs = tensor_specs(cfg, include_mtp)
    orbax_io.check_stored_tree(reader, {s.path: _kernel_shape(s) for s in specs if not s.alias},
                               allow_extra_prefix=None if include_mtp else [("mtp",)])
    main_spec = {s.path: s for s in specs if not s.alias}
    plan = _export_plan(_ordered(specs), fp8, dtype, src_dtypes, main_spec)
    total = sum(_nbytes(s, k) for _, s, k in plan)
    bar = Progress("orbax-to-hf", len(plan), total, enabled=progress)
    with atomic_output_dir(out, overwrite, inputs=[source.guard]) as tmp:
        copied = copy_tokenizer_files(os.fspath(ckpt), tmp)
        recorded = _recorded_tokenizer(source)
        if "tokenizer.json" not in copied and recorded:  # (a workdir records the tokenizer it trained with)
            shutil.copy2(recorded, os.path.join(tmp, "tokenizer.json"))
        writer = ShardedSafetensorsWriter(tmp, plan, int(shard_size_gb * 1e9),
                                          metadata={"converted_by": "dsv32_jax.checkpoint.convert"})
        try:
            for spec in _ordered(specs):  # one parameter (e.g. a layer's stacked w_gate) in memory at a time
                wanted = [spec.path] + ([orbax_io.scale_path(spec.path)] if reader.dtype(spec.path) == FP8 else [])
                stored = reader.load(wanted)
                _export_spec(writer, spec, main_spec.get(spec.path, spec), stored, fp8, dtype, src_dtypes, bar,
                             source.label)
                del stored
            writer.close()
        except BaseException:
            writer.abort()
            raise
        out_cfg = cfg.replace(quantization_config=(cfg.quantization_config or QUANTIZATION_CONFIG) if fp8 else None)
        hf = out_cfg.to_hf()
        if not include_mtp:
            hf["num_nextn_predict_layers"] = cfg.num_nextn_predict_layers
        hf["torch_dtype"] = "bfloat16" if fp8 else (dtype or default_dtype)
        orbax_io.write_json(os.path.join(tmp, "config.json"), hf)
    bar.close()
    return {"tensors": bar.items, "bytes": bar.nbytes, "seconds": bar.elapsed, "shards": len(writer.files),
            "gb_per_s": bar.nbytes / 1e9 / max(bar.elapsed, 1e-9), "out": os.path.abspath(out),
            "source": source.label}


def _export_spec(writer: ShardedSafetensorsWriter, spec: TensorSpec, ref: TensorSpec, store, fp8: bool, dtype,
                 src_dtypes, bar: Progress, where: str = "the checkpoint") -> None:
    leaf = store[orbax_io.str_path(spec.path)]
    scale = store.get(orbax_io.scale_path(spec.path)) if leaf.dtype == FP8 else None
    for what, v in (("", leaf), (" (its FP8 scales)", scale)):
        # (a diverged run's weights: hf-to-orbax and from_pretrained refuse them, so an export must not write them)
        if v is not None and not np.all(np.isfinite(v)):
            raise CheckpointError(f"{where}: parameter {'.'.join(orbax_io.str_path(spec.path))}{what} (HF "
                                  f"{spec.hf_names[0]}{' ...' if len(spec.hf_names) > 1 else ''}) contains NaN or Inf "
                                  "values: nothing was exported")
    stacked = len(spec.hf_names) > 1
    kind = _export_kind(ref, dtype, src_dtypes)
    for i, name in enumerate(spec.hf_names):
        x = leaf[i] if stacked else leaf
        s = None if scale is None else (scale[i] if stacked else scale)
        if fp8 and spec.quantized:
            if s is not None:  # stored FP8: bit-exact
                codes, _ = convert_tensor(x, None, FP8, spec.transpose, check=False)
                sc = np.ascontiguousarray(s.T) if spec.transpose else s
            else:
                codes, sc = quantize_fp8(x, transpose=spec.transpose)
            writer.add(name, codes)
            writer.add(name + SCALE_SUFFIX, np.asarray(sc, F32))
            bar.update(2, codes.nbytes + sc.nbytes)
            continue
        if s is not None:
            y = dequant_fp8(x, s, DTYPES[kind], transpose=spec.transpose)
        else:
            y, _ = convert_tensor(x, None, DTYPES[kind], spec.transpose, check=False)
        writer.add(name, y)
        bar.update(1, y.nbytes)
        del y


# ================================================================================================== CLI
COMMANDS = ("hf-to-orbax", "orbax-to-hf")
USAGE = __doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1]


def _define_flags():
    from absl import flags

    if "shard_size_gb" in flags.FLAGS:
        return flags.FLAGS
    flags.DEFINE_string("hf_dir", None, "hf-to-orbax: HF checkpoint directory (config.json + safetensors shards).")
    flags.DEFINE_string("ckpt", None, "orbax-to-hf: a dsv32-jax orbax checkpoint directory (from hf-to-orbax) or a "
                        "training workdir (python -m dsv32_jax.train.main --workdir=W; its latest checkpoint unless --step).")
    flags.DEFINE_integer("step", None, "orbax-to-hf from a training workdir: export the checkpoint of this step "
                         "(default: the latest finished one).")
    flags.DEFINE_string("out", None, "Output directory (written as <out>.tmp-<pid>, renamed when complete).")
    flags.DEFINE_enum("dtype", None, list(IMPORT_DTYPES),
                      "hf-to-orbax: stored dtype (default bfloat16; float8 keeps FP8 codes + scales). "
                      "orbax-to-hf: dtype of the non-FP8 tensors (default: the source checkpoint's).")
    flags.DEFINE_bool("include_mtp", False, "hf-to-orbax: also convert the MTP layer (checkpoint layer 61).")
    flags.DEFINE_enum("init_indexer", "auto", ["auto", "load", "fresh"],
                      "hf-to-orbax: the lightning indexers: 'load' them, initialize them 'fresh' (from "
                      "--indexer_seed), or 'auto' = fresh for a deepseek_v3 checkpoint without indexer tensors "
                      "(DeepSeek-V3.1-Terminus), load otherwise.")
    flags.DEFINE_integer("indexer_seed", 0, "hf-to-orbax: seed of fresh lightning indexers.")
    flags.DEFINE_string("mesh", None, "hf-to-orbax: shard arrays onto a device mesh, e.g. 'fsdp:2,tensor:4'.")
    flags.DEFINE_bool("fp8", False, "orbax-to-hf: write FP8 e4m3 weights with 128x128 weight_scale_inv.")
    flags.DEFINE_float("shard_size_gb", 5.0, "orbax-to-hf: maximum shard size in GB (1e9 bytes).")
    flags.DEFINE_bool("overwrite", False, "Replace an existing output directory.")
    flags.DEFINE_bool("progress", True, "Show a progress bar on stderr.")
    return flags.FLAGS


def _tune_malloc() -> None:
    """Fixed glibc mmap/trim thresholds (1 MiB): with the default dynamic threshold, the freed buffers of one layer
    stay in the heap and the RSS of a long conversion creeps up by several hundred MB."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _under(path: str, out: str) -> bool:
    """Whether `path` is `out`, lies inside it, or is one of its `<out>.tmp-<pid>` / `.old-<pid>` siblings."""
    path, out = os.path.abspath(path), os.path.abspath(out)
    return path == out or path.startswith(out + os.sep) or path.startswith(out + ".tmp-") or \
        path.startswith(out + ".old-")


def main(argv) -> int:
    from absl import app, logging

    _tune_malloc()

    FLAGS = _define_flags()
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every partial save at INFO
    if len(argv) != 2 or argv[1] not in COMMANDS:
        raise app.UsageError(f"expected one command, {' or '.join(COMMANDS)}; got {argv[1:]}\n\n{USAGE}")
    command = argv[1]
    # a flag of the other command would be ignored silently (hf-to-orbax --fp8 wrote bfloat16): refused by name
    other = {"hf-to-orbax": ("ckpt", "step", "fp8", "shard_size_gb"),
             "orbax-to-hf": ("hf_dir", "include_mtp", "mesh", "init_indexer", "indexer_seed")}[command]
    given = [f"--{name}" for name in other if FLAGS[name].present]
    if given:
        hint = " (FP8 import: --dtype=float8)" if command == "hf-to-orbax" and "--fp8" in given else ""
        raise app.UsageError(f"{', '.join(given)}: not a flag of {command}{hint}")
    try:
        if FLAGS.out is None:
            raise app.UsageError("--out is required")
        if command == "hf-to-orbax":
            if FLAGS.hf_dir is None:
                raise app.UsageError("hf-to-orbax needs --hf_dir")
            summary = hf_to_orbax(FLAGS.hf_dir, FLAGS.out, dtype=FLAGS.dtype or "bfloat16",
                                  include_mtp=FLAGS.include_mtp, mesh=FLAGS.mesh, overwrite=FLAGS.overwrite,
                                  progress=FLAGS.progress, init_indexer=FLAGS.init_indexer, seed=FLAGS.indexer_seed)
        else:
            if FLAGS.ckpt is None:
                raise app.UsageError("orbax-to-hf needs --ckpt")
            if FLAGS.dtype == "float8":
                raise app.UsageError("orbax-to-hf: use --fp8 for FP8 output; --dtype is bfloat16 or float32")
            summary = orbax_to_hf(FLAGS.ckpt, FLAGS.out, fp8=FLAGS.fp8, dtype=FLAGS.dtype,
                                  shard_size_gb=FLAGS.shard_size_gb, overwrite=FLAGS.overwrite,
                                  progress=FLAGS.progress, step=FLAGS.step)
    except (CheckpointError, ConfigError, OutputExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OutputPathError as e:  # the output's parent is a file, not writable, the final rename failed, ...
        print(f"error: --out={FLAGS.out}: {e.strerror}", file=sys.stderr)
        return 1
    except OSError as e:  # any other I/O failure (a full disk, an unreadable input): one line, not a traceback
        where = f"--out={FLAGS.out}: " if e.filename and _under(os.fspath(e.filename), FLAGS.out) else ""
        print(f"error: {where}{e}", file=sys.stderr)
        return 1
    print(f"{command}: wrote {summary['out']} from {summary['source']} ({summary['tensors']} tensors, "
          f"{summary['bytes'] / 1e9:.3f} GB in {summary['seconds']:.1f} s, {summary['gb_per_s']:.3f} GB/s)")
    return 0


def cli(argv=None) -> None:
    """Console script `dsv32-convert` (same as `python -m dsv32_jax.checkpoint.convert`)."""
    from absl import app

    _define_flags()
    sys.modules["__main__"].__doc__ = USAGE  # what absl's --help prints (the console-script wrapper has none)
    app.run(main, argv=argv)


if __name__ == "__main__":
    cli()
