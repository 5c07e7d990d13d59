"""FP8 (e4m3) quantization and the Hadamard rotation used by the production lightning indexer.

`act_quant` follows the official kernel: groups of 128 along the last dim, amax clamped at 1e-4, scale
amax/448 rounded UP to a power of two when scale_fmt == "ue8m0". Checkpoint weights (e4m3 with 128x128 "weight_scale_inv" block
multipliers) are dequantized by `dsv32_jax.checkpoint.convert.dequant_fp8`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0  # largest finite e4m3 value
FP8_DTYPE = jnp.float8_e4m3fn
WEIGHT_BLOCK = 128  # checkpoint weights: one scale per 128x128 block
SCALE_SUFFIX = "_scale_inv"  # HF: "<name>.weight_scale_inv" holds the block multipliers of "<name>.weight"


@functools.lru_cache(maxsize=None)
def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester (natural-order) Hadamard matrix H_n with entries +-1; n must be a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard_rotate(x: jnp.ndarray) -> jnp.ndarray:
    """x @ H_d * d^-1/2 over the last dim (orthonormal, so dot products are preserved).

    The +-1 sums first, then one multiply by d^-1/2 (not a matrix of +-d^-1/2 entries: d^-1/2 is no power of two
    for odd log2 d, and the two orders round differently), as fast_hadamard_transform(x, scale) does and the
    `hadamard_quant` kernel: for 128 dims about one value in 1e5 otherwise fell on the other side of an e4m3 rounding
    midpoint, a different code and a different selection."""
    d = x.shape[-1]
    h = jnp.asarray(hadamard_matrix(d), jnp.float32)
    y = jnp.einsum("...d,de->...e", x.astype(jnp.float32), h, precision="highest") * np.float32(d**-0.5)
    return y.astype(x.dtype)


def ue8m0_round_up(s: jnp.ndarray) -> jnp.ndarray:
    """Smallest power of two >= s (s > 0), exactly: 2^ceil(log2 s). A non-finite s stays as it is (frexp gives
    exponent 0 for inf and NaN: an overflowed group was quantized with scale 1, the inf clipped to 448, where the
    scale_fmt=None branch propagates it)."""
    mantissa, exponent = jnp.frexp(s)  # s = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    return jnp.where(jnp.isfinite(s), jnp.ldexp(jnp.ones_like(s), exponent), s)


def fp8_scale(amax: jnp.ndarray) -> jnp.ndarray:
    """amax / 448, correctly rounded in f32, for the same result eager, under jit and inside a Pallas kernel.

    XLA's algebraic simplifier rewrites `x / 448.0` as `x * fl(1/448)` under jit (jax 0.12.1), one ulp above the
    quotient for some amax (84 / 448 = 0.1875 gives 0.18750001), which moves exact rounding ties of x / s to the
    other e4m3 neighbour. Here q0 = amax * fl(1/448) is corrected by its residual, computed exactly: q0 splits
    into a head of 20 significant bits and a tail of 4 (448 = 7 * 2^6 has 3 bits, so head * 448 and tail * 448
    are exact f32 products, amax - head * 448 is exact by Sterbenz and the residual fits 24 bits); q0 + r / 448
    is then the correctly rounded quotient (amax / 448 is never a rounding midpoint: it would need 28 bits).
    For positive normal amax (callers clamp it at 1e-4); inf and NaN pass through as amax / 448 gives them.
    (`dsv32_jax.checkpoint.fp8_weights` keeps its divisions exact with an optimization barrier instead, which works
    for whole XLA programs over numpy or jax arrays but not inside a Pallas kernel.)
    """
    amax = amax.astype(jnp.float32)
    inv = np.float32(1.0 / FP8_MAX)
    q0 = amax * inv
    head = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(q0, jnp.int32) & np.int32(-16), jnp.float32)
    tail = q0 - head
    residual = (amax - head * np.float32(FP8_MAX)) - tail * np.float32(FP8_MAX)
    return jnp.where(jnp.isfinite(q0), q0 + residual * inv, q0)


def act_quant(x: jnp.ndarray, block: int = 128, scale_fmt: str | None = "ue8m0"):
    """Quantizes x [..., N] to e4m3 per group of `block` along the last dim.

    Returns (codes float8_e4m3fn [..., N], scales float32 [..., N // block]); x ~= codes * scale.
    """
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"act_quant: last dim {n} is not a multiple of the block size {block}")
    xg = x.astype(jnp.float32).reshape(*x.shape[:-1], n // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), 1e-4)
    scale = fp8_scale(amax)
    if scale_fmt == "ue8m0":
        scale = ue8m0_round_up(scale)
    elif scale_fmt is not None:
        raise ValueError(f"act_quant: unknown scale_fmt {scale_fmt!r} (expected 'ue8m0' or None)")
    codes = jnp.clip(xg / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return codes.reshape(x.shape), scale


def act_dequant(codes: jnp.ndarray, scale: jnp.ndarray, dtype=jnp.float32) -> jnp.ndarray:
    n = codes.shape[-1]
    block = n // scale.shape[-1]
    xg = codes.astype(jnp.float32).reshape(*codes.shape[:-1], scale.shape[-1], block) * scale[..., None]
    return xg.reshape(codes.shape).astype(dtype)


def fake_quant(x: jnp.ndarray, block: int = 128, scale_fmt: str | None = "ue8m0") -> jnp.ndarray:
    """Quantize-dequantize round trip (simulates an FP8 cache or FP8 GEMM input), same dtype as x.

    Differentiated straight through (the gradient w.r.t. x is the incoming gradient): autodiff of the round trip
    would cast the gradient itself to e4m3 without a scale, which flushes gradients below 2^-9 x scale to zero
    (all of them at training magnitudes), so a run with an FP8 cache would leave c_kv's producers untrained."""
    return _fake_quant_ste(x, block, scale_fmt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fake_quant_ste(x, block, scale_fmt):
    return act_dequant(*act_quant(x, block, scale_fmt), dtype=x.dtype)


def _fake_quant_ste_fwd(x, block, scale_fmt):
    return _fake_quant_ste(x, block, scale_fmt), None


def _fake_quant_ste_bwd(block, scale_fmt, _, g):
    return (g,)


_fake_quant_ste.defvjp(_fake_quant_ste_fwd, _fake_quant_ste_bwd)
