"""Deviceless compile of every Pallas Mosaic-TPU kernel for TPU v5p and v6e, on a machine with no TPU.

    make test-tpu-compile                     # builds .venv-tpu (jax[tpu] + libtpu) and runs --check on the CI subset
    make tpu-compile-table                    # every case, and the table + TPU roofline rewritten in BENCHMARKS.md
    .venv-tpu/bin/python tools/tpu_compile/tpu_compile.py --list [--subset ci]
    .venv-tpu/bin/python tools/tpu_compile/tpu_compile.py --check --cases 'v5p/sparse_mla_bwd\\[prod' --keep /tmp/d

How: with jax[tpu] installed (libtpu from PyPI) and JAX_PLATFORMS=cpu, `jax.experimental.topologies.
get_topology_desc(platform="tpu", topology_name=...)` describes a TPU slice without one; each case is traced with
ShapeDtypeStruct arguments placed on its first chip, lowered (Pallas -> Mosaic MLIR inside a tpu_custom_call) and
compiled by libtpu (Mosaic -> LLO -> bundles for that chip: the program a TPU would run). Each case runs in its
own process (at most --jobs 2 at a time) with libtpu dumping its VMEM report and each kernel's final bundles:
  * the compiled HLO: every tpu_custom_call (one per Mosaic kernel), its kernel name (the Mosaic module's
    sym_name, read from the serialized body) and `used_scoped_memory_configs`, the scoped VMEM the kernel uses;
  * the VMEM report (`*vmem_report.html`, a JSON blob): the chip's VMEM capacity as the compiler sees it;
  * the final bundles (`*-<hlo name>-*final_bundles.txt`): bundle count and vector-register spills, the stores
    to / loads from `#allocationN_spill` VMEM slots.

Checks (--check; exit 1 when one fails): the case lowers and compiles; the compiled program contains a Mosaic
kernel; every kernel's scoped VMEM is at most VMEM_BUDGET (half) of the chip's VMEM. Spills are reported, not judged
(see pallas_kernels/topk.py). The negative controls (expect_fail) must FAIL with the stated reason: a top-k over 8
rows of 2M keys needs ~128 MiB of VMEM (the compile fails on both chips), and one of 8 rows sized to compile but
use more than the budget (768K keys on v5p, 1.5M on v6e: 75% of the VMEM) -- so a check that cannot fail is caught.

Subsets (--subset): "ci" = every kernel at the tiny shapes on both chips, every kernel at the production shapes on
v5p, the negative control that must fail to compile on v5p (`make test-tpu-compile`, CI); "all" = also production on
v6e, the 32K-key sparse MLA, the float32 sparse MLA, the tiny model's train step with attention="kernel" and the
over-budget controls, which compile in full (about 280 s of a 2-core CI's time: their judgement is unit-tested in
tests/test_tpu_compile_tool.py) (`make tpu-compile-table`).

A compile proves the kernels are valid Mosaic programs for the chip and fit its VMEM; nothing here ran on a TPU.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import dataclasses
import datetime
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TOPOLOGIES = {"v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
# VMEM per TensorCore as libtpu 0.0.50.1's VMEM report gives it (used when a case leaves no report).
VMEM_CAPACITY = {"v5p": 64 << 20, "v6e": 128 << 20}
VMEM_BUDGET = 0.5  # of the chip's VMEM, per kernel
BEGIN, END = "<!-- tpu-compile:begin -->", "<!-- tpu-compile:end -->"
MIB = 1 << 20


# ------------------------------------------------------------------------------------------------- the cases
# The shapes of tools/gpu_compile/gpu_compile.py (one definition): production (H 128, Dqk 576 = 512 + 64, k 2048,
# indexer 64 x 128) and the tiny test model (4 heads, 32 + 8 latent dims, top-8) with a 4 x 128 indexer.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu_compile"))
from gpu_compile import PROD, TINY, Shapes  # noqa: E402  (stdlib-only at import)

SHAPES = {s.name: s for s in (PROD, TINY)}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    gen: str
    op: str
    shapes: str
    keys: int
    options: tuple = ()  # (key, value) pairs for the builder
    expect_fail: str = ""  # a negative control: a regex its failure must match
    ci: bool = False  # in the CI subset

    def opts(self):
        return dict(self.options)


KERNEL_OPS = ("hadamard_quant", "indexer_logits", "topk", "indexer_topk", "sparse_mla_fwd", "sparse_mla_probs",
              "sparse_mla_bwd")


def all_cases() -> list[Case]:
    cases = []
    for gen in TOPOLOGIES:
        for sh in (PROD, TINY):
            ci = sh is TINY or gen == "v5p"
            big, small = sh.keys[-1], sh.keys[0]

            def case(op, keys, **kw):
                return Case(f"{gen}/{op}[{sh.name},L={keys}]", gen, op, sh.name, keys, ci=ci, **kw)
            cases += [case("indexer_logits", l) for l in sh.keys]
            cases += [case("hadamard_quant", big), case("topk", big), case("indexer_topk", small)]
            cases += [case(op, small) for op in ("sparse_mla_fwd", "sparse_mla_probs", "sparse_mla_bwd")]
        cases += [
            Case(f"{gen}/sparse_mla_fwd[prod,L=32768]", gen, "sparse_mla_fwd", "prod", 32768),
            Case(f"{gen}/sparse_mla_bwd[prod,L=32768]", gen, "sparse_mla_bwd", "prod", 32768),
            Case(f"{gen}/sparse_mla_fwd[tiny,L=64,float32]", gen, "sparse_mla_fwd", "tiny", 64,
                 options=(("dtype", "float32"),)),
            Case(f"{gen}/sparse_mla_bwd[tiny,L=64,float32]", gen, "sparse_mla_bwd", "tiny", 64,
                 options=(("dtype", "float32"),)),
            Case(f"{gen}/model_kernel_train_step[tiny,T=64]", gen, "model_kernel", "tiny", 64),
            # every op under jax.vmap over 2 slices (pallas_kernels/_vmap folds the mapped axis into the rows;
            # pallas_call's own batching made the Mosaic TPU lowering refuse sparse MLA and hadamard_quant)
            Case(f"{gen}/vmap[prod,L=8192]", gen, "vmap", "prod", 8192, ci=gen == "v5p"),
        ]
        # negative controls: the compile must fail for lack of VMEM / the budget check must fail
        over = {"v5p": 786432, "v6e": 1572864}[gen]  # 48 MiB of 64, 96 MiB of 128
        cases += [
            Case(f"{gen}/topk[8 x L={1 << 21}: exceeds VMEM]", gen, "topk_rows", "prod", 1 << 21,
                 expect_fail=r"(?i)out of memory.*vmem|vmem.*exceed", ci=gen == "v5p"),
            Case(f"{gen}/topk[8 x L={over}: over budget]", gen, "topk_rows", "prod", over,
                 expect_fail=r"scoped VMEM .* > budget"),
        ]
    return cases


def select(cases: list[Case], subset: str, pattern: str) -> list[Case]:
    return [c for c in cases if (subset == "all" or c.ci) and re.search(pattern, c.name)]


_DEVICES = {}


def tpu_device(gen: str):
    if gen not in _DEVICES:
        from jax.experimental import topologies
        _DEVICES[gen] = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[gen]).devices[0]
    return _DEVICES[gen]


def build(case: Case):
    """(fn, argument specs) of a case, placed on one abstract chip of its generation; impl="pallas_tpu"."""
    import jax
    import jax.numpy as jnp

    from dsv32_jax import kernels as pk

    dev = tpu_device(case.gen)
    sh = SHAPES[case.shapes]

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(dev))

    t, l, o, tpu = sh.queries, case.keys, case.opts(), "pallas_tpu"
    f8 = jnp.float8_e4m3fn
    if case.op == "model_kernel":
        return model_kernel_step(l, spec)
    if case.op == "vmap":
        def fn(x, h, q8, k8, ks, w, q, kv, idx):
            def loss(q_, kv_, i_):
                return pk.sparse_mla(q_, kv_, i_, sh.d_qk ** -0.5, sh.d_v, impl=tpu)[0].astype(jnp.float32).sum()
            return (jax.vmap(lambda a: pk.topk(a, sh.topk, impl=tpu))(x),
                    jax.vmap(lambda a: pk.hadamard_quant(a, impl=tpu))(h),
                    jax.vmap(lambda *a: pk.indexer_logits(*a, impl=tpu))(q8, k8, ks, w),
                    jax.vmap(jax.grad(loss, argnums=(0, 1)))(q, kv, idx))
        v, n = 2, 256  # slices, queries per slice
        return fn, [spec((v, n, l), jnp.float32), spec((v, l, sh.index_dim), jnp.bfloat16),
                    spec((v, 1, n, sh.index_heads, sh.index_dim), f8), spec((v, 1, l, sh.index_dim), f8),
                    spec((v, 1, l), jnp.float32), spec((v, 1, n, sh.index_heads), jnp.float32),
                    spec((v, 1, n, sh.heads, sh.d_qk), jnp.bfloat16), spec((v, 1, l, sh.d_qk), jnp.bfloat16),
                    spec((v, 1, n, sh.topk), jnp.int32)]
    if case.op == "hadamard_quant":
        return (lambda x: pk.hadamard_quant(x, impl=tpu)), [spec((1, l, 128), jnp.bfloat16)]
    if case.op == "indexer_logits":
        args = [spec((1, t, sh.index_heads, sh.index_dim), f8), spec((1, l, sh.index_dim), f8),
                spec((1, l), jnp.float32), spec((1, t, sh.index_heads), jnp.float32), spec((1, t), jnp.int32),
                spec((1, t), jnp.int32)]
        return (lambda q, k, ks, w, st, en: pk.indexer_logits(q, k, ks, w, starts=st, ends=en, impl=tpu)), args
    if case.op == "topk":
        return (lambda x: pk.topk(x, min(sh.topk, l), impl=tpu)), [spec((t, l), jnp.float32)]
    if case.op == "topk_rows":  # the negative controls: 8 rows (one program) of many keys
        return (lambda x: pk.topk(x, sh.topk, impl=tpu)), [spec((8, l), jnp.float32)]
    if case.op == "indexer_topk":
        def fn(q, k, w, qi, seg):
            return pk.indexer_topk(q, k, w, qi, seg[:, :t], seg, sh.topk, fp8=True, q_chunk=sh.q_chunk, impl=tpu)
        return fn, [spec((1, t, sh.index_heads, sh.index_dim), jnp.bfloat16),
                    spec((1, l, sh.index_dim), jnp.bfloat16), spec((1, t, sh.index_heads), jnp.float32),
                    spec((1, t), jnp.int32), spec((1, l), jnp.int32)]
    dtype = jnp.dtype(o.get("dtype", "bfloat16"))
    args = [spec((1, t, sh.heads, sh.d_qk), dtype), spec((1, l, sh.d_qk), dtype), spec((1, t, sh.topk), jnp.int32)]
    scale = sh.d_qk ** -0.5
    if case.op == "sparse_mla_fwd":
        return (lambda q, kv, i: pk.sparse_mla(q, kv, i, scale, sh.d_v, impl=tpu)), args
    if case.op == "sparse_mla_probs":
        return (lambda q, kv, i: pk.sparse_mla(q, kv, i, scale, sh.d_v, return_probs=True, impl=tpu)), args
    if case.op == "sparse_mla_bwd":
        def loss(q, kv, i):
            out, lse = pk.sparse_mla(q, kv, i, scale, sh.d_v, impl=tpu)
            return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()
        return jax.grad(loss, argnums=(0, 1)), args
    raise SystemExit(f"unknown op {case.op!r}")


def model_kernel_step(length: int, spec):
    """Gradients of the tiny model's sparse-stage loss (indexer 4 x 128, fp8, sparse indexer KL) with
    RunOptions(attention="kernel") and every op on its TPU kernel (set_default_impl("pallas_tpu"))."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv32_jax import kernels as pk
    from dsv32_jax.model.config import load_preset
    from dsv32_jax.model.transformer import Transformer
    from dsv32_jax.model.options import RunOptions
    from dsv32_jax.train.steps import LossWeights, lm_objective

    pk.set_default_impl("pallas_tpu")
    cfg = load_preset("tiny").replace(index_head_dim=128)
    opts = RunOptions(attention="kernel", indexer_fp8=True, indexer_loss="sparse")
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), options=opts, dtype=jnp.bfloat16))
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: spec(x.shape, x.dtype), state)

    def step(state, tokens):
        def loss(state):
            batch = {"tokens": tokens, "targets": tokens,
                     "positions": jnp.broadcast_to(jnp.arange(length), tokens.shape),
                     "segment_ids": jnp.ones_like(tokens), "loss_mask": jnp.ones(tokens.shape, jnp.float32)}
            return lm_objective(nnx.merge(graphdef, state), batch, stage="sparse", weights=LossWeights(),
                                model_cfg=cfg)[0]
        return jax.grad(loss)(state)

    return step, [state, spec((1, length), jnp.int32)]


def compile_one(case: Case) -> dict:
    """Child process: trace, lower, compile; the compiled HLO's kernels and the HBM memory analysis."""
    import jax
    import jaxlib
    rec = {"case": case.name, "jax": jax.__version__, "jaxlib": jaxlib.__version__}
    try:
        from importlib.metadata import version
        rec["libtpu"] = version("libtpu")
    except Exception:  # reported as unknown
        rec["libtpu"] = None
    t0 = time.perf_counter()
    try:
        dev = tpu_device(case.gen)
        rec["device_kind"] = dev.device_kind
        fn, args = build(case)
        with jax.default_device(dev):
            lowered = jax.jit(fn).trace(*args).lower()
        rec["lower_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        compiled = lowered.compile()
        rec["compile_s"] = time.perf_counter() - t1
        ma = compiled.memory_analysis()
        rec.update(arg_bytes=int(ma.argument_size_in_bytes), out_bytes=int(ma.output_size_in_bytes),
                   temp_bytes=int(ma.temp_size_in_bytes))
        rec["kernels"] = parse_hlo_kernels(compiled.as_text())
    except Exception as e:  # the case's failure, judged by the parent
        rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    return rec


# ------------------------------------------------------------------------------------------- what we read
CUSTOM_CALL = re.compile(r"^\s*(?:ROOT )?%(\S+) = [^\n]*custom_call_target=\"tpu_custom_call\"[^\n]*$", re.M)
KERNEL_NAME = re.compile(rb"^[A-Za-z_]\w*kernel\w*$")


def mosaic_name(body_b64: str) -> str | None:
    """The Mosaic module's sym_name (the Pallas kernel function's name) from a tpu_custom_call's serialized body:
    MLIR bytecode, whose string table holds it in plain text."""
    try:
        raw = base64.b64decode(body_b64)
    except ValueError:
        return None
    names = [s for s in re.findall(rb"[\x21-\x7e]{4,}", raw) if KERNEL_NAME.match(s)]
    return names[0].decode() if names else None


def parse_hlo_kernels(text: str) -> list[dict]:
    """Each tpu_custom_call of a compiled HLO module: its HLO name, kernel name and scoped VMEM bytes (None if the
    line has no used_scoped_memory_configs)."""
    out = []
    for m in CUSTOM_CALL.finditer(text):
        line = m.group(0)
        used = re.search(r'"used_scoped_memory_configs":\[(.*?)\]', line)
        body = re.search(r'"body":"([^"]*)"', line)
        size = sum(int(x) for x in re.findall(r'"size":"(\d+)"', used.group(1))) if used else None
        out.append({"hlo_name": m.group(1), "kernel": (mosaic_name(body.group(1)) if body else None) or m.group(1),
                    "scoped_vmem": size,
                    "body_sha1": hashlib.sha1(body.group(1).encode()).hexdigest()[:12] if body else None})
    return out


def parse_vmem_capacity(text: str) -> int | None:
    """VMEM capacity from libtpu's VMEM report (an HTML page holding `const DATA = {json}`)."""
    i = text.find("const DATA =")
    if i < 0:
        return None
    try:
        data, _ = json.JSONDecoder().raw_decode(text[i + len("const DATA ="):].lstrip())
    except ValueError:
        return None
    cap = data.get("global_info", {}).get("vmem_capacity")
    return int(cap) if cap else None


SPILL = re.compile(r"\b(vst|vld)(?:\.\w+)* \[vmem:\[#allocation\d+_spill")
BUNDLE = re.compile(r"^\s*0x[0-9a-f]+\s")


def parse_bundles(text: str) -> dict:
    """A kernel's final LLO bundles -> bundle count and vector-register spill stores / loads."""
    ops = SPILL.findall(text)
    return {"bundles": sum(1 for ln in text.splitlines() if BUNDLE.match(ln)),
            "spill_stores": ops.count("vst"), "spill_loads": ops.count("vld")}


def collect_dumps(workdir: str, kernels: list[dict]) -> int | None:
    """Adds each kernel's bundle facts (in place); returns the VMEM capacity of the report, if any."""
    cap = None
    for path in glob.glob(os.path.join(workdir, "*vmem_report.html")):
        cap = parse_vmem_capacity(open(path, errors="replace").read()) or cap
    for k in kernels:
        paths = [p for p in glob.glob(os.path.join(workdir, f"*-{glob.escape(k['hlo_name'])}-*final_bundles.txt"))
                 if "schedule-analysis" not in p]
        if paths:
            k.update(parse_bundles(open(sorted(paths)[-1], errors="replace").read()))
    # libtpu compiles identical kernels (same Mosaic body, e.g. the two branches of a lax.cond) once, under one name
    done = {k["body_sha1"]: k for k in kernels if "bundles" in k and k["body_sha1"]}
    for k in kernels:
        if "bundles" not in k and k["body_sha1"] in done:
            k.update({f: done[k["body_sha1"]][f] for f in ("bundles", "spill_stores", "spill_loads")})
    return cap


def check(case: Case, rec: dict, capacity: int) -> list[str]:
    """The reasons the case fails its checks (empty: it passes)."""
    if "error" in rec:
        return [rec["error"].splitlines()[0][:400]]
    kernels = rec.get("kernels", [])
    if not kernels:
        return ["no Mosaic kernel (tpu_custom_call) in the compiled program"]
    budget = int(VMEM_BUDGET * capacity)
    bad = []
    for k in kernels:
        if k["scoped_vmem"] is None:
            bad.append(f"{k['kernel']} ({k['hlo_name']}): no used_scoped_memory_configs in the compiled HLO")
        elif k["scoped_vmem"] > budget:
            bad.append(f"{k['kernel']} ({k['hlo_name']}): scoped VMEM {k['scoped_vmem'] / MIB:.1f} MiB > budget "
                       f"{budget / MIB:.1f} MiB ({VMEM_BUDGET:.0%} of {capacity / MIB:.0f} MiB)")
    return bad


def judge(case: Case, rec: dict, capacity: int) -> dict:
    """failures, and ok: a normal case passes its checks; a negative control fails them for its stated reason."""
    failures = check(case, rec, capacity)
    if case.expect_fail:
        ok = any(re.search(case.expect_fail, f) for f in failures)
    else:
        ok = not failures
    return {"failures": failures, "expect_fail": case.expect_fail, "ok": ok}


# ------------------------------------------------------------------------------------------------ the runner
def run_case(case: Case, keep: str | None, dumps: bool, timeout: int) -> dict:
    workdir = tempfile.mkdtemp(prefix="tpu_compile_")
    # no TPU is probed (the host backend is the CPU); libtpu's one-process-per-host lock file is for real chips,
    # and parallel deviceless compiles would trip over it
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    if dumps:
        env["LIBTPU_INIT_ARGS"] = " ".join([os.environ.get("LIBTPU_INIT_ARGS", ""), f"--xla_jf_dump_to={workdir}",
                                            "--xla_jf_dump_llo_text=true",
                                            "--xla_jf_dump_llo_pass_label_regex=final_bundles"]).strip()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one",
                               json.dumps(dataclasses.asdict(case))], env=env, capture_output=True, text=True,
                              cwd=ROOT, timeout=timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        rec = json.loads(lines[-1]) if lines else {"case": case.name, "error": f"child exited {proc.returncode}: "
                                                                             f"{proc.stderr[-1500:]}"}
    except subprocess.TimeoutExpired:
        rec = {"case": case.name, "error": f"timeout after {timeout} s"}
    rec["wall_s"] = time.perf_counter() - t0
    rec["gen"] = case.gen
    cap = collect_dumps(workdir, rec.get("kernels", [])) if dumps else None
    rec["vmem_capacity"] = cap or VMEM_CAPACITY[case.gen]
    rec["vmem_capacity_source"] = "libtpu VMEM report" if cap else "VMEM_CAPACITY table"
    rec.update(judge(case, rec, rec["vmem_capacity"]))
    if keep:
        dst = os.path.join(keep, re.sub(r"[^\w.=-]+", "_", case.name))
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(workdir, dst)
    shutil.rmtree(workdir, ignore_errors=True)
    return rec


def status(rec: dict) -> str:
    if rec["expect_fail"]:
        if rec["ok"]:
            return "expected failure: " + "; ".join(rec["failures"])[:160].replace("|", "/")
        return "FAIL: the negative control " + ("passed the checks" if not rec["failures"] else
                                                "failed for another reason: " + "; ".join(rec["failures"])[:120])
    return "ok" if rec["ok"] else "FAIL: " + "; ".join(rec["failures"])[:200].replace("|", "/")


def unique_kernels(kernels: list[dict]) -> list[dict]:
    """One row per distinct kernel (same name and Mosaic body) with how many times the program calls it; XLA's own
    Mosaic kernels (no kernel function name, e.g. the MoE's ragged-dot-none.N) in one row per family. A row holds
    the largest scoped VMEM / spills / bundles of its calls."""
    out = {}
    for k in kernels:
        ours = KERNEL_NAME.match(k["kernel"].encode())
        key = (k["kernel"], k["body_sha1"] or k["hlo_name"]) if ours else (re.sub(r"\.\d+$", "", k["kernel"]), None)
        if key not in out:
            out[key] = {**k, "kernel": key[0], "count": 1}
            continue
        row = out[key]
        row["count"] += 1
        for field in ("scoped_vmem", "spill_stores", "spill_loads", "bundles"):
            if k.get(field) is not None and (row.get(field) is None or k[field] > row[field]):
                row[field] = k[field]
    return list(out.values())


# the project's Pallas kernel functions (the Mosaic module names) -> the op they belong to, for the table
OP_OF_KERNEL = {"_kernel": "hadamard_quant", "_tpu_kernel": "indexer_logits", "_tpu_threshold_kernel": "topk",
                "_fwd_kernel": "sparse_mla fwd", "_probs_kernel": "sparse_mla probs", "_bwd_kernel": "sparse_mla bwd"}


def table(records: list[dict]) -> str:
    rows = ["| case | op: Mosaic kernel (calls) | scoped VMEM MiB (% of chip) | spill st / ld | bundles | compile s | "
            "status |", "|---|---|---|---|---|---|---|"]
    for rec in records:
        ks = unique_kernels(rec.get("kernels") or []) or [None]
        comp = f"{rec['compile_s']:.1f}" if "compile_s" in rec else "-"
        for i, k in enumerate(ks):
            first = i == 0
            if k is None:
                rows.append(f"| {rec['case']} | - | - | - | - | {comp} | {status(rec)} |")
                continue
            vmem = "-" if k["scoped_vmem"] is None else (
                f"{k['scoped_vmem'] / MIB:.2f} ({100 * k['scoped_vmem'] / rec['vmem_capacity']:.0f}%)")
            spills = f"{k['spill_stores']} / {k['spill_loads']}" if "spill_stores" in k else "-"
            op = OP_OF_KERNEL.get(k["kernel"])
            name = (f"{op}: {k['kernel']}" if op else k["kernel"]) + (f" (x{k['count']})" if k["count"] > 1 else "")
            rows.append(f"| {rec['case'] if first else ''} | {name} | {vmem} | {spills} | "
                        f"{k.get('bundles', '-')} | {comp if first else ''} | {status(rec) if first else ''} |")
    return "\n".join(rows)


def roofline_table(lengths=(8192, 32768, 131072), queries: int = 4096) -> str:
    """bench/roofline.py's floors for v5p and v6e side by side."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import roofline as rl
    rows = ["| op | L | GFLOP | op bytes (MB) | + design bytes (MB) | v5p floor: compute / HBM (ms) | v5p floor "
            "with design bytes (ms) | v6e floor: compute / HBM (ms) | v6e floor with design bytes (ms) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for length in lengths:
        per_chip = {chip: rl.rows(queries, length, chip) for chip in ("v5p", "v6e")}
        for i, (op, flops, op_bytes, extra, _, _) in enumerate(per_chip["v5p"]):
            cells = []
            for chip in ("v5p", "v6e"):
                peak, hbm = per_chip[chip][i][4], rl.CHIPS[chip][2]
                tc, tb, td = flops / peak * 1e3, op_bytes / hbm * 1e3, (op_bytes + extra) / hbm * 1e3
                cells += [f"{tc:.3f} / {tb:.3f}", f"{max(tc, td):.3f}"]
            rows.append(f"| {op} | {length // 1024}K | {flops / 1e9:,.0f} | {op_bytes / 1e6:,.0f} | "
                        f"{extra / 1e6:,.0f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def update_benchmarks(path: str, records: list[dict], wall_s: float, jobs: int) -> None:
    text = open(path).read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} section to replace")
    first = next((r for r in records if "jax" in r), {})
    caps = []
    for gen in TOPOLOGIES:
        reported = sorted({r["vmem_capacity"] for r in records if r["gen"] == gen and
                           r["vmem_capacity_source"] != "VMEM_CAPACITY table"})
        caps.append(f"{gen} " + (", ".join(f"{c / MIB:.0f} MiB" for c in reported) + " (libtpu's VMEM report)"
                                 if reported else f"{VMEM_CAPACITY[gen] / MIB:.0f} MiB (VMEM_CAPACITY)"))
    stamp = textwrap.fill(
        f"Generated by `make tpu-compile-table` on {datetime.date.today()}: jax {first.get('jax')}, jaxlib "
        f"{first.get('jaxlib')}, libtpu {first.get('libtpu')}, on a CPU-only host (no TPU: deviceless compile for "
        f"the `get_topology_desc` topologies {', '.join(TOPOLOGIES.values())}), {len(records)} cases in "
        f"{wall_s / 60:.1f} min at {jobs} parallel processes. VMEM per chip: {'; '.join(caps)}; budget "
        f"{VMEM_BUDGET:.0%} of it per kernel. Compile s: the host's time for the whole case (XLA and Mosaic). A kernel "
        "with (xN) is called N times by the program (the largest values of the N shown); XLA's own Mosaic kernels "
        "(ragged-dot: the MoE's grouped matmuls) are one row per family.", width=118)
    roof = textwrap.fill(
        "Static roofline at 4096 queries (`python bench/roofline.py --chip v5p|v6e`; peaks from Google Cloud's TPU "
        "docs, cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GB HBM2e at 2765 GB/s; cloud.google.com/tpu/docs/"
        "v6e: 918 TFLOP/s bf16, 32 GB at 1638 GB/s; the TPU indexer kernel widens e4m3 to bf16, so every row uses "
        "the bf16 peak; bytes counted as in the H100 roofline above: a gathered KV row is Dqk x 2 = 1,152 B, which "
        "is what the TPU gather moves):", width=118)
    block = f"{BEGIN}\n{stamp}\n\n{table(records)}\n\n{roof}\n\n{roofline_table()}\n{END}"
    new = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a case fails (a negative control passes)")
    p.add_argument("--subset", default="all", choices=("ci", "all"))
    p.add_argument("--cases", default="", help="regex: run the cases whose name matches")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile processes (at most 2 on the CI machine)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per case")
    p.add_argument("--no-dumps", action="store_true", help="no libtpu dumps: no spills, VMEM capacity from the table")
    p.add_argument("--json", default="", help="write the records here")
    p.add_argument("--benchmarks", default="", help="replace the tpu-compile section of this file (BENCHMARKS.md)")
    p.add_argument("--keep", default="", help="keep each case's libtpu dumps under this directory")
    p.add_argument("--list", action="store_true")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        fields = json.loads(a.one)
        fields["options"] = tuple(map(tuple, fields["options"]))
        print(json.dumps(compile_one(Case(**fields))), flush=True)
        return 0
    cases = select(all_cases(), a.subset, a.cases)
    if a.list:
        print("\n".join(c.name for c in cases))
        return 0
    if not cases:
        raise SystemExit(f"--subset={a.subset} --cases={a.cases!r} match no case (see --list)")
    t0 = time.perf_counter()
    records = []
    with concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as pool:
        for rec in pool.map(lambda c: run_case(c, a.keep or None, not a.no_dumps, a.timeout), cases):
            records.append(rec)
            facts = "; ".join(f"{k['kernel']} vmem={k['scoped_vmem']} spills={k.get('spill_stores', '?')}"
                              for k in rec.get("kernels", []))
            print(f"[{'ok' if rec['ok'] else 'FAIL'}] {rec['case']}  compile {rec.get('compile_s', 0):.1f}s "
                  f"wall {rec['wall_s']:.1f}s  {facts}" + (f"\n    failures: {rec['failures']}" if rec["failures"]
                                                            else ""), flush=True)
    wall = time.perf_counter() - t0
    print("\n" + table(records))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"wall_s": wall, "jobs": a.jobs, "subset": a.subset, "records": records}, f, indent=1)
    if a.benchmarks:
        update_benchmarks(a.benchmarks, records, wall, a.jobs)
    failed = [r["case"] for r in records if not r["ok"]]
    print(f"\n{len(records) - len(failed)}/{len(records)} cases ok in {wall:.0f} s"
          + (f"; failed: {failed}" if failed else ""))
    return 1 if (a.check and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
