"""Synthetic copying data: a stand-in for the pretrained checkpoint the paper's post-training starts from.

The agentic cold start (train/agent_grpo.py) teaches the chat and tool-call format, but the tool environments also
need the model to COPY: a quoted key from the task into the call's arguments, a number from a tool result into
the answer. A tiny model trained from random initialization on a few thousand demonstrations does not learn that
(BENCHMARKS.md, "Agentic post-training"); a pretrained LM has it from pre-training. This module generates
conversations whose only content is copying, in the same chat encoding the environments use, so a short "recall"
stage (``config.agent.recall_steps``) gives a tiny model induction / associative-recall heads first.

Kinds (each a user message and the assistant's answer; the loss is on the answer's tokens, as in the cold start):

    repeat:  user ``repeat "qz41kdv"``                         -> assistant ``qz41kdv``   (8-48 characters)
    recall:  user ``"ab"=12, "xyz"=7, "qd"=88. "xyz"``         -> assistant ``7``
    quote:   user ``mo tal "kq" ren bo``                       -> assistant ``kq``

and two raw kinds (no chat wrapping, loss on EVERY token of the copies):

    induction: ``BOS s_1 .. s_n s_1 .. s_n`` where s_i are random single-character tokens (letters, digits, the
               quote: the characters lookup keys and values are made of), n = ``INDUCTION_LEN`` (default 24)
               (BENCHMARKS.md's positive control). The copy is always n + 1 positions back, so a model can solve it
               with a fixed-offset head instead of an induction head: it does not transfer to the environments.
    span:      1-4 marked spans at random distances, then each again after its marker, in a random order:
               ``BOS f.. m_1 s.. f.. m_2 s'.. f.. m_2 s'.. f.. m_1 s..`` where the markers m_i and fillers f
               are random ordinary vocabulary tokens and each span is a random string of 1-``INDUCTION_LEN``
               characters ENCODED BY THE CODEC, so a BPE's merges ("se", "en", "12") occur in the copies as they
               do in the environments' keys and numbers ("sew" -> "se" "w"); half the sequences open with decoys
               (a marker + other characters): copy from the LAST occurrence.
               Predicting a copy needs content-based retrieval (find the earlier m_i, copy what followed, continue
               the span from its own previous token): the skill behind copying a quoted key into a tool call and a
               tool result into an answer, at the distances an episode has (up to ~200 tokens).

Keys, words and values are random (letters and digits of ``dsv32_jax.posttrain.envs.CHARSET``), so nothing but copying from
the context predicts them. Pure Python; deterministic per ``random.Random``.
"""

from __future__ import annotations

import random
from typing import Sequence

from dsv32_jax.posttrain import chat

KINDS = ("repeat", "recall", "quote")
INDUCTION_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789\""
INDUCTION_LEN = 24
LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"


def _word(rng: random.Random, lo: int = 1, hi: int = 4, alphabet: str = LETTERS) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _token(rng: random.Random) -> str:
    """A random word (letters) or number (0-999)."""
    return str(rng.randint(0, 999)) if rng.random() < 0.3 else _word(rng)


def recall_messages(rng: random.Random, kind: str) -> list[chat.Message]:
    """One copying conversation of `kind` (see the module docstring)."""
    if kind == "repeat":
        text = "".join(rng.choice(LETTERS + DIGITS) for _ in range(rng.randint(8, 48)))
        user, answer = f'repeat "{text}"', text
    elif kind == "recall":
        keys: list[str] = []
        while len(keys) < rng.randint(2, 6):
            k = _word(rng, 2, 3)
            if k not in keys:
                keys.append(k)
        values = [rng.randint(0, 99) for _ in keys]
        asked = rng.randrange(len(keys))
        user = ", ".join(f'"{k}"={v}' for k, v in zip(keys, values)) + f'. "{keys[asked]}"'
        answer = str(values[asked])
    elif kind == "quote":
        words = [_word(rng) for _ in range(rng.randint(1, 6))]
        quoted = _word(rng, 1, 4, LETTERS + DIGITS)
        words.insert(rng.randint(0, len(words)), f'"{quoted}"')
        user, answer = " ".join(words), quoted
    else:
        raise ValueError(f"recall kind must be one of {KINDS}, got {kind!r}")
    return [chat.User(user), chat.Assistant(content=answer)]


def induction_alphabet(codec: chat.Codec, chars: str = INDUCTION_CHARS) -> list[int]:
    """The ids of `chars` that the codec encodes as one token each (all of them for the shipped BPE and TinyCodec)."""
    ids = []
    for c in chars:
        enc = codec.encode(c)
        if len(enc) == 1 and enc[0] not in ids:
            ids.append(enc[0])
    if len(ids) < 2:
        raise ValueError("recall: the codec has fewer than 2 single-character tokens for the induction kind")
    return ids


def induction_example(rng: random.Random, codec: chat.Codec, length: int = INDUCTION_LEN,
                      alphabet: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """BOS + `length` random single-character tokens + the same tokens again; loss mask 1 on the second copy."""
    alphabet = list(alphabet) if alphabet is not None else induction_alphabet(codec)
    span = [rng.choice(alphabet) for _ in range(length)]
    ids = [codec.token_to_id(chat.BOS)] + span + span
    return ids, [0] * (1 + length) + [1] * length


def _special_ids(codec: chat.Codec) -> set[int]:
    """pad, BOS, EOS and the chat markup: never copied, never fillers."""
    return {codec.token_to_id(t) for t in chat.SPECIAL_TOKENS}


def word_alphabet(codec: chat.Codec, chars: str = INDUCTION_CHARS) -> list[int]:
    """The ordinary vocabulary ids whose text is made of `chars` only: the single characters and the codec's merges
    of them (every token an encoded string of `chars` can contain)."""
    special, allowed = _special_ids(codec), set(chars)
    ids = [i for i in range(codec.vocab_size) if i not in special and (t := codec.decode([i])) and set(t) <= allowed]
    if len(ids) < 2:
        raise ValueError(f"recall: the codec has fewer than 2 tokens made of {chars!r} for the span kind")
    return ids


def filler_ids(codec: chat.Codec, alphabet: Sequence[int]) -> list[int]:
    """Ordinary (non-special) vocabulary ids outside `alphabet`: the fillers and markers of the span kind."""
    banned = _special_ids(codec) | set(alphabet)
    ids = [i for i in range(codec.vocab_size) if i not in banned]
    if len(ids) < 8:
        raise ValueError(f"recall: the codec has only {len(ids)} ordinary tokens for the span kind (need 8)")
    return ids


def span_example(rng: random.Random, codec: chat.Codec, max_span: int = INDUCTION_LEN,
                 alphabet: Sequence[int] | None = None, fillers: Sequence[int] | None = None,
                 max_items: int = 4, max_gap: int = 24, chars: str = INDUCTION_CHARS) -> tuple[list[int], list[int]]:
    """Marked spans at random distances, then copied after their markers (module docstring); loss mask 1 on every
    token of the copies. A span is a random string of 1-`max_span` of `chars`, encoded by the codec (its tokens are
    in `alphabet`, default word_alphabet(codec, chars)). Markers are distinct and never occur as fillers; half the
    sequences start with decoy occurrences of the markers, so a copy's source is its marker's last occurrence."""
    alphabet = list(alphabet) if alphabet is not None else word_alphabet(codec, chars)
    fillers = list(fillers) if fillers is not None else filler_ids(codec, alphabet)
    n = rng.randint(1, max_items)
    markers = rng.sample(fillers, n)

    def word(hi: int) -> list[int]:
        return codec.encode("".join(rng.choice(chars) for _ in range(rng.randint(1, hi))))

    # half the spans short (1-4 characters: keys, values), half up to max_span
    spans = [word(rng.choice((min(4, max_span), max_span))) for _ in range(n)]

    def filler(hi: int) -> list[int]:
        out, k = [], rng.randint(0, hi)
        while len(out) < k:
            f = rng.choice(fillers)
            if f not in markers:
                out.append(f)
        return out

    ids, mask = [codec.token_to_id(chat.BOS)], [0]
    # half the sequences open with decoys: markers followed by other characters. A copy then comes from its
    # marker's LAST occurrence before it (as a tool call's key comes from the task's quote, not from the quotes of
    # the tool schemas before it)
    if rng.random() < 0.5:
        for _ in range(rng.randint(1, 2 * n)):
            decoy = [rng.choice(markers)] + word(4)
            ids += filler(max_gap // 2) + decoy
    mask += [0] * (len(ids) - len(mask))
    for m, s in zip(markers, spans):
        part = filler(max_gap) + [m] + s
        ids += part
        mask += [0] * len(part)
    for i in rng.sample(range(n), n):
        gap = filler(max_gap) + [markers[i]]
        ids += gap + spans[i]
        mask += [0] * len(gap) + [1] * len(spans[i])
    return ids, mask


def recall_examples(seed: int, count: int, codec: chat.Codec, kinds: Sequence[str] = KINDS,
                    thinking: bool = False, induction_len: int = INDUCTION_LEN, span_items: int = 4,
                    span_gap: int = 24, chars: str = INDUCTION_CHARS) -> list[tuple[list[int], list[int]]]:
    """`count` copying examples (ids, loss mask), kinds cycled in order: chat-encoded conversations (mask on the
    answer) or raw sequences (induction, span: mask on every copied token). `induction_len`: the induction kind's
    length and the span kind's longest span; `span_items`, `span_gap`: the span kind's spans per sequence and
    longest filler run; `chars`: the characters the raw kinds copy (each must be one token of the codec)."""
    if not kinds:
        raise ValueError("recall: no kinds given")
    if span_items < 1 or span_gap < 0 or induction_len < 1:
        raise ValueError(f"recall: need recall_induction_len >= 1, recall_span_items >= 1, recall_span_gap >= 0; "
                         f"got {induction_len}, {span_items}, {span_gap}")
    rng = random.Random(seed)
    alphabet = induction_alphabet(codec, chars) if "induction" in kinds else None
    words = word_alphabet(codec, chars) if "span" in kinds else None
    fillers = filler_ids(codec, words) if "span" in kinds else None
    out = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        if kind == "induction":
            out.append(induction_example(rng, codec, induction_len, alphabet))
        elif kind == "span":
            out.append(span_example(rng, codec, induction_len, words, fillers, span_items, span_gap, chars))
        else:
            ids, mask = chat.encode_tokens(recall_messages(rng, kind), codec, thinking=thinking)
            out.append((list(ids), list(mask)))
    return out
