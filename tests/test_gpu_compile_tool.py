"""The deviceless H100 compile check (tools/gpu_compile/gpu_compile.py, `make test-gpu-compile`): its parsers of
XLA's thunk sequence, `ptxas -v`, PTX and Mosaic GPU dumps, and its budget checks. The compile itself needs
jax[cuda13] and runs in its own make target / CI step; these tests pin what it reads and how it judges."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "gpu_compile"))
import gpu_compile as gc  # noqa: E402

THUNKS = """\
001: kCustomKernel [source       | next=002 (1)] loop_select_fusion grid: [16384, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
002: kCustomKernel [prev=001 (1) | sink        ] _fwd_kernel grid: [4096, 2, 1] threads: [256, 1, 1]  shared_memory: 221440 bytes
012: kWhile        [prev=011 (1) | sink         ]
    023: kCustomKernel [prev=022 (1) | next=024 (1)] _bracket_kernel grid: [8, 1, 1] threads: [256, 1, 1]  shared_memory: 1024 bytes
"""

PTXAS = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'loop_select_fusion' for 'sm_90a'
ptxas info    : Function properties for loop_select_fusion
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 14 registers, used 0 barriers
ptxas warning : Registers are spilled to local memory in function '_fwd_kernel', 120 bytes spill stores, 120 bytes spill loads
ptxas info    : Compiling entry function '_fwd_kernel' for 'sm_90a'
ptxas info    : Function properties for _fwd_kernel
    120 bytes stack frame, 120 bytes spill stores, 120 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 120 bytes cumulative stack size
"""

PTX = """\
.target sm_90a
.visible .entry anonymous_mosaic_gpu_kernel(
\twgmma.fence.sync.aligned;
\t{ .reg .pred p; wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%r1}, %rd22, %rd23, p, 1, 1; }
\t{ .reg .pred p; wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%r1}, %rd24, %rd25, p, 1, 1; }
}
.visible .entry _kernel(
\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f2};
}
"""


# jax 0.12.1's thunk sequence (from a topk[tiny] dump, 2026-12-06): the old format found no kernel in it
THUNKS_KV = """\
001: kCustomKernel [source       | next=002 (1)] kernel=loop_broadcast_fusion, profile_annotation=loop_broadcast_fusion, launch dimensions=blocks: {1, 1, 1}, threads/block: {16, 1, 1}, cluster_dim=nullopt, shmem_bytes=0, use_pdl=true
002: kCustomKernel [prev=001 (1) | next=003 (1)] kernel=_filter_kernel, profile_annotation=pallas_call.0, launch dimensions=blocks: {16, 2, 1}, threads/block: {256, 1, 1}, cluster_dim=nullopt, shmem_bytes=32, use_pdl=true
    004: kCustomKernel [prev=003 (1) | sink        ] kernel=_emit_kernel, profile_annotation=pallas_call.8, launch dimensions=blocks: {16, 1, 1}, threads/block: {256, 1, 1}, cluster_dim=nullopt, shmem_bytes=8192, use_pdl=true
"""


def test_parse_thunks():
    t = gc.parse_thunks(THUNKS)
    assert t["_fwd_kernel"] == {"grid": (4096, 2, 1), "threads": (256, 1, 1), "smem": 221440}
    assert t["_bracket_kernel"]["smem"] == 1024 and t["loop_select_fusion"]["grid"] == (16384, 1, 1)
    t = gc.parse_thunks(THUNKS_KV)
    assert t["_filter_kernel"] == {"grid": (16, 2, 1), "threads": (256, 1, 1), "smem": 32}
    assert t["_emit_kernel"]["smem"] == 8192 and t["loop_broadcast_fusion"]["threads"] == (16, 1, 1)
    assert len(t) == 3


def test_parse_ptxas_attributes_the_spill_warning_to_its_own_function():
    r = gc.parse_ptxas(PTXAS)
    assert r["loop_select_fusion"] == {"spill_bytes": 0, "registers": 14}
    assert r["_fwd_kernel"] == {"spill_bytes": 240, "registers": 255}


def test_parse_ptx_counts_tensor_core_instructions_per_entry():
    r = gc.parse_ptx(PTX)
    assert r["anonymous_mosaic_gpu_kernel"] == {"wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3": 2}
    assert r["_kernel"] == {"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32": 1}


def test_parse_mosaic_dumps():
    res = ("Resources(smem_scratch_bytes=93184, tmem_scratch_cols=0, tmem_collective_scratch_cols=0, "
           "barrier_counts=Counter({Barrier(arrival_count=1, num_barriers=6, orders_tensor_core=False): 1}), "
           "scoped_gmem_semaphores={})")
    assert gc.parse_mosaic_resources(res) == 93184 + 6 * 8
    launch = ("%73 = gpu.launch async [%3] blocks(%arg2, %arg3, %arg4) in (%arg8 = %c8, %arg9 = %c32, %arg10 = %c1) "
              "threads(%arg5, %arg6, %arg7) in (%arg11 = %c128, %arg12 = %c1, %arg13 = %c1) "
              "dynamic_shared_memory_size %c93232_i32 {")
    assert gc.parse_mosaic_launch(launch) == ((8, 32, 1), (128, 1, 1))


def test_mosaic_dumps_numbered_apart_are_paired_by_kernel_name(tmp_path):
    """With several Mosaic GPU kernels in one program (the vmap case: the FP8 indexer and the sparse MLA forward),
    jaxlib numbered a kernel's PTX / ptxas dumps apart from its resources dump (batched_body_0.resources.txt beside
    batched_body_1.ptx): the kernel had no ptxas report and failed its case. One dump of each name pairs."""
    ptxas_v = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\nptxas info    : Function properties for k\n"
               "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
               "ptxas info    : Used {} registers, used 1 barriers\n")
    res = "Resources(smem_scratch_bytes={}, barrier_counts=Counter(), scoped_gmem_semaphores={{}})"
    mdir = tmp_path / "mosaic"
    mdir.mkdir()
    for name, smem, regs in (("batched_body_0", 1024, 110), ("fwd_1", 2048, 213)):
        (mdir / f"{name}.resources.txt").write_text(res.format(smem))
    (mdir / "batched_body_1.ptxas").write_text(ptxas_v.format(110))
    (mdir / "batched_body_1.ptx").write_text(PTX)
    (mdir / "fwd_0.ptxas").write_text(ptxas_v.format(213))
    (mdir / "fwd_0.ptx").write_text(".target sm_90a\n")
    got = {k.name: (k.smem, k.registers, sorted(k.mma)) for k in gc.collect(str(tmp_path))}
    assert got == {"mosaic:batched_body_0": (1024, 110, ["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                                                         "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"]),
                   "mosaic:fwd_1": (2048, 213, [])}


def _kernel(**kw):
    base = dict(name="_fwd_kernel", backend="triton", grid=(1, 1, 1), threads=(128, 1, 1), smem=1024, registers=64,
                spill_bytes=0, mma={"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32": 4})
    return gc.Kernel(**{**base, **kw})


@pytest.mark.parametrize("kernel,needle", [
    (dict(smem=gc.SMEM_BUDGET + 1), "shared memory > budget"),
    (dict(spill_bytes=8), "spills 8 B > budget"),
    (dict(registers=None), "no ptxas report"),
])
def test_check_fails_over_budget(kernel, needle):
    case = gc.Case("c", "sparse_mla_fwd", "prod", 8192)
    assert gc.check(case, {}, [_kernel()]) == []
    reasons = gc.check(case, {}, [_kernel(**kernel)])
    assert len(reasons) == 1 and needle in reasons[0]


def test_check_requires_the_claimed_instruction_and_a_pallas_kernel():
    fp8 = gc.Case("c", "indexer_logits", "prod", 8192, requires=(r"wgmma\.mma_async\S*\.e4m3\.e4m3",))
    reasons = gc.check(fp8, {}, [_kernel(mma={"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32": 8})])
    assert len(reasons) == 1 and "e4m3" in reasons[0]
    ok = _kernel(backend="mosaic", mma={"wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3": 64})
    assert gc.check(fp8, {}, [ok]) == []
    only_xla = gc.check(gc.Case("c", "topk", "prod", 8192), {}, [_kernel(backend="xla")])
    assert only_xla == ["no Pallas kernel in the compiled program"]
    assert gc.check(fp8, {"error": "JaxRuntimeError: RESOURCE_EXHAUSTED: Shared memory\nmore"}, [ok]) == [
        "JaxRuntimeError: RESOURCE_EXHAUSTED: Shared memory"]


def test_cases_cover_every_op_forward_and_backward_at_both_shapes_and_include_bad_tiles():
    cases = gc.all_cases()
    names = [c.name for c in cases]
    assert len(names) == len(set(names))
    for shapes in ("prod", "tiny"):
        ops = {c.op for c in cases if c.shapes == shapes and not c.expect_fail}
        assert ops >= {"hadamard_quant", "indexer_logits", "topk", "indexer_topk", "sparse_mla_fwd",
                       "sparse_mla_probs", "sparse_mla_bwd"}
    assert sum(c.expect_fail for c in cases) >= 2
    assert all(c.requires for c in cases if c.op == "indexer_logits")
    # the CI subset (make test-gpu-compile) leaves out only the model step with mla_bwd="atomic": its atomic claim
    # stays in CI at the kernel level, and every op, shape and negative control is still compiled
    ci = [c for c in cases if c.ci]
    assert [c.name for c in cases if not c.ci] == ["model_kernel_train_step[tiny,T=64,mla_bwd=atomic]"]
    assert {(c.op, c.shapes, c.expect_fail) for c in ci} == {(c.op, c.shapes, c.expect_fail) for c in cases}
    assert any(dict(c.kernel_requires).get("_dqkv_kernel", "").startswith(r"(red|atom)") for c in ci)


def test_kernel_scoped_claims_vector_loads_and_registers():
    ptx = (".visible .entry _filter_kernel(\n\t@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];\n"
           "\tld.global.b32 %r5, [ %rd2 + 0 ];\n}\n.visible .entry _emit_kernel(\n\tld.global.b32 %r1, [ %rd1 ];\n}\n")
    assert gc.parse_ptx(ptx, gc.VLOAD) == {"_filter_kernel": {"ld.global.v4.b32": 1}, "_emit_kernel": {}}
    case = gc.Case("c", "topk", "prod", 131072, **gc.TOPK_CLAIMS["prod"])
    filt = _kernel(name="_filter_kernel", registers=113, mma={}, vector_loads={"ld.global.v4.b32": 4})
    emit = _kernel(name="_emit_kernel", registers=200, mma={})  # claims name only the streaming pass
    assert gc.check(case, {}, [filt, emit]) == []
    scalar = gc.check(case, {}, [_kernel(name="_filter_kernel", registers=113, mma={}), emit])
    assert len(scalar) == 1 and "_filter_kernel: no instruction matching" in scalar[0]
    heavy = gc.check(case, {}, [_kernel(name="_filter_kernel", registers=129, mma={},
                                        vector_loads={"ld.global.v4.b32": 4})])
    assert heavy == ["_filter_kernel: 129 registers > 128"]
    assert gc.check(case, {}, [emit]) == ["no kernel matching '_filter_kernel'"] * 2


def test_a_case_may_set_its_own_shared_memory_budget():
    """The Mosaic GPU sparse MLA forward uses 231,464 B by design: over the default 90% budget, within its case's
    (and its 32-head form's, 192,520 B, and its ping-pong form's, 223,272 B)."""
    mgpu = [c for c in gc.all_cases() if c.name.startswith("sparse_mla_fwd_mgpu")]
    assert len(mgpu) == 3 and all(c.smem_budget == gc.SMEM_PER_BLOCK for c in mgpu)
    big = _kernel(name="mosaic:anonymous_0", smem=231_464, registers=213, spill_bytes=0, mma={})
    assert gc.check(gc.Case("c", "sparse_mla_fwd", "prod", 8192), {}, [big])[0].startswith(
        "mosaic:anonymous_0: 231464 B shared memory > budget 209203 B (90% of 232448)")
    assert gc.check(gc.Case("c", "sparse_mla_fwd", "prod", 8192, smem_budget=gc.SMEM_PER_BLOCK), {}, [big]) == []
    over = _kernel(name="mosaic:anonymous_0", smem=gc.SMEM_PER_BLOCK + 8, registers=213, spill_bytes=0, mma={})
    assert gc.check(gc.Case("c", "sparse_mla_fwd", "prod", 8192, smem_budget=gc.SMEM_PER_BLOCK), {}, [over])


def test_stored_backward_claims_wgmma_and_forbids_mma_sync():
    case = gc.Case("c", "sparse_mla_bwd", "prod", 8192, options=(("bwd", "stored"),), **gc.STORED_BWD_CLAIMS["prod"])
    wgmma = {"wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16": 8}
    pds, dqkv = _kernel(name="_pds_kernel", mma=wgmma), _kernel(name="_dqkv_kernel", mma=wgmma)
    assert gc.check(case, {}, [pds, dqkv, _kernel(name="_fwd_kernel")]) == []  # the forward is not claimed
    mixed = _kernel(name="_dqkv_kernel", mma={**wgmma, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32": 2})
    reasons = gc.check(case, {}, [pds, mixed])
    assert len(reasons) == 1 and reasons[0].startswith("_dqkv_kernel: mma.sync") and "forbidden" in reasons[0]
    only_sync = gc.check(case, {}, [pds, _kernel(name="_dqkv_kernel")])
    assert any("no instruction matching" in r for r in only_sync) and any("forbidden" in r for r in only_sync)


def test_tile_sweep_cases_and_the_committed_sweep_file_agree():
    """--sweep compiles the sparse MLA forward and each stored-backward kernel alone at every candidate tile, judged
    by the per-block shared memory maximum, no spills and no mma.sync; bench/tile_sweep_h100.json (what
    bench/kernels.py --tile_sweep times on a chip) holds one record per candidate, the default tiles among those
    that fit, and a record fits exactly when its facts pass those checks."""
    import dataclasses
    import json

    from dsv32_jax.kernels import StoredTiles
    cases = gc.sweep_cases()
    assert len({c.name for c in cases}) == len(cases) == sum(map(len, gc.SWEEPS.values()))
    for c in cases:
        if c.opts()["kernel"] != "fwd":
            StoredTiles(**dict(c.opts()["tiles"])).check()  # every backward candidate is a valid tile
        assert c.smem_budget == gc.SMEM_PER_BLOCK and c.kernel_forbids[0][1] == r"mma\.sync"
    with open(os.path.join(os.path.dirname(gc.HERE), "..", "bench", "tile_sweep_h100.json")) as f:
        sweep = json.load(f)
    default = dataclasses.asdict(StoredTiles())
    default.update(block_h=64, block_i=32, num_warps=8, num_stages=2)  # sparse_mla's forward tiles
    for kernel, grid in gc.SWEEPS.items():
        recs = sweep[kernel]
        assert [r["tiles"] for r in recs] == grid
        fits = [r["tiles"] for r in recs if r["fits"]]
        assert {k: default[k] for k in grid[0]} in fits
        for r in recs:
            facts_ok = (r["smem"] is not None and r["smem"] <= gc.SMEM_PER_BLOCK and r["spill_bytes"] == 0
                        and not any("mma.sync" in m for m in r["mma"]) and any("wgmma" in m for m in r["mma"]))
            assert r["fits"] == facts_ok, r
    # the summary judges by the case's checks: a spilling candidate does not fit
    case = next(c for c in cases if c.opts()["kernel"] == "pds")
    bad = gc.check(case, {}, [_kernel(name="_pds_kernel", smem=1000, registers=255, spill_bytes=8, mma={})])
    summary = gc.sweep_summary([{"ok": not bad, "failures": bad, "kernels": [dict(
        name="_pds_kernel", smem=1000, registers=255, spill_bytes=8, mma={})]}], [case])
    assert summary["pds"][0]["fits"] is False and "spills" in summary["pds"][0]["why"]
