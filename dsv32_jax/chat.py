"""The DeepSeek-V3.2 chat encoding: prompts, DSML tool calls, thinking retention, loss masks, two codecs.

Written from DeepSeek's description of V3.2's chat format (``encoding/encoding_dsv32.py`` in the HF repositories
deepseek-ai/DeepSeek-V3.2 and -Exp; read, not copied) and from section 3.2.1 of the V3.2 report ("Thinking Context
Management"). Pure Python: no jax, no numpy; ``tokenizers`` is imported only by :class:`HFCodec`.

The format, piece by piece (``BOS``/``EOS`` = ``<｜begin▁of▁sentence｜>``/``<｜end▁of▁sentence｜>``)::

    BOS {system}[\\n\\n{tools prompt}]                     system message (optional, first only)
    <｜User｜>{user}<｜Assistant｜>{opener}                  user message + the assistant prefix
    {reasoning}</think>{content}[{calls}]EOS               assistant turn whose reasoning is kept
    {content}[{calls}]EOS                                  assistant turn whose reasoning is dropped
    \\n\\n<function_results>\\n<result>{r1}</result>\\n...\\n</function_results>\\n\\n{opener}   the results of one turn

``{opener}`` is ``<think>`` when the next assistant turn keeps its reasoning and ``</think>`` otherwise (so a
dropped turn reads ``...</think>{content}EOS``; with ``thinking=False`` every opener is ``</think>``). Note there is
no ``<｜Assistant｜>`` after tool results: the assistant continues right after the results block. Tool calls::

    \\n\\n<｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

``string="true"``: the value is the raw string; ``string="false"``: the value is JSON (numbers, booleans, null,
lists, objects). Parameters are joined by ``\\n``, invokes by ``\\n``; an invoke without arguments has an empty line.
The tools prompt is :data:`TOOLS_PROMPT` with one JSON object per tool (``{"name", "description", "parameters"}``,
``json.dumps`` with ``ensure_ascii=False``) inside ``<functions>...</functions>``.

Thinking retention (``drop_thinking``):

* ``"after_user"`` (V3.2, the default): reasoning of assistant turns BEFORE the last user message is dropped (their
  content, tool calls and the tool results stay); turns after it -- the current tool-calling episode -- keep it.
* ``"every_turn"`` (R1-style ablation): only the last assistant turn (or the turn to be generated) keeps reasoning.
* ``"never"``: every assistant turn keeps its reasoning.

Assumptions and departures from the published encoder (documented here because they change strings):

* ``tools=`` is rendered into the system message (the published encoder reads ``tools`` off the system message);
  without a system message, an empty one is made, so the prompt starts ``BOS \\n\\n## Tools``.
* ``drop_thinking="never"`` really keeps old reasoning (opener ``<think>`` before every assistant turn); the
  published V3.2 encoder renders history the same way with or without its ``drop_thinking`` flag.
* ``add_generation_prompt=False`` leaves out the trailing ``<｜Assistant｜>{opener}`` (or ``\\n\\n{opener}`` after tool
  results); the published encoder always writes it.
* Structure is validated (system first only; an assistant turn follows a user message or tool results; tool results
  follow an assistant turn with calls, one per call, in order; a turn with calls is followed by its results or ends
  the conversation): violations raise :class:`ChatFormatError` naming the message.
* The codecs in this module treat 17 strings as single tokens (:data:`SPECIAL_TOKENS`): pad, BOS, EOS, the role
  markers, the think tags, the six DSML tags (``<｜DSML｜invoke`` / ``<｜DSML｜parameter`` without their attributes)
  and the function_results / result tags. DeepSeek's own tokenizer splits some of these; that changes ids, not text.

Loss mask (:func:`encode_tokens`): 1 exactly on what the model generated in trained turns -- ``{reasoning}</think>``
(when kept), content, tool-call markup and EOS; 0 on BOS, system, user, tool results, the openers and on assistant
turns whose reasoning was dropped (in thinking mode those turns are history, not targets). ``Assistant(train=False)``
masks a turn out explicitly.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Protocol, Sequence, Union, get_args

__all__ = [
    "Assistant", "ChatFormatError", "Codec", "HFCodec", "SPECIAL_TOKENS", "System", "TinyCodec", "Tool", "ToolCall",
    "ToolResult", "User", "encode", "encode_tokens", "load_tokenizer", "parse_completion", "render_tools",
]

# ----------------------------------------------------------------------------------------------- tokens and prompts

PAD = "<｜▁pad▁｜>"
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML}function_calls>"
CALLS_CLOSE = f"</{DSML}function_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"
RESULTS_OPEN = "<function_results>"
RESULTS_CLOSE = "</function_results>"
RESULT_OPEN = "<result>"
RESULT_CLOSE = "</result>"

#: Every string the codecs of this module map to ONE id (TinyCodec ids 0..16 in this order; PAD is id 0).
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD, BOS, EOS, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE, CALLS_OPEN, CALLS_CLOSE, INVOKE_OPEN, INVOKE_CLOSE,
    PARAM_OPEN, PARAM_CLOSE, RESULTS_OPEN, RESULTS_CLOSE, RESULT_OPEN, RESULT_CLOSE,
)

#: The tool-use instructions appended to the system prompt; ``{tool_schemas}`` is one JSON object per line.
TOOLS_PROMPT = (
    "## Tools\n\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    f'You can invoke functions by writing a "{CALLS_OPEN}" block like the following as part of your reply to the '
    "user:\n"
    f"{CALLS_OPEN}\n"
    f'{INVOKE_OPEN} name="$FUNCTION_NAME">\n'
    f'{PARAM_OPEN} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}\n'
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f'{INVOKE_OPEN} name="$FUNCTION_NAME2">\n'
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f"{CALLS_CLOSE}\n\n"
    "String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects "
    'should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" '
    "for other types (numbers, booleans, arrays, objects).\n\n"
    "If the thinking_mode is enabled, then after function results you should strongly consider outputting a "
    "thinking block. Here is an example:\n\n"
    f"{CALLS_OPEN}\n...\n{CALLS_CLOSE}\n\n"
    f"{RESULTS_OPEN}\n...\n{RESULTS_CLOSE}\n\n"
    f"{THINK_OPEN}...thinking about results{THINK_CLOSE}\n\n"
    "Here are the functions available in JSONSchema format:\n"
    "<functions>\n{tool_schemas}\n</functions>\n"
)

DropThinking = Literal["after_user", "every_turn", "never"]
DROP_MODES = get_args(DropThinking)


class ChatFormatError(ValueError):
    """A conversation that cannot be encoded, or a completion that does not parse; the message names where."""


# ------------------------------------------------------------------------------------------------------- messages


@dataclass
class ToolCall:
    """One function call: the tool's name and its arguments (a JSON-able dict)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


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


@dataclass
class Tool:
    """A tool definition: name, description and a JSON-schema ``parameters`` object."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def schema(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


Message = Union[System, User, Assistant, ToolResult]
MessageLike = Union[Message, Mapping[str, Any]]
ToolLike = Union[Tool, Mapping[str, Any]]


def _as_tool_call(value: Any, where: str) -> ToolCall:
    if isinstance(value, ToolCall):
        call = value
    elif isinstance(value, Mapping):
        fn = value.get("function", value)  # OpenAI {"type": "function", "function": {...}} or plain {"name", ...}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ChatFormatError(f"{where}.arguments: not valid JSON ({e.msg})") from None
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


# -------------------------------------------------------------------------------------------------------- encoding


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


ToolsPrompt = Literal["full", "compact"]
#: ``tools_prompt="compact"``: only the schema list of :data:`TOOLS_PROMPT`, without the format instructions (about
#: 400 BPE tokens shorter; for small models trained on the format, which never read the instructions).
COMPACT_TOOLS_PROMPT = "## Tools\n<functions>\n{tool_schemas}\n</functions>\n"


def render_tools(tools: Sequence[ToolLike], tools_prompt: ToolsPrompt = "full") -> str:
    """The tools section of the system prompt (:data:`TOOLS_PROMPT`, or :data:`COMPACT_TOOLS_PROMPT` for
    ``tools_prompt="compact"``, with one JSON schema per tool)."""
    templates = {"full": TOOLS_PROMPT, "compact": COMPACT_TOOLS_PROMPT}
    if tools_prompt not in templates:
        raise ValueError(f"tools_prompt={tools_prompt!r}: expected 'full' or 'compact'")
    schemas = "\n".join(_json(as_tool(t, i).schema()) for i, t in enumerate(tools))
    return templates[tools_prompt].replace("{tool_schemas}", schemas)


_NAME_RE = re.compile(r'[^"<>\n]+')


def _render_param(tool: str, key: str, value: Any) -> str:
    if not isinstance(key, str) or not _NAME_RE.fullmatch(key):
        raise ChatFormatError(f"tool call {tool!r}: parameter name {key!r} must be a non-empty string without "
                              "quotes, angle brackets or newlines")
    if isinstance(value, str):
        if DSML in value:
            raise ChatFormatError(f"tool call {tool!r}: string parameter {key!r} contains DSML markup ({DSML!r})")
        return f'{PARAM_OPEN} name="{key}" string="true">{value}{PARAM_CLOSE}'
    try:
        text = _json(value)
    except (TypeError, ValueError) as e:
        raise ChatFormatError(f"tool call {tool!r}: parameter {key!r} is not JSON-serialisable ({e})") from None
    return f'{PARAM_OPEN} name="{key}" string="false">{text}{PARAM_CLOSE}'


def render_tool_calls(calls: Sequence[ToolCall]) -> str:
    """``\\n\\n<｜DSML｜function_calls>...</｜DSML｜function_calls>`` for one assistant turn ("" without calls)."""
    if not calls:
        return ""
    invokes = []
    for call in calls:
        if not _NAME_RE.fullmatch(call.name):
            raise ChatFormatError(f"tool call name {call.name!r} must not contain quotes, angle brackets or newlines")
        params = "\n".join(_render_param(call.name, k, v) for k, v in call.arguments.items())
        invokes.append(f'{INVOKE_OPEN} name="{call.name}">\n{params}\n{INVOKE_CLOSE}')
    return "\n\n" + CALLS_OPEN + "\n" + "\n".join(invokes) + "\n" + CALLS_CLOSE


def render_assistant(msg: Assistant, keep_reasoning: bool) -> str:
    """What the model generates for one assistant turn, after the opener, up to and including EOS."""
    head = (msg.reasoning or "") + THINK_CLOSE if keep_reasoning else ""
    return head + (msg.content or "") + render_tool_calls(msg.tool_calls) + EOS


def _validate(msgs: Sequence[Message]) -> None:
    """Raise ChatFormatError on a conversation whose structure the format cannot express."""
    pending: tuple[int, int] | None = None  # (assistant index, results still expected)
    for i, m in enumerate(msgs):
        prev = msgs[i - 1] if i else None
        if pending and pending[1] and not isinstance(m, ToolResult):
            a, left = pending
            n = len(msgs[a].tool_calls)
            raise ChatFormatError(f"messages[{a}]: the assistant made {n} tool call(s) but {n - left} tool result(s) "
                                  f"follow it (messages[{i}] is a {m.role} message)")
        if isinstance(m, System) and i:
            raise ChatFormatError(f"messages[{i}]: a system message may only be the first message")
        elif isinstance(m, Assistant) and not isinstance(prev, (User, ToolResult)):
            got = prev.role if prev else "nothing"
            raise ChatFormatError(f"messages[{i}]: an assistant message must follow a user or tool message, "
                                  f"not {got}")
        elif isinstance(m, ToolResult):
            if not pending or not pending[1]:
                raise ChatFormatError(f"messages[{i}]: a tool result must follow an assistant message with tool "
                                      "calls (one result per call)")
            pending = (pending[0], pending[1] - 1)
        if isinstance(m, Assistant):
            pending = (i, len(m.tool_calls))
    if pending and pending[1] and isinstance(msgs[-1], ToolResult):
        a, left = pending
        n = len(msgs[a].tool_calls)
        raise ChatFormatError(f"messages[{a}]: the assistant made {n} tool call(s) but only {n - left} tool "
                              "result(s) follow it")


def _kept_slots(msgs: Sequence[Message], gen_slot: int | None, thinking: bool, drop: str) -> set[int]:
    """Indices of assistant turns (and the generation slot ``len(msgs)``) that keep their reasoning."""
    if drop not in DROP_MODES:
        raise ChatFormatError(f"drop_thinking={drop!r}: expected one of {', '.join(DROP_MODES)}")
    if not thinking:
        return set()
    slots = [i for i, m in enumerate(msgs) if isinstance(m, Assistant)] + ([gen_slot] if gen_slot is not None else [])
    if drop == "never":
        return set(slots)
    if drop == "every_turn":
        return {max(slots)} if slots else set()
    last_user = max((i for i, m in enumerate(msgs) if isinstance(m, User)), default=-1)
    return {s for s in slots if s > last_user}


def render_segments(messages: Sequence[MessageLike], tools: Sequence[ToolLike] | None = None, thinking: bool = True,
                    drop_thinking: DropThinking = "after_user", add_generation_prompt: bool = True,
                    add_bos: bool = True, tools_prompt: ToolsPrompt = "full") -> list[tuple[str, bool]]:
    """The prompt as ``(text, trained)`` pieces; ``trained`` marks model-generated text of trained turns.

    Every boundary between pieces lies next to a special token, so tokenizing the pieces one by one gives the
    same ids as tokenizing the joined string (for codecs that map specials to single ids)."""
    msgs = [as_message(m, i) for i, m in enumerate(messages)]
    if tools:
        tools_text = render_tools(tools, tools_prompt)
        if msgs and isinstance(msgs[0], System):
            msgs[0] = System(msgs[0].content + "\n\n" + tools_text)
        else:
            msgs.insert(0, System("\n\n" + tools_text))
    _validate(msgs)
    n = len(msgs)
    gen_slot = n if add_generation_prompt and n and isinstance(msgs[-1], (User, ToolResult)) else None
    kept = _kept_slots(msgs, gen_slot, thinking, drop_thinking)

    def opener(slot: int) -> str:
        return THINK_OPEN if slot in kept else THINK_CLOSE

    out: list[tuple[str, bool]] = [(BOS, False)] if add_bos else []
    for i, m in enumerate(msgs):
        last = i == n - 1
        if isinstance(m, System):
            out.append((m.content, False))
        elif isinstance(m, User):
            out.append((USER + m.content, False))
            if not last or gen_slot is not None:
                out.append((ASSISTANT + opener(i + 1), False))
        elif isinstance(m, Assistant):
            trained = m.train and (i in kept or not thinking)
            out.append((render_assistant(m, i in kept), trained))
        else:
            first = not isinstance(msgs[i - 1], ToolResult)
            closes = last or not isinstance(msgs[i + 1], ToolResult)
            text = (("\n\n" + RESULTS_OPEN) if first else "") + "\n" + RESULT_OPEN + m.content + RESULT_CLOSE
            if closes:
                text += "\n" + RESULTS_CLOSE
                if not last or gen_slot is not None:
                    text += "\n\n" + opener(i + 1)
            out.append((text, False))
    return [(t, tr) for t, tr in out if t]


def encode(messages: Sequence[MessageLike], tools: Sequence[ToolLike] | None = None, thinking: bool = True,
           add_generation_prompt: bool = True, drop_thinking: DropThinking = "after_user",
           add_bos: bool = True, tools_prompt: ToolsPrompt = "full") -> str:
    """The prompt string of a conversation (see the module docstring for the format and the retention rule).

    ``add_generation_prompt``: when the conversation ends with a user message or tool results, end with the
    assistant prefix (``<｜Assistant｜><think>`` / ``\\n\\n<think>``) the model continues from."""
    return "".join(t for t, _ in render_segments(messages, tools, thinking, drop_thinking, add_generation_prompt,
                                                 add_bos, tools_prompt))


def encode_tokens(messages: Sequence[MessageLike], codec: "Codec", tools: Sequence[ToolLike] | None = None,
                  thinking: bool = True, add_generation_prompt: bool = True,
                  drop_thinking: DropThinking = "after_user", add_bos: bool = True,
                  tools_prompt: ToolsPrompt = "full") -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)``: the ids of :func:`encode`'s string and 1 on the tokens of trained assistant turns."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in render_segments(messages, tools, thinking, drop_thinking, add_generation_prompt, add_bos,
                                         tools_prompt):
        piece = codec.encode(text)
        ids.extend(piece)
        mask.extend([int(trained)] * len(piece))
    return ids, mask


# --------------------------------------------------------------------------------------------------------- parsing

_INVOKE_HEAD = re.compile(r' name="([^"<>\n]*)"')
_PARAM_HEAD = re.compile(r' name="([^"<>\n]*)" string="(true|false)"')
_FORBIDDEN_IN_TEXT = (BOS, EOS, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE, RESULTS_OPEN, RESULTS_CLOSE)


def _snippet(text: str, pos: int) -> str:
    return repr(text[pos:pos + 24] + ("..." if len(text) > pos + 24 else ""))


def _skip_ws(text: str, pos: int, end: int) -> int:
    while pos < end and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _check_text(field_name: str, text: str, offset: int) -> None:
    """Reasoning and content carry no special tokens and no DSML markup (that belongs in a function_calls block)."""
    markup = (CALLS_OPEN, CALLS_CLOSE, PARAM_OPEN, INVOKE_OPEN, DSML)
    hits = [(text.find(tok), tok) for tok in _FORBIDDEN_IN_TEXT + markup if tok in text]
    if not hits:
        return
    at, tok = min(hits, key=lambda h: (h[0], -len(h[1])))
    where = f"in {field_name} at offset {offset + at}"
    if tok == CALLS_OPEN:
        raise ChatFormatError(f"tool calls {where} (calls go after {THINK_CLOSE!r})")
    if tok == CALLS_CLOSE:
        raise ChatFormatError(f"{CALLS_CLOSE!r} without {CALLS_OPEN!r} {where}")
    if tok == PARAM_OPEN:
        raise ChatFormatError(f"parameter outside invoke: {PARAM_OPEN!r} {where}")
    if tok == INVOKE_OPEN:
        raise ChatFormatError(f"invoke outside function_calls: {INVOKE_OPEN!r} {where}")
    if tok == DSML:
        raise ChatFormatError(f"DSML markup {_snippet(text, at)} outside a function_calls block {where}")
    if tok == RESULTS_OPEN:
        raise ChatFormatError(f"model-generated {RESULTS_OPEN!r} {where} (tool results come from the environment)")
    raise ChatFormatError(f"unexpected special token {tok!r} {where}")


def _tool_table(tools: Sequence[ToolLike] | None) -> dict[str, Tool] | None:
    return None if tools is None else {t.name: t for t in (as_tool(x, i) for i, x in enumerate(tools))}


def _check_against_schema(tool: Tool, args: dict[str, Any], pos: int) -> None:
    params = tool.parameters or {}
    props = params.get("properties")
    if isinstance(props, dict) and params.get("additionalProperties") is not True:
        for key in args:
            if key not in props:
                raise ChatFormatError(f"unknown parameter {key!r} of tool {tool.name!r} in invoke at offset {pos} "
                                      f"(parameters: {', '.join(props) or 'none'})")
    for key in params.get("required", []) or []:
        if key not in args:
            raise ChatFormatError(f"missing required parameter {key!r} of tool {tool.name!r} in invoke at "
                                  f"offset {pos}")


def _parse_param(text: str, pos: int, end: int, tool: str) -> tuple[str, Any, int]:
    head_end = text.find(">", pos + len(PARAM_OPEN), end)
    m = _PARAM_HEAD.fullmatch(text, pos + len(PARAM_OPEN), head_end) if head_end >= 0 else None
    if m is None:
        raise ChatFormatError(f"malformed parameter tag in invoke {tool!r} at offset {pos}: expected "
                              f'{PARAM_OPEN} name="..." string="true|false">, got {_snippet(text, pos)}')
    key, is_str = m.group(1), m.group(2) == "true"
    close = text.find(PARAM_CLOSE, head_end + 1, end)
    markup = text.find(DSML, head_end + 1, end)
    if close < 0 or markup < close:  # the closing tag itself holds the first DSML after the value
        before = "the end of the completion" if close < 0 else f"the DSML tag at offset {markup - 1}"
        raise ChatFormatError(f"unclosed parameter {key!r} of tool {tool!r} at offset {pos}: no {PARAM_CLOSE!r} "
                              f"before {before}")
    raw = text[head_end + 1:close]
    if is_str:
        value: Any = raw
    else:
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"bad JSON in parameter {key!r} of tool {tool!r} at offset {pos}: {e.msg} "
                                  f"(value {raw[:40]!r}; use string=\"true\" for raw strings)") from None
    return key, value, close + len(PARAM_CLOSE)


def _parse_invoke(text: str, pos: int, end: int, tools: dict[str, Tool] | None) -> tuple[dict[str, Any], int]:
    start = pos
    head_end = text.find(">", pos + len(INVOKE_OPEN), end)
    m = _INVOKE_HEAD.fullmatch(text, pos + len(INVOKE_OPEN), head_end) if head_end >= 0 else None
    if m is None or not m.group(1):
        raise ChatFormatError(f'malformed invoke tag at offset {pos}: expected {INVOKE_OPEN} name="...">, got '
                              f"{_snippet(text, pos)}")
    name = m.group(1)
    if tools is not None and name not in tools:
        raise ChatFormatError(f"unknown tool {name!r} in invoke at offset {pos} (tools: {', '.join(tools) or 'none'})")
    args: dict[str, Any] = {}
    pos = head_end + 1
    while True:
        pos = _skip_ws(text, pos, end)
        if text.startswith(INVOKE_CLOSE, pos, end):
            pos += len(INVOKE_CLOSE)
            break
        if pos >= end or text.startswith(CALLS_CLOSE, pos, end) or text.startswith(INVOKE_OPEN, pos, end):
            raise ChatFormatError(f"unclosed invoke {name!r} at offset {start}: no {INVOKE_CLOSE!r} before "
                                  + ("the end of the completion" if pos >= end else f"offset {pos}"))
        if not text.startswith(PARAM_OPEN, pos, end):
            raise ChatFormatError(f"unexpected text {_snippet(text, pos)} in invoke {name!r} at offset {pos}")
        at = pos
        key, value, pos = _parse_param(text, pos, end, name)
        if key in args:
            raise ChatFormatError(f"duplicate parameter {key!r} of tool {name!r} at offset {at}")
        args[key] = value
    if tools is not None:
        _check_against_schema(tools[name], args, start)
    return {"name": name, "arguments": args}, pos


def _parse_calls(text: str, pos: int, end: int, tools: dict[str, Tool] | None) -> tuple[list[dict[str, Any]], int]:
    start = pos
    pos += len(CALLS_OPEN)
    calls = []
    while True:
        pos = _skip_ws(text, pos, end)
        if pos >= end:
            raise ChatFormatError(f"unclosed function_calls block at offset {start}: no {CALLS_CLOSE!r}")
        if text.startswith(CALLS_CLOSE, pos, end):
            return calls, pos + len(CALLS_CLOSE)
        if text.startswith(INVOKE_OPEN, pos, end):
            call, pos = _parse_invoke(text, pos, end, tools)
            calls.append(call)
        elif text.startswith(PARAM_OPEN, pos, end):
            raise ChatFormatError(f"parameter outside invoke at offset {pos}")
        else:
            raise ChatFormatError(f"unexpected text {_snippet(text, pos)} in function_calls block at offset {pos}")


def parse_completion(text: str, thinking: bool = True, tools: Sequence[ToolLike] | None = None) -> dict[str, Any]:
    """Parse what the model generated after the generation prompt.

    Returns ``{"reasoning": str | None, "content": str, "tool_calls": [{"name", "arguments"}, ...]}``
    (``reasoning`` is None when ``thinking=False``). The completion may end with EOS (nothing after it) or stop
    before it; in thinking mode it must close its reasoning with ``</think>`` (a leading ``<think>`` is accepted).
    With ``tools``, calls to unknown tools / parameters and missing required parameters are errors. Anything
    malformed raises :class:`ChatFormatError` naming the problem and its character offset."""
    table = _tool_table(tools)
    pos, reasoning = 0, None
    if thinking:
        start = len(THINK_OPEN) if text.startswith(THINK_OPEN) else 0
        close = text.find(THINK_CLOSE, start)
        if close < 0:
            raise ChatFormatError(f"missing {THINK_CLOSE!r}: in thinking mode the reasoning must end with "
                                  f"{THINK_CLOSE!r} (completion {_snippet(text, 0)})")
        reasoning, pos = text[start:close], close + len(THINK_CLOSE)
        _check_text("reasoning", reasoning, start)
    end = len(text)
    eos = text.find(EOS, pos)
    if eos >= 0:
        if eos + len(EOS) != len(text):
            raise ChatFormatError(f"text after {EOS!r} at offset {eos + len(EOS)}: {_snippet(text, eos + len(EOS))}")
        end = eos
    calls_at = text.find(CALLS_OPEN, pos, end)
    calls: list[dict[str, Any]] = []
    if calls_at < 0:
        content = text[pos:end]
    else:
        content = text[pos:calls_at]
        content = content[:-2] if content.endswith("\n\n") else content
        calls, after = _parse_calls(text, calls_at, end, table)
        if text[after:end].strip():
            raise ChatFormatError(f"unexpected text after {CALLS_CLOSE!r} at offset {after}: {_snippet(text, after)}")
    _check_text("content", content, pos)
    return {"reasoning": reasoning, "content": content, "tool_calls": calls}


# ---------------------------------------------------------------------------------------------------------- codecs


class Codec(Protocol):
    """Text <-> ids where every string of :data:`SPECIAL_TOKENS` is ONE id."""

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_to_id(self, token: str) -> int: ...


#: TinyCodec's default characters: digits, lowercase letters, space, newline and a little punctuation.
TINY_CHARS = string.digits + string.ascii_lowercase + " \n" + "{}[]\":,.=+-*/()_<>?!'"
#: Printable ASCII plus newline (no tab / CR): enough for the tools prompt; 96 characters + 17 specials = 113 ids.
PRINTABLE_CHARS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")


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
        self.vocab_size = len(self._vocab)
        if self.vocab_size > max_vocab:
            raise ValueError(f"TinyCodec: {self.vocab_size} ids > max_vocab={max_vocab}; use fewer chars")
        self.pad_id, self.bos_id, self.eos_id = self._ids[PAD], self._ids[BOS], self._ids[EOS]

    @classmethod
    def printable(cls) -> "TinyCodec":
        """A TinyCodec over :data:`PRINTABLE_CHARS` (needed for the English tools prompt)."""
        return cls(PRINTABLE_CHARS)

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            c = text[i]
            if c == "<":
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
        self._tok = tokenizer
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
        return self._tok.encode(text, add_special_tokens=False).ids

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
CHAT_TOKENIZER_PATH = Path(__file__).resolve().parent / "assets" / "chat_tokenizer.json"


def load_tokenizer(path: str | Path | None = None) -> HFCodec:
    """The shipped chat BPE tokenizer (or the tokenizer.json at ``path``) as an :class:`HFCodec`."""
    path = CHAT_TOKENIZER_PATH if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"chat tokenizer {path} not found; run `python tools/make_chat_tokenizer.py`")
    return HFCodec.from_file(path)
