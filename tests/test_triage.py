"""bench/mgpu_triage.py: the triage of the Mosaic GPU kernels never run on a chip (issue 31), and how
bench/gpu_session.sh runs it for a failed test group within the call's deadline. A failing chip test gives one number;
these check that the triage says where a fault sits (key block, warpgroup half, column half, token), on synthetic
faults and on faults injected into the real kernels' outputs in interpret mode."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _triage():
    spec = importlib.util.spec_from_file_location("mgpu_triage", os.path.join(ROOT, "bench", "mgpu_triage.py"))
    module = sys.modules["mgpu_triage"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pds_like(rng, n=2, h=64, k=256):
    want = rng.standard_normal((n, h, k))
    idx = rng.integers(0, 100, (n, k))
    idx[:, 10:14] = -1
    want[np.broadcast_to(idx[:, None, :] < 0, want.shape)] = 0.0
    return want, idx < 0


def test_breakdown_names_the_block_and_half_of_a_fault():
    """A P / dS-shaped output wrong only in key block 2's second half (warpgroup 1's slots) is reported as that block
    and that half; a clean output as ok; the diagnosis names no axis along which every group is bad."""
    tr = _triage()
    rng = np.random.default_rng(0)
    want, invalid = _pds_like(rng)
    n, h, k = want.shape
    parts = [tr.token_part(n), *tr.head_parts(1, h), *tr.block_parts(2, k, "pds")]
    clean = tr.breakdown(want + 1e-4 * rng.standard_normal(want.shape) * (~invalid[:, None, :]), want, parts,
                         tr.BOUND, zero=invalid[:, None, :])
    assert tr.diagnose({"p": clean}, {"p": tr.BOUND}) == "ok"
    got = want.copy()
    got[:, :, 128 + 32:192] += 0.5
    c = tr.breakdown(got, want, parts, tr.BOUND, zero=invalid[:, None, :])
    assert c["bad"]["key block (64 slots)"]["bad"] == ["2"] and c["bad"]["block half (32 slots: warpgroup)"]["bad"] \
        == ["32-63"]
    said = tr.diagnose({"p": c}, {"p": tr.BOUND})
    assert "key block (64 slots) 2 of 4" in said and "block half (32 slots: warpgroup) 32-63 of 2" in said
    assert "token" not in said and "head group" not in said  # every token and head is bad: no localization there


def test_breakdown_counts_nans_invalid_slots_scale_and_lse_infinities():
    tr = _triage()
    rng = np.random.default_rng(1)
    want, invalid = _pds_like(rng, n=3)
    parts = [tr.token_part(3), *tr.block_parts(2, want.shape[2], "dqkv")]
    got = want.copy()
    got[1, 5, 70] = np.nan  # token 1, block 1 (odd), slot row 6 of its block
    got[0, 0, 11] = 2.0  # an invalid slot written
    c = tr.breakdown(got, want, parts, tr.BOUND, zero=invalid[:, None, :])
    assert c["nan"] == 1 and c["nonzero_where_invalid"] == 1 and c["invalid_slots"] == 3 * 64 * 4
    said = tr.diagnose({"part": c}, {"part": tr.BOUND})
    assert "1 NaN" in said and "1 of 768 invalid-slot values nonzero" in said and "token 0,1 of 3" in said
    half = tr.breakdown(want / 2, want, parts, tr.BOUND)
    said = tr.diagnose({"dq": half}, {"dq": tr.BOUND})
    assert "best scale got/want 0.500" in said and "everywhere" in said
    zero = tr.diagnose({"dq": tr.breakdown(0 * want, want, parts, tr.BOUND)}, {"dq": tr.BOUND})
    assert "all zero" in zero
    want_lse = np.array([[0.5, 1.0], [-np.inf, -np.inf]])
    lse = np.array([[0.5, 1.0 + 3e-4], [-np.inf, 2.0]])
    c = tr.lse_check(lse, want_lse, [tr.token_part(2), *tr.head_parts(1, 2)], tr.LSE_BOUND)
    assert c["inf_mismatch"] == 1 and abs(c["abs"] - 3e-4) < 1e-9
    said = tr.diagnose({"lse": c}, {"lse": tr.LSE_BOUND})
    assert "abs 3.00e-04 > 1e-04" in said and "1 rows -inf where the reference is finite" in said


def test_records_name_a_case_that_hung_and_each_targets_first_failure(tmp_path):
    """A start line without its end (the device hung there, or the time limit ended the run) reads as "hung"; the
    summary names each target's first failing case, in ladder order."""
    tr = _triage()
    log = tmp_path / "t.jsonl"
    lines = [{"event": "start", "target": "fwd", "case": "layout"},
             {"event": "end", "target": "fwd", "case": "layout", "status": "ok", "diagnosis": "ok", "seconds": 1.0},
             {"event": "start", "target": "pds", "case": "layout"},
             {"event": "end", "target": "pds", "case": "layout", "status": "wrong", "diagnosis": "p: rel 1",
              "seconds": 1},
             {"event": "start", "target": "fwd", "case": "one_block"}]
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    recs = tr.read_records(str(log))
    assert [(r["target"], r["case"], r["status"]) for r in recs] == [
        ("fwd", "layout", "ok"), ("pds", "layout", "wrong"), ("fwd", "one_block", "hung")]
    text = tr.summary(recs)
    assert "**fwd**: first failure at `one_block` (hung)" in text
    assert "**pds**: first failure at `layout` (wrong)" in text
    # a kill inside the write of the last record: that line is skipped (its case reads as hung, its start being
    # there), the --report names nothing wrong; the same line inside the log is refused naming file and line
    log.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"event": "end", "target": "fwd", "ca')
    assert [(r["case"], r["status"]) for r in tr.read_records(str(log))][-1] == ("one_block", "hung")
    log.write_text('{"event": "end", "target": "fwd", "ca\n' + "".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(ValueError, match=r"t\.jsonl, line 1: not a triage record"):
        tr.read_records(str(log))
    with pytest.raises(SystemExit):
        tr.main(["--report", str(log)])


def test_triage_runs_the_kernels_and_localizes_an_injected_fault(monkeypatch, tmp_path):
    """The real kernels in interpret mode pass every case run here; a forward whose warpgroup 1 columns go wrong from
    the second key block on (injected into its output) is first caught at blocks_2, in column half 256-511 only."""
    tr = _triage()
    recs = tr.main(["--interpret", "--targets", "fwd-t,pds-t", "--cases", "layout,blocks_2", "--out",
                    str(tmp_path / "t")])
    assert [r["status"] for r in recs] == ["ok"] * 4
    assert (tmp_path / "t.md").read_text().count("every case ran ok") == 2
    from dsv32_jax.kernels import sparse_mla_mgpu as sm
    real = sm.sparse_mla_fwd

    def broken(q, kv, idx, **kw):
        out, lse = real(q, kv, idx, **kw)
        return (out.at[:, :, 256:].multiply(1.1) if idx.shape[1] > 64 else out), lse
    monkeypatch.setattr(sm, "sparse_mla_fwd", broken)
    recs = tr.main(["--interpret", "--targets", "fwd", "--cases", "one_block,blocks_2"])
    assert [r["status"] for r in recs] == ["ok", "wrong"]
    assert "column half (256) 256-511 of 2" in recs[1]["diagnosis"] and "lse" not in recs[1]["diagnosis"]


def test_triage_of_the_gather_producer(monkeypatch):
    """The gather target (chip only: `inline_mgpu` has no interpret mode) with its two kernels replaced here by the
    reference and by a form that loses key rows 16-31: the first is ok at every index pattern, the second is reported
    at exactly those rows, and all-invalid indices (zero rows) are checked as zeros."""
    tr = _triage()
    from dsv32_jax.kernels import gather_mgpu as gm
    monkeypatch.setattr(gm, "gather_qk", gm.gather_qk_reference)
    monkeypatch.setattr(gm, "gather_qk_ws", lambda q, kv, idx: gm.gather_qk_reference(q, kv, idx).at[:, 16:32].set(0))
    assert not tr.applicable("gather", "layout", True) and not tr.applicable("gather", "heads", False)
    for case in tr.GATHER_CASES:
        r = tr.run_case("gather", case, interpret=False)
        said = tr.diagnose(r["checks"], r["bounds"])
        if case == "blocks_3":  # all invalid: both give zeros
            assert said == "ok" and r["checks"]["gather_qk"]["invalid_slots"] == 64 * 64
        else:
            assert "gather_qk:" not in said and "gather_qk_ws: rel" in said and "key row in 16s 1 of 4" in said, said


def test_chunk_map_says_where_misplaced_chunks_landed():
    """Gathered rows with the 16-byte chunks of block 1 swapped in pairs on odd rows (a swizzle off by one bit) and
    one row copied from a wrong source: the map counts the right, misplaced (by shift) and missing chunks of the one
    wrong block, and the diagnosis quotes them."""
    tr = _triage()
    rng = np.random.default_rng(2)
    want = np.asarray(jnp.asarray(rng.standard_normal((1, 128, 576)), jnp.bfloat16))
    got = want.copy()
    blk = got[0, 64:].reshape(64, 72, 8)
    odd = blk[1::2].copy()
    blk[1::2, 0::2], blk[1::2, 1::2] = odd[:, 1::2], odd[:, 0::2]
    got[0, 64:] = blk.reshape(64, 576)
    got[0, 70] = np.asarray(jnp.asarray(rng.standard_normal(576), jnp.bfloat16))  # row 6 of block 1: wrong source
    valid = np.ones((1, 128), bool)
    m = tr.chunk_map(got, want, valid)
    assert m["blocks_wrong"] == 1 and m["missing"] == 72
    assert m["right"] == 32 * 72 - 72 and m["misplaced"] == 32 * 72
    assert m["shifts"] == {"+0,+1": 32 * 36, "+0,-1": 32 * 36}
    c = tr.breakdown(got, want, [tr.token_part(1), *tr.block_parts(1, 128, "pds")], 0.0)
    c["chunks"] = m
    said = tr.diagnose({"rows": c}, {"rows": 0.0})
    assert "2304 misplaced by (rows,chunks) (+0,+1) x1152, (+0,-1) x1152, 72 missing" in said
    assert "key block (64 slots) 1 of 2" in said and "token 0 block 1 row 1 chunk 0 -> row 1 chunk 1" in said
    assert tr.chunk_map(want, want, valid)["blocks_wrong"] == 0


def test_chunk_map_names_what_a_missing_chunk_holds_instead():
    """Given kv and idx, a missing chunk's place is read back: zeros (row 7 never written), the next kv row (row 3:
    an index off by one), another slot's row (row 9 holds slot 10's), its own row's next chunk (row 5, chunk 2)."""
    tr = _triage()
    rng = np.random.default_rng(3)
    kv = np.asarray(jnp.asarray(rng.standard_normal((200, 576)), jnp.bfloat16))
    idx = 2 * rng.choice(100, (1, 64), replace=False).astype(np.int32)  # even rows: an odd one is no slot's
    want = kv[idx]
    got = want.copy()
    got[0, 7] = 0
    got[0, 3] = kv[idx[0, 3] + 1]
    got[0, 9] = kv[idx[0, 10]]
    got[0, 5, 16:24] = want[0, 5, 24:32]
    m = tr.chunk_map(got, want, np.ones((1, 64), bool), kv, idx)
    assert m["instead"] == {"zeros": 72, "kv row +1 from the selected, chunk +0": 72, "slot +1's row, chunk +0": 72,
                            "its row, chunk +1": 1} and m["missing"] == 3 * 72 + 1
    assert m["misplaced"] == 0 and m["shifts"] == {}  # chunk 3 of row 5 is also in its place: right


def test_echo_targets_run_the_gathers_in_interpret_mode():
    """The echo kernels (`gather_echo_mgpu`) through the triage: the kernels' interpret gathers give kv[idx] and the
    additive mask exactly (the chip runs their cp.async gathers instead)."""
    tr = _triage()
    recs = tr.main(["--interpret", "--targets", "echo-split,echo-block,echo-pp", "--cases", "layout,invalid"])
    assert [(r["target"], r["status"]) for r in recs] == [(t, "ok") for t in ("echo-split", "echo-block",
                                                                              "echo-pp")] * 2
    assert recs[3]["checks"]["mask"]["inf_mismatch"] == 0 and recs[3]["checks"]["rows"]["invalid_slots"] > 0


def test_atomic_target_groups_dkv_rows_by_the_adds_that_meet_on_them(monkeypatch):
    """The atomic backward's target: the real kernels (interpret mode) pass; dkv rows whose adds were lost where two or
    more meet (a race: here the atomic add replaced by a store) are reported in those contention groups only."""
    tr = _triage()
    idx = np.array([[0, 1, 1, 2, 2, 2, -1, 5]])
    c = tr.contention_part(0, np.bincount(idx[idx >= 0], minlength=8))
    assert [c[3][g] for g in c[2]] == ["1", "2-4", "2-4", "0", "0", "1", "0", "0"]  # rows 0-7: 1, 2, 3, 0, 0, 1 adds
    r = tr.run_case("atomic", "tokens", interpret=True)
    assert tr.diagnose(r["checks"], r["bounds"]) == "ok"
    import importlib
    smla = importlib.import_module("dsv32_jax.kernels.sparse_mla")
    store = lambda ref, at, v: ref.__setitem__(at, v)  # noqa: E731  (an add that keeps only the last value)
    monkeypatch.setattr(smla.triton_atomics, "atomic_add", store)
    r = tr.run_case("atomic", "tokens", interpret=True)
    said = tr.diagnose(r["checks"], r["bounds"])
    assert said.startswith("dkv: rel") and "kv rows by selections (atomic adds) 2-4" in said and "dq" not in said
    assert "1," not in said.split("atomic adds) ")[1].split(" of ")[0]  # rows with one add are right


def test_triage_refuses_unknown_targets_and_cases(capsys):
    tr = _triage()
    for argv, what in ((["--targets", "fwd,bwd"], "no target 'bwd'"), (["--cases", "layout,huge"], "no case 'huge'")):
        with pytest.raises(SystemExit):
            tr.main(argv)
        assert what in capsys.readouterr().err


def test_gpu_session_triages_a_failed_group_packs_its_logs_and_keeps_the_deadline(tmp_path):
    """bench/gpu_session.sh (bench/gpu_owed.sh 0's settings, on the CPU): a test group that fails (here: killed by its
    time limit) is followed by the triage of its targets (TEST_TRIAGE; in interpret mode here), whose table lands in
    $OUT; with more files than the device tool brings back, the logs go into logs.tar; and a stage that the call's
    deadline (CALL_END) leaves no time for is skipped instead of run past it."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], OUT=str(tmp_path),
               STAGES="tests", TEST_S="1", TEST_K="chunk_positions", TEST_TRIAGE="fwd-t",
               TRIAGE_ARGS="--interpret --cases layout", OUT_FILES="3")
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", "bench/gpu_session.sh"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert "tests [chunk_positions] rc=124" in r.stdout and "triage [fwd-t] rc=0" in r.stdout, r.stdout + r.stderr
    assert "**fwd-t**: every case ran ok" in (tmp_path / "triage.md").read_text()
    names = set(os.listdir(tmp_path))
    assert {"logs.tar", "triage.jsonl", "triage.md"} <= names and not any(n.endswith(".log") for n in names)
    out = tmp_path / "late"
    out.mkdir()
    import time
    r = subprocess.run(["bash", "bench/gpu_session.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(env, OUT=str(out), STAGES="bench", CALL_END=str(int(time.time()) + 12)))
    assert "bench rc=124" in r.stdout and "skipped" in r.stdout and "before the call's deadline" in r.stdout


@pytest.mark.heavy  # 20 s of a triage killed by its limit
def test_gpu_session_reports_a_triage_case_that_hung(tmp_path):
    """A triage that its time limit ends inside a case (as a hung kernel would) leaves a start line without an end;
    the session's table then names that case as hung, first failure of its target."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], OUT=str(tmp_path),
               STAGES="tests", TEST_S="1", TEST_K="chunk_positions", TEST_TRIAGE="echo-slice", TRIAGE_S="20",
               TRIAGE_ARGS="--interpret --cases tokens")  # 8 tokens through the interpreted slice gather: > 60 s
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", "bench/gpu_session.sh"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert "triage [echo-slice] rc=124" in r.stdout, r.stdout + r.stderr
    assert "**echo-slice**: first failure at `tokens` (hung)" in r.stdout
    assert "| echo-slice | tokens |  | hung |" in (tmp_path / "triage.md").read_text()


def test_triage_case_ladder_shapes_fit_each_kernel():
    """Every case of every sparse MLA kernel is a shape its kernel takes (K a multiple of its block; dq / dkv's of
    128), the ladder grows one thing at a time, and production is the chip tests' shape."""
    tr = _triage()
    from dsv32_jax.kernels import gather_echo_mgpu as ge
    from dsv32_jax.kernels import sparse_mla_mgpu as sm
    for target, (kernel, form, h_full) in tr.TARGETS.items():
        if kernel in ("gather", "indexer"):  # their own cases (test_indexer_ladder_shapes_fit_the_kernel)
            continue
        for case in tr.CASES:
            s = tr.case_shape(kernel, case, h_full, form)
            kv = jax.ShapeDtypeStruct((s["m"], 576), jnp.bfloat16)
            idx = jax.ShapeDtypeStruct((s["n"], s["k"]), jnp.int32)
            if kernel == "echo":  # the echo's own argument check (a block a warpgroup: pairs of blocks)
                jax.eval_shape(lambda kv, i: ge.gather_echo(kv, i, form=form, interpret=True), kv, idx)
                continue
            assert s["k"] % (128 if kernel == "dqkv" else 64) == 0, (target, case)
            q = jnp.zeros((s["n"], s["h"], 576), jnp.bfloat16)
            assert sm.check_shapes(q, kv, idx) is None, (target, case)
        assert tr.case_shape(kernel, "production", h_full, form) == dict(n=64, h=h_full, m=8192, k=2048,
                                                                         pattern="edge")
    idx = tr.make_indices(np.random.default_rng(0), 8, 500, 192, "edge")
    assert (idx[1] == -1).all() and (idx[0, 64:128] == -1).all() and 0.1 < (idx[2:] < 0).mean() < 0.3
    assert (tr.make_indices(None, 1, 64, 64, "contiguous") == np.arange(64)).all()


def test_indexer_targets_run_the_kernel_and_fit_the_accumulator():
    """The FP8 indexer's targets (the chip tests' block settings) in interpret mode: every case run here is ok, and on
    the chip tests' small shapes the accumulator fit is recorded even when they pass; the interpreted kernel sums in
    float32, so "exact" fits best there (the chip's own fit is what calibrates the model)."""
    tr = _triage()
    recs = tr.main(["--interpret", "--targets", "idx-64,idx-k2", "--cases", "one_block,blocks_3,tokens"])
    assert [(r["target"], r["case"], r["status"]) for r in recs] == [
        (t, c, "ok") for c in ("one_block", "blocks_3", "tokens") for t in ("idx-64", "idx-k2")]
    fit = recs[-1]["checks"]["logits"]["model"]["fit"]
    assert fit[0][0] == "exact" and fit[0][1] <= 1e-6 and fit[1][1] > 1e-6, fit
    assert "fit" not in recs[0]["checks"]["logits"]["model"]  # a passing case off the fit shapes is not fitted
    text = tr.summary(recs)
    assert "- idx-k2 `tokens` accumulator fit (max |got - variant| / max |exact|): exact " in text
    assert "`one_block` accumulator fit" not in text
    assert recs[2]["checks"]["mask"]["mismatch"] == 0 and recs[2]["shape"]["pattern"] == "skip_first"


def _indexer_stub(tr, monkeypatch, fn):
    """indexer_logits_mgpu replaced by fn(logits model args, starts, ends) -> [B, T, S] (a chip's output, faked)."""
    from dsv32_jax.kernels import indexer_logits_mgpu as im

    def host(q, k, ks, w, starts, ends):
        f = [np.asarray(np.asarray(x).astype(np.float32), np.float64) for x in (q, k, ks, w)]
        return np.asarray(fn(f, np.asarray(starts), np.asarray(ends)), np.float32)

    def stub(q, k, ks, w, starts, ends, **kw):  # under the triage's jit: a host callback
        import jax
        out = jax.ShapeDtypeStruct((q.shape[0], q.shape[1], k.shape[1]), np.float32)
        return jax.pure_callback(host, out, q, k, ks, w, starts, ends)
    monkeypatch.setattr(im, "indexer_logits_mgpu", stub)


def _masked(logits, starts, ends):
    col = np.arange(logits.shape[-1])[None, None]
    return np.where((col >= starts[..., None]) & (col < ends[..., None]), logits, -np.inf)


def test_indexer_fit_names_the_accumulator_the_chip_rounds_with(monkeypatch):
    """A chip whose accumulator keeps 12 bits rounded to nearest in groups of 16 (or 14 truncated in 32s) passes the
    chip bound (twice the 13-bit model's error) or not, and either way the fit names that accumulator first; a
    bf16-like accumulator (7 bits) fails the bound and the diagnosis quotes the model's error and the closest
    variants; one wgmma tile 1% off is placed in that tile."""
    tr = _triage()
    acc = tr._accumulator()
    for bits, rounding, group in ((12, "rn", 16), (14, "rz", 32)):
        _indexer_stub(tr, monkeypatch, lambda f, st, en: _masked(
            acc.emulate_logits(*f, frac_bits=bits, rounding=rounding, group=group), st, en))
        r = tr.run_case("idx", "tokens", interpret=False)
        fit = r["checks"]["logits"]["model"]["fit"]
        assert fit[0][0] == f"{bits} bits {rounding} /{group}" and fit[0][1] < 1e-6 < 1e-5 < fit[1][1], fit
    _indexer_stub(tr, monkeypatch, lambda f, st, en: _masked(acc.emulate_logits(*f, frac_bits=7), st, en))
    r = tr.run_case("idx", "blocks_2", interpret=False)
    said = tr.diagnose(r["checks"], r["bounds"])
    assert said.startswith("logits: rel") and "the accumulator model's own error" in said, said
    assert "closest accumulators: 11 bits" in said and "mask" not in said, said
    assert "everywhere" in said  # key block 0 is outside every range (no value): not "key block 1 of 2"

    def tile_off(f, st, en):  # the second 64-key wgmma tile of each block 1% off: far outside the model's error
        out = _masked(acc.emulate_logits(*f), st, en)
        out[:, :, 64:128] *= 1.01
        return out
    _indexer_stub(tr, monkeypatch, tile_off)
    said = tr.diagnose(*(lambda r: (r["checks"], r["bounds"]))(tr.run_case("idx", "layout", interpret=False)))
    assert said.startswith("logits: rel") and said.endswith("; 64-key wgmma tile of the block 1 of 2"), said


def test_indexer_mask_faults_are_placed_in_skipped_blocks_or_at_range_edges(monkeypatch):
    """-inf mismatches are told apart: the key blocks the kernel skips left unwritten (zeros) vs a range's end off by
    one (the real kernel in interpret mode with its column index shifted by one), and the logits of the keys that
    both score stay right."""
    tr = _triage()
    from dsv32_jax.kernels import indexer_logits_mgpu as im

    def skipped_zero(f, st, en):
        out = _masked(np.einsum("btsh,bth->bts", np.maximum(np.einsum("bthd,bsd->btsh", f[0], f[1]), 0), f[3])
                      * f[2][:, None], st, en)
        out[:, :, :128] = np.where(np.isneginf(out[:, :, :128]), 0.0, out[:, :, :128])  # block 0: every row skips it
        return out
    _indexer_stub(tr, monkeypatch, skipped_zero)
    r = tr.run_case("idx", "blocks_3", interpret=False)
    mask = r["checks"]["mask"]
    assert mask["mismatch"] == mask["in_skipped_blocks"] == 8 * 128 and "logits" not in tr.diagnose(r["checks"],
                                                                                                       r["bounds"])
    assert mask["bad"]["key block (128)"]["bad"] == ["0"]
    monkeypatch.undo()
    real = im._score_block
    monkeypatch.setattr(im, "_score_block", lambda q, k, ks, w, o, first_key, *a: real(q, k, ks, w, o, first_key - 1,
                                                                                         *a))
    r = tr.run_case("idx-64", "invalid", interpret=True)
    mask = r["checks"]["mask"]
    said = tr.diagnose(r["checks"], r["bounds"])
    assert mask["mismatch"] > 0 and mask["at_range_edges"] == mask["mismatch"], mask
    assert said.startswith("mask:") and "at a range's edge (off by one), 0 elsewhere" in said, said


def test_indexer_ladder_shapes_fit_the_kernel():
    """Every indexer case is a shape its block settings take, with every range inside [0, S]; blocks_N leaves key
    block 0 outside every range (the skipped blocks' -inf is checked), production skips blocks too, and the small
    cases are the chip tests' failing shapes."""
    tr = _triage()
    from dsv32_jax.kernels import indexer_logits_mgpu as im
    for target, (kernel, form, _) in tr.TARGETS.items():
        if kernel != "indexer":
            continue
        bq, bk, _ = form
        for case in tr.CASES:
            s = tr.indexer_case_shape(case, bq, bk)
            q = jax.ShapeDtypeStruct((s["b"], s["t"], s["h"], s["d"]), jnp.float8_e4m3fn)
            assert im.check_shapes(q, jax.ShapeDtypeStruct((s["b"], s["s"], s["d"]), jnp.float8_e4m3fn), bq, bk) \
                is None, (target, case)
            st, en = tr.indexer_ranges(np.random.default_rng(0), s["b"], s["t"], s["s"], s["ranges"], bq, bk)
            assert st.shape == en.shape == (s["b"], s["t"]) and (0 <= st).all() and (en <= s["s"]).all()
            if case.startswith("blocks_") or case == "production":
                assert (st >= bk).all() if case != "production" else (en[:, :bq] <= s["s"] // 2).all(), (target, case)
    assert tr.indexer_case_shape("tokens", 4, 64) == dict(b=2, t=13, s=301, h=8, d=32, ranges="tests")
    assert tr.indexer_case_shape("heads", 4, 64) == dict(b=1, t=3, s=70, h=16, d=128, ranges="full")


def test_indexer_mask_check_maps_skipped_blocks_per_query_block():
    """Two query blocks with different skipped key blocks (block 0's rows see key block 0 only, block 1's key block 2
    only; an empty row widens no range): the -inf of every skipped block left as 0 is counted in skipped blocks, ranges
    scored one and two keys late at a range's edge, and a stray finite value 5 keys past a range (inside a scored
    block) elsewhere."""
    tr = _triage()
    bq, bk, t, s = 4, 64, 8, 192
    starts = np.array([[3, 10, 0, 20, 130, 150, 128, 140]])
    ends = np.array([[40, 60, 64, 30, 180, 192, 170, 140]])  # row 7 empty: it widens no range
    col = np.arange(s)[None, None]
    ref = np.where((col >= starts[..., None]) & (col < ends[..., None]), 1.0, -np.inf)
    got = ref.copy()
    got[0, :4, 64:] = 0.0  # query block 0 skips key blocks 1, 2
    got[0, 4:, :128] = 0.0  # query block 1 skips key blocks 0, 1
    got[0, 0, 40] = 1.0  # row 0's range [3, 40) scored one key late
    got[0, 3, 31] = 1.0  # row 3's range [20, 30) scored two keys late
    got[0, 6, 175] = 2.0  # row 6's range ends at 170: 175 is no edge (5 keys out)
    parts = [tr.part(f"key block ({bk})", 2, s, lambda i: i // bk)]
    m = tr.indexer_mask_check(got, ref, starts, ends, bq, bk, parts)
    skipped = 4 * 128 - int(np.isfinite(ref[0, :4, 64:]).sum()) + 4 * 128 - int(np.isfinite(ref[0, 4:, :128]).sum())
    assert m["in_skipped_blocks"] == skipped and m["at_range_edges"] == 2, m
    assert m["mismatch"] == skipped + 3 and "2 at a range's edge (off by one), 1 elsewhere" in m["value_said"], m


def test_gpu_session_calib_fits_the_accumulator_whatever_the_tests_gave(tmp_path):
    """bench/gpu_session.sh's calib stage (bench/gpu_owed.sh 0: CALIB_TARGETS=idx): the indexer's cases run through
    the triage without a failed test group, the accumulator fit lands in the call's output and $OUT/triage.md, and a
    case that a run in $OUT already ended is not run again (--skip_done), while one that hung there (a start line
    without its end) and one not yet run are."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], OUT=str(tmp_path),
               STAGES="calib", CALIB_TARGETS="idx", CALIB_CASES="tokens", CALIB_ARGS="--interpret")
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", "bench/gpu_session.sh"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert "triage [idx] rc=0" in r.stdout, r.stdout + r.stderr
    line = "- idx `tokens` accumulator fit (max |got - variant| / max |exact|): exact "
    assert line in r.stdout and line in (tmp_path / "triage.md").read_text()
    with open(tmp_path / "triage.jsonl", "a") as f:  # the heads case hung in an earlier run
        f.write(json.dumps({"event": "start", "target": "idx", "case": "heads"}) + "\n")
    env["CALIB_CASES"] = "tokens,heads,invalid"
    r = subprocess.run(["bash", "bench/gpu_session.sh"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert "triage [idx] rc=0" in r.stdout, r.stdout + r.stderr
    ends = [(e["case"]) for e in map(json.loads, (tmp_path / "triage.jsonl").read_text().splitlines())
            if e["event"] == "end"]
    assert sorted(ends) == ["heads", "invalid", "tokens"], ends  # tokens once; heads and invalid run now
    assert "idx tokens      ended in an earlier run: skipped (--skip_done)" in (tmp_path / "triage.log").read_text()
