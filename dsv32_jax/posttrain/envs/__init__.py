"""Verifiable tool environments for agentic GRPO (paper section 3.2): `make_env(name, **kwargs)`.

    lookup      a hidden key-value table behind get(key)                       domain "search"
    calculator  multi-step integer arithmetic with calc(expr)                  domain "code"
    trip        constrained trip planning with list_hotels(city), get_hotel    domain "general"

Your own: subclass `Env` (docs/environments.md), then use it by instance, by import path ("my_pkg.my_env:MyEnv")
or by a name given to `register`. Pure Python (no jax, no numpy); base.py has the episode API, tools.py the tools.
"""

from __future__ import annotations

from dsv32_jax.posttrain.chat import ToolCall
from dsv32_jax.posttrain.envs.base import Action, Env, Observation
from dsv32_jax.posttrain.envs.calculator import CalculatorEnv
from dsv32_jax.posttrain.envs.helpers import LETTERS, integer_score, parse_integer, unique_names
from dsv32_jax.posttrain.envs.lookup import LookupEnv
from dsv32_jax.posttrain.envs.registry import ENVS, env_factory, make_env, register
from dsv32_jax.posttrain.envs.tools import (CHARSET, TOOL_STATUSES, Tool, ToolError, ToolOutput, check_schema, compact_json,
                                  in_charset, sanitize, tool_counts, validate_arguments)
from dsv32_jax.posttrain.envs.trip import TripEnv

__all__ = ["CHARSET", "ENVS", "LETTERS", "TOOL_STATUSES", "Action", "CalculatorEnv", "Env", "LookupEnv",
           "Observation", "Tool", "ToolCall", "ToolError", "ToolOutput", "TripEnv", "check_schema", "compact_json",
           "env_factory", "in_charset", "integer_score", "make_env", "parse_integer", "register", "sanitize",
           "tool_counts", "unique_names", "validate_arguments"]
