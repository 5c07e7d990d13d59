"""YaRN RoPE frequencies and the two rotary layouts of DeepSeek-V3.2.

MLA rotates interleaved pairs (x[2i], x[2i+1]) on the LAST qk_rope_head_dim dims of each head; the lightning
indexer rotates half-split pairs (x[i], x[i+d/2]) on the FIRST qk_rope_head_dim dims of its head
(reference_spec.md section 3, pitfall 1). Both use one frequency table and absolute positions.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from dsv32_jax.model.config import ModelConfig


def yarn_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies f'_i (i < qk_rope_head_dim/2), float32. YaRN-corrected when rope_type == 'yarn'."""
    dim = cfg.qk_rope_head_dim
    base = cfg.rope_theta
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if cfg.rope_type != "yarn":
        return freqs.astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(cfg.rope_original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.rope_beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0.0, 1.0)
    smooth = 1.0 - ramp  # 1: keep the original frequency (extrapolate), 0: interpolate by the factor
    return (freqs / cfg.rope_factor * (1.0 - smooth) + freqs * smooth).astype(np.float32)


def rope_angles(positions: jnp.ndarray, inv_freq: np.ndarray, attention_factor: float = 1.0):
    """cos, sin of p * f'_i for integer positions [...]; returns two float32 arrays [..., dim/2]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope_interleaved(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """GPT-J layout: rotates (x[2i], x[2i+1]) by angle i. x: [..., d]; cos/sin broadcast to [..., d/2]."""
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def apply_rope_half(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """NeoX / rotate-half layout: rotates (x[i], x[i + d/2]) by angle i."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x0, x1 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    return out.astype(x.dtype)
