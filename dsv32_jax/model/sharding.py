"""Device mesh and the one rule table that maps logical axis names to mesh axes.

Parameters carry logical names in their `axes` metadata (optimizer state inherits them); activations name
theirs through `constrain`. Mesh axes: data (pure data parallel), fsdp (parameters sharded, batch split),
tensor (heads / hidden units), expert (routed experts split; batch split too), seq (sequence / context
parallelism: activations split along the tokens; MLA all-gathers the keys, `dsv32_jax.model.mla.seq_parallel`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor", "expert", "seq")
SEQ_AXIS = "seq"  # sequence (context) parallelism: tokens split over it, keys all-gathered in attention
TENSOR_AXIS = "tensor"  # attention / indexer heads, hidden units
BATCH_AXES = ("data", "fsdp", "expert")

# logical name -> mesh axis (or tuple of mesh axes, or None = replicated)
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "seq": SEQ_AXIS,
    "vocab": "tensor",
    "embed": "fsdp",
    # FSDP on the LoRA ranks, tensor parallelism on heads: never two mesh axes on one dimension (XLA's SPMD
    # partitioner produced wrong gradients for kv_b_proj with heads -> ("tensor", "fsdp"), see tests/test_train.py)
    "q_lora": "fsdp",
    "kv_lora": "fsdp",
    "heads": "tensor",
    "index_heads": "tensor",
    "mlp": "tensor",
    "moe_mlp": "tensor",
    # Routed experts (~97% of a DeepSeek-V3 model's parameters) are also split over the sequence-parallel axis:
    # seq devices hold different tokens of the same sequences, so they would otherwise keep identical copies of
    # every expert weight, gradient and AdamW moment (ZeRO-3 over seq; the MoE all-gathers them per layer, see
    # dsv32_jax.model.moe._expert_parallel). Both axes in one dimension: "expert" outer, "seq" inner.
    "expert": ("expert", SEQ_AXIS),
    "norm": None,
}

_CONTEXT: dict = {"mesh": None, "rules": DEFAULT_RULES}
# The mesh and rules are read while tracing, so they are part of every jit's cache key (`jax.make_user_context`):
# without it, a function jitted and traced outside `use_mesh` and called again inside it (or under
# other rules) with inputs of the same shardings ran the cached unsharded program (the kernels outside any
# shard_map), and one traced inside kept its mesh outside.
_TRACE_KEY = jax.make_user_context(None)


def parse_mesh_spec(spec: str | Mapping[str, int], flag: str = "--mesh") -> dict[str, int]:
    """'fsdp:2,tensor:2,expert:2' (or a dict) -> sizes for every mesh axis; one axis may be -1 (the rest).
    Errors name `flag`, where the spec came from (the CLIs' --mesh, the trainer's config.mesh)."""
    if isinstance(spec, str):
        sizes = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, sep, size = (x.strip() for x in part.partition(":"))
            if not sep or name not in MESH_AXES or not size.lstrip("-").isdigit() or int(size) == 0 or int(size) < -1:
                raise ValueError(f"{flag}: bad entry {part!r}; expected name:size with name in {MESH_AXES}, "
                                 "e.g. 'fsdp:2,tensor:4'")
            if name in sizes:
                raise ValueError(f"{flag}: axis {name!r} given twice in {spec!r}")
            sizes[name] = int(size)
    else:
        sizes = dict(spec)
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"{flag}: mesh axes {sorted(unknown)} unknown; expected a subset of {MESH_AXES}")
    return {a: int(sizes.get(a, 1)) for a in MESH_AXES}


def make_mesh(spec: str | Mapping[str, int] = "", devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    sizes = parse_mesh_spec(spec)
    auto = [a for a, s in sizes.items() if s == -1]
    if len(auto) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {auto}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if auto:
        sizes[auto[0]] = len(devices) // known
    need = math.prod(sizes.values())
    if need > len(devices) or (auto and need != len(devices)):
        raise ValueError(f"mesh {sizes} needs {need} devices but only {len(devices)} are visible "
                         "(CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    devices = devices[:need]  # an explicit smaller mesh uses the first devices
    return Mesh(np.asarray(devices).reshape([sizes[a] for a in MESH_AXES]), MESH_AXES)


def process_row_block(sharding, shape, process_index: int | None = None) -> tuple[int, int]:
    """(i, n): the devices of process `process_index` (default: this one) own rows [i B/n, (i+1) B/n) of an array
    of `shape` [B, ...] placed with `sharding`, the n blocks tiling [0, B). Processes whose devices own the same rows
    (a tensor or seq axis that spans processes replicates the batch over them) get the same i: each process loads
    block i of n, not its process index of the process count (which gave those processes different halves of a
    batch they must share: a wrong loss, then a hang). Raises ValueError when a process's rows are no such block."""
    b = shape[0]
    me = jax.process_index() if process_index is None else process_index
    spans: dict[int, set] = {}
    for dev, idx in sharding.devices_indices_map(tuple(shape)).items():
        start, stop, _ = (idx[0] if idx else slice(None)).indices(b)
        spans.setdefault(dev.process_index, set()).add((start, stop))
    blocks = {}
    for p, got in spans.items():
        lo = hi = min(a for a, _ in got)
        for a, z in sorted(got):
            if a > hi:
                raise ValueError(f"the devices of process {p} own rows {sorted(got)} of the batch's {b}: not one block")
            hi = max(hi, z)
        blocks[p] = (lo, hi)
    distinct = sorted(set(blocks.values()))
    n = len(distinct)
    if b % n or distinct != [(i * b // n, (i + 1) * b // n) for i in range(n)]:
        raise ValueError(f"the processes' devices own the row blocks {distinct} of the batch's {b} rows: not an even "
                         "tiling")
    return distinct.index(blocks[me]), n


def host_value(tree):
    """`tree` with every array as numpy holding its global value, on every process. An array whose shards live on
    other processes' devices too (the rows of a batch-sharded rollout on several hosts) is all-gathered: `np.asarray`
    of it raises there. Post-training runs its host logic (rewards, environments, verifiers) on every process over
    the whole batch, so every process needs every row."""
    leaves, treedef = jax.tree.flatten(tree)
    spread = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable]
    if spread:
        from jax.experimental import multihost_utils

        got = multihost_utils.process_allgather([leaves[i] for i in spread], tiled=True)
        for i, v in zip(spread, got):
            leaves[i] = v
    return jax.tree.unflatten(treedef, [np.asarray(x) for x in jax.device_get(leaves)])  # (one batched transfer)


def process_rows(n: int, process_index: int | None = None) -> range:
    """The rows of `n` host-side work items (episodes, demonstrations) that process `process_index` (default: this
    one) runs: a contiguous block, the blocks of the processes tiling range(n) in process order (some empty when
    n < process count)."""
    p, count = jax.process_index() if process_index is None else process_index, jax.process_count()
    return range(n * p // count, n * (p + 1) // count)


def gather_objects(what: str, obj) -> list:
    """Every process's `obj` (any picklable Python value), in process order, on every process; [obj] on one process
    (nothing pickled). Two small all-gathers (the sizes, then the bytes padded to a power of two: few compiled
    gathers). Every process must call it at the same point. A value that does not pickle on one process raises a
    ValueError naming `what` and the process on every process, instead of leaving the others waiting."""
    if jax.process_count() == 1:
        return [obj]
    import pickle

    from jax.experimental import multihost_utils

    try:
        data, failed = pickle.dumps((True, obj), protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as e:  # noqa: BLE001 (every process raises it below)
        failed = f"{type(e).__name__}: {e}"
        data = pickle.dumps((False, failed))
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([len(data)], np.int32))).reshape(-1)
    width = 1 << max(10, int(sizes.max() - 1).bit_length())
    buf = np.zeros(width, np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), width)
    out = []
    for p in range(len(sizes)):
        try:
            out.append(pickle.loads(every[p, :sizes[p]].tobytes()))
        except Exception as e:  # noqa: BLE001 (a value that pickles but does not unpickle: the same on every process)
            out.append((False, f"{type(e).__name__} when unpickling: {e}"))
    bad = next((p for p, (ok, _) in enumerate(out) if not ok), None)
    if bad is not None:
        raise ValueError(f"{what}: process {bad} could not send its value to the other processes (pickle): "
                         f"{out[bad][1]}")
    return [v for _, v in out]


def process_map(what: str, fn, items) -> list:
    """[fn(x) for x in items] on every process, each process computing only its block of `items` (process_rows)
    and receiving the others' results (gather_objects): host work such as oracle episodes, whose environments are
    then called once per item, not once per process. When fn raises on some process every process raises: the
    first failing process re-raises its exception, the others a RuntimeError naming `what`, that process and the
    exception."""
    items = list(items)
    if jax.process_count() == 1:
        return [fn(x) for x in items]
    own, error = [], None
    try:
        own = [fn(items[i]) for i in process_rows(len(items))]
    except Exception as e:  # noqa: BLE001 (sent to the other processes, re-raised below)
        error = e
    every = gather_objects(what, (own, None if error is None else f"{type(error).__name__}: {error}"))
    bad = next((p for p, (_, e) in enumerate(every) if e is not None), None)
    if bad is not None:
        if bad == jax.process_index():
            raise error
        raise RuntimeError(f"{what}: process {bad} failed: {every[bad][1]}")
    return [x for got, _ in every for x in got]


def check_same_on_processes(what: str, *values) -> None:
    """Raises a ValueError naming `what` and the processes when the host values `values` (numpy arrays, lists,
    strings, numbers) differ between processes; nothing on one process. Each process runs the post-training host
    logic that is not split over the processes itself (the agent stage's reward terms, a caller's own driver of
    MultiTurnSampler), and its jitted steps take these values as replicated inputs: values that differ (an unseeded
    random draw, a clock, the order of a set of strings, which differs between Python processes) would give each
    host's devices another batch, silently. One small all-gather of a digest."""
    if jax.process_count() == 1:
        return
    import hashlib

    from jax.experimental import multihost_utils

    h = hashlib.blake2b(digest_size=8)
    for v in values:  # (an array's bytes: its repr elides the middle of a large one)
        h.update(v.dtype.str.encode() + np.ascontiguousarray(v).tobytes() if isinstance(v, np.ndarray)
                 else repr(v).encode())
        h.update(b"\x00")
    mine = np.frombuffer(h.digest(), np.int64)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count())
    odd = [p for p in range(len(every)) if every[p] != every[0]]
    if odd:
        raise ValueError(f"{what}: process {odd[0]} computed other values than process 0. Every process computes "
                         "them over the whole batch: they must be deterministic functions of their inputs (a seeded "
                         "random generator; no clock, no set-of-strings order, which differs between Python "
                         "processes)")


def logical_to_spec(names: Iterable[str | None] | None, rules: Mapping = DEFAULT_RULES,
                    mesh_shape: Mapping[str, int] | None = None) -> P:
    """Logical axis names -> PartitionSpec; a mesh axis is used at most once, size-1 mesh axes are dropped."""
    if names is None:
        return P()
    used, out = set(), []
    for name in names:
        target = rules.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used and (mesh_shape is None or mesh_shape[a] > 1))
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*out)


def dividing_run(axes: Iterable[str], n: int, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The longest leading run of `axes` (those of size 1 left out) whose product divides `n`: the mesh axes that
    split a dimension of n (() when the first one does not divide it). The rest hold identical copies."""
    run = tuple(a for a in axes if mesh_shape.get(a, 1) > 1)
    while run and n % math.prod(mesh_shape[a] for a in run):
        run = run[:-1]
    return run


def array_spec(axes, shape, mesh_shape: Mapping[str, int], rules: Mapping = DEFAULT_RULES) -> P:
    """PartitionSpec of an array with logical `axes`: each name maps through `rules` to mesh axes; a mesh axis is
    used at most once per array, size-1 mesh axes are dropped, and a dimension is split over the longest leading
    run of its mesh axes whose product divides it (none: replicated), leaving the rest free for later dimensions."""
    axes = tuple(axes or ())
    axes = axes + (None,) * (len(shape) - len(axes))
    used, out = set(), []
    for name, dim in zip(axes, shape):
        target = rules.get(name) if name is not None else None
        cand = (target,) if isinstance(target, str) else tuple(target or ())
        cand = dividing_run((a for a in cand if a not in used), dim, mesh_shape)
        used.update(cand)
        out.append((cand[0] if len(cand) == 1 else cand) if cand else None)
    return P(*out)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def variable_spec(var, mesh_shape: Mapping[str, int], rules: Mapping = DEFAULT_RULES) -> P:
    """PartitionSpec of one nnx variable from its `axes` metadata (replicated without, or on a rank mismatch)."""
    axes = var.get_metadata().get("axes") if _is_var(var) else None
    shape = getattr(var.get_value() if _is_var(var) else var, "shape", ())
    if axes is None or len(axes) != len(shape):
        return P()
    return array_spec(axes, shape, mesh_shape, rules)


def state_specs(state: nnx.State, mesh_shape: Mapping[str, int], rules: Mapping = DEFAULT_RULES):
    """PartitionSpecs for every variable of an nnx state; needs only the mesh's axis sizes (no devices)."""
    return jax.tree.map(lambda v: variable_spec(v, mesh_shape, rules), state, is_leaf=_is_var)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Mapping = DEFAULT_RULES):
    """NamedSharding for every variable of an nnx state, as a state-shaped tree (for jit in/out_shardings)."""
    return jax.tree.map(lambda v: v.replace(NamedSharding(mesh, variable_spec(v, mesh.shape, rules))) if _is_var(v)
                        else NamedSharding(mesh, P()), state, is_leaf=_is_var)


def _placeholder(x) -> bool:
    """optax.MaskedNode (no array: a parameter that another optimizer group owns) without importing optax."""
    return type(x).__name__ == "MaskedNode"


def abstract_sharded(state, shardings):
    """ShapeDtypeStructs of `state` placed with `shardings` (matching trees: nnx states or pure dicts);
    optimizer-state placeholders without arrays (optax.MaskedNode) stay as they are."""
    return jax.tree.map(lambda x, s: x if _placeholder(x) else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state, shardings, is_leaf=_placeholder)


def per_device_bytes(state: nnx.State, mesh_shape: Mapping[str, int], rules: Mapping = DEFAULT_RULES) -> int:
    """Bytes each device holds for `state` (abstract or concrete) under the rule table."""
    total = 0
    for var in jax.tree.leaves(state, is_leaf=_is_var):
        value = var.get_value() if _is_var(var) else var
        if _placeholder(value):
            continue
        spec = variable_spec(var, mesh_shape, rules)
        shards = math.prod(math.prod(mesh_shape[a] for a in ((e,) if isinstance(e, str) else e))
                           for e in spec if e is not None)
        total += int(np.prod(value.shape)) * np.dtype(value.dtype).itemsize // shards
    return total


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None, rules: Mapping = DEFAULT_RULES):
    """Activates `constrain` (and the model's shard_maps) for code traced inside (a no-op outside any mesh); a jitted
    function called inside is traced for this mesh and these rules, not taken from its cache of another."""
    old = dict(_CONTEXT)
    _CONTEXT.update(mesh=mesh, rules=rules)
    key = None if mesh is None else (mesh, tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                                        for k, v in rules.items())))
    try:
        with _TRACE_KEY(key):
            yield mesh
    finally:
        _CONTEXT.update(old)


def current_mesh() -> Mesh | None:
    return _CONTEXT["mesh"]


def current_rules() -> Mapping:
    return _CONTEXT["rules"]


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """with_sharding_constraint by logical names under the active mesh."""
    mesh = _CONTEXT["mesh"]
    if mesh is None or mesh.size == 1:
        return x
    spec = array_spec(names, x.shape, mesh.shape, _CONTEXT["rules"])
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
