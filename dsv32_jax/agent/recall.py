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

Keys, words and values are random (letters and digits of ``dsv32_jax.envs.CHARSET``), so nothing but copying from
the context predicts them. Pure Python; deterministic per ``random.Random``.
"""

from __future__ import annotations

import random
from typing import Sequence

from dsv32_jax import chat

KINDS = ("repeat", "recall", "quote")
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


def recall_examples(seed: int, count: int, codec: chat.Codec, kinds: Sequence[str] = KINDS,
                    thinking: bool = False) -> list[tuple[list[int], list[int]]]:
    """`count` chat-encoded copying conversations (ids, loss mask on the answer), kinds cycled in order."""
    if not kinds:
        raise ValueError("recall: no kinds given")
    rng = random.Random(seed)
    out = []
    for i in range(count):
        msgs = recall_messages(rng, kinds[i % len(kinds)])
        ids, mask = chat.encode_tokens(msgs, codec, thinking=thinking)
        out.append((list(ids), list(mask)))
    return out
