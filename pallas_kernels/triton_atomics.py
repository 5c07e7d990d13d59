"""A relaxed-order fp32 atomic add for Pallas Triton kernels that only accumulate.

`jax.experimental.pallas.triton.atomic_add` lowers with acquire-release order at GPU scope. On sm_90a ptxas
brackets every such atomic with `MEMBAR.ALL.GPU` (waiting for all of the thread's outstanding memory operations,
the prefetching cp.async included) and `CCTL.IVALL` (invalidating L1): four of each per 64 x 64 tile in the sparse
MLA backward's dkv accumulation, which needs no ordering at all (the sum is read after the kernel). `atomic_add`
here is the same primitive's rules (abstract eval, interpret-mode discharge, lowering) with relaxed order, which
lowers to a plain `ATOMG.E.ADD.F32x4` / `REDG`. It leans on the private Pallas Triton lowering
(`jax._src.pallas.triton`) of jax 0.11.2 (the lent GPUs') and 0.12: `tools/gpu_compile` checks the PTX for the
relaxed atomic on every CI run.
"""

from __future__ import annotations

import functools

from jax._src import core as jax_core
from jax._src import tree_util
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as _lowering
from jax._src.pallas.triton import primitives as _prims
from jax._src.state import discharge as _discharge
from jax._src.state import primitives as _state_prims

_ADD = _prims.AtomicOpType.ADD
relaxed_atomic_add_p = jax_core.Primitive("atomic_add_relaxed")


@relaxed_atomic_add_p.def_effectful_abstract_eval
def _abstract_eval(*avals_flat, args_tree):
    return _prims._atomic_abstract_eval(*avals_flat, args_tree=args_tree, atomic_type=_ADD)


@_discharge.register_discharge_rule(relaxed_atomic_add_p)
def _discharge_rule(ctx, *args_flat, args_tree):
    return _prims._atomic_rmw_discharge_rule(ctx, *args_flat, args_tree=args_tree, atomic_type=_ADD)


@_lowering.register_lowering(relaxed_atomic_add_p)
def _lowering_rule(ctx, *args_flat, args_tree):
    """`atomic_add`'s own lowering, with the atomic's memory order switched to relaxed for its duration."""
    acq_rel = _lowering._atomic_rmw
    _lowering._atomic_rmw = functools.partial(acq_rel, semantic=tt_dialect.MemSemantic.RELAXED)
    try:
        return _prims._atomic_lowering_rule(ctx, *args_flat, args_tree=args_tree, atomic_type=_ADD)
    finally:
        _lowering._atomic_rmw = acq_rel


def atomic_add(x_ref_or_view, idx, val, *, mask=None):
    """x_ref_or_view[idx] += val, atomically, with no memory ordering (the result is not returned)."""
    x_ref, transforms = _state_prims.get_ref_and_transforms(x_ref_or_view, idx, "atomic_add_relaxed")
    args_flat, args_tree = tree_util.tree_flatten((x_ref, transforms, val, mask))
    relaxed_atomic_add_p.bind(*args_flat, args_tree=args_tree)
