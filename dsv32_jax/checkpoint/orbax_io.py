"""The dsv32-jax orbax checkpoint: layout, layer-by-layer writing, loading (whole or one layer at a time),
and sharding parameters onto a device mesh by their logical axis names.

Layout of a checkpoint directory `D` (what `python -m dsv32_jax.checkpoint.convert hf-to-orbax` writes):

    D/config.json        ModelConfig.to_hf() (HF field names; quantization_config only for float8 checkpoints)
    D/params/            an orbax (v1 API) PyTree checkpoint of the model's pure state dict, i.e. the structure of
                         `nnx.to_pure_dict(nnx.state(model))` (Params AND the ExpertBias variables), with the
                         integer keys of `layers` / `mtp` written as strings ("0", "1", ...). The PyTree
                         checkpointable lives in D/params/state (orbax's partial-save layout).
    D/dsv32_meta.json    format name + version, dtype, include_mtp, fp8, the groups, and the HF dtype of each
                         source tensor (so that an export reproduces the original dtypes). Written LAST: a
                         directory without it is not a complete checkpoint.

Load it with `dsv32_jax.from_pretrained(D)` (or `load_orbax_model`), or with orbax directly:
`ocp.v1.load(D / "params")` returns the nested dict.

float8 checkpoints (`--dtype=float8`): every tensor the official checkpoint stores as F8_E4M3 (TensorSpec.quantized)
is kept as its e4m3 codes (float8_e4m3fn, in the model's kernel layout [in, out], experts stacked [E, in, out]) plus
a float32 sibling leaf `<name>_scale_inv` holding the 128x128 block multipliers in the same orientation
([ceil(in/128), ceil(out/128)], [E, ...] for experts). Everything else is stored losslessly (bfloat16, or float32
where the source or the model uses float32). The model has no FP8 matmul path yet, so loading such a checkpoint
dequantizes (codes * block scale, in float32, then cast to the requested parameter dtype).

bfloat16 / float32 checkpoints store every leaf in the model's parameter dtype for that dtype (the router, the
correction bias and the indexer's weights_proj are float32 in the model anyway), except that vectors (norm
weights, k_norm, biases) whose source tensor is F32 stay float32 in a bfloat16 checkpoint, so that an HF -> orbax
-> HF round trip reproduces every BF16 and F32 tensor bit for bit.

Why partial saves: orbax-checkpoint 0.12.8 cannot append to a PyTree checkpoint with its standard (v0) API, but its
v1 API has `ocp.v1.partial.save` (each call writes a disjoint subtree into a pending directory; nothing is
rewritten) and `ocp.v1.partial.finalize` (merges the pending directories by renames, no data copy). We call
`partial.save` once per group -- the globals (embedding, final norm, LM head), then every decoder layer, then every
MTP layer -- so the host holds one layer at a time, and the result is ONE ordinary PyTree checkpoint that restores
as a whole (`ocp.v1.load`) or piecewise (`partial_load`). Arrays are written uncompressed (zstd costs ~3x the
time on weights that barely compress) and without orbax's defensive host copy (we never mutate a saved array).
The alternatives were worse: one sub-checkpoint per layer cannot be restored with a single orbax call, and raw
tensorstore/zarr arrays would bypass orbax's metadata.

Training workdirs (`python -m dsv32_jax.train.main --workdir=W`) use a different layout, which this module reads but does not
write: `W/checkpoints/` is an orbax CheckpointManager whose step directories `W/checkpoints/<step>/` hold the items
`params` (the same pure state dict as above, as saved by the trainer's mesh), `opt`, `data` and `meta` (JSON with
`model_config`, the HF config dict). `training_checkpoint(W, step)` picks a finished step and reads the config from
`meta`; `ParamsReader(step_dir, item="params")` then loads parameters one by one exactly as for a converted
checkpoint. `open_params(path, step)` resolves either kind of directory to (config, reader); `python -m
dsv32_jax.checkpoint.convert orbax-to-hf --ckpt=W` and `from_pretrained(W)` go through it.

Sharding: `dsv32_jax.model.sharding.make_mesh("fsdp:2,tensor:4")` builds the mesh; `logical_sharding` maps a parameter's
logical `axes` metadata to mesh axes through the shared rule table (every function takes `rules=`). A mesh axis is used at most once
per array and only where it divides the dimension; anything else is replicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
from typing import Any, Iterator, Mapping

import jax
import numpy as np
from flax import nnx

from dsv32_jax.model.config import ConfigError, ModelConfig
from dsv32_jax.model import sharding as shd
from dsv32_jax.model.fp8 import SCALE_SUFFIX
from dsv32_jax.checkpoint.io_utils import ORBAX_META_FILE
from dsv32_jax.checkpoint.fp8_weights import fp8_blocks
from dsv32_jax.checkpoint.fp8_weights import FP8 as FP8_DTYPE
from dsv32_jax.checkpoint.safetensors_io import CheckpointError

FORMAT_NAME = "dsv32-jax-orbax"
FORMAT_VERSION = 1
META_FILE = ORBAX_META_FILE
CONFIG_FILE = "config.json"
PARAMS_DIR = "params"

# --------------------------------------------------------------------------------------------- tree helpers
def group_of(path: tuple) -> str:
    """Write/read unit of a parameter path: 'globals', 'layers.<i>' or 'mtp.<j>'."""
    if path and path[0] in ("layers", "mtp"):
        return f"{path[0]}.{path[1]}"
    return "globals"


def group_sort_key(group: str):
    kind, _, idx = group.partition(".")
    return ({"globals": 0, "layers": 1, "mtp": 2}[kind], int(idx or 0))


def str_path(path: tuple) -> tuple[str, ...]:
    return tuple(str(k) for k in path)


def scale_path(path: tuple) -> tuple[str, ...]:
    """Path of the float32 block-scale sibling of an FP8 leaf: (..., 'kernel') -> (..., 'kernel_scale_inv')."""
    p = str_path(path)
    return p[:-1] + (p[-1] + SCALE_SUFFIX,)


def set_leaf(tree: dict, path: tuple, value) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(str(key), {})
    node[str(path[-1])] = value


def get_leaf(tree: Mapping, path: tuple):
    node = tree
    for key in path:
        node = node[str(key)]
    return node


def flatten(tree: Mapping, prefix: tuple = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from flatten(value, prefix + (str(key),))
        else:
            yield prefix + (str(key),), value


# ------------------------------------------------------------------------------------------------- meta
def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, META_FILE)) and os.path.isdir(os.path.join(path, PARAMS_DIR))


def read_meta(path: str | os.PathLike) -> dict:
    path = os.fspath(path)
    meta_path = os.path.join(path, META_FILE)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a dsv32-jax orbax checkpoint ({META_FILE} is missing; an interrupted "
                              "conversion leaves no such file)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path}: corrupt ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path}: corrupt (a JSON {type(meta).__name__}, not an object)")
    if meta.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{meta_path}: field 'format' is {meta.get('format')!r}, expected {FORMAT_NAME!r}")
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format version {meta.get('version')!r} is not supported "
                              f"(this code reads version {FORMAT_VERSION})")
    dtypes = meta.get("hf_dtypes", {})
    if not isinstance(dtypes, dict) or not all(isinstance(v, str) for v in dtypes.values()):
        raise CheckpointError(f"{meta_path}: field 'hf_dtypes' is {str(dtypes)[:80]}, expected an object of HF tensor "
                              "name -> safetensors dtype")
    if not os.path.isdir(os.path.join(path, PARAMS_DIR)):
        raise CheckpointError(f"{path}: {PARAMS_DIR}/ is missing")
    return meta


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


# ----------------------------------------------------------------------------------------- training workdirs
WORKDIR_CHECKPOINTS = "checkpoints"
TRAIN_PARAMS_ITEM = "params"
TRAIN_META_ITEM = "meta"


def is_training_workdir(path: str | os.PathLike) -> bool:
    """A training workdir (`python -m dsv32_jax.train.main --workdir=W`): W/checkpoints/ is its orbax CheckpointManager."""
    path = os.fspath(path)
    return os.path.isdir(os.path.join(path, WORKDIR_CHECKPOINTS)) and not os.path.isfile(os.path.join(path, META_FILE))


@dataclasses.dataclass(frozen=True)
class TrainingCheckpoint:
    workdir: str
    directory: str  # W/checkpoints (the CheckpointManager root)
    step: int
    step_dir: str  # W/checkpoints/<step>: items params, opt, data, meta (GRPO: also ref)
    cfg: ModelConfig  # the meta item's 'model_config'
    meta: dict


def training_checkpoint(workdir: str | os.PathLike, step: int | None = None) -> TrainingCheckpoint:
    """One finished checkpoint of a training workdir (train/trainer.py, train/grpo.py): the latest step, or `step`.
    Reads only the CheckpointManager's step list and the small `meta` item, whose field 'model_config' (the HF
    config dict, `ModelConfig.to_hf()`) gives the architecture. Errors name the directory, the step or the field."""
    import orbax.checkpoint as ocp

    workdir = os.fspath(workdir)
    root = os.path.abspath(os.path.join(workdir, WORKDIR_CHECKPOINTS))
    if not os.path.isdir(root):
        raise CheckpointError(f"{workdir}: not a training workdir ({WORKDIR_CHECKPOINTS}/ is missing)")
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(create=False)) as mngr:
        steps = sorted(mngr.all_steps())
        if not steps:
            raise CheckpointError(f"{root}: training workdir {workdir} has no finished checkpoint (no step directory "
                                  "with a completed save; was training stopped before its first save?)")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise CheckpointError(f"{root}: no finished checkpoint for step {step} (available steps: "
                                  f"{', '.join(map(str, steps))})")
        step_dir = os.fspath(ocp.step.standard_name_format().find_step(mngr.directory, step).path)
        for item in (TRAIN_PARAMS_ITEM, TRAIN_META_ITEM):
            if not os.path.isdir(os.path.join(step_dir, item)):
                raise CheckpointError(f"{step_dir}: checkpoint of step {step} has no '{item}' item "
                                      f"({os.path.join(step_dir, item)} is missing); not written by the trainer?")
        where = os.path.join(step_dir, TRAIN_META_ITEM)
        try:
            meta = mngr.restore(step, args=ocp.args.Composite(
                **{TRAIN_META_ITEM: ocp.args.JsonRestore()}))[TRAIN_META_ITEM]
        except Exception as e:  # orbax raises a variety of types for unreadable items
            raise CheckpointError(f"{where}: cannot read the meta item ({type(e).__name__}: {e})") from None
    raw = meta.get("model_config") if isinstance(meta, dict) else None
    if raw is None:
        raise CheckpointError(f"{where}: field 'model_config' is missing (the trainer records the model's HF config "
                              "there; without it the architecture of this checkpoint is unknown)")
    try:
        cfg = ModelConfig.from_hf(raw)
    except ConfigError as e:
        raise ConfigError(f"{where}: field 'model_config': {e}") from None
    return TrainingCheckpoint(workdir, root, int(step), step_dir, cfg, meta)


@dataclasses.dataclass(frozen=True)
class StoredParams:
    """Where a checkpoint's parameters come from: a converted checkpoint or one step of a training workdir."""
    cfg: ModelConfig
    reader: "ParamsReader"
    has_mtp: bool  # the stored parameters include the MTP layer(s)
    guard: str  # the directory an output must not be, contain or lie inside
    label: str  # for messages
    meta: dict  # dsv32_meta.json, or the training checkpoint's meta item
    training: bool


def open_params(path: str | os.PathLike, step: int | None = None) -> StoredParams:
    """Resolves a converted orbax checkpoint (dsv32_meta.json) or a training workdir (checkpoints/; its latest
    finished step, or `step`) to its config and a `ParamsReader`; errors name the path, the step or the field."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: does not exist (expected a dsv32-jax orbax checkpoint or a training workdir)")
    if is_training_workdir(path):
        tc = training_checkpoint(path, step)
        # the trainer builds Transformer(cfg): its parameters include the MTP layer(s) iff the config has them
        return StoredParams(tc.cfg, ParamsReader(tc.step_dir, item=TRAIN_PARAMS_ITEM),
                            tc.cfg.num_nextn_predict_layers > 0, tc.directory,
                            f"training workdir {tc.workdir} step {tc.step}", tc.meta, True)
    if step is not None:
        raise ValueError(f"--step={step} selects a checkpoint of a training workdir, but {path} is not one "
                         f"(no {WORKDIR_CHECKPOINTS}/ directory)")
    if not os.path.isfile(os.path.join(path, META_FILE)):
        raise CheckpointError(f"{path}: not a dsv32-jax orbax checkpoint ({META_FILE} is missing; an interrupted "
                              f"conversion leaves no such file) nor a training workdir ({WORKDIR_CHECKPOINTS}/ is "
                              "missing)")
    meta = read_meta(path)
    cfg = ModelConfig.from_hf(os.path.join(path, CONFIG_FILE))
    has_mtp = bool(meta.get("include_mtp")) and cfg.num_nextn_predict_layers > 0
    return StoredParams(cfg, ParamsReader(path), has_mtp, path, path, meta, False)


# -------------------------------------------------------------------------------------------------- mesh
def logical_sharding(axes, shape, mesh, rules=None) -> jax.sharding.NamedSharding:
    """Sharding of an array with logical `axes` under the shared rule table (`dsv32_jax.model.sharding`)."""
    return jax.sharding.NamedSharding(mesh, shd.array_spec(axes, shape, mesh.shape, rules or shd.DEFAULT_RULES))


def param_axes(state: nnx.State) -> dict[tuple, tuple]:
    """{path: logical axes} of every variable in a model state (missing metadata: replicated)."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
        out[tuple(path)] = tuple(meta.get("axes") or ())
    return out


def shard_state(state: nnx.State, mesh, rules=None) -> nnx.State:
    """Places every array of a (concrete) state on `mesh` according to its `axes` metadata."""
    axes = param_axes(state)
    pure = nnx.to_pure_dict(state)

    def place(path, x):
        key = tuple(p.key if hasattr(p, "key") else p.idx for p in path)
        return jax.device_put(x, logical_sharding(axes.get(key, ()), x.shape, mesh, rules))

    pure = jax.tree_util.tree_map_with_path(place, pure)
    nnx.replace_by_pure_dict(state, pure)
    return state


# ------------------------------------------------------------------------------------------------ writing
# Largest stored chunk (tensorstore's unit of reading): a sharded load reads the chunks that overlap each process's
# slices, so chunks much smaller than a host's share keep every host's reads near its share (1 / hosts of the
# checkpoint) even when the checkpoint was written whole (unsharded, as hf-to-orbax on one host writes it). Stacked
# expert tensors [E, in, out] (97% of a DeepSeek-V3 checkpoint) are chunked one expert at a time (orbax's greedy
# chunking would otherwise split the large in/out dims first and keep all experts in every chunk, so that every
# host of an expert-parallel run read every chunk). A checkpoint written sharded (hf-to-orbax --mesh) has chunks
# no larger than its shards.
WRITE_CHUNK_BYTES = 64 << 20


def _storage_options(keypath, value):
    from orbax.checkpoint import v1 as ocp

    if getattr(value, "ndim", 0) == 3 and value.shape[0] > 1:  # stacked experts (and their block scales)
        return ocp.options.ArrayOptions.Saving.StorageOptions(shard_axes=(0,))
    return None


def _save_context():
    from orbax.checkpoint import v1 as ocp

    ctx = ocp.Context()
    ctx.array.saving.use_compression = False
    ctx.array.saving.storage_options.chunk_byte_size = WRITE_CHUNK_BYTES
    ctx.array.saving.scoped_storage_options_creator = _storage_options
    ctx.memory.deepcopy_host_arrays = False
    return ctx


class ParamsWriter:
    """Writes the params PyTree of a checkpoint directory one group (subtree) at a time."""

    def __init__(self, checkpoint_dir: str):
        self.path = os.path.join(checkpoint_dir, PARAMS_DIR)
        self.groups: list[str] = []

    def write(self, group: str, subtree: dict) -> None:
        from orbax.checkpoint import v1 as ocp

        with _save_context():
            ocp.partial.save(self.path, subtree)
        if group not in self.groups:  # a group may be written in several parts
            self.groups.append(group)

    def finalize(self) -> None:
        from orbax.checkpoint import v1 as ocp

        with _save_context():
            ocp.partial.finalize(self.path)


# ------------------------------------------------------------------------------------------------ reading
class ParamsReader:
    """Stored tree metadata and group-by-group (partial) loading of a checkpoint's params, as numpy arrays.

    checkpoint_dir: a dsv32-jax orbax checkpoint (reads `<dir>/params`); with `item`, a CheckpointManager step
    directory instead (reads the item of that name, e.g. 'params' of a training checkpoint `W/checkpoints/<step>`).
    """

    def __init__(self, checkpoint_dir: str, item: str | None = None):
        from orbax.checkpoint import v1 as ocp

        self.directory = os.fspath(checkpoint_dir)
        self.path = os.path.join(self.directory, item or PARAMS_DIR)  # what error messages name
        # (root, checkpointable name) for orbax: a converted checkpoint's params/ resolves itself ('AUTO')
        # orbax needs absolute paths (a relative one reads back no metadata)
        root = os.path.abspath(self.path if item is None else self.directory)
        self._source = (root, "AUTO") if item is None else (root, item)
        try:
            with quiet_failed_reads():
                tree = ocp.metadata(self._source[0], checkpointable_name=self._source[1]).metadata
                if not isinstance(tree, Mapping):  # (orbax logs the read error as a warning and returns None)
                    raise CheckpointError(f"{self.path}: cannot read the orbax checkpoint metadata (orbax read none: "
                                          "a damaged or truncated file?)")
        except CheckpointError:
            raise
        except Exception as e:  # orbax raises a variety of types for unreadable checkpoints
            raise CheckpointError(f"{self.path}: cannot read the orbax checkpoint metadata ({read_error_text(e)})") from None
        self.tree = tree
        self.leaves: dict[tuple[str, ...], Any] = dict(flatten(tree))

    def shape(self, path) -> tuple:
        return tuple(self.leaves[str_path(path)].shape)

    def dtype(self, path) -> np.dtype:
        return np.dtype(self.leaves[str_path(path)].dtype)

    def __contains__(self, path) -> bool:
        return str_path(path) in self.leaves

    def load(self, paths, shardings: Mapping | None = None) -> dict[tuple[str, ...], Any]:
        """The given leaves (paths) as numpy arrays, reading nothing else. shardings: {path: jax.sharding.Sharding};
        those leaves are restored straight into global jax.Arrays with that sharding (in their stored dtype), each
        process reading only the slices its devices hold (orbax restores per shard)."""
        from orbax.checkpoint import v1 as ocp

        shardings = {str_path(p): s for p, s in (shardings or {}).items()}
        abstract: dict = {}
        for p in paths:
            m = self.leaves[str_path(p)]
            shape, dtype = tuple(m.shape), np.dtype(m.dtype)
            sharding = shardings.get(str_path(p))
            leaf = (_numpy_abstract(shape, dtype) if sharding is None
                    else jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
            set_leaf(abstract, str_path(p), leaf)
        ctx = ocp.Context()
        ctx.pytree.loading.partial_load = True
        try:
            with ctx, quiet_failed_reads():
                tree = ocp.load(self._source[0], abstract, checkpointable_name=self._source[1])
        except Exception as e:
            raise CheckpointError(f"{self.path}: failed to read {[ '/'.join(str_path(p)) for p in paths][:3]}... "
                                  f"({read_error_text(e)})") from None
        return {str_path(p): (get_leaf(tree, str_path(p)) if str_path(p) in shardings
                              else np.asarray(get_leaf(tree, str_path(p)))) for p in paths}


_TS_SPEC = re.compile(r"\s*\[tensorstore_spec(\[\d+\])?='[^']*'\]")


def innermost_cause(e: BaseException) -> BaseException:
    """The end of `e`'s `raise ... from` chain (orbax wraps TensorStore's read error in a bare Exception)."""
    seen = {id(e)}
    while e.__cause__ is not None and id(e.__cause__) not in seen:
        e = e.__cause__
        seen.add(id(e))
    return e


def read_error_text(e: BaseException, limit: int = 400) -> str:
    """A failed orbax / TensorStore read on one line: the innermost cause's type and first line (orbax's wrapper of
    a sharded read names the array index and appends the whole TensorStore spec, ~150 lines, but not the cause)."""
    e = innermost_cause(e)
    lines = str(e).strip().splitlines()
    first = _TS_SPEC.sub("", lines[0]) if lines else ""  # (TensorStore appends its specs, ~1,500 characters each)
    text = f"{type(e).__name__}: {first}"
    return text if len(text) <= limit else text[:limit] + " ..."


def _orphaned_read(record) -> bool:
    """False for asyncio's log record of a read task or gather whose error nobody retrieved (drops it; see below)."""
    return "exception was never retrieved" not in str(record.msg).split("\n", 1)[0]


def _orphaned_unraisable(u) -> bool:
    """An unraisable error of a read orbax left behind: the read coroutine's own error, TensorStore's callback into
    the closed loop, or the import a dying read attempts at interpreter exit."""
    msg, code = str(u.exc_value), getattr(u.object, "cr_code", None)
    return ((code is not None and "orbax" in code.co_filename)
            or (isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in msg)
            or (isinstance(u.exc_value, ImportError) and "sys.meta_path is None" in msg))


@contextlib.contextmanager
def quiet_failed_reads():
    """Around an orbax restore: when one read fails, orbax's event loop closes under the reads still in flight, and
    each of them reports its end as an unraisable error (its own error with the whole TensorStore spec, "Event loop
    is closed" from TensorStore's callbacks, "sys.meta_path is None" as the interpreter exits) or as asyncio's
    "... exception was never retrieved" log record: up to 4,000 lines that bury the read error itself. Those are
    dropped; every other unraisable error reaches the previous hook. After a failure both filters stay installed
    (the orphaned reads end later, at the latest at exit); after a success both are gone."""
    import logging  # noqa: PLC0415

    previous, asyncio_log = sys.unraisablehook, logging.getLogger("asyncio")
    filtered = _orphaned_read in asyncio_log.filters

    def hook(u):
        if not _orphaned_unraisable(u):
            previous(u)

    sys.unraisablehook = hook
    asyncio_log.addFilter(_orphaned_read)  # (a no-op when it is there already)
    yield  # (an exception leaves both in place)
    sys.unraisablehook = previous
    if not filtered:
        asyncio_log.removeFilter(_orphaned_read)


def _numpy_abstract(shape, dtype):
    """Abstract leaf that orbax restores as a host numpy array (whatever sharding the array was saved with): an
    unallocated numpy array, the form orbax's public API documents (its pages are never touched, so no memory)."""
    return np.empty(shape, dtype)


def check_stored_tree(reader: ParamsReader, expected: Mapping[tuple, tuple], allow_extra_prefix=None,
                      ignore=None) -> None:
    """Every expected leaf (path -> shape) is stored with that shape (FP8 leaves with a scale of block shape);
    nothing else is stored except leaves under `allow_extra_prefix` (e.g. an MTP layer that is not loaded) and
    leaves for which `ignore(path)` is true (e.g. indexers that are initialized fresh instead)."""
    where = reader.path
    seen = set()
    for path, shape in expected.items():
        sp = str_path(path)
        if sp not in reader.leaves:
            raise CheckpointError(f"{where}: missing parameter '{'/'.join(sp)}' (expected shape {list(shape)} from "
                                  f"{CONFIG_FILE})")
        got = reader.shape(sp)
        if got != tuple(shape):
            raise CheckpointError(f"{where}: parameter '{'/'.join(sp)}' has shape {list(got)}, expected {list(shape)} "
                                  f"from {CONFIG_FILE}")
        seen.add(sp)
        if reader.dtype(sp) == FP8_DTYPE:
            spp = scale_path(sp)
            if spp not in reader.leaves:
                raise CheckpointError(f"{where}: FP8 parameter '{'/'.join(sp)}' has no block scale '{'/'.join(spp)}'")
            if reader.shape(spp) != fp8_blocks(shape):
                raise CheckpointError(f"{where}: scale '{'/'.join(spp)}' has shape {list(reader.shape(spp))}, expected "
                                      f"{list(fp8_blocks(shape))} for 128x128 blocks of {list(shape)}")
            seen.add(spp)
    extra = sorted(p for p in reader.leaves if p not in seen
                   and not (allow_extra_prefix and any(p[:len(x)] == x for x in allow_extra_prefix))
                   and not (ignore and ignore(p)))
    if extra:
        raise CheckpointError(f"{where}: {len(extra)} unexpected parameters for this config, e.g. '{'/'.join(extra[0])}'; "
                              f"does {CONFIG_FILE} match the checkpoint?")


def flatten_pure(tree: Mapping, prefix: tuple = ()):
    """Like `flatten` but keeps the original (int) keys of an nnx pure dict."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from flatten_pure(value, prefix + (key,))
        else:
            yield prefix + (key,), value
