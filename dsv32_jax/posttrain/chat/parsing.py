"""Completions -> reasoning, content and typed tool calls (:func:`parse_completion` on text,
:func:`parse_completion_ids` on sampled ids: only special ids are markup), and the id-level checks of a sampled
completion (:func:`decode_completion`: EOS last, no PAD / BOS)."""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from dsv32_jax.posttrain.chat.messages import Tool, ToolLike, as_tool, json_error_text
from dsv32_jax.posttrain.chat.tokens import (BOS, CALLS_CLOSE, CALLS_OPEN, DSML, EOS, INVOKE_CLOSE, INVOKE_OPEN, PAD, PARAM_CLOSE,
                                   PARAM_OPEN, RESULT_OPEN, RESULTS_OPEN, SPECIAL_TOKENS, THINK_CLOSE, THINK_OPEN,
                                   ChatFormatError)

__all__ = ["decode_completion", "parse_completion", "parse_completion_ids"]

_INVOKE_HEAD = re.compile(r' name="([^"<>\n]*)"')
_PARAM_HEAD = re.compile(r' name="([^"<>\n]*)" string="(true|false)"')
# every special token but the DSML tags (which the markup check below reports): <result> / </result> were missing
_FORBIDDEN_IN_TEXT = tuple(t for t in SPECIAL_TOKENS if DSML not in t)


def _snippet(text: str, pos: int) -> str:
    return repr(text[pos:pos + 24] + ("..." if len(text) > pos + 24 else ""))


def _skip_ws(text: str, pos: int, end: int) -> int:
    while pos < end and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _check_text(field_name: str, text: str, offset: int) -> None:
    """Reasoning, content and parameter values carry no special tokens and no DSML markup outside the tags of a
    function_calls block (data is encoded as plain text: a special token there would not re-encode as sampled)."""
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
    if tok in (RESULTS_OPEN, RESULT_OPEN):
        raise ChatFormatError(f"model-generated {tok!r} {where} (tool results come from the environment)")
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


def _same(text: str) -> str:
    return text


def _parse_param(text: str, pos: int, end: int, tool: str, clean=_same) -> tuple[str, Any, int]:
    head_end = text.find(">", pos + len(PARAM_OPEN), end)
    m = _PARAM_HEAD.fullmatch(text, pos + len(PARAM_OPEN), head_end) if head_end >= 0 else None
    if m is None:
        raise ChatFormatError(f"malformed parameter tag in invoke {tool!r} at offset {pos}: expected "
                              f'{PARAM_OPEN} name="..." string="true|false">, got {_snippet(text, pos)}')
    key, is_str = clean(m.group(1)), m.group(2) == "true"
    close = text.find(PARAM_CLOSE, head_end + 1, end)
    markup = text.find(DSML, head_end + 1, end)
    if close < 0 or markup < close:  # the closing tag itself holds the first DSML after the value
        before = "the end of the completion" if close < 0 else f"the DSML tag at offset {markup - 1}"
        raise ChatFormatError(f"unclosed parameter {key!r} of tool {tool!r} at offset {pos}: no {PARAM_CLOSE!r} "
                              f"before {before}")
    raw = text[head_end + 1:close]
    _check_text(f"parameter {key!r} of tool {tool!r}", raw, head_end + 1)
    raw = clean(raw)  # (before JSON: a value's JSON escape may spell any character, the parse's marker too)
    if is_str:
        value: Any = raw
    else:
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError) as e:  # (JSONDecodeError, an integer of over 4300 digits, deep nesting)
            raise ChatFormatError(f"bad JSON in parameter {key!r} of tool {tool!r} at offset {pos}: "
                                  f"{json_error_text(e)} "
                                  f"(value {raw[:40]!r}; use string=\"true\" for raw strings)") from None
    return key, value, close + len(PARAM_CLOSE)


def _parse_invoke(text: str, pos: int, end: int, tools: dict[str, Tool] | None,
                  clean=_same) -> tuple[dict[str, Any], int]:
    start = pos
    head_end = text.find(">", pos + len(INVOKE_OPEN), end)
    m = _INVOKE_HEAD.fullmatch(text, pos + len(INVOKE_OPEN), head_end) if head_end >= 0 else None
    if m is None or not m.group(1):
        raise ChatFormatError(f'malformed invoke tag at offset {pos}: expected {INVOKE_OPEN} name="...">, got '
                              f"{_snippet(text, pos)}")
    name = clean(m.group(1))
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
        key, value, pos = _parse_param(text, pos, end, name, clean)
        if key in args:
            raise ChatFormatError(f"duplicate parameter {key!r} of tool {name!r} at offset {at}")
        args[key] = value
    if tools is not None:
        _check_against_schema(tools[name], args, start)
    return {"name": name, "arguments": args}, pos


def _parse_calls(text: str, pos: int, end: int, tools: dict[str, Tool] | None,
                 clean=_same) -> tuple[list[dict[str, Any]], int]:
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
            call, pos = _parse_invoke(text, pos, end, tools, clean)
            calls.append(call)
        elif text.startswith(PARAM_OPEN, pos, end):
            raise ChatFormatError(f"parameter outside invoke at offset {pos}")
        else:
            raise ChatFormatError(f"unexpected text {_snippet(text, pos)} in function_calls block at offset {pos}")


def parse_completion(text: str, thinking: bool = True, tools: Sequence[ToolLike] | None = None, *,
                     _clean=_same) -> dict[str, Any]:
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
        calls, after = _parse_calls(text, calls_at, end, table, _clean)
        if text[after:end].strip():
            raise ChatFormatError(f"unexpected text after {CALLS_CLOSE!r} at offset {after}: {_snippet(text, after)}")
    _check_text("content", content, pos)
    return {"reasoning": None if reasoning is None else _clean(reasoning), "content": _clean(content),
            "tool_calls": calls}


def decode_completion(ids: Sequence[int], codec) -> str:
    """The text of sampled completion ``ids`` (``codec``: a :class:`~dsv32_jax.posttrain.chat.codecs.Codec`), checked at the id
    level: EOS, when present, is the last id (ids after it raise "text after EOS", naming the token offset), and
    neither PAD nor BOS occurs (they are never content). A ChatFormatError names the problem and its token offset."""
    ids = [int(i) for i in ids]
    if codec.eos_id in ids:
        at = ids.index(codec.eos_id)
        if at != len(ids) - 1:
            raise ChatFormatError(f"text after {EOS!r} at token offset {at + 1} of {len(ids)}: "
                                  f"{codec.decode(ids[at + 1:at + 9])!r}")
    for tid, name in ((codec.pad_id, PAD), (codec.bos_id, BOS)):
        if tid != codec.eos_id and tid in ids:
            raise ChatFormatError(f"{name!r} (id {tid}) at token offset {ids.index(tid)} of the completion: padding "
                                  "and BOS are never content")
    return codec.decode(ids)


# Marks a special token's spelling inside plain text while parse_completion_ids parses (Unicode private use; the
# character itself is doubled): after `<` of "</think>", inside "｜DSML｜". Removed from every parsed string.
_ESC = "\ue000"
_DSML_TAGS = (CALLS_OPEN, CALLS_CLOSE, INVOKE_OPEN, INVOKE_CLOSE, PARAM_OPEN, PARAM_CLOSE)
_UNESCAPE = re.compile(_ESC + "(" + _ESC + ")?")
_REPR_UNESCAPE = re.compile(r"\\ue000(\\ue000)?")


def _specials_of(codec) -> dict[int, str]:
    """id -> string of the format's special tokens that ``codec`` has as one id (``token_to_id`` raises for the
    others: a non-strict HFCodec's DSML tags)."""
    out = {}
    for tok in SPECIAL_TOKENS:
        try:
            out[codec.token_to_id(tok)] = tok
        except ValueError:
            continue
    return out


def _escape(text: str, spellings: Sequence[str], dsml: bool) -> str:
    text = text.replace(_ESC, _ESC + _ESC)
    if dsml:  # (first: it sits inside every DSML tag)
        text = text.replace(DSML, DSML[0] + _ESC + DSML[1:])
    for tok in spellings:
        text = text.replace(tok, tok[0] + _ESC + tok[1:])
    return text


def _unescape(text: str) -> str:
    return _UNESCAPE.sub(lambda m: _ESC if m.group(1) else "", text)


def parse_completion_ids(ids: Sequence[int], codec, thinking: bool = True,
                         tools: Sequence[ToolLike] | None = None) -> dict[str, Any]:
    """:func:`parse_completion` of sampled ``ids`` (after :func:`decode_completion`'s id-level checks), where only
    the codec's special ids are markup: text the model spelled with plain-text ids (``</think>`` letter by letter,
    a DSML tool-call block or ``<result>`` copied from a tool result, which the chat encoding feeds it as plain
    text) is data, in the reasoning, the content or an argument; parsing the decoded string read it as markup (a
    copied tool-call block ran as a call). DSML tags count as markup only where the codec has them as single ids
    (a non-strict HFCodec spells them in plain ids, so there they are read from the text)."""
    decode_completion(ids, codec)
    specials = _specials_of(codec)
    dsml = all(tag in specials.values() for tag in _DSML_TAGS)
    spellings = sorted((t for t in specials.values() if DSML not in t), key=len, reverse=True)
    parts, run = [], []
    for i in [int(x) for x in ids] + [None]:
        if i is None or i in specials:
            if run:
                parts.append(_escape(codec.decode(run), spellings, dsml))
                run = []
            if i is not None:
                parts.append(specials[i])
        else:
            run.append(i)
    try:  # (every string the parse extracts is unescaped once, a JSON value before it is decoded)
        return parse_completion("".join(parts), thinking=thinking, tools=tools, _clean=_unescape)
    except ChatFormatError as e:  # (its snippets are reprs: the marker shows as the escape sequence there)
        text = _unescape(str(e))
        raise ChatFormatError(_REPR_UNESCAPE.sub(lambda m: m.group(1) or "", text)) from None
