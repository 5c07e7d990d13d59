import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# XLA:CPU's thread pool (NPROC; else the usable CPUs, 2 on CI): Mosaic GPU's interpret mode runs a kernel's two
# warpgroups as threads that each hold a pool thread at a barrier, and with 2 the dq / dkv gradient test hung CI
# (pallas_kernels/_dispatch.py: mosaic_gpu_interpret_params refuses a pool under 4 for such kernels).
os.environ.setdefault("NPROC", str(max(os.cpu_count() or 1, 4)))
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

# Expensive shared fixtures (a training run, a converted checkpoint, an install) are session-scoped, not module-
# scoped: an xdist worker interleaves tests of several modules, and each switch would tear a module fixture down and
# compute it again (the stage runs of test_train.py were computed twice a run that way).

_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


# The longest heavy tests, longest first (seconds in the fresh-clone CI run at f907acf, 2 cores shared with the
# compiles; at 8373abd, with this order: 461, 905, 219, 156, 342 + 103, 128 s), collected first, so `-n 2` starts
# them first and the shorter ones fill in around them, instead of one of them starting last and running alone at
# the end (longest-processing-time-first scheduling). A group (xdist_group) is scheduled where its first test is
# collected, so naming one test moves its whole group.
LONGEST_FIRST = (
    "tests/test_multiprocess.py::test_one_device_eight_devices",  # 905 s
    "tests/test_agent_grpo.py::test_grpo_over_trajectories_beats",  # 741 s
    "tests/test_agent_grpo.py::test_agent_resume_after_sigkill",  # 705 s
    "tests/test_docs.py::test_runnable_blocks_heavy[docs/training.md]",  # 245 s
    "tests/test_grpo.py::test_learns_map_a_digit_from_chance",  # its group's fixture: 202 s, then 79 s and more
    "tests/test_agent_grpo.py::test_cold_start_then_one_grpo_step",  # 177 s
)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Before the other implementations: collects LONGEST_FIRST's tests first, in that order (a stable sort: every
    other test keeps its place). After them (xdist's included): `_warn_lost_groups`."""
    def rank(item):
        return next((i for i, p in enumerate(LONGEST_FIRST) if item.nodeid.startswith(p)), len(LONGEST_FIRST))
    items.sort(key=rank)
    result = yield
    _warn_lost_groups(config, items)
    return result


def _warn_lost_groups(config, items):
    """Warn when `--dist loadgroup` did not take an `xdist_group` mark. xdist groups by appending "@<group>" to the
    node ids on each worker; from pytest 9.2 that no longer takes effect (pytest-xdist#1386), the tests of a group
    are spread over the workers and their shared session fixture is computed on each (test_grpo's map run, twice).
    pyproject's test extra keeps pytest below 9.2 until xdist fixes it; this says so if it happens anyway."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            item.warn(pytest.PytestWarning(
                "--dist loadgroup did not group this test (pytest-xdist#1386 with pytest >= 9.2): its xdist_group's "
                "session fixture may be computed on every worker; install pytest < 9.2 (pyproject's test extra)"))


def pytest_configure(config):
    """One persistent XLA compilation cache per test run, shared by the xdist workers and by every subprocess a test
    starts (they inherit the environment): many tests compile the same tiny programs (a trainer's steps, a resumed
    run's, the CLI's), and a hit skips XLA's compile. Keyed on the program and the compile options, so a hit is the
    same executable; DSV32_TEST_COMPILE_CACHE=0 turns it off, and a JAX_COMPILATION_CACHE_DIR already set is kept.
    Created by the controlling process before jax is imported anywhere; removed when the run ends."""
    _fast_cpu_compiles()
    if hasattr(config, "workerinput") or os.environ.get("DSV32_TEST_COMPILE_CACHE", "1") == "0":
        return
    if _CACHE_ENV not in os.environ:
        import tempfile

        config._dsv32_cache_dir = tempfile.mkdtemp(prefix="dsv32-jax-compile-cache-")
        os.environ[_CACHE_ENV] = config._dsv32_cache_dir
    # No size bound: with one, jax rescans the directory under a file lock on every write. Without it an entry read
    # while another process is still writing it fails to decompress, and jax warns and compiles instead.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


# LLVM's optimization level for XLA:CPU programs. Most of the suite's time is XLA compiling tiny programs that then
# run for milliseconds; at -O0 (and without LLVM's expensive passes) a compile is much cheaper, and the results are
# the same (IEEE semantics either way: no fast-math; XLA's own HLO passes do not depend on this level). Measured
# 2026-11-27 on 2 cores, test_sampler + test_model + a kernel decode test: 149 s -> 100 s of CPU time.
# DSV32_TEST_FAST_COMPILE=0 keeps XLA's defaults; flags already in XLA_FLAGS win.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def child_xla_flags(extra: str = "") -> str:
    """XLA_FLAGS for a subprocess a test starts: the fast-compile flags (unless turned off) and `extra`."""
    fast = "" if os.environ.get("DSV32_TEST_FAST_COMPILE", "1") == "0" else " ".join(FAST_COMPILE_FLAGS)
    return f"{fast} {extra}".strip()


def run_processes(script: str, nproc: int, *args: str, timeout: int = 600) -> list[dict]:
    """Runs `python -c script PID NPROC PORT *args` for PID in range(nproc) (a jax.distributed job on localhost, the
    parent's XLA_FLAGS replaced by the fast-compile ones) and returns each process's last `RESULT <json>` line."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = str(s.getsockname()[1])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = child_xla_flags()
    procs = [subprocess.Popen([sys.executable, "-c", script, str(pid), str(nproc), port, *args], cwd=root, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for pid in range(nproc)]
    results = []
    for pid, proc in enumerate(procs):
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, f"process {pid}/{nproc} failed:\n{stderr[-4000:]}"
        line = [x for x in stdout.splitlines() if x.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT "):]))
    return results


def _fast_cpu_compiles():
    if os.environ.get("DSV32_TEST_FAST_COMPILE", "1") == "0":
        return
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in FAST_COMPILE_FLAGS if f.split("=")[0] not in flags]
    os.environ["XLA_FLAGS"] = " ".join([flags] + extra).strip()


def pytest_unconfigure(config):
    path = getattr(config, "_dsv32_cache_dir", None)
    if path:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop(_CACHE_ENV, None)

# Every random input is a function of the test's name (and its parameters), so a run is repeatable and a failure
# reproduces alone; see tests/seeds.py (DSV32_TEST_SEED shifts all seeds for sweeps).
from seeds import SEED_OFFSET, test_seed  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_log_levels():
    """A test that parses absl flags (a CLI's main run in-process) sets the absl logger to --verbosity's default,
    WARNING, and a convert run sets WARNING itself; later tests on the same xdist worker would then lose absl INFO
    records. Every test leaves the absl and root logger levels as it found them."""
    import logging

    from absl import logging as absl_logging

    loggers = (logging.getLogger(), absl_logging.get_absl_logger())
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)


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


_JIT_DECODE = {}


def jit_decode(model, tokens, cache, index, positions, segment_ids):
    """`model.decode` under one jit (the model's graph static, `index` traced): a test's prefill and its one-token
    steps compile once each instead of dispatching every op eagerly (eager decode of the tiny model with interpret-
    mode kernels took ~2 min a test). One jit per kernel-impl environment value: the dispatch reads it when tracing."""
    import jax
    from flax import nnx

    from dsv32_jax.kernels import _dispatch
    key = os.environ.get(_dispatch.ENV_VAR)
    if key not in _JIT_DECODE:
        def run(graphdef, state, *args):
            return nnx.merge(graphdef, state).decode(*args)
        _JIT_DECODE[key] = jax.jit(run, static_argnums=0)
    graphdef, state = nnx.split(model)
    return _JIT_DECODE[key](graphdef, state, tokens, cache, jax.numpy.int32(index), positions, segment_ids)


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (the relative error bound used throughout the tests)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
