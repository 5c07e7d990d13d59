"""Tokenizers: raw bytes, or an HF `tokenizers` tokenizer.json; `make_tokenizer(spec)`."""

from __future__ import annotations

import json
import os
from typing import Protocol, Sequence

import numpy as np


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


# what HFTokenizer.encode makes of special-token strings in the text: special ids, or the characters they are
SPECIAL_TOKEN_MODES = ("parse", "text")


class HFTokenizer:
    """A HF `tokenizers` tokenizer.json. EOS / BOS come from the files next to it, first found wins:
    tokenizer_config.json (``eos_token``, ``bos_token`` + ``add_bos_token``), then config.json /
    generation_config.json (``eos_token_id``), then well-known EOS token names. ``encode`` applies the
    tokenizer's own post-processor and prepends BOS when tokenizer_config.json asks for it."""

    def __init__(self, path: str, special_tokens: str = "parse"):
        import tokenizers  # noqa: PLC0415  (optional at import time of this module)

        if special_tokens not in SPECIAL_TOKEN_MODES:
            raise ValueError(f"special_tokens must be 'text' or 'parse', got {special_tokens!r}")
        self.path = path
        self.name = path
        self.special_tokens = special_tokens
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001  (the Rust error types are not exported)
            raise ValueError(f"cannot load tokenizer {path}: {e}") from e
        # encode(): with special_tokens="text" a copy that reads special-token strings as text (the flag belongs to
        # the tokenizer object; the one the chat codec checks its specials with keeps parsing them)
        self._encoder = self._tok
        if special_tokens == "text":
            self._encoder = tokenizers.Tokenizer.from_str(self._tok.to_str())
            self._encoder.encode_special_tokens = True
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
        return {"path": self.path, "special_tokens": self.special_tokens}

    def __setstate__(self, state):
        self.__init__(state["path"], state.get("special_tokens", "parse"))

    def encode(self, text: str) -> list[int]:
        """`text`'s ids (the post-processor's BOS / EOS added); its special-token strings become special ids with
        special_tokens="parse", are tokenized as text with "text"."""
        ids = self._encoder.encode(text, add_special_tokens=True).ids
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def chat_codec(self):
        """This tokenizer as a chat codec (`dsv32_jax.posttrain.chat.HFCodec`, non-strict: BOS, EOS, the role markers
        and the think tags must be single added tokens), which encodes a conversation's data (message contents,
        tool results) as plain text: special-token strings inside them never become special ids. ValueError when
        the tokenizer lacks those tokens."""
        if getattr(self, "_codec", None) is None:
            from dsv32_jax.posttrain.chat.codecs import HFCodec  # noqa: PLC0415  (chat is optional here)

            self._codec = HFCodec(self._tok, strict=False)
        return self._codec

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def tokenizer_file(spec: str) -> str:
    """The tokenizer.json a spec other than "byte" names (the file, or one in the directory); raises if absent."""
    path = os.path.expanduser(os.fspath(spec))
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer {spec!r}: {path} not found (give \"byte\", a tokenizer.json, "
                                "or a checkpoint directory that contains tokenizer.json)")
    return path


def tokenizer_record(spec: str) -> str:
    """What a checkpoint's meta records as its tokenizer (`dsv32-generate`, the eval CLI and a resume read it): "byte", or the absolute
    path of the tokenizer.json that config.data.tokenizer names (a file or a directory holding one)."""
    if spec == "byte":
        return spec
    path = os.path.abspath(os.path.expanduser(spec))
    return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path


def make_tokenizer(spec: str, vocab_size: int | None = None,
                   special_tokens: str = "parse") -> ByteTokenizer | HFTokenizer:
    """"byte", a tokenizer.json path, or a (checkpoint) directory containing tokenizer.json. With
    ``vocab_size`` (the model's), raises if the tokenizer can produce ids >= vocab_size. special_tokens: what
    HFTokenizer.encode makes of special-token strings in the text ("parse": special ids, "text": text)."""
    tok = ByteTokenizer() if spec == "byte" else HFTokenizer(tokenizer_file(spec), special_tokens)
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {tok.name!r} has {tok.vocab_size} ids but the model's vocab_size is "
                         f"{vocab_size}: token ids would fall outside the embedding table. Use a model config "
                         f"with vocab_size >= {tok.vocab_size} or a smaller tokenizer")
    return tok
