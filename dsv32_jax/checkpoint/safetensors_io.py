"""Memory-mapped safetensors reading for every dtype DeepSeek checkpoints use (F8_E4M3 included, which the
`safetensors` numpy backend cannot return). Headers and byte ranges are validated so that a truncated or
corrupt shard fails with the file and tensor named, before any data is touched."""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, malformed or does not match the model; names file and tensor."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_entry(path: str, name: str, e) -> None:
    """One header entry's structure: {"dtype": str, "shape": [int >= 0, ...], "data_offsets": [begin, end]} with
    0 <= begin <= end (the byte range's size and bounds are checked against the shape and the file after)."""
    if not isinstance(e, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: tensor '{name}' is a JSON {type(e).__name__}, "
                              "not an object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in e:
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor '{name}' has no '{key}'")
    if not isinstance(e["dtype"], str):
        raise CheckpointError(f"{path}: corrupt safetensors header: tensor '{name}' has dtype {e['dtype']!r} (a "
                              "string such as \"BF16\" expected)")
    shape, offsets = e["shape"], e["data_offsets"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{path}: corrupt safetensors header: tensor '{name}' has shape {shape!r} (a list of "
                              "non-negative integers expected)")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{path}: corrupt safetensors header: tensor '{name}' has data_offsets {offsets!r} "
                              "([begin, end] with 0 <= begin <= end expected)")


class SafetensorsFile:
    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{path}: truncated safetensors file (no header)")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8 or n > 100 << 20:
                    raise CheckpointError(f"{path}: corrupt safetensors header (length {n}, file size {size})")
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise CheckpointError(f"{path}: file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
        self.metadata = header.pop("__metadata__", {}) or {}
        self._base = 8 + n
        self._entries = header
        data_size = size - self._base
        for name, e in header.items():
            _check_entry(path, name, e)
            if e.get("dtype") not in DTYPES:
                raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {e.get('dtype')!r}")
            begin, end = e["data_offsets"]
            want = int(np.prod(e["shape"], dtype=np.int64)) * DTYPES[e["dtype"]].itemsize
            if end - begin != want:
                raise CheckpointError(f"{path}: tensor '{name}' byte range {end - begin} != {want} for shape "
                                      f"{e['shape']} {e['dtype']}")
            if end > data_size:
                raise CheckpointError(f"{path}: truncated: tensor '{name}' ends at byte {end} but the data section "
                                      f"has {data_size} bytes")

    def keys(self):
        return self._entries.keys()

    def dtype_name(self, name: str) -> str:
        return self._entries[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def nbytes(self, name: str) -> int:
        begin, end = self._entries[name]["data_offsets"]
        return end - begin

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory-mapped numpy array (no copy)."""
        e = self._entries[name]
        begin, _ = e["data_offsets"]
        shape = tuple(e["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            return np.zeros(shape, DTYPES[e["dtype"]])
        return np.memmap(self.path, dtype=DTYPES[e["dtype"]], mode="r", offset=self._base + begin, shape=shape)


class HFCheckpoint:
    """All tensors of an HF checkpoint directory: `model.safetensors.index.json` shards or one `*.safetensors`."""

    def __init__(self, directory: str):
        self.directory = directory
        index_path = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: not a valid safetensors index ({e!r})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index_path}: not a valid safetensors index (weight_map must map tensor "
                                      f"names to shard file names, got a {type(weight_map).__name__})")
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not os.path.exists(os.path.join(directory, shard)):
                    raise CheckpointError(f"{index_path}: points at shard '{shard}', which does not exist in {directory}")
        else:
            shards = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors")) if os.path.isdir(directory) else []
            if not shards:
                raise CheckpointError(f"{directory}: no model.safetensors.index.json and no *.safetensors files")
            weight_map = None
        self.files = {s: SafetensorsFile(os.path.join(directory, s)) for s in shards}
        self.location: dict[str, SafetensorsFile] = {}
        for shard, f in self.files.items():
            for name in f.keys():
                if weight_map is not None and weight_map.get(name) != shard:
                    raise CheckpointError(f"{f.path}: tensor '{name}' is not listed for this shard in "
                                          "model.safetensors.index.json")
                if name in self.location:  # (with an index, the check above has already refused this)
                    raise CheckpointError(f"tensor '{name}' is in two shards, {self.location[name].path} and "
                                          f"{f.path}: which one to load is ambiguous")
                self.location[name] = f
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.location))
            if missing:
                raise CheckpointError(f"{index_path}: lists {len(missing)} tensors absent from their shards, e.g. "
                                      f"'{missing[0]}' (expected in {weight_map[missing[0]]})")

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def names(self) -> list[str]:
        return list(self.location)

    def where(self, name: str) -> str:
        return self.location[name].path

    def get(self, name: str) -> np.ndarray:
        if name not in self.location:
            raise CheckpointError(f"{self.directory}: missing tensor '{name}'")
        return self.location[name].get(name)


def check_finite(ok, ckpt: HFCheckpoint, name: str) -> None:
    """The one finiteness check of checkpoint values (hf-to-orbax and from_pretrained): `ok` = all values finite."""
    if not bool(ok):
        raise CheckpointError(f"{ckpt.where(name)}: tensor '{name}' contains NaN or Inf values (corrupt shard?)")


def check_scale_values(ckpt: HFCheckpoint, scale_name: str, scale: np.ndarray) -> None:
    """FP8 block scales must be finite and >= 0."""
    if not np.all(np.isfinite(scale)) or np.any(scale < 0):
        bad = np.argwhere(~np.isfinite(scale) | (scale < 0))[0]
        raise CheckpointError(f"{ckpt.where(scale_name)}: scale '{scale_name}' has an invalid value "
                              f"{float(scale[tuple(bad)])!r} at block {bad.tolist()} (expected finite and >= 0)")


def check_alias(ckpt: HFCheckpoint, alias: str, main: str, chunk_bytes: int = 64 << 20) -> int:
    """The MTP copies of embed / lm_head must equal the originals (they are shared here); returns bytes read."""
    a, b = ckpt.get(alias), ckpt.get(main)
    rows = max(1, chunk_bytes // max(1, a.strides[0]))
    for r in range(0, a.shape[0], rows):
        x, y = np.asarray(a[r:r + rows]), np.asarray(b[r:r + rows])
        same = np.array_equal(x, y) if x.dtype == y.dtype else np.array_equal(x.astype(np.float32), y.astype(np.float32))
        if not same:
            raise CheckpointError(f"{ckpt.where(alias)}: tensor '{alias}' should be an exact copy of '{main}' "
                                  f"({ckpt.where(main)}; the MTP layer shares the main embedding / LM head) but "
                                  f"differs in rows {r}..{r + len(x) - 1}; refusing to drop it")
    n = a.nbytes
    del a, b
    return n


# ======================================================================================== safetensors writing
# Small whole files go through `safetensors.numpy.save_file`. The streaming shard writer below stays ours: it writes
# tensors one by one as a conversion produces them (bounded memory for a 671B export), which save_file (a dict of
# in-memory arrays) cannot; likewise the reader above: `safetensors.safe_open(framework="numpy")` cannot return
# F8_E4M3 tensors, which every DeepSeek checkpoint holds.
def _header_bytes(entries: list[tuple[str, tuple, str]], metadata: Mapping[str, str] | None) -> bytes:
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, shape, kind in entries:
        n = int(np.prod(shape, dtype=np.int64)) * DTYPES[kind].itemsize
        header[name] = {"dtype": kind, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _nbytes(shape, kind) -> int:
    return int(np.prod(shape, dtype=np.int64)) * DTYPES[kind].itemsize


def _as_bytes(x: np.ndarray):
    x = np.ascontiguousarray(x)
    return x.reshape(-1).view(np.uint8).data


class ShardedSafetensorsWriter:
    """Writes a planned list of tensors (name, shape, safetensors dtype) into size-bounded shards
    `model-0000N-of-0000M.safetensors` + `model.safetensors.index.json`, streaming: tensors arrive one by one, in
    plan order, and go straight to disk (each shard's header is known in advance)."""

    def __init__(self, directory: str, entries: Iterable[tuple[str, tuple, str]], max_shard_bytes: int,
                 metadata: Mapping[str, str] | None = None, prefix: str = "model"):
        self.directory = directory
        self.metadata = {"format": "pt", **(metadata or {})}
        entries = [(n, tuple(int(d) for d in s), k) for n, s, k in entries]
        names = [e[0] for e in entries]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in the shard plan")
        self.shards: list[list] = []
        size = 0
        for e in entries:
            n = _nbytes(e[1], e[2])
            if not self.shards or (size + n > max_shard_bytes and self.shards[-1]):
                self.shards.append([])
                size = 0
            self.shards[-1].append(e)
            size += n
        m = len(self.shards)
        self.files = [f"{prefix}-{i + 1:05d}-of-{m:05d}.safetensors" for i in range(m)]
        self.total_size = sum(_nbytes(s, k) for _, s, k in entries)
        self._plan = [(i, e) for i, shard in enumerate(self.shards) for e in shard]
        self._pos = 0
        self._file = None
        self._shard = -1

    def add(self, name: str, array: np.ndarray) -> None:
        if self._pos >= len(self._plan):
            raise RuntimeError(f"tensor '{name}' is beyond the shard plan")
        shard, (want_name, want_shape, want_kind) = self._plan[self._pos]
        kind = DTYPE_NAMES.get(np.dtype(array.dtype))
        if (name, tuple(array.shape), kind) != (want_name, want_shape, want_kind):
            raise RuntimeError(f"shard plan mismatch: got '{name}' {list(array.shape)} {kind}, planned "
                               f"'{want_name}' {list(want_shape)} {want_kind}")
        if shard != self._shard:
            self._close_file()
            self._shard = shard
            self._file = open(os.path.join(self.directory, self.files[shard]), "wb")
            self._file.write(_header_bytes(self.shards[shard], self.metadata))
        self._file.write(_as_bytes(array))
        self._pos += 1

    def _close_file(self):
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def close(self) -> None:
        self._close_file()
        if self._pos != len(self._plan):
            raise RuntimeError(f"shard plan incomplete: {self._pos} of {len(self._plan)} tensors written")
        weight_map = {name: self.files[i] for i, (name, _, _) in self._plan}
        index = {"metadata": {"total_size": self.total_size},
                 "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(self.directory, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
    """One safetensors file from in-memory arrays (BF16 and F8_E4M3 included, via ml_dtypes), written to a temporary
    name and renamed."""
    from safetensors.numpy import save_file

    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({n: np.ascontiguousarray(a) for n, a in tensors.items()}, tmp, metadata={"format": "pt", **(metadata or {})})
    os.replace(tmp, path)
