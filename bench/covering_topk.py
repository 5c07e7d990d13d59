"""Attention over a covering top-k (dense) against the gathered selection, in the step where it matters on a CPU: one
cold-start SFT step of the trip recipe (configs/agent_trip.py) on 16 oracle episodes (<= 525 tokens, padded to a
multiple of 64: 16 x 576).

When `index_topk` >= the number of keys, the indexer's selection is every visible key and `mla.py:mqa_attend`
computes eq. 2 as dense attention over the visible keys (`attention="sparse"`); with one slot fewer than the keys
(k = 575, `--gathered_k`) it gathers k rows of 576 values per query, although the selection is the same set (no
row here has more than 525 tokens). Two learners from the same seed, each step compiled first, then `--repeats`
steps of each taken in turn (so both see the same machine load); medians, the ratio, and the first step's loss of
each (the same batch and the same initial weights: equal up to float rounding; exit 1 when they differ by 1e-5 or
more). That loss is a
sanity check only: at random init it is near log(vocab) whatever attention computes (a 1% error in the dense path's
softmax scale moves it by 3e-7). What checks the dense path is
`tests/test_model.py::test_a_covering_topk_attends_densely_and_equals_the_gathered_selection` (outputs within 1e-5
of the gathered selection's).

    .venv/bin/python bench/covering_topk.py            # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="timed steps of each learner after its compile")
    p.add_argument("--episodes", type=int, default=16, help="oracle episodes in the SFT batch")
    p.add_argument("--gathered_k", type=int, default=575, help="index_topk of the gathered learner (< 576 keys)")
    a = p.parse_args(argv)
    import jax

    from dsv32_jax.configs import agent_trip
    from dsv32_jax.train.agent_grpo import AgentLearner, sft_batch

    ks = {"covering": agent_trip.get_config().model_overrides["index_topk"], "gathered": a.gathered_k}
    learners = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, k in ks.items():
            c = agent_trip.get_config()
            c.model_overrides["index_topk"] = k
            learners[name] = AgentLearner(c, os.path.join(tmp, name))
        first = learners["covering"]
        examples = first.demonstrations(range(a.episodes))[:a.episodes]
        width = sft_batch(examples, first.a.capacity, bucket=64)["tokens"].shape
        longest = max(len(ids) for ids, _ in examples)
        if longest > a.gathered_k:
            raise SystemExit(f"bench/covering_topk.py: an episode has {longest} tokens, more than --gathered_k="
                             f"{a.gathered_k}: the gathered learner's selection would differ")
        loss0 = {name: lrn._sft_update(examples) for name, lrn in learners.items()}  # compile + first step
        times = {name: [] for name in learners}
        for _ in range(a.repeats):
            for name, lrn in learners.items():
                t0 = time.perf_counter()
                lrn._sft_update(examples)  # float(loss) waits for the step
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"covering top-k vs gathered, trip cold-start SFT step, batch {width[0]} x {width[1]} (longest episode "
          f"{longest} tokens); jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs, "
          f"{datetime.date.today()}")
    for name, k in ks.items():
        each = " ".join(f"{t:.2f}" for t in times[name])
        print(f"  {name:9s} k={k:5d}: median {med[name]:.3f} s of {a.repeats} ({each}), "
              f"first-step loss {loss0[name]:.8f}")
    rel = abs(loss0["covering"] - loss0["gathered"]) / abs(loss0["gathered"])
    print(f"  gathered / covering: {med['gathered'] / med['covering']:.2f}x; first-step loss rel. difference {rel:.1e}")
    return 0 if rel < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
