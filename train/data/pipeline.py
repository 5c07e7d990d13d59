"""Training data: a deterministic, resumable grain pipeline of packed token rows.

Pipeline (``make_dataset``)::

    documents (random-access source: builtin / JSONL / Parquet / ArrayRecord / text)
      -> per-epoch shuffle (global; per row group for Parquet) -> repeat(num_epochs)
      -> one shard  [process_index::process_count] of the document stream (make_iterator: data.shards shards,
         each process reading those of its row block; their batches concatenated in shard order form the global
         batch. process_index / process_count here: the block of the batch's rows this process's devices own and
         the number of blocks, trainer.data_shard; processes that share a block read the same shards)
      -> tokenize (+ EOS)  (in ReadOptions threads, or in `worker_count` processes via mp_prefetch)
      -> drop empty documents, add next-token targets + loss mask per document
      -> pack into rows of seq_len (concatenate, then split: grain.experimental.ConcatThenSplitIterDataset)
      -> shuffle rows in windows of `shuffle_window` (with shuffle: grain.experimental.WindowShuffleIterDataset)
      -> batch(batch_size // process_count)
      -> prefetch PREFETCH_BATCHES batches in a background thread (packing overlaps the training step)

Each element is a dict of numpy arrays, ``b = batch_size // process_count`` rows of ``seq_len``:

* ``tokens`` int32: documents laid end to end (no padding except at the very end of a finite stream).
* ``segment_ids`` int32: 1, 2, 3, ... for the document pieces of a row in order; 0 only for padding. The
  model never lets attention or the indexer cross a segment boundary.
* ``positions`` int32: position within the piece, restarting at 0 at each segment. A document longer
  than the space left in a row is split at the row end and continues as segment 1 of the next row with
  positions restarting at 0. (Attention cannot see across rows anyway and RoPE depends on position
  differences only, so restarting loses nothing and keeps positions < seq_len.)
* ``targets`` int32: the document's next token. Inside a segment this is ``tokens[t + 1]``; at the last
  token of a piece whose document continues in the next row it is that next row's first token (the true
  next token of the document, so no target is lost at a split). 0 where there is none.
* ``loss_mask`` float32: 1 where ``targets`` is a real next token of the same document; 0 at each
  document's last token and on padding.

Deeper targets (MTP depth j predicts token t + 2 + j) are ``targets[t + 1 + j]``, valid where
``segment_ids[t + 1 + j] == segment_ids[t]`` and ``loss_mask[t + 1 + j] == 1``.

With ``add_eos`` the tokenizer's EOS id ends every document, once (not again after a post-processor that appends
it; the byte tokenizer has none; documents are still separated by segment ids). Empty documents (empty or whitespace-only text, null fields) are
skipped: they carry no tokens. Nothing else is dropped, except, when ``num_epochs`` is finite, the final
partial batch of each host (the last partial row is padded and kept). Hosts shard documents, so with a
finite ``num_epochs`` they can run out a few batches apart: multi-host training should use
``num_epochs=None`` and stop after a number of steps.

Order is a pure function of the config and seed: ``get_state()`` of the iterator is a small
JSON-serializable dict and ``set_state()`` resumes exactly at the next batch. The document shard of a
host depends on ``process_count``; the rows do not depend on ``worker_count`` (workers only read and
tokenize; packing runs in the host process), but the iterator state format does, so keep
``worker_count`` fixed across a resume.

The sources (``DataConfig.source``) are described in sources.py.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import threading
import weakref

import grain
import numpy as np

from dsv32_jax.train.data.config import DataConfig
from dsv32_jax.train.data.sources import check_not_compressed, make_source, source_files
from dsv32_jax.train.data.tokenizers import make_tokenizer, tokenizer_file


class BlockShuffleMapDataset(grain.MapDataset):
    """Per-epoch shuffle that keeps locality: permutes the blocks (e.g. Parquet row groups), then the
    elements inside each block. Index i of epoch e = i // len reads parent[perm_e(i % len)]."""

    def __init__(self, parent: grain.MapDataset, blocks: np.ndarray, seed: int):
        super().__init__(parent)
        self._blocks = np.asarray(blocks, np.int64)
        self._seed = int(seed)
        self._len = int(self._blocks[-1])
        self._lock = threading.Lock()
        self._epoch_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._block_cache: collections.OrderedDict = collections.OrderedDict()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_lock"] = None
        state["_epoch_cache"] = None
        state["_block_cache"] = collections.OrderedDict()
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __len__(self):
        return self._len

    def __str__(self):
        return "BlockShuffleMapDataset"

    def _epoch(self, epoch: int):
        cached = self._epoch_cache
        if cached is None or cached[0] != epoch:
            order = np.random.default_rng([self._seed, epoch]).permutation(len(self._blocks) - 1)
            sizes = np.diff(self._blocks)[order]
            cached = self._epoch_cache = (epoch, order, np.cumsum(np.concatenate([[0], sizes])))
        return cached

    def _inner(self, epoch: int, block: int) -> np.ndarray:
        key = (epoch, block)
        with self._lock:
            perm = self._block_cache.get(key)
            if perm is None:
                size = int(self._blocks[block + 1] - self._blocks[block])
                perm = np.random.default_rng([self._seed, epoch, block + 1]).permutation(size)
                self._block_cache[key] = perm
                while len(self._block_cache) > 8:
                    self._block_cache.popitem(last=False)
            return perm

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        epoch, i = divmod(int(index), self._len)
        _, order, starts = self._epoch(epoch)
        k = bisect.bisect_right(starts, i) - 1
        block = int(order[k])
        inner = self._inner(epoch, block)[i - int(starts[k])]
        return self._parent[int(self._blocks[block]) + int(inner) + epoch * self._len]


class _Tokenize:
    def __init__(self, tokenizer, add_eos: bool, vocab_size: int):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_id if add_eos else None
        self.vocab_size = vocab_size

    def __call__(self, text: str) -> np.ndarray:
        if not text or not text.strip():
            return np.zeros(0, np.int32)
        ids = self.tokenizer.encode_array(text)
        # (a tokenizer whose post-processor appends EOS itself, "$A </s>": a second one trained EOS -> EOS)
        if self.eos_id is not None and (not ids.size or int(ids[-1]) != self.eos_id):
            ids = np.append(ids, np.int32(self.eos_id))
        if ids.size and (int(ids.max()) >= self.vocab_size or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= self.vocab_size else int(ids.min())
            raise ValueError(f"tokenizer {self.tokenizer.name!r} produced id {bad} outside the model's vocabulary "
                             f"[0, vocab_size={self.vocab_size})")
        return ids.astype(np.int32, copy=False)


class _MinLength:
    """Documents shorter than n tokens become empty (dropped with the empty ones by `_DropEmpty`)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        return ids if len(ids) >= self.n else ids[:0]


class _DropEmpty(grain.IterDataset):
    """Drops empty documents; raises once `max_run` documents in a row were empty.

    Without the limit a stream whose every document is empty (whitespace-only text, or all shorter than
    data.min_doc_tokens) would repeat forever without yielding. make_dataset sets `max_run` to two passes over the
    whole source: one process meets every document once per pass (shuffled or not), so a run that long means
    the source has no usable document (the longest run between usable ones, across an epoch boundary of two
    shuffles, is 2 (n - 1)); a process shard reaching it has met none in its share of two or more epochs."""

    def __init__(self, parent: grain.IterDataset, max_run: int | None, what: str):
        super().__init__(parent)
        self.max_run, self.what = max_run, what

    def __iter__(self):
        return _DropEmptyIterator(self._parent.__iter__(), self.max_run, self.what)

    def __str__(self):
        return "DropEmpty"


class NoDocuments(ValueError):
    """A stream that yields no document (every one empty or shorter than data.min_doc_tokens)."""


class _DropEmptyIterator(grain.DatasetIterator):
    def __init__(self, parent, max_run: int | None, what: str):
        super().__init__(parent)
        self.max_run, self.what = max_run, what

    def __next__(self) -> np.ndarray:
        run = 0
        while True:
            ids = next(self._parent)
            if len(ids):
                return ids
            run += 1
            if self.max_run is not None and run >= self.max_run:
                raise NoDocuments(f"data: {run} documents in a row of {self.what} were empty or shorter than "
                                 "data.min_doc_tokens (two passes' worth): no document to train on")

    def get_state(self) -> dict:
        return self._parent.get_state()

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state)

    def __str__(self):
        return "DropEmptyIterator"


def _with_next_tokens(ids: np.ndarray) -> dict:
    """A document's tokens with its next-token targets and loss mask, all of the document's length.

    Computed per document, before packing: the packer splits the three features at the same offsets (equal
    lengths), so the last target of a piece cut at a row end is still the document's true next token (the first
    token of the piece in the next row), and only the document's last token has loss_mask 0."""
    targets = np.zeros_like(ids)
    targets[:-1] = ids[1:]
    loss_mask = np.ones(len(ids), np.float32)
    loss_mask[-1] = 0.0
    return {"tokens": ids, "targets": targets, "loss_mask": loss_mask}


def pack_documents(documents: grain.IterDataset, seq_len: int, *, max_empty_run: int | None = None,
                   what: str = "the documents") -> grain.IterDataset:
    """Concatenate-then-split packing of token arrays into rows of seq_len (fields: see the module docstring).

    grain's ConcatThenSplitIterDataset does the packing (split pieces restart at segment 1 / position 0 of the next
    row, padding zeros at the end of a finite stream); `_with_next_tokens` supplies the cross-row targets. Empty
    documents are dropped first: grain would give them a segment id of their own with no tokens. With
    `max_empty_run`, that many empty documents in a row raise a ValueError naming `what` (see `_DropEmpty`)."""
    features = _DropEmpty(documents, max_empty_run, what).map(_with_next_tokens)
    packed = grain.experimental.ConcatThenSplitIterDataset(  # split_full_length_features=False would emit a document
        features, length_struct={"tokens": seq_len, "targets": seq_len, "loss_mask": seq_len},  # of exactly seq_len
        split_full_length_features=True)  # ahead of the row being filled: keep stream order
    return _PackedRows(packed)


class _PackedRows(grain.IterDataset):
    """Our field names on grain's packed rows, and a packer state that survives a JSON round trip.

    grain 0.2.18 keeps `remainder_slices` as tuples and tests `slice != (-1, -1)` for "no remainder"; after JSON (how
    checkpoints store the data state) they are lists, so a state saved with no remainder would resume by dropping
    the next document. set_state turns them back into tuples."""

    def __iter__(self):
        return _PackedRowsIterator(self._parent.__iter__())

    def __str__(self):
        return "PackedRows"


class _PackedRowsIterator(grain.DatasetIterator):
    def __next__(self):
        row = next(self._parent)
        return {"tokens": row["tokens"], "targets": row["targets"], "segment_ids": row["tokens_segment_ids"],
                "positions": row["tokens_positions"], "loss_mask": row["loss_mask"]}

    def get_state(self) -> dict:
        return self._parent.get_state()

    def set_state(self, state: dict) -> None:
        state = dict(state)
        state["remainder_slices"] = {k: tuple(v) for k, v in state["remainder_slices"].items()}
        self._parent.set_state(state)

    def __str__(self):
        return "PackedRowsIterator"


# ----------------------------------------------------------------------------------------------------
# Entry points


def check_inputs(cfg: DataConfig) -> None:
    """Refuses what make_dataset would refuse about cfg's inputs without reading them: the source and split, a
    path or pattern that names no file, a missing tokenizer file. A run calls it before it builds its model state
    (seconds to minutes of compiles), so a typo in a path is reported at once."""
    files = source_files(cfg)
    if cfg.source in ("jsonl", "text"):  # (10 bytes a file: refused before the model state, not after it)
        for path in files:
            check_not_compressed(path, cfg.source)
    if cfg.tokenizer != "byte":
        tokenizer_file(cfg.tokenizer)


def make_dataset(cfg: DataConfig, *, vocab_size: int, process_index: int = 0,
                 process_count: int = 1, source=None) -> grain.IterDataset:
    """Batches of packed rows for this host (see the module docstring for the fields). source: make_source(cfg)'s
    (source, blocks), built once and shared by the shards of one process (ShardedBatches); None: built here."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} / process_count {process_count} is not a valid shard")
    if cfg.batch_size % process_count:
        raise ValueError(f"data.batch_size {cfg.batch_size} must be divisible by the process count {process_count}")
    tokenizer = make_tokenizer(cfg.tokenizer, vocab_size, special_tokens=cfg.special_tokens)
    source, blocks = make_source(cfg) if source is None else source
    if len(source) == 0:
        raise ValueError(f"data source {cfg.source!r} {list(cfg.paths)} holds no documents")
    ds = grain.MapDataset.source(source)
    if cfg.shuffle:
        ds = ds.shuffle(seed=cfg.seed) if blocks is None else BlockShuffleMapDataset(ds, blocks, cfg.seed)
    ds = ds.repeat(cfg.num_epochs)
    if process_count > 1:
        ds = ds[process_index::process_count]
    ds = ds.map(_Tokenize(tokenizer, cfg.add_eos, vocab_size))
    if cfg.min_doc_tokens > 1:  # short documents become empty and are dropped, with the empty ones, by _DropEmpty
        ds = ds.map(_MinLength(cfg.min_doc_tokens))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=64))
    if cfg.worker_count > 0:
        from absl import flags  # noqa: PLC0415

        if not flags.FLAGS.is_parsed():  # grain's worker processes read its absl flags (defaults suffice)
            flags.FLAGS.mark_as_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count))
    what = (f"the built-in corpus's {cfg.split!r} split" if cfg.source == "builtin"
            else f"data source {cfg.source!r} {list(cfg.paths)}")
    if process_count > 1:
        what += f" (shard {process_index} of {process_count})"
    it = pack_documents(it, cfg.seq_len, max_empty_run=2 * len(source), what=what)
    if cfg.shuffle and cfg.shuffle_window > 1:  # spreads the rows of one long document over many batches
        it = grain.experimental.WindowShuffleIterDataset(it, window_size=cfg.shuffle_window, seed=cfg.seed)
    it = it.batch(cfg.batch_size // process_count, drop_remainder=True)
    # packing, the row shuffle and batching in a thread of their own, PREFETCH_BATCHES ahead of the consumer: the
    # train loop's next() waited for them while the accelerator idled (its step is synchronous), up to seconds at
    # a window refill. The iterator state is that of the last batch returned (the format is unchanged).
    return _Prefetch(it, prefetch_buffer_size=PREFETCH_BATCHES)


PREFETCH_BATCHES = 2
_LIVE_PREFETCH: weakref.WeakSet = weakref.WeakSet()


class _Prefetch(grain.experimental.ThreadPrefetchIterDataset):
    """grain's thread prefetch, whose iterators are closed (their thread stopped and joined) when the interpreter
    exits: a daemon thread still packing there (inside grain's C++ index_shuffle of a window refill) was killed by
    the finalization and the process aborted ("terminate called without an active exception", exit 134) after a
    run that ended normally without closing its iterator."""

    def __iter__(self):
        it = super().__iter__()
        _LIVE_PREFETCH.add(it)
        return it


@atexit.register
def _close_prefetch_threads() -> None:
    for it in list(_LIVE_PREFETCH):
        try:
            it.close()
        except Exception:  # noqa: BLE001 (exiting: a failed close must not hide the run's own outcome)
            pass


class ShardedBatches:
    """Batches of `num_shards` document shards (make_dataset's process_index / process_count), concatenated
    along the rows in shard order; this process holds shards [process_index * k, (process_index + 1) * k) with
    k = num_shards / process_count, i.e. the rows that its devices own in the global batch.

    get_state() -> {"num_shards": n, "shards": {"i": grain state}} for this process's shards; set_state() accepts
    any superset (a checkpoint's merged state of all processes, `merge_states`) and takes its own shards, so a
    run can resume on another process count that divides num_shards."""

    def __init__(self, cfg: DataConfig, *, vocab_size: int, process_index: int = 0, process_count: int = 1):
        n = cfg.shards or process_count
        if n % process_count:
            raise ValueError(f"data.shards {n} must be a multiple of the process count {process_count}")
        k = n // process_count
        self.num_shards = n
        self.ids = list(range(process_index * k, (process_index + 1) * k))
        # one source for this process's shards: each built its own (a JSONL line index of 16 bytes per line and
        # its indexing pass: k times the memory and start-up time); its caches are sized for k readers
        source = make_source(cfg, readers=k) if k > 1 else None
        self.iters = [iter(make_dataset(cfg, vocab_size=vocab_size, process_index=i, process_count=n, source=source))
                      for i in self.ids]

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batches = [next(it) for it in self.iters]
        return {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}

    def get_state(self) -> dict:
        return {"num_shards": self.num_shards, "shards": {str(i): it.get_state() for i, it in zip(self.ids, self.iters)}}

    def set_state(self, state: dict) -> None:
        if "num_shards" not in state:
            raise ValueError(f"data state is one unsharded stream (data.shards=0 on one process), this run has "
                             f"{self.num_shards} shards: resume with data.shards=0 on one process")
        if state["num_shards"] != self.num_shards:
            raise ValueError(f"data state has {state['num_shards']} shards, this run {self.num_shards}: set "
                             "data.shards to the checkpoint's count to resume on another number of processes")
        missing = [i for i in self.ids if str(i) not in state["shards"]]
        if missing:
            raise ValueError(f"data state lacks shards {missing} of this process (have {sorted(state['shards'])})")
        for i, it in zip(self.ids, self.iters):
            it.set_state(state["shards"][str(i)])

    def close(self) -> None:
        for it in self.iters:
            close = getattr(it, "close", None)
            if close is not None:
                close()


def merge_states(states: list[dict]) -> dict:
    """One data state from every process's ShardedBatches.get_state() (for a checkpoint)."""
    merged = {"num_shards": states[0]["num_shards"], "shards": {}}
    for st in states:
        merged["shards"].update(st["shards"])
    return merged


def make_iterator(cfg: DataConfig, *, vocab_size: int, process_index: int = 0, process_count: int = 1):
    """This process's batches: iter(make_dataset(...)) (a grain DatasetIterator with get_state() / set_state())
    for one shard, a ShardedBatches over its shards otherwise (cfg.shards, or one shard per process)."""
    if (cfg.shards or process_count) == 1:
        return iter(make_dataset(cfg, vocab_size=vocab_size))
    return ShardedBatches(cfg, vocab_size=vocab_size, process_index=process_index, process_count=process_count)
