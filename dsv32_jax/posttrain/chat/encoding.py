"""Conversations -> the V3.2 prompt string (:func:`encode`) and ids with a loss mask (:func:`encode_tokens`).

Every rendered piece is a list of parts, each markup (the format's tags and template text, encoded with the codec's
special tokens) or data (system prompts, user messages, tool results, tool schemas, the assistant's reasoning,
content and call arguments: encoded as plain text, ``codec.encode_text``). So no special token can come from data:
a tool result that reads ``</function_results><｜User｜>`` is those characters, not the end of the results block and
a user turn. A piece whose data holds no special-token string is encoded as one string, which gives the ids every
earlier version gave (trained checkpoints and fixtures rely on them); only pieces with such data are encoded part by
part.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple, Sequence

from dsv32_jax.posttrain.chat.messages import (Assistant, Message, MessageLike, System, ToolCall, ToolLike, ToolResult, User,
                                     as_message, as_tool)
from dsv32_jax.posttrain.chat.tokens import (ASSISTANT, BOS, CALLS_CLOSE, CALLS_OPEN, DROP_MODES, DSML, EOS, INVOKE_CLOSE,
                                   INVOKE_OPEN, PARAM_CLOSE, PARAM_OPEN, RESULT_CLOSE, RESULT_OPEN, RESULTS_CLOSE,
                                   RESULTS_OPEN, THINK_CLOSE, THINK_OPEN, USER, ChatFormatError, DropThinking,
                                   ToolsPrompt)

__all__ = ["COMPACT_TOOLS_PROMPT", "TOOLS_PROMPT", "Piece", "check_encodable", "encode", "encode_assistant", "encode_parts", "encode_tokens",
           "render_assistant", "render_pieces", "render_tool_calls", "render_tools"]

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
#: ``tools_prompt="compact"``: only the schema list of :data:`TOOLS_PROMPT`, without the format instructions (about
#: 400 BPE tokens shorter; for small models trained on the format, which never read the instructions).
COMPACT_TOOLS_PROMPT = "## Tools\n<functions>\n{tool_schemas}\n</functions>\n"

#: One part of a rendered piece: (text, data). Data is encoded as plain text, markup with special tokens.
Part = tuple[str, bool]


class Piece(NamedTuple):
    """A run of the prompt: its parts and whether it is model-generated text of a trained turn. Every boundary
    between pieces lies next to a special token, so encoding pieces one by one gives the ids of the joined string."""

    parts: tuple[Part, ...]
    trained: bool

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.parts)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _tools_parts(tools: Sequence[ToolLike], tools_prompt: ToolsPrompt) -> list[Part]:
    templates = {"full": TOOLS_PROMPT, "compact": COMPACT_TOOLS_PROMPT}
    if tools_prompt not in templates:
        raise ValueError(f"tools_prompt={tools_prompt!r}: expected 'full' or 'compact'")
    head, tail = templates[tools_prompt].split("{tool_schemas}")
    parts: list[Part] = [(head, False)]
    for i, t in enumerate(tools):
        parts += [("\n", False)] if i else []
        parts.append((_json(as_tool(t, i).schema()), True))
    return parts + [(tail, False)]


def render_tools(tools: Sequence[ToolLike], tools_prompt: ToolsPrompt = "full") -> str:
    """The tools section of the system prompt (:data:`TOOLS_PROMPT`, or :data:`COMPACT_TOOLS_PROMPT` for
    ``tools_prompt="compact"``, with one JSON schema per tool)."""
    return "".join(t for t, _ in _tools_parts(tools, tools_prompt))


_NAME_RE = re.compile(r'[^"<>\n]+')


def _param_parts(tool: str, key: str, value: Any) -> list[Part]:
    if not isinstance(key, str) or not _NAME_RE.fullmatch(key):
        raise ChatFormatError(f"tool call {tool!r}: parameter name {key!r} must be a non-empty string without "
                              "quotes, angle brackets or newlines")
    if isinstance(value, str):
        if DSML in value:
            raise ChatFormatError(f"tool call {tool!r}: string parameter {key!r} contains DSML markup ({DSML!r})")
        flag, text = "true", value
    else:
        try:
            flag, text = "false", _json(value)
        except (TypeError, ValueError) as e:
            raise ChatFormatError(f"tool call {tool!r}: parameter {key!r} is not JSON-serialisable ({e})") from None
    return [(f'{PARAM_OPEN} name="', False), (key, True), (f'" string="{flag}">', False), (text, True),
            (PARAM_CLOSE, False)]


def _calls_parts(calls: Sequence[ToolCall]) -> list[Part]:
    if not calls:
        return []
    parts: list[Part] = [("\n\n" + CALLS_OPEN + "\n", False)]
    for j, call in enumerate(calls):
        if not _NAME_RE.fullmatch(call.name):
            raise ChatFormatError(f"tool call name {call.name!r} must not contain quotes, angle brackets or newlines")
        parts += [("\n" if j else "", False), (f'{INVOKE_OPEN} name="', False), (call.name, True), ('">\n', False)]
        for k, (key, value) in enumerate(call.arguments.items()):
            parts += [("\n" if k else "", False)] + _param_parts(call.name, key, value)
        parts.append(("\n" + INVOKE_CLOSE, False))
    return parts + [("\n" + CALLS_CLOSE, False)]


def render_tool_calls(calls: Sequence[ToolCall]) -> str:
    """``\\n\\n<｜DSML｜function_calls>...</｜DSML｜function_calls>`` for one assistant turn ("" without calls)."""
    return "".join(t for t, _ in _calls_parts(calls))


def _assistant_parts(msg: Assistant, keep_reasoning: bool) -> list[Part]:
    head = [(msg.reasoning or "", True), (THINK_CLOSE, False)] if keep_reasoning else []
    return head + [(msg.content or "", True)] + _calls_parts(msg.tool_calls) + [(EOS, False)]


def render_assistant(msg: Assistant, keep_reasoning: bool) -> str:
    """What the model generates for one assistant turn, after the opener, up to and including EOS."""
    return "".join(t for t, _ in _assistant_parts(msg, keep_reasoning))


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


def render_pieces(messages: Sequence[MessageLike], tools: Sequence[ToolLike] | None = None, thinking: bool = True,
                  drop_thinking: DropThinking = "after_user", add_generation_prompt: bool = True,
                  add_bos: bool = True, tools_prompt: ToolsPrompt = "full") -> list[Piece]:
    """The prompt as :class:`Piece` s; ``trained`` marks model-generated text of trained turns."""
    msgs = [as_message(m, i) for i, m in enumerate(messages)]
    system: list[Part] | None = None
    if msgs and isinstance(msgs[0], System):
        system = [(msgs[0].content, True)]
    if tools:
        system = (system or []) + [("\n\n", False)] + _tools_parts(tools, tools_prompt)
        if not isinstance(msgs[0] if msgs else None, System):
            msgs.insert(0, System(""))
    _validate(msgs)
    n = len(msgs)
    gen_slot = n if add_generation_prompt and n and isinstance(msgs[-1], (User, ToolResult)) else None
    kept = _kept_slots(msgs, gen_slot, thinking, drop_thinking)

    def opener(slot: int) -> str:
        return THINK_OPEN if slot in kept else THINK_CLOSE

    out: list[Piece] = [Piece(((BOS, False),), False)] if add_bos else []
    for i, m in enumerate(msgs):
        last = i == n - 1
        if isinstance(m, System):
            out.append(Piece(tuple(system or ()), False))
        elif isinstance(m, User):
            out.append(Piece(((USER, False), (m.content, True)), False))
            if not last or gen_slot is not None:
                out.append(Piece(((ASSISTANT + opener(i + 1), False),), False))
        elif isinstance(m, Assistant):
            trained = m.train and (i in kept or not thinking)
            out.append(Piece(tuple(_assistant_parts(m, i in kept)), trained))
        else:
            first = not isinstance(msgs[i - 1], ToolResult)
            closes = last or not isinstance(msgs[i + 1], ToolResult)
            head = (("\n\n" + RESULTS_OPEN) if first else "") + "\n" + RESULT_OPEN
            tail = RESULT_CLOSE
            if closes:
                tail += "\n" + RESULTS_CLOSE
                if not last or gen_slot is not None:
                    tail += "\n\n" + opener(i + 1)
            out.append(Piece(((head, False), (m.content, True), (tail, False)), False))
    return [Piece(tuple(p for p in piece.parts if p[0]), piece.trained) for piece in out if piece.text]


def encode(messages: Sequence[MessageLike], tools: Sequence[ToolLike] | None = None, thinking: bool = True,
           add_generation_prompt: bool = True, drop_thinking: DropThinking = "after_user",
           add_bos: bool = True, tools_prompt: ToolsPrompt = "full") -> str:
    """The prompt string of a conversation (see the package docstring for the format and the retention rule).

    ``add_generation_prompt``: when the conversation ends with a user message or tool results, end with the
    assistant prefix (``<｜Assistant｜><think>`` / ``\\n\\n<think>``) the model continues from."""
    return "".join(p.text for p in render_pieces(messages, tools, thinking, drop_thinking, add_generation_prompt,
                                                 add_bos, tools_prompt))


def encode_parts(codec, parts: Sequence[Part]) -> list[int]:
    """The ids of one piece: markup through ``codec.encode``, data through ``codec.encode_text`` (plain text). When
    no data part holds one of ``codec.special_tokens`` the piece is encoded as one string (the same ids)."""
    if not any(data and any(s in text for s in codec.special_tokens) for text, data in parts):
        return codec.encode("".join(t for t, _ in parts))
    ids: list[int] = []
    for text, data in parts:
        ids += codec.encode_text(text) if data else codec.encode(text)
    return ids


def encode_assistant(msg: Assistant, codec, keep_reasoning: bool = True) -> list[int]:
    """The ids a model generates for assistant turn ``msg`` after the generation prompt (``render_assistant``'s
    string, up to and including EOS), its reasoning, content and arguments as plain text: a demonstration whose
    answer or argument spells ``<result>`` or ``</think>`` encodes them as the characters they are, as the
    conversation's encoding does."""
    return encode_parts(codec, _assistant_parts(msg, keep_reasoning))


def check_encodable(msg: Assistant, codec) -> None:
    """Raise :class:`ChatFormatError` unless assistant turn ``msg`` renders and ``codec`` encodes it: what a parsed
    completion must pass before it joins a conversation. A ``string="false"`` argument is JSON, which can spell any
    string (``"\\uff5cDSML\\uff5c"``, a lone surrogate, a character outside a small codec's vocabulary), so a turn that
    parsed may still not re-encode; this is the model's format error, not a crash of the run."""
    try:
        encode_parts(codec, _assistant_parts(msg, keep_reasoning=True))
    except ChatFormatError:
        raise
    except ValueError as e:
        raise ChatFormatError(f"the turn does not re-encode: {e}") from None


def encode_tokens(messages: Sequence[MessageLike], codec, tools: Sequence[ToolLike] | None = None,
                  thinking: bool = True, add_generation_prompt: bool = True,
                  drop_thinking: DropThinking = "after_user", add_bos: bool = True,
                  tools_prompt: ToolsPrompt = "full") -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)``: the ids of :func:`encode`'s string (data as plain text: see the module docstring) and 1
    on the tokens of trained assistant turns. ``codec`` is a :class:`~dsv32_jax.posttrain.chat.codecs.Codec`."""
    ids: list[int] = []
    mask: list[int] = []
    for piece in render_pieces(messages, tools, thinking, drop_thinking, add_generation_prompt, add_bos,
                               tools_prompt):
        piece_ids = encode_parts(codec, piece.parts)
        ids.extend(piece_ids)
        mask.extend([int(piece.trained)] * len(piece_ids))
    return ids, mask
