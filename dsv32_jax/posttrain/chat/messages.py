"""Conversation messages (System, User, Assistant with ToolCalls, ToolResult) and Tool definitions, from dataclasses
or OpenAI-style dicts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from dsv32_jax.posttrain.chat.tokens import ChatFormatError

__all__ = ["Assistant", "Message", "MessageLike", "System", "Tool", "ToolCall", "ToolLike", "ToolResult", "User",
           "as_message", "as_tool"]


@dataclass
class ToolCall:
    """One function call: the tool's name and its arguments (a JSON-able dict)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": dict(self.arguments)}


@dataclass
class System:
    content: str
    role: str = field(default="system", init=False)


@dataclass
class User:
    content: str
    role: str = field(default="user", init=False)


@dataclass
class Assistant:
    """An assistant turn: optional reasoning (the thinking text), content, tool calls; ``train=False`` masks it."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    train: bool = True
    role: str = field(default="assistant", init=False)


@dataclass
class ToolResult:
    """The output of one tool call; results are matched in order to the calls of the assistant turn before them."""

    content: str
    role: str = field(default="tool", init=False)


@dataclass(frozen=True)
class Tool:
    """A tool definition: name, description and a JSON-schema ``parameters`` object (``dsv32_jax.posttrain.envs.Tool`` is this
    plus the Python function that runs it)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def schema(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


Message = Union[System, User, Assistant, ToolResult]
MessageLike = Union[Message, Mapping[str, Any]]
ToolLike = Union[Tool, Mapping[str, Any]]


def json_error_text(e: BaseException) -> str:
    """What json.loads' failure says: a JSONDecodeError's message, or the first clause of the ValueError of an
    integer of over 4300 digits, or RecursionError for deep nesting (model text can hold any of them)."""
    if isinstance(e, json.JSONDecodeError):
        return e.msg
    return str(e).split(";")[0] or type(e).__name__


def _as_tool_call(value: Any, where: str) -> ToolCall:
    if isinstance(value, ToolCall):
        call = value
    elif isinstance(value, Mapping):
        fn = value.get("function", value)  # OpenAI {"type": "function", "function": {...}} or plain {"name", ...}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError) as e:
                raise ChatFormatError(f"{where}.arguments: not valid JSON ({json_error_text(e)})") from None
        call = ToolCall(name=fn.get("name"), arguments=args)
    else:
        raise ChatFormatError(f"{where}: expected a ToolCall or a dict, got {type(value).__name__}")
    if not isinstance(call.name, str) or not call.name:
        raise ChatFormatError(f"{where}.name: expected a non-empty string, got {call.name!r}")
    if not isinstance(call.arguments, dict):
        raise ChatFormatError(f"{where}.arguments: expected a dict, got {type(call.arguments).__name__}")
    return call


def as_message(value: MessageLike, index: int = 0) -> Message:
    """A message dataclass from a dataclass or a dict with ``role`` (``reasoning`` or ``reasoning_content``)."""
    where = f"messages[{index}]"
    if isinstance(value, Assistant):
        return Assistant(value.content or "", value.reasoning,
                         [_as_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(value.tool_calls)],
                         value.train)
    if isinstance(value, (System, User, ToolResult)):
        return value
    if not isinstance(value, Mapping):
        raise ChatFormatError(f"{where}: expected a message dataclass or a dict, got {type(value).__name__}")
    role, content = value.get("role"), value.get("content") or ""
    if not isinstance(content, str):
        raise ChatFormatError(f"{where}.content: expected a string, got {type(content).__name__}")
    if role == "system":
        return System(content)
    if role == "user":
        return User(content)
    if role == "tool":
        return ToolResult(content)
    if role == "assistant":
        reasoning = value.get("reasoning", value.get("reasoning_content"))
        calls = [_as_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(value.get("tool_calls") or [])]
        return Assistant(content, reasoning, calls, bool(value.get("train", True)))
    raise ChatFormatError(f"{where}.role: unknown role {role!r} (system, user, assistant, tool)")


def as_tool(value: ToolLike, index: int = 0) -> Tool:
    """A :class:`Tool` from a Tool, a ``{"name", "description", "parameters"}`` dict or OpenAI's function form."""
    if isinstance(value, Tool):
        tool = value
    elif isinstance(value, Mapping):
        fn = value.get("function", value)
        tool = Tool(fn.get("name"), fn.get("description", "") or "", fn.get("parameters", {}) or {})
    else:
        raise ChatFormatError(f"tools[{index}]: expected a Tool or a dict, got {type(value).__name__}")
    if not isinstance(tool.name, str) or not tool.name:
        raise ChatFormatError(f"tools[{index}].name: expected a non-empty string, got {tool.name!r}")
    return tool
