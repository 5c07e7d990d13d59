"""Context management for long tool-calling episodes (V3.2 report, section 4.4, "Context Management of Search Agent").

When an agent's context fills up, the report rewrites the trajectory with one of three strategies once token usage
exceeds 80% of the context window; the baseline does nothing and the episode fails when the window is full:

    none         leave the messages alone
    summary      replace the tool-call history by a summary of it and re-initiate the rollout
    discard75    drop the first 75% of the tool-call history
    discard_all  drop all of the tool-call history (like a "new context" tool)

Everything here is a pure function over a message list (:mod:`dsv32_jax.posttrain.chat` dataclasses). The *tool-call
history* is what follows the LAST user message: a sequence of units, each one :class:`~dsv32_jax.posttrain.chat.Assistant`
turn together with the :class:`~dsv32_jax.posttrain.chat.ToolResult` messages answering its calls. Everything up to and
including the last user message (the system prompt with its tools, earlier conversation, the user task) is kept.

* ``discard75`` drops the first ``floor(0.75 * n)`` of the n units, but at least one (it is only called when the
  context is over budget, so something must go); with one unit that unit goes too.
* ``discard_all`` drops all n units.
* ``summary`` drops all n units and appends ``summarize(messages)`` to the last user message after
  :data:`SUMMARY_MARKER` (one user-visible message: task + summary). A second summary replaces the first: the default
  summarizer keeps the old summary's items (held on the :class:`SummarizedUser` message as written; read back from
  its text only when another summarizer wrote it, since an argument or a result may spell the separator). The
  summary goes into the user message rather than a second user message because the chat format puts
  ``<｜Assistant｜></think>`` after every user message that is not last, which would read as an empty assistant reply.

The default summarizer (:func:`extractive_summary`) is extractive and needs no model: one item per tool call,
``name(arg,...)=result`` (:func:`format_call`), items joined by ``", "``, exact duplicates kept once, e.g.
``calc(698-82)=616, get(qd)=41``. It adds only the characters of its inputs plus ``(),=`` and space, so when the
calls and results are inside :data:`dsv32_jax.posttrain.envs.CHARSET` the summary is too (the separator is not ``";"``, which
CHARSET lacks).

The 80% trigger (:func:`over_budget`) is measured in tokens of the prompt the model would be given: the encoded
conversation (system prompt + tools prompt + all messages) INCLUDING the generation prompt (``<｜Assistant｜><think>``
or ``\\n\\n<think>``), compared against ``trigger * context_budget`` with ``trigger = 0.8``. The episode runner
checks it once before every generation; if the rewritten context is still over 80%, the model generates anyway in
what room is left (strategies are applied once per turn, not in a loop).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Callable, Mapping, Sequence

from dsv32_jax.posttrain.chat import Assistant, Message, ToolResult, User

__all__ = ["STRATEGIES", "SUMMARY_MARKER", "TRIGGER", "SummarizedUser", "extractive_summary", "format_call",
           "history_units", "manage", "over_budget", "parse_summary", "split_summary"]

STRATEGIES: tuple[str, ...] = ("none", "summary", "discard75", "discard_all")
#: Fraction of the context budget above which a strategy is applied (the report's 80%).
TRIGGER = 0.8
#: What separates the user task from the summary inside the (last) user message.
SUMMARY_MARKER = ". known results: "
_ITEM_SEP = ", "
_ITEM_START = re.compile(r", (?=[a-z_][a-z0-9_]*\()")  # an item starts with `name(`; results may contain ", "

Summarizer = Callable[[Sequence[Message]], str]


def over_budget(prompt_tokens: int, context_budget: int, trigger: float = TRIGGER) -> bool:
    """True when ``prompt_tokens`` (the encoded prompt incl. the generation prompt) exceed ``trigger`` of the budget."""
    if context_budget <= 0:
        raise ValueError(f"context_budget must be > 0, got {context_budget}")
    return prompt_tokens > trigger * context_budget


def format_call(name: str, arguments: Mapping[str, Any]) -> str:
    """``name(v1,v2)``: argument values in order, strings raw, everything else compact JSON."""
    vals = [v if isinstance(v, str) else json.dumps(v, separators=(",", ":")) for v in arguments.values()]
    return f"{name}({','.join(vals)})"


def _last_user(messages: Sequence[Message]) -> int:
    idx = max((i for i, m in enumerate(messages) if isinstance(m, User)), default=-1)
    if idx < 0:
        raise ValueError("messages: context management needs a user message (the task); found none")
    return idx


def history_units(messages: Sequence[Message]) -> list[tuple[int, int]]:
    """The tool-call history after the last user message as ``[start, end)`` index spans, one per assistant turn
    (the turn and the tool results that follow it)."""
    start = _last_user(messages) + 1
    units: list[tuple[int, int]] = []
    for i in range(start, len(messages)):
        m = messages[i]
        if isinstance(m, Assistant):
            units.append((i, i + 1))
        elif isinstance(m, ToolResult):
            if not units:
                raise ValueError(f"messages[{i}]: a tool result after the last user message precedes every "
                                 "assistant turn")
            units[-1] = (units[-1][0], i + 1)
        else:
            raise ValueError(f"messages[{i}]: unexpected {type(m).__name__} in the tool-call history")
    return units


@dataclasses.dataclass
class SummarizedUser(User):
    """The user message that ``summary`` wrote, kept as its two parts (content = task + SUMMARY_MARKER + summary,
    derived), so a later summary finds the task whatever its text holds (a task containing the marker's text was
    cut there)."""

    content: str = dataclasses.field(init=False, default="")
    task: str = ""
    summary: str = ""
    #: the extractive summary's items when the default summarizer wrote it (a later summary keeps them as they are:
    #: items cannot be read back out of the joined text when an argument or a result spells ", name(")
    items: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self):
        self.content = self.task + SUMMARY_MARKER + self.summary


def split_summary(content: str) -> tuple[str, str]:
    """``(task, summary)`` of a rendered user message's text ("" when it carries no summary): the text after the
    first SUMMARY_MARKER. On messages, :func:`manage` reads :class:`SummarizedUser`'s parts instead."""
    at = content.find(SUMMARY_MARKER)
    return (content, "") if at < 0 else (content[:at], content[at + len(SUMMARY_MARKER):])


def _task_and_summary(message: Message) -> tuple[str, str]:
    """A plain user message is all task (user text is data: never parsed for a marker)."""
    if isinstance(message, SummarizedUser):
        return message.task, message.summary
    return message.content, ""


def parse_summary(summary: str) -> dict[str, str]:
    """The ``{call: result}`` items of an extractive summary's text (the inverse of the join in
    :func:`extractive_summary` when no argument or result spells ``", name("``; :func:`manage` keeps the items
    themselves on :class:`SummarizedUser`, this is for rendered text)."""
    out: dict[str, str] = {}
    for item in _ITEM_START.split(summary) if summary else []:
        at = item.find(")=")
        if at >= 0:
            out[item[:at + 1]] = item[at + 2:]
    return out


def _summary_items(messages: Sequence[Message]) -> list[str]:
    """The old summary's items (as kept on :class:`SummarizedUser`, else read back from its text), then one
    ``name(args)=result`` item per tool call of the history, duplicates kept once."""
    user = messages[_last_user(messages)]
    if isinstance(user, SummarizedUser) and user.items:
        items = list(user.items)
    else:
        items = [f"{k}={v}" for k, v in parse_summary(_task_and_summary(user)[1]).items()]
    for start, end in history_units(messages):
        turn = messages[start]
        results = [m.content for m in messages[start + 1:end]]
        for j, call in enumerate(turn.tool_calls):
            result = results[j] if j < len(results) else "(no result)"
            items.append(f"{format_call(call.name, call.arguments)}={result}")
    return list(dict.fromkeys(items))


def extractive_summary(messages: Sequence[Message]) -> str:
    """The default summarizer: the old summary's items (if the last user message has one), then one
    ``name(args)=result`` item per tool call of the history, duplicates kept once, joined by ``", "``."""
    return _ITEM_SEP.join(_summary_items(messages))


def manage(messages: Sequence[Message], strategy: str, summarize: Summarizer | None = None) -> list[Message]:
    """The message list after applying ``strategy`` (see the module docstring); a new list, the input is unchanged.

    Returns an equal list when there is nothing to do (``none``, or no tool-call history)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {', '.join(STRATEGIES)}")
    out = list(messages)
    if strategy == "none":
        return out
    units = history_units(out)
    if not units:
        return out
    first = units[0][0]
    if strategy == "discard_all":
        return out[:first] + out[units[-1][1]:]
    if strategy == "discard75":
        drop = max(1, math.floor(0.75 * len(units)))
        return out[:first] + [m for start, end in units[drop:] for m in out[start:end]]
    items = tuple(_summary_items(out)) if summarize in (None, extractive_summary) else ()
    summary = _ITEM_SEP.join(items) if items else (summarize or extractive_summary)(out)
    last = first - 1
    task = _task_and_summary(out[last])[0]
    out[last] = SummarizedUser(task=task, summary=summary, items=items) if summary else User(task)
    return out[:first] + out[units[-1][1]:]
