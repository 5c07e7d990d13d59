"""Output helpers of the converters: atomic output directories (written as `<out>.tmp-<pid>`, renamed when
complete, so nothing is ever left half-written under the final name) and a tqdm progress bar in bytes."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from typing import Iterable

from tqdm import tqdm

from dsv32_jax.checkpoint.safetensors_io import INDEX_FILE

ORBAX_META_FILE = "dsv32_meta.json"  # marks a converted orbax checkpoint (dsv32_jax.checkpoint.orbax_io.META_FILE)
# What serving an exported checkpoint needs besides the weights and config.json (copied along by both converters).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copies the TOKENIZER_FILES present in src_dir to dst_dir; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        path = os.path.join(src_dir, name)
        if os.path.isfile(path):
            shutil.copy2(path, os.path.join(dst_dir, name))
            copied.append(name)
    return copied


class OutputExistsError(FileExistsError):
    """The output path already holds something and --overwrite was not given."""


class OutputPathError(OSError):
    """The output cannot be written where it was asked for (its parent is a regular file, is not writable, the
    final rename failed, ...): an OSError with errno / strerror / filename; `str()` names the path. The CLIs print
    it as `--out=<out>: <strerror>`."""

    def __init__(self, out: str, err: OSError):
        super().__init__(err.errno, err.strerror or str(err), out)
        self.out = out

    def __str__(self) -> str:
        return f"{self.out}: {self.strerror}"


def check_output_parent(out: str) -> None:
    """Refuses, before any work, an output whose parent directory cannot exist: the nearest existing ancestor of
    `out` must be a directory (a regular file there makes every `makedirs` fail with "File exists" / "Not a
    directory"). Creates nothing. Raises OutputPathError."""
    out = os.path.abspath(os.fspath(out))
    parent = os.path.dirname(out)
    probe = parent
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise OutputPathError(out, NotADirectoryError(errno.ENOTDIR, f"{os.strerror(errno.ENOTDIR)}: {probe}"))


class Progress:
    """tqdm over bytes (B/s, ETA) with the tensor count alongside; keeps the totals for the conversion summary."""

    def __init__(self, label: str, total_items: int, total_bytes: int, enabled: bool = True, unit: str = "tensors"):
        self.items, self.nbytes, self.total_items, self.unit = 0, 0, total_items, unit
        self.start = time.perf_counter()
        self._bar = tqdm(total=total_bytes, desc=label, unit="B", unit_scale=True, unit_divisor=1000,
                         disable=not enabled, mininterval=0.5, dynamic_ncols=True)

    def update(self, items: int = 0, nbytes: int = 0) -> None:
        self.items += items
        self.nbytes += nbytes
        self._bar.set_postfix_str(f"{self.items}/{self.total_items} {self.unit}", refresh=False)
        self._bar.update(nbytes)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def close(self) -> None:
        self._bar.close()


def _same_or_nested(a: str, b: str) -> bool:
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep)


def drop_partial_last_line(path: str) -> None:
    """A run killed inside a write to a JSON-lines log leaves a last line without its newline; the next run's
    first row would be appended to it (one line that is not JSON). Cut the file back to its last complete line."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        f.seek(max(0, size - (1 << 20)))
        tail = f.read()
        cut = tail.rfind(b"\n")
        f.truncate(size - len(tail) + cut + 1 if cut >= 0 else max(0, size - len(tail)))


def write_text_atomic(path: str, text: str) -> None:
    """Writes `text` to `path` through `<path>.tmp-<pid>` and a rename: a reader sees the old file or the new one,
    never a partial one (a full disk or a kill leaves the old file in place)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp) and not os.path.isdir(tmp):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def atomic_output_dir(out: str, overwrite: bool = False, inputs: Iterable[str] = ()):
    """Yields a fresh `<out>.tmp-<pid>` directory; renamed to `out` only if the block completes. An existing
    non-empty `out` is refused unless overwrite (then replaced only at the very end)."""
    out = os.path.abspath(os.fspath(out))
    for src in inputs:
        if _same_or_nested(out, src):
            raise OutputExistsError(f"{out}: the output must not be, contain, or lie inside the input {src}")
    if os.path.lexists(out):
        if not os.path.isdir(out):
            if not overwrite:
                raise OutputExistsError(f"{out}: exists and is not a directory; pass --overwrite to replace it")
            content = []
        else:
            content = sorted(os.listdir(out))
        if content and not overwrite:
            kind = ("an orbax checkpoint" if os.path.exists(os.path.join(out, ORBAX_META_FILE)) else
                    "an HF checkpoint" if os.path.exists(os.path.join(out, INDEX_FILE)) or
                    any(c.endswith(".safetensors") for c in content) else f"{len(content)} entries")
            raise OutputExistsError(f"{out}: output directory already exists and holds {kind}; refusing to overwrite "
                                    "it (pass --overwrite to replace it)")
    check_output_parent(out)
    parent = os.path.dirname(out)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        os.makedirs(parent, exist_ok=True)
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp)
        elif os.path.lexists(tmp):
            os.remove(tmp)
        os.makedirs(tmp)
    except OSError as e:
        raise OutputPathError(out, e) from None
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        if os.path.lexists(out):
            old = f"{out}.old-{os.getpid()}"
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)  # the previous output back in place
                raise
            if os.path.isdir(old) and not os.path.islink(old):
                shutil.rmtree(old, ignore_errors=True)
            else:  # a file or a link that --overwrite replaces
                os.remove(old)
        else:
            os.rename(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise OutputPathError(out, e) from None
        raise
