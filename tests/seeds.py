"""Test seeds as a function of the test's name (importable without pytest: subprocess scripts use it too)."""

import os
import zlib

# DSV32_TEST_SEED=N (default 0) shifts every seed at once: sweep it to check that a statistical bound or a learning
# test holds over many draws (tools/seed_sweep.sh), never to make a failing test pass.
SEED_OFFSET = int(os.environ.get("DSV32_TEST_SEED", "0"))


def test_seed(name: str, offset: int | None = None) -> int:
    """Deterministic 31-bit seed for a test id such as 'tests/test_x.py::test_y[param]'."""
    return (zlib.crc32(name.encode()) + (SEED_OFFSET if offset is None else offset)) % (2**31)


test_seed.__test__ = False  # a helper, not a test
