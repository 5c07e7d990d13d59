"""Success rate against context budget for each context-management strategy (the V3.2 report's Figure 6 setup).

:func:`success_vs_budget` runs ``policy_factory(env, codec, seed)`` on every seed for every (strategy, budget) and
reports success rate, mean reward, mean turns and mean context resets; :func:`format_table` renders it as markdown.

With a real model the curve shows how much test-time compute a strategy buys. Without one, :class:`VerbosePolicy`
makes contexts overflow on purpose: it is the env's oracle, but it (a) READS ITS CONTEXT -- before answering, it
requires every tool result of the demonstration to be visible in the prompt it is given (as a ``<result>`` after the
matching DSML call since the last user message, or as an item of a context summary), re-fetching any that are not
visible, in the demonstration's order; and (b) wastes ``extra_calls`` tool turns on redundant "double-check" calls
(repeats of the demonstration's calls, one per turn) before its answer. Its waste counter is internal state (it
knows it already double-checked), its facts are not (it can only use what it sees). So:

* ``none`` keeps every redundant turn; at a tight budget the context fills and the episode fails.
* ``discard75`` / ``discard_all`` drop history, possibly the needed results; the policy then re-fetches them and
  succeeds as long as the needed calls fit in the budget (discarding facts an answer depends on breaks a policy
  that does not re-fetch -- that is why it must).
* ``summary`` carries every result into the summary (``name(args)=result`` items, which the policy parses), so
  nothing needs re-fetching.
* At a large budget nothing triggers and every strategy behaves like ``none``.

The env must allow the extra tool turns: pass ``env_kwargs={"max_steps": ...}`` (the default max_steps=4 ends an
episode after 4 tool turns).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Sequence

from dsv32_jax.posttrain import chat
from dsv32_jax.posttrain.agent.context import STRATEGIES, format_call, parse_summary, split_summary
from dsv32_jax.posttrain.agent.episode import OraclePolicy, Policy, completion_ids, run_episode
from dsv32_jax.posttrain.envs import Action, Env, make_env

__all__ = ["VerbosePolicy", "format_table", "success_vs_budget", "visible_facts"]

_RESULT = re.compile(re.escape(chat.RESULT_OPEN) + r"(.*?)" + re.escape(chat.RESULT_CLOSE), re.S)


def visible_facts(prompt: str) -> dict[str, str]:
    """``{format_call(...): result}`` for every tool call visible in ``prompt`` after its last user message: DSML
    calls paired in order with the following ``<function_results>`` block, and the items of a context summary in the
    user message."""
    at = prompt.rfind(chat.USER)
    tail = prompt[at + len(chat.USER):] if at >= 0 else prompt
    end_user = tail.find(chat.ASSISTANT)
    facts = parse_summary(split_summary(tail[:end_user] if end_user >= 0 else tail)[1])
    pos = 0
    while True:
        a = tail.find(chat.CALLS_OPEN, pos)
        b = tail.find(chat.CALLS_CLOSE, a) if a >= 0 else -1
        r0 = tail.find(chat.RESULTS_OPEN, b) if b >= 0 else -1
        r1 = tail.find(chat.RESULTS_CLOSE, r0) if r0 >= 0 else -1
        if r1 < 0:
            return facts
        try:
            calls = chat.parse_completion(tail[a:b + len(chat.CALLS_CLOSE)], thinking=False)["tool_calls"]
        except chat.ChatFormatError:
            calls = []
        for call, result in zip(calls, _RESULT.findall(tail, r0, r1)):
            facts[format_call(call["name"], call["arguments"])] = result
        pos = r1


class VerbosePolicy:
    """The oracle plus ``extra_calls`` redundant tool turns, answering only from facts visible in its prompt (see
    the module docstring). Wraps an :class:`~dsv32_jax.posttrain.agent.episode.OraclePolicy` (its demonstration and codec)."""

    def __init__(self, oracle: OraclePolicy, extra_calls: int = 4):
        if extra_calls < 0:
            raise ValueError(f"extra_calls must be >= 0, got {extra_calls}")
        self.codec, self.thinking, self.extra_calls = oracle.codec, oracle.thinking, extra_calls
        self.tool_turns = [a for a in oracle.actions if a.tool_calls]
        self.answer = oracle.actions[-1]
        self.calls = [c for a in self.tool_turns for c in a.tool_calls]
        self.wasted = 0  # redundant turns emitted so far
        self.refetches = 0  # needed turns emitted again because their results were no longer visible
        self._emitted: set[int] = set()

    def _emit(self, action: Action, max_new_tokens: int) -> list[int]:
        return completion_ids(action, self.codec, self.thinking)[:max_new_tokens]

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        facts = visible_facts(self.codec.decode(prompt_ids))
        for i, turn in enumerate(self.tool_turns):
            if any(format_call(c.name, c.arguments) not in facts for c in turn.tool_calls):
                self.refetches += i in self._emitted
                self._emitted.add(i)
                return self._emit(turn, max_new_tokens)
        if self.wasted < self.extra_calls and self.calls:
            call = self.calls[self.wasted % len(self.calls)]
            self.wasted += 1
            check = Action(tool_calls=[call], reasoning="double-check " + format_call(call.name, call.arguments))
            return self._emit(check, max_new_tokens)
        return self._emit(self.answer, max_new_tokens)


PolicyFactory = Callable[[Env, chat.Codec, int], Policy]


def success_vs_budget(env: Env | str, policy_factory: PolicyFactory, codec: chat.Codec, budgets: Sequence[int],
                      strategies: Sequence[str] = STRATEGIES, seeds: Sequence[int] = range(10), *,
                      env_kwargs: Mapping[str, Any] | None = None, max_turns: int = 16, max_new_tokens: int = 512,
                      thinking: bool = True, drop_thinking: chat.DropThinking = "after_user") -> list[dict[str, Any]]:
    """One row per (strategy, budget): ``strategy, budget, episodes, success_rate, mean_reward, mean_turns,
    mean_resets, errors`` (episodes the runner ended with an error, e.g. a full context). ``env``: an environment,
    or a registered name / import path built with ``env_kwargs``."""
    for s in strategies:
        if s not in STRATEGIES:
            raise ValueError(f"strategies: unknown strategy {s!r} (expected one of {', '.join(STRATEGIES)})")
    seeds = list(seeds)
    if not seeds:
        raise ValueError("seeds: need at least one seed")
    env = make_env(env, **dict(env_kwargs or {}))
    rows = []
    for strategy in strategies:
        for budget in budgets:
            trajs = [run_episode(env, seed, policy_factory(env, codec, seed), codec, max_turns=max_turns,
                                 max_new_tokens=max_new_tokens, context_budget=budget, strategy=strategy,
                                 thinking=thinking, drop_thinking=drop_thinking) for seed in seeds]
            n = len(trajs)
            rows.append({"strategy": strategy, "budget": budget, "episodes": n,
                         "success_rate": sum(t.success for t in trajs) / n,
                         "mean_reward": sum(t.reward for t in trajs) / n,
                         "mean_turns": sum(t.turns for t in trajs) / n,
                         "mean_resets": sum(t.resets for t in trajs) / n,
                         "errors": sum("error" in t.info for t in trajs)})
    return rows


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table of :func:`success_vs_budget` rows."""
    lines = ["| strategy | budget | success | mean reward | mean turns | mean resets | errors |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['budget']} | {r['success_rate']:.0%} | {r['mean_reward']:.2f} | "
                     f"{r['mean_turns']:.1f} | {r['mean_resets']:.1f} | {r['errors']}/{r['episodes']} |")
    return "\n".join(lines)
