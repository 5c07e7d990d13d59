"""Codecs: text <-> ids with the chat markers as single special ids. :class:`TinyCodec` (characters, for tiny CPU
models) and :class:`HFCodec` (an HF ``tokenizers`` BPE; :func:`load_tokenizer`: the shipped 1536-id one)."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any, Protocol, Sequence

from dsv32_jax.posttrain.chat.tokens import ASSISTANT, BOS, EOS, PAD, SPECIAL_TOKENS, THINK_CLOSE, THINK_OPEN, USER

__all__ = ["CHAT_TOKENIZER_PATH", "PRINTABLE_CHARS", "TINY_CHARS", "Codec", "HFCodec", "TinyCodec", "load_tokenizer"]


class Codec(Protocol):
    """Text <-> ids where every string of :data:`SPECIAL_TOKENS` is ONE id. ``encode`` reads special-token strings as
    special tokens (for the format's markup), ``encode_text`` never does (for data: messages, tool results)."""

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    special_tokens: tuple[str, ...]  # every string the codec maps to a special id (at least SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]:
        """``text`` as plain text: never a special id, even where ``text`` spells one (``decode`` gives it back)."""

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_to_id(self, token: str) -> int: ...


#: TinyCodec's default characters: digits, lowercase letters, space, newline and a little punctuation.
TINY_CHARS = string.digits + string.ascii_lowercase + " \n" + "{}[]\":,.=+-*/()_<>?!'"
#: Printable ASCII plus newline (no tab / CR): enough for the tools prompt; 96 characters + 17 specials = 113 ids.
PRINTABLE_CHARS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")


def _check_text(codec: str, text: Any) -> None:
    """What the codecs encode: a ``str`` that UTF-8 can represent (a lone surrogate such as ``"\\ud800"``, which a
    JSON value can spell, cannot be). Raises a ValueError naming the codec, so callers that turn unencodable data into
    an error result (tool results, a model's tool-call arguments) need to catch one exception type."""
    if not isinstance(text, str):
        raise ValueError(f"{codec}: expected text (str), got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{codec}: character {text[e.start]!r} at offset {e.start} is not valid Unicode text "
                         f"({e.reason})") from None


class TinyCodec:
    """A character-level codec for CPU tests with tiny models: ids 0..16 are :data:`SPECIAL_TOKENS` (PAD = 0),
    then one id per character of ``chars``. Special tokens are matched greedily (longest first) wherever they
    occur; any other character must be in ``chars`` or encoding raises a ValueError naming it."""

    def __init__(self, chars: str = TINY_CHARS, max_vocab: int = 128):
        seen: set[str] = set()
        for c in chars:
            if c in seen:
                raise ValueError(f"TinyCodec: character {c!r} appears twice in chars")
            seen.add(c)
        self.chars = chars
        self._vocab = list(SPECIAL_TOKENS) + list(chars)
        self._ids = {tok: i for i, tok in enumerate(self._vocab)}
        self._specials = sorted(SPECIAL_TOKENS, key=len, reverse=True)
        self.special_tokens = SPECIAL_TOKENS
        self.vocab_size = len(self._vocab)
        if self.vocab_size > max_vocab:
            raise ValueError(f"TinyCodec: {self.vocab_size} ids > max_vocab={max_vocab}; use fewer chars")
        self.pad_id, self.bos_id, self.eos_id = self._ids[PAD], self._ids[BOS], self._ids[EOS]

    @classmethod
    def printable(cls) -> "TinyCodec":
        """A TinyCodec over :data:`PRINTABLE_CHARS` (needed for the English tools prompt)."""
        return cls(PRINTABLE_CHARS)

    def encode(self, text: str, specials: bool = True) -> list[int]:
        if not isinstance(text, str):
            _check_text("TinyCodec", text)
        ids, i = [], 0
        while i < len(text):
            c = text[i]
            if c == "<" and specials:
                tok = next((s for s in self._specials if text.startswith(s, i)), None)
                if tok is not None:
                    ids.append(self._ids[tok])
                    i += len(tok)
                    continue
            if c not in self._ids or len(c) != 1:
                raise ValueError(f"TinyCodec: character {c!r} (U+{ord(c):04X}) at offset {i} is not in the "
                                 f"vocabulary; add it to chars= (or use TinyCodec.printable() / HFCodec)")
            ids.append(self._ids[c])
            i += 1
        return ids

    def encode_text(self, text: str) -> list[int]:
        """One id per character, special-token strings included (``<think>`` is 7 ids)."""
        return self.encode(text, specials=False)

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"TinyCodec: id {i} outside the vocabulary [0, {self.vocab_size})")
            out.append(self._vocab[i])
        return "".join(out)

    def token_to_id(self, token: str) -> int:
        if token not in self._ids:
            raise ValueError(f"TinyCodec: {token!r} is not a token (specials: {', '.join(SPECIAL_TOKENS)})")
        return self._ids[token]


class HFCodec:
    """An HF ``tokenizers.Tokenizer`` in which the chat specials are added tokens.

    ``strict=True`` (default) requires every string of :data:`SPECIAL_TOKENS` to be one id; ``strict=False``
    only BOS, EOS, the role markers and the think tags (e.g. for a third-party tokenizer that splits DSML tags;
    :func:`encode_tokens`'s prefix guarantee then holds only at those tokens)."""

    def __init__(self, tokenizer: Any, strict: bool = True):
        import tokenizers  # noqa: PLC0415  (only the HF codec needs it)

        self._tok = tokenizer
        # encode_text: a copy that reads special-token strings as text (a flag of the tokenizer, so not toggled on
        # the shared one: rollout threads encode concurrently)
        self._plain = tokenizers.Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self.special_tokens = tuple(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special)
        required = SPECIAL_TOKENS if strict else (BOS, EOS, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE)
        self._special_ids: dict[str, int] = {}
        for tok in SPECIAL_TOKENS:
            tid = tokenizer.token_to_id(tok)
            single = tid is not None and tokenizer.encode(tok, add_special_tokens=False).ids == [tid]
            if single:
                self._special_ids[tok] = tid
            elif tok in required:
                raise ValueError(f"HFCodec: special token {tok!r} is not a single added token of this tokenizer "
                                 "(register it with add_special_tokens)")
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id = self._special_ids[BOS], self._special_ids[EOS]
        self.pad_id = self._special_ids.get(PAD, self.eos_id)

    @classmethod
    def from_file(cls, path: str | Path, strict: bool = True) -> "HFCodec":
        import tokenizers  # noqa: PLC0415  (only the HF codec needs it)

        return cls(tokenizers.Tokenizer.from_file(str(path)), strict=strict)

    def encode(self, text: str) -> list[int]:
        _check_text("HFCodec", text)
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        _check_text("HFCodec", text)
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int:
        if token in self._special_ids:
            return self._special_ids[token]
        ids = self.encode(token)
        if len(ids) != 1:
            raise ValueError(f"HFCodec: {token!r} is not a single token (it encodes to {len(ids)} ids)")
        return ids[0]


#: The shipped BPE tokenizer (``tools/make_chat_tokenizer.py`` regenerates it).
CHAT_TOKENIZER_PATH = Path(__file__).resolve().parents[2] / "assets" / "chat_tokenizer.json"


def load_tokenizer(path: str | Path | None = None) -> HFCodec:
    """The shipped chat BPE tokenizer (or the tokenizer.json at ``path``) as an :class:`HFCodec`."""
    path = CHAT_TOKENIZER_PATH if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"chat tokenizer {path} not found; run `python tools/make_chat_tokenizer.py`")
    return HFCodec.from_file(path)
