"""Training-data pipeline on the host: tokens per second (wall and per CPU-second), the first batch, the longest
wait for a batch, a resume's first batch and peak memory, over a JSONL corpus of English documents of realistic
length (slices of the built-in corpus, lognormal, median about 12K bytes, 2K to 200K) or your own files.

    python bench/data_pipeline.py                                     # byte tokenizer, seq_len 4096 and 32768
    python bench/data_pipeline.py --bpe=32000 --seq_lens=32768 --worker_counts=0,2   # a byte-level BPE trained here
    python bench/data_pipeline.py --tokenizer=/path/tokenizer.json --paths='corpus/*.jsonl' --seq_lens=131072

What a host needs: its GPUs' tokens per second (a small model, 50K-100K per GPU; the 671B recipe, a few thousand per
GPU). An HF tokenizer holds the GIL while it encodes: the pipeline's threads tokenize on about one core, and each
`worker_count` process adds about that much. CPU seconds include the worker processes (psutil). Prints one JSON line
per case (peak_rss_mib: the process's peak so far, cases run in order).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

try:
    import dsv32_jax  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from dsv32_jax.train.data import DataConfig, make_iterator  # noqa: E402

def corpus(path: str, docs: int, seed: int = 0) -> None:
    """`docs` JSONL documents: slices of the built-in corpus (Python's documentation) of lognormal length in bytes
    (median 12K, 2K to 200K: about 500 to 50K tokens of a 4-byte-per-token BPE)."""
    from dsv32_jax.train.data import builtin_documents

    pool = "\n\n".join(builtin_documents("train"))
    pool = pool * (1 + 400_000 // len(pool))
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for n in np.clip(rng.lognormal(np.log(12_000), 1.0, docs), 2_000, 200_000).astype(int):
            start = int(rng.integers(0, len(pool) - n))
            f.write(json.dumps({"text": pool[start:start + n]}) + "\n")


def train_bpe(corpus_path: str, vocab: int, out_dir: str) -> str:
    """A byte-level BPE of `vocab` ids (DeepSeek's kind of tokenizer) trained on the first 2,000 documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(corpus_path) as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(2000), f)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    sample = texts[0]
    print(json.dumps({"bpe_vocab": tok.get_vocab_size(), "bytes_per_token": round(
        len(sample.encode()) / len(tok.encode(sample).ids), 2)}), flush=True)
    return path


def cpu_s() -> float:
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def measure(cfg: DataConfig, seconds: float) -> dict:
    t0 = time.perf_counter()
    it = make_iterator(cfg, vocab_size=1 << 20)
    next(it)
    first = time.perf_counter() - t0
    tokens, waits, c0, t1 = 0, [], cpu_s(), time.perf_counter()
    while time.perf_counter() - t1 < seconds:
        tb = time.perf_counter()
        b = next(it)
        waits.append(time.perf_counter() - tb)
        tokens += int((b["segment_ids"] > 0).sum())
    wall, cpu = time.perf_counter() - t1, cpu_s() - c0
    state = it.get_state()
    t2 = time.perf_counter()
    again = make_iterator(cfg, vocab_size=1 << 20)
    again.set_state(state)
    next(again)
    resume = time.perf_counter() - t2
    for i in (it, again):
        getattr(i, "close", lambda: None)()
    return {"seq_len": cfg.seq_len, "batch": cfg.batch_size, "tokenizer": os.path.basename(cfg.tokenizer),
            "worker_count": cfg.worker_count, "shuffle_window": cfg.shuffle_window, "batches": len(waits),
            "tokens_per_s": round(tokens / wall), "tokens_per_cpu_s": round(tokens / max(cpu, 1e-9)),
            "first_batch_s": round(first, 2), "max_wait_s": round(max(waits), 3),
            "median_wait_s": round(float(np.median(waits)), 4), "resume_first_batch_s": round(resume, 2),
            "state_bytes": len(json.dumps(state, default=str)),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--paths", default="", help="JSONL files / globs (default: a synthetic corpus of --docs documents)")
    p.add_argument("--docs", type=int, default=2000)
    p.add_argument("--tokenizer", default="byte")
    p.add_argument("--bpe", type=int, default=0, help="> 0: train a byte-level BPE of this vocabulary on the corpus "
                   "and use it (instead of --tokenizer)")
    p.add_argument("--seq_lens", default="4096,32768")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--worker_counts", default="0")
    p.add_argument("--shuffle_windows", default="512")
    p.add_argument("--seconds", type=float, default=10.0, help="timed reading per case, after the first batch")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = tuple(a.paths.split(",")) if a.paths else (os.path.join(tmp, "corpus.jsonl"),)
        if not a.paths:
            corpus(paths[0], a.docs)
        tokenizer = train_bpe(paths[0], a.bpe, tmp) if a.bpe else a.tokenizer
        for seq in map(int, a.seq_lens.split(",")):
            for workers in map(int, a.worker_counts.split(",")):
                for window in map(int, a.shuffle_windows.split(",")):
                    cfg = DataConfig(source="jsonl", paths=paths, tokenizer=tokenizer, seq_len=seq,
                                     batch_size=a.batch, worker_count=workers, shuffle_window=window)
                    print(json.dumps(measure(cfg, a.seconds)), flush=True)


if __name__ == "__main__":
    main()
