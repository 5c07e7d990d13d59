"""Control: does jax's own FA3 example (jax.experimental.pallas.ops.gpu.attention_mgpu, 3 warpgroups with
set_max_registers 232/40) also get ptxas C7504 ('setmaxnreg' ignored) in the deviceless compile?"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention_mgpu as am
from compile_util import compile_and_report
cfg = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)
compile_and_report(lambda q, k, v: am._attention_forward(q, k, v, cfg),
                   [((1, 1024, 4, 128), jnp.float16)] * 3, "fa3_upstream")
