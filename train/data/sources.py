"""Document sources with random access (``len``, ``[i] -> str``) and ``make_source(cfg)``.

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
  text files, JSONL lines and raw ArrayRecord records decode to U+FFFD, and so do lone surrogates that a JSON
  string spells (``"\\ud800"``: valid JSON, not encodable text).

pyarrow (parquet) and array_record (arrayrecord) are optional: imported only when their source is used; a
missing one raises an ImportError naming ``data.source`` and the pip extra.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import threading
from typing import Any, Sequence

import grain
import numpy as np

from dsv32_jax.optional import require
from dsv32_jax.train.data.builtin import builtin_documents
from dsv32_jax.train.data.config import DataConfig


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))  # .cache/, .crc files, .ipynb_checkpoints/, Spark's _SUCCESS / _temporary/


# metadata that HF datasets' save_to_disk / push_to_hub and the hub's dataset folders keep beside the data files:
# not documents (a directory of them failed at start-up, read as JSON lines)
METADATA_FILES = frozenset({"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"})

# the first bytes of compressed files (gzip, zstd, bz2, xz): a source reads plain files
_COMPRESSED = {"gzip": re.compile(rb"\x1f\x8b"), "zstd": re.compile(rb"\x28\xb5\x2f\xfd"),
               "bzip2": re.compile(rb"BZh[1-9]1AY&SY"), "xz": re.compile(rb"\xfd7zXZ\x00")}


def check_not_compressed(path: str, source: str, head: bytes | None = None) -> None:
    """Refuses a compressed file by name: read as JSON lines it failed at its first line with "invalid JSON (...
    byte 0x8b ...)", read as text it trained on the compressed bytes. head: the file's first bytes when the caller
    has read them (None: read here)."""
    if head is None:
        with open(path, "rb") as f:
            head = f.read(10)
    for kind, magic in _COMPRESSED.items():
        if magic.match(head):
            raise ValueError(f"data source {source!r}: {path} is {kind}-compressed (it starts with the {kind} "
                             "magic bytes); the sources read plain files: decompress it first")


def _data_files(directory: str, suffixes: tuple[str, ...]) -> list[str]:
    """A directory's files that end with one of `suffixes`, or carry one before a shard number
    ('train.array_record-00000-of-00008'); a name that merely contains one, such as corpus.txt.gz or
    part.parquet.crc, is not data. Hidden files and directories are skipped. Sorted."""
    def wanted(name: str) -> bool:
        return not _hidden(name) and name not in METADATA_FILES and (
            name.endswith(suffixes) or any(f"{s}-" in name for s in suffixes))

    found = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = [d for d in dirs if not _hidden(d)]
        found.extend(os.path.join(root, n) for n in names if wanted(n))
    return sorted(found)


def resolve_paths(patterns: Sequence[str], *, suffixes: tuple[str, ...], what: str) -> list[str]:
    """Expands files / directories / glob patterns (each sorted) into a list of files without repeats (one file
    named twice, e.g. by a directory and a glob, or by a relative and an absolute path, is read once). An existing
    file or directory is taken as named even when its name holds glob characters ('shard[0].jsonl')."""
    out: list[str] = []
    seen: set[str] = set()
    for pattern in patterns:
        pattern = os.path.expanduser(pattern)
        if os.path.isfile(pattern):
            found = [pattern]
        elif os.path.isdir(pattern):
            found = _data_files(pattern, suffixes)
            if not found:
                raise FileNotFoundError(f"{what}: directory {pattern!r} holds no {'/'.join(suffixes)} files")
        elif glob.has_magic(pattern):
            found = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not found:
                raise FileNotFoundError(f"{what}: no files match the pattern {pattern!r}")
        else:
            raise FileNotFoundError(f"{what}: file {pattern!r} does not exist")
        for p in found:
            real = os.path.realpath(p)
            if real not in seen:
                seen.add(real)
                out.append(p)
    return out


class _FileReader:
    """pread-based reads (thread safe, no shared file position); descriptors reopened after pickling.

    At most MAX_OPEN descriptors stay open (least recently used closed first, never while a read uses it): a corpus of
    thousands of files read in shuffled order would otherwise keep one descriptor per file and fail with EMFILE
    ("Too many open files") once it met more files than RLIMIT_NOFILE allows (1024 by default on many hosts)."""

    MAX_OPEN = 64

    def __init__(self, files: Sequence[str]):
        self.files = list(files)
        self._fds: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # file -> [fd, readers]
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"files": self.files}

    def __setstate__(self, state):
        self.__init__(state["files"])

    def _close_idle(self) -> None:  # (lock held)
        if len(self._fds) <= self.MAX_OPEN:
            return
        for key in [k for k, (_, users) in self._fds.items() if not users][:len(self._fds) - self.MAX_OPEN]:
            os.close(self._fds.pop(key)[0])

    def read(self, file_index: int, start: int, end: int) -> bytes:
        with self._lock:
            entry = self._fds.get(file_index)
            if entry is None:
                entry = self._fds[file_index] = [os.open(self.files[file_index], os.O_RDONLY), 0]
            else:
                self._fds.move_to_end(file_index)
            entry[1] += 1
        try:
            return os.pread(entry[0], end - start, start)
        finally:
            with self._lock:
                entry[1] -= 1
                self._close_idle()

    def __del__(self):
        for fd, _ in getattr(self, "_fds", {}).values():
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
            if not size:
                check_not_compressed(path, "jsonl", block[:10])
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
        remaining, line = int(self._starts[index]), 1
        with open(path, "rb") as fh:  # counted in 16 MB blocks: a bad line deep in a large file costs no more memory
            while remaining > 0 and (block := fh.read(min(remaining, 1 << 24))):
                line += block.count(b"\n")
                remaining -= len(block)
        return f"{path}, line {line}"

    def __getitem__(self, index):
        index = int(index)
        f = int(np.searchsorted(self._file_offsets, index, side="right")) - 1
        raw = self._reader.read(f, int(self._starts[index]), int(self._ends[index]))
        if not raw.strip():
            return ""
        try:
            try:
                record = json.loads(raw)
            except UnicodeDecodeError:  # invalid UTF-8 bytes (a scraped page): U+FFFD, as in text files, not a dead run
                record = json.loads(raw.decode("utf-8-sig", errors="replace"))  # (a BOM on a file's first line)
        except ValueError as e:
            raise ValueError(f"{self._where(index)}: invalid JSON ({e})") from None
        return _text_of(record, self.field, lambda: self._where(index))


class MissingFieldError(KeyError):
    """A record or file without the configured text field. A KeyError (what a missing key is), whose message reads
    as written: a KeyError's str quotes its text, and every caller printed it through `e.args[0]` to undo that."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # (json.loads joins an escaped pair into one character)


def _text_of(record, field: str, where) -> str:
    if not isinstance(record, dict):
        raise ValueError(f"{where()}: expected a JSON object with the text field {field!r}, "
                         f"got {type(record).__name__}")
    if field not in record:
        raise MissingFieldError(f"{where()}: text field {field!r} missing (keys: {sorted(record)[:20]})")
    value = record[field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where()}: text field {field!r} holds {type(value).__name__}, expected a string")
    return value if value.isascii() else _LONE_SURROGATE.sub("\ufffd", value)


UTF8_BOM = b"\xef\xbb\xbf"


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
                check_not_compressed(path, "text", f.read(10))
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
        raw = self._reader.read(f, start, end)
        if start == 0:  # a file's UTF-8 byte-order mark is no text (it was kept as U+FEFF: 3 byte tokens)
            raw = raw.removeprefix(UTF8_BOM)
        return raw.decode("utf-8", errors="replace")


class ParquetSource:
    """Rows of one string column; decodes a whole row group at a time (small LRU cache)."""

    CACHED_ROW_GROUPS = 4  # per reader of the source (`readers`: ShardedBatches' shards share one)
    MAX_OPEN = 64  # open Parquet files at most (least recently used closed: a corpus of thousands of files)

    def __init__(self, files: Sequence[str], field: str, readers: int = 1):
        self.files = list(files)
        self.field = field
        # readers that iterate apart over this source (the shards of one process): a cache of one reader's groups
        # decoded a group again for most rows
        self.cached_row_groups = self.CACHED_ROW_GROUPS * readers
        pa = require("pyarrow", "parquet", "data.source='parquet'")
        rg_rows, rg_where = [], []
        for i, path in enumerate(self.files):
            pf = self._open(path)
            names = pf.schema_arrow.names
            if field not in names:
                raise MissingFieldError(f"{path}: Parquet column {field!r} missing (columns: {names[:20]})")
            typ = pf.schema_arrow.field(field).type
            is_view = getattr(pa.types, "is_string_view", lambda t: False)
            values = typ.value_type if pa.types.is_dictionary(typ) else typ  # (a pandas category column)
            if not (pa.types.is_string(values) or pa.types.is_large_string(values) or is_view(values)):
                raise ValueError(f"{path}: Parquet column {field!r} has type {typ}, expected a string column")
            for g in range(pf.metadata.num_row_groups):
                rg_rows.append(pf.metadata.row_group(g).num_rows)
                rg_where.append((i, g))
        self._rg_where = rg_where
        self._rg_starts = np.cumsum([0] + rg_rows).astype(np.int64)
        self._init_cache()

    def _init_cache(self):
        self._files_open: collections.OrderedDict = collections.OrderedDict()
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._failed: dict[int, str] = {}  # row group -> its read error (a corrupt group is not read once per row)
        self._lock = threading.Lock()

    def __getstate__(self):
        state = dict(self.__dict__)
        for k in ("_files_open", "_cache", "_failed", "_lock"):
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
            if rg in self._failed:
                raise ValueError(self._failed[rg])
            f, g = self._rg_where[rg]
            pf = self._files_open.get(f)
            if pf is None:
                pf = self._files_open[f] = self._open(self.files[f])
                while len(self._files_open) > self.MAX_OPEN:  # (reads hold the lock: none uses the one closed)
                    self._files_open.popitem(last=False)[1].close()
            else:
                self._files_open.move_to_end(f)
            try:
                rows = pf.read_row_group(g, columns=[self.field]).column(0).to_pylist()
            except Exception as e:  # noqa: BLE001
                self._failed[rg] = f"cannot read row group {g} of Parquet file {self.files[f]}: {e}"
                raise ValueError(self._failed[rg]) from e
            self._cache[rg] = rows
            while len(self._cache) > self.cached_row_groups:
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
        raw = self._sources[f][index - int(self._offsets[f])].removeprefix(UTF8_BOM)  # (a BOM made a JSON record
        if raw.lstrip()[:1] == b"{":  # raw text: its markup was trained on)
            try:
                record = json.loads(raw)
            except ValueError:
                record = None
            if isinstance(record, dict):
                where = lambda: f"{self.files[f]}, record {index - int(self._offsets[f])}"  # noqa: E731
                return _text_of(record, self.field, where)
        return raw.decode("utf-8", errors="replace")


# the file names each source reads in a directory (data.paths may also name files and glob patterns)
SUFFIXES = {"jsonl": (".jsonl", ".json"), "text": (".txt",), "parquet": (".parquet",),
            "arrayrecord": ("array_record", "arrayrecord")}


def source_files(cfg: DataConfig) -> list[str] | None:
    """The files cfg reads (None for the built-in corpus), after the source and split checks; opens none."""
    if cfg.source == "builtin":
        return None
    if cfg.split != "train":
        raise ValueError(f"data.split={cfg.split!r} applies to data.source='builtin' only; for {cfg.source!r} "
                         "point data.paths (or config.eval.paths) at the held-out files")
    if cfg.source not in SUFFIXES:
        raise ValueError(f"unknown data source {cfg.source!r}")
    return resolve_paths(cfg.paths, suffixes=SUFFIXES[cfg.source], what=f"data source {cfg.source!r}")


class SkipBadRecords:
    """data.skip_bad_records: a record the source refuses (invalid JSON, the text field missing or not a string:
    the KeyError / ValueError that names its file and line) reads as an empty document, which packing drops, with a
    warning naming it (the first LOG_FIRST of a process, then every LOG_EVERY-th). Positions are the source's, so
    the stream and a resume are those of the same source with those records empty. The sources' start-up checks
    of each file's first record (a misnamed text field, a file that is not JSON lines) still stop the run."""

    LOG_FIRST, LOG_EVERY = 20, 1000

    def __init__(self, source):
        self.source = source
        self.skipped = 0
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"source": self.source}

    def __setstate__(self, state):
        self.__init__(state["source"])

    def __len__(self):
        return len(self.source)

    def __getitem__(self, index):
        try:
            return self.source[index]
        except (KeyError, ValueError) as e:
            with self._lock:
                self.skipped += 1
                n = self.skipped
            if n <= self.LOG_FIRST or n % self.LOG_EVERY == 0:
                from absl import logging  # noqa: PLC0415

                logging.warning("data.skip_bad_records: skipped %s (%d record(s) skipped by this process so far)",
                                e, n)
            return ""


def make_source(cfg: DataConfig, readers: int = 1):
    """The random-access document source for cfg, and its locality blocks (None = any order is cheap); with
    data.skip_bad_records, wrapped in SkipBadRecords. readers: how many iterators share it (caches are sized for
    them)."""
    files = source_files(cfg)
    if files is None:
        return ListSource(builtin_documents(cfg.split)), None
    if cfg.source == "jsonl":
        src, blocks = JsonlSource(files, cfg.text_field), None
    elif cfg.source == "text":
        src, blocks = TextSource(files), None
    elif cfg.source == "parquet":
        src = ParquetSource(files, cfg.text_field, readers)
        blocks = src.blocks
    else:
        src, blocks = ArrayRecordSource(files, cfg.text_field), None
    return (SkipBadRecords(src) if cfg.skip_bad_records else src), blocks
