"""A model of the Hopper FP8 tensor-core accumulator, for checking FP8 kernels on a real chip (issue 31, item 4).

An e4m3 x e4m3 `wgmma` (QGMMA) does not accumulate in full float32. The model: for each group of 32 products along K
(one k32 instruction step), the exact products and the running accumulator are aligned to the largest exponent
among them and each is cut to FRAC_BITS = 13 fraction bits below it (truncation toward zero), then summed; the
accumulator carries the result into the next group (no promotion to float32 inside one MMA chain, as in DeepGEMM's
`fp8_mqa_logits` and our Mosaic GPU indexer). This is the "FP22 (e8m13)" / "about 14 bits" accumulator reported
for Hopper FP8 GEMMs (DeepSeek-V3 report section 3.5.2; DeepGEMM issues 50 and 176); an independent probe of
`wgmma` with FP8 inputs on an H100 (the huweim/emulation_sys README, read 2026-12-06) reports the same: 13 effective
fraction bits, truncation (RZ), a multi-term sum with one final rounding. Khattak and Mikaitis, "Accurate Models of
NVIDIA Tensor Cores" (arXiv:2512.07004), give bit-accurate models that we have not checked against this one. The
chip's own fit is owed: `bench/mgpu_triage.py` fits 24 variants of this model (bits, rounding, group) to the
kernel's logits, and `bench/gpu_owed.sh 0` runs it (its calib stage).

Evidence (2026-11-27, CPU, `emulate_logits` on the exact inputs of the four tests that failed on an H200 on
2026-11-26 and 2026-11-27; their seeds are functions of the chip run's test ids): the model gives relative errors
4.7e-5 and 4.1e-5 for the two D = 32 cases and 1.6e-4 and 2.0e-4 for the two D = 128 cases; the chip gave 4.4e-5,
5.7e-5, 1.7e-4 and 1.9e-4 (which case gave which was not recorded). 12 or 14 fraction bits, groups of 16, or rounding
to nearest move the modelled errors by about 2x either way. The model is not claimed bit-exact: the chip tests allow
twice its error on their own inputs (`modelled_bound`). A per-entry worst-case bound (every aligned term losing a
whole unit, magnitudes from the sums of |products|) came out at 1e-2 to 2e-1 of the largest logit on these cases,
too loose to catch a wrong scale, so it is not used.
"""

from __future__ import annotations

import numpy as np

FRAC_BITS = 13
GROUP = 32  # products per k32 wgmma step (e4m3)


def _f64(x):
    return np.asarray(np.asarray(x).astype(np.float32), np.float64)


def emulate_dots(q, k, frac_bits: int = FRAC_BITS, group: int = GROUP, rounding: str = "rz"):
    """q [B, T, H, D], k [B, S, D] (e4m3 codes or their values) -> [B, T, S, H] dot products as the model
    accumulates them (float64 arithmetic, exact products)."""
    q, k = _f64(q), _f64(k)
    d = q.shape[-1]
    dp = -(-d // group) * group
    q = np.pad(q, [(0, 0)] * 3 + [(0, dp - d)])
    k = np.pad(k, [(0, 0)] * 2 + [(0, dp - d)])
    acc = np.zeros((q.shape[0], q.shape[1], k.shape[1], q.shape[2]))
    cut = {"rz": np.trunc, "rn": np.rint}[rounding]
    for g in range(dp // group):
        sl = slice(g * group, (g + 1) * group)
        terms = np.concatenate([acc[..., None], q[:, :, None, :, sl] * k[:, None, :, None, sl]], -1)
        _, e = np.frexp(np.max(np.abs(terms), -1))  # mag = m * 2^e, m in [0.5, 1): the ulp is 2^(e - 1 - frac_bits)
        shift = (e - 1 - frac_bits)[..., None]  # (mag 0 gives e = 0: its terms are all 0, any shift keeps them)
        acc = np.sum(np.ldexp(cut(np.ldexp(terms, -shift)), shift), -1)  # exact scalings by powers of two
    return acc


def emulate_logits(q, k, k_scale, w, **kw):
    """The indexer logits [B, T, S] (no range mask) from `emulate_dots`."""
    dots = emulate_dots(q, k, **kw)
    return np.einsum("btsh,bth->bts", np.maximum(dots, 0.0), _f64(w)) * _f64(k_scale)[:, None, :]


def modelled_bound(q, k, k_scale, w, ref, margin: float = 2.0, model=None) -> float:
    """The relative error bound (max |a - b| / max |b| over the finite entries of the exact `ref`) for an FP8
    kernel on a Hopper chip: `margin` times the model's own error on these inputs, and at least 1e-6 (float32).
    The margin covers what the model does not pin down (rounding mode, carry bits, one bit more or less: each moves
    the error by at most about 2x on the recorded cases); a wrong scale, head or range, or a bf16 accumulator
    (2^-8), is far outside it."""
    ref = np.asarray(ref, np.float64)
    finite = np.isfinite(ref)
    model = emulate_logits(q, k, k_scale, w) if model is None else np.asarray(model, np.float64)  # (precomputed)
    err = np.max(np.abs(model[finite] - ref[finite])) / np.max(np.abs(ref[finite]))
    return max(margin * float(err), 1e-6)
