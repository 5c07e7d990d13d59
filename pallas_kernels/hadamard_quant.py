"""Hadamard rotation + e4m3 quantization of the indexer's q and k (reference_spec.md 5.2 steps 3-4, 5.3).

One row = one 128-dim vector (a q head of a token, or a token's k): y = x @ H_128 * 128^-1/2 rounded to x's dtype
(as `dsv32_jax.model.fp8.hadamard_rotate`), then one power-of-two (ue8m0) scale per row and e4m3 codes
(`dsv32_jax.model.fp8.act_quant` with block = 128).

Kernel: rows are tiled [BR, 128]; the rotation is one MMA against the +-1 Sylvester matrix (exact in bf16 for bf16
inputs, IEEE fp32 FMA for fp32 inputs) followed by the 128^-1/2 scale, the row amax, the exponent bit trick for
2^ceil(log2(amax/448)) and the e4m3 cast. The same body serves Triton ("pallas_gpu"), Mosaic TPU ("pallas_tpu")
and interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsv32_jax.model.fp8 import FP8_DTYPE, FP8_MAX, act_quant, fp8_scale, hadamard_matrix, hadamard_rotate
from dsv32_jax.model.config import is_int
from dsv32_jax.kernels._dispatch import next_pow2, resolve_impl, round_up, tpu_interpret_params
from dsv32_jax.kernels._vmap import ROWS, fold_vmap

DIM = 128


def hadamard_quant_reference(x: jnp.ndarray, scale_fmt: str | None = "ue8m0"):
    codes, scale = act_quant(hadamard_rotate(x), block=x.shape[-1], scale_fmt=scale_fmt)
    return codes, scale[..., 0]


def _pow2_ceil(s: jnp.ndarray) -> jnp.ndarray:
    """Smallest power of two >= s for normal positive f32 s (exponent + 1 when the mantissa is non-zero); inf and
    NaN stay as they are, as in `ue8m0_round_up` (a NaN's mantissa carried into the sign bit: -0.0)."""
    bits = jax.lax.bitcast_convert_type(s, jnp.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = jnp.where((bits & 0x7FFFFF) != 0, exponent + 1, exponent)
    return jnp.where(jnp.isfinite(s), jax.lax.bitcast_convert_type(exponent << 23, jnp.float32), s)


def _kernel(x_ref, h_ref, codes_ref, scale_ref, *, scale_fmt):
    x = x_ref[...]
    mma_dtype = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    y = jnp.dot(x.astype(mma_dtype), h_ref[...].astype(mma_dtype), preferred_element_type=jnp.float32)
    y = (y * DIM**-0.5).astype(x.dtype).astype(jnp.float32)  # the reference rounds the rotation to x's dtype
    amax = jnp.maximum(jnp.max(jnp.abs(y), axis=1), 1e-4)
    scale = fp8_scale(amax)  # amax / 448 correctly rounded, as act_quant (XLA would multiply by 1/448)
    if scale_fmt == "ue8m0":
        scale = _pow2_ceil(scale)
    codes_ref[...] = jnp.clip(y / scale[:, None], -FP8_MAX, FP8_MAX).astype(codes_ref.dtype)
    scale_ref[...] = scale


@functools.partial(jax.jit, static_argnames=("scale_fmt", "block_rows", "backend"))
def _hadamard_quant_pallas(x, *, scale_fmt, block_rows, backend):
    lead = x.shape[:-1]
    # (under jax.vmap the mapped axis joins the rows: the Mosaic TPU compiler refuses the batched rank-1 scale block)
    rotate = functools.partial(_rotate_rows, scale_fmt=scale_fmt, block_rows=block_rows, backend=backend)
    codes, scale = fold_vmap(lambda fold: rotate, (ROWS,))(x.reshape(-1, DIM))
    return codes.reshape(*lead, DIM), scale.reshape(lead)


def _rotate_rows(rows, *, scale_fmt, block_rows, backend):
    n = rows.shape[0]
    br = min(block_rows, round_up(n, 16))
    if backend in ("pallas_tpu", "interpret_tpu"):  # Mosaic TPU: a rank-1 (scale) block must be a power of two >= 128
        br = max(next_pow2(block_rows), 128)
    n_pad = round_up(n, br)
    rows = jnp.pad(rows, ((0, n_pad - n), (0, 0)))
    h = jnp.asarray(hadamard_matrix(DIM), jnp.float32)  # +-1 entries, exact in any MMA dtype
    kwargs = {}
    if backend == "pallas_gpu":
        from jax.experimental.pallas import triton as pltriton
        kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=4, num_stages=2)
    codes, scale = pl.pallas_call(
        functools.partial(_kernel, scale_fmt=scale_fmt),
        grid=(n_pad // br,),
        in_specs=[pl.BlockSpec((br, DIM), lambda i: (i, 0)), pl.BlockSpec((DIM, DIM), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((br, DIM), lambda i: (i, 0)), pl.BlockSpec((br,), lambda i: (i,))],
        out_shape=[jax.ShapeDtypeStruct((n_pad, DIM), FP8_DTYPE), jax.ShapeDtypeStruct((n_pad,), jnp.float32)],
        interpret=tpu_interpret_params() if backend == "interpret_tpu" else backend == "interpret",
        **kwargs,
    )(rows, h)
    return codes[:n], scale[:n]


def hadamard_quant(x: jnp.ndarray, *, scale_fmt: str | None = "ue8m0", impl: str | None = None,
                   block_rows: int = 64):
    """x [..., 128] (one indexer q head or one k row per vector) -> (e4m3 codes [..., 128], f32 scale [...]).

    codes * scale ~= x @ H_128 / sqrt(128). Same result as `act_quant(hadamard_rotate(x), 128)` (scales squeezed).
    Backends: pallas_gpu, pallas_tpu, interpret, interpret_tpu, for a last dim of 128 only: other last dims run
    the reference with impl=None and raise ValueError with an explicit kernel impl.
    """
    if scale_fmt not in ("ue8m0", None):
        raise ValueError(f"hadamard_quant: scale_fmt must be 'ue8m0' or None, got {scale_fmt!r}")
    if not is_int(block_rows) or block_rows < 1:
        raise ValueError(f"hadamard_quant: block_rows must be an integer >= 1, got {block_rows!r}")
    impl = resolve_impl(impl, ("pallas_gpu", "pallas_tpu", "interpret", "interpret_tpu"), op="hadamard_quant",
                        shapes={"x": x}, unsupported=None if x.shape[-1] == DIM else f"the kernel rotates rows of "
                        f"{DIM}, got a last dim of {x.shape[-1]}")
    if impl == "reference" or x.size == 0:  # (no rows: the kernels' grid would be empty, a division by 0)
        return hadamard_quant_reference(x, scale_fmt)
    return _hadamard_quant_pallas(x, scale_fmt=scale_fmt, block_rows=block_rows, backend=impl)
