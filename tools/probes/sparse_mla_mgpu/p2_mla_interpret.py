"""Q2/Q3: run mla_fwd.sparse_mla_token in Mosaic GPU interpret mode on CPU and compare with a float64 numpy reference.
Usage: p2_mla_interpret.py MODE PV [nbuf] [o_via_q 0|1] [pv_acc add|run_state]   (MODE wg1|dup3|share3, PV smem|reg)"""
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np
import jax, jax.numpy as jnp
from common import inputs, reference, err
import mla_fwd

mode, pv = sys.argv[1], sys.argv[2]
nbuf = int(sys.argv[3]) if len(sys.argv) > 3 else 1
o_via_q = len(sys.argv) > 4 and sys.argv[4] == "1"
pv_acc = sys.argv[5] if len(sys.argv) > 5 else "add"
scale = 576 ** -0.5
q, kv, idx = inputs(n=1024, k=256, seed=1)
# one block entirely invalid except nothing (block 2 all -1) to exercise the -inf guard on a whole block
idx = idx.at[128:192].set(-1)
t0 = time.time()
out, lse = mla_fwd.sparse_mla_token(q, kv, idx, scale=scale, mode=mode, pv=pv, interpret=True, nbuf=nbuf,
                                    o_via_q=o_via_q, pv_acc=pv_acc)
out = np.asarray(out.astype(jnp.float32)); lse = np.asarray(lse)
ro, rl = reference(q, kv, idx, scale)
print(f"[{mode}/{pv}/nbuf={nbuf}/o_via_q={o_via_q}/pv_acc={pv_acc}] interpret run {time.time() - t0:.1f}s")
err(f"[{mode}/{pv}] out", out, ro)
err(f"[{mode}/{pv}] lse", lse, rl)
# and against the project's JAX reference (dsv32_jax.model.attention.sparse_mla)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from dsv32_jax.model.attention import sparse_mla
jo, jl = sparse_mla(q[None, None], kv[None], idx[None, None], scale, 512)
err(f"[{mode}/{pv}] out vs attention.sparse_mla", out, np.asarray(jo[0, 0].astype(jnp.float32)))
err(f"[{mode}/{pv}] lse vs attention.sparse_mla", lse, np.asarray(jl[0, 0]))
