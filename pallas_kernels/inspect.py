"""Where the kernels are in a traced or compiled program: what the sharded-step checks and benches count.

  pallas_calls(jaxpr)     every Pallas kernel (`pallas_call`, or `mpmd_map`: a Mosaic GPU `plgpu.kernel`) of a
                          (closed) jaxpr, nested ones included, with the mesh axes that are manual around it (the
                          enclosing shard_maps' axes, accumulated)
  unsharded_kernels(...)  the pallas_calls that GSPMD would have to partition: not inside a shard_map whose
                          manual axes cover every mesh axis of size > 1 (Mosaic refuses them, a Triton call would
                          be replicated)
  compiled_kernels(text)  Pallas kernels in a compiled HLO module's text (custom calls whose metadata names a
                          pallas_call or an mpmd_map), by backend: "tpu" (Mosaic TPU `tpu_custom_call`), "triton"
                          (`__gpu$xla.gpu.triton`), "mosaic_gpu" (Mosaic GPU custom calls). Interpret-mode kernels
                          lower to plain HLO and count as none.
"""

from __future__ import annotations

import collections
import re

import jax

_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


# The primitives a Pallas kernel is in a jaxpr: `pallas_call` (Triton, Mosaic TPU, and Mosaic GPU via pallas_call) and
# `mpmd_map` (what `plgpu.kernel`, the Mosaic GPU kernels' entry point, binds in jax 0.12).
KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for v in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def _kernel_name(eqn) -> str:
    name = eqn.params.get("name_and_src_info") or eqn.params.get("name")
    if name is None:
        debug = getattr(eqn.params.get("jaxpr"), "debug_info", None)
        name = getattr(debug, "func_name", None)
    return str(getattr(name, "name", name) or "pallas_call")


def _manual_axes(eqn) -> frozenset:
    for key in ("newly_manual_axes", "manual_axes", "axis_names"):
        if key in eqn.params:
            return frozenset(eqn.params[key])
    mesh = eqn.params.get("mesh")
    auto = eqn.params.get("auto", frozenset())
    return frozenset(a for a in getattr(mesh, "axis_names", ()) if a not in auto)


def pallas_calls(jaxpr, manual: frozenset = frozenset()) -> list[tuple[str, frozenset]]:
    """[(kernel name, manual mesh axes around it)] for every pallas_call in `jaxpr` (a Jaxpr or ClosedJaxpr, e.g.
    from jax.make_jaxpr), in program order; a kernel inside a scan / cond / remat body counts once."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in KERNEL_PRIMITIVES:
            found.append((_kernel_name(eqn), manual))
            continue
        inner = manual | _manual_axes(eqn) if name == "shard_map" else manual
        for sub in _subjaxprs(eqn):
            found.extend(pallas_calls(sub, inner))
    return found


def unsharded_kernels(jaxpr, mesh) -> list[str]:
    """Names of the pallas_calls of `jaxpr` that are not inside a shard_map manual over every axis of `mesh` with
    size > 1 (empty: every kernel sees only its device's block)."""
    need = frozenset(a for a, n in mesh.shape.items() if n > 1)
    return [name for name, manual in pallas_calls(jaxpr) if not need <= manual]


def compiled_kernels(hlo_text: str) -> collections.Counter:
    """Counter of Pallas kernels in a compiled module's text (`compiled.as_text()`) by backend: custom calls whose
    metadata names a `pallas_call` (XLA emits Mosaic TPU custom calls of its own, e.g. for `lax.ragged_dot`, which
    do not count), "tpu" (`tpu_custom_call`), "triton" (`__gpu$xla.gpu.triton`), "mosaic_gpu" (`mosaic_gpu_v2`,
    whose metadata names `mpmd_map` when `plgpu.kernel` built it: before 2026-11-28 those were not counted)."""
    counts = collections.Counter()
    for line in hlo_text.splitlines():
        target = _TARGET.search(line)
        op_name = (_OP_NAME.search(line) or [""])[0]
        if target is None or not any(p in op_name for p in KERNEL_PRIMITIVES):
            continue
        target = target.group(1)
        if target == "tpu_custom_call":
            counts["tpu"] += 1
        elif "triton" in target:
            counts["triton"] += 1
        elif "mosaic_gpu" in target:
            counts["mosaic_gpu"] += 1
    return counts
