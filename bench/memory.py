"""Activation memory per decoder layer of the three continued-pretraining stages, from compile-time analysis on the
CPU (nothing is run or allocated): dense LM training, the dense warm-up (eq. 3: indexer KL to the head-summed dense
attention, gradients for the indexer only) and the sparse stage (eq. 2 attention on the top-k set + the eq. 4 KL),
at the small and 671B layer shapes.

    python bench/memory.py                                  # small + 671b, L = 4K, 8K, 32K, 128K, remat none + full
    python bench/memory.py --presets small --lengths 4096 --remats full --out runs/memory

Two numbers per (layer shapes, stage, remat, L), for one decoder block (dense MLP: the first layers of V3.2; MoE
activations are linear in L as well), bf16, batch 1:
  * saved: the bytes the block keeps from its forward for its backward (`saved_residuals`, its input included):
    what every layer of the model holds at once, so an N-layer step keeps N x saved;
  * peak: XLA's temp-buffer size for the block's forward + backward alone (`memory_analysis()` of the compiled
    vjp): the transient of the one block being differentiated (recomputed under remat), needed once.
So a step needs about N x saved + peak (+ parameters, gradients, optimizer state). Query chunks default to 128 rows
(attention and the eq. 3 teacher hold [chunk, H, L] fp32 logits per chunk), each rematerialized in the backward
(map_query_chunks); "remat" is the per-block policy (RunOptions.remat). XLA:CPU's buffer assignment stands in for
the GPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # what jax.ad_checkpoint.print_saved_residuals prints

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv32_jax.model.config import load_preset  # noqa: E402
from dsv32_jax.model.transformer import Transformer, _block_call  # noqa: E402
from dsv32_jax.model.options import RunOptions  # noqa: E402
from dsv32_jax.train.optimizer import trainable_filter  # noqa: E402
from dsv32_jax.checkpoint.io_utils import write_text_atomic  # noqa: E402

STAGES = ("dense", "warmup", "sparse")


def stage_options(stage: str, remat: str, chunk: int) -> RunOptions:
    common = dict(attn_chunk=chunk, index_chunk=chunk, remat=remat)
    if stage == "dense":
        return RunOptions(dsa=False, attention="dense", **common)
    if stage == "warmup":
        return RunOptions(dsa=False, attention="dense", indexer_loss="dense", **common)
    return RunOptions(attention="sparse", indexer_loss="sparse", **common)


def block_functions(preset: str, length: int, stage: str, remat: str, chunk: int):
    """(loss of one block as a function of its trainable state and input, trainable state, frozen state, h)."""
    cfg = load_preset(preset).replace(num_hidden_layers=1, first_k_dense_replace=1, num_nextn_predict_layers=0,
                                      vocab_size=1024)
    opts = stage_options(stage, remat, chunk)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                               param_dtype=jnp.bfloat16, options=opts))
    graphdef, trainable, rest = nnx.split(model.layers[0], trainable_filter(stage), ...)
    pos = nnx.eval_shape(lambda: model.positions(jnp.zeros((1, length), jnp.int32)))
    h = jax.ShapeDtypeStruct((1, length, cfg.hidden_size), jnp.bfloat16)
    block = _block_call(remat)

    def loss(train_state, h, rest_state, pos):
        out, aux = block(nnx.merge(graphdef, train_state, rest_state), h, pos, opts, None, None)
        kl = jnp.sum(aux["indexer_kl"]) if "indexer_kl" in aux else 0.0
        if stage == "warmup":  # the frozen model: no gradient reaches the block input
            return kl
        return jnp.sum(out.astype(jnp.float32)) + kl

    return loss, trainable, rest, h, pos, stage != "warmup"


def measure_block(preset, length, stage, remat, chunk) -> tuple[int, int, float]:
    """(saved residual bytes, peak temp bytes of the block's forward + backward, compile seconds)."""
    loss, trainable, rest, h, pos, grad_h = block_functions(preset, length, stage, remat, chunk)
    argnums = (0, 1) if grad_h else (0,)
    # residuals computed in the block, plus its input h (parameters and
    # positions are held anyway, not per layer activations)
    saved = h.size * h.dtype.itemsize  # remat keeps the block input (to recompute), without it more
    for aval, desc in saved_residuals(loss, trainable, h, rest, pos):
        if "from the argument" not in desc:
            saved += aval.size * aval.dtype.itemsize
    t0 = time.perf_counter()
    compiled = jax.jit(jax.grad(loss, argnums=argnums)).trace(trainable, h, rest, pos).lower().compile()
    return saved, int(compiled.memory_analysis().temp_size_in_bytes), time.perf_counter() - t0


@dataclasses.dataclass
class Row:
    preset: str
    stage: str
    remat: str
    length: int
    saved_bytes: int  # per layer, kept from forward to backward
    peak_bytes: int  # one block's forward + backward transient
    compile_s: float

    def model_bytes(self, layers: int) -> int:
        return layers * self.saved_bytes + self.peak_bytes


def gib(n: float) -> str:
    return f"{n / 2**30:,.2f}"


def table(rows: list[Row]) -> str:
    lines = ["| layer shapes | stage | remat | L | saved per layer (GiB) | saved per token (KiB) | one-block peak (GiB) |"
             " 61 layers: 61 x saved + peak (GiB) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.preset} | {r.stage} | {r.remat} | {r.length // 1024}K | {gib(r.saved_bytes)} | "
                     f"{r.saved_bytes / r.length / 1024:,.1f} | {gib(r.peak_bytes)} | {gib(r.model_bytes(61))} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="small,deepseek_v32_671b")
    p.add_argument("--lengths", default="4096,8192,32768,131072")
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--remats", default="none,full")
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--out", default="", help="write OUT.json and OUT.md")
    a = p.parse_args(argv)
    rows = []
    for preset in a.presets.split(","):
        for stage in a.stages.split(","):
            for remat in a.remats.split(","):
                for length in (int(x) for x in a.lengths.split(",")):
                    r = Row(preset, stage, remat, length, *measure_block(preset, length, stage, remat, a.chunk))
                    rows.append(r)
                    print(f"{preset:18s} {stage:7s} remat={remat:5s} L={length:7d}: saved {gib(r.saved_bytes):>8s} GiB "
                          f"({r.saved_bytes / length / 1024:7.1f} KiB/token), one-block peak {gib(r.peak_bytes):>7s} GiB"
                          f"  (compile {r.compile_s:.1f}s)", flush=True)
    md = (f"jax {jax.__version__}, XLA:CPU compile-time memory analysis, {datetime.date.today()}, chunk {a.chunk}\n\n"
          + table(rows))
    print("\n" + md)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        write_text_atomic(a.out + ".json", json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
        write_text_atomic(a.out + ".md", md + "\n")


if __name__ == "__main__":
    main()
