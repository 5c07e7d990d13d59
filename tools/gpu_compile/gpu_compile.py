"""Deviceless compile of every Pallas GPU kernel for an H100 (sm_90a), on a machine with no GPU.

    make test-gpu-compile                     # builds .venv-cuda (jax[cuda13]) and runs --check on the CI subset
    .venv-cuda/bin/python tools/gpu_compile/gpu_compile.py --check [--subset ci|all] [--cases REGEX] [--jobs 2]
        [--json runs/gpu_compile.json] [--benchmarks BENCHMARKS.md]

How: `jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=<XLA's H100 target config>)`
gives an abstract H100; each case is traced and lowered with it as the default device (the Triton lowering reads
the compute capability from it) and compiled by XLA to sm_90a cubins. Each case runs in its own process with
  * XLA_FLAGS --xla_dump_to: the thunk sequence gives every kernel's grid, threads and shared memory;
  * XLA calling the ptxas binary (libnvptxcompiler / libnvjitlink off) through `ptxas_wrapper.sh`, which logs
    `ptxas -v` (registers, spills) and keeps the PTX (the MMA instructions actually emitted);
  * MOSAIC_GPU_DUMP_TO: Mosaic GPU kernels (compiled by jaxlib at lowering time) leave their PTX, ptxas report,
    SASS (when nvdisasm is on PATH), launch configuration and shared-memory scratch there.

Checks (--check; exit 1 when one fails): the case lowers and compiles; every kernel of it uses at most
SMEM_BUDGET bytes of shared memory (90% of the H100's 232,448 B per block) and spills at most SPILL_BUDGET bytes;
cases that claim an instruction (the FP8 indexer: e4m3 wgmma) show it in the PTX; cases that claim something of
one kernel show it there: an instruction (top-k's streaming pass: 16-byte vector loads, `ld.global.v4`) or a
register bound (the same pass: <= 128 registers at 256 threads, so two blocks share an SM). A case marked expect_fail
(a deliberately oversized tile) must FAIL one of those checks, which proves the checks can fail.

Subsets (--subset): "ci" = every case but the model's train step with mla_bwd="atomic" (about 100 s of a 2-core
CI's compile time; the atomic accumulation keeps its kernel-level claim, sparse_mla_bwd_atomic[prod,L=8192], in CI);
"all" (the default, `make gpu-compile-table`) = every case.

A compile proves the kernels are valid for the chip and fit its limits; it says nothing about speed or results.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import datetime
import glob
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TARGET_CONFIG = os.path.join(HERE, "h100_target_config.txtpb")  # XLA's GpuTargetConfigProto, "NVIDIA H100 80GB HBM3"
SMEM_PER_BLOCK = 232_448  # H100 opt-in maximum per block
SMEM_BUDGET = int(0.90 * SMEM_PER_BLOCK)
SPILL_BUDGET = 0  # bytes of spill stores + loads allowed per kernel at the default tiles
BEGIN, END = "<!-- gpu-compile:begin -->", "<!-- gpu-compile:end -->"


# ------------------------------------------------------------------------------------------------- the cases
@dataclasses.dataclass(frozen=True)
class Shapes:
    name: str
    queries: int
    heads: int
    d_qk: int
    d_v: int
    topk: int
    index_heads: int
    index_dim: int
    keys: tuple[int, ...]
    q_chunk: int


PROD = Shapes("prod", queries=4096, heads=128, d_qk=576, d_v=512, topk=2048, index_heads=64, index_dim=128,
              keys=(8192, 131072), q_chunk=256)
TINY = Shapes("tiny", queries=16, heads=4, d_qk=40, d_v=32, topk=8, index_heads=4, index_dim=128, keys=(64,),
              q_chunk=8)  # the tiny test model (4 heads, kv_lora_rank 32 + rope 8, top-8) with its fp8 indexer
#                          test's 4 x 128 indexer (the Hadamard kernel rotates 128-dim rows)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    op: str
    shapes: str
    keys: int
    options: tuple = ()  # (key, value) pairs passed to the builder
    requires: tuple = ()  # regexes that must match the PTX of the case
    kernel_requires: tuple = ()  # (kernel name regex, instruction regex): every matching kernel shows the instruction
    max_registers: tuple = ()  # (kernel name regex, n): every matching kernel uses at most n registers
    kernel_forbids: tuple = ()  # (kernel name regex, instruction regex): no matching kernel shows the instruction
    smem_budget: int | None = None  # bytes of shared memory per kernel (None: SMEM_BUDGET)
    expect_fail: bool = False
    ci: bool = True  # in the CI subset (--subset ci, `make test-gpu-compile`)

    def opts(self):
        return dict(self.options)


# The top-k streaming pass at production shapes: unmasked full blocks load 16 bytes per instruction, and 113 of 128
# registers at 256 threads leave room for a second block on each SM (65,536 registers).
TOPK_CLAIMS = {"prod": dict(kernel_requires=(("_filter_kernel", r"ld\.global\S*\.v4"),),
                            max_registers=(("_filter_kernel", 128),))}


# The backward without recomputation at production shapes: both kernels on wgmma, none on mma.sync.
STORED_BWD_CLAIMS = {"prod": dict(kernel_requires=(("_pds_kernel", r"wgmma\.mma_async"),
                                                   ("_dqkv_kernel", r"wgmma\.mma_async")),
                                  kernel_forbids=(("_pds_kernel|_dqkv_kernel", r"mma\.sync"),))}


# bwd="atomic": the stored backward with the dkv rows added into the fp32 accumulator by the second kernel
# (global fp32 atomics of relaxed order: acquire-release ones cost a GPU-wide MEMBAR and an L1 invalidation each),
# no partials written.
ATOMIC_BWD_CLAIMS = {"prod": dict(kernel_requires=(*STORED_BWD_CLAIMS["prod"]["kernel_requires"],
                                                   ("_dqkv_kernel", r"(red|atom)\.global\S*\.relaxed\S*\.add\S*\.f32")),
                                  kernel_forbids=STORED_BWD_CLAIMS["prod"]["kernel_forbids"])}


def all_cases() -> list[Case]:
    cases = []
    for sh in (PROD, TINY):
        big = sh.keys[-1]
        for l in sh.keys:
            cases.append(Case(f"indexer_logits[{sh.name},L={l}]", "indexer_logits", sh.name, l,
                              requires=(r"wgmma\.mma_async\S*\.e4m3\.e4m3",)))
        cases += [
            Case(f"hadamard_quant[{sh.name},L={big}]", "hadamard_quant", sh.name, big),
            Case(f"indexer_logits_triton[{sh.name},L={sh.keys[0]}]", "indexer_logits_triton", sh.name, sh.keys[0]),
            Case(f"topk[{sh.name},L={big}]", "topk", sh.name, big, **TOPK_CLAIMS.get(sh.name, {})),
            Case(f"indexer_topk[{sh.name},L={sh.keys[0]}]", "indexer_topk", sh.name, sh.keys[0],
                 requires=(r"wgmma\.mma_async\S*\.e4m3\.e4m3",)),
            Case(f"sparse_mla_fwd[{sh.name},L={sh.keys[0]}]", "sparse_mla_fwd", sh.name, sh.keys[0]),
            Case(f"sparse_mla_probs[{sh.name},L={sh.keys[0]}]", "sparse_mla_probs", sh.name, sh.keys[0]),
            Case(f"sparse_mla_bwd[{sh.name},L={sh.keys[0]}]", "sparse_mla_bwd", sh.name, sh.keys[0],
                 options=(("bwd", "recompute"),)),
            Case(f"sparse_mla_bwd_stored[{sh.name},L={sh.keys[0]}]", "sparse_mla_bwd", sh.name, sh.keys[0],
                 options=(("bwd", "stored"),), **STORED_BWD_CLAIMS.get(sh.name, {})),
            Case(f"sparse_mla_bwd_atomic[{sh.name},L={sh.keys[0]}]", "sparse_mla_bwd", sh.name, sh.keys[0],
                 options=(("bwd", "atomic"),), **ATOMIC_BWD_CLAIMS.get(sh.name, {})),
        ]
    # Issue 31 item 4: the FP8 indexer with chunks of 8 key blocks per program (queries loaded once, the key blocks
    # through a double-buffered TMA pipeline), still on FP8 wgmma, and small enough for two CTAs per SM (233,472 B
    # of shared memory per SM, 1 KiB reserved per CTA) like the one-block kernel.
    cases.append(Case("indexer_logits_kloop[prod,L=8192,k_steps=8]", "indexer_logits", "prod", 8192,
                      options=(("k_steps", 8),), requires=(r"wgmma\.mma_async\S*\.e4m3\.e4m3",),
                      smem_budget=(233_472 - 2 * 1024) // 2))
    # Issue 31 item 2's producer: selected rows gathered by 16-byte cp.async into the swizzled layout wgmma reads,
    # then QK^T for 64 keys at once (N = 64), in one warpgroup and warp-specialized (producer + consumer).
    for form in ("", "_ws"):
        cases.append(Case(f"gather_producer{form}[prod,L=8192]", "gather_producer", "prod", 8192,
                          options=(("ws", form == "_ws"),),
                          requires=(r"cp\.async\.cg\.shared\.global", r"fence\.proxy\.async\.shared::cta",
                                    r"wgmma\.mma_async\S*m64n64k16\S*bf16", r"sass:LDGSTS\.\S*128",
                                    r"sass:HGMMA\.64x64x16")))
    # Issue 31 item 2's forward (impl="mosaic_gpu"): two warpgroups gathering by cp.async, S on wgmma N = 32 per
    # warpgroup (64 keys per CTA), PV on N = 256, no mma.sync, no spills. It uses the whole 227 KiB by design (q +
    # two 64 x 576 key blocks + P: FlashMLA's budget), so its budget is the H100's per-block maximum, not 90%.
    cases.append(Case("sparse_mla_fwd_mgpu[prod,L=8192]", "sparse_mla_fwd", "prod", 8192,
                      options=(("impl", "mosaic_gpu"),), smem_budget=SMEM_PER_BLOCK,
                      requires=(r"cp\.async\.cg\.shared\.global", r"wgmma\.mma_async\S*m64n32k16\S*bf16",
                                r"wgmma\.mma_async\S*m64n256k16\S*bf16", r"sass:LDGSTS\.\S*128",
                                r"sass:HGMMA\.64x256x16", r"sass:HGMMA\.64x32x16"),
                      kernel_forbids=(("mosaic", r"mma\.sync"),), max_registers=(("mosaic", 232),)))  # 213 measured
    # ... its ping-pong form (fwd="mosaic_gpu_pingpong", issue 31 item 2's "N >= 64 for QK^T"): a key block per
    # warpgroup, S on wgmma N = 64 (m64n32k16 must not appear), PV on N = 256, each block refilled by cp.async in
    # two parts; q + two 64 x 512 value blocks + two 64 x 64 rope / P tiles.
    cases.append(Case("sparse_mla_fwd_mgpu_pingpong[prod,L=8192]", "sparse_mla_fwd", "prod", 8192,
                      options=(("impl", "mosaic_gpu"), ("fwd", "mosaic_gpu_pingpong")), smem_budget=SMEM_PER_BLOCK,
                      requires=(r"cp\.async\.cg\.shared\.global", r"wgmma\.mma_async\S*m64n64k16\S*bf16",
                                r"wgmma\.mma_async\S*m64n256k16\S*bf16", r"sass:LDGSTS\.\S*128",
                                r"sass:HGMMA\.64x256x16", r"sass:HGMMA\.64x64x16"),
                      kernel_forbids=(("mosaic", r"mma\.sync"), ("mosaic", r"m64n32k16")),
                      max_registers=(("mosaic", 232),)))  # 212 measured
    # ... and its keys-as-M form for 32 heads per device (the 671B recipe's tensor:4; 16 heads are padded to 32):
    # one warpgroup, S^T = K q^T on wgmma N = 32, the softmax over keys across its 4 warps, O^T = V^T P^T with V^T
    # read transposed from shared memory, the key blocks double-buffered by cp.async.
    cases.append(Case("sparse_mla_fwd_mgpu[prod,L=8192,heads=32]", "sparse_mla_fwd", "prod", 8192,
                      options=(("impl", "mosaic_gpu"), ("heads", 32)), smem_budget=SMEM_PER_BLOCK,
                      requires=(r"cp\.async\.cg\.shared\.global", r"wgmma\.mma_async\S*m64n32k16\S*bf16",
                                r"sass:LDGSTS\.\S*128", r"sass:HGMMA\.64x32x16"),
                      kernel_forbids=(("mosaic", r"mma\.sync"),)))
    # Issue 31 item 3's P / dS kernel (the stored backward's first kernel) in Mosaic GPU: both warpgroups gather by
    # cp.async, S and dP on wgmma N = 32 per warpgroup, no mma.sync, no spills; q + dO + one key block + staging.
    cases.append(Case("sparse_mla_pds_mgpu[prod,L=8192]", "sparse_mla_pds_mgpu", "prod", 8192,
                      smem_budget=SMEM_PER_BLOCK,
                      requires=(r"cp\.async\.cg\.shared\.global", r"wgmma\.mma_async\S*m64n32k16\S*bf16",
                                r"sass:LDGSTS\.\S*128", r"sass:HGMMA\.64x32x16"),
                      kernel_forbids=(("mosaic", r"mma\.sync"),)))
    # ... and its keys-as-M form for 32 heads per device: one warpgroup, S^T and dP^T on wgmma N = 32, P^T and dS^T
    # stored through transposed views of the staging tiles, the key blocks double-buffered by cp.async.
    cases.append(Case("sparse_mla_pds_mgpu[prod,L=8192,heads=32]", "sparse_mla_pds_mgpu", "prod", 8192,
                      options=(("heads", 32),), smem_budget=SMEM_PER_BLOCK,
                      requires=(r"cp\.async\.cg\.shared\.global", r"wgmma\.mma_async\S*m64n32k16\S*bf16",
                                r"sass:LDGSTS\.\S*128", r"sass:HGMMA\.64x32x16"),
                      kernel_forbids=(("mosaic", r"mma\.sync"),)))
    # Issue 31 item 3's dq / dkv kernel (the stored backward's second kernel) in Mosaic GPU: two ping-pong
    # warpgroups, the selected rows' slice gathered by cp.async, dS^T q + P^T dO and dS K on wgmma N = 64.
    cases.append(Case("sparse_mla_dqkv_mgpu[prod,L=8192]", "sparse_mla_dqkv_mgpu", "prod", 8192,
                      smem_budget=SMEM_PER_BLOCK,
                      requires=(r"cp\.async\.cg\.shared\.global", r"wgmma\.mma_async\S*m64n64k16\S*bf16",
                                r"sass:LDGSTS\.\S*128", r"sass:HGMMA\.64x64x16"),
                      kernel_forbids=(("mosaic", r"mma\.sync"),)))
    # ... at 32 heads per device: dq^T = k^T dS^T (wgmma M = the 64 columns, N = the 32 heads), dS^T q + P^T dO
    # with K = 32 heads, dq^T stored through a transposed view.
    cases.append(Case("sparse_mla_dqkv_mgpu[prod,L=8192,heads=32]", "sparse_mla_dqkv_mgpu", "prod", 8192,
                      options=(("heads", 32),), smem_budget=SMEM_PER_BLOCK,
                      requires=(r"cp\.async\.cg\.shared\.global", r"wgmma\.mma_async\S*m64n32k16\S*bf16",
                                r"wgmma\.mma_async\S*m64n64k16\S*bf16", r"sass:LDGSTS\.\S*128",
                                r"sass:HGMMA\.64x32x16", r"sass:HGMMA\.64x64x16"),
                      kernel_forbids=(("mosaic", r"mma\.sync"),)))
    # The triage's echo kernels (bench/mgpu_triage.py, target echo): each Mosaic GPU kernel's gather as the kernel
    # issues it (the same inline cp.async body, buffers and transforms), its buffers stored back by TMA.
    for form in ("split", "block", "pingpong", "slice", "slice32"):
        cases.append(Case(f"gather_echo[prod,L=8192,{form}]", "gather_echo", "prod", 8192, options=(("form", form),),
                          requires=(r"cp\.async\.cg\.shared\.global", r"sass:LDGSTS\.\S*128")))
    # Every op under jax.vmap over 2 slices (pallas_kernels/_vmap folds the mapped axis into the kernels' rows; the
    # Mosaic kernels' batched blocks are not needed): top-k, the Hadamard quantizer, the FP8 indexer (Mosaic GPU),
    # the Mosaic GPU sparse MLA forward and the gradient through the stored backward.
    cases.append(Case("vmap[prod,L=8192]", "vmap", "prod", 8192, smem_budget=SMEM_PER_BLOCK,
                      requires=(r"sass:HGMMA\.64x256x16", r"wgmma\.mma_async\S*\.e4m3\.e4m3"),
                      kernel_requires=STORED_BWD_CLAIMS["prod"]["kernel_requires"],
                      kernel_forbids=(("mosaic", r"mma\.sync"),)))
    # The whole model with attention="kernel" (fp8 indexer -> top-k -> sparse MLA, eq. 4 KL), loss + gradients.
    cases.append(Case("model_kernel_train_step[tiny,T=64]", "model_kernel", "tiny", 64,
                      requires=(r"wgmma\.mma_async\S*\.e4m3\.e4m3",)))
    # ... with mla_bwd="atomic": the model's gradient step reaches the in-place dkv accumulation (relaxed atomics)
    cases.append(Case("model_kernel_train_step[tiny,T=64,mla_bwd=atomic]", "model_kernel", "tiny", 64,
                      options=(("mla_bwd", "atomic"),), requires=(r"wgmma\.mma_async\S*\.e4m3\.e4m3",),
                      kernel_requires=(("_dqkv_kernel", r"red\.global\S*\.relaxed\S*\.add\S*\.f32"),), ci=False))
    # The checks must be able to fail: a 128 x 128 forward tile does not fit the H100's shared memory (the compile
    # fails); 64 x 64 (the former default) compiles but needs 95% of it and spills; 4 warps spill.
    cases += [
        Case("sparse_mla_fwd[prod,L=8192,block 128x128: oversized]", "sparse_mla_fwd", "prod", 8192,
             options=(("block_h", 128), ("block_i", 128)), expect_fail=True),
        Case("sparse_mla_fwd[prod,L=8192,block 64x64: over budget]", "sparse_mla_fwd", "prod", 8192,
             options=(("block_h", 64), ("block_i", 64)), expect_fail=True),
        Case("sparse_mla_bwd[prod,L=8192,num_warps 4: spills]", "sparse_mla_bwd", "prod", 8192,
             options=(("num_warps", 4), ("bwd", "recompute")), expect_fail=True),
    ]
    return cases


# --sweep: the sparse MLA Triton forward (sparse_mla's block_h / block_i / num_warps / num_stages) and the stored
# backward's two kernels (sparse_mla.StoredTiles) at every candidate tile, each kernel compiled alone at the
# production shapes so that one kernel's failure does not hide the other's facts. What fits (compiles, shared
# memory within the per-block maximum, no spills, no mma.sync) goes into the sweep file, which
# bench/kernels.py --tile_sweep times on a chip.
SWEEP_FWD = [dict(block_h=h, block_i=i, num_warps=w, num_stages=st)
             for h in (32, 64) for i in (16, 32, 64) for w in (4, 8) for st in (1, 2, 3)]
SWEEP_PDS = [dict(pds_slots=s, pds_warps=w, pds_stages=st) for s in (16, 32, 64) for w in (4, 8) for st in (1, 2, 3)]
SWEEP_DQKV = [dict(dqkv_slots=s, dqkv_slice=c, dqkv_warps=w, dqkv_stages=st)
              for s in (32, 64, 128) for c in (32, 64) for w in (4, 8) for st in (1, 2, 3)]


SWEEPS = {"fwd": SWEEP_FWD, "pds": SWEEP_PDS, "dqkv": SWEEP_DQKV}


def sweep_cases() -> list[Case]:
    cases = []
    for kernel, grid in SWEEPS.items():
        for tiles in grid:
            label = ",".join(f"{k}={v}" for k, v in tiles.items())
            cases.append(Case(f"tile_sweep[{kernel}:{label}]", "sweep_kernel", "prod", 8192,
                              options=(("kernel", kernel), ("tiles", tuple(tiles.items()))),
                              smem_budget=SMEM_PER_BLOCK,
                              kernel_forbids=((f"_{kernel}_kernel", r"mma\.sync"),)))
    return cases


def sweep_summary(records: list[dict], cases: list[Case]) -> dict:
    """The sweep file: per kernel, each candidate's tiles, resources and whether it fits (the case's checks)."""
    import jax
    out = {"generated": f"tools/gpu_compile --sweep on {datetime.date.today()}, jax {jax.__version__}, sm_90a "
                        "(no GPU: XLA's H100 target config), production shapes (H 128, Dqk 576, d_v 512, k 2048)",
           **{kernel: [] for kernel in SWEEPS}}
    for case, rec in zip(cases, records):
        o = case.opts()
        ks = [k for k in rec["kernels"] if k["name"].startswith(f"_{o['kernel']}_kernel")]
        k = ks[0] if ks else {}
        out[o["kernel"]].append(dict(tiles=dict(o["tiles"]), fits=rec["ok"], smem=k.get("smem"),
                                     registers=k.get("registers"), spill_bytes=k.get("spill_bytes"),
                                     mma=sorted(k.get("mma", {})), why="; ".join(rec["failures"])[:300]))
    return out


def build(case: Case):
    """(fn, arg specs) of a case, for the abstract H100."""
    import jax
    import jax.numpy as jnp

    from dsv32_jax import kernels as pk
    il = importlib.import_module("dsv32_jax.kernels.indexer_logits")

    dev = h100()
    sh = {"prod": PROD, "tiny": TINY}[case.shapes]

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(dev))

    t, l, o = sh.queries, case.keys, case.opts()
    if case.op == "model_kernel":
        return model_kernel_step(l, spec, **o)
    f8 = jnp.float8_e4m3fn
    if case.op == "vmap":
        return vmap_ops(sh, l, spec)
    if case.op == "hadamard_quant":  # the kernel rotates 128-dim rows (the production indexer head dim)
        return (lambda x: pk.hadamard_quant(x, impl="pallas_gpu")), [spec((1, l, 128), jnp.bfloat16)]
    if case.op in ("indexer_logits", "indexer_logits_triton"):
        args = [spec((1, t, sh.index_heads, sh.index_dim), f8), spec((1, l, sh.index_dim), f8),
                spec((1, l), jnp.float32), spec((1, t, sh.index_heads), jnp.float32), spec((1, t), jnp.int32),
                spec((1, t), jnp.int32)]
        if case.op == "indexer_logits":
            return (lambda q, k, ks, w, st, en: pk.indexer_logits(q, k, ks, w, starts=st, ends=en,
                                                                   impl="pallas_gpu", **o)), args
        return (lambda q, k, ks, w, st, en: il._indexer_logits_pallas(
            q, k, ks, w, st, en, out_dtype=jnp.float32, block_q=2, block_k=128, backend="pallas_gpu", num_warps=4,
            num_stages=3)), args
    if case.op == "topk":
        return (lambda x: pk.topk(x, min(sh.topk, l), impl="pallas_gpu")), [spec((t, l), jnp.float32)]
    if case.op == "indexer_topk":
        def fn(q, k, w, qi, seg):
            return pk.indexer_topk(q, k, w, qi, seg[:, :t], seg, sh.topk, fp8=True, q_chunk=sh.q_chunk,
                                   impl="pallas_gpu")
        return fn, [spec((1, t, sh.index_heads, sh.index_dim), jnp.bfloat16),
                    spec((1, l, sh.index_dim), jnp.bfloat16), spec((1, t, sh.index_heads), jnp.float32),
                    spec((1, t), jnp.int32), spec((1, l), jnp.int32)]
    if case.op == "gather_producer":  # one 64-head x 64-key block of the production shapes
        gm = importlib.import_module("dsv32_jax.kernels.gather_mgpu")
        return (gm.gather_qk_ws if o.get("ws") else gm.gather_qk), [
            spec((64, sh.d_qk), jnp.bfloat16), spec((l, sh.d_qk), jnp.bfloat16), spec((64,), jnp.int32)]
    if case.op == "gather_echo":  # 64 tokens' production selections
        ge = importlib.import_module("dsv32_jax.kernels.gather_echo_mgpu")
        return (lambda kv, i: ge.gather_echo(kv, i, form=o["form"])), [spec((l, sh.d_qk), jnp.bfloat16),
                                                                        spec((64, sh.topk), jnp.int32)]
    if case.op == "sweep_kernel" and o["kernel"] == "fwd":  # the forward at a candidate tile (--sweep)
        return (lambda q, kv, i: pk.sparse_mla(q, kv, i, sh.d_qk ** -0.5, sh.d_v, impl="pallas_gpu",
                                               **dict(o["tiles"]))), [
            spec((1, t, sh.heads, sh.d_qk), jnp.bfloat16), spec((1, l, sh.d_qk), jnp.bfloat16),
            spec((1, t, sh.topk), jnp.int32)]
    if case.op == "sweep_kernel":  # one kernel of the stored backward at a candidate tile (--sweep)
        smla = importlib.import_module("dsv32_jax.kernels.sparse_mla")
        n, kp, hp, dp = 512, sh.topk, sh.heads, sh.d_qk  # 512 tokens: a chunk of the backward's scan
        cfg = smla.default_config(spec((1, n, hp, dp), jnp.bfloat16), spec((1, l, dp), jnp.bfloat16),
                                  spec((1, n, kp), jnp.int32), sh.d_qk ** -0.5, sh.d_v, "pallas_gpu",
                                  stored_tiles=pk.StoredTiles(**dict(o["tiles"])))
        args = [spec((n, hp, dp), jnp.bfloat16), spec((l, dp), jnp.bfloat16), spec((n, kp), jnp.int32),
                spec((n, hp, cfg.dv_p), jnp.bfloat16)]
        if o["kernel"] == "pds":
            return (lambda *a: smla._pds(*a, cfg)), args + [spec((n, hp), jnp.float32)] * 2
        return (lambda *a: smla._dqkv(*a, cfg, jnp.bfloat16)), args + [spec((n, hp, kp), jnp.bfloat16)] * 2
    if case.op == "sparse_mla_pds_mgpu":  # the stored backward's P / dS kernel in Mosaic GPU, flattened tokens
        pm = importlib.import_module("dsv32_jax.kernels.sparse_mla_pds_mgpu")
        h = o.get("heads", sh.heads)
        return (lambda q, do, kv, i, lse, dl: pm.sparse_mla_pds(q, do, kv, i, lse, dl, scale=sh.d_qk ** -0.5)), [
            spec((t, h, sh.d_qk), jnp.bfloat16), spec((t, h, sh.d_v), jnp.bfloat16),
            spec((l, sh.d_qk), jnp.bfloat16), spec((t, sh.topk), jnp.int32), spec((t, h), jnp.float32),
            spec((t, h), jnp.float32)]
    if case.op == "sparse_mla_dqkv_mgpu":  # the stored backward's dq / dkv kernel in Mosaic GPU, 512 tokens
        dm = importlib.import_module("dsv32_jax.kernels.sparse_mla_dqkv_mgpu")
        n, h = 512, o.get("heads", sh.heads)  # a chunk of the backward's scan
        return (lambda *a: dm.sparse_mla_dqkv(*a)), [
            spec((n, h, sh.d_qk), jnp.bfloat16), spec((n, h, sh.d_qk), jnp.bfloat16),
            spec((l, sh.d_qk), jnp.bfloat16), spec((n, sh.topk), jnp.int32),
            spec((n, h, sh.topk), jnp.bfloat16), spec((n, h, sh.topk), jnp.bfloat16)]
    heads = o.pop("heads", sh.heads)  # per device: the production 128 unless the case says (a tensor-sharded step)
    args = [spec((1, t, heads, sh.d_qk), jnp.bfloat16), spec((1, l, sh.d_qk), jnp.bfloat16),
            spec((1, t, sh.topk), jnp.int32)]
    scale = sh.d_qk ** -0.5
    if case.op == "sparse_mla_fwd":
        impl = o.pop("impl", "pallas_gpu")
        return (lambda q, kv, i: pk.sparse_mla(q, kv, i, scale, sh.d_v, impl=impl, **o)), args
    if case.op == "sparse_mla_probs":
        return (lambda q, kv, i: pk.sparse_mla(q, kv, i, scale, sh.d_v, return_probs=True, impl="pallas_gpu",
                                               **o)), args
    if case.op == "sparse_mla_bwd":
        def loss(q, kv, i):
            return pk.sparse_mla(q, kv, i, scale, sh.d_v, impl="pallas_gpu", **o)[0].astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1)), args
    raise SystemExit(f"unknown op {case.op!r}")


def vmap_ops(sh: Shapes, length: int, spec, v: int = 2, tokens: int = 256):
    """The "vmap" case: each op mapped over `v` slices of `tokens` queries."""
    import jax
    import jax.numpy as jnp

    from dsv32_jax import kernels as pk

    def fn(x, h, q8, k8, ks, w, q, kv, idx):
        def loss(q_, kv_, i_):
            return pk.sparse_mla(q_, kv_, i_, sh.d_qk ** -0.5, sh.d_v, impl="pallas_gpu")[0].astype(jnp.float32).sum()
        return (jax.vmap(lambda a: pk.topk(a, sh.topk, impl="pallas_gpu"))(x),
                jax.vmap(lambda a: pk.hadamard_quant(a, impl="pallas_gpu"))(h),
                jax.vmap(lambda *a: pk.indexer_logits(*a, impl="pallas_gpu"))(q8, k8, ks, w),
                jax.vmap(lambda *a: pk.sparse_mla(*a, sh.d_qk ** -0.5, sh.d_v, impl="mosaic_gpu")[0])(q, kv, idx),
                jax.vmap(jax.grad(loss, argnums=(0, 1)))(q, kv, idx))

    f8, bf16 = jnp.float8_e4m3fn, jnp.bfloat16
    return fn, [spec((v, tokens, length), jnp.float32), spec((v, length, sh.index_dim), bf16),
                spec((v, 1, tokens, sh.index_heads, sh.index_dim), f8), spec((v, 1, length, sh.index_dim), f8),
                spec((v, 1, length), jnp.float32), spec((v, 1, tokens, sh.index_heads), jnp.float32),
                spec((v, 1, tokens, sh.heads, sh.d_qk), bf16), spec((v, 1, length, sh.d_qk), bf16),
                spec((v, 1, tokens, sh.topk), jnp.int32)]


def model_kernel_step(length: int, spec, mla_bwd: str = "stored"):
    """Loss + gradients of the tiny model (indexer 4 x 128) on one sequence with RunOptions(attention="kernel",
    indexer_fp8=True, indexer_loss="sparse", mla_bwd=...): every op dispatched to its GPU kernel (set_default_impl)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv32_jax import kernels as pk
    from dsv32_jax.model.config import load_preset
    from dsv32_jax.model.transformer import Transformer
    from dsv32_jax.model.options import RunOptions
    from dsv32_jax.train.steps import LossWeights, lm_objective

    pk.set_default_impl("pallas_gpu")
    cfg = load_preset("tiny").replace(index_head_dim=128)
    opts = RunOptions(attention="kernel", indexer_fp8=True, indexer_loss="sparse", mla_bwd=mla_bwd)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), options=opts, dtype=jnp.bfloat16))
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: spec(x.shape, x.dtype), state)

    def step(state, tokens):
        def loss(state):
            batch = {"tokens": tokens, "targets": tokens, "positions": jnp.broadcast_to(jnp.arange(length),
                                                                                        tokens.shape),
                     "segment_ids": jnp.ones_like(tokens), "loss_mask": jnp.ones(tokens.shape, jnp.float32)}
            return lm_objective(nnx.merge(graphdef, state), batch, stage="sparse", weights=LossWeights(),
                                model_cfg=cfg)[0]
        return jax.grad(loss)(state)

    return step, [state, spec((1, length), jnp.int32)]


_H100 = None


def h100():
    global _H100
    if _H100 is None:
        from jax.experimental import topologies
        with open(TARGET_CONFIG) as f:
            topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=f.read())
        _H100 = topo.devices[0]
    return _H100


def compile_one(case: Case) -> dict:
    """Child process: trace, lower, compile; the facts that the dumps do not hold."""
    import jax
    rec = {"case": case.name}
    t0 = time.perf_counter()
    try:
        fn, args = build(case)
        with jax.default_device(h100()):
            lowered = jax.jit(fn).trace(*args).lower()
        rec["lower_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        compiled = lowered.compile()
        rec["compile_s"] = time.perf_counter() - t1
        ma = compiled.memory_analysis()
        rec["temp_bytes"] = int(ma.temp_size_in_bytes)
        rec["arg_bytes"] = int(ma.argument_size_in_bytes)
        rec["out_bytes"] = int(ma.output_size_in_bytes)
    except Exception as e:  # reported, and a failed check in the parent
        rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
    return rec


# ------------------------------------------------------------------------------------------------ the dumps
@dataclasses.dataclass
class Kernel:
    name: str
    backend: str  # "triton" (Pallas Triton), "mosaic" (Pallas Mosaic GPU), "xla" (XLA's own fusions)
    grid: tuple = ()
    threads: tuple = ()
    smem: int | None = None
    registers: int | None = None
    spill_bytes: int | None = None  # stores + loads
    mma: dict = dataclasses.field(default_factory=dict)  # tensor-core instruction -> count in the PTX
    # VLOAD matches in the PTX -> count: vector loads (ld.global.v2/v4/v8) and a gathering producer's cp.async /
    # proxy fences
    vector_loads: dict = dataclasses.field(default_factory=dict)


# XLA's thunk sequence, one kernel launch per line: "kKernel [...] NAME grid: [x,y,z] threads: [x,y,z] shared_memory: N"
# (jax <= 0.12.0) or "kCustomKernel [...] kernel=NAME, ... blocks: {x, y, z}, threads/block: {x, y, z}, ...,
# shmem_bytes=N" (jax 0.12.1)
THUNK = re.compile(r"(?:kCustomKernel|kKernel)\s.*?\]\s+(\S+)\s+grid:\s*\[([^\]]*)\]\s+threads:\s*\[([^\]]*)\]\s+"
                   r"shared_memory:\s*(\d+)")
THUNK_KV = re.compile(r"(?:kCustomKernel|kKernel)\s.*?\]\s+kernel=([^,\s]+),.*?blocks:\s*\{([^}]*)\},\s*"
                      r"threads/block:\s*\{([^}]*)\}.*?shmem_bytes=(\d+)")
XLA_NAME = re.compile(r"fusion|^(loop|input|wrapped|gemm|cutlass|cublas|triton_softmax|sort|scatter|reduce)_|"
                      r"^(copy|transpose|bitcast|sort|scatter)")
MMA = re.compile(r"\b((?:wgmma\.mma_async|mma\.sync)\.[\w.]+)")
# vector loads, the async-copy path of a gathering producer (per-thread cp.async + the proxy fence before wgmma),
# and global atomics / reductions (a kernel that accumulates into memory)
VLOAD = re.compile(r"\b(ld\.global(?:\.\w+)*?\.v[248]\.\w+|cp\.async\.c[ag]\.shared\.global|"
                   r"fence\.proxy\.async[\w:.]*|(?:red|atom)\.[\w:.]*global[\w:.]*)")


def parse_thunks(text: str) -> dict[str, dict]:
    """XLA's thunk sequence -> {kernel name: grid, threads, shared memory}."""
    out = {}
    for m in [*THUNK.finditer(text), *THUNK_KV.finditer(text)]:
        out[m.group(1)] = dict(grid=tuple(int(x) for x in m.group(2).split(",")),
                               threads=tuple(int(x) for x in m.group(3).split(",")), smem=int(m.group(4)))
    return out


def parse_ptxas(text: str) -> dict[str, dict]:
    """`ptxas -v` output -> {entry function: registers, spill bytes (stores + loads)}."""
    out, name = {}, None
    for line in text.splitlines():
        if "Registers are spilled" in line:  # a warning that names the function; the properties line follows
            continue
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            name = m.group(1)
            out[name] = {}
        elif name and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            out[name]["spill_bytes"] = int(m.group(1)) + int(m.group(2))
        elif name and (m := re.search(r"Used (\d+) registers", line)):
            out[name]["registers"] = int(m.group(1))
    return out


def parse_ptx(text: str, pattern: re.Pattern = MMA) -> dict[str, dict[str, int]]:
    """PTX -> {entry: {instruction matching `pattern` (default: tensor-core MMAs; VLOAD: vector loads): count}}."""
    out = {}
    for chunk in re.split(r"(?=\.(?:visible\s+)?\.?entry\s)", text):
        if m := re.match(r"\.(?:visible\s+)?\.?entry\s+(\w+)", chunk):
            counts = {}
            for ins in pattern.findall(chunk):
                counts[ins] = counts.get(ins, 0) + 1
            out[m.group(1)] = counts
    return out


def parse_mosaic_resources(text: str) -> int:
    """Mosaic GPU's Resources(...) dump -> shared memory bytes (scratch + 8 per mbarrier)."""
    scratch = int(re.search(r"smem_scratch_bytes=(\d+)", text).group(1))
    barriers = sum(int(n) * int(c) for n, c in re.findall(r"num_barriers=(\d+)[^)]*\):\s*(\d+)", text))
    return scratch + 8 * barriers


def parse_mosaic_launch(text: str) -> tuple[tuple, tuple]:
    m = re.search(r"gpu\.launch.*?blocks\([^)]*\) in \(([^)]*)\) threads\([^)]*\) in \(([^)]*)\)", text)
    if not m:
        return (), ()
    dims = [tuple(int(v) for v in re.findall(r"%c(\d+)", g)) for g in m.groups()]
    return dims[0], dims[1]


def collect(workdir: str) -> list[Kernel]:
    kernels: dict[str, Kernel] = {}
    thunks = {}
    for path in glob.glob(os.path.join(workdir, "xla", "*thunk_sequence.txt")):
        thunks.update(parse_thunks(open(path).read()))
    ptxas = {}
    for path in glob.glob(os.path.join(workdir, "ptxas.log.*")):
        ptxas.update(parse_ptxas(open(path).read()))
    ptx, vloads = {}, {}
    for path in glob.glob(os.path.join(workdir, "ptx_*.ptx")):
        text = open(path).read()
        ptx.update(parse_ptx(text))
        vloads.update(parse_ptx(text, VLOAD))
    for name, facts in thunks.items():
        backend = "xla" if XLA_NAME.search(name) else "triton"
        k = Kernel(name, backend, facts["grid"], facts["threads"], facts["smem"])
        k.registers = ptxas.get(name, {}).get("registers")
        k.spill_bytes = ptxas.get(name, {}).get("spill_bytes")
        k.mma = ptx.get(name, {})
        k.vector_loads = vloads.get(name, {})
        kernels[name] = k
    mdir = os.path.join(workdir, "mosaic")
    for i, res in enumerate(sorted(glob.glob(os.path.join(mdir, "*.resources.txt")))):
        base = res[: -len(".resources.txt")]
        k = Kernel(f"mosaic:{os.path.basename(base)}", "mosaic", smem=parse_mosaic_resources(open(res).read()))
        if os.path.exists(base + ".after_layout_inference.txt"):
            k.grid, k.threads = parse_mosaic_launch(open(base + ".after_layout_inference.txt").read())
        if not os.path.exists(base + ".ptx"):  # (with several Mosaic GPU kernels in one program, jaxlib numbers a
            # kernel's PTX / ptxas / SASS dumps apart from its resources and layout dumps: one of each name pairs)
            same = glob.glob(re.sub(r"_\d+$", "", base) + "_*.ptx")
            if len(same) == 1:
                base = same[0][: -len(".ptx")]
        if os.path.exists(base + ".ptxas"):
            facts = next(iter(parse_ptxas(open(base + ".ptxas").read()).values()), {})
            k.registers, k.spill_bytes = facts.get("registers"), facts.get("spill_bytes")
        if os.path.exists(base + ".ptx"):
            k.mma = {}
            text = open(base + ".ptx").read()
            for counts in parse_ptx(text).values():
                for ins, n in counts.items():
                    k.mma[ins] = k.mma.get(ins, 0) + n
            for counts in parse_ptx(text, VLOAD).values():
                for ins, n in counts.items():
                    k.vector_loads[ins] = k.vector_loads.get(ins, 0) + n
        for sass in glob.glob(base + ".sass*"):  # whole instruction tokens, counted once each (read once)
            with open(sass) as f:
                found = collections.Counter(re.findall(r"\b([QH]GMMA\.[\w.]+|LDGSTS\.[\w.]+)", f.read()))
            for ins, n in found.items():
                k.mma["sass:" + ins] = k.mma.get("sass:" + ins, 0) + n
        kernels[k.name] = k
    return list(kernels.values())


def check(case: Case, rec: dict, kernels: list[Kernel]) -> list[str]:
    """The reasons the case fails (empty: it passes)."""
    if "error" in rec:
        return [rec["error"].splitlines()[0][:300]]
    bad = []
    for k in kernels:
        budget = SMEM_BUDGET if case.smem_budget is None else case.smem_budget
        if k.smem is not None and k.smem > budget:
            share = round(100 * budget / SMEM_PER_BLOCK)
            bad.append(f"{k.name}: {k.smem} B shared memory > budget {budget} B ({share}% of {SMEM_PER_BLOCK})")
        if k.spill_bytes:
            if k.spill_bytes > SPILL_BUDGET:
                bad.append(f"{k.name}: spills {k.spill_bytes} B > budget {SPILL_BUDGET} B")
        if k.backend != "xla" and k.registers is None:
            bad.append(f"{k.name}: no ptxas report (is tools/gpu_compile/ptxas_wrapper.sh installed?)")
    ptx_ins = " ".join(ins for k in kernels for ins in [*k.mma, *k.vector_loads])
    for pattern in case.requires:
        if not re.search(pattern, ptx_ins):
            bad.append(f"no instruction matching {pattern!r} in the PTX (found: {sorted(set(ptx_ins.split()))})")
    def claimed(name_re):  # the kernels a claim names; a claim that names none fails
        matched = [k for k in kernels if re.search(name_re, k.name)]
        if not matched:
            bad.append(f"no kernel matching {name_re!r}")
        return matched

    for name_re, pattern in case.kernel_requires:
        for k in claimed(name_re):
            found = " ".join([*k.mma, *k.vector_loads])
            if not re.search(pattern, found):
                bad.append(f"{k.name}: no instruction matching {pattern!r} (found: {sorted(found.split())})")
    for name_re, pattern in case.kernel_forbids:
        for k in kernels:
            if re.search(name_re, k.name) and (found := [ins for ins in k.mma if re.search(pattern, ins)]):
                bad.append(f"{k.name}: {found[0]} matches the forbidden {pattern!r}")
    for name_re, limit in case.max_registers:
        for k in claimed(name_re):
            if k.registers is not None and k.registers > limit:
                bad.append(f"{k.name}: {k.registers} registers > {limit}")
    if not any(k.backend != "xla" for k in kernels):
        bad.append("no Pallas kernel in the compiled program")
    return bad


# ------------------------------------------------------------------------------------------------ the runner
def cuda_bin() -> str:
    import nvidia
    for base in nvidia.__path__:
        path = os.path.join(base, "cu13", "bin")
        if os.path.exists(os.path.join(path, "ptxas")):
            return path
    raise SystemExit("tools/gpu_compile: ptxas not found in the nvidia/cu13 wheels: install jax[cuda13] "
                     "(make venv-cuda)")


def run_case(case: Case, keep: str | None) -> dict:
    workdir = tempfile.mkdtemp(prefix="gpu_compile_")
    os.makedirs(os.path.join(workdir, "mosaic"))
    bin_dir = cuda_bin()
    if not os.path.exists(os.path.join(bin_dir, "ptxas.real")):
        raise SystemExit(f"tools/gpu_compile: {bin_dir}/ptxas is not the logging wrapper; run `make venv-cuda` "
                         "(it installs tools/gpu_compile/ptxas_wrapper.sh)")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PTXAS_LOG=os.path.join(workdir, "ptxas.log"),
               MOSAIC_GPU_DUMP_TO=os.path.join(workdir, "mosaic"), PATH=bin_dir + os.pathsep + os.environ["PATH"],
               XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""), "--xla_gpu_enable_libnvptxcompiler=false",
                                   "--xla_gpu_enable_libnvjitlink=false",
                                   f"--xla_dump_to={os.path.join(workdir, 'xla')}"]).strip())
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", json.dumps(dataclasses.asdict(case))],
                          env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    rec = json.loads(lines[-1]) if lines else {"case": case.name, "error": f"child exited {proc.returncode}: "
                                                                          f"{proc.stderr[-1500:]}"}
    rec["wall_s"] = wall
    kernels = collect(workdir)
    reasons = check(case, rec, kernels)
    rec.update(kernels=[dataclasses.asdict(k) for k in kernels], failures=reasons, expect_fail=case.expect_fail,
               ok=bool(reasons) == case.expect_fail)
    if keep:
        dst = os.path.join(keep, re.sub(r"[^\w.=-]+", "_", case.name))
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(workdir, dst, ignore=shutil.ignore_patterns("*.mlir-passes.log"))
    shutil.rmtree(workdir, ignore_errors=True)
    return rec


def fmt_dims(d) -> str:
    return "x".join(str(v) for v in d) if d else "-"


def table(records: list[dict]) -> str:
    head = ("| case | kernel | grid | threads | smem (B, % of 232,448) | registers | spills (B) | tensor-core "
            "instructions (PTX / SASS); vector loads | compile (s) | status |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    rows = [head]
    for rec in records:
        status = ("expected failure: " + "; ".join(rec["failures"])[:160]) if rec["expect_fail"] else (
            "ok" if rec["ok"] else "FAIL: " + "; ".join(rec["failures"])[:200])
        if rec["expect_fail"] and not rec["ok"]:
            status = "FAIL: the oversized tile passed the checks"
        ks = [k for k in rec["kernels"] if k["backend"] != "xla"] or [None]
        for i, k in enumerate(ks):
            if k is None:
                rows.append(f"| {rec['case']} | - | | | | | | | {rec.get('compile_s', 0):.1f} | {status} |")
                continue
            mma = ", ".join(f"{ins} x{n}" for ins, n in sorted(k["mma"].items())) or "-"
            if k.get("vector_loads"):
                mma += "; " + ", ".join(f"{ins} x{n}" for ins, n in sorted(k["vector_loads"].items()))
            smem = f"{k['smem']:,} ({100 * k['smem'] / SMEM_PER_BLOCK:.0f}%)" if k["smem"] is not None else "-"
            rows.append(f"| {rec['case'] if i == 0 else ''} | {k['name']} ({k['backend']}) | {fmt_dims(k['grid'])} "
                        f"| {fmt_dims(k['threads'])} | {smem} | {k['registers']} | {k['spill_bytes']} | {mma} | "
                        f"{rec.get('compile_s', 0):.1f} | {status if i == 0 else ''} |")
    return "\n".join(rows)


def update_benchmarks(path: str, records: list[dict]) -> None:
    import jax
    text = open(path).read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} section to replace")
    stamp = (f"Generated by `make test-gpu-compile` on {datetime.date.today()} (jax {jax.__version__}, "
             f"jax-cuda13-plugin, ptxas from nvidia-cuda-nvcc; no GPU: XLA's H100 target config). Budgets: shared "
             f"memory <= {SMEM_BUDGET:,} B (90%), spills <= {SPILL_BUDGET} B.")
    block = f"{BEGIN}\n{stamp}\n\n{table(records)}\n{END}"
    new = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a case fails its checks")
    p.add_argument("--cases", default="", help="regex: run the cases whose name matches")
    p.add_argument("--subset", default="all", choices=("ci", "all"), help="ci: the cases CI compiles (Case.ci)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default="", help="write the records here")
    p.add_argument("--benchmarks", default="", help="replace the gpu-compile section of this file (BENCHMARKS.md)")
    p.add_argument("--keep", default="", help="keep each case's dumps under this directory")
    p.add_argument("--list", action="store_true")
    p.add_argument("--sweep", default="", help="compile the sparse MLA forward's and the stored backward's kernels at "
                   "every candidate tile "
                   "instead of the cases, and write what fits to this JSON file (bench/kernels.py --tile_sweep)")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        nested = ("options", "kernel_requires", "max_registers", "kernel_forbids")
        print(json.dumps(compile_one(Case(**{k: tuple(map(tuple, v)) if k in nested else
                                             tuple(v) if isinstance(v, list) else v
                                             for k, v in json.loads(a.one).items()}))))
        return 0
    cases = [c for c in (sweep_cases() if a.sweep else all_cases())
             if re.search(a.cases, c.name) and (a.subset == "all" or c.ci)]
    if a.list:
        print("\n".join(c.name for c in cases))
        return 0
    if not cases:
        raise SystemExit(f"--subset={a.subset} --cases={a.cases!r} match no case (see --list)")
    records = []
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        for rec in pool.map(lambda c: run_case(c, a.keep or None), cases):
            records.append(rec)
            ks = [k for k in rec["kernels"] if k["backend"] != "xla"]
            facts = "; ".join(f"{k['name']} smem={k['smem']} regs={k['registers']} spills={k['spill_bytes']} "
                              f"mma={sorted(k['mma'])}" for k in ks)
            print(f"[{'ok' if rec['ok'] else 'FAIL'}] {rec['case']}  compile {rec.get('compile_s', 0):.1f}s  {facts}"
                  + (f"\n    failures: {rec['failures']}" if rec["failures"] else ""), flush=True)
    print("\n" + table(records))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
    if a.benchmarks:
        update_benchmarks(a.benchmarks, records)
    if a.sweep:
        summary = sweep_summary(records, cases)
        tmp = a.sweep + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(tmp, a.sweep)
        for kernel in SWEEPS:
            fit = sum(c["fits"] for c in summary[kernel])
            print(f"{kernel}: {fit} of {len(summary[kernel])} candidate tiles fit", flush=True)
    failed = [r["case"] for r in records if not r["ok"]]
    print(f"\n{len(records) - len(failed)}/{len(records)} cases ok" + (f"; failed: {failed}" if failed else ""))
    return 1 if (a.check and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
