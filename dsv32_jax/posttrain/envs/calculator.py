"""`calculator`: multi-step integer arithmetic with a `calc(expr)` tool (the code-interpreter pattern at its smallest).

Per seed: 2-3 operations (`min_ops`-`max_ops`) on 1-3 digit numbers (`max_digits`), either as a parenthesized
expression ("compute (17*23)+45") or stated in words as a chain ("start with 17, multiply by 23, then add 45"). The
demonstration evaluates one operation per call, innermost first (independent operations share a turn), so every task
takes two or three tool turns.
With `max_ops_per_call=1` the tool itself refuses longer expressions and multi-step use is required. `quote=True`
quotes the expression ('compute "(17*23)+45"'): a BPE then splits its first number as in the tool call (unquoted, the
space merges into the first digit: " 1" "7" in the task, "1" "7" in the call), as the lookup environment's keys are.

Arithmetic (the tool and the task's answer alike): integers, + - * /, parentheses, unary minus. '/' is integer
division rounding toward minus infinity, Python's `//` (-7/2 = -4). Division by zero, a malformed expression, one
longer than 64 characters or a result beyond 10**15 is an `error: ...` result. No `eval`.

    task:   compute (17*23)+45
    call:   calc {"expr":"17*23"} -> 391      calc {"expr":"391+45"} -> 436
    answer: 436
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Union

from dsv32_jax.posttrain.chat import ToolCall
from dsv32_jax.posttrain.envs.base import Action, Env
from dsv32_jax.posttrain.envs.helpers import integer_score
from dsv32_jax.posttrain.envs.tools import Tool, ToolError, sanitize

MAX_EXPR_CHARS = 64
MAX_MAGNITUDE = 10**15
OPS = "+-*/"
_WORDS = {"+": "add", "-": "subtract", "*": "multiply by", "/": "divide by"}

# An expression tree: an int leaf or (op, left, right).
Tree = Union[int, tuple]


def apply(op: str, a: int, b: int) -> int:
    if op == "/" and b == 0:
        raise ToolError("division by zero")
    out = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b
    if abs(out) > MAX_MAGNITUDE:
        raise ToolError(f"result beyond {MAX_MAGNITUDE}")
    return out


class _Parser:
    """Recursive descent: expr = term (('+'|'-') term)*; term = factor (('*'|'/') factor)*;
    factor = ('-'|'+') factor | integer | '(' expr ')'."""

    def __init__(self, text: str):
        self.text, self.pos, self.ops = text, 0, 0

    def peek(self) -> str:
        while self.pos < len(self.text) and self.text[self.pos] == " ":
            self.pos += 1
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def fail(self) -> ToolError:
        got = self.peek()
        return ToolError(f'unexpected "{sanitize(got, 1)}" at {self.pos}' if got else "unexpected end of expression")

    def expr(self) -> int:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.text[self.pos]
            self.pos += 1
            self.ops += 1
            value = apply(op, value, self.term())
        return value

    def term(self) -> int:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op = self.text[self.pos]
            self.pos += 1
            self.ops += 1
            value = apply(op, value, self.factor())
        return value

    def factor(self) -> int:
        c = self.peek()
        if c in ("-", "+"):
            self.pos += 1
            value = self.factor()
            return -value if c == "-" else value
        if c == "(":
            self.pos += 1
            value = self.expr()
            if self.peek() != ")":
                raise self.fail()
            self.pos += 1
            return value
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isdigit():
            self.pos += 1
        if start == self.pos:
            raise self.fail()
        return int(self.text[start:self.pos])


def evaluate(text: str, max_ops: int | None = None) -> int:
    """The integer value of arithmetic expression `text` (see the module docstring); ToolError when invalid."""
    if len(text) > MAX_EXPR_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPR_CHARS} characters")
    if not all(c.isdigit() and c.isascii() or c in OPS + "() " for c in text):
        bad = next(i for i, c in enumerate(text) if not (c.isdigit() and c.isascii() or c in OPS + "() "))
        raise ToolError(f'unexpected "{sanitize(text[bad], 1)}" at {bad}')
    parser = _Parser(text)
    value = parser.expr()
    if parser.peek():
        raise parser.fail()
    if max_ops is not None and parser.ops > max_ops:
        raise ToolError(f"at most {max_ops} operation{'s' if max_ops > 1 else ''} per call")
    return value


def tree_value(tree: Tree) -> int:
    return tree if isinstance(tree, int) else apply(tree[0], tree_value(tree[1]), tree_value(tree[2]))


def render(tree: Tree, top: bool = True) -> str:
    """Fully parenthesized except at the top: (17*23)+45; negative leaves in parentheses."""
    if isinstance(tree, int):
        return f"({tree})" if tree < 0 else str(tree)
    text = f"{render(tree[1], False)}{tree[0]}{render(tree[2], False)}"
    return text if top else f"({text})"


@dataclasses.dataclass(frozen=True)
class CalcInstance:
    tree: Tree
    words: bool  # stated as a chain in words (a left-deep tree) rather than as an expression

    @property
    def answer(self) -> int:
        return tree_value(self.tree)


class CalculatorEnv(Env):
    name = "calculator"
    domain = "code"
    instructions = "answer with the integer only. / is integer division rounding down."

    def __init__(self, max_steps: int = 4, max_digits: int = 3, words_fraction: float = 0.5,
                 max_ops_per_call: int | None = None, min_ops: int = 2, max_ops: int = 3, quote: bool = False):
        if not 1 <= max_digits <= 6:
            raise ValueError(f"calculator: max_digits must be in [1, 6], got {max_digits}")
        if not 0.0 <= words_fraction <= 1.0:
            raise ValueError(f"calculator: words_fraction must be in [0, 1], got {words_fraction}")
        if max_ops_per_call is not None and max_ops_per_call < 1:
            raise ValueError(f"calculator: max_ops_per_call must be >= 1 or None, got {max_ops_per_call}")
        if not 1 <= min_ops <= max_ops <= 6:
            raise ValueError(f"calculator: need 1 <= min_ops <= max_ops <= 6, got min_ops={min_ops} "
                             f"max_ops={max_ops}")
        self.max_digits, self.words_fraction, self.max_ops_per_call = max_digits, words_fraction, max_ops_per_call
        self.min_ops, self.max_ops, self.quote = min_ops, max_ops, bool(quote)
        super().__init__(max_steps)

    def generate(self, seed: int) -> CalcInstance:
        rng = random.Random(seed)
        words = rng.random() < self.words_fraction
        n_ops = rng.randint(self.min_ops, self.max_ops)
        while True:
            tree = self._chain(rng, n_ops) if words else self._tree(rng, n_ops)
            try:
                tree_value(tree)
                return CalcInstance(tree, words)
            except ToolError:  # a zero divisor: draw again
                continue

    def _number(self, rng: random.Random) -> int:
        return rng.randint(1 if rng.random() < 0.9 else 0, 10 ** rng.randint(1, self.max_digits) - 1)

    def _tree(self, rng: random.Random, n_ops: int) -> Tree:
        if n_ops == 0:
            return self._number(rng)
        left = rng.randint(0, n_ops - 1)
        return (rng.choice(OPS), self._tree(rng, left), self._tree(rng, n_ops - 1 - left))

    def _chain(self, rng: random.Random, n_ops: int) -> Tree:
        tree: Tree = self._number(rng)
        for _ in range(n_ops):
            tree = (rng.choice(OPS), tree, self._number(rng))
        return tree

    def make_tools(self) -> list[Tool]:
        schema = {"type": "object", "properties": {"expr": {"type": "string", "description": "arithmetic"}},
                  "required": ["expr"]}
        return [Tool("calc", "evaluates integers with + - * / and parentheses", schema, self._calc)]

    def _calc(self, expr: str) -> str:
        return str(evaluate(expr, self.max_ops_per_call))

    def render_task(self, instance: CalcInstance) -> str:
        if not instance.words:
            return f'compute "{render(instance.tree)}"' if self.quote else f"compute {render(instance.tree)}"
        steps, tree = [], instance.tree
        while not isinstance(tree, int):
            steps.append(f"{_WORDS[tree[0]]} {tree[2]}")
            tree = tree[1]
        steps.reverse()
        return f"start with {tree}, " + ", ".join(steps[:-1]) + f", then {steps[-1]}"

    def score(self, instance: CalcInstance, answer: str) -> tuple[float, dict[str, Any]]:
        return integer_score(answer, instance.answer)

    def solve(self, instance: CalcInstance) -> list[Action]:
        """One call per operation whose operands are known, innermost first; independent ones share a turn."""
        actions, tree, known = [], instance.tree, []
        while not isinstance(tree, int):
            ready = _ready(tree)
            calls = [ToolCall("calc", {"expr": render(node)}) for node in ready]
            done = ", ".join(f"{render(n)}={tree_value(n)}" for n in known)
            actions.append(Action(tool_calls=calls, reasoning=(done + ", " if done else "") + "next " +
                                  " and ".join(c.arguments["expr"] for c in calls)))
            known = ready
            tree = _substitute(tree, {id(n): tree_value(n) for n in ready})
        done = ", ".join(f"{render(n)}={tree_value(n)}" for n in known)
        return actions + [Action(content=str(instance.answer), reasoning=f"{done}, so the answer is {tree}")]


def _ready(tree: Tree) -> list[tuple]:
    """The operations whose both operands are numbers, left to right."""
    if isinstance(tree, int):
        return []
    if isinstance(tree[1], int) and isinstance(tree[2], int):
        return [tree]
    return _ready(tree[1]) + _ready(tree[2])


def _substitute(tree: Tree, values: dict[int, int]) -> Tree:
    if id(tree) in values:
        return values[id(tree)]
    if isinstance(tree, int):
        return tree
    return (tree[0], _substitute(tree[1], values), _substitute(tree[2], values))
