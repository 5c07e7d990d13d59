"""Loading checkpoints into a ready `Transformer`: `from_pretrained` (HF safetensors, converted orbax checkpoints,
training workdirs) and the orbax layer-by-layer loader.

Layer: the top of the checkpoint stack below the convert CLI (fp8 -> fp8_weights -> safetensors_io -> hf ->
orbax_io -> loading -> convert); imports only downward.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv32_jax.model import sharding as shd
from dsv32_jax.model.config import ModelConfig
from dsv32_jax.checkpoint.fp8_weights import dequant_fp8
from dsv32_jax.checkpoint.hf import checkpoint_has_mtp, is_indexer_spec, load_hf_state, tensor_specs
from dsv32_jax.model.transformer import Transformer
from dsv32_jax.checkpoint.orbax_io import (FP8_DTYPE, check_stored_tree, flatten_pure, group_of, group_sort_key, logical_sharding,
                                open_params, param_axes, scale_path, str_path)
from dsv32_jax.checkpoint import orbax_io
from dsv32_jax.checkpoint.safetensors_io import CheckpointError, HFCheckpoint
from dsv32_jax.checkpoint.validate import check_hf_checkpoint


def resolve_mtp(cfg: ModelConfig, has_mtp: bool, include_mtp: bool | None, missing_error: str):
    """(config to build, whether to load the MTP layer): None loads it iff present; True requires it."""
    if include_mtp and not has_mtp:
        raise CheckpointError(missing_error)
    include_mtp = has_mtp if include_mtp is None else include_mtp
    return (cfg if include_mtp else cfg.replace(num_nextn_predict_layers=0)), include_mtp


def abstract_model(cfg: ModelConfig, dtype, param_dtype, options):
    """(graphdef, abstract state) of Transformer(cfg) without allocating parameters."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                                        param_dtype=param_dtype or dtype, options=options)))


INIT_INDEXER = ("auto", "load", "fresh")


def has_indexer_tensors(ckpt: HFCheckpoint) -> bool:
    return any(".self_attn.indexer." in name for name in ckpt.names())


def resolve_init_indexer(init_indexer: str, ckpt: HFCheckpoint, path: str) -> str:
    """"load" or "fresh" for an HF checkpoint: "auto" is "fresh" for a `deepseek_v3` checkpoint without indexer
    tensors (DeepSeek-V3.1-Terminus), "load" otherwise; decided by the tensors, not the label alone, so stored
    indexer weights are never discarded."""
    if init_indexer not in INIT_INDEXER:
        raise ValueError(f"init_indexer must be one of {INIT_INDEXER}, got {init_indexer!r}")
    if init_indexer != "auto":
        return init_indexer
    stored = has_indexer_tensors(ckpt)
    v3 = hf_model_type(path) == "deepseek_v3"
    if stored and v3:
        logging.warning("%s: config.json says model_type 'deepseek_v3' but the checkpoint holds lightning indexer "
                        "tensors: loading them (init_indexer='fresh' replaces them)", path)
    return "fresh" if v3 and not stored else "load"


def hf_model_type(path: str) -> str:
    import json
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f).get("model_type", "deepseek_v32")


def untrained_indexers(path: str | os.PathLike, step: int | None = None) -> str | None:
    """Why the lightning indexers `from_pretrained(path)` would load have never been trained, or None when they
    have (as far as the checkpoint records): an HF checkpoint without indexer tensors (DeepSeek-V3.1-Terminus: the
    indexers are initialized fresh), an orbax checkpoint whose conversion initialized them fresh (dsv32_meta.json
    "indexers"), or a training workdir whose checkpoint is the dense stage's (no indexer loss). Selecting top-k keys
    with such an indexer picks keys at random; `dsv32-generate --dsa=auto` attends densely instead."""
    path = os.fspath(path)
    if orbax_io.is_training_workdir(path):
        stage = orbax_io.training_checkpoint(path, step).meta.get("stage")
        return f"{path}: a dense-stage training checkpoint (its indexers had no loss)" if stage == "dense" else None
    if orbax_io.is_orbax_checkpoint(path):
        if (orbax_io.read_meta(path).get("indexers") or {}).get("fresh"):
            return f"{path}: converted with fresh lightning indexers ({orbax_io.META_FILE} \"indexers\")"
        return None
    if has_indexer_tensors(HFCheckpoint(path)):
        return None
    return f"{path}: an HF checkpoint without lightning indexer tensors (model_type {hf_model_type(path)!r})"


def from_pretrained(path: str | os.PathLike, dtype=jnp.bfloat16, *, param_dtype=None, options=None,
                    include_mtp: bool | None = None, mesh=None, rules=None, step: int | None = None,
                    init_indexer: str = "auto", seed: int = 0, overrides: dict | None = None):
    """Loads a checkpoint directory into a ready `Transformer`: an HF-layout safetensors checkpoint (config.json +
    shards), a dsv32-jax orbax checkpoint (written by `python -m dsv32_jax.checkpoint.convert hf-to-orbax`; detected by its
    `dsv32_meta.json`, loaded layer by layer, FP8 leaves dequantized), or a training workdir (`python -m
    dsv32_jax.train.main --workdir=W`; detected by `W/checkpoints/`): the parameters of its latest finished checkpoint, or
    of `step`, with the model config recorded in that checkpoint.

    dtype: compute dtype (and parameter dtype unless param_dtype is given); router, correction bias and indexer
    weights_proj stay float32. include_mtp: None loads the MTP layer iff the checkpoint has it. mesh: a
    `jax.sharding.Mesh` or a spec like 'fsdp:2,tensor:4' to shard the parameters by their logical axes
    (`rules`: logical axis -> mesh axes, default `dsv32_jax.model.sharding.DEFAULT_RULES`).
    init_indexer (HF checkpoints): "load" the lightning indexers from the checkpoint (missing ones are an error),
    "fresh" initialize them (`Transformer`'s init from `seed`) and load everything else, "auto" = "fresh" for an HF
    `deepseek_v3` checkpoint (DeepSeek-V3.1-Terminus, where the paper's warm-up starts: no indexer weights, the
    indexer geometry from config.json or V3.2's defaults) and "load" otherwise. Training workdirs and orbax
    checkpoints take "fresh" too (loaded, then the indexers replaced). overrides: ModelConfig fields replacing
    config.json's (orbax checkpoints and workdirs: the recorded config's; fields that change a stored shape are
    refused by name, except the indexers' with init_indexer="fresh"), e.g. the indexer geometry of fresh indexers.
    """
    if init_indexer not in INIT_INDEXER:
        raise ValueError(f"from_pretrained: init_indexer must be one of {INIT_INDEXER}, got {init_indexer!r}")
    path = os.fspath(path)
    if orbax_io.is_orbax_checkpoint(path) or orbax_io.is_training_workdir(path):
        fresh = init_indexer == "fresh"
        model = load_orbax_model(path, dtype, param_dtype=param_dtype, options=options,
                                 include_mtp=include_mtp, mesh=mesh, rules=rules, step=step, overrides=overrides,
                                 skip_indexers=fresh)
        if fresh:
            state = nnx.to_pure_dict(nnx.state(model))
            _copy_indexers(state, _fresh_indexers(model.config, seed, dtype, param_dtype, options, mesh, rules))
            nnx.update(model, _as_state(model, state))
            logging.info("%s: lightning indexers initialized fresh (seed %d), not loaded", path, seed)
        return model
    if step is not None:
        raise ValueError(f"{path}: step={step} applies to training workdirs only (this is an HF checkpoint)")
    config = ModelConfig.from_hf(path)
    if overrides:
        config = config.replace(**dict(overrides))
    ckpt = HFCheckpoint(path)
    has_mtp = checkpoint_has_mtp(ckpt, config)
    load_indexer = resolve_init_indexer(init_indexer, ckpt, path) == "load"
    # the converter's validator (hf-to-orbax runs the same); values are checked finite as they are read
    check_hf_checkpoint(ckpt, config, has_mtp if include_mtp is None else include_mtp, load_indexer)
    cfg, include_mtp = resolve_mtp(config, has_mtp, include_mtp,
                                   f"{path}: include_mtp=True but the checkpoint has no MTP layer "
                                   f"(model.layers.{config.num_hidden_layers}.eh_proj.weight)")
    if load_indexer:
        graphdef, state = abstract_model(cfg, dtype, param_dtype, options)
    else:  # a real initialization: the indexers keep it, everything else is overwritten by the checkpoint
        graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed), dtype=dtype,
                                                param_dtype=param_dtype or dtype, options=options))
        fresh = sorted({".".join(map(str, s.path[:s.path.index("indexer") + 1]))
                        for s in tensor_specs(cfg, include_mtp) if is_indexer_spec(s)})
        logging.info("%s: %d lightning indexers initialized fresh (seed %d), not loaded: %s", path, len(fresh), seed,
                     ", ".join(fresh[:3]) + (", ..." if len(fresh) > 3 else ""))
    state = load_hf_state(ckpt, cfg, state, include_mtp, load_indexer)
    if mesh is not None:
        state = orbax_io.shard_state(state, shd.make_mesh(mesh) if isinstance(mesh, str) else mesh, rules)
    return nnx.merge(graphdef, state)


def _to_target_sharded(x: jax.Array, scale: np.ndarray | None, dtype) -> jax.Array:
    """A restored (sharded, stored-dtype) array in the parameter dtype, shard by shard on the devices that hold it:
    FP8 codes times the 128x128 block scales of each slice (the same float32 products as `dequant_fp8`)."""
    dtype = np.dtype(dtype)
    if scale is None:
        if x.dtype == dtype:
            return x
        return jax.jit(lambda a: a.astype(dtype), out_shardings=x.sharding)(x)
    done: dict = {}
    buffers = []
    for shard in x.addressable_shards:
        key = tuple((s.start, s.stop) for s in shard.index)
        if key not in done:
            done[key] = dequant_fp8_slice(np.asarray(shard.data), scale, shard.index, x.shape, dtype)
        buffers.append(jax.device_put(done[key], shard.device))
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, buffers)


def dequant_fp8_slice(codes: np.ndarray, scale: np.ndarray, index: tuple, shape: tuple, dtype) -> np.ndarray:
    """The slice `index` (of the global FP8 array of `shape`) of codes * block scale: `codes` holds just that
    slice, `scale` the whole array's block scales [..., ceil(r/128), ceil(c/128)]. Bitwise `dequant_fp8(whole)`
    restricted to the slice (one float32 product per element, then the cast)."""
    from dsv32_jax.model.fp8 import WEIGHT_BLOCK as block

    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    bounds = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
    lead = tuple(slice(a, b) for a, b in bounds[:-2])
    s = np.asarray(scale, np.float32)[lead]
    for axis, (a, b) in zip((-2, -1), bounds[-2:]):
        blocks = np.arange(a, b) // block
        s = np.take(s, blocks, axis=axis)
    return (codes.astype(np.float32) * s).astype(dtype)


def _indexer_subtree(tree: dict) -> dict:
    """The parts of a pure parameter dict under 'indexer' keys (same nesting)."""
    out = {}
    for key, value in tree.items():
        if key == "indexer":
            out[key] = value
        elif isinstance(value, dict):
            sub = _indexer_subtree(value)
            if sub:
                out[key] = sub
    return out


def _fresh_indexers(cfg, seed, dtype, param_dtype, options, mesh, rules) -> dict:
    """The lightning indexers of `Transformer(cfg)` initialized from `seed` (a pure-dict subtree). On a mesh they
    are computed by one jitted init that keeps only the indexers (the rest of the model is never materialized)
    and placed with their logical shardings."""
    def build():
        model = Transformer(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype or dtype, options=options)
        return _indexer_subtree(nnx.to_pure_dict(nnx.state(model)))

    if mesh is None:
        return build()
    if isinstance(mesh, str):
        mesh = shd.make_mesh(mesh)
    _, state = abstract_model(cfg, dtype, param_dtype, options)
    axes = param_axes(state)
    shapes = jax.eval_shape(build)
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, x: logical_sharding(axes.get(tuple(p.key for p in path), ()), x.shape, mesh, rules), shapes)
    return jax.jit(build, out_shardings=shardings)()


def _copy_indexers(dst: dict, src: dict) -> None:
    """dst[...]['indexer'] = src[...]['indexer'] everywhere in two pure parameter dicts."""
    for key, value in src.items():
        if key == "indexer":
            dst[key] = value
        elif isinstance(value, dict):
            _copy_indexers(dst[key], value)


def _as_state(model, pure: dict):
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, pure)
    return state


def _is_indexer_path(path: tuple) -> bool:
    return "indexer" in path


def load_orbax_model(path: str | os.PathLike, dtype=jnp.bfloat16, *, param_dtype=None, options=None,
                     include_mtp: bool | None = None, mesh=None, rules=None, step: int | None = None,
                     overrides: dict | None = None, skip_indexers: bool = False):
    """Loads a dsv32-jax orbax checkpoint directory, or a training workdir (its latest finished checkpoint, or
    `step`; parameters only), into a ready `Transformer`, one layer at a time.

    dtype / param_dtype / options / include_mtp as in `from_pretrained`; FP8 leaves are dequantized. mesh: a
    `jax.sharding.Mesh` (or a spec string like 'fsdp:2,tensor:4') to shard every parameter by its logical axes:
    then every array is restored straight into its sharding (orbax restore targets with the shardings), so each
    process reads from storage only the chunks overlapping the slices its own devices hold, FP8 codes are
    dequantized slice by slice, and no host ever holds a whole parameter (multi-host: every process calls this).
    overrides: ModelConfig fields replacing the recorded config's (a changed stored shape is refused by name).
    skip_indexers: the lightning indexers are neither checked nor read (left abstract: the caller fills them in).
    """
    source = open_params(path, step)
    reader = source.reader
    cfg = source.cfg.replace(**dict(overrides)) if overrides else source.cfg
    cfg, include_mtp = resolve_mtp(cfg, source.has_mtp, include_mtp,
                                   f"{source.label}: include_mtp=True but the checkpoint has no MTP layer")
    if isinstance(mesh, str):
        mesh = shd.make_mesh(mesh)
    graphdef, state = abstract_model(cfg, dtype, param_dtype, options)
    axes = param_axes(state)
    targets = {tuple(p): v for p, v in flatten_pure(nnx.to_pure_dict(state))
               if not (skip_indexers and _is_indexer_path(tuple(p)))}
    check_stored_tree(reader, {p: tuple(v.shape) for p, v in targets.items()},
                      allow_extra_prefix=None if include_mtp else [("mtp",)],
                      ignore=_is_indexer_path if skip_indexers else None)
    pure = nnx.to_pure_dict(state)
    groups: dict[str, list] = {}
    for p in targets:
        groups.setdefault(group_of(p), []).append(p)
    for group in sorted(groups, key=group_sort_key):
        paths = groups[group]
        wanted = []
        for p in paths:
            wanted.append(p)
            if reader.dtype(p) == FP8_DTYPE:
                wanted.append(scale_path(p))
        shardings = None
        if mesh is not None:  # each process reads only the slices of its devices (FP8 scales: whole, 1/16384 of it)
            shardings = {p: logical_sharding(axes.get(p, ()), reader.shape(p), mesh, rules) for p in paths}
        stored = reader.load(wanted, shardings)
        for p in paths:
            x = stored.pop(str_path(p))
            target = targets[p]
            if mesh is not None:
                scale = stored.pop(scale_path(p)) if reader.dtype(p) == FP8_DTYPE else None
                value = _to_target_sharded(x, scale, target.dtype)
            else:
                if x.dtype == FP8_DTYPE:
                    x = dequant_fp8(x, stored.pop(scale_path(p)), target.dtype)
                value = jnp.asarray(np.asarray(x).astype(target.dtype, copy=False))
            node = pure
            for key in p[:-1]:
                node = node[key]
            node[p[-1]] = value
            del x
        del stored
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)
