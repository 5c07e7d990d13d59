"""Verifiable tool environments for agentic GRPO (paper section 3.2): `make_env(name, **kwargs)`.

    lookup      a hidden key-value table behind get(key)                       domain "search"
    calculator  multi-step integer arithmetic with calc(expr)                  domain "code"
    trip        constrained trip planning with list_hotels(city), get_hotel    domain "general"

Pure Python (no jax, no numpy); see base.py for the episode API and CHARSET.
"""

from __future__ import annotations

from dsv32_jax.envs.base import (CHARSET, Action, Env, Observation, Tool, ToolCall, ToolError, in_charset,
                                 validate_arguments)
from dsv32_jax.envs.calculator import CalculatorEnv
from dsv32_jax.envs.lookup import LookupEnv
from dsv32_jax.envs.trip import TripEnv

ENVS: dict[str, type[Env]] = {"lookup": LookupEnv, "calculator": CalculatorEnv, "trip": TripEnv}


def make_env(name: str, **kwargs) -> Env:
    """A new environment by registry name; kwargs go to its constructor (all take max_steps)."""
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}; expected one of {sorted(ENVS)}")
    return ENVS[name](**kwargs)


__all__ = ["CHARSET", "ENVS", "Action", "CalculatorEnv", "Env", "LookupEnv", "Observation", "Tool", "ToolCall",
           "ToolError", "TripEnv", "in_charset", "make_env", "validate_arguments"]
