"""Host-side multi-turn agent episodes: a policy (any token generator), a tool environment, the chat encoding.

:func:`run_episode` is model-agnostic: the policy is anything with ``generate(prompt_ids, max_new_tokens) -> ids``
(a sampler over a JAX model, a scripted replay, a random baseline). Per turn::

    prompt = chat.encode_tokens(messages, codec, tools, add_generation_prompt=True, thinking, drop_thinking)
    if strategy != "none" and len(prompt) > 0.8 * context_budget: messages = context.manage(messages, strategy)
    ids = policy.generate(prompt, min(max_new_tokens, context_budget - len(prompt)))
    parsed = chat.parse_completion_ids(ids, codec)           # ChatFormatError -> reward 0, info["error"]
    obs, reward, done, info = env.step(Action(...))         # append Assistant + one ToolResult per call

The episode starts from ``[System(env system prompt), User(task)]`` with the env's tools rendered into the system
prompt by the chat encoding. Right after ``env.reset`` every text of the environment (system prompt, task, tool
schemas) must be encodable by the codec, or a ValueError names the environment, the seed and the field. The episode
ends when the env says done (a final answer, or more than the env's max_steps tool turns), on a malformed completion
(``info["error"]`` starts with ``format``: unparsable text, ids after EOS, PAD or BOS inside the completion, a tool
call whose JSON argument does not re-encode: ``chat.check_encodable``), when a completion has no EOS (cut by
``max_new_tokens`` or by the context budget), when the prompt alone fills the budget (``context full``) or after
``max_turns`` generations. Ids outside the codec's vocabulary are a bug of the policy
(a sampler must mask the logits beyond the codec: ``SamplingConfig.vocab_size``) and raise a ValueError.

Tool failures are the model's data, never an exception (``dsv32_jax.posttrain.envs.tools``): a tool that raises, returns what
JSON cannot encode or overruns its deadline gives an ``error: ...`` result, and so does a result with characters
the codec cannot encode (``error: tool "f" returned text outside the vocabulary``, counted as a crash). The
trajectory counts them: ``tool_calls``, ``tool_errors``, ``tool_crashes``, ``tool_timeouts``.

Training view -- segments and offsets. A prompt is the canonical re-encoding of the current messages (what a serving
stack renders), so it extends the previous prompt + completion exactly when nothing earlier was rewritten. The
trajectory is therefore cut into SEGMENTS: a segment is a token sequence ``ids`` with a ``loss_mask``; each turn's
prompt must start with the current segment's ids (then the segment grows by the new prompt tokens, mask 0, and by the
generated ids, mask 1); when it does not, a new segment starts from that prompt. New segments come from a context
strategy (reason ``summary`` / ``discard75`` / ``discard_all``) and from re-rendering that changes history
(reason ``rerender``: ``drop_thinking="every_turn"`` drops the previous turn's reasoning, or a completion whose text
re-encodes to other ids). Within a segment the model tokens are exactly the ids the policy returned, so log-probs
recorded at sampling time line up with ``segment.ids[c.start:c.start + c.length]`` for each
:class:`Completion` ``c`` (its ``segment`` index, ``start`` offset = prompt length, ``length``). The loss mask is 1
on exactly those positions and 0 on prompt, tool-result and generation-prompt tokens; for canonical completions it
equals ``chat.encode_tokens``'s mask of the segment's messages, except that turns a strategy carried over from an
earlier segment (``discard75`` keeps the last 25%) are prompt (mask 0) in the later one: every generated token is
trained exactly once, in the segment where it was sampled. ``Trajectory.ids`` / ``loss_mask`` are the last
segment's (the final context as the model saw it).
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any, Callable, Mapping, Protocol, Sequence, Union

from dsv32_jax.posttrain import chat
from dsv32_jax.posttrain.agent.context import STRATEGIES, TRIGGER, Summarizer, manage, over_budget
from dsv32_jax.posttrain.envs import Action, Env, Observation, ToolCall

__all__ = ["Completion", "GuessPolicy", "OraclePolicy", "Policy", "RandomPolicy", "ScriptedPolicy", "Segment",
           "Trajectory", "chat_tools", "check_env_text", "completion_ids", "completion_text", "run_episode"]


class Policy(Protocol):
    """Continues a prompt: returns the generated ids, ending with the codec's EOS id or cut at ``max_new_tokens``."""

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]: ...


ActionLike = Union[Action, chat.Assistant, Mapping[str, Any]]


def _assistant(action: ActionLike) -> chat.Assistant:
    if isinstance(action, chat.Assistant):
        return action
    act = Action.coerce(action)
    return chat.Assistant(act.content, act.reasoning, list(act.tool_calls))


def completion_text(action: ActionLike, thinking: bool = True) -> str:
    """What a model generates for ``action`` after the generation prompt: ``{reasoning}</think>`` (thinking mode),
    content, DSML tool calls, EOS."""
    return chat.render_assistant(_assistant(action), keep_reasoning=thinking)


def completion_ids(action: ActionLike, codec: chat.Codec, thinking: bool = True) -> list[int]:
    """The ids of :func:`completion_text`, with the action's reasoning, content and arguments as plain text (a
    demonstration answering ``<result>`` or ``use </think>``: encoding its text turned them into markup, and the
    oracle episode then failed as a format error, stopping the agent stage's cold start)."""
    return chat.encode_assistant(_assistant(action), codec, keep_reasoning=thinking)


def chat_tools(env: Env) -> list[chat.Tool]:
    """The env's tools as chat tool definitions (rendered into the system prompt): an env Tool is a chat Tool."""
    return list(env.tools)


class ScriptedPolicy:
    """Replays fixed completions in order, ignoring the prompt: each is an action (rendered with
    :func:`completion_text`), a raw string (encoded as is, e.g. malformed text) or a list of ids."""

    def __init__(self, codec: chat.Codec, completions: Sequence[ActionLike | str | list[int]], thinking: bool = True):
        self.codec, self.thinking = codec, thinking
        self.completions: list[list[int]] = []
        for i, c in enumerate(completions):
            if isinstance(c, str):
                self.completions.append(codec.encode(c))
            elif isinstance(c, list) and all(isinstance(x, int) for x in c):
                self.completions.append(list(c))
            else:
                try:
                    self.completions.append(completion_ids(c, codec, thinking))
                except (TypeError, chat.ChatFormatError) as e:
                    raise ValueError(f"completions[{i}]: not an action, string or id list ({e})") from None
        self.calls = 0

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        if self.calls >= len(self.completions):
            raise RuntimeError(f"ScriptedPolicy: script exhausted after {len(self.completions)} completions")
        ids = self.completions[self.calls]
        self.calls += 1
        return ids[:max_new_tokens]


class OraclePolicy(ScriptedPolicy):
    """Replays ``env.demonstration(seed)`` (tool turns, then the answer) as encoded completions: reward 1.0 by
    construction, and cold-start SFT data. ``actions`` keeps the demonstration."""

    def __init__(self, env: Env, codec: chat.Codec, seed: int, thinking: bool = True):
        self.actions: list[Action] = env.demonstration(seed)
        super().__init__(codec, self.actions, thinking)


class GuessPolicy:
    """The no-tool chance baseline: answers at once with ``guess(rng)`` (default a uniform integer 0..99)."""

    def __init__(self, codec: chat.Codec, seed: int = 0, guess: Callable[[random.Random], str] | None = None,
                 thinking: bool = True):
        self.codec, self.thinking, self.rng = codec, thinking, random.Random(seed)
        self.guess = guess or (lambda rng: str(rng.randint(0, 99)))

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        return completion_ids(Action(content=self.guess(self.rng), reasoning="guess"), self.codec,
                              self.thinking)[:max_new_tokens]


class RandomPolicy:
    """Uniformly random ids (never PAD/BOS) until EOS or ``max_new_tokens``: almost always a format error."""

    def __init__(self, codec: chat.Codec, seed: int = 0, eos_prob: float = 0.05):
        self.codec, self.rng, self.eos_prob = codec, random.Random(seed), eos_prob
        self.ids = [i for i in range(codec.vocab_size) if i not in (codec.pad_id, codec.bos_id, codec.eos_id)]

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        out: list[int] = []
        while len(out) < max_new_tokens:
            if self.rng.random() < self.eos_prob:
                out.append(self.codec.eos_id)
                break
            out.append(self.rng.choice(self.ids))
        return out


@dataclasses.dataclass
class Segment:
    """One context the model saw: ``ids`` and ``loss_mask`` (1 exactly on generated ids); ``reason`` says why it
    started: ``start``, a strategy name or ``rerender``."""

    ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    reason: str = "start"


@dataclasses.dataclass
class Completion:
    """Where one generation lies: ``segments[segment].ids[start:start + length]`` (``start`` = its prompt length)."""

    segment: int
    start: int
    length: int
    turn: int


@dataclasses.dataclass
class Trajectory:
    """One episode. ``messages``: the final context (after any rewriting) incl. the last assistant turn;
    ``history``: every message of the episode, nothing discarded. ``info``: the env's last info plus ``error`` when
    the runner ended the episode."""

    messages: list[chat.Message]
    history: list[chat.Message]
    reward: float
    success: bool
    turns: int
    resets: int
    segments: list[Segment]
    completions: list[Completion]
    info: dict[str, Any]
    peak_prompt_tokens: int = 0
    tool_calls: int = 0
    tool_errors: int = 0  # every error result: bad calls, ToolError, crashes, timeouts
    tool_crashes: int = 0  # the tool raised (not ToolError), returned what JSON or the codec cannot encode
    tool_timeouts: int = 0
    instance: Any = None  # the environment's task instance (env.instance after reset(seed)): what its hooks read

    @property
    def ids(self) -> list[int]:
        return self.segments[-1].ids if self.segments else []

    @property
    def loss_mask(self) -> list[int]:
        return self.segments[-1].loss_mask if self.segments else []

    def completion_ids(self, i: int) -> list[int]:
        c = self.completions[i]
        return self.segments[c.segment].ids[c.start:c.start + c.length]


def _to_assistant(parsed: Mapping[str, Any]) -> chat.Assistant:
    return chat.Assistant(parsed["content"], parsed["reasoning"],
                          [chat.ToolCall(c["name"], c["arguments"]) for c in parsed["tool_calls"]])


def _unencodable_result(tool: str) -> str:
    return f'error: tool "{tool}" returned text outside the vocabulary'


def check_env_text(env: Env, obs: Observation, codec: chat.Codec, seed: int) -> None:
    """Raise a ValueError naming the environment, the seed and the field unless the codec encodes every text the
    environment gives the model (system prompt, task, tool schemas, the runner's error result for each tool)."""
    fields = [("system prompt (instructions / system_prompt())", obs.system), ("task (render_task)", obs.task)]
    fields += [(f"tool {t.name!r} schema (name, description, parameters)", json.dumps(t.schema(), ensure_ascii=False))
               for t in env.tools]
    fields += [(f"error result of tool {t.name!r}", _unencodable_result(t.name)) for t in env.tools]
    for what, text in fields:
        try:
            codec.encode_text(text)
        except ValueError as e:
            raise ValueError(f"environment {env.name or type(env).__name__!r} ({type(env).__name__}), seed {seed}: "
                             f"the {what} has text the codec cannot encode: {e}") from None


def _encodable_results(results: Sequence[str], calls: Sequence[ToolCall], codec: chat.Codec) -> tuple[list[str], int]:
    """The results, each one the codec cannot encode replaced by an error result; and how many were replaced."""
    out, bad = [], 0
    for text, call in zip(results, calls):
        try:
            codec.encode_text(text)
            out.append(text)
        except ValueError:
            out.append(_unencodable_result(call.name))
            bad += 1
    return out, bad


def run_episode(env: Env, seed: int, policy: Policy, codec: chat.Codec, *, max_turns: int = 8,
                max_new_tokens: int = 512, context_budget: int = 8192, strategy: str = "none",
                thinking: bool = True, drop_thinking: chat.DropThinking = "after_user",
                summarize: Summarizer | None = None, trigger: float = TRIGGER,
                tools_prompt: chat.ToolsPrompt = "full") -> Trajectory:
    """Run one episode of ``env`` (``env.reset(seed)``) with ``policy``; see the module docstring."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {', '.join(STRATEGIES)}")
    for name, value in (("max_turns", max_turns), ("max_new_tokens", max_new_tokens),
                        ("context_budget", context_budget)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:  # (True was taken as 1)
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    # (nan switched context management off silently, -1 rewrote the history every turn, "0.8" was a TypeError)
    if isinstance(trigger, bool) or not isinstance(trigger, (int, float)) or not 0 < trigger <= 1:
        raise ValueError(f"trigger must be a number in (0, 1] (the fraction of context_budget past which the "
                         f"strategy rewrites the history), got {trigger!r}")
    obs = env.reset(seed)
    check_env_text(env, obs, codec, seed)
    tools = chat_tools(env)
    messages: list[chat.Message] = [chat.System(obs.system), chat.User(obs.task)]
    history = list(messages)
    segments: list[Segment] = []
    completions: list[Completion] = []
    reward, info, turns, resets, peak, done = 0.0, {}, 0, 0, 0, False
    counts = dict.fromkeys(("tool_calls", "tool_errors", "tool_crashes", "tool_timeouts"), 0)

    def encode(msgs: Sequence[chat.Message]) -> list[int]:
        return chat.encode_tokens(msgs, codec, tools=tools, thinking=thinking, add_generation_prompt=True,
                                  drop_thinking=drop_thinking, tools_prompt=tools_prompt)[0]

    def fail(error: str) -> None:
        nonlocal reward, done
        reward, done = 0.0, True
        info["error"] = error

    for turn in range(max_turns):
        prompt = encode(messages)
        reason = "rerender"
        if strategy != "none" and over_budget(len(prompt), context_budget, trigger):
            managed = manage(messages, strategy, summarize)
            if managed != messages:
                messages, resets, reason = managed, resets + 1, strategy
                prompt = encode(messages)
        peak = max(peak, len(prompt))
        room = context_budget - len(prompt)
        if room <= 0:
            fail(f"context full: the prompt has {len(prompt)} tokens, context_budget={context_budget}")
            break
        limit = min(max_new_tokens, room)
        seg = segments[-1] if segments else None
        if seg is None or prompt[:len(seg.ids)] != seg.ids:
            seg = Segment(reason="start" if seg is None else reason)
            segments.append(seg)
        seg.loss_mask.extend([0] * (len(prompt) - len(seg.ids)))
        seg.ids.extend(prompt[len(seg.ids):])
        gen = [int(i) for i in policy.generate(list(prompt), limit)]
        if len(gen) > limit:
            raise ValueError(f"policy.generate returned {len(gen)} ids for max_new_tokens={limit}")
        outside = [i for i in gen if not 0 <= i < codec.vocab_size]
        if outside:
            raise ValueError(f"policy.generate returned id {outside[0]} outside the codec's vocabulary "
                             f"[0, {codec.vocab_size}) at turn {turn}; a sampler over a larger model vocabulary "
                             "must mask the logits beyond the codec (SamplingConfig.vocab_size)")
        completions.append(Completion(len(segments) - 1, len(prompt), len(gen), turn))
        seg.ids.extend(gen)
        seg.loss_mask.extend([1] * len(gen))
        turns += 1
        if codec.eos_id not in gen:
            cut = "context full" if not gen or (limit < max_new_tokens and len(gen) >= limit) else "truncated"
            fail(f"{cut}: completion of {len(gen)} tokens has no EOS (max_new_tokens={limit}, "
                 f"context_budget={context_budget})")
            break
        try:
            # (from the ids: text the model spelled in plain ids, e.g. a tool-call block copied from a tool result,
            # is data, not markup; red-team audit)
            parsed = chat.parse_completion_ids(gen, codec, thinking=thinking)
            assistant = _to_assistant(parsed)
            chat.check_encodable(assistant, codec)  # (a JSON argument can spell what the codec cannot encode)
        except chat.ChatFormatError as e:
            fail(f"format: {e}")
            break
        action = Action(parsed["content"], assistant.tool_calls, parsed["reasoning"] or "")
        obs, reward, done, step_info = env.step(action)
        info = dict(step_info)
        messages.append(assistant)
        history.append(assistant)
        if done:
            break
        texts, unencodable = _encodable_results(obs.tool_results, action.tool_calls, codec)
        counts["tool_calls"] += len(action.tool_calls)
        for key in ("tool_errors", "tool_crashes", "tool_timeouts"):
            counts[key] += int(step_info.get(key, 0))
        counts["tool_errors"] += unencodable
        counts["tool_crashes"] += unencodable
        results = [chat.ToolResult(r) for r in texts]
        messages.extend(results)
        history.extend(results)
    if not done:
        fail(f"max_turns={max_turns} reached without a final answer")
    return Trajectory(messages=messages, history=history, reward=float(reward),
                      success=bool(info.get("success", False)) and "error" not in info, turns=turns, resets=resets,
                      segments=segments, completions=completions, info=info, peak_prompt_tokens=peak,
                      instance=env.instance, **counts)


def near_miss(call: ToolCall, rng: random.Random) -> ToolCall | None:
    """`call` with its first string argument of >= 2 characters changed by one edit (two neighbours swapped, one
    character dropped or one doubled): the mistakes a small model makes when it copies a key. None when the call
    has no such argument."""
    for name, value in call.arguments.items():
        if isinstance(value, str) and len(value) >= 2:
            i = rng.randrange(len(value) - 1)
            edits = {value[:i] + value[i + 1] + value[i] + value[i + 2:], value[:i] + value[i + 1:],
                     value[:i + 1] + value[i] + value[i + 1:]} - {value}
            return ToolCall(call.name, {**call.arguments, name: rng.choice(sorted(edits))})
    return None


def recovery_demonstration(env: Env, seed: int, codec: chat.Codec, rng: random.Random,
                           **episode_kwargs: Any) -> Trajectory | None:
    """A demonstration that first repeats the oracle's first call with a near-miss argument (:func:`near_miss`),
    gets the tool's error, then follows the oracle to the answer. The wrong call's tokens get loss mask 0, so SFT on
    it teaches the recovery (reading an error result and calling again), not the mistake. None when the oracle's
    first turn has no call with a string argument, the near miss does not produce an error result (e.g. it names
    another valid key) or the longer episode does not succeed (the env's max_steps)."""
    actions = env.demonstration(seed)
    if not actions or not actions[0].tool_calls:
        return None
    wrong = near_miss(actions[0].tool_calls[0], rng)
    if wrong is None:
        return None
    thinking = episode_kwargs.get("thinking", True)
    script = [Action(tool_calls=[wrong], reasoning=actions[0].reasoning)] + list(actions)
    t = run_episode(env, seed, ScriptedPolicy(codec, script, thinking), codec, **episode_kwargs)
    results = [m for m in t.history if isinstance(m, chat.ToolResult)]
    if not t.success or not results or not results[0].content.startswith("error"):
        return None
    first = t.completions[0]
    seg = t.segments[first.segment]
    seg.loss_mask[first.start:first.start + first.length] = [0] * first.length
    return t
