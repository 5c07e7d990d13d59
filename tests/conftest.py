import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture
def rng():
    """Fresh random inputs each run (seed printed on failure via the test id)."""
    seed = np.random.SeedSequence().entropy % (2**31)
    print(f"numpy seed {seed}")
    return np.random.default_rng(seed)


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (the relative error bound used throughout the tests)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
