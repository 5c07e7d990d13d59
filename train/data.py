"""Training data: a deterministic, resumable grain pipeline of packed token rows.

Pipeline (``make_dataset``)::

    documents (random-access source: builtin / JSONL / Parquet / ArrayRecord / text)
      -> per-epoch shuffle (global; per row group for Parquet) -> repeat(num_epochs)
      -> this host's shard  [process_index::process_count] of the document stream
      -> tokenize (+ EOS)  (in ReadOptions threads, or in `worker_count` processes via mp_prefetch)
      -> pack into rows of seq_len (concatenate, then split)
      -> shuffle rows in windows of `shuffle_window` (with shuffle)  -> batch(batch_size // process_count)

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

With ``add_eos`` the tokenizer's EOS id ends every document (the byte tokenizer has none; documents are
still separated by segment ids). Empty documents (empty or whitespace-only text, null fields) are
skipped: they carry no tokens. Nothing else is dropped, except, when ``num_epochs`` is finite, the final
partial batch of each host (the last partial row is padded and kept). Hosts shard documents, so with a
finite ``num_epochs`` they can run out a few batches apart: multi-host training should use
``num_epochs=None`` and stop after a number of steps.

Order is a pure function of the config and seed: ``get_state()`` of the iterator is a small
JSON-serializable dict and ``set_state()`` resumes exactly at the next batch. The document shard of a
host depends on ``process_count``; the rows do not depend on ``worker_count`` (workers only read and
tokenize; packing runs in the host process), but the iterator state format does, so keep
``worker_count`` fixed across a resume.

Sources (``DataConfig.source``; ``paths`` are files, directories or glob patterns, sorted per entry):

* ``builtin``: Python's own documentation, present on every CPython install: the pydoc help topics
  (``pydoc_data.topics``, ~80 documents, ~0.5 MB) and the docstrings of a fixed list of stdlib modules
  (one document per module, ~0.4 MB). Fixed order; contents depend on the Python version.
* ``jsonl``: one JSON object per line, text under ``text_field``; blank lines are ignored. Files are
  indexed by line offsets once (one pass) and read line by line on demand.
* ``parquet``: string column ``text_field``; read one row group at a time. Shuffling permutes the row
  groups and the rows within each row group (a full shuffle would decode a row group per document).
* ``arrayrecord``: one document per record; a record that is a JSON object must hold ``text_field``,
  any other record is taken as raw UTF-8 text.
* ``text``: ``.txt`` files (a directory means the ``*.txt`` files under it); each file is one document.
  Files larger than 1 MiB are read as consecutive pieces of about 1 MiB cut at line ends, each piece its
  own document (bounded memory; documents are split into seq_len pieces anyway). Invalid UTF-8 bytes in
  text files and raw ArrayRecord records decode to U+FFFD.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import glob
import importlib
import inspect
import json
import os
import threading
import warnings
from typing import Any, Protocol, Sequence

import grain
import numpy as np

from dsv32_jax.optional import require

SOURCES = ("builtin", "jsonl", "parquet", "arrayrecord", "text")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "builtin"  # "builtin" | "jsonl" | "parquet" | "arrayrecord" | "text"
    paths: tuple[str, ...] = ()  # files, directories or glob patterns (ignored for builtin)
    text_field: str = "text"  # JSONL key / Parquet column / JSON key inside ArrayRecord records
    tokenizer: str = "byte"  # "byte", a tokenizer.json, or a checkpoint dir containing tokenizer.json
    seq_len: int = 128
    batch_size: int = 4  # global batch (rows); each host yields batch_size // process_count
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None  # None = repeat forever
    add_eos: bool = True  # append the tokenizer's EOS id to each document (byte tokenizer: none)
    worker_count: int = 0  # grain worker processes for reading + tokenizing (0 = threads in-process)
    shuffle_window: int = 512  # with shuffle: packed rows shuffled together in windows of this many (<= 1: off)

    def __post_init__(self):
        paths = self.paths
        if isinstance(paths, (str, os.PathLike)):
            paths = (paths,)
        object.__setattr__(self, "paths", tuple(os.fspath(p) for p in (paths or ())))
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be one of {SOURCES}, got {self.source!r}")
        if self.source != "builtin" and not self.paths:
            raise ValueError(f"data.paths is empty: source {self.source!r} needs files or glob patterns")
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {self.batch_size}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"data.num_epochs must be None or >= 1, got {self.num_epochs}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"data.seed must be in [0, 2**32), got {self.seed}")
        if self.worker_count < 0:
            raise ValueError(f"data.worker_count must be >= 0, got {self.worker_count}")


# ----------------------------------------------------------------------------------------------------
# Tokenizers


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; no special tokens (eos_id None)."""

    name = "byte"
    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


_EOS_CANDIDATES = ("<｜end▁of▁sentence｜>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A HF `tokenizers` tokenizer.json. EOS / BOS come from the files next to it, first found wins:
    tokenizer_config.json (``eos_token``, ``bos_token`` + ``add_bos_token``), then config.json /
    generation_config.json (``eos_token_id``), then well-known EOS token names. ``encode`` applies the
    tokenizer's own post-processor and prepends BOS when tokenizer_config.json asks for it."""

    def __init__(self, path: str):
        import tokenizers  # noqa: PLC0415  (optional at import time of this module)

        self.path = path
        self.name = path
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001  (the Rust error types are not exported)
            raise ValueError(f"cannot load tokenizer {path}: {e}") from e
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        folder = os.path.dirname(os.path.abspath(path))
        tcfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
        self.eos_id = None
        eos = _token_content(tcfg.get("eos_token"))
        if eos is not None:
            self.eos_id = self._tok.token_to_id(eos)
        for name in ("config.json", "generation_config.json"):
            if self.eos_id is None:
                value = _read_json(os.path.join(folder, name)).get("eos_token_id")
                value = value[0] if isinstance(value, list) and value else value
                if isinstance(value, int) and 0 <= value < self.vocab_size:
                    self.eos_id = value
        for candidate in _EOS_CANDIDATES:
            if self.eos_id is None:
                self.eos_id = self._tok.token_to_id(candidate)
        self.bos_id = None
        bos = _token_content(tcfg.get("bos_token"))
        if tcfg.get("add_bos_token") and bos is not None:
            self.bos_id = self._tok.token_to_id(bos)

    def __getstate__(self):  # reload from the file in grain worker processes
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=True).ids
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def make_tokenizer(spec: str, vocab_size: int | None = None) -> ByteTokenizer | HFTokenizer:
    """"byte", a tokenizer.json path, or a (checkpoint) directory containing tokenizer.json. With
    ``vocab_size`` (the model's), raises if the tokenizer can produce ids >= vocab_size."""
    if spec == "byte":
        tok = ByteTokenizer()
    else:
        path = os.path.expanduser(os.fspath(spec))
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer {spec!r}: {path} not found (give \"byte\", a tokenizer.json, "
                                    "or a checkpoint directory that contains tokenizer.json)")
        tok = HFTokenizer(path)
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {tok.name!r} has {tok.vocab_size} ids but the model's vocab_size is "
                         f"{vocab_size}: token ids would fall outside the embedding table. Use a model config "
                         f"with vocab_size >= {tok.vocab_size} or a smaller tokenizer")
    return tok


# ----------------------------------------------------------------------------------------------------
# Document sources: random access, __len__ / __getitem__ -> str ("" for an empty document)


def resolve_paths(patterns: Sequence[str], *, suffixes: tuple[str, ...], what: str) -> list[str]:
    """Expands files / directories / glob patterns (each sorted) into a de-duplicated list of files."""
    out: list[str] = []
    for pattern in patterns:
        pattern = os.path.expanduser(pattern)
        if glob.has_magic(pattern):
            found = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not found:
                raise FileNotFoundError(f"{what}: no files match the pattern {pattern!r}")
        elif os.path.isdir(pattern):
            found = sorted(os.path.join(root, name) for root, _, names in os.walk(pattern) for name in names
                           if any(s in name for s in suffixes))
            if not found:
                raise FileNotFoundError(f"{what}: directory {pattern!r} holds no {'/'.join(suffixes)} files")
        elif os.path.isfile(pattern):
            found = [pattern]
        else:
            raise FileNotFoundError(f"{what}: file {pattern!r} does not exist")
        out.extend(p for p in found if p not in out)
    return out


class _FileReader:
    """pread-based reads (thread safe, no shared file position); descriptors reopened after pickling."""

    def __init__(self, files: Sequence[str]):
        self.files = list(files)
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"files": self.files}

    def __setstate__(self, state):
        self.__init__(state["files"])

    def read(self, file_index: int, start: int, end: int) -> bytes:
        fd = self._fds.get(file_index)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file_index)
                if fd is None:
                    fd = self._fds[file_index] = os.open(self.files[file_index], os.O_RDONLY)
        return os.pread(fd, end - start, start)

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass


class ListSource:
    def __init__(self, documents: Sequence[str]):
        self.documents = list(documents)

    def __len__(self):
        return len(self.documents)

    def __getitem__(self, index):
        return self.documents[index]


def _line_spans(path: str, chunk: int = 1 << 24) -> tuple[np.ndarray, np.ndarray]:
    """Byte [start, end) of every non-empty line (without the newline) of a file, in one pass."""
    newlines = []
    size = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            newlines.append(np.flatnonzero(np.frombuffer(block, np.uint8) == 10) + size)
            size += len(block)
    ends = np.concatenate(newlines + [np.array([size], np.int64)]).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    keep = ends > starts
    return starts[keep], ends[keep]


class JsonlSource:
    def __init__(self, files: Sequence[str], field: str):
        self.field = field
        self._reader = _FileReader(files)
        starts, ends, counts = [], [], []
        for path in files:
            s, e = _line_spans(path)
            starts.append(s)
            ends.append(e)
            counts.append(len(s))
        self._starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self._ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
        self._file_offsets = np.cumsum([0] + counts)
        for i, count in enumerate(counts):  # fail fast on a wrong field name
            if count:
                self[int(self._file_offsets[i])]

    def __len__(self):
        return len(self._starts)

    def _where(self, index: int) -> str:
        f = int(np.searchsorted(self._file_offsets, index, side="right")) - 1
        path = self._reader.files[f]
        with open(path, "rb") as fh:
            line = fh.read(int(self._starts[index])).count(b"\n") + 1
        return f"{path}, line {line}"

    def __getitem__(self, index):
        index = int(index)
        f = int(np.searchsorted(self._file_offsets, index, side="right")) - 1
        raw = self._reader.read(f, int(self._starts[index]), int(self._ends[index]))
        if not raw.strip():
            return ""
        try:
            record = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{self._where(index)}: invalid JSON ({e})") from None
        return _text_of(record, self.field, lambda: self._where(index))


def _text_of(record, field: str, where) -> str:
    if not isinstance(record, dict):
        raise ValueError(f"{where()}: expected a JSON object with the text field {field!r}, "
                         f"got {type(record).__name__}")
    if field not in record:
        raise KeyError(f"{where()}: text field {field!r} missing (keys: {sorted(record)[:20]})")
    value = record[field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where()}: text field {field!r} holds {type(value).__name__}, expected a string")
    return value


class TextSource:
    PIECE_BYTES = 1 << 20

    def __init__(self, files: Sequence[str], piece_bytes: int | None = None):
        self.piece_bytes = piece_bytes or self.PIECE_BYTES
        self._reader = _FileReader(files)
        self._pieces: list[tuple[int, int, int]] = []
        for i, path in enumerate(files):
            size = os.path.getsize(path)
            start = 0
            with open(path, "rb") as f:
                while start < size:
                    end = min(start + self.piece_bytes, size)
                    if end < size:
                        end = self._cut(f, end, size)
                    self._pieces.append((i, start, end))
                    start = end

    @staticmethod
    def _cut(f, pos: int, size: int, look: int = 1 << 16) -> int:
        """First position after a newline at or after pos (else a UTF-8 character boundary)."""
        f.seek(pos)
        block = f.read(look)
        nl = block.find(b"\n")
        if nl >= 0:
            return pos + nl + 1
        i = 0
        while i < len(block) and (block[i] & 0xC0) == 0x80:  # continuation byte
            i += 1
        return min(pos + i, size)

    def __len__(self):
        return len(self._pieces)

    def __getitem__(self, index):
        f, start, end = self._pieces[int(index)]
        return self._reader.read(f, start, end).decode("utf-8", errors="replace")


class ParquetSource:
    """Rows of one string column; decodes a whole row group at a time (small LRU cache)."""

    CACHED_ROW_GROUPS = 4

    def __init__(self, files: Sequence[str], field: str):
        self.files = list(files)
        self.field = field
        rg_rows, rg_where = [], []
        for i, path in enumerate(self.files):
            pf = self._open(path)
            names = pf.schema_arrow.names
            if field not in names:
                raise KeyError(f"{path}: Parquet column {field!r} missing (columns: {names[:20]})")
            typ = pf.schema_arrow.field(field).type
            pa = require("pyarrow", "parquet", "data.source='parquet'")

            is_view = getattr(pa.types, "is_string_view", lambda t: False)
            if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or is_view(typ)):
                raise ValueError(f"{path}: Parquet column {field!r} has type {typ}, expected a string column")
            for g in range(pf.metadata.num_row_groups):
                rg_rows.append(pf.metadata.row_group(g).num_rows)
                rg_where.append((i, g))
        self._rg_where = rg_where
        self._rg_starts = np.cumsum([0] + rg_rows).astype(np.int64)
        self._init_cache()

    def _init_cache(self):
        self._files_open: dict[int, Any] = {}
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self):
        state = dict(self.__dict__)
        for k in ("_files_open", "_cache", "_lock"):
            state.pop(k)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_cache()

    @staticmethod
    def _open(path: str):
        pq = require("pyarrow.parquet", "parquet", "data.source='parquet'")

        try:
            return pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001  (ArrowInvalid, OSError, ...)
            raise ValueError(f"cannot read Parquet file {path}: {e}") from e

    @property
    def blocks(self) -> np.ndarray:
        """Row-group boundaries [num_row_groups + 1] (the unit of locality for shuffling)."""
        return self._rg_starts

    def __len__(self):
        return int(self._rg_starts[-1])

    def _row_group(self, rg: int) -> list:
        with self._lock:
            rows = self._cache.get(rg)
            if rows is not None:
                self._cache.move_to_end(rg)
                return rows
            f, g = self._rg_where[rg]
            pf = self._files_open.get(f)
            if pf is None:
                pf = self._files_open[f] = self._open(self.files[f])
            try:
                rows = pf.read_row_group(g, columns=[self.field]).column(0).to_pylist()
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"cannot read row group {g} of Parquet file {self.files[f]}: {e}") from e
            self._cache[rg] = rows
            while len(self._cache) > self.CACHED_ROW_GROUPS:
                self._cache.popitem(last=False)
            return rows

    def __getitem__(self, index):
        index = int(index)
        rg = int(np.searchsorted(self._rg_starts, index, side="right")) - 1
        value = self._row_group(rg)[index - int(self._rg_starts[rg])]
        return value or ""


class ArrayRecordSource:
    def __init__(self, files: Sequence[str], field: str):
        require("array_record", "arrayrecord", "data.source='arrayrecord'")
        self.files = list(files)
        self.field = field
        self._sources = []
        for path in self.files:
            try:
                self._sources.append(grain.sources.ArrayRecordDataSource([path]))
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"cannot open ArrayRecord file {path}: {e}") from e
        self._offsets = np.cumsum([0] + [len(s) for s in self._sources]).astype(np.int64)
        for i in range(len(self.files)):  # fail fast on a wrong field name
            if self._offsets[i + 1] > self._offsets[i]:
                self[int(self._offsets[i])]

    def __len__(self):
        return int(self._offsets[-1])

    def __getitem__(self, index):
        index = int(index)
        f = int(np.searchsorted(self._offsets, index, side="right")) - 1
        raw = self._sources[f][index - int(self._offsets[f])]
        if raw.lstrip()[:1] == b"{":
            try:
                record = json.loads(raw)
            except ValueError:
                record = None
            if isinstance(record, dict):
                where = lambda: f"{self.files[f]}, record {index - int(self._offsets[f])}"  # noqa: E731
                return _text_of(record, self.field, where)
        return raw.decode("utf-8", errors="replace")


# Stdlib modules whose docstrings form part of the built-in corpus (fixed order; import-safe everywhere).
_DOC_MODULES = (
    "abc argparse ast base64 bisect calendar collections configparser contextlib copy csv dataclasses "
    "datetime decimal difflib enum fractions functools gettext heapq hmac html.parser inspect io ipaddress "
    "itertools json logging math operator os pathlib pickle pprint queue random re sched secrets shlex "
    "shutil socket statistics string struct subprocess tarfile tempfile textwrap threading time timeit "
    "tokenize typing unittest urllib.parse uuid warnings weakref zipfile zlib"
).split()


def _module_document(name: str) -> str:
    try:
        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001
        return ""
    parts = [f"Module {name}\n\n{inspect.cleandoc(mod.__doc__)}" if mod.__doc__ else f"Module {name}"]
    for attr, obj in sorted(vars(mod).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if isinstance(obj.__doc__, str):
            parts.append(f"{name}.{attr}\n{inspect.cleandoc(obj.__doc__)}")
        if inspect.isclass(obj):
            for member, value in sorted(vars(obj).items()):
                if member.startswith("_"):
                    continue
                if inspect.isroutine(value) or isinstance(value, (property, classmethod, staticmethod)):
                    doc = getattr(value, "__doc__", None)
                    if isinstance(doc, str):
                        parts.append(f"{name}.{attr}.{member}\n{inspect.cleandoc(doc)}")
    return "\n\n".join(parts) + "\n" if len(parts) > 1 or mod.__doc__ else ""


@functools.lru_cache(maxsize=1)
def builtin_documents() -> tuple[str, ...]:
    """The built-in demo corpus: pydoc help topics (sorted by topic) then stdlib module docstrings."""
    docs: list[str] = []
    try:
        from pydoc_data.topics import topics  # noqa: PLC0415
    except ImportError:
        topics = {}
    docs.extend(topics[key] for key in sorted(topics) if topics[key].strip())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        docs.extend(doc for doc in map(_module_document, _DOC_MODULES) if doc.strip())
    if sum(map(len, docs)) < 100_000:
        raise RuntimeError("the built-in corpus needs pydoc_data or docstrings (is Python running with -OO?); "
                           "use data.source=jsonl/parquet/arrayrecord/text instead")
    return tuple(docs)


def make_source(cfg: DataConfig):
    """The random-access document source for cfg, and its locality blocks (None = any order is cheap)."""
    if cfg.source == "builtin":
        return ListSource(builtin_documents()), None
    what = f"data source {cfg.source!r}"
    if cfg.source == "jsonl":
        return JsonlSource(resolve_paths(cfg.paths, suffixes=(".jsonl", ".json"), what=what), cfg.text_field), None
    if cfg.source == "text":
        return TextSource(resolve_paths(cfg.paths, suffixes=(".txt",), what=what)), None
    if cfg.source == "parquet":
        src = ParquetSource(resolve_paths(cfg.paths, suffixes=(".parquet",), what=what), cfg.text_field)
        return src, src.blocks
    if cfg.source == "arrayrecord":
        files = resolve_paths(cfg.paths, suffixes=("array_record", "arrayrecord"), what=what)
        return ArrayRecordSource(files, cfg.text_field), None
    raise ValueError(f"unknown data source {cfg.source!r}")


# ----------------------------------------------------------------------------------------------------
# Grain transformations


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
        if self.eos_id is not None:
            ids = np.append(ids, np.int32(self.eos_id))
        if ids.size and (int(ids.max()) >= self.vocab_size or int(ids.min()) < 0):
            raise ValueError(f"tokenizer {self.tokenizer.name!r} produced id {int(ids.max())} outside the "
                             f"model's vocab_size {self.vocab_size}")
        return ids.astype(np.int32, copy=False)


class PackIterDataset(grain.IterDataset):
    """Concatenate-then-split packing of token arrays into rows of seq_len (see the module docstring)."""

    def __init__(self, parent: grain.IterDataset, seq_len: int):
        super().__init__(parent)
        self._seq_len = seq_len

    def __iter__(self):
        return _PackIterator(self._parent.__iter__(), self._seq_len)

    def __str__(self):
        return f"PackIterDataset(seq_len={self._seq_len})"


class RowShuffleIterDataset(grain.IterDataset):
    """Shuffles consecutive windows of `window` rows (so the rows of one long document spread over many
    batches). State: parent state at the window start + position in it; resuming re-reads that window."""

    def __init__(self, parent: grain.IterDataset, window: int, seed: int):
        super().__init__(parent)
        self._window = window
        self._seed = seed

    def __iter__(self):
        return _RowShuffleIterator(self._parent.__iter__(), self._window, self._seed)

    def __str__(self):
        return f"RowShuffleIterDataset(window={self._window})"


class _RowShuffleIterator(grain.DatasetIterator):
    def __init__(self, parent, window: int, seed: int):
        super().__init__(parent)
        self._window_size = window
        self._seed = seed
        self._rows: list = []
        self._order: np.ndarray = np.zeros(0, np.int64)
        self._pos = 0
        self._index = 0  # index of the window in self._rows (or of the next one when it is used up)
        self._start_state = None

    def _fill(self):
        self._start_state = self._parent.get_state()
        self._rows = []
        for _ in range(self._window_size):
            try:
                self._rows.append(next(self._parent))
            except StopIteration:
                break
        self._order = np.random.default_rng([self._seed, self._index]).permutation(len(self._rows))
        self._pos = 0

    def __next__(self):
        if self._pos == len(self._rows):
            if self._rows:
                self._index += 1
            self._fill()
            if not self._rows:
                raise StopIteration
        row = self._rows[int(self._order[self._pos])]
        self._pos += 1
        return row

    def get_state(self) -> dict:
        if self._pos < len(self._rows):
            return {"parent": self._start_state, "window": self._index, "pos": self._pos}
        return {"parent": self._parent.get_state(), "window": self._index + (1 if self._rows else 0), "pos": 0}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["parent"])
        self._index = int(state["window"])
        self._rows, self._order, self._pos = [], np.zeros(0, np.int64), 0
        if int(state["pos"]):
            self._fill()
            self._pos = min(int(state["pos"]), len(self._rows))

    def __str__(self):
        return f"_RowShuffleIterator(window={self._window_size})"


class _PackIterator(grain.DatasetIterator):
    def __init__(self, parent, seq_len: int):
        super().__init__(parent)
        self._seq_len = seq_len
        self._doc: np.ndarray | None = None  # the document being laid out
        self._doc_state = None  # parent state from before the document was fetched
        self._offset = 0  # tokens of _doc already emitted
        self._exhausted = False

    def _next_document(self) -> bool:
        while True:
            state = self._parent.get_state()
            try:
                doc = next(self._parent)
            except StopIteration:
                self._exhausted = True
                return False
            if len(doc):
                self._doc, self._doc_state, self._offset = np.asarray(doc, np.int32), state, 0
                return True

    def __next__(self):
        n = self._seq_len
        tokens = np.zeros(n, np.int32)
        targets = np.zeros(n, np.int32)
        segment_ids = np.zeros(n, np.int32)
        positions = np.zeros(n, np.int32)
        loss_mask = np.zeros(n, np.float32)
        p, segment = 0, 0
        while p < n:
            if self._doc is None and (self._exhausted or not self._next_document()):
                break
            doc, o = self._doc, self._offset
            k = min(n - p, len(doc) - o)
            segment += 1
            tokens[p:p + k] = doc[o:o + k]
            nxt = doc[o + 1:o + k + 1]  # the document's next tokens (one short at its end)
            targets[p:p + len(nxt)] = nxt
            loss_mask[p:p + len(nxt)] = 1.0
            segment_ids[p:p + k] = segment
            positions[p:p + k] = np.arange(k, dtype=np.int32)
            p += k
            self._offset = o + k
            if self._offset == len(doc):
                self._doc, self._doc_state, self._offset = None, None, 0
        if p == 0:
            raise StopIteration
        return {"tokens": tokens, "targets": targets, "segment_ids": segment_ids, "positions": positions,
                "loss_mask": loss_mask}

    def get_state(self) -> dict:
        if self._doc is not None:
            return {"parent": self._doc_state, "offset": self._offset}
        return {"parent": self._parent.get_state(), "offset": 0}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["parent"])
        self._doc, self._doc_state, self._offset, self._exhausted = None, None, 0, False
        offset = int(state["offset"])
        if offset:
            if not self._next_document():
                raise ValueError("iterator state points past the end of the data")
            self._offset = offset

    def __str__(self):
        return f"_PackIterator(seq_len={self._seq_len})"


# ----------------------------------------------------------------------------------------------------
# Entry points


def make_dataset(cfg: DataConfig, *, vocab_size: int, process_index: int = 0,
                 process_count: int = 1) -> grain.IterDataset:
    """Batches of packed rows for this host (see the module docstring for the fields)."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} / process_count {process_count} is not a valid shard")
    if cfg.batch_size % process_count:
        raise ValueError(f"data.batch_size {cfg.batch_size} must be divisible by the process count {process_count}")
    tokenizer = make_tokenizer(cfg.tokenizer, vocab_size)
    source, blocks = make_source(cfg)
    if len(source) == 0:
        raise ValueError(f"data source {cfg.source!r} {list(cfg.paths)} holds no documents")
    ds = grain.MapDataset.source(source)
    if cfg.shuffle:
        ds = ds.shuffle(seed=cfg.seed) if blocks is None else BlockShuffleMapDataset(ds, blocks, cfg.seed)
    ds = ds.repeat(cfg.num_epochs)
    if process_count > 1:
        ds = ds[process_index::process_count]
    ds = ds.map(_Tokenize(tokenizer, cfg.add_eos, vocab_size))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=64))
    if cfg.worker_count > 0:
        from absl import flags  # noqa: PLC0415

        if not flags.FLAGS.is_parsed():  # grain's worker processes read its absl flags (defaults suffice)
            flags.FLAGS.mark_as_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count))
    it = PackIterDataset(it, cfg.seq_len)
    if cfg.shuffle and cfg.shuffle_window > 1:
        it = RowShuffleIterDataset(it, cfg.shuffle_window, cfg.seed)
    return it.batch(cfg.batch_size // process_count, drop_remainder=True)


def make_iterator(cfg: DataConfig, **kw):
    """iter(make_dataset(cfg, **kw)): a grain DatasetIterator with get_state() / set_state()."""
    return iter(make_dataset(cfg, **kw))
