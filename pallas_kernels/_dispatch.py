"""Backend selection shared by every op: one public function per op, `impl` picks the implementation.

impl values:
  "reference"   plain JAX (the dsv32_jax semantics; always available),
  "pallas_gpu"  the Pallas kernel compiled for GPU: the Mosaic GPU kernel where an op has one (Hopper: wgmma),
                else the Triton-backend kernel,
  "mosaic_gpu"  the op's Mosaic GPU kernel (`jax.experimental.pallas.mosaic_gpu`), ops that have one,
  "interpret_mosaic_gpu" that kernel run in Mosaic GPU's interpret mode on any platform,
  "pallas_tpu"  a Pallas Mosaic-TPU kernel where the op has one,
  "interpret"   the GPU kernel body run with `interpret=True` on any platform (what the CPU tests exercise),
  "interpret_tpu" the TPU kernel body run in Pallas' TPU interpret mode (`pltpu.InterpretParams`: DMAs,
                semaphores and SMEM/VMEM simulated on CPU), for ops that have a TPU kernel.
impl=None resolves, in order, to `set_default_impl(...)`, the env var DSV32_KERNEL_IMPL, then the platform of the
device the trace targets (`target_device`: the active `dsv32_jax.model.sharding.use_mesh` mesh's devices, else
`jax.default_device`, else the default backend's; so a step compiled for a deviceless TPU or H100 topology on a CPU
host gets that chip's kernels): gpu -> "pallas_gpu", tpu -> "pallas_tpu", anything else -> "reference"
(set_default_impl and the mesh key jax's tracing caches: a jitted function is traced again after either changes;
the env var is read at trace time only, set it before the first). Those are process-wide preferences: an op without
a kernel for the preferred backend, or inputs (shapes, dtypes) that backend cannot serve, runs its
reference instead. An impl passed explicitly as `impl=` is a demand: an op without that kernel, or inputs it cannot
serve, raise a ValueError naming the op, the input shapes and the reason (never a silent reference run); each
op's docstring lists its backends and constraints.
"""

from __future__ import annotations

import math
import os

import jax

IMPLS = ("reference", "pallas_gpu", "pallas_tpu", "interpret", "interpret_tpu", "mosaic_gpu", "interpret_mosaic_gpu")
ENV_VAR = "DSV32_KERNEL_IMPL"
_default_impl: str | None = None
# set_default_impl's preference keys jax's tracing caches (it is read while tracing): without it, a function jitted
# and traced before a set_default_impl call kept the implementation of its first trace.
_IMPL_KEY = jax.make_user_context(None)


def _check(impl: str, where: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"{where}: unknown kernel impl {impl!r}; expected one of {IMPLS}")
    return impl


def set_default_impl(impl: str | None) -> None:
    """Process-wide default for impl=None (None: back to env var / platform); jitted functions called after it are
    traced again for it."""
    global _default_impl
    _default_impl = None if impl is None else _check(impl, "set_default_impl")
    _IMPL_KEY.set_global(_default_impl)


_PLATFORM_IMPL = {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "tpu": "pallas_tpu"}


def target_device():
    """The device the code being traced is compiled for: the first device of the active mesh
    (`dsv32_jax.model.sharding.use_mesh` with a concrete `jax.sharding.Mesh`, e.g. of deviceless TPU / GPU topology
    devices), else `jax.default_device`'s, else the default backend's first device (None if there is none)."""
    from dsv32_jax.model.sharding import current_mesh  # the math layer; imported late (kernels import this module early)
    mesh = current_mesh()
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh.devices.flat[0]
    dev = jax.config.jax_default_device
    if isinstance(dev, str):  # jax.default_device("cpu") is stored as the platform's name
        try:
            return jax.devices(dev)[0]
        except RuntimeError:
            return None
    if dev is not None:
        return dev
    try:
        return jax.devices()[0]
    except RuntimeError:
        return None


def target_platform() -> str:
    """Platform of `target_device()` ("cpu", "gpu", "tpu", ...); the default backend when no device is known."""
    dev = target_device()
    return dev.platform if dev is not None else jax.default_backend()


def _describe(shapes) -> str:
    """'q (2, 3, 4, 128) float32, k ...' for an error message; values may be arrays, shape tuples or strings."""
    parts = []
    for name, value in (shapes or {}).items():
        if hasattr(value, "shape"):
            dtype = getattr(value, "dtype", None)
            parts.append(f"{name} {tuple(value.shape)}" + (f" {jax.numpy.dtype(dtype).name}" if dtype is not None
                                                              else ""))
        else:
            parts.append(f"{name} {value}")
    return ", ".join(parts) or "(no shapes given)"


def resolve_impl(impl: str | None, available: tuple[str, ...], *, op: str | None = None, shapes=None,
                 unsupported=None) -> str:
    """The implementation to run.

    available: the op's kernel backends ("reference" is always available). shapes: {name: array or shape}, used in
    error messages. unsupported: why the op's kernels cannot serve these inputs -- a string, or a callable
    impl -> reason (None when that backend can serve them) for constraints that differ per backend; None: no
    constraint. impl=None (and the process-wide defaults it reads) falls back to "reference" when the preferred
    backend is not in `available` or is unsupported for these inputs; an explicit impl raises ValueError instead.
    """
    explicit = impl is not None
    if impl is None:
        impl = _default_impl or os.environ.get(ENV_VAR) or None
        if impl is not None:
            _check(impl, f"{ENV_VAR} / set_default_impl")
    if impl is None:
        impl = _PLATFORM_IMPL.get(target_platform(), "reference")
    _check(impl, "impl" if op is None else f"{op}: impl")
    if impl == "reference":
        return impl
    reason = None
    if impl not in available:
        reason = f"the op has no {impl!r} kernel (its kernels: {', '.join(available) or 'none'})"
    elif unsupported is not None:
        reason = unsupported(impl) if callable(unsupported) else unsupported
    if reason is None:
        return impl
    if explicit:
        raise ValueError(f"{op or 'kernel op'}: impl={impl!r} cannot run on {_describe(shapes)}: {reason}; "
                         "pass impl=None to fall back to the reference, or impl='reference'")
    return "reference"


# Options of the TPU interpret mode (`pltpu.InterpretParams`): uninitialised memory reads as NaN, so a kernel that
# consumes memory it never wrote fails its tests; tests may switch on race detection here.
TPU_INTERPRET_OPTIONS: dict = {"uninitialized_memory": "nan"}


def tpu_interpret_params():
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.InterpretParams(**TPU_INTERPRET_OPTIONS)


# Mosaic GPU's interpret mode runs a kernel's warpgroups (num_threads) as Python threads, each executing its own XLA
# computation, from inside a host callback of the calling computation; a warpgroup waiting at a simulated barrier
# blocks the XLA:CPU thread that runs its callback. Those threads come from one pool sized by PJRT_NPROC / NPROC or,
# unset, the CPUs this process may use: with fewer threads than the callback plus the warpgroups, the warpgroup that
# would release the barrier never gets one and the run hangs (measured 2026-11-29, jax 0.12.0.1: the dq / dkv
# gradient test hangs at NPROC=1 every time and sometimes at 2, the CI machine's cores; passes at 3 and 8).
def mgpu_interpret_min_pool(warpgroups: int) -> int:
    """Pool threads a kernel of `warpgroups` needs in interpret mode: 0 for one (it runs inline, no threads), else
    the calling callback + the warpgroups + 1 spare."""
    return 0 if warpgroups <= 1 else warpgroups + 2


def xla_cpu_pool_size() -> int:
    """The XLA:CPU client's thread pool size as XLA computes it (PJRT_NPROC, then NPROC, then the usable CPUs)."""
    for name in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(name, "")
        if value.strip().lstrip("-").isdigit():
            return max(0, int(value))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def manual_devices() -> int:
    """How many devices run the computation being traced side by side: the product of the manual (shard_map) axes
    of the current abstract mesh; 1 outside any shard_map."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[a] for a in mesh.manual_axes)


def mosaic_gpu_interpret_params(kernel: str, warpgroups: int, detect_races: bool = False):
    """`plgpu.InterpretGPUParams` for `kernel` (of `warpgroups` = its num_threads), refusing (instead of hanging)
    when XLA:CPU's thread pool is too small for the interpreter's warpgroup threads. The pool is created with the CPU
    client, so NPROC must be set before jax first runs anything. Refused as well inside a shard_map over several
    devices: the interpreter (jax 0.12.1) keeps one memory for all devices and checks it, and resets every device's
    per-cluster state, at the end of each device's kernel, so kernels running on several devices at once fail
    ("Barrier remains allocated", an accumulator that aliases another) or hang; measured 2026-12-07 on 2-8 CPU
    devices for every Mosaic GPU kernel here that allocates a barrier. A GPU runs them on any mesh."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    devices = manual_devices()
    if devices > 1:
        raise RuntimeError(
            f"{kernel}: Mosaic GPU interpret mode cannot run inside a shard_map over {devices} devices (jax's "
            "interpreter shares one simulated memory and per-cluster state between the devices' kernels, which "
            "then fail or hang): use impl='interpret' (the Triton kernels' interpret mode) or the reference on a "
            "mesh, or run this kernel on one device")
    need, pool = mgpu_interpret_min_pool(warpgroups), xla_cpu_pool_size()
    if pool < need:
        raise RuntimeError(
            f"{kernel}: Mosaic GPU interpret mode needs an XLA:CPU thread pool of at least {need} threads for "
            f"{warpgroups} warpgroups (it has {pool}: PJRT_NPROC / NPROC, else the usable CPUs): each warpgroup runs "
            f"as a thread that holds a pool thread at every barrier, and with fewer the run can hang. Set NPROC={need} "
            "(or more) in the environment before jax starts")
    return plgpu.InterpretGPUParams(detect_races=detect_races)


def next_pow2(n: int, minimum: int = 1) -> int:
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m
