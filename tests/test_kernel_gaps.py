"""Tests closing the gaps found by mutation testing round 7 of the Pallas kernels (runs/mut7/log.tsv).

The kernel bodies run in interpret mode on CPU (impl="interpret": the Triton GPU kernels, "interpret_tpu": the
Mosaic TPU ones). Every expected value comes from an independent source: float64 numpy written here from the ops'
documented semantics (top-k of the candidates with ties to the lower index, masked-softmax attention and its
gradient, the ue8m0 scale rule), or the plain-JAX reference at float32, never from a kernel's output. Each test
names the mutant(s) it guards."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

from dsv32_jax import kernels

IMPL = "interpret"
TPU = "interpret_tpu"
topk_module = importlib.import_module("dsv32_jax.kernels.topk")


# ------------------------------------------------------------------------------------------------------ top-k
def numpy_topk(x, k, lengths=None):
    """[rows, k] sorted index sets: per row the k largest candidates (columns < length whose value is > -inf, so
    not NaN either), ties to the lower column, -1 for the missing slots (the op's docstring)."""
    x = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
    out = []
    for i, row in enumerate(x):
        n = row.shape[0] if lengths is None else int(np.asarray(lengths).reshape(-1)[i])
        cand = [c for c in range(n) if row[c] > -np.inf]
        best = sorted(cand, key=lambda c: (-row[c], c))[:k]
        out.append(np.sort(best + [-1] * (k - len(best))))
    return np.asarray(out)


def _gpu_topk(x, k, buf, lengths=None):
    out, stats = topk_module._topk_pallas(jnp.asarray(x), None if lengths is None else jnp.asarray(lengths), k=k,
                                          buf=buf, block=256, backend=IMPL, num_warps=8, with_stats=True)
    return np.sort(np.asarray(out), -1), np.asarray(stats)


def test_topk_exact_bracket_with_a_buffer_of_twice_k(rng):
    """The GPU kernel's fallback (stats path 1) at k = 4 with an 8-entry buffer, on rows whose streaming pass
    overflows the buffer through ties at its threshold (the existing tests use k = 20 with a 32-entry buffer and
    never reach these states):
      * a bracket that still holds more keys than the buffer must be split again: row 0 has 11 keys >= its first
        bracket (a tie group below the top values, all at higher columns than the ties) and the compaction keeps
        the first 8 in column order, so the top values are lost if the split stops. Mutant t10: the refine loop
        ran while more than 2 * buf keys were in the bracket (`(s[1] > buf)` -> `(s[1] > 2 * buf)`).
      * the select must read only the fallback's entries of the buffer: row 1's streaming pass filled all 8
        entries (column order) and the fallback rewrote only 5, so entry 5 still holds the pass's key of the row's
        maximum; read as a bracket key, it is counted twice. Mutant t14: `(pos < n_buf)` -> `(pos <= n_buf)` in
        the select (also caught by several of the rounded-Gaussian rows).
    Expected: numpy's top-k (`numpy_topk`)."""
    n, k, buf = 64, 4, 8
    row0 = np.concatenate([-100 + 0.01 * np.arange(53), np.zeros(6), [1, 2, 3, 4, 5]])  # top 4 = columns 60..63
    row1 = -1 - 0.01 * np.arange(n)
    row1[:12] = [4, 4, 4, 4, 4, 8, 6, 5, 5, 5, 4, 4]  # 12 keys >= 4 (the pass's threshold): 8 of them buffered
    ties = np.round(rng.standard_normal((30, n)) * 3)  # heavy ties: most rows overflow the pass's buffer
    x = np.concatenate([row0[None], row1[None], ties]).astype(np.float32)
    out, stats = _gpu_topk(x, k, buf)
    assert stats[0, 5] == 1 and stats[1, 5] == 1  # both constructed rows took the exact bracket
    np.testing.assert_array_equal(out, numpy_topk(x, k))


def test_topk_fallback_row_with_fewer_candidates_than_k(rng):
    """A long row (8192 columns: the streaming pass samples half of it) whose 15 candidates (the rest -inf, as a
    causal row across a segment boundary gives) all lie in the sample: the sampled threshold admits only 13 keys,
    fewer than k = 20, so the row goes to the exact bracket, which must count -inf as no candidate and return the
    15 columns and five -1. Mutant t26: the bracket's smallest candidate key set to -inf's (`lo_init =
    NEG_INF_KEY + 1` -> `NEG_INF_KEY`: five -inf columns returned). Expected: numpy's top-k."""
    n, k, buf = 8192, 20, 32
    x = np.full((1, n), -np.inf, np.float32)
    cols = rng.choice(np.asarray(topk_module.sample_columns(n)), 15, replace=False)
    x[0, cols] = rng.standard_normal(15)
    out, stats = _gpu_topk(x, k, buf)
    assert stats[0, 5] == 1  # the exact bracket ran
    np.testing.assert_array_equal(out, numpy_topk(x, k))
    assert np.sum(out[0] == -1) == 5


def test_topk_bracket_split_always_moves_past_lo():
    """`_split_thresholds`' contract, which the exact bracket's refine loop needs to end: for lo < hi, 16
    non-decreasing thresholds in [lo, hi], the first == lo and the second > lo (so every split pass either raises lo
    or lowers hi below the second threshold). Checked on brackets of width 1, 2, 15, 16, 17 ulps, at the int32
    extremes, across zero and on 2000 random brackets; the thresholds come from the 16-way split rule, the checks
    from the contract alone. Mutant t20: thresholds rounded down (`+ (N_THRESH - 1)` dropped: a 1-ulp bracket
    gives lo 16 times and the loop never ends on a chip; in interpret mode it hangs the test below)."""
    rng = np.random.default_rng(20)
    int_min, int_max = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    pairs = [(a, a + w) for a in (int_min, -17, -1, 0, 1065353216, int_max - 20) for w in (1, 2, 15, 16, 17, 20)]
    pairs += [(int_min, int_max), (int_min, 0), (-1, int_max)]
    a = rng.integers(int_min, int_max, 2000, dtype=np.int64)
    b = a + rng.integers(1, 1 << rng.integers(1, 32, 2000), dtype=np.int64)
    pairs += [(int(x), int(min(y, int_max))) for x, y in zip(a, b) if x < min(y, int_max)]
    lo, hi = (jnp.asarray([p[i] for p in pairs], jnp.int32) for i in (0, 1))
    t = np.asarray(jax.vmap(topk_module._split_thresholds)(lo, hi)).astype(np.int64)
    lo, hi = np.asarray(lo, np.int64)[:, None], np.asarray(hi, np.int64)[:, None]
    assert np.all((t >= lo) & (t <= hi)) and np.all(np.diff(t, axis=1) >= 0)
    assert np.all(t[:, 0] == lo[:, 0]) and np.all(t[:, 1] > lo[:, 0])


def test_topk_bracket_refined_to_one_ulp_with_more_keys_than_the_buffer():
    """A row whose bracket narrows to one ulp while more keys than the buffer lie in it: 4064 copies of 1.0 and 32
    keys 2 ulps above (k = 64, buffer 1024). The streaming pass admits all 4096 (more than the buffer), the exact
    bracket's first thresholds (sample keys) give [key(1.0), key(1.0) + 1] with 4096 keys >= lo, and one split pass
    must close it to lo = hi = key(1.0) (stats), then the select takes the 32 high keys and the first 32 ties.
    Mutant t20 hangs here. Expected: numpy's top-k."""
    n, k, buf = 4096, 64, 1024
    one = np.float32(1.0)
    high = np.nextafter(np.nextafter(one, np.float32(2)), np.float32(2))
    row = np.full(n, one, np.float32)
    row[::128] = high
    x = np.stack([row, np.roll(row, 5)])
    out, stats = _gpu_topk(x, k, buf)
    key = int(one.view(np.int32))
    assert np.all(stats[:, 5] == 1) and np.all(stats[:, 0] == key) and np.all(stats[:, 1] == key)
    np.testing.assert_array_equal(out, numpy_topk(x, k))


# ------------------------------------------------------------------------------------------------- sparse MLA
def numpy_sparse_mla(q, kv, idx, scale, d_v):
    """float64 eq. (2): per (b, t, h) the softmax of scale * q . kv[b, idx] over the valid slots (0 <= idx < S,
    duplicates counted twice), out = P V (V = the first d_v dims), lse natural log; no valid slot: out 0, lse
    -inf. Returns (out, lse, P summed over heads)."""
    q, kv, idx = np.asarray(q, np.float64), np.asarray(kv, np.float64), np.asarray(idx)
    b, t, h, _ = q.shape
    valid = (idx >= 0) & (idx < kv.shape[1])
    rows = kv[np.arange(b)[:, None, None], np.where(valid, idx, 0)]  # [B, T, K, D]
    logits = np.where(valid[:, :, None, :], scale * np.einsum("bthd,btkd->bthk", q, rows), -np.inf)
    m = np.max(logits, axis=-1, keepdims=True)
    e = np.where(valid[:, :, None, :], np.exp(logits - np.where(np.isfinite(m), m, 0)), 0.0)
    l = np.sum(e, axis=-1, keepdims=True)
    p = e / np.where(l > 0, l, 1)
    lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1)), -np.inf)
    return np.einsum("bthk,btkd->bthd", p, rows[..., :d_v]), lse, p.sum(axis=2)


# float32 kernels against float64 numpy: measured ~3e-7 on these inputs; 1e-5 as the kernel tests' fp32 bound
F32_BOUND = 1e-5


def test_sparse_mla_out_of_range_slot_of_an_earlier_batch_is_empty(rng):
    """topk_idx >= S is an empty slot in every batch row (the op's docstring). The wrapper makes the indices global
    (b * S + idx); an index >= S of batch 0 must not become a row of batch 1 (the existing case puts its
    out-of-range index in the last batch, where the kernel's own bound on B * S hides the mistake). Mutant s27:
    `(idx >= 0) & (idx < s)` -> `(idx >= 0)` in `_prepare`. Expected: float64 numpy attention."""
    b, t, s, h, d, d_v, k = 2, 3, 6, 4, 40, 32, 8
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    kv = rng.standard_normal((b, s, d)).astype(np.float32)
    idx = rng.integers(0, s, (b, t, k)).astype(np.int32)
    idx[0, 0, [1, 5]] = [s, s + 3]  # both would be rows 0 and 3 of batch 1
    idx[0, 2, :] = s + np.arange(k)  # a row of only out-of-range slots: out 0, lse -inf
    out, lse, probs = kernels.sparse_mla(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(idx), d ** -0.5, d_v,
                                         return_probs=True, impl=IMPL, block_h=16, block_i=16)
    w_out, w_lse, w_probs = numpy_sparse_mla(q, kv, idx, d ** -0.5, d_v)
    assert rel_err(out, w_out) <= F32_BOUND
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(w_lse))
    assert np.all(np.asarray(out)[0, 2] == 0)
    finite = np.isfinite(w_lse)
    assert rel_err(np.asarray(lse)[finite], w_lse[finite]) <= F32_BOUND
    assert rel_err(probs, w_probs) <= F32_BOUND


# ---------------------------------------------------------------------------------------------- hadamard_quant
def test_hadamard_quant_scale_at_an_exact_power_of_two_and_the_amax_floor():
    """ue8m0 scale = 2^ceil(log2(max(amax, 1e-4) / 448)) per row, amax the rotated row's max |y| (reference_spec.md
    5.3, `act_quant`). Rows a * e_0 rotate to y = a * 128^-1/2 in every entry (row 0 of the Sylvester matrix is all
    ones; one rounding), with a chosen so that amax = 448 * 2^e exactly: the scale is 2^e itself, not 2^(e + 1)
    (random rows never land on a power of two). Zero and tiny rows take the 1e-4 floor (random rows in the other
    tests all have amax > 1e-3). Mutants: h01, the exponent always rounded up (`where((bits & 0x7FFFFF) != 0,
    exponent + 1, exponent)` -> `exponent + 1`); h02, the floor at 1e-6. Expected: float64 numpy from that
    formula; scale_fmt=None gives amax / 448 itself."""
    r = np.float32(128 ** -0.5)  # the kernel's 128^-1/2 in float32
    a = next(v for v in (np.float32(448 / float(r)) * np.float32(f) for f in (1.0, 1 - 2**-23, 1 + 2**-23))
             if v * r == np.float32(448))  # fl32(a * r) == 448 exactly
    powers = np.array([0, -3, 5, -10])
    x = np.zeros((6, 128), np.float32)
    x[:4, 0] = a * np.exp2(powers).astype(np.float32)  # amax = 448 * 2^e (scaling by 2^e is exact)
    x[5] = 1e-9 * np.sign(np.arange(128) - 63.5)  # a tiny row: amax = 1e-9 * 128^1/2 < 1e-4; row 4 stays zero
    amax = np.maximum(np.concatenate([448 * np.exp2(powers), [0.0, 1e-9 * 128**0.5]]), 1e-4)
    for fmt, want in (("ue8m0", np.exp2(np.ceil(np.log2(amax / 448)))), (None, amax / 448)):
        codes, scale = kernels.hadamard_quant(jnp.asarray(x), scale_fmt=fmt, impl=IMPL)
        scale = np.asarray(scale, np.float64)
        if fmt == "ue8m0":
            np.testing.assert_array_equal(scale, want)
        else:  # float32 amax / 448 against float64: an ulp or two
            np.testing.assert_allclose(scale, want, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(codes[:4], np.float32), 448.0)  # y / scale = 448 in every entry
        np.testing.assert_array_equal(np.asarray(codes[4], np.float32), 0.0)


def numpy_sparse_mla_grads(q, kv, idx, scale, d_v, w_out, w_lse):
    """float64 gradient of sum(out * w_out) + sum(lse * w_lse) (rows with a finite lse) w.r.t. q and kv, from the
    softmax's derivative: dP = dO V^T, dS = P (dP - rowsum(O dO) + dlse), dq = scale dS K, and per valid slot
    dkv[idx] += scale dS^T q (all Dqk dims) + P^T dO (the value dims)."""
    q, kv, idx = np.asarray(q, np.float64), np.asarray(kv, np.float64), np.asarray(idx)
    b, t, h, d = q.shape
    out, lse, _ = numpy_sparse_mla(q, kv, idx, scale, d_v)
    valid = (idx >= 0) & (idx < kv.shape[1])
    safe = np.where(valid, idx, 0)
    rows = kv[np.arange(b)[:, None, None], safe]
    logits = np.where(valid[:, :, None, :], scale * np.einsum("bthd,btkd->bthk", q, rows), -np.inf)
    p = np.where(np.isfinite(lse)[..., None], np.exp(logits - np.where(np.isfinite(lse), lse, 0)[..., None]), 0.0)
    dp = np.einsum("bthd,btkd->bthk", w_out, rows[..., :d_v])
    dlse = np.where(np.isfinite(lse), w_lse, 0.0)
    ds = p * (dp - np.sum(out * w_out, axis=-1, keepdims=True) + dlse[..., None])
    dq = scale * np.einsum("bthk,btkd->bthd", ds, rows)
    per_slot = scale * np.einsum("bthk,bthd->btkd", ds, q)
    per_slot[..., :d_v] += np.einsum("bthk,bthd->btkd", p, w_out)
    dkv = np.zeros_like(kv)
    bb = np.broadcast_to(np.arange(b)[:, None, None], idx.shape)
    np.add.at(dkv, (bb[valid], safe[valid]), per_slot[valid])
    return dq, dkv


def _kernel_grads(q, kv, idx, scale, d_v, w_out, w_lse, **kw):
    def f(q_, kv_):
        out, lse = kernels.sparse_mla(q_, kv_, jnp.asarray(idx), scale, d_v, **kw)
        return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) * w_lse)
    return jax.grad(f, argnums=(0, 1))(jnp.asarray(q), jnp.asarray(kv))


def test_sparse_mla_stored_backward_token_chunks_that_do_not_divide_the_tokens(rng):
    """The stored and atomic GPU backwards walk the tokens in chunks of bwd_partial_bytes; with 7 tokens and
    10240 bytes the chunks are 2 tokens (stored: 5120 B of partials + P / dS per token at these tiles) and 5
    (atomic: 2048 B of P / dS per token), so the last chunk is padded (the kernel tests' chunks always divide the
    tokens). dq must be cut from the front of the padded chunks. Mutant s35: `[:n]` -> `[-n:]` (dq of the wrong
    tokens). Expected: the float64 numpy gradient; fp32 bound as the forward's (measured ~5e-7)."""
    b, t, s, h, d, d_v, k = 1, 7, 9, 4, 40, 32, 8
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    kv = rng.standard_normal((b, s, d)).astype(np.float32)
    idx = rng.integers(0, s, (b, t, k)).astype(np.int32)
    idx[0, 3, :5] = -1
    w_out = rng.standard_normal((b, t, h, d_v)).astype(np.float32)
    w_lse = rng.standard_normal((b, t, h)).astype(np.float32)
    want = numpy_sparse_mla_grads(q, kv, idx, d ** -0.5, d_v, w_out, w_lse)
    for bwd in ("stored", "atomic"):
        got = _kernel_grads(q, kv, idx, d ** -0.5, d_v, w_out, w_lse, impl=IMPL, bwd=bwd, bwd_partial_bytes=10240)
        for g, w in zip(got, want):
            assert rel_err(g, w) <= F32_BOUND, bwd


# bf16 kernels against float64 numpy on the same bf16-valued inputs (tests/test_kernels.py's bf16 bounds: P and dS
# are rounded to bf16 before their MMAs, measured ~3e-3 forward / ~5e-3 gradients there)
BF16_FWD_BOUND, BF16_GRAD_BOUND = 1e-2, 2e-2


def test_sparse_mla_tpu_bf16_value_dims_in_both_planes(rng):
    """The TPU kernels gather bf16 rows as 32-bit words of two planes, plane p holding the p-th half of the padded
    value dims (dv_p = 256 here) and of the rope dims. With the kernel tests' d_v = 32 the second plane's value half
    is all padding, so any mistake in how the value dims of plane 1 enter P V, dO V^T or P^T dO cancels out; at
    d_v = 160 (production: 512, two planes of 256) dims 128..159 live in plane 1. Forward and both gradients
    against float64 numpy. Mutants: p13, dP from plane 0 only (`for i in range(1, lay.planes)` -> `range(1, 1)`);
    p21, P V of every plane from plane 0's rows (`k[i][:, :lay.v_width]` -> `k[0][...]`); p22, P^T dO of every
    plane from plane 0's dO (`do_ref[i]` -> `do_ref[0]`); also, without the heavy bf16 cases of
    tests/test_kernels.py, p12, p14 and p19 (the plane offset of the dkv segment sum, dS K and dS^T q from plane 0)."""
    b, t, s, h, d_v, d_tail, k = 1, 2, 6, 3, 160, 8, 8
    d = d_v + d_tail
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    q, kv = bf(rng.standard_normal((b, t, h, d))), bf(rng.standard_normal((b, s, d)))
    idx = rng.integers(0, s, (b, t, k)).astype(np.int32)
    idx[0, 1, 5:] = -1
    w_out = rng.standard_normal((b, t, h, d_v)).astype(np.float32)
    w_lse = rng.standard_normal((b, t, h)).astype(np.float32)
    scale = d ** -0.5
    q16, kv16 = jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16)
    out, lse = kernels.sparse_mla(q16, kv16, jnp.asarray(idx), scale, d_v, impl=TPU, block_i=8)
    want_out, want_lse, _ = numpy_sparse_mla(q, kv, idx, scale, d_v)
    assert rel_err(out, want_out) <= BF16_FWD_BOUND
    assert rel_err(lse, want_lse) <= BF16_FWD_BOUND
    got = _kernel_grads(q16, kv16, idx, scale, d_v, w_out, w_lse, impl=TPU, block_i=8)
    for g, w in zip(got, numpy_sparse_mla_grads(q, kv, idx, scale, d_v, w_out, w_lse)):
        assert rel_err(g, w) <= BF16_GRAD_BOUND


# ------------------------------------------------------------------------------------------------ indexer_topk
def test_indexer_topk_fp8_query_outside_its_segments_key_run(rng):
    """A key range [segment start, q_index + 1) is exact only if the query's own slot lies in its segment (the
    module docstring); here the segment ids form contiguous runs ([0] * 6 + [1] * 10) but three queries of segment
    0 sit at slots 10..12, inside segment 1's run, so their ranges cover keys of segment 1 and the kernels must take
    the masked branch. Contract: only keys of the query's segment at or before it (here 0..5) are selected, as in
    the reference. Mutant i08: the coverage check made vacuous (`(last == q_segment)` -> `(last >= 0)`: segment 1's
    keys selected). Expected: the structural rule and the plain-JAX reference selection."""
    from dsv32_jax.model import indexer as ref_indexer

    b, t, s, h, topk = 1, 3, 16, 4, 4
    q = jnp.asarray(rng.standard_normal((b, t, h, 128)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, 128)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
    q_index = jnp.asarray([[10, 11, 12]], jnp.int32)
    q_seg = jnp.zeros((b, t), jnp.int32)
    kv_seg = jnp.asarray([[0] * 6 + [1] * 10], jnp.int32)
    out = np.asarray(kernels.indexer_topk(q, k, w, q_index, q_seg, kv_seg, topk, fp8=True, impl=IMPL))
    assert np.all((out >= 0) & (out < 6)), out
    ref = ref_indexer.indexer_topk(q, k, w, q_index, q_seg, kv_seg, topk, fp8=True)
    np.testing.assert_array_equal(np.sort(out, -1), np.sort(np.asarray(ref), -1))


# ---------------------------------------------------------------------------------------------------- dispatch
def test_impl_resolves_from_the_active_meshs_devices_before_the_default_device(monkeypatch):
    """`target_device`: the first device of the active mesh, then jax.default_device, then the default backend's.
    A mesh of (stand-in) TPU devices on this CPU host, with jax.default_device set to the CPU: impl=None resolves
    to the TPU kernels. (With the suite's one-device CPU meshes the mesh's device is also the default device, so
    skipping the mesh changed nothing.) Mutant d05: the mesh branch skipped (`if isinstance(mesh,
    jax.sharding.Mesh):` -> `if False:`)."""
    from dsv32_jax.kernels import _dispatch
    from dsv32_jax.model import sharding as shd

    class StandInTpu:
        platform, id, process_index = "tpu", 7, 0

    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(_dispatch, "_default_impl", None)
    mesh = jax.sharding.Mesh(np.array([StandInTpu()], dtype=object), ("fsdp",))
    backends = ("pallas_gpu", "pallas_tpu", "interpret")
    with jax.default_device(jax.devices("cpu")[0]):
        assert _dispatch.resolve_impl(None, backends) == "reference"
        with shd.use_mesh(mesh):
            assert _dispatch.target_device() is mesh.devices.flat[0]
            assert _dispatch.resolve_impl(None, backends) == "pallas_tpu"


# ------------------------------------------------------------------------- argument checks (audit 2026-12-06)


def _indexer_inputs(rng, b=1, t=2, h=4, s=16, d=128):
    from dsv32_jax.model import indexer as ri

    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
    return ri.quantize_indexer(q, k, w)


@pytest.mark.parametrize("impl", ["interpret", "interpret_tpu"])
def test_indexer_logits_names_a_mismatched_argument(impl, rng):
    """Mismatched heads, D or k_scale came back as NaN (interpret mode's padding for the reads past an argument's
    end; on a chip, whatever memory held), and a [B, 1] range made the interpreted Triton kernel loop on garbage
    bounds (a hang). Each is a ValueError naming the argument; a range that broadcasts still runs."""
    qf, kf, ks, wf = _indexer_inputs(rng)
    for args, kw, msg in (
            ((qf, kf, ks, wf[..., :2]), {}, r"weights must be \[B, T, H\] = \(1, 2, 4\), got shape \(1, 2, 2\)"),
            ((qf, kf[..., :64], ks, wf), {}, r"k_fp8 must be \[B, S, D\] = \[1, S, 128\] .*got shape \(1, 16, 64\)"),
            ((qf, kf, ks[:, :5], wf), {}, r"k_scale must be \[B, S\] = \(1, 16\), got shape \(1, 5\)"),
            ((qf[0], kf, ks, wf), {}, r"q_fp8 must be \[B, T, H, D\], got shape \(2, 4, 128\)"),
            ((qf, kf, ks, wf), {"starts": jnp.zeros((1, 3), jnp.int32)},
             r"starts of shape \(1, 3\) must broadcast to \(B, T\) = \(1, 2\)")):
        with pytest.raises(ValueError, match=r"^indexer_logits: " + msg):
            kernels.indexer_logits(*args, impl=impl, **kw)
    want = kernels.indexer_logits(qf, kf, ks, wf, starts=jnp.zeros((1, 2), jnp.int32),
                                  ends=jnp.full((1, 2), 9, jnp.int32), impl="reference")
    got = kernels.indexer_logits(qf, kf, ks, wf, starts=jnp.zeros((1, 1), jnp.int32), ends=9, impl=impl)
    assert np.isinf(np.asarray(got)[..., 9:]).all()
    assert rel_err(np.asarray(got)[..., :9], np.asarray(want)[..., :9]) <= 1e-6


@pytest.mark.parametrize("impl", ["reference", "interpret", "interpret_tpu"])
@pytest.mark.parametrize("k", [0, -1, 2.5, True])
def test_topk_refuses_a_k_that_is_not_a_positive_integer(impl, k):
    """k=-1 returned [..., 0] on the TPU path and failed deep in Pallas on the GPU one (k=0, 2.5 too)."""
    scores = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 64)), jnp.float32)
    with pytest.raises(ValueError, match=rf"^topk: k must be an integer >= 1, got {k!r}$"):
        kernels.topk(scores, k, impl=impl)


def test_hadamard_quant_refuses_block_rows_below_one_and_takes_no_rows():
    with pytest.raises(ValueError, match=r"^hadamard_quant: block_rows must be an integer >= 1, got 0$"):
        kernels.hadamard_quant(jnp.ones((4, 128)), impl="interpret", block_rows=0)
    for impl in ("interpret", "interpret_tpu"):  # (a ZeroDivisionError / an out-of-bound slice)
        codes, scale = kernels.hadamard_quant(jnp.zeros((0, 128)), impl=impl)
        assert codes.shape == (0, 128) and scale.shape == (0,)


# ------------------------------------------------------------------------------------------------ indexer_topk
def _topk_args(rng, b=1, t=2, s=8, h=2, d=128):
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
    q_index = jnp.broadcast_to(jnp.arange(s - t, s, dtype=jnp.int32), (b, t))
    return q, k, w, q_index, jnp.zeros((b, t), jnp.int32), jnp.zeros((b, s), jnp.int32)


def _indexer_topk_fn(impl):
    from dsv32_jax.model import indexer as ref_indexer

    if impl == "model":  # the model's own reference (dsv32_jax.model.indexer), which takes no impl
        return ref_indexer.indexer_topk
    return lambda *a, **kw: kernels.indexer_topk(*a, impl=impl, **kw)


@pytest.mark.parametrize("impl", ["model", "reference", "interpret", "interpret_tpu"])
def test_indexer_topk_names_a_mismatched_argument(impl, rng):
    """A kv_segment shorter than k clipped every query's causal range to its length: keys past it were never chosen,
    with no error (fp8 kernel path); [B, 1] query ids, a [B, T, 1] w and a batch-2 k broadcast against a batch-1
    q; e4m3 codes with their k_scale but fp8=False were scored as unrotated float keys (a wrong selection); q_chunk
    0 was a ZeroDivisionError. Each is now a ValueError naming the argument, in the model's reference and in the
    kernel composition alike. Mutants: the kv_segment shape check dropped; the k_scale / fp8 check dropped."""
    from dsv32_jax.model.indexer import quantize_keys

    fn = _indexer_topk_fn(impl)
    q, k, w, qi, qs, ks = _topk_args(rng)
    codes, scale = quantize_keys(k)
    for args, kw, msg in (
            ((q, k, w, qi, qs, ks[:, :3]), {}, r"kv_segment must have shape \(1, 8\) .*got \(1, 3\)"),
            ((q, k, w, qi, qs, jnp.zeros((1, 12), jnp.int32)), {}, r"kv_segment must have shape \(1, 8\)"),
            ((q, k, w, qi[:, :1], qs, ks), {}, r"q_index must have shape \(1, 2\) .*got \(1, 1\)"),
            ((q, k, w, qi, qs[:, :1], ks), {}, r"q_segment must have shape \(1, 2\)"),
            ((q, k, w[..., :1], qi, qs, ks), {}, r"w must have shape \(1, 2, 2\)"),
            ((q, jnp.concatenate([k, k]), w, qi, qs, ks), {}, r"k must be \[B, S, D\] = \[1, S, 128\]"),
            ((q[0], k, w, qi, qs, ks), {}, r"q must be \[B, T, H_I, D\], got shape \(2, 2, 128\)"),
            ((q, codes, w, qi, qs, ks), {"k_scale": scale}, r"k_scale goes with fp8=True and k given as e4m3 codes"),
            ((q, k, w, qi, qs, ks), {"k_scale": scale, "fp8": True}, r"k_scale goes with fp8=True and k given as"),
            ((q, codes, w, qi, qs, ks), {"fp8": True}, r"k is e4m3 codes \(float8_e4m3fn\): pass their k_scale"),
            ((q, codes, w, qi, qs, ks), {"k_scale": scale[:, :4], "fp8": True}, r"k_scale must have shape \(1, 8\)"),
            ((q, k, w, qi, qs, ks), {"q_chunk": 0}, r"q_chunk must be None or an integer >= 1, got 0"),
            ((q, k, w, qi, qs, ks), {"q_chunk": 2.5}, r"q_chunk must be None or an integer >= 1, got 2.5")):
        with pytest.raises(ValueError, match=r"^indexer_topk: " + msg):
            fn(*args[:6], 4, **kw)
    for topk in (0, 2.0, True):
        with pytest.raises(ValueError, match=rf"^indexer_topk: topk must be an integer >= 1, got {topk!r}$"):
            fn(q, k, w, qi, qs, ks, topk)
    if impl in ("interpret", "interpret_tpu"):  # integer logits truncated scores and the -inf mask (fp8=False)
        with pytest.raises(ValueError, match=r"^indexer_topk: logits_dtype must be float32 or bfloat16, got int32$"):
            fn(q, k, w, qi, qs, ks, 4, logits_dtype=jnp.int32)


@pytest.mark.parametrize("impl", ["model", "interpret", "interpret_tpu"])
@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_topk_with_no_keys_or_no_queries(impl, fp8, rng):
    """S = 0 was an argmax of an empty sequence, T = 0 a slice error in indexer_logits (and a reduction of an empty
    array in the reference's exact path): both are empty selections [B, T, min(topk, S)], the contract's shape."""
    fn = _indexer_topk_fn(impl)
    q, k, w, qi, qs, ks = _topk_args(rng, b=2)
    out = fn(q, k[:, :0], w, jnp.zeros_like(qi), qs, ks[:, :0], 4, fp8=fp8)
    assert out.shape == (2, 2, 0) and out.dtype == jnp.int32
    out = fn(q[:, :0], k, w[:, :0], qi[:, :0], qs[:, :0], ks, 4, fp8=fp8)
    assert out.shape == (2, 0, 4) and out.dtype == jnp.int32


def test_hadamard_quant_codes_equal_the_reference_on_rounding_midpoints():
    """The kernel sums the +-1 products and then scales by 128^-1/2 (as fast_hadamard_transform(x, scale) does);
    the reference multiplied by a matrix of +-128^-1/2 entries, which rounds differently: about one value in 1e5
    fell on the other side of an e4m3 midpoint (8192 rows of N(0, 37.3^2): 16 codes), a different code and so a
    different selection when two keys tie. Expected: the rotation within float32 rounding of float64 numpy's x @ H
    128^-1/2, and the kernel's codes and scales equal to the reference's, all of them (on CPU both sum the 128
    products in the same order; a chip's order may differ, test_hadamard_quant_matches_reference_exactly allows
    that). Mutant: the reference's matrix scaled first again (`hadamard_matrix(d) * d**-0.5`: 16 codes differ)."""
    from dsv32_jax.model.fp8 import hadamard_matrix, hadamard_rotate

    x = (np.random.default_rng(0).standard_normal((8192, 128)) * 37.3).astype(np.float32)
    y = np.asarray(hadamard_rotate(jnp.asarray(x)), np.float64)
    want = x.astype(np.float64) @ hadamard_matrix(128).astype(np.float64) * 128 ** -0.5
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-6 * np.abs(want).max())
    codes, scale = kernels.hadamard_quant(jnp.asarray(x), impl=IMPL, block_rows=1024)
    ref_codes, ref_scale = kernels.hadamard_quant(jnp.asarray(x), impl="reference")
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(ref_scale))
    np.testing.assert_array_equal(np.asarray(codes, np.float32), np.asarray(ref_codes, np.float32))


@pytest.mark.parametrize("impl", ["interpret", "interpret_tpu"])
def test_hadamard_quant_keeps_a_nan_rows_scale_nan(impl):
    """A NaN row's ue8m0 scale came back as -0.0 from the kernel (the NaN's mantissa carried into the sign bit)
    where the reference keeps NaN, as `ue8m0_round_up` documents; an inf row keeps inf codes clipped, as both."""
    x = jnp.ones((2, 128), jnp.float32).at[0, 3].set(jnp.nan)
    _, scale = kernels.hadamard_quant(x, impl=impl)
    _, ref_scale = kernels.hadamard_quant(x, impl="reference")
    assert np.isnan(np.asarray(scale)[0]) and np.isnan(np.asarray(ref_scale)[0])
    assert np.asarray(scale)[1] == np.asarray(ref_scale)[1] == 2.0 ** -5


# ---------------------------------------------------------------------------------------------- sparse_mla args
def _mla_args(rng, b=1, t=2, s=6, h=2, d=40, k=4):
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, s, (b, t, k)), jnp.int32)
    return q, kv, idx


@pytest.mark.parametrize("impl", ["reference", "interpret", "interpret_tpu"])
def test_sparse_mla_names_a_bad_argument_on_every_impl(impl, rng):
    """A 4-D kv ran on its first plane (interpret), a float topk_idx was truncated (-0.5 -> the valid slot 0), an
    e4m3 kv rounded q and P to e4m3 (5e-2 off), d_v 32.0 / scale NaN were a TypeError / all-NaN output, and a bwd
    or stored_tiles typo passed on the reference (a CPU) to fail only on a GPU. Each is a ValueError naming the
    argument, whichever impl runs. Mutants: the topk_idx dtype check dropped; the early backward-option check
    dropped (the reference accepts bwd='bogus')."""
    from dsv32_jax.kernels.sparse_mla import StoredTiles

    q, kv, idx = _mla_args(rng)
    for args, kw, msg in (
            ((q, kv[:, :, None], idx, 0.1, 32), {}, r"needs q \[B, T, H, Dqk\], kv \[B, S, Dqk\], topk_idx \[B, T, K\]"),
            ((q[0], kv, idx, 0.1, 32), {}, r"needs q \[B, T, H, Dqk\]"),
            ((q, kv, idx.astype(jnp.float32) - 0.5, 0.1, 32), {}, r"topk_idx must be an integer array \(got float32\)"),
            ((q, kv, idx, 0.1, 32.0), {}, r"d_v must be an integer \(got 32.0\)"),
            ((q, kv, idx, float("nan"), 32), {}, r"scale must be finite \(got nan\)"),
            ((q, kv[..., :32], idx, 0.1, 32), {}, r"q \(1, 2, 2, 40\) / kv \(1, 6, 32\) need the same last dim Dqk"),
            ((q, kv, idx[:, :1], 0.1, 32), {}, r"batch/token dims of q \(1, 2, 2, 40\)"),
            ((q, kv.astype(jnp.float8_e4m3fn), idx, 0.1, 32), {}, r"kv must be float32, bfloat16 or float16 \(got "
                                                                  r"float8_e4m3fn"),
            ((q, kv, idx, 0.1, 32), {"bwd": "bogus"}, r"bwd='bogus' must be one of"),
            ((q, kv, idx, 0.1, 32), {"stored_tiles": "bogus"}, r"stored_tiles must be a sparse_mla.StoredTiles"),
            ((q, kv, idx, 0.1, 32), {"stored_tiles": StoredTiles(pds_slots=3)}, r"StoredTiles.pds_slots=3")):
        with pytest.raises(ValueError, match=r"^sparse_mla: " + msg):
            kernels.sparse_mla(*args, impl=impl, **kw)
    if impl != "reference":  # the kernels compile scale in: a traced one was a ConcretizationTypeError
        with pytest.raises(ValueError, match=r"^sparse_mla: impl='interpret(_tpu)?' compiles scale into its kernels"):
            jax.jit(lambda sc: kernels.sparse_mla(q, kv, idx, sc, 32, impl=impl))(0.1)


@pytest.mark.parametrize("impl", ["interpret", "interpret_tpu"])
def test_sparse_mla_int64_indices_past_int32_are_empty_slots(impl, rng):
    """Under jax_enable_x64 an int64 index 2^32 + 1 was cast to int32 before the range check: the valid key 1. The
    range is checked in the caller's dtype now. Expected: the reference (which reads such slots as empty), and the
    same result as -1 in those slots. Mutant: the cast before the check again."""
    q, kv, _ = _mla_args(rng, t=1)
    with jax.enable_x64(True):
        idx = jnp.asarray([[[2**32 + 1, 2**32 + 2, -(2**32) + 3, 5]]], jnp.int64)
        out, lse = kernels.sparse_mla(q, kv, idx, 0.1, 32, impl=impl)
        want_out, want_lse = kernels.sparse_mla(q, kv, jnp.asarray([[[-1, -1, -1, 5]]], jnp.int32), 0.1, 32,
                                                impl="reference")
    assert rel_err(lse, want_lse) <= 1e-6 and rel_err(out, want_out) <= 1e-6


@pytest.mark.parametrize("impl", ["reference", "interpret", "interpret_tpu"])
def test_sparse_mla_with_no_keys_slots_tokens_or_heads(impl, rng):
    """K = 0 or S = 0 were a reduction of an empty array (the reference) and Pallas slice errors or a block_i=0
    the caller never passed (the kernels); T, B or H = 0 a ZeroDivisionError in the kernels. The contract (a row
    with no valid slot: out 0, lse -inf; the probabilities [B, T, K]) holds for each, with zero gradients."""
    q, kv, idx = _mla_args(rng)
    for qq, kk, ii in ((q, kv, idx[..., :0]), (q, kv[:, :0], idx), (q[:, :0], kv, idx[:, :0]),
                       (q[..., :0, :], kv, idx), (q[:0], kv[:0], idx[:0])):
        out, lse, probs = kernels.sparse_mla(qq, kk, ii, 0.1, 32, impl=impl, return_probs=True)
        assert out.shape == (*qq.shape[:3], 32) and lse.shape == qq.shape[:3] and probs.shape == ii.shape
        assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
        assert np.all(np.asarray(probs) == 0)
        dq, dkv = jax.grad(lambda a, c: jnp.sum(kernels.sparse_mla(a, c, ii, 0.1, 32, impl=impl)[0]), (0, 1))(qq, kk)
        assert dq.shape == qq.shape and dkv.shape == kk.shape
        assert not np.any(np.asarray(dq)) and not np.any(np.asarray(dkv))


@pytest.mark.parametrize("impl", ["reference", "interpret", "interpret_tpu"])
def test_sparse_mla_nan_in_a_row_no_valid_slot_selects(impl, rng):
    """kv row 0 (the reference's stand-in for an empty slot) holding NaN made the reference's out, dq and dkv NaN
    (0 * NaN in P V and dS K) while the kernels stayed finite. Expected: the result with row 0 zeroed, since no
    valid slot reads it. Mutant: the reference's `where(valid, rows, 0)` dropped."""
    q, kv, _ = _mla_args(rng, t=3, s=9)
    idx = jnp.asarray(rng.integers(1, 9, (1, 3, 4)), jnp.int32).at[0, 0, :2].set(-1).at[0, 2, 3].set(11)
    nan_kv = kv.at[0, 0].set(jnp.nan)

    def run(c):
        def f(a, c):
            out, lse = kernels.sparse_mla(a, c, idx, 0.1, 32, impl=impl)
            return jnp.sum(out) + jnp.sum(lse), out
        (_, out), grads = jax.value_and_grad(f, (0, 1), has_aux=True)(q, c)
        return out, *grads

    got, want = run(nan_kv), run(kv.at[0, 0].set(0.0))
    for name, g, w in zip(("out", "dq", "dkv"), got, want):  # (want is finite: a NaN in got fails here)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6, err_msg=name)


def test_sparse_mla_recompute_backward_ignores_the_mosaic_pds_option(rng):
    """pds is the stored / atomic backward's P / dS kernel and is documented as ignored by bwd='recompute', but
    pds='mosaic_gpu' with the recompute backward raised on any input the Mosaic kernel cannot serve (here Dqk 40).
    Expected: the recompute backward's own result."""
    q, kv, idx = _mla_args(rng)
    f = lambda **kw: jax.grad(lambda a: jnp.sum(kernels.sparse_mla(a, kv, idx, 0.1, 32, impl=IMPL, bwd="recompute",
                                                                   **kw)[0]))(q)
    np.testing.assert_array_equal(np.asarray(f(pds="mosaic_gpu")), np.asarray(f()))


def test_set_default_impl_retraces_functions_jitted_before_it(monkeypatch):
    """`set_default_impl` is read while tracing, so it keys jax's tracing caches: a function jitted and traced
    with the platform's default (the reference on a CPU) kept it after set_default_impl("interpret"), and one
    traced under a preference kept it after the reset. Expected: the Pallas call appears in the jitted function's
    trace exactly while the preference is set. Mutant: the user context not set (no Pallas call after the switch)."""
    from dsv32_jax.kernels.inspect import pallas_calls
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    g = jax.jit(lambda x: kernels.topk(x, 4))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 40)), jnp.float32)
    counts = [len(pallas_calls(jax.make_jaxpr(g)(x)))]
    kernels.set_default_impl(IMPL)
    try:
        counts.append(len(pallas_calls(jax.make_jaxpr(g)(x))))
        got = np.sort(np.asarray(g(x)), axis=-1)
    finally:
        kernels.set_default_impl(None)
    counts.append(len(pallas_calls(jax.make_jaxpr(g)(x))))
    assert counts[0] == 0 and counts[1] >= 1 and counts[2] == 0, counts
    np.testing.assert_array_equal(got, numpy_topk(x, 4))


# ------------------------------------------------------------------------------------------------------ vmap
@pytest.mark.parametrize("impl", [IMPL, TPU])
def test_kernels_under_vmap_equal_the_per_slice_expectation(impl, rng):
    """jax.vmap over a leading axis (an ensemble, a microbatch loop written with vmap) of every op. The kernels
    fold the mapped axis into their rows (pallas_kernels/_vmap.py; slice v's cache rows are addressed at v x the
    rows): pallas_call's own batching, a grid axis more, is refused by the Mosaic TPU compiler for sparse MLA's
    cache block in HBM and hadamard_quant's scale block (test_vmapped_kernels_lower_for_tpu), and by JAX's TPU
    interpreter for every kernel with dimension semantics ("safe_zip() argument 1 has length ..."). Expected:
    float64 numpy per slice (top-k sets, attention and its gradient), the FP8 references per slice; the slices
    differ (a short row, an empty slot only in the second), and a vmap of a vmap folds twice."""
    v = 2
    x = rng.standard_normal((v, 6, 256)).astype(np.float32)
    x[1, 2, 40:] = -np.inf  # a row with fewer candidates than k, in the second slice only
    f = jax.vmap(lambda a: kernels.topk(a, 64, impl=impl))
    assert "pallas_call" in str(jax.make_jaxpr(f)(jnp.asarray(x)))  # (the kernels run, not the references)
    got = np.asarray(f(jnp.asarray(x)))
    for i in range(v):
        np.testing.assert_array_equal(np.sort(got[i], axis=-1), numpy_topk(x[i], 64))

    h = jnp.asarray(rng.standard_normal((v, 24, 128)), jnp.bfloat16)
    codes, scale = jax.vmap(lambda a: kernels.hadamard_quant(a, impl=impl))(h)
    for i in range(v):
        w_codes, w_scale = kernels.hadamard_quant(h[i], impl="reference")
        np.testing.assert_array_equal(np.asarray(codes[i], np.float32), np.asarray(w_codes, np.float32))
        np.testing.assert_array_equal(scale[i], w_scale)

    b, t, hi, s = 1, 16, 4, 64
    qc, _ = kernels.hadamard_quant(jnp.asarray(rng.standard_normal((v, b, t, hi, 128)), jnp.bfloat16),
                                   impl="reference")
    kc, ks = kernels.hadamard_quant(jnp.asarray(rng.standard_normal((v, b, s, 128)), jnp.bfloat16), impl="reference")
    w = jnp.asarray(rng.standard_normal((v, b, t, hi)), jnp.float32)
    ends = jnp.asarray(np.broadcast_to(np.arange(1, t + 1) * 3, (v, b, t)), jnp.int32)  # a causal-like range
    f = jax.vmap(lambda a, c, e, f, n: kernels.indexer_logits(a, c, e, f, ends=n, impl=impl))
    assert "pallas_call" in str(jax.make_jaxpr(f)(qc, kc, ks, w, ends))
    got = f(qc, kc, ks, w, ends)
    for i in range(v):
        want = kernels.indexer_logits(qc[i], kc[i], ks[i], w[i], ends=ends[i], impl="reference")
        np.testing.assert_array_equal(np.isneginf(got[i]), np.isneginf(want))
        finite = np.isfinite(np.asarray(want))
        assert rel_err(np.asarray(got[i])[finite], np.asarray(want)[finite]) <= 1e-6

    b, t, s, h, d, d_v, k = 1, 5, 9, 4, 40, 32, 8
    q = rng.standard_normal((v, b, t, h, d)).astype(np.float32)
    kv = rng.standard_normal((v, b, s, d)).astype(np.float32)
    idx = rng.integers(0, s, (v, b, t, k)).astype(np.int32)
    idx[1, 0, 2, :5] = -1
    w_out = rng.standard_normal((v, b, t, h, d_v)).astype(np.float32)
    w_lse = rng.standard_normal((v, b, t, h)).astype(np.float32)
    tiles = {"block_h": 16, "block_i": 16} if impl == IMPL else {"block_i": 16}

    def loss(q_, kv_, idx_, wo, wl):
        out, lse = kernels.sparse_mla(q_, kv_, idx_, d ** -0.5, d_v, impl=impl, **tiles)
        return jnp.sum(out * wo) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) * wl), (out, lse)

    f = jax.vmap(jax.grad(loss, argnums=(0, 1), has_aux=True))
    args = tuple(map(jnp.asarray, (q, kv, idx, w_out, w_lse)))
    assert str(jax.make_jaxpr(f)(*args)).count("pallas_call") >= 2  # the forward and the backward
    grads, (out, lse) = f(*args)
    for i in range(v):
        w_o, w_l, _ = numpy_sparse_mla(q[i], kv[i], idx[i], d ** -0.5, d_v)
        assert rel_err(out[i], w_o) <= F32_BOUND and rel_err(lse[i], w_l) <= F32_BOUND
        for g, want in zip(grads, numpy_sparse_mla_grads(q[i], kv[i], idx[i], d ** -0.5, d_v, w_out[i], w_lse[i])):
            assert rel_err(g[i], want) <= F32_BOUND
    # a vmap of a vmap: [2 x 2] slices, the inner axis the keys' batch B = 1 mapped away
    q2, kv2, idx2 = (a.reshape(v, 1, *a.shape[1:]) for a in args[:3])
    out2 = jax.vmap(jax.vmap(lambda *a: kernels.sparse_mla(*a, d ** -0.5, d_v, impl=impl, **tiles)[0]))(q2, kv2,
                                                                                                       idx2)
    np.testing.assert_array_equal(np.asarray(out2[:, 0]), np.asarray(out))


def test_the_kernels_key_ranges_follow_the_segments_in_linear_memory():
    """indexer_topk's [start, end) per query (its segment's first key up to itself; start = end when no key has the
    query's segment) against a numpy oracle on random segment ids (runs, interleaved ids, ids absent from the keys,
    query positions out of range); and its compiled program holds no [B, T, S] value: it was a query-by-key compare
    built outside the query chunks (16 GiB at 128K tokens; a forward with constant segment ids then spent minutes
    constant-folding it at compile time; audit, 2026-12-07). Temp memory at L = 1024 and 4096 is bounded linearly."""
    from dsv32_jax.kernels.indexer_topk import _key_ranges

    rng = np.random.default_rng(11)
    shapes = [(1, 1, 1), (1, 17, 29), (3, 39, 59), (2, 40, 7), (3, 5, 60), (1, 33, 33)]  # (few: each compiles)
    for trial in range(36):
        b, t, s = shapes[trial % len(shapes)]
        kv = rng.integers(0, rng.integers(1, 6), (b, s)).astype(np.int32)
        if trial % 3 == 0:
            kv = np.sort(kv, axis=1)  # packed documents: contiguous runs
        qs = rng.integers(0, 7, (b, t)).astype(np.int32)
        qi = rng.integers(-2, s + 3, (b, t)).astype(np.int32)
        end = np.clip(qi + 1, 0, s)
        start = np.array([[np.flatnonzero(kv[i] == qs[i, j])[0] if np.any(kv[i] == qs[i, j]) else end[i, j]
                           for j in range(t)] for i in range(b)])
        got = jax.device_get(_key_ranges(qi, qs, kv))
        np.testing.assert_array_equal(got[0], start, err_msg=f"trial {trial}")
        np.testing.assert_array_equal(got[1], end, err_msg=f"trial {trial}")
    for length in (1024, 4096):
        spec = jax.ShapeDtypeStruct((1, length), jnp.int32)
        compiled = jax.jit(_key_ranges).lower(spec, spec, spec).compile()
        assert f"[1,{length},{length}]" not in compiled.as_text()
        assert compiled.memory_analysis().temp_size_in_bytes < 64 * length  # (the compare: 17 MB at 4096)


def test_the_kernel_path_s_reference_fallback_takes_the_run_s_attention_chunk(monkeypatch):
    """attention="kernel" where no kernel runs (a CPU without interpret mode) computes the sparse MLA with the
    reference: with the run's RunOptions.attn_chunk, which the kernels' entry dropped (its reference ran the default
    chunk of 64 whatever the run set; audit, 2026-12-07)."""
    from flax import nnx

    from dsv32_jax import RunOptions, Transformer, load_preset
    from dsv32_jax.kernels import _dispatch
    from dsv32_jax.model import attention

    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    seen, orig = [], attention.sparse_mla
    monkeypatch.setattr(attention, "sparse_mla", lambda *a, **k: seen.append(k.get("q_chunk")) or orig(*a, **k))
    cfg = load_preset("tiny").replace(index_topk=4)
    model = Transformer(cfg, rngs=nnx.Rngs(0), options=RunOptions(attention="kernel", attn_chunk=16))
    model(jnp.arange(24, dtype=jnp.int32).reshape(1, 24) % cfg.vocab_size)
    assert seen and set(seen) == {16}, seen
