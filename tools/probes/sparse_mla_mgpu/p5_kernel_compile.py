"""Deviceless sm_90a compile of pallas_kernels/sparse_mla_mgpu.sparse_mla_fwd (the kernel, not a probe).
Run via: ./cc.sh TAG p5_kernel_compile.py [N] [H] [K]"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax.numpy as jnp
from compile_util import compile_and_report
from dsv32_jax.kernels import sparse_mla_mgpu

n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
h = int(sys.argv[2]) if len(sys.argv) > 2 else 128
k = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
compile_and_report(lambda q, kv, idx: sparse_mla_mgpu.sparse_mla_fwd(q, kv, idx, scale=576 ** -0.5),
                   [((n, h, 576), jnp.bfloat16), ((8192, 576), jnp.bfloat16), ((n, k), jnp.int32)],
                   f"sparse_mla_mgpu/N={n}/H={h}/K={k}")
