"""Q1: in Mosaic GPU interpret mode, can a Pallas-level gather fill a tiled (8,64) + 128B-swizzled smem buffer row by
row?  Variants:  reg  = kv_smem[pl.ds(r,1), :] = where(valid, kv_gmem[pl.ds(i,1), :], 0)  in a fori_loop,
                 tma  = copy_gmem_to_smem(kv_gmem.at[pl.ds(i,1)], kv_smem.at[pl.ds(r,1)], bar) + barrier_wait per row.
The kernel then runs a wgmma q @ kv_smem^T and TMA-stores both the gathered buffer and the QK^T block.
Usage: p1_gather_interpret.py [reg|tma] [interpret|compile]"""
import os, sys, functools
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from common import plgpu, tiles, interp, inputs, err, H, D_QK, BK


def gather_reg(kv_gmem, idx_smem, kv_smem, bar):
    def row(r, c):
        i = idx_smem[r]
        v = kv_gmem[pl.ds(jnp.maximum(i, 0), 1), :]
        kv_smem[pl.ds(r, 1), :] = jnp.where(i >= 0, v, jnp.zeros_like(v))
        return c
    jax.lax.fori_loop(0, kv_smem.shape[0], row, 0)


def gather_tma(kv_gmem, idx_smem, kv_smem, bar):
    mg = plgpu()
    def row(r, c):
        i = idx_smem[r]
        mg.copy_gmem_to_smem(kv_gmem.at[pl.ds(jnp.maximum(i, 0), 1)], kv_smem.at[pl.ds(r, 1)], bar)
        mg.barrier_wait(bar)
        return c
    jax.lax.fori_loop(0, kv_smem.shape[0], row, 0)


def build(gather, interpret):
    mg = plgpu()
    t = tiles()

    def body(q_gmem, kv_gmem, idx_gmem, s_gmem, g_gmem, q_smem, kv_smem, s_smem, idx_smem, bars):
        mg.copy_gmem_to_smem(q_gmem, q_smem, bars.at[0])
        mg.copy_gmem_to_smem(idx_gmem, idx_smem, bars.at[1])
        mg.barrier_wait(bars.at[1])
        gather(kv_gmem, idx_smem, kv_smem, bars.at[2])
        mg.commit_smem()
        mg.barrier_wait(bars.at[0])

        def mm(acc):
            mg.wgmma(acc, q_smem, kv_smem.T)
            return acc[...]
        s_smem[...] = pl.run_scoped(mm, mg.ACC((H, BK), jnp.float32))
        mg.commit_smem()
        mg.copy_smem_to_gmem(s_smem, s_gmem)
        mg.copy_smem_to_gmem(kv_smem, g_gmem)
        mg.wait_smem_to_gmem(0)

    return mg.kernel(body, out_type=(jax.ShapeDtypeStruct((H, BK), jnp.float32),
                                     jax.ShapeDtypeStruct((BK, D_QK), jnp.bfloat16)),
                     scratch_types=[mg.SMEM((H, D_QK), jnp.bfloat16, transforms=t),
                                    mg.SMEM((BK, D_QK), jnp.bfloat16, transforms=t),
                                    mg.SMEM((H, BK), jnp.float32), mg.SMEM((BK,), jnp.int32),
                                    mg.Barrier(num_barriers=3)],
                     interpret=interp() if interpret else None, compiler_params=mg.CompilerParams())


if __name__ == "__main__":
    variant = sys.argv[1] if len(sys.argv) > 1 else "reg"
    mode = sys.argv[2] if len(sys.argv) > 2 else "interpret"
    gather = {"reg": gather_reg, "tma": gather_tma}[variant]
    q, kv, idx = inputs(n=512, k=BK)
    if mode == "interpret":
        s, g = build(gather, True)(q, kv, idx)
        rows = np.where(np.asarray(idx)[:, None] >= 0, np.asarray(kv, np.float32)[np.clip(np.asarray(idx), 0, None)], 0)
        err(f"[{variant}] gathered rows", g.astype(jnp.float32), rows)
        err(f"[{variant}] q @ rows^T", s, np.asarray(q, np.float32) @ rows.T)
        ok = np.asarray(idx) >= 0
        err(f"[{variant}] gathered rows, valid slots only", np.asarray(g.astype(jnp.float32))[ok], rows[ok])
        err(f"[{variant}] q @ rows^T, valid slots only", np.asarray(s)[:, ok], (np.asarray(q, np.float32) @ rows.T)[:, ok])
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from compile_util import compile_and_report
        compile_and_report(lambda q, kv, idx: build(gather, False)(q, kv, idx),
                           [((H, D_QK), jnp.bfloat16), ((8192, D_QK), jnp.bfloat16), ((BK,), jnp.int32)],
                           f"p1_{variant}")
