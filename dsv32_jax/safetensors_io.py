"""Memory-mapped safetensors reading for every dtype DeepSeek checkpoints use (F8_E4M3 included, which the
`safetensors` numpy backend cannot return). Headers and byte ranges are validated so that a truncated or
corrupt shard fails with the file and tensor named, before any data is touched."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, malformed or does not match the model; names file and tensor."""


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
        self.metadata = header.pop("__metadata__", {}) or {}
        self._base = 8 + n
        self._entries = header
        data_size = size - self._base
        for name, e in header.items():
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
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path}: not a valid safetensors index ({e!r})") from None
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
