import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

# Every random input is a function of the test's name (and its parameters), so a run is repeatable and a failure
# reproduces alone; see tests/seeds.py (DSV32_TEST_SEED shifts all seeds for sweeps).
from seeds import SEED_OFFSET, test_seed  # noqa: E402


@pytest.fixture
def seed(request) -> int:
    value = test_seed(request.node.nodeid)
    request.node.user_properties.append(("seed", value))
    print(f"seed {value} (DSV32_TEST_SEED={SEED_OFFSET})")
    return value


@pytest.fixture
def rng(seed):
    """numpy Generator seeded from the test's name (see `test_seed`)."""
    return np.random.default_rng(seed)


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (the relative error bound used throughout the tests)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
