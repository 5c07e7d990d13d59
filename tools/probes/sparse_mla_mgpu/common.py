"""Shared bits of the sparse-MLA Mosaic GPU probes: reference, inputs, interpret params."""
import os, sys
import numpy as np

D_QK, D_V, H, BK = 576, 512, 64, 64
TILES = None


def plgpu():
    from jax.experimental.pallas import mosaic_gpu
    return mosaic_gpu


def tiles():
    p = plgpu()
    return (p.TilingTransform((8, 64)), p.SwizzleTransform(128))


def interp():
    return plgpu().InterpretGPUParams()


def inputs(n=512, k=256, seed=0, invalid=True):
    import jax.numpy as jnp
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((H, D_QK)).astype(np.float32)
    kv = rng.standard_normal((n, D_QK)).astype(np.float32)
    idx = rng.choice(n, size=k, replace=False).astype(np.int32)
    if invalid:
        idx[rng.choice(k, size=k // 8, replace=False)] = -1
    return jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16), jnp.asarray(idx)


def reference(q, kv, idx, scale, d_v=D_V):
    """numpy float64: out [H, d_v], lse [H] (natural log), matching attention.sparse_mla for one token."""
    q = np.asarray(q, np.float64); kv = np.asarray(kv, np.float64); idx = np.asarray(idx)
    valid = idx >= 0
    rows = np.where(valid[:, None], kv[np.clip(idx, 0, None)], 0.0)
    s = scale * q @ rows.T
    s = np.where(valid[None, :], s, -np.inf)
    m = s.max(1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(1, keepdims=True)
    out = (p / l) @ rows[:, :d_v]
    return out, (m + np.log(l))[:, 0]


def err(name, got, want):
    got = np.asarray(got, np.float64); want = np.asarray(want, np.float64)
    a = np.abs(got - want).max()
    r = a / max(np.abs(want).max(), 1e-30)
    print(f"{name}: max abs err {a:.3e}, max rel (to max|ref|) {r:.3e}", flush=True)
    return a, r
