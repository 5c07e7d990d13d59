"""jax.vmap of a kernel call by folding the mapped axis into the rows the kernel already takes (tokens, cache rows,
rows of a rotation), instead of pallas_call's batching rule, which adds the mapped axis to the grid and to every
block. The Mosaic TPU compiler refuses that on the blocks of sparse MLA's gathered cache (in HBM: "supports in memory
space ANY only blocks having the same block shape as the array shape") and on hadamard_quant's rank-1 scale block,
and JAX's TPU interpreter on every kernel with dimension semantics. Folded, the kernel runs once over V x the rows
(one launch, not V), on every backend alike.

Argument kinds (axis 0 of each array argument):
    ROWS   independent rows (tokens, query rows): [V, N, ...] -> [V N, ...]
    KEYS   the rows the INDEX arguments address (the flattened cache): [V, M, ...] -> [V M, ...]
    INDEX  ROWS of int32 row numbers into the KEYS argument (< 0: an empty slot); slice v's are shifted by v M
Every output's axis 0 is ROWS or KEYS and is unfolded the same way ([V N, ...] -> [V, N, ...]).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import custom_batching

ROWS, KEYS, INDEX = "rows", "keys", "index"


def fold_vmap(make: Callable[[int], Callable], kinds: Sequence[str]) -> Callable:
    """A function equal to make(1) (called with len(kinds) array arguments of those kinds) whose jax.vmap runs
    make(V) once on the folded arguments: `make(fold)` is the function for arguments that hold `fold` slices
    (what depends on the number of cache rows, such as a kernel's bound on valid row numbers, scales with it).
    Arguments that the vmap does not map are broadcast; nested vmaps each fold again."""
    kinds = tuple(kinds)
    if KEYS not in kinds and INDEX in kinds:
        raise ValueError("fold_vmap: INDEX arguments need the KEYS argument they address")

    @custom_batching.custom_vmap
    def call(*args):
        return make(1)(*args)

    @call.def_vmap
    def rule(axis_size, in_batched, *args):
        v = axis_size
        args = [a if b else jnp.broadcast_to(a, (v, *jnp.shape(a))) for a, b in zip(args, in_batched)]
        m = next((a.shape[1] for a, k in zip(args, kinds) if k == KEYS), 0)
        folded = []
        for a, k in zip(args, kinds):
            if k == INDEX:
                shift = (jnp.arange(v, dtype=a.dtype) * m).reshape((v,) + (1,) * (a.ndim - 1))
                a = jnp.where(a >= 0, a + shift, a)
            folded.append(a.reshape(v * a.shape[1], *a.shape[2:]))
        out = fold_vmap(lambda f: make(v * f), kinds)(*folded)
        out = jax.tree.map(lambda o: o.reshape(v, o.shape[0] // v, *o.shape[1:]), out)
        return out, jax.tree.map(lambda _: True, out)

    return call
