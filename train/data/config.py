"""The data configuration (`config.data` of an experiment)."""

from __future__ import annotations

import dataclasses
import os

from dsv32_jax.train.data.tokenizers import SPECIAL_TOKEN_MODES


SOURCES = ("builtin", "jsonl", "parquet", "arrayrecord", "text")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "builtin"  # "builtin" | "jsonl" | "parquet" | "arrayrecord" | "text"
    paths: tuple[str, ...] = ()  # files, directories or glob patterns (refused for builtin, which reads none)
    text_field: str = "text"  # JSONL key / Parquet column / JSON key inside ArrayRecord records
    tokenizer: str = "byte"  # "byte", a tokenizer.json, or a checkpoint dir containing tokenizer.json
    seq_len: int = 128
    batch_size: int = 4  # global batch (rows); each host yields its row block's: batch_size // blocks
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None  # None = repeat forever
    add_eos: bool = True  # append the tokenizer's EOS id to each document (byte tokenizer: none)
    # grain worker processes for reading + tokenizing (0 = threads in-process; an HF tokenizer holds the GIL, so
    # threads tokenize on about one core: docs/training.md)
    worker_count: int = 0
    # with shuffle: packed rows shuffled together in windows of this many (<= 1: off); a window of seq_len-token
    # rows is held and packed whole (at the start, a resume and each refill): 16 at 128K is 2M tokens
    shuffle_window: int = 512
    # Document shards of the stream (0: one per process). The global batch is every shard's batch_size // shards
    # rows in shard order, each process yielding those of its shards: a fixed count keeps the batches (and a
    # checkpoint's data state) the same on any number of processes that divides it.
    shards: int = 0
    split: str = "train"  # builtin source: "train" or "heldout" (disjoint documents, for evaluation)
    min_doc_tokens: int = 0  # drop documents shorter than this (e.g. a long-context evaluation split)
    # A tokenizer.json's special-token strings inside a document (an EOS string quoted in a web page): "text"
    # (default) tokenizes them as the text they are; "parse" turns them into the special ids (text rendered with a
    # chat template on purpose)
    special_tokens: str = "text"
    # a record a source refuses (invalid JSON, the text field missing or not a string) is skipped with a warning
    # naming it instead of stopping the run (which met it again at every resume); a resume may turn it on
    skip_bad_records: bool = False

    def __post_init__(self):
        paths = self.paths
        if isinstance(paths, (str, os.PathLike)):
            paths = (paths,)
        object.__setattr__(self, "paths", tuple(os.fspath(p) for p in (paths or ())))
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be one of {SOURCES}, got {self.source!r}")
        if self.source != "builtin" and not self.paths:
            raise ValueError(f"data.paths is empty: source {self.source!r} needs files or glob patterns")
        if self.source == "builtin" and self.paths:
            raise ValueError(f"data.paths is set ({', '.join(map(repr, self.paths[:3]))}"
                             f"{', ...' if len(self.paths) > 3 else ''}) but data.source='builtin' reads no files: "
                             f"set data.source to their format ({', '.join(SOURCES[1:])})")
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {self.batch_size}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"data.num_epochs must be None or >= 1, got {self.num_epochs}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"data.seed must be in [0, 2**32), got {self.seed}")
        if self.split not in ("train", "heldout"):
            raise ValueError(f"data.split must be 'train' or 'heldout', got {self.split!r}")
        if self.min_doc_tokens < 0:
            raise ValueError(f"data.min_doc_tokens must be >= 0, got {self.min_doc_tokens}")
        if self.shards < 0:
            raise ValueError(f"data.shards must be >= 0 (0: one per process), got {self.shards}")
        if self.shards and self.batch_size % self.shards:
            raise ValueError(f"data.batch_size {self.batch_size} must be divisible by data.shards {self.shards}")
        if self.worker_count < 0:
            raise ValueError(f"data.worker_count must be >= 0, got {self.worker_count}")
        if self.special_tokens not in SPECIAL_TOKEN_MODES:
            raise ValueError(f"data.special_tokens must be 'text' or 'parse', got {self.special_tokens!r}")
