"""`lookup`: a hidden key-value table behind a `get(key)` tool (the search-agent pattern at its smallest).

Per seed: 5-8 keys of 2-3 letters (of `key_letters`, default all 26) with values 0-99. The task asks for one key's value or for the sum of two keys'
values; the values appear nowhere in the prompt, so answering without the tool succeeds at chance level
(about 1/100 for a uniform guess in the value range).

    task:   find the sum of the values of "qd" and "mbx"   (keys quoted: a BPE then splits them as in the tool call)
    call:   get {"key":"qd"} -> 41      get {"key":"zz"} -> error: no key "zz"
    answer: 58
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from dsv32_jax.posttrain.chat import ToolCall
from dsv32_jax.posttrain.envs.base import Action, Env
from dsv32_jax.posttrain.envs.helpers import LETTERS, integer_score, unique_names
from dsv32_jax.posttrain.envs.tools import Tool, ToolError, sanitize

MAX_VALUE = 99


@dataclasses.dataclass(frozen=True)
class LookupInstance:
    table: dict[str, int]
    asked: tuple[str, ...]  # one key (its value) or two keys (the sum of their values)

    @property
    def answer(self) -> int:
        return sum(self.table[k] for k in self.asked)


class LookupEnv(Env):
    name = "lookup"
    domain = "search"
    instructions = "answer with the integer only."

    def __init__(self, max_steps: int = 4, min_keys: int = 5, max_keys: int = 8, sum_fraction: float = 0.5,
                 key_letters: str = LETTERS):
        if not 2 <= min_keys <= max_keys:
            raise ValueError(f"lookup: need 2 <= min_keys <= max_keys, got min_keys={min_keys} max_keys={max_keys}")
        n = len(set(key_letters))
        if n < 3 or not set(key_letters) <= set(LETTERS) or n**2 + n**3 < max_keys:
            raise ValueError(f"lookup: key_letters must be at least 3 distinct lowercase letters, enough for "
                             f"max_keys={max_keys} distinct 2-3 letter keys; got {key_letters!r}")
        if not 0.0 <= sum_fraction <= 1.0:
            raise ValueError(f"lookup: sum_fraction must be in [0, 1], got {sum_fraction}")
        self.min_keys, self.max_keys, self.sum_fraction = min_keys, max_keys, sum_fraction
        self.key_letters = "".join(sorted(set(key_letters)))
        super().__init__(max_steps)

    def generate(self, seed: int) -> LookupInstance:
        rng = random.Random(seed)
        keys = unique_names(rng, rng.randint(self.min_keys, self.max_keys), (2, 3), letters=self.key_letters)
        table = {k: rng.randint(0, MAX_VALUE) for k in keys}
        asked = tuple(rng.sample(keys, 2 if rng.random() < self.sum_fraction else 1))
        return LookupInstance(table, asked)

    def make_tools(self) -> list[Tool]:
        schema = {"type": "object", "properties": {"key": {"type": "string", "description": "the key"}},
                  "required": ["key"]}
        return [Tool("get", "returns the value stored under key", schema, self._get)]

    def _get(self, key: str) -> str:
        if key not in self.instance.table:
            raise ToolError(f'no key "{sanitize(key)}"')
        return str(self.instance.table[key])

    def render_task(self, instance: LookupInstance) -> str:
        asked = instance.asked
        if len(asked) == 1:
            return f'find the value of "{asked[0]}"'
        return f'find the sum of the values of "{asked[0]}" and "{asked[1]}"'

    def score(self, instance: LookupInstance, answer: str) -> tuple[float, dict[str, Any]]:
        return integer_score(answer, instance.answer)

    def solve(self, instance: LookupInstance) -> list[Action]:
        calls = [ToolCall("get", {"key": k}) for k in instance.asked]
        found = " and ".join(f"{k} is {instance.table[k]}" for k in instance.asked)
        if len(instance.asked) == 2:
            a, b = (instance.table[k] for k in instance.asked)
            found += f", {a}+{b}={a + b}"
        return [Action(tool_calls=calls, reasoning="look up " + " and ".join(instance.asked)),
                Action(content=str(instance.answer), reasoning=found)]
