"""Helpers for task generators and verifiers: integer answers, random distinct names."""

from __future__ import annotations

import random
import re
from typing import Any, Sequence

LETTERS = "abcdefghijklmnopqrstuvwxyz"
_INTEGER = re.compile(r"\s*(-?[0-9]{1,18})\s*", re.ASCII)  # (ASCII: '４２' and '٤٢' scored as 42)


def parse_integer(answer: str) -> int | None:
    """The integer a final answer states (optional ASCII whitespace around an optional '-' and ASCII digits), else
    None."""
    m = _INTEGER.fullmatch(answer) if isinstance(answer, str) else None
    return int(m.group(1)) if m else None


def integer_score(answer: str, expected: int) -> tuple[float, dict[str, Any]]:
    """Verifier for an integer answer: 1.0 when it equals `expected`, else 0.0 (details say why)."""
    value = parse_integer(answer)
    if value is None:
        return 0.0, {"reason": "answer is not an integer", "expected": expected, "answer": None}
    return float(value == expected), {"reason": "correct" if value == expected else "wrong value",
                                      "expected": expected, "answer": value}


def unique_names(rng: random.Random, count: int, lengths: Sequence[int], taken: set[str] | None = None,
                 letters: str = LETTERS) -> list[str]:
    """`count` distinct random names of `letters` (lengths drawn from `lengths`), none of them in `taken`."""
    taken = set(taken or ())
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(letters) for _ in range(rng.choice(list(lengths))))
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names
