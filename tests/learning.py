"""Knobs for the learning tests (GRPO, warm-up, sparse stage): which seed a run uses and an optional tiny float
perturbation of its initial parameters, both taken from the environment so that the same tests can be swept:

    DSV32_TEST_SEED=3 DSV32_TEST_PERTURB=1e-6 pytest tests/test_grpo.py     (tools/seed_sweep.sh loops over seeds)

A learning test must pass for every seed and under the perturbation (a different CPU changes the last bits of
a run just as much); each test's docstring records the spread measured that way.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from tests.seeds import test_seed

PERTURB = float(os.environ.get("DSV32_TEST_PERTURB", "0"))


def run_seed(name: str) -> int:
    """The config seed of a learning run: a function of the test's name (and DSV32_TEST_SEED), kept small."""
    return test_seed(name) % 10_000


def perturb_params(model_state: nnx.State, rel: float = PERTURB, seed: int = 0) -> None:
    """In place: every floating parameter x -> x * (1 + rel * N(0, 1)) (no-op for rel == 0)."""
    if not rel:
        return
    pure = nnx.to_pure_dict(model_state)
    leaves, treedef = jax.tree.flatten(pure)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [(x.astype(jnp.float32) * (1 + rel * jax.random.normal(k, x.shape, jnp.float32))).astype(x.dtype)
           if jnp.issubdtype(x.dtype, jnp.floating) else x for x, k in zip(leaves, keys)]
    nnx.replace_by_pure_dict(model_state, jax.tree.unflatten(treedef, out))
