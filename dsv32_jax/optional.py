"""Optional dependencies: imported only where a feature needs them; a missing one names the feature and its extra."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, feature: str) -> ModuleType:
    """import_module(module), or an ImportError saying which feature needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{feature} needs the optional package {module.split('.')[0]!r}: "
                          f"pip install 'dsv32-jax[{extra}]'") from e
