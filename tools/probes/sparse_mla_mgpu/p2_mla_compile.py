"""Deviceless sm_90a compile of mla_fwd.sparse_mla_token with the inline_mgpu cp.async gather (gather_mgpu.py).
Run via: ./cc.sh TAG p2_mla_compile.py MODE PV [nbuf] [o_via_q 0|1] [pv_acc run_state|add] [maxreg 0|1] [K]"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax.numpy as jnp
import mla_fwd
from compile_util import compile_and_report

mode, pv = sys.argv[1], sys.argv[2]
nbuf = int(sys.argv[3]) if len(sys.argv) > 3 else 1
o_via_q = len(sys.argv) > 4 and sys.argv[4] == "1"
pv_acc = sys.argv[5] if len(sys.argv) > 5 else "run_state"
maxreg = not (len(sys.argv) > 6 and sys.argv[6] == "0")
k = int(sys.argv[7]) if len(sys.argv) > 7 else 2048
gather = mla_fwd.gather_cp_async(sync_warpgroup=(mode == "wg1"))
tag = f"{mode}/{pv}/nbuf={nbuf}/o_via_q={int(o_via_q)}/{pv_acc}/maxreg={int(maxreg)}/K={k}"
compile_and_report(lambda q, kv, idx: mla_fwd.sparse_mla_token(q, kv, idx, scale=576 ** -0.5, mode=mode, pv=pv,
                                                               gather=gather, nbuf=nbuf, o_via_q=o_via_q,
                                                               pv_acc=pv_acc, maxreg=maxreg),
                   [((64, 576), jnp.bfloat16), ((8192, 576), jnp.bfloat16), ((k,), jnp.int32)], tag)
