"""Environments by name: the built-in ones, those added with `register`, and any by import path
("my_pkg.my_env:MyEnv", the module imported on first use), e.g. in `config.agent.envs`."""

from __future__ import annotations

import importlib
from typing import Callable

from dsv32_jax.posttrain.envs.base import Env
from dsv32_jax.posttrain.envs.calculator import CalculatorEnv
from dsv32_jax.posttrain.envs.lookup import LookupEnv
from dsv32_jax.posttrain.envs.trip import TripEnv

EnvFactory = Callable[..., Env]
ENVS: dict[str, EnvFactory] = {"lookup": LookupEnv, "calculator": CalculatorEnv, "trip": TripEnv}


def register(name: str, factory: EnvFactory, *, replace: bool = False) -> EnvFactory:
    """Make `make_env(name, **kwargs)` call `factory(**kwargs)` (an Env subclass or a function returning an Env).
    Returns `factory`, so it also works as a class decorator: `@functools.partial(register, "mine")`."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"register: the name must be a non-empty string without ':' (import paths need no "
                         f"registration), got {name!r}")
    if not callable(factory):
        raise TypeError(f"register({name!r}, ...): the factory must be callable, got {type(factory).__name__}")
    if name in ENVS and ENVS[name] is not factory and not replace:
        raise ValueError(f"register: environment {name!r} is already registered ({ENVS[name]!r}); pass replace=True")
    ENVS[name] = factory
    return factory


def env_factory(spec: str) -> EnvFactory:
    """The factory of a registered name or of an import path "module.path:Name"."""
    if not isinstance(spec, str):
        raise TypeError(f"environment spec must be a name or 'module:Name' string, got {type(spec).__name__}")
    if ":" not in spec:
        if spec not in ENVS:
            raise ValueError(f"unknown environment {spec!r}; expected one of {sorted(ENVS)}, an import path "
                             "'my_pkg.my_env:MyEnv' or a name added with dsv32_jax.posttrain.envs.register")
        return ENVS[spec]
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"environment {spec!r}: cannot import module {module_name!r} ({e})") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"environment {spec!r}: module {module_name!r} has no callable {attr!r}")
    return factory


def make_env(spec: str | Env, **kwargs) -> Env:
    """A new environment from a registered name or an import path (kwargs go to its constructor; all built-in ones
    take max_steps), or `spec` itself when it is already an Env (then no kwargs)."""
    if isinstance(spec, Env):
        if kwargs:
            raise ValueError(f"make_env: got an Env instance ({type(spec).__name__}) and kwargs {sorted(kwargs)}; "
                             "configure the instance itself")
        return spec
    env = env_factory(spec)(**kwargs)
    if not isinstance(env, Env):
        raise TypeError(f"environment {spec!r} built a {type(env).__name__}, not a dsv32_jax.posttrain.envs.Env")
    return env
