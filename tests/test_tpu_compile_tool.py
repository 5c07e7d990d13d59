"""The deviceless TPU compile check (tools/tpu_compile/tpu_compile.py, `make test-tpu-compile`): what it reads
from the compiled HLO and libtpu's dumps, and how it judges (scoped-VMEM budget, negative controls). The compile
itself needs jax[tpu] + libtpu and runs in its own make target / CI step; these tests need neither."""

import base64
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "tpu_compile"))
import tpu_compile as tc  # noqa: E402

MIB = 1 << 20


def _body(name: str) -> str:
    """A stand-in for a serialized Mosaic module: MLIR bytecode keeps sym_name in its string table."""
    return base64.b64encode(b"ML\xefR\x01MLIR24.0.0git\x00sym_name\x00" + name.encode() + b"\x00builtin\x00").decode()


def _hlo_line(hlo_name, kernel, size):
    used = f'"used_scoped_memory_configs":[{{"memory_space":"1","offset":"0","size":"{size}"}}],' if size else ""
    return (f'  %{hlo_name} = (bf16[16,2,8,128]{{3,2,1,0:T(8,128)(2,1)}}) custom-call(%a, %b), '
            f'custom_call_target="tpu_custom_call", metadata={{op_name="jit(f)/pallas_call"}}, '
            f'backend_config={{"flag_configs":[],"scoped_memory_configs":[],"custom_call_config":{{"body":"'
            f'{_body(kernel)}","needs_layout_passes":true}},{used}"retry_config":{{"retry_count":"0"}}}}')


HLO = "\n".join([
    "HloModule jit_f",
    '  %fusion.3 = f32[8]{0} fusion(%p), kind=kLoop, backend_config={"used_scoped_memory_configs":[{"size":"999"}]}',
    _hlo_line("jvp__.1", "_fwd_kernel", 2_883_584),
    _hlo_line("eval_jaxpr.2", "_bwd_kernel", 7_405_568),
    "  ROOT " + _hlo_line("custom-call.7", "ragged-dot", None).lstrip(),
])

BUNDLES = """\
  0x5a LB: >> { %6902 = vst [vmem:[#allocation18_spill] sm:$0xff] /*vst_source=*/%v2801_v2  ;;  %v479 = vld [vmem:[%s230_s11] sm:$0xff] }
  0x5b   : >> { %v12 = vld [vmem:[#allocation18_spill] sm:$0xff]  ;;  %6903 = vst.msk [vmem:[#allocation19_spill] sm:$0xff] %v3 }
  0x5c   : > { %s1 = sld [smem:[#allocation3_spill]] }
"""


def test_parse_hlo_kernels_reads_only_mosaic_calls_with_their_names_and_scoped_vmem():
    ks = tc.parse_hlo_kernels(HLO)
    assert [(k["hlo_name"], k["kernel"], k["scoped_vmem"]) for k in ks] == [
        ("jvp__.1", "_fwd_kernel", 2_883_584), ("eval_jaxpr.2", "_bwd_kernel", 7_405_568),
        ("custom-call.7", "custom-call.7", None)]  # XLA's own Mosaic kernel: no "kernel" name, the HLO name


def test_parse_bundles_counts_vector_register_spills():
    assert tc.parse_bundles(BUNDLES) == {"bundles": 3, "spill_stores": 2, "spill_loads": 1}


def test_parse_vmem_capacity_from_the_report():
    html = '<script>const DATA = {"global_info": {"module_name": "jit_f", "vmem_capacity": 67108864}, ' \
           '"hlo_breakdowns": {}};</script>'
    assert tc.parse_vmem_capacity(html) == 64 * MIB
    assert tc.parse_vmem_capacity("<html>no data</html>") is None


def _rec(*sizes):
    return {"kernels": [{"hlo_name": f"k.{i}", "kernel": "_fwd_kernel", "scoped_vmem": s, "body_sha1": None}
                        for i, s in enumerate(sizes)]}


def test_vmem_budget_is_half_of_the_chip():
    case = tc.Case("v5p/sparse_mla_fwd[prod,L=8192]", "v5p", "sparse_mla_fwd", "prod", 8192)
    cap = 64 * MIB
    assert tc.check(case, _rec(1 * MIB, 32 * MIB), cap) == []
    reasons = tc.check(case, _rec(1 * MIB, 32 * MIB + 1), cap)
    assert len(reasons) == 1 and "scoped VMEM 32.0 MiB > budget 32.0 MiB (50% of 64 MiB)" in reasons[0]
    assert tc.check(case, _rec(40 * MIB), 128 * MIB) == []  # the same kernel fits v6e's budget
    assert "no used_scoped_memory_configs" in tc.check(case, _rec(None), cap)[0]
    assert tc.check(case, {"kernels": []}, cap) == ["no Mosaic kernel (tpu_custom_call) in the compiled program"]
    assert tc.check(case, {"error": "MosaicError: INTERNAL: Mosaic failed\nmore"}, cap) == [
        "MosaicError: INTERNAL: Mosaic failed"]


@pytest.mark.parametrize("name", ["exceeds VMEM", "over budget"])
def test_negative_controls_pass_only_when_they_fail_for_their_reason(name):
    control = next(c for c in tc.all_cases() if c.gen == "v5p" and name in c.name)
    cap = 64 * MIB
    compile_error = {"error": "JaxRuntimeError: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of "
                              "memory in memory space vmem. Used 128.72M of 63.94M vmem."}
    results = {"compiled within budget": _rec(12 * MIB), "other error": {"error": "ImportError: no libtpu"},
               "compile error": compile_error, "over budget": _rec(48 * MIB)}
    expected = "compile error" if name == "exceeds VMEM" else "over budget"
    for what, rec in results.items():
        assert tc.judge(control, rec, cap)["ok"] == (what == expected), what
    normal = tc.Case("v5p/topk[prod,L=131072]", "v5p", "topk", "prod", 131072)
    assert tc.judge(normal, _rec(12 * MIB), cap)["ok"] and not tc.judge(normal, _rec(48 * MIB), cap)["ok"]


def test_identical_kernels_share_their_bundles(tmp_path):
    ks = [{"hlo_name": "_topk_tpu", "kernel": "_tpu_threshold_kernel", "scoped_vmem": 1, "body_sha1": "a"},
          {"hlo_name": "_topk_tpu.1", "kernel": "_tpu_threshold_kernel", "scoped_vmem": 1, "body_sha1": "a"}]
    (tmp_path / "123-_topk_tpu-01-final_bundles.txt").write_text(BUNDLES)
    (tmp_path / "123-_topk_tpu-00-schedule-analysis_final_bundles.txt").write_text("")
    (tmp_path / "9-TLP-02-vmem_report.html").write_text('const DATA = {"global_info": {"vmem_capacity": 134217728}}')
    assert tc.collect_dumps(str(tmp_path), ks) == 128 * MIB
    assert ks[0]["spill_stores"] == ks[1]["spill_stores"] == 2
    rows = tc.unique_kernels(ks)
    assert len(rows) == 1 and rows[0]["count"] == 2


def test_cases_cover_every_kernel_forward_and_backward_on_both_chips_and_ci_subset():
    cases = tc.all_cases()
    names = [c.name for c in cases]
    assert len(names) == len(set(names))
    for gen in tc.TOPOLOGIES:
        for shapes in ("prod", "tiny"):
            ops = {c.op for c in cases if c.gen == gen and c.shapes == shapes and not c.expect_fail}
            assert ops >= set(tc.KERNEL_OPS), (gen, shapes)
        assert sum(bool(c.expect_fail) for c in cases if c.gen == gen) == 2
    ci = tc.select(cases, "ci", "")
    assert {c.op for c in ci if c.gen == "v5p" and c.shapes == "prod"} >= set(tc.KERNEL_OPS)
    assert {c.op for c in ci if c.gen == "v6e" and c.shapes == "tiny"} >= set(tc.KERNEL_OPS)
    assert [c.name for c in ci if c.expect_fail] == [f"v5p/topk[8 x L={1 << 21}: exceeds VMEM]"]
    assert tc.select(cases, "all", "") == cases
