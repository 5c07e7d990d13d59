"""Exact per-row top-k (k up to 2048 over 128K+ candidates) by threshold/radix select, without a sort.

Semantics = `dsv32_jax.model.indexer.select_topk`: per row, the k largest values among the candidates -- columns below
the row's valid length whose value is > -inf (so neither -inf nor NaN) -- with ties broken towards the lower index
(as `jax.lax.top_k`);
slots beyond the number of candidates are -1. The order of the returned indices is unspecified (the kernel
returns them in ascending column order).

Kernel (Pallas, Triton backend), on the order-preserving int32 image of fp32 (bits ^ ((bits >> 31) & 0x7fffffff)),
three programs per row, the second one idle for almost every row. C is the per-row buffer (default 4k, >= 1024):
  0. one streaming pass (`_filter_kernel`): a threshold from a sample of the row (SAMPLE_GROUPS runs of SAMPLE_RUN
     adjacent columns, evenly spaced: 16 KB of a 128K fp32 row, one 32-byte sector per run), at the sample rank
     whose expected count over the row is (k + C) / 2, found by a 32-step bisection over the sampled keys; with
     the whole row in the sample (n <= 4096) that count is exact, and rows of n <= (k + C) / 2 columns take every
     candidate. One pass then compacts the keys >= threshold, in column order, into the row's buffer; full blocks
     of FILTER_BLOCK columns load without a mask (16-byte vector loads), the last one masked. The row is settled
     when its count lies in [k, C], or when the threshold admitted every candidate and they fit. At k = 2048 and
     128K i.i.d. scores the sample rank is 160 and the count's standard deviation about 5120 / sqrt(160) = 405, so
     [k, C] lies 7.6 of them either side of the target; scores correlated over neighbouring columns shrink the
     sample's effective size towards its 512 runs (2.7 deviations).
  1. exact bracket + compaction, only for the rows step 0 left (ties around the threshold, a sample that misleads,
     candidates that do not fit; every other program returns at once, its outputs kept by input/output aliasing):
     16 thresholds are taken from a 256-element strided sample of the row (ranks of the sample elements around the
     expected rank k * 256 / n), one streaming pass counts the candidates >= each threshold, which brackets the
     k-th key in [lo, hi] (count(>= lo) >= k > count(> hi)). While more than C candidates lie in the bracket,
     another pass splits it 16 ways (at most ~8 passes, exactness never depends on the sample). A last pass writes
     the keys > hi and, in column order, the keys in [lo, hi] (capped at C, which only drops surplus ties) to the
     buffer.
  2. select + emit: a bisection between the smallest and largest buffered keys (at most 32 steps) finds the
     exact k-th key; keys above it and the first ties (lowest columns) are written out with prefix sums, the rest
     of the row's k slots get -1.
Typical cost: a 3% sample + 1 streaming read of the row + O(C) work per row (the read floor is one pass); a row
that falls back pays step 1's 2+ reads as well. On an H200 (2026-11-28) this design takes 2.71 ms at 4096 x 128K,
k 2048 (791 GB/s, 13x `lax.top_k`); the previous one (step 1 for every row, 256 columns per loop step, 164
registers: one block per SM) took 23.5 ms (91 GB/s).

TPU kernel (Mosaic; TPU has neither the gathers nor the scatters the GPU compaction uses, but a 128K fp32 row is
only 512 KB of VMEM): programs of 8 rows read their rows once from HBM, turn them into keys in a VMEM scratch, and
find each row's exact k-th largest key by a 32-step bitwise bisection (step b keeps bit b if at least k keys are
>= the candidate), each step one compare-and-count pass over VMEM in lane chunks; they return that threshold and
how many of its ties to take. XLA then emits the indices in ascending column order: keys above the threshold and
the first ties, by prefix sums and a binary search per output slot (two more streaming reads of the row).
Vector registers: the passes step over [8 rows, 1024 lanes] of VMEM (TPU_CHUNK_VREGS = 8 vregs per array) and
keep the counts per lane in the loop carry, summed across lanes once per pass. The first version stepped over up
to 8192 lanes (64 vregs per array, with hoisted [8, 8192] column iotas) with a cross-lane sum in every step: its
final bundles at 4096 x 128K on v5p held 219 vector-register spill stores and 241 loads (782 bundles; the first
deviceless compile also reported 167 / 188 in indexer_topk's top-k at 256 x 8K); now 0 / 0 (244 bundles) at every
shape `tools/tpu_compile` compiles, on v5p and v6e (libtpu 0.0.50.1; BENCHMARKS.md). Compile-verified only: no
TPU timing exists.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from dsv32_jax.model.config import is_int
from dsv32_jax.model.indexer import select_topk
from dsv32_jax.kernels._dispatch import next_pow2, resolve_impl, round_up, tpu_interpret_params
from dsv32_jax.kernels._vmap import ROWS, fold_vmap

INT_MIN = -(2**31)
INT_MAX = 2**31 - 1
NEG_INF_KEY = -2139095041  # key of -inf; candidates have larger keys
INF_KEY = 0x7F800000  # key of +inf; only a positive NaN's key is larger
N_THRESH = 16
SAMPLE_GROUPS = 512  # the threshold sample: 512 evenly spaced runs ...
SAMPLE_RUN = 8  # ... of 8 adjacent columns (4096 keys; one 32-byte sector per run)
FILTER_BLOCK = 4096  # columns per step of the streaming pass (16 KB of fp32 in flight per program)


def topk_reference(scores: jnp.ndarray, k: int, lengths=None) -> jnp.ndarray:
    lead, n = scores.shape[:-1], scores.shape[-1]
    rows = scores.reshape(1, -1, n)
    valid = jnp.ones(rows.shape, bool)
    if lengths is not None:
        valid = jnp.arange(n)[None, None, :] < lengths.reshape(1, -1, 1)
    if k > n:  # lax.top_k needs k <= n: pad with -inf columns, which are never candidates
        rows = jnp.pad(rows, ((0, 0), (0, 0), (0, k - n)), constant_values=-jnp.inf)
        valid = jnp.pad(valid, ((0, 0), (0, 0), (0, k - n)))
    return select_topk(rows, valid, k).reshape(*lead, k)


def _key_bits(x):
    """Order-preserving int32 keys of float values; NaN (either sign) gets INT_MIN, below every candidate (a NaN is
    not > -inf: never a candidate, as in the reference). A negative NaN's key is already below -inf's; a positive
    one's lies above +inf's (INF_KEY), which is the one case the select maps."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    key = bits ^ ((bits >> 31) & INT_MAX)
    return jnp.where(key > INF_KEY, INT_MIN, key)


def _keys(x, col, n):
    """Order-preserving int32 keys; non-candidates (col >= n) get INT_MIN."""
    return jnp.where(col < n, _key_bits(x), INT_MIN)


def _candidate_keys(x, col, n):
    """Like `_keys`, with -inf mapped to INT_MIN too: every non-candidate has the smallest key (TPU path)."""
    key = _keys(x, col, n)
    return jnp.where(key > NEG_INF_KEY, key, INT_MIN)


def _load_keys(x_ref, col, n):
    x = pltriton.load(x_ref.at[col], mask=col < n, other=-jnp.inf)
    return _keys(x, col, n)


def _split_thresholds(lo, hi):
    """16 increasing thresholds in [lo, hi] (inclusive, int32, no overflow), the first one == lo, the second > lo."""
    j = jnp.arange(N_THRESH, dtype=jnp.int32)
    small = (hi >> 1) - (lo >> 1) < (1 << 19)
    w = jnp.where(small, hi - lo, 0)
    t_small = lo + ((w * j + (N_THRESH - 1)) >> 4)
    t_big = 2 * ((lo >> 5) * (N_THRESH - j) + (hi >> 5) * j)
    t = jnp.where(small, t_small, jnp.clip(t_big, lo, hi))
    return jnp.where(j == 0, lo, t)


def _bracket_kernel(x_ref, n_ref, stats_ref, bkey_ref, bidx_ref, *, k, buf, block, sample, max_len):
    n = jnp.minimum(n_ref[0], max_len)
    j16 = jnp.arange(N_THRESH, dtype=jnp.int32)

    # -- first thresholds: sample elements whose rank in the sample is near the expected rank of the k-th key
    stride = jnp.maximum(n // sample, 1)
    s_cols = jnp.arange(sample, dtype=jnp.int32) * stride
    s_keys = _load_keys(x_ref, s_cols, n)
    est = (k * sample) // jnp.maximum(n, 1)
    targets = jnp.where(j16 == 0, -1, est - N_THRESH // 2 + j16)
    thresh = jnp.full((N_THRESH,), INT_MIN, jnp.int32)
    chunk = 64
    for c in range(sample // chunk):
        pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        c_keys = _load_keys(x_ref, pos * stride, n)
        above = (s_keys[None, :] > c_keys[:, None]) | (
            (s_keys[None, :] == c_keys[:, None]) & (jnp.arange(sample)[None, :] < pos[:, None]))
        rank = jnp.sum(above.astype(jnp.int32), axis=1)  # [chunk], distinct ranks
        hit = rank[None, :] == targets[:, None]
        thresh = jnp.maximum(thresh, jnp.max(jnp.where(hit, c_keys[None, :], INT_MIN), axis=1))
    lo_init = NEG_INF_KEY + 1
    thresh = jnp.where(j16 == 0, lo_init, jnp.maximum(thresh, lo_init))

    def count_ge(t):
        def body(b, acc):
            keys = _load_keys(x_ref, b * block + jnp.arange(block, dtype=jnp.int32), n)
            return acc + (keys[:, None] >= t[None, :]).astype(jnp.int32)
        acc = jax.lax.fori_loop(0, pl.cdiv(n, block), body, jnp.zeros((block, N_THRESH), jnp.int32))
        return jnp.sum(acc, axis=0)

    def update(state, t, counts, need):
        lo, cnt_lo, hi, cnt_hi = state
        ge = counts >= need
        lo = jnp.maximum(lo, jnp.max(jnp.where(ge, t, INT_MIN)))
        cnt_lo = jnp.minimum(cnt_lo, jnp.min(jnp.where(ge, counts, INT_MAX)))
        first_below = jnp.min(jnp.where(ge, INT_MAX, t))
        hi = jnp.minimum(hi, jnp.where(first_below == INT_MAX, first_below, first_below - 1))
        cnt_hi = jnp.maximum(cnt_hi, jnp.max(jnp.where(ge, -1, counts)))
        return lo, cnt_lo, hi, cnt_hi

    counts = count_ge(thresh)
    n_cand = jnp.sum(jnp.where(j16 == 0, counts, 0))
    need = jnp.minimum(k, n_cand)
    state = update((jnp.int32(lo_init), n_cand, jnp.int32(INT_MAX), jnp.int32(0)), thresh, counts, need)

    def refine(state):
        t = _split_thresholds(state[0], state[2])
        return update(state, t, count_ge(t), need)

    lo, _, hi, cnt_hi = jax.lax.while_loop(lambda s: (s[1] > buf) & (s[0] < s[2]), refine, state)

    # -- compaction: keys > hi at [0, cnt_hi), keys in [lo, hi] after them in column order (capped at buf)
    def compact(b, carry):
        run_gt, run_mid = carry
        cols = b * block + jnp.arange(block, dtype=jnp.int32)
        keys = _load_keys(x_ref, cols, n)
        gt = keys > hi
        mid = (keys >= lo) & ~gt
        pos_gt = run_gt + jnp.cumsum(gt.astype(jnp.int32)) - 1
        pos_mid = cnt_hi + run_mid + jnp.cumsum(mid.astype(jnp.int32)) - 1
        pos = jnp.where(gt, pos_gt, jnp.where(mid & (pos_mid < buf), pos_mid, buf))
        pltriton.store(bkey_ref.at[pos], keys, mask=pos < buf)
        pltriton.store(bidx_ref.at[pos], cols, mask=pos < buf)
        return run_gt + jnp.sum(gt.astype(jnp.int32)), run_mid + jnp.sum(mid.astype(jnp.int32))

    _, n_mid = jax.lax.fori_loop(0, pl.cdiv(n, block), compact, (jnp.int32(0), jnp.int32(0)))
    n_buf = cnt_hi + jnp.minimum(n_mid, buf - cnt_hi)
    stats_ref[...] = _stats(lo, hi, cnt_hi, n_buf, need, path=1, count=cnt_hi + n_mid)


def _stats(lo, hi, cnt_hi, n_buf, need, path, count):
    """A row's 8 stats: keys > hi are buffer[0, cnt_hi), keys in [lo, hi] buffer[cnt_hi, n_buf); `need` of the k
    slots are filled; path 0 = settled by the streaming pass, 1 = by the exact bracket, 2 = not settled yet;
    count = keys >= lo in the row."""
    j8 = jnp.arange(8, dtype=jnp.int32)
    vals = (lo, hi, cnt_hi, n_buf, need, path, count)
    out = jnp.zeros((8,), jnp.int32)
    for i, v in enumerate(vals):
        out = jnp.where(j8 == i, v, out)
    return out


def sample_columns(n, groups: int = SAMPLE_GROUPS):
    """[groups * SAMPLE_RUN] int32: the columns the streaming pass samples in a row of n columns: `groups` runs of
    SAMPLE_RUN adjacent columns, `stride` apart (a multiple of SAMPLE_RUN, at least SAMPLE_RUN). With
    n <= groups * SAMPLE_RUN the sample is the columns [0, groups * SAMPLE_RUN), which hold the whole row."""
    stride = jnp.maximum((n // groups) // SAMPLE_RUN * SAMPLE_RUN, SAMPLE_RUN)
    j = jnp.arange(groups * SAMPLE_RUN, dtype=jnp.int32)
    return (j // SAMPLE_RUN) * stride + j % SAMPLE_RUN


def _filter_kernel(x_ref, n_ref, stats_ref, bkey_ref, bidx_ref, *, k, buf, block, groups, max_len):
    n = jnp.minimum(n_ref[0], max_len)
    lo_init = jnp.int32(NEG_INF_KEY + 1)  # the smallest candidate key: a threshold that admits every candidate
    target = (k + buf) // 2

    # -- threshold: the sampled key whose rank among the sample's keys predicts `target` keys >= it in the row
    s_keys = _load_keys(x_ref, sample_columns(n, groups), n)  # columns >= n get INT_MIN (never counted)
    s_eff = jnp.minimum(n, groups * SAMPLE_RUN)  # sample positions < n
    rank = (target * s_eff + jnp.maximum(n, 1) - 1) // jnp.maximum(n, 1)

    def bisect(_, bounds):  # the largest t with count(sample >= t) >= rank (lo_init when no t has)
        a, b = bounds
        m = _upper_mid(a, b)
        ok = jnp.sum((s_keys >= m).astype(jnp.int32)) >= rank
        return jnp.where(ok, m, a), jnp.where(ok, b, m - 1)

    # 32 fixed steps: a data-dependent loop bounded by the sampled keys took the pass from 113 to 124 registers
    thr, _ = jax.lax.fori_loop(0, 32, bisect, (lo_init, jnp.int32(INT_MAX)))
    thr = jnp.where(n > target, thr, lo_init)

    # -- one pass: keys >= thr into the buffer in column order (the first `buf` of them)
    def take(cols, keys, run):
        hit = keys >= thr
        pos = run + jnp.cumsum(hit.astype(jnp.int32)) - 1
        keep = hit & (pos < buf)
        pos = jnp.where(keep, pos, buf)
        pltriton.store(bkey_ref.at[pos], keys, mask=keep)
        pltriton.store(bidx_ref.at[pos], cols, mask=keep)
        return run + jnp.sum(hit.astype(jnp.int32))

    def full_block(b, run):  # no mask: the loads vectorize
        start = pl.multiple_of(b * block, block)
        cols = start + jnp.arange(block, dtype=jnp.int32)
        return take(cols, _key_bits(x_ref[pl.ds(start, block)]), run)

    n_full = n // block
    run = jax.lax.fori_loop(0, n_full, full_block, jnp.int32(0))
    tail = n_full * block + jnp.arange(block, dtype=jnp.int32)
    count = take(tail, _load_keys(x_ref, tail, n), run)  # keys >= thr (INT_MIN < lo_init <= thr: no pad counts)

    every = thr == lo_init
    settled = (count <= buf) & ((count >= k) | every)
    need = jnp.where(every, jnp.minimum(count, k), k)
    stats_ref[...] = _stats(thr, jnp.int32(INT_MAX), 0, jnp.minimum(count, buf), need,
                            path=2 - 2 * settled.astype(jnp.int32), count=count)  # (a where of two literals does
    # not lower to Triton: arith.select on mismatched types)


def _fallback_kernel(x_ref, n_ref, stats_in, bkey_in, bidx_in, stats_ref, bkey_ref, bidx_ref, **kw):
    """`_bracket_kernel` for the rows the streaming pass left unsettled; the others keep their outputs (aliased)."""
    del bkey_in, bidx_in

    @pl.when(stats_in[5] == 2)
    def _():
        _bracket_kernel(x_ref, n_ref, stats_ref, bkey_ref, bidx_ref, **kw)


def _upper_mid(lo, hi):
    """ceil((lo + hi) / 2) without int32 overflow."""
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1) + ((lo ^ hi) & 1)


def _emit_kernel(stats_ref, bkey_ref, bidx_ref, out_ref, *, k, k_pad, buf):
    lo, hi, cnt_hi, n_buf, need = (stats_ref[i] for i in range(5))
    pos = jnp.arange(buf, dtype=jnp.int32)
    keys = bkey_ref[...]
    idx = bidx_ref[...]
    is_gt = pos < cnt_hi
    is_mid = (pos >= cnt_hi) & (pos < n_buf)
    need_mid = need - cnt_hi

    def bisect(bounds):
        a, b = bounds
        m = _upper_mid(a, b)
        ok = jnp.sum((is_mid & (keys >= m)).astype(jnp.int32)) >= need_mid
        return jnp.where(ok, m, a), jnp.where(ok, b, m - 1)

    # the k-th key is one of the buffer's [lo, hi] keys: bracket their smallest and largest, bisect until it closes
    mid_lo = jnp.maximum(lo, jnp.min(jnp.where(is_mid, keys, INT_MAX)))
    mid_hi = jnp.minimum(hi, jnp.max(jnp.where(is_mid, keys, INT_MIN)))
    kth, _ = jax.lax.while_loop(lambda ab: ab[0] < ab[1], bisect, (mid_lo, jnp.maximum(mid_hi, mid_lo)))
    take = need_mid > 0
    above = is_mid & (keys > kth) & take
    ties = is_mid & (keys == kth) & take
    n_above = jnp.sum(above.astype(jnp.int32))
    slot = jnp.where(is_gt, pos, jnp.where(above, cnt_hi + jnp.cumsum(above.astype(jnp.int32)) - 1,
                                           cnt_hi + n_above + jnp.cumsum(ties.astype(jnp.int32)) - 1))
    keep = is_gt | above | (ties & (slot < need))
    slot = jnp.where(keep, slot, k)
    pltriton.store(out_ref.at[slot], idx, mask=keep)
    tail = jnp.arange(k_pad, dtype=jnp.int32)
    pltriton.store(out_ref.at[tail], jnp.full((k_pad,), -1, jnp.int32), mask=(tail >= need) & (tail < k))


@functools.partial(jax.jit, static_argnames=("k", "buf", "block", "backend", "num_warps", "with_stats"))
def _topk_pallas(scores, lengths, *, k, buf, block, backend, num_warps, with_stats=False):
    lead, length = scores.shape[:-1], scores.shape[-1]
    rows = scores.reshape(-1, length)
    r = rows.shape[0]
    lengths = (jnp.full((r,), length, jnp.int32) if lengths is None
               else jnp.clip(lengths.reshape(r).astype(jnp.int32), 0, length))
    # (a function of the rows: under jax.vmap the mapped axis joins them, see _vmap; pallas_call's own batching
    # adds a grid axis, which costs the filtering pass 15 registers and the emission a spill on an H100)
    out, stats = fold_vmap(lambda fold: functools.partial(_topk_rows, k=k, buf=buf, block=block, backend=backend,
                                                          num_warps=num_warps), (ROWS, ROWS))(rows, lengths)
    out = out.reshape(*lead, k)
    return (out, stats.reshape(*lead, 8)) if with_stats else out


def _topk_rows(rows, lengths, *, k, buf, block, backend, num_warps):
    r, length = rows.shape

    def call(kernel, warps, **kw):
        extra = {}
        if backend == "pallas_gpu":
            extra["compiler_params"] = pltriton.CompilerParams(num_warps=warps, num_stages=2)
        return pl.pallas_call(kernel, interpret=backend == "interpret", grid=(r,), **extra, **kw)

    row_spec = pl.BlockSpec((None, length), lambda i: (i, 0))
    len_spec = pl.BlockSpec((1,), lambda i: (i,))
    stat_spec = pl.BlockSpec((None, 8), lambda i: (i, 0))
    buf_spec = pl.BlockSpec((None, buf), lambda i: (i, 0))
    shapes = [jax.ShapeDtypeStruct((r, 8), jnp.int32)] + [jax.ShapeDtypeStruct((r, buf), jnp.int32)] * 2
    filt = min(FILTER_BLOCK, 1 << (length.bit_length() - 1))  # a power of two <= the row: full blocks fit
    stats, bkey, bidx = call(
        functools.partial(_filter_kernel, k=k, buf=buf, block=filt, groups=SAMPLE_GROUPS, max_len=length),
        num_warps, in_specs=[row_spec, len_spec], out_specs=[stat_spec, buf_spec, buf_spec], out_shape=shapes,
    )(rows, lengths)
    stats, bkey, bidx = call(
        functools.partial(_fallback_kernel, k=k, buf=buf, block=block, sample=256, max_len=length), num_warps,
        in_specs=[row_spec, len_spec, stat_spec, buf_spec, buf_spec], out_specs=[stat_spec, buf_spec, buf_spec],
        out_shape=shapes, input_output_aliases={2: 0, 3: 1, 4: 2},
    )(rows, lengths, stats, bkey, bidx)
    out = call(
        functools.partial(_emit_kernel, k=k, k_pad=next_pow2(k), buf=buf), max(num_warps, buf // 512),
        in_specs=[stat_spec, buf_spec, buf_spec], out_specs=pl.BlockSpec((None, k), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((r, k), jnp.int32),
    )(stats, bkey, bidx)
    return out, stats


# ------------------------------------------------------------------------------------------------ TPU
TPU_ROWS = 8
TPU_CHUNK_VREGS = 8  # [8 rows, 1024 lanes] per loop step: 8 vregs per array (see the module docstring)


def _tpu_threshold_kernel(x_ref, n_ref, thr_ref, need_ref, keys_ref, *, k, chunk):
    rows, width = x_ref.shape
    n_chunks = width // chunk
    # counts accumulate per lane in a [rows, chunk] carry (chunk / 128 vregs) and are summed across lanes once per
    # pass: no cross-lane reduction inside the loops, and a working set that fits the vector registers
    lane_counts = jnp.zeros((rows, chunk), jnp.float32)

    def to_keys(c, total):
        cols = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        col = c * chunk + jax.lax.broadcasted_iota(jnp.int32, (rows, chunk), 1)
        key = _candidate_keys(x_ref[:, cols], col, n_ref[...])
        keys_ref[:, cols] = key
        return total + (key > INT_MIN).astype(jnp.float32)

    candidates = jnp.sum(jax.lax.fori_loop(0, n_chunks, to_keys, lane_counts), axis=1, keepdims=True)
    k_eff = jnp.minimum(candidates, float(k))

    def count(pred):
        def body(c, total):
            key = keys_ref[:, pl.ds(pl.multiple_of(c * chunk, chunk), chunk)]
            return total + pred(key).astype(jnp.float32)
        return jnp.sum(jax.lax.fori_loop(0, n_chunks, body, lane_counts), axis=1, keepdims=True)

    def bisect(i, ans):  # ans: the bits found so far of the k-th key in the unsigned (key ^ INT_MIN) order
        bit = jax.lax.shift_left(jnp.int32(1), 31 - i)
        cand = ans | bit
        n_ge = count(lambda key: key >= (cand ^ INT_MIN))
        return jnp.where(n_ge >= k_eff, cand, ans)

    thr = jax.lax.fori_loop(0, 32, bisect, jnp.zeros((rows, 1), jnp.int32)) ^ INT_MIN  # INT_MAX if k_eff == 0
    thr_ref[...] = thr
    need_ref[...] = (k_eff - count(lambda key: key > thr)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("k", "backend"))
def _topk_tpu(scores, lengths, *, k, backend):
    lead, length = scores.shape[:-1], scores.shape[-1]
    if length >= 1 << 24:
        raise ValueError(f"topk: rows of {length} >= 2^24 candidates are not supported on TPU (float32 counts)")
    rows = scores.reshape(-1, length)
    r = rows.shape[0]
    lengths = (jnp.full((r,), length, jnp.int32) if lengths is None
               else jnp.clip(lengths.reshape(r).astype(jnp.int32), 0, length))
    rp, lp = round_up(r, TPU_ROWS), round_up(length, 128)
    x = jnp.pad(rows, ((0, rp - r), (0, lp - length)), constant_values=-jnp.inf)
    n = jnp.pad(lengths, (0, rp - r))[:, None]
    chunk = 128 * math.gcd(lp // 128, TPU_CHUNK_VREGS)  # lanes per loop step, divides lp
    row_spec = pl.BlockSpec((TPU_ROWS, 1), lambda i: (i, 0))

    def threshold(x, n):  # (a function of the rows: under jax.vmap the mapped axis joins them, see _vmap)
        return pl.pallas_call(
            functools.partial(_tpu_threshold_kernel, k=k, chunk=chunk),
            grid=(x.shape[0] // TPU_ROWS,),
            in_specs=[pl.BlockSpec((TPU_ROWS, lp), lambda i: (i, 0)), row_spec],
            out_specs=[row_spec, row_spec],
            out_shape=[jax.ShapeDtypeStruct((x.shape[0], 1), jnp.int32)] * 2,
            scratch_shapes=[pltpu.VMEM((TPU_ROWS, lp), jnp.int32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                                 vmem_limit_bytes=max(32 << 20, 3 * TPU_ROWS * lp * 4 + (8 << 20))),
            interpret=tpu_interpret_params() if backend == "interpret_tpu" else False,
        )(x, n)

    thr, need = fold_vmap(lambda fold: threshold, (ROWS, ROWS))(x, n)
    # emission in XLA: the keys above the threshold and the first `need` ties, in ascending column order
    col = jnp.arange(length, dtype=jnp.int32)[None, :]
    key = _candidate_keys(rows, col, lengths[:, None])
    thr, need = thr[:r], need[:r]  # thr > INT_MIN: a candidate's key, or INT_MAX for a row without candidates
    tie = key == thr
    take = (key > thr) | (tie & (jnp.cumsum(tie, axis=1, dtype=jnp.int32) <= need))
    pos = jnp.cumsum(take, axis=1, dtype=jnp.int32)  # slot s holds the first column where pos reaches s + 1
    slots = jnp.arange(1, k + 1, dtype=jnp.int32)
    out = jax.vmap(lambda p: jnp.searchsorted(p, slots, side="left"))(pos).astype(jnp.int32)
    out = jnp.where(slots[None, :] <= pos[:, -1:], out, -1)
    return out.reshape(*lead, k)


def topk(scores: jnp.ndarray, k: int, *, lengths=None, impl: str | None = None, buffer: int | None = None,
         block: int = 256, num_warps: int = 8) -> jnp.ndarray:
    """Top-k column indices [..., k] int32 of scores [..., L] (f32 or bf16), -1 in slots beyond the candidates.

    lengths [...] (optional): only columns < lengths are candidates; -inf and NaN values never are. `buffer` (power of
    two > k) is the per-row candidate buffer of the GPU kernel (default max(4 k, 1024), rounded up). Backends:
    pallas_gpu, interpret (GPU kernel), pallas_tpu, interpret_tpu (TPU threshold kernel + XLA emission); CPU runs
    the reference (`jax.lax.top_k`, a full sort).
    """
    if not is_int(k) or k < 1:  # (-1 gave [..., 0] on the TPU path)
        raise ValueError(f"topk: k must be an integer >= 1, got {k!r}")
    if lengths is not None:  # one length per row (a scalar or any shape that broadcasts to the rows' shape)
        lengths = jnp.asarray(lengths, jnp.int32)
        try:
            lengths = jnp.broadcast_to(lengths, scores.shape[:-1])
        except ValueError:
            raise ValueError(f"topk: lengths of shape {lengths.shape} do not broadcast to the rows' shape "
                             f"{scores.shape[:-1]} (scores {scores.shape})") from None
    impl = resolve_impl(impl, ("pallas_gpu", "interpret", "pallas_tpu", "interpret_tpu"), op="topk",
                        shapes={"scores": scores, "k": k})
    if impl == "reference":
        return topk_reference(scores, k, lengths)
    if impl in ("pallas_tpu", "interpret_tpu"):
        return _topk_tpu(scores, lengths, k=k, backend=impl)
    buf = buffer or max(next_pow2(4 * k), 1024)
    if buf < next_pow2(k + 1) or buf & (buf - 1):
        raise ValueError(f"topk: buffer {buf} must be a power of two larger than k={k}")
    return _topk_pallas(scores, lengths, k=k, buf=buf, block=block, backend=impl, num_warps=num_warps)
