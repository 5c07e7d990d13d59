"""Static roofline of the DSA kernels at the production shapes (no device, no jax): FLOPs, HBM bytes, and the
floor time max(FLOPs / peak, bytes / bandwidth). H100 SXM (default): the peaks and FLOP conventions of
shared/docs/kernels.md (sections 1-2), BENCHMARKS.md "Roofline". TPU v5p / v6e (`--chip`): the vendor's per-chip
peaks (CHIPS below), BENCHMARKS.md "TPU kernels compiled without a TPU"; the TPU indexer kernel widens the e4m3
codes to bf16 (v5p has no FP8 MXU path), so every TPU row uses the bf16 peak. Prints a markdown table.

    python bench/roofline.py [--chip h100|v5p|v6e] [--queries 4096] [--lengths 8192,32768,131072]

Conventions: the T queries are the last T positions of L keys (causal); indexer FLOPs 2*H_I*d_I per visible pair
(QK only); sparse MLA forward 2*H*k*(d_qk + d_v) per query, backward 2*H*k*(3*d_qk + 2*d_v) (all k slots);
head-summed probabilities 2*H*k*d_qk. Bytes count each tensor crossing HBM once (gathered KV rows counted once
per query, i.e. no L2 reuse: an upper bound for the gather); "design bytes" adds what our kernels move beyond the
op's own inputs/outputs (full -inf logits rows, the backward's [T, k, 576] dkv partials written and re-read).
"""

from __future__ import annotations

import argparse

PEAK_FP8 = 1979e12  # dense FLOP/s, H100 SXM
PEAK_BF16 = 989e12
HBM = 3.35e12  # B/s
# Per chip: (fp8 or the indexer's peak, bf16 peak, HBM B/s, HBM bytes, source). TPU: Google Cloud's TPU docs
# (cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16, 95 GB HBM2e at 2765 GBps; cloud.google.com/tpu/docs/v6e:
# 918 TFLOPs bf16, 32 GB at 1638 GBps), read 2026-11-27.
CHIPS = {
    "h100": (PEAK_FP8, PEAK_BF16, HBM, 80e9, "H100 SXM, shared/docs/kernels.md"),
    "v5p": (459e12, 459e12, 2765e9, 95e9, "TPU v5p, cloud.google.com/tpu/docs/v5p"),
    "v6e": (918e12, 918e12, 1638e9, 32e9, "TPU v6e, cloud.google.com/tpu/docs/v6e"),
}
H_I, D_I, H, D_QK, D_V, K = 64, 128, 128, 576, 512, 2048


def causal_pairs(length: int, queries: int) -> int:
    first = length - queries
    return sum(min(t + 1, length) for t in range(first, length))


def rows(t: int, length: int, chip: str = "h100") -> list[tuple]:
    """(op, FLOPs, op bytes, design bytes, peak, peak name)."""
    peak_fp8, peak_bf16 = CHIPS[chip][:2]
    indexer = ("indexer_logits (fp8 wgmma)", peak_fp8, "fp8") if chip == "h100" else (
        "indexer_logits (e4m3 as bf16)", peak_bf16, "bf16")
    pairs = causal_pairs(length, t)
    sel = sum(min(p + 1, K) for p in range(length - t, length))  # valid selected slots
    out = []
    out.append(("hadamard_quant (q)", 2 * 128 * 128 * t * H_I, t * H_I * 128 * (2 + 1) + t * H_I * 4, 0, peak_bf16,
                "bf16"))
    logits_op = pairs * 4  # the visible part of the fp32 logits
    out.append((indexer[0], 2 * H_I * D_I * pairs,
                t * H_I * D_I + length * (D_I + 4) + t * H_I * 4 + logits_op, t * length * 4 - logits_op, indexer[1],
                indexer[2]))
    out.append(("topk k=2048", 0, t * length * 4 + t * K * 4, 0, peak_bf16, "-"))
    q_bytes = t * H * D_QK * 2
    gather = sel * D_QK * 2
    out.append(("sparse_mla fwd", 2 * H * K * (D_QK + D_V) * t, q_bytes + gather + t * K * 4 + t * H * (D_V * 2 + 4),
                0, peak_bf16, "bf16"))
    out.append(("sparse_mla probs (eq. 4 target)", 2 * H * K * D_QK * t, q_bytes + gather + t * K * 8 + t * H * 4, 0,
                peak_bf16, "bf16"))
    partials = 2 * t * K * D_QK * 2  # bf16 partial rows written by the dkv kernel and read by the scatter-add
    out.append(("sparse_mla bwd (dq + dkv)", 2 * H * K * (3 * D_QK + 2 * D_V) * t,
                2 * q_bytes + 2 * gather + t * H * D_V * 2 * 2 + length * D_QK * 4, partials, peak_bf16, "bf16"))
    return out


def table(t: int, lengths: list[int], chip: str = "h100") -> str:
    hbm = CHIPS[chip][2]
    lines = ["| op | L | GFLOP | op bytes (MB) | floor: compute / HBM (ms) | + design bytes (MB) | floor with design "
             "bytes (ms) |", "|---|---|---|---|---|---|---|"]
    for length in lengths:
        for op, flops, op_bytes, extra, peak, name in rows(t, length, chip):
            tc, tb = flops / peak * 1e3, op_bytes / hbm * 1e3
            td = (op_bytes + extra) / hbm * 1e3
            lines.append(f"| {op} | {length // 1024}K | {flops / 1e9:,.0f} | {op_bytes / 1e6:,.0f} | "
                         f"{tc:.3f} ({name}) / {tb:.3f} | {extra / 1e6:,.0f} | {max(tc, td):.3f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chip", default="h100", choices=sorted(CHIPS))
    p.add_argument("--queries", type=int, default=4096)
    p.add_argument("--lengths", default="8192,32768,131072")
    a = p.parse_args(argv)
    print(table(a.queries, [int(x) for x in a.lengths.split(",")], a.chip))


if __name__ == "__main__":
    main()
