"""Basic parameterised layers. Every parameter carries logical axis names (metadata `axes`) that the
sharding rule table in `dsv32_jax.model.sharding` maps to mesh axes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def normal_param(rngs: nnx.Rngs, shape, axes, dtype, std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), axes=tuple(axes))


class Dense(nnx.Module):
    """y = x @ kernel, kernel [in, out] (HF stores [out, in]). No bias anywhere in DeepSeek-V3.2's linears."""

    def __init__(self, d_in: int, d_out: int, axes, *, rngs: nnx.Rngs, dtype, param_dtype, std: float = 0.02):
        self.kernel = normal_param(rngs, (d_in, d_out), axes, param_dtype, std)
        self.dtype = dtype

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype))


class RMSNorm(nnx.Module):
    """w * x * rsqrt(mean(x^2) + eps), computed in float32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, *, param_dtype, axes=("norm",)):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=tuple(axes))
        self.eps = eps

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nnx.Module):
    """Mean-centred LayerNorm with affine weight and bias (the indexer's k_norm), computed in float32."""

    def __init__(self, dim: int, eps: float, *, param_dtype, axes=("norm",)):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=tuple(axes))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), axes=tuple(axes))
        self.eps = eps

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def take_rows(table, tokens, vocab: int):
    """jnp.take(table, tokens, axis=0) for table [vocab, D], whose gradient sums each id's rows in float32: the
    transpose of take is a scatter-add in the table's dtype, which in bf16 rounded away most of a frequent token's
    gradient (the embedding: 2040 occurrences, 50% off; audit, 2026-12-07). The sum is rounded to the table's dtype
    once. Also the MoE's k copies of each token's row."""
    return jnp.take(table, tokens, axis=0)


def _take_rows_fwd(table, tokens, vocab):
    return jnp.take(table, tokens, axis=0), tokens


def _take_rows_bwd(vocab, tokens, g):
    summed = jnp.zeros((vocab, g.shape[-1]), jnp.float32).at[tokens].add(g.astype(jnp.float32), mode="drop")
    return summed.astype(g.dtype), None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)
