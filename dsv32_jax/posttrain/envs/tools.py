"""Tools of the environments: the JSON-schema subset, argument validation and `Tool` (a chat tool definition plus the
Python function that runs it), whose every failure comes back as an error result (`ToolOutput`), never an exception.

Statuses of a call (`ToolOutput.status`; `Env.step` counts them in its info as `tool_errors` (all three),
`tool_crashes`, `tool_timeouts`):

    error    a bad call: unknown tool, arguments against the schema, or the tool raised `ToolError`
    crash    the tool raised any other exception (`error: tool "f" failed: ZeroDivisionError: division by zero`), or
             returned a value JSON cannot encode (a set, NaN, an object): `error: tool "f" returned a set that ...`
    timeout  the call ran longer than its environment's `tool_timeout` (base.py)
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Mapping, Sequence

from dsv32_jax.posttrain.chat import Tool as ChatTool

# Every character the built-in environments emit: lowercase letters, digits, space and the punctuation of compact
# JSON and arithmetic. No newline, no uppercase, no single quote (error messages quote names with double quotes).
CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789 " + '{}[]":,.=+-*/()_<>'
_CHARS = frozenset(CHARSET)
_TYPES = ("string", "integer", "number", "boolean", "array")
TOOL_STATUSES = ("error", "crash", "timeout")


def in_charset(text: str) -> bool:
    return all(c in _CHARS for c in text)


def sanitize(text: Any, limit: int = 24) -> str:
    """Model-supplied text echoed in an error message, kept inside CHARSET for character-level codecs: lowercased,
    cut to `limit` characters, others as '_'. Not a safety measure: the chat encoding reads results as plain text."""
    return "".join(c if c in _CHARS else "_" for c in str(text).lower()[:limit])


def compact_json(value: Any) -> str:
    """`value` as JSON without spaces; strict: NaN and infinities raise ValueError (JSON has no such numbers)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class ToolError(Exception):
    """Raised by a tool's function for a call it cannot serve; the message becomes the result `error: <message>`."""


def check_schema(schema: Mapping[str, Any], where: str) -> None:
    """Raise ValueError (naming `where` and the field) unless `schema` is in the supported JSON-schema subset."""
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        got = schema.get("type") if isinstance(schema, Mapping) else schema
        raise ValueError(f"{where}: parameters.type must be 'object', got {got!r}")
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
class ToolOutput:
    """One tool call's result: the `text` the model reads and its `status`, "ok" or one of TOOL_STATUSES."""
    text: str
    status: str = "ok"


def tool_counts(outputs: Sequence[ToolOutput]) -> dict[str, int]:
    """`tool_errors` (every failed call), `tool_crashes`, `tool_timeouts` of one turn's outputs."""
    return {"tool_errors": sum(o.status != "ok" for o in outputs),
            "tool_crashes": sum(o.status == "crash" for o in outputs),
            "tool_timeouts": sum(o.status == "timeout" for o in outputs)}


def _limit(text: str, n: int = 160) -> str:
    return text if len(text) <= n else text[:n] + "..."


def _message(e: BaseException) -> str:
    """str(e), or a stand-in when the exception's own __str__ raises (a broken tool's exception is data too)."""
    try:
        return str(e)
    except Exception:  # noqa: BLE001
        return f"(a {type(e).__name__} whose message cannot be printed)"


@dataclasses.dataclass(frozen=True)
class Tool(ChatTool):
    """A tool the agent may call: the chat tool definition (`name`, `description`, JSON-schema `parameters`) plus
    the Python `function` that runs it with the call's arguments as keyword arguments. The function returns a
    string (the result as is) or a JSON-able value (the result as compact JSON), and raises `ToolError` for a call
    it cannot serve."""
    function: Callable[..., Any] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not re.fullmatch(r"[a-z_][a-z0-9_]*", self.name):
            raise ValueError(f"Tool.name must be a lowercase identifier, got {self.name!r}")
        if not callable(self.function):
            raise ValueError(f"tool {self.name!r}: function must be callable, got {self.function!r}")
        check_schema(self.parameters, f"tool {self.name!r}")

    def run(self, arguments: Any) -> ToolOutput:
        """Validate `arguments` and run the function; every failure becomes an error output (module docstring)."""
        problem = validate_arguments(self.parameters, arguments)
        if problem:
            return ToolOutput(f"error: {problem}", "error")
        try:
            out = self.function(**arguments)
        except ToolError as e:
            return ToolOutput(f"error: {_message(e)}", "error")
        except (Exception, SystemExit) as e:  # noqa: BLE001 (a broken tool is data for the model, not a crash)
            return ToolOutput(f'error: tool "{self.name}" failed: {type(e).__name__}: {_limit(_message(e))}', "crash")
        if isinstance(out, str):
            return ToolOutput(out)
        try:
            return ToolOutput(compact_json(out))
        except (TypeError, ValueError, RecursionError) as e:
            return ToolOutput(f'error: tool "{self.name}" returned a {type(out).__name__} that JSON cannot encode '
                              f"({_limit(_message(e))})", "crash")

    def call(self, arguments: Any) -> str:
        """The result text of a call with `arguments` (an `error: ...` on failure)."""
        return self.run(arguments).text

    def signature(self) -> str:
        props = self.parameters.get("properties", {})
        return f"{self.name}(" + ",".join(f"{k}:{v['type']}" for k, v in props.items()) + ")"

    def spec(self) -> dict[str, Any]:
        """The function-calling description (no callable): name, description, parameters."""
        return self.schema()
