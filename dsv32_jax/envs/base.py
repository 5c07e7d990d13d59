"""Tool environments for agentic RL (paper section 3.2): each task is an environment, its tools, a task and a verifier.

An episode: `obs = env.reset(seed)` gives the system prompt and the task text (the user message). The agent then
answers with `Action`s. An action with tool calls runs each call and the next observation holds one result string
per call (reward 0, not done); an action without tool calls is the final answer: the verifier scores its content
(reward in [0, 1], done). More than `max_steps` tool turns end the episode with reward 0 (info["truncated"]).

Tool arguments are checked against the tool's JSON schema (a subset: an object whose properties are string /
integer / number / boolean / array) before the tool runs; a bad call, an unknown tool or a tool's own `ToolError`
becomes an `error: ...` result string that the model reads. Nothing a model can send makes `step` raise.

All text an environment produces (system prompt, task, tool results, demonstrations) stays inside `CHARSET`, so a
character-level tiny vocabulary can encode it. This module imports neither jax nor numpy.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from typing import Any, Callable, Mapping, Sequence

# Every character an environment emits: lowercase letters, digits, space and the punctuation of compact JSON and
# arithmetic. No newline, no uppercase, no single quote (error messages quote names with double quotes).
CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789 " + '{}[]":,.=+-*/()_<>'
_CHARS = frozenset(CHARSET)
_TYPES = ("string", "integer", "number", "boolean", "array")
_INTEGER = re.compile(r"\s*(-?\d{1,18})\s*")


def in_charset(text: str) -> bool:
    return all(c in _CHARS for c in text)


def sanitize(text: Any, limit: int = 24) -> str:
    """Model-supplied text echoed in an error message: lowercased, cut to `limit` characters, others as '_'."""
    return "".join(c if c in _CHARS else "_" for c in str(text).lower()[:limit])


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def parse_integer(answer: str) -> int | None:
    """The integer a final answer states (optional spaces around an optional '-' and digits), else None."""
    m = _INTEGER.fullmatch(answer) if isinstance(answer, str) else None
    return int(m.group(1)) if m else None


class ToolError(Exception):
    """Raised by a tool's function for a call it cannot serve; the message becomes the result `error: <message>`."""


def check_schema(schema: Mapping[str, Any], where: str) -> None:
    """Raise ValueError (naming `where` and the field) unless `schema` is in the supported JSON-schema subset."""
    if schema.get("type") != "object":
        raise ValueError(f"{where}: parameters.type must be 'object', got {schema.get('type')!r}")
    props = schema.get("properties", {})
    if not isinstance(props, Mapping):
        raise ValueError(f"{where}: parameters.properties must be a dict")
    for key, spec in props.items():
        if spec.get("type") not in _TYPES:
            raise ValueError(f"{where}: parameters.properties.{key}.type must be one of {_TYPES}, got "
                             f"{spec.get('type')!r}")
        item = spec.get("items", {}).get("type")
        if item is not None and item not in _TYPES[:4]:
            raise ValueError(f"{where}: parameters.properties.{key}.items.type must be one of {_TYPES[:4]}")
    missing = [k for k in schema.get("required", []) if k not in props]
    if missing:
        raise ValueError(f"{where}: parameters.required names {missing}, which are not in properties")


def _has_type(value: Any, type_name: str) -> bool:
    if type_name == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):  # bool is an int subclass in Python, not a JSON integer
        return False
    return isinstance(value, {"string": str, "integer": int, "number": (int, float), "array": list}[type_name])


def validate_arguments(schema: Mapping[str, Any], arguments: Any) -> str | None:
    """The first problem with `arguments` under `schema` (a message naming the argument), or None when valid."""
    if not isinstance(arguments, Mapping):
        return "arguments must be an object"
    props = schema.get("properties", {})
    for key in arguments:
        if key not in props:
            return f'unknown argument "{sanitize(key)}"'
    for key in schema.get("required", []):
        if key not in arguments:
            return f'missing argument "{key}"'
    for key, value in arguments.items():
        spec = props[key]
        if not _has_type(value, spec["type"]):
            return f'argument "{key}" must be {spec["type"]}'
        item = spec.get("items", {}).get("type")
        if item and not all(_has_type(v, item) for v in value):
            return f'argument "{key}" must be an array of {item}'
    return None


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the agent may call: `name`, `description`, JSON-schema `parameters` and the Python `function`."""
    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]

    def __post_init__(self):
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", self.name):
            raise ValueError(f"Tool.name must be a lowercase identifier, got {self.name!r}")
        check_schema(self.parameters, f"tool {self.name!r}")

    def call(self, arguments: Any) -> str:
        """Validate `arguments`, run the function and return its output as a string (an `error: ...` on failure)."""
        problem = validate_arguments(self.parameters, arguments)
        if problem:
            return f"error: {problem}"
        try:
            out = self.function(**arguments)
        except ToolError as e:
            return f"error: {e}"
        return out if isinstance(out, str) else compact_json(out)

    def signature(self) -> str:
        props = self.parameters.get("properties", {})
        return f"{self.name}(" + ",".join(f"{k}:{v['type']}" for k, v in props.items()) + ")"

    def spec(self) -> dict[str, Any]:
        """The function-calling description (no callable): name, description, parameters."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": dict(self.arguments)}


@dataclasses.dataclass
class Action:
    """One assistant turn: tool calls, or (without them) the final answer in `content`. The env ignores `reasoning`."""
    content: str = ""
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
    reasoning: str = ""

    @classmethod
    def coerce(cls, action: Action | Mapping[str, Any]) -> Action:
        """An Action from an Action or a dict {"content", "tool_calls": [{"name", "arguments"}], "reasoning"}."""
        if isinstance(action, Action):
            return action
        if not isinstance(action, Mapping):
            raise TypeError(f"action must be an Action or a dict, got {type(action).__name__}")
        calls = [_coerce_call(c) for c in action.get("tool_calls") or []]
        return cls(str(action.get("content") or ""), calls, str(action.get("reasoning") or ""))

    def to_dict(self) -> dict[str, Any]:
        return {"content": self.content, "tool_calls": [c.to_dict() for c in self.tool_calls],
                "reasoning": self.reasoning}


def _coerce_call(call: Any) -> ToolCall:
    """A ToolCall from a ToolCall or a dict; anything else becomes a call of the unknown tool "" (an error result)."""
    if isinstance(call, ToolCall):
        return call
    if isinstance(call, Mapping):
        return ToolCall(str(call.get("name", "")), call.get("arguments", {}))
    return ToolCall("", {})


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the agent sees: the system prompt, the task (user message) and the results of the last tool turn."""
    system: str
    task: str
    tool_results: tuple[str, ...] = ()


class Env:
    """Base class. Subclasses set `name`, `domain`, `instructions` and implement `generate`, `_make_tools`,
    `render_task`, `score` and `solve`; tools read the current episode's instance from `self.instance`."""
    name: str = ""
    domain: str = ""  # the per-domain KL weight key
    instructions: str = ""  # the system prompt's first sentence(s): answer format

    def __init__(self, max_steps: int = 4):
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an integer >= 1, got {max_steps!r}")
        self.max_steps = max_steps
        self.tools: list[Tool] = self._make_tools()
        self._by_name = {t.name: t for t in self.tools}
        self.instance: Any = None
        self.steps = 0
        self.done = True

    # --- subclass hooks ---
    def generate(self, seed: int) -> Any:
        """The task instance for `seed` (deterministic; no effect on the current episode)."""
        raise NotImplementedError

    def _make_tools(self) -> list[Tool]:
        raise NotImplementedError

    def render_task(self, instance: Any = None) -> str:
        """The task text (user message) of `instance`, default the current episode's."""
        raise NotImplementedError

    def score(self, answer: str) -> tuple[float, dict[str, Any]]:
        """Verifier: (reward in [0, 1], details) for the final answer `answer` to the current instance."""
        raise NotImplementedError

    def solve(self, instance: Any) -> list[Action]:
        """Oracle trajectory for `instance`: tool-call turns, then the final answer."""
        raise NotImplementedError

    # --- episode API ---
    def system_prompt(self) -> str:
        return f"{self.instructions} tools: " + ". ".join(f"{t.signature()} {t.description}" for t in self.tools)

    def reset(self, seed: int) -> Observation:
        self.instance = self.generate(seed)
        self.steps = 0
        self.done = False
        return self._observation()

    def step(self, action: Action | Mapping[str, Any]) -> tuple[Observation, float, bool, dict[str, Any]]:
        if self.instance is None:
            raise RuntimeError(f"{self.name}: step() before reset(seed)")
        if self.done:
            raise RuntimeError(f"{self.name}: the episode is over; call reset(seed)")
        action = Action.coerce(action)
        if action.tool_calls:
            if self.steps >= self.max_steps:
                self.done = True
                return self._observation(), 0.0, True, {
                    "success": False, "steps": self.steps, "truncated": True,
                    "reason": f"more than max_steps={self.max_steps} tool turns"}
            self.steps += 1
            results = tuple(self.call_tool(c) for c in action.tool_calls)
            return self._observation(results), 0.0, False, {"success": False, "steps": self.steps, "truncated": False}
        reward, details = self.score(action.content)
        reward = min(max(float(reward), 0.0), 1.0)
        self.done = True
        return self._observation(), reward, True, {"success": reward == 1.0, "steps": self.steps, "truncated": False,
                                                   **details}

    def call_tool(self, call: ToolCall | Mapping[str, Any]) -> str:
        call = _coerce_call(call)
        tool = self._by_name.get(call.name)
        if tool is None:
            return f'error: unknown tool "{sanitize(call.name)}"'
        return tool.call(call.arguments)

    def verify(self, answer: str) -> float:
        """The verifier's reward for `answer` to the current instance (no effect on the episode)."""
        if self.instance is None:
            raise RuntimeError(f"{self.name}: verify() before reset(seed)")
        return self.score(answer)[0]

    def demonstration(self, seed: int) -> list[Action]:
        """Oracle trajectory for `seed`'s instance (for cold-start SFT); replay it after `reset(seed)`."""
        return self.solve(self.generate(seed))

    def _observation(self, results: Sequence[str] = ()) -> Observation:
        return Observation(self.system_prompt(), self.render_task(), tuple(results))


def integer_score(answer: str, expected: int) -> tuple[float, dict[str, Any]]:
    """Verifier for an integer answer: 1.0 when it equals `expected`, else 0.0 (details say why)."""
    value = parse_integer(answer)
    if value is None:
        return 0.0, {"reason": "answer is not an integer", "expected": expected, "answer": None}
    return float(value == expected), {"reason": "correct" if value == expected else "wrong value",
                                      "expected": expected, "answer": value}


LETTERS = "abcdefghijklmnopqrstuvwxyz"


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
