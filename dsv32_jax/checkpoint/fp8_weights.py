"""FP8 checkpoint weights: e4m3 codes with one float32 multiplier per 128x128 block ("weight_scale_inv"), as
DeepSeek-V3 / V3.2 ship them. Dequantize, quantize, cast and transpose kernels for the converters and loaders.

Layer: above `dsv32_jax.model.fp8` (the constants and the activation codec), below every checkpoint module
(safetensors_io, hf, orbax_io, loading, convert).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv32_jax.model.fp8 import FP8_MAX, WEIGHT_BLOCK as BLOCK

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def fp8_blocks(shape: tuple) -> tuple:
    """Block-scale shape of an FP8 array: leading (expert) dims kept, last two divided into 128-blocks."""
    return tuple(shape[:-2]) + tuple(-(-n // BLOCK) for n in shape[-2:])


@contextlib.contextmanager
def cpu_default_device():
    """Conversion kernels run on the host even where an accelerator is the default backend."""
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:
        yield
        return
    with jax.default_device(cpu):
        yield


# ============================================================================================ numeric kernels
# Each kernel is written once against an array namespace `xp` (numpy or jax.numpy). Tensors of at least
# JAX_MIN_ELEMENTS elements run the jitted JAX version on the host CPU (about 2x faster than numpy on these
# memory-bound conversions), smaller ones run numpy (no compile per shape). Both give bitwise identical results:
# float32 products and quotients are IEEE operations, and every cast rounds to nearest-even.
JAX_MIN_ELEMENTS = 1 << 20


def _swap(xp, x, transpose: bool):
    return xp.swapaxes(x, -1, -2) if transpose else x


def _finite(xp, x):
    return xp.all(xp.isfinite(x.astype(xp.float32)))


def _cast_swap(xp, x, dtype, transpose):
    """Cast and (optionally) transpose, moving the narrower representation (same bits either way)."""
    if np.dtype(dtype).itemsize <= np.dtype(x.dtype).itemsize:
        return _swap(xp, x.astype(dtype), transpose)
    return _swap(xp, x, transpose).astype(dtype)


def _dequant_impl(xp, codes, scale, dtype, transpose):
    r, c = codes.shape[-2:]
    s = xp.repeat(xp.repeat(scale.astype(xp.float32), BLOCK, axis=-2), BLOCK, axis=-1)[..., :r, :c]
    w = codes.astype(xp.float32) * s
    return _cast_swap(xp, w, dtype, transpose), _finite(xp, w)


def _cast_impl(xp, x, dtype, transpose):
    return _cast_swap(xp, x, dtype, transpose), _finite(xp, x)


def _exact(xp, divisor):
    """XLA rewrites x / broadcast(d) (and x / constant) as x * (1 / d), which is not the IEEE quotient; an
    optimization barrier on the materialized divisor keeps the true division (numpy divides exactly anyway)."""
    return jax.lax.optimization_barrier(divisor) if xp is jnp else divisor


def _quant_impl(xp, x, transpose):
    """Per 128x128 block of x [r, c]: scale = amax / 448 (1 for an all-zero block), codes = clip(x / scale) as e4m3;
    both transposed at the end when transpose (the 1-byte codes are the cheap thing to move)."""
    x = x.astype(xp.float32)
    r, c = x.shape
    pr, pc = -(-r // BLOCK) * BLOCK, -(-c // BLOCK) * BLOCK
    b = xp.pad(x, [(0, pr - r), (0, pc - c)]).reshape(pr // BLOCK, BLOCK, pc // BLOCK, BLOCK)
    amax = xp.max(xp.abs(b), axis=(1, 3))
    scale = amax / _exact(xp, xp.full(amax.shape, FP8_MAX, xp.float32))
    scale = xp.where(amax > 0, scale, xp.float32(1.0))
    divisor = _exact(xp, xp.broadcast_to(scale[:, None, :, None], b.shape))
    codes = xp.clip(b / divisor, -FP8_MAX, FP8_MAX).astype(FP8).reshape(pr, pc)[:r, :c]
    return _swap(xp, codes, transpose), _swap(xp, scale, transpose), _finite(xp, x)


_IMPLS = {"dequant": (_dequant_impl, ("dtype", "transpose")), "cast": (_cast_impl, ("dtype", "transpose")),
          "quant": (_quant_impl, ("transpose",))}


@functools.lru_cache(maxsize=None)
def _jitted(kind: str):
    impl, static = _IMPLS[kind]
    return jax.jit(functools.partial(impl, jnp), static_argnames=static)


def _call(kind: str, *args, **kw):
    """One kernel call on host arrays; returns numpy arrays (numpy bools for the finiteness flags)."""
    if max(int(np.prod(np.shape(a))) for a in args) < JAX_MIN_ELEMENTS:
        out = _IMPLS[kind][0](np, *[np.asarray(a) for a in args], **kw)
    else:
        with cpu_default_device():
            out = _jitted(kind)(*[jnp.asarray(a) for a in args], **kw)
    return jax.tree.map(np.asarray, out)


# Large tensors go through the kernels in strips of whole 128-column blocks of at most CHUNK_ELEMENTS elements:
# that bounds the float32 temporaries (the 671B embedding would need 3.7 GB of them at once) and is ~1.5x faster
# for the transposing kernels (cache-sized working sets).
CHUNK_ELEMENTS = 1 << 22


def _strips(rows: int, cols: int):
    width = max(BLOCK, (CHUNK_ELEMENTS // max(rows, 1)) // BLOCK * BLOCK)
    return [(j, min(cols, j + width)) for j in range(0, cols, width)]


def _out_shape(shape, transpose):
    return tuple(shape[:-2]) + ((shape[-1], shape[-2]) if transpose else tuple(shape[-2:]))


def convert_tensor(x: np.ndarray, scale: np.ndarray | None, dtype, transpose: bool,
                   check: bool = True) -> tuple[np.ndarray, bool]:
    """x [..., r, c] -> dtype, last two dims swapped when transpose; e4m3 codes are dequantized with their 128x128
    block scale when `scale` is given. Returns (array, all values finite); with check=False an array that needs
    no change is returned as is (finiteness not checked)."""
    dtype = np.dtype(dtype)
    kind = "cast" if scale is None else "dequant"
    if scale is None and not transpose and x.dtype == dtype and not check:
        return x, True
    if x.ndim > 2:
        out, ok = np.empty(_out_shape(x.shape, transpose), dtype), True
        for idx in np.ndindex(*x.shape[:-2]):
            out[idx], ok_i = convert_tensor(x[idx], None if scale is None else scale[idx], dtype, transpose, check)
            ok = ok and ok_i
        return out, ok
    if x.ndim < 2:
        y, ok = _call("cast", x, dtype=dtype, transpose=False)
        return y, bool(ok)
    rows, cols = x.shape
    args = lambda j0, j1: (x[:, j0:j1],) + (() if scale is None else (scale[:, j0 // BLOCK:-(-j1 // BLOCK)],))
    if x.size < JAX_MIN_ELEMENTS or x.size <= CHUNK_ELEMENTS:
        y, ok = _call(kind, *args(0, cols), dtype=dtype, transpose=transpose)
        return y, bool(ok)
    out, ok = np.empty(_out_shape(x.shape, transpose), dtype), True
    for j0, j1 in _strips(rows, cols):
        y, ok_i = _call(kind, *args(j0, j1), dtype=dtype, transpose=transpose)
        if transpose:
            out[j0:j1] = y
        else:
            out[:, j0:j1] = y
        ok = ok and bool(ok_i)
    return out, ok


def _quantize(x: np.ndarray, transpose: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    """(codes, scale, all finite) of x [..., r, c], in the transposed layout when transpose."""
    if x.ndim > 2:
        lead = x.shape[:-2]
        codes = np.empty(_out_shape(x.shape, transpose), FP8)
        scale = np.empty(lead + fp8_blocks(codes.shape[-2:]), F32)
        ok = True
        for idx in np.ndindex(*lead):
            codes[idx], scale[idx], ok_i = _quantize(x[idx], transpose)
            ok = ok and ok_i
        return codes, scale, ok
    rows, cols = x.shape
    strips = [(0, cols)] if x.size <= CHUNK_ELEMENTS else _strips(rows, cols)
    codes = np.empty(_out_shape(x.shape, transpose), FP8)
    scale = np.empty(fp8_blocks(codes.shape), F32)
    ok = True
    for j0, j1 in strips:
        c, s, ok_i = _call("quant", x[:, j0:j1], transpose=transpose)
        b0, b1 = j0 // BLOCK, -(-j1 // BLOCK)
        if transpose:
            codes[j0:j1], scale[b0:b1] = c, s
        else:
            codes[:, j0:j1], scale[:, b0:b1] = c, s
        ok = ok and bool(ok_i)
    return codes, scale, ok


def dequant_fp8(codes: np.ndarray, scale: np.ndarray, dtype=np.float32, transpose: bool = False) -> np.ndarray:
    """codes (e4m3) * 128x128 block scale over the last two dims (leading dims: experts), ragged edges cropped."""
    if tuple(scale.shape) != fp8_blocks(codes.shape):
        raise ValueError(f"scale shape {list(scale.shape)} does not match {list(codes.shape)} "
                         f"(expected {list(fp8_blocks(codes.shape))} for {BLOCK}x{BLOCK} blocks)")
    out, _ = convert_tensor(codes, scale, dtype, transpose)
    return out


def quantize_fp8(w: np.ndarray, transpose: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per 128x128 block (last two dims): scale = amax / 448 (float32, 1.0 for an all-zero block),
    codes = clip(w / scale, +-448) as float8_e4m3fn. Returns (codes, scale); w ~= codes * scale."""
    codes, scale, _ = _quantize(w, transpose)
    return codes, scale
