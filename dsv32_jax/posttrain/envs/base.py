"""Tool environments for agentic RL (paper section 3.2): each task is an environment, its tools, a task and a verifier.

An episode: `obs = env.reset(seed)` gives the system prompt and the task text (the user message). The agent then
answers with `Action`s. An action with tool calls runs each call and the next observation holds one result string
per call (reward 0, not done); an action without tool calls is the final answer: the verifier scores its content
(reward in [0, 1], done). More than `max_steps` tool turns end the episode with reward 0 (info["truncated"]).

Nothing a model can send makes `step` raise: a bad call, a tool's `ToolError`, any other exception of a tool, a
result JSON cannot encode and a call past the deadline all become `error: ...` results (tools.py), counted in the
step's info (`tool_errors`, `tool_crashes`, `tool_timeouts`). The deadline is `Env.tool_timeout` seconds (default
10; None: no deadline, the call runs inline): each call then runs in a daemon worker thread. Python cannot stop a
thread, so one that overruns is left to finish and the environment refuses further calls (as `timeout` errors)
until it has: at most one runaway thread per environment, never a pile of them. The verifier runs on the model's
answer under its own deadline, `Env.score_timeout` (default 60 s): past it the answer scores 0 (info
"reward_error"). A reward that is no finite number (a string among them) also scores 0, one outside [0, 1] is clamped
and is no success, each noted in "reward_error" (the agent stage's `reward_errors` metric counts them). A `score()`
that raises is the environment's bug and ends the rollout.

Writing an environment: docs/environments.md. What an environment returns is data to the chat encoding (plain text,
never special tokens). This module imports neither jax nor numpy.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import threading
from typing import Any, Mapping, Sequence

from dsv32_jax.posttrain.chat import ToolCall
from dsv32_jax.posttrain.envs.tools import Tool, ToolOutput, sanitize, tool_counts


def _within(timeout: float | None, fn, *args):
    """fn(*args), or TimeoutError once it has run `timeout` seconds (None: inline). Python cannot stop a thread: one
    that overruns is a daemon left to finish. fn's own exception is raised here."""
    if timeout is None:
        return fn(*args)
    box: dict[str, Any] = {}

    def run():
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller)
            box["err"] = e

    worker = threading.Thread(target=run, daemon=True, name=getattr(fn, "__qualname__", "fn"))
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise TimeoutError
    if "err" in box:
        raise box["err"]
    return box["out"]


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


def as_number(value: Any) -> float:
    """A hook's returned number as a float; nan for what is none: a string (even one float() reads: "0.7" from a
    verifier is a bug to report), a list, None."""
    if isinstance(value, (str, bytes)):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


class Env:
    """Base class of the tool environments (docs/environments.md). A subclass sets `name`, `domain` and
    `instructions` and implements the hooks `generate(seed)`, `make_tools()`, `render_task(instance)`,
    `score(instance, answer)` and `solve(instance)`; tool functions read the current episode's `self.instance`.

    `make_tools` is called once, on the first use of `tools` (not by the constructor), so a subclass may set its
    fields before or after `super().__init__()`, or not call it at all (the class attributes are the defaults)."""
    name: str = ""
    domain: str = ""  # the per-domain KL weight key
    instructions: str = ""  # the system prompt's first sentence(s): answer format
    max_steps: int = 4
    tool_timeout: float | None = 10.0  # seconds a tool call may run (None: no deadline, run inline)
    score_timeout: float | None = 60.0  # seconds the verifier may take on an answer (None: no deadline, run inline)
    instance: Any = None
    steps: int = 0
    done: bool = True

    #: hook name -> the arguments it is called with (besides self)
    HOOKS = {"generate": ("seed",), "make_tools": (), "render_task": ("instance",), "score": ("instance", "answer"),
             "solve": ("instance",), "language_consistency": ("instance", "text")}

    def __init_subclass__(cls, **kwargs):
        """A hook whose signature cannot take its arguments (e.g. the earlier `score(answer)`, or the private
        `_make_tools`) fails when the class is defined, naming the hook, instead of mid-episode."""
        super().__init_subclass__(**kwargs)
        if "_make_tools" in cls.__dict__:
            raise TypeError(f"{cls.__name__}._make_tools: the hook is public now; rename it make_tools(self)")
        for name, args in Env.HOOKS.items():
            fn = cls.__dict__.get(name)
            if fn is None:
                continue
            try:
                inspect.signature(fn).bind(None, *args)
            except TypeError:
                raise TypeError(f"{cls.__name__}.{name}{inspect.signature(fn)}: the hook is called as "
                                f"{name}(self{''.join(', ' + a for a in args)})") from None

    def __init__(self, max_steps: int = 4):
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an integer >= 1, got {max_steps!r}")
        self.max_steps = max_steps

    # --- subclass hooks ---
    def generate(self, seed: int) -> Any:
        """The task instance for `seed` (deterministic; no effect on the current episode)."""
        raise NotImplementedError(f"{type(self).__name__}.generate(seed)")

    def make_tools(self) -> list[Tool]:
        """The tools (called once, on the first use of `self.tools`); their functions read `self.instance`."""
        raise NotImplementedError(f"{type(self).__name__}.make_tools()")

    def render_task(self, instance: Any) -> str:
        """The task text (user message) of `instance`."""
        raise NotImplementedError(f"{type(self).__name__}.render_task(instance)")

    def score(self, instance: Any, answer: str) -> tuple[float, dict[str, Any]]:
        """Verifier: (reward in [0, 1], details) for the final answer `answer` to `instance`."""
        raise NotImplementedError(f"{type(self).__name__}.score(instance, answer)")

    def solve(self, instance: Any) -> list[Action]:
        """Oracle trajectory for `instance`: tool-call turns, then the final answer."""
        raise NotImplementedError(f"{type(self).__name__}.solve(instance)")

    def language_consistency(self, instance: Any, text: str) -> float | None:
        """Optional: the fraction of `text` (the model's reasoning and answers of one episode, one per line) in the
        language `instance` asks for, in [0, 1]: the paper's language-consistency reward, weighted by
        config.agent.language_weight. None (the default): this task has no language to check; the built-in tasks
        are all in one script (CHARSET)."""
        return None

    # --- tools ---
    @property
    def tools(self) -> list[Tool]:
        if self.__dict__.get("_tools") is None:
            tools = list(self.make_tools())
            for i, t in enumerate(tools):
                if not isinstance(t, Tool):
                    raise TypeError(f"{type(self).__name__}.make_tools()[{i}]: expected a dsv32_jax.posttrain.envs.Tool, got "
                                    f"{type(t).__name__}")
            names = [t.name for t in tools]
            if len(set(names)) != len(names):
                raise ValueError(f"{type(self).__name__}.make_tools(): duplicate tool names {names}")
            self._tools = tools
        return self._tools

    def run_tool(self, call: ToolCall | Mapping[str, Any]) -> ToolOutput:
        """Run one call (module docstring: statuses, deadline); never raises."""
        call = _coerce_call(call)
        tool = next((t for t in self.tools if t.name == call.name), None)
        if tool is None:
            return ToolOutput(f'error: unknown tool "{sanitize(call.name)}"', "error")
        if self.tool_timeout is None:
            return tool.run(call.arguments)
        runaway = self.__dict__.get("_runaway")
        if runaway is not None and runaway.is_alive():
            return ToolOutput(f'error: tool "{call.name}" not run: an earlier call timed out and is still running',
                              "timeout")
        box: dict[str, ToolOutput] = {}
        worker = threading.Thread(target=lambda: box.setdefault("out", tool.run(call.arguments)), daemon=True,
                                  name=f"{self.name or type(self).__name__}.{call.name}")
        worker.start()
        worker.join(self.tool_timeout)
        if worker.is_alive():
            self._runaway = worker
            return ToolOutput(f'error: tool "{call.name}" timed out after {self.tool_timeout:g} s', "timeout")
        return box.get("out", ToolOutput(f'error: tool "{call.name}" failed', "crash"))

    def call_tool(self, call: ToolCall | Mapping[str, Any]) -> str:
        """The result text of one call (`run_tool(call).text`)."""
        return self.run_tool(call).text

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
            outputs = [self.run_tool(c) for c in action.tool_calls]
            return (self._observation(tuple(o.text for o in outputs)), 0.0, False,
                    {"success": False, "steps": self.steps, "truncated": False, **tool_counts(outputs)})
        reward, details = self._verified(action.content)
        self.done = True
        success = reward == 1.0 and "reward_error" not in details
        return self._observation(), reward, True, {"success": success, "steps": self.steps, "truncated": False,
                                                   **details}

    def verify(self, answer: str) -> float:
        """The verifier's reward for `answer` to the current instance, checked as `step` checks it (no effect on the
        episode)."""
        if self.instance is None:
            raise RuntimeError(f"{self.name}: verify() before reset(seed)")
        return self._verified(answer)[0]

    def _verified(self, answer: str) -> tuple[float, dict[str, Any]]:
        """score()'s (reward, details) for `answer`, checked: under score_timeout, a reward that is no finite number
        scores 0 and one outside [0, 1] is clamped, each noted in details["reward_error"]. Never raises."""
        try:
            reward, details = self._scored(_within(self.score_timeout, self.score, self.instance, answer))
        except TimeoutError:  # (the model's answer drives the verifier: e.g. a regex that backtracks for ever)
            return 0.0, {"reward_error": f"{type(self).__name__}.score() ran past score_timeout="
                                         f"{self.score_timeout:g} s: reward 0"}
        value = as_number(reward)
        name = type(self).__name__
        if not math.isfinite(value):  # (max(nan, 0) is nan: one nan reward made its group's advantages and the loss nan)
            details["reward_error"] = f"{name}.score() returned {reward!r}, not a finite number: reward 0"
            value = 0.0
        elif not 0.0 <= value <= 1.0:  # (a 5 was clamped to 1 and counted as a success, unreported)
            details["reward_error"] = (f"{name}.score() returned {reward!r}, outside [0, 1]: clamped to "
                                       f"{min(max(value, 0.0), 1.0):g}, not a success")
        return min(max(value, 0.0), 1.0), details

    def _language(self, instance: Any, text: str) -> tuple[float, str | None]:
        """language_consistency()'s value for `text` (the model's own words: they drive it, as they drive the
        verifier), checked: (value, None) for a number in [0, 1]; (0.0, None) for None (no language to check);
        (0.0, the "reward_error" text) for anything else or past score_timeout. Its own exception is raised (the
        environment's bug, as score()'s)."""
        name = type(self).__name__
        try:
            got = _within(self.score_timeout, self.language_consistency, instance, text)
        except TimeoutError:
            return 0.0, f"{name}.language_consistency() ran past score_timeout={self.score_timeout:g} s: language reward 0"
        if got is None:
            return 0.0, None
        value = as_number(got)
        if not 0.0 <= value <= 1.0:  # (nan fails it too)
            return 0.0, f"{name}.language_consistency() returned {got!r}, not a number in [0, 1]: language reward 0"
        return value, None

    def _scored(self, out) -> tuple[Any, dict[str, Any]]:
        """score()'s (reward, details); a bare reward (a number: the likeliest slip) has no details, details that
        are no mapping are noted in `details_error`. Never raises: the reward is checked by `step`."""
        reward, details = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
        if details is None:
            return reward, {}
        if not isinstance(details, Mapping):
            return reward, {"details_error": f"{type(self).__name__}.score() returned details {details!r}, not a "
                                             "dict: ignored"}
        return reward, dict(details)

    def demonstration(self, seed: int) -> list[Action]:
        """Oracle trajectory for `seed`'s instance (for cold-start SFT); replay it after `reset(seed)`."""
        return self.solve(self.generate(seed))

    def _observation(self, results: Sequence[str] = ()) -> Observation:
        return Observation(self.system_prompt(), self.render_task(self.instance), tuple(results))
