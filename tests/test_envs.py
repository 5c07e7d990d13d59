"""Tool environments (dsv32_jax/posttrain/envs): schema validation, episodes, verifiers, oracle demonstrations, chance rates,
the calculator's parser against Python, trip generation and partial credit, truncation and the character set."""

import json
import random
import re

import numpy as np
import pytest

from dsv32_jax.posttrain.envs import (CHARSET, ENVS, Action, Env, Tool, ToolCall, ToolError, in_charset, make_env,
                            validate_arguments)
from dsv32_jax.posttrain.envs.calculator import MAX_EXPR_CHARS, evaluate
from dsv32_jax.posttrain.envs.trip import feasible_plans, render_plan, score_plan, solve_trip

NAMES = sorted(ENVS)
SCHEMA = {"type": "object", "properties": {"key": {"type": "string"}, "n": {"type": "integer"},
                                           "x": {"type": "number"}, "flag": {"type": "boolean"},
                                           "ids": {"type": "array", "items": {"type": "integer"}}},
          "required": ["key", "n"]}


def replay(env, seed, actions):
    """Run `actions` from reset(seed); -> (reward, info, every tool result string)."""
    env.reset(seed)
    results, reward, info = [], 0.0, {}
    for action in actions:
        obs, reward, done, info = env.step(action)
        results.extend(obs.tool_results)
        if done:
            break
    return reward, info, results


# --- Tool and schema validation ---

@pytest.mark.parametrize("arguments, error", [
    ({"n": 1}, 'missing argument "key"'),
    ({"key": "a"}, 'missing argument "n"'),
    ({"key": "a", "n": 1, "zz": 2}, 'unknown argument "zz"'),
    ({"key": 3, "n": 1}, 'argument "key" must be string'),
    ({"key": "a", "n": 1.5}, 'argument "n" must be integer'),
    ({"key": "a", "n": True}, 'argument "n" must be integer'),  # bool is not a JSON integer
    ({"key": "a", "n": 1, "x": "1"}, 'argument "x" must be number'),
    ({"key": "a", "n": 1, "flag": 1}, 'argument "flag" must be boolean'),
    ({"key": "a", "n": 1, "ids": 3}, 'argument "ids" must be array'),
    ({"key": "a", "n": 1, "ids": [1, "2"]}, 'argument "ids" must be an array of integer'),
    (["key"], "arguments must be an object"),
])
def test_schema_validation_errors(arguments, error):
    assert validate_arguments(SCHEMA, arguments) == error
    tool = Tool("t", "test tool", SCHEMA, lambda **kw: kw)
    assert tool.call(arguments) == f"error: {error}"


def test_tool_call_valid_and_tool_errors():
    def f(key, n, x=0.0, flag=False, ids=()):
        if n < 0:
            raise ToolError("n must be >= 0")
        return {"key": key, "total": n + x + sum(ids), "flag": flag}

    tool = Tool("t", "test tool", SCHEMA, f)
    assert validate_arguments(SCHEMA, {"key": "a", "n": 1, "x": 2, "flag": True, "ids": [3]}) is None
    assert tool.call({"key": "a", "n": 1, "x": 2.5, "ids": [3]}) == '{"key":"a","total":6.5,"flag":false}'
    assert tool.call({"key": "a", "n": -1}) == "error: n must be >= 0"
    assert tool.signature() == "t(key:string,n:integer,x:number,flag:boolean,ids:array)"


@pytest.mark.parametrize("schema, field", [
    ({"type": "array"}, "parameters.type"),
    ({"type": "object", "properties": {"a": {"type": "float"}}}, "parameters.properties.a.type"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "array"}}}}, "items.type"),
    ({"type": "object", "properties": {}, "required": ["a"]}, "parameters.required"),
])
def test_bad_schema_names_the_field(schema, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        Tool("t", "test tool", schema, lambda: "")


def test_registry():
    assert NAMES == ["calculator", "lookup", "trip"]
    assert {make_env(n).domain for n in NAMES} == {"search", "code", "general"}
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        make_env("nope")
    with pytest.raises(ValueError, match="max_steps"):
        make_env("lookup", max_steps=0)


def test_envs_import_neither_jax_nor_numpy():
    import ast
    import os

    import dsv32_jax.posttrain.envs as envs
    folder = os.path.dirname(envs.__file__)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                tree = ast.parse(f.read())
            roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            heavy = roots & {"jax", "numpy", "flax"}
            assert not heavy, f"envs/{name} imports {sorted(heavy)}"


# --- episodes ---

@pytest.mark.parametrize("name", NAMES)
def test_reset_deterministic_and_varies_with_seed(name):
    a, b = make_env(name), make_env(name)
    for seed in range(20):
        oa, ob = a.reset(seed), b.reset(seed)
        assert oa == ob and a.instance == b.instance and a.demonstration(seed) == b.demonstration(seed)
        assert oa.task and oa.system and oa.tool_results == ()
    assert len({a.reset(seed).task for seed in range(50)}) >= 45
    assert len({repr(a.generate(seed)) for seed in range(50)}) == 50


@pytest.mark.parametrize("name", NAMES)
def test_demonstration_solves_50_seeds(name):
    env = make_env(name)
    for seed in range(50):
        actions = env.demonstration(seed)
        assert actions[-1].tool_calls == [] and all(a.tool_calls for a in actions[:-1])
        reward, info, results = replay(env, seed, actions)
        assert reward == 1.0 and info["success"] and not info["truncated"], (seed, info)
        assert info["steps"] == len(actions) - 1 and not any(r.startswith("error") for r in results)
        # the same trajectory as plain dicts (the form a model's parsed output takes)
        assert replay(env, seed, [a.to_dict() for a in actions])[0] == 1.0


@pytest.mark.parametrize("name", NAMES)
def test_wrong_answers_score_below_one(name):
    env = make_env(name)
    for seed in range(30):
        env.reset(seed)
        right = env.demonstration(seed)[-1].content
        assert env.verify(right) == 1.0
        wrong = [right + "1", "", "abc", right[:-1]]
        if name == "trip":
            plan = json.loads(right)["plan"]
            wrong += [json.dumps({"plan": plan[::-1]}), json.dumps({"plan": plan[:-1]}),
                      json.dumps({"plan": [dict(e, nights=e["nights"] + 1) for e in plan]})]
        for w in wrong:
            assert env.verify(w) < 1.0, (seed, w)
            env.reset(seed)
            _, reward, done, info = env.step({"content": w})
            assert done and reward < 1.0 and not info["success"]
            env.reset(seed)


def test_tool_turn_observation_and_errors():
    env = make_env("lookup")
    env.reset(3)
    key = env.instance.asked[0]
    obs, reward, done, info = env.step({"tool_calls": [{"name": "get", "arguments": {"key": key}},
                                                       {"name": "get", "arguments": {"key": "zz9"}},
                                                       {"name": "get", "arguments": {}},
                                                       {"name": "fly", "arguments": {}},
                                                       {"name": "get", "arguments": "notadict"}, "garbage"]})
    assert obs.tool_results == (str(env.instance.table[key]), 'error: no key "zz9"', 'error: missing argument "key"',
                                'error: unknown tool "fly"', "error: arguments must be an object",
                                'error: unknown tool ""')
    assert (reward, done, info) == (0.0, False, {"success": False, "steps": 1, "truncated": False, "tool_errors": 5,
                                                 "tool_crashes": 0, "tool_timeouts": 0})
    obs, reward, done, info = env.step(Action(content=str(env.instance.answer), reasoning="ignored"))
    assert (reward, done, info["success"], info["steps"]) == (1.0, True, True, 1)
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step({"content": "1"})


@pytest.mark.parametrize("name", NAMES)
def test_max_steps_truncates(name):
    env = make_env(name, max_steps=2)
    env.reset(0)
    call = ToolCall(env.tools[0].name, {})
    for step in (1, 2):
        _, reward, done, info = env.step(Action(tool_calls=[call]))
        assert not done and info["steps"] == step
    obs, reward, done, info = env.step(Action(tool_calls=[call]))
    assert done and reward == 0.0 and info["truncated"] and not info["success"] and obs.tool_results == ()


def test_calculator_demo_fits_default_max_steps_and_needs_several_calls():
    env = make_env("calculator", max_ops_per_call=1)
    turns = [len(env.demonstration(seed)) - 1 for seed in range(200)]
    assert min(turns) == 2 and max(turns) == 3 <= env.max_steps
    for seed in range(50):  # one operation per call is enough for the oracle
        assert replay(env, seed, env.demonstration(seed))[0] == 1.0
    env.reset(0)
    assert env.call_tool(ToolCall("calc", {"expr": "1+2*3"})) == "error: at most 1 operation per call"
    words = [make_env("calculator").render_task(make_env("calculator").generate(s)) for s in range(40)]
    assert any(w.startswith("start with") for w in words) and any(w.startswith("compute") for w in words)


def test_calculator_operation_count_is_configurable():
    env = make_env("calculator", min_ops=2, max_ops=2, words_fraction=0.0, max_digits=2)
    turns = {len(env.demonstration(seed)) - 1 for seed in range(100)}
    assert turns == {2}  # two operations: the inner one, then the outer one on its result
    assert all(replay(env, seed, env.demonstration(seed))[0] == 1.0 for seed in range(30))
    with pytest.raises(ValueError, match="min_ops"):
        make_env("calculator", min_ops=3, max_ops=2)


def test_lookup_key_letters_are_configurable():
    """key_letters: every key of every table is made of those letters only (the default: all 26), the oracle still
    solves the task, and a bad alphabet is refused naming the field."""
    env = make_env("lookup", key_letters="djkmqrvwxyz")
    keys = {k for seed in range(50) for k in env.generate(seed).table}
    assert set("".join(keys)) == set("djkmqrvwxyz") and all(2 <= len(k) <= 3 for k in keys)
    assert all(replay(env, seed, env.demonstration(seed))[0] == 1.0 for seed in range(20))
    assert len(set("".join(k for s in range(50) for k in make_env("lookup").generate(s).table))) == 26
    for bad in ("ab", "abC", "ab1"):
        with pytest.raises(ValueError, match="key_letters"):
            make_env("lookup", key_letters=bad)


# --- chance success without tools ---
# Each bound is several standard deviations above the rate a guesser can reach, and far below the oracle's 1.0:
# lookup: a uniform guess in the value range succeeds with p = 1/100 (one key) or 1/199 (a sum), mean ~0.0075 over
# 200 seeds (sd ~0.006), bound 0.04. calculator: a uniform guess in [-1000, 1000] hits with p <= 1/2001, bound 0.02.
# trip: hotel names are unknown without the tools (a 2-letter guess hits a real one with p ~ 3/676 per leg), bound
# 0.02; even a guesser who knows the names and picks hotels at random is capped by generation at 1/3 of the plans
# per instance (measured ~0.14), bound 0.25.

def test_lookup_chance():
    env, rng, wins = make_env("lookup"), random.Random(0), 0
    for seed in range(200):
        env.reset(seed)
        wins += env.verify(str(rng.randint(0, 99 * len(env.instance.asked))))
    assert wins / 200 < 0.04


def test_calculator_chance():
    env, rng, wins = make_env("calculator"), random.Random(0), 0
    for seed in range(200):
        env.reset(seed)
        wins += env.verify(str(rng.randint(-1000, 1000)))
    assert wins / 200 < 0.02


def test_trip_chance():
    env, rng = make_env("trip"), random.Random(0)
    guessed = known = 0
    for seed in range(200):
        env.reset(seed)
        inst = env.instance
        guess = [{"city": c, "hotel": rng.choice("abcdefghijklmnopqrstuvwxyz") + rng.choice("aeiou"), "nights": n}
                 for c, n in inst.legs]
        guessed += env.verify(json.dumps({"plan": guess})) == 1.0
        known += env.verify(render_plan(inst, [rng.choice(inst.hotels_in(c)) for c, _ in inst.legs])) == 1.0
    assert guessed / 200 < 0.02
    assert 0.0 < known / 200 < 0.25


# --- calculator parser ---

def _random_expression(rng: random.Random, depth: int = 0) -> str:
    if depth > 2 or rng.random() < 0.3:
        text = str(rng.randint(0, 999))
    else:
        text = (_random_expression(rng, depth + 1) + rng.choice(["+", "-", "*", "/", " + ", " / "])
                + _random_expression(rng, depth + 1))
        if rng.random() < 0.5:
            text = f"({text})"
    return ("-" if rng.random() < 0.15 else "") + text


def test_parser_matches_python_floor_division(seed):
    rng, checked, zero = random.Random(seed), 0, 0
    while checked < 500:
        text = _random_expression(rng)
        if len(text) > MAX_EXPR_CHARS:
            continue
        checked += 1
        try:
            expected = eval(text.replace("/", "//"))  # test-only oracle; the parser never evals
        except ZeroDivisionError:
            zero += 1
            with pytest.raises(ToolError, match="division by zero"):
                evaluate(text)
            continue
        assert evaluate(text) == expected, text
    assert checked - zero > 400


@pytest.mark.parametrize("text, error", [
    ("1+", "unexpected end"), ("(1+2", "unexpected end"), ("1+2)", 'unexpected ")" at 3'), ("2**3", 'unexpected "*"'),
    ("1.5", 'unexpected "." at 1'), ("x+1", 'unexpected "x" at 0'), ("", "unexpected end"), ("7/0", "division by zero"),
    ("1" * 65, "longer than 64"), ("999999999*999999999", "result beyond"), ("__import__('os')", 'unexpected "_"'),
])
def test_parser_errors(text, error):
    with pytest.raises(ToolError, match=re.escape(error)):
        evaluate(text)
    env = make_env("calculator")
    env.reset(0)
    result = env.call_tool(ToolCall("calc", {"expr": text}))
    assert result.startswith("error: ") and in_charset(result)


def test_parser_semantics():
    assert [evaluate(t) for t in ("-7/2", "7/-2", "2+3*4", "(2+3)*4", "--3", "10-2-3", "100/7/2", " 1 + 2 ")] == \
        [-4, -4, 14, 20, 3, 5, 7, 3]


# --- trip ---

def test_trip_every_instance_solvable_and_not_trivial():
    env = make_env("trip")
    for seed in range(300):
        inst = env.generate(seed)
        plans = feasible_plans(inst)
        total = 1
        for c, _ in inst.legs:
            total *= len(inst.hotels_in(c))
        assert plans and solve_trip(inst) in plans and len(plans) <= total / 3
        assert 3 <= len(inst.cities) <= 4 and 2 <= len(inst.legs) <= 3
        assert all(2 <= len(inst.hotels_in(c)) <= 3 for c in inst.cities)
        assert len({h.name for h in inst.hotels}) == len(inst.hotels)


def test_trip_partial_credit():
    inst = make_env("trip").generate(7)
    best = solve_trip(inst)
    n = len(inst.legs)
    total = 4 * n + 2  # per leg: city, nights, hotel in city, rating; then legs and budget
    assert score_plan(inst, render_plan(inst, best)) == (1.0, score_plan(inst, render_plan(inst, best))[1])
    plan = json.loads(render_plan(inst, best))["plan"]

    def score(p):
        return score_plan(inst, json.dumps({"plan": p}))

    # an unknown hotel on leg 0: that leg's hotel and rating checks fail, and the budget cannot be computed
    reward, info = score([dict(plan[0], hotel="zz9")] + plan[1:])
    assert reward == (total - 3) / total and not info["checks"]["budget"] and info["cost"] is None
    # a hotel from another city on leg 0
    other = next(h for h in inst.hotels if h.city != inst.legs[0][0])
    assert not score([dict(plan[0], hotel=other.name)] + plan[1:])[1]["checks"]["hotel_0"]
    # a hotel below the minimum rating, if the city has one
    low = [h for h in inst.hotels_in(inst.legs[0][0]) if h.rating < inst.min_rating]
    if low:
        assert not score([dict(plan[0], hotel=low[0].name)] + plan[1:])[1]["checks"]["rating_0"]
    # over budget: the dearest hotel everywhere, with the rating relaxed, exceeds the budget
    relaxed = type(inst)(inst.cities, inst.hotels, inst.legs, inst.budget, 1)
    dearest = [max(inst.hotels_in(c), key=lambda h: h.price) for c, _ in inst.legs]
    reward, info = score_plan(relaxed, render_plan(relaxed, dearest))
    assert info["cost"] > inst.budget and not info["checks"]["budget"] and reward == (total - 1) / total
    # a missing leg; wrong nights (the cost is the asked trip's, so nights cannot buy the budget)
    assert score(plan[:-1])[0] < 1.0 and not score(plan[:-1])[1]["checks"]["legs"]
    reward, info = score([dict(e, nights=0) for e in plan])
    assert reward == (total - n) / total and info["checks"]["budget"]
    # not a plan at all
    for bad in ("{", "[]", '{"plan":3}', '{"plan":[{"city":"a","hotel":"b"}]}', '{"plan":[{"city":"a","hotel":"b",'
                                                                                '"nights":true}]}'):
        reward, info = score_plan(inst, bad)
        assert reward == 0.0 and info["reason"], bad


def test_trip_name_letters_are_configurable():
    """name_letters: every city and hotel name is made of those letters (default all 26), the oracle still solves
    every task, and an alphabet too small for the hotel names (or not lowercase letters) is refused naming it."""
    env = make_env("trip", name_letters="djkmqrvwxyz", legs=(2, 2))
    insts = [env.generate(seed) for seed in range(50)]
    names = [n for i in insts for n in i.cities + tuple(h.name for h in i.hotels)]
    assert set("".join(names)) == set("djkmqrvwxyz") and all(len(i.legs) == 2 for i in insts)
    assert all(replay(env, seed, env.demonstration(seed))[0] == 1.0 for seed in range(20))
    assert len(set("".join(h.name for s in range(50) for h in make_env("trip").generate(s).hotels))) == 26
    for bad in ("ab", "abC", "ab1", "abc"):  # "abc": 9 two-letter names < 4 cities x 3 hotels
        with pytest.raises(ValueError, match="name_letters"):
            make_env("trip", name_letters=bad)
    # quote=True: the same instances and demonstrations, every city quoted in the task
    quoted = make_env("trip", name_letters="djkmqrvwxyz", legs=(2, 2), quote=True)
    for seed in range(10):
        inst = quoted.generate(seed)
        assert inst == insts[seed] and quoted.demonstration(seed) == env.demonstration(seed)
        task = quoted.render_task(inst)
        assert all(f'"{city}" for {n} night' in task for city, n in inst.legs), task
        assert task.replace('"', "") == env.render_task(inst)


def test_calculator_quote_renders_the_expression_as_the_call_does():
    """quote=True: the task quotes the expression, so a BPE splits it exactly as the first tool call's argument
    (unquoted, the space merges into the first digit where the BPE has that merge: " 2", " 5", not " 6"); the answer
    and the demonstration are unchanged."""
    from dsv32_jax.posttrain.chat import load_tokenizer

    codec = load_tokenizer()
    plain = make_env("calculator", words_fraction=0.0, max_digits=2, min_ops=1, max_ops=1)
    quoted = make_env("calculator", words_fraction=0.0, max_digits=2, min_ops=1, max_ops=1, quote=True)
    same = 0
    for seed in range(30):
        expr = plain.demonstration(seed)[0].tool_calls[0].arguments["expr"]
        assert quoted.generate(seed) == plain.generate(seed)
        assert quoted.demonstration(seed) == plain.demonstration(seed)
        assert quoted.render_task(quoted.generate(seed)) == f'compute "{expr}"'
        call = codec.encode(expr)
        task_q, task_p = codec.encode(f'compute "{expr}"'), codec.encode(f"compute {expr}")
        assert task_q[-len(call) - 1:-1] == call  # the call's tokens, verbatim, before the closing quote
        same += task_p[-len(call):] == call
        assert replay(quoted, seed, quoted.demonstration(seed))[0] == 1.0
    assert same < 25  # unquoted, the first digit is another token (" 2" vs "2") in about half the tasks


# --- character set ---

def test_every_string_stays_in_charset():
    assert len(set(CHARSET)) == len(CHARSET) and "\n" not in CHARSET and "'" not in CHARSET
    rng = random.Random(0)
    for name in NAMES:
        env = make_env(name)
        texts = [env.system_prompt()]
        for seed in range(200):
            obs = env.reset(seed)
            texts += [obs.task, obs.system]
            actions = env.demonstration(seed)
            for a in actions:
                texts += [a.content, a.reasoning] + [json.dumps(c.to_dict(), separators=(",", ":"))
                                                     for c in a.tool_calls]
            texts += replay(env, seed, actions)[2]
            # tool errors from hostile arguments echo only sanitized text
            env.reset(seed)
            for tool in env.tools:
                hostile = "Ab'?\n" + chr(rng.randint(128, 5000))
                texts.append(tool.call({k: hostile for k in tool.parameters["required"]}))
                texts.append(tool.call({"Bad'Key": 1}))
            texts.append(env.call_tool({"name": "Ünknown'", "arguments": {}}))
        bad = [t for t in texts if not in_charset(t)]
        assert not bad, f"{name}: {bad[:3]}"


# --- tool failures are results, not exceptions (issue #32) ---

NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def _tool(function, name="t"):
    return Tool(name, "test tool", NAME_SCHEMA, function)


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message")


class _UnprintableToolError(ToolError):
    def __str__(self):
        raise RuntimeError("no message")


def _raise(e):
    raise e


@pytest.mark.parametrize("function, status, text", [
    (lambda name: 1 // 0, "crash", 'error: tool "t" failed: ZeroDivisionError: integer division or modulo by zero'),
    (lambda name: {"a"}, "crash", 'error: tool "t" returned a set that JSON cannot encode (Object of type set is not '
                                  'JSON serializable)'),
    (lambda name: [float("nan")], "crash", 'error: tool "t" returned a list that JSON cannot encode (Out of range '
                                           'float values are not JSON compliant'),
    (lambda name: object(), "crash", 'error: tool "t" returned a object that JSON cannot encode'),
    (lambda name: {}["k" + name], "crash", "error: tool \"t\" failed: KeyError: 'ka'"),
    (lambda name: exit(3), "crash", 'error: tool "t" failed: SystemExit: 3'),
    (lambda name: _raise(_Unprintable()), "crash", 'error: tool "t" failed: _Unprintable: (a _Unprintable whose '
                                                    "message cannot be printed)"),
    (lambda name: _raise(_UnprintableToolError()), "error", "error: (a _UnprintableToolError whose message cannot"),
    (lambda name: "x" * 500, "ok", "x" * 500),
    (lambda name: {"n": name}, "ok", '{"n":"a"}'),
])
def test_any_tool_failure_is_an_error_result(function, status, text):
    """Mutation tried: catching only ToolError (the old Tool.call) raises ZeroDivisionError / TypeError here; str(e)
    in place of `_message(e)` raises the exception's own __str__ error out of the tool."""
    out = _tool(function).run({"name": "a"})
    assert out.status == status and out.text.startswith(text), out
    assert _tool(function).call({"name": "a"}) == out.text


class _BrokenEnv(Env):
    """Hooks set after super().__init__() (tools are built lazily); tools that crash, return sets and hang."""
    name = "broken"

    def __init__(self, gate=None, tool_timeout=10.0):
        super().__init__(max_steps=8)
        self.gate, self.tool_timeout, self.started = gate, tool_timeout, 0

    def generate(self, seed):
        return seed

    def make_tools(self):
        def hang(name):
            self.started += 1
            self.gate.wait(30)
            return "late"
        return [_tool(lambda name: 1 // 0, "div"), _tool(lambda name: {name}, "setty"), _tool(hang, "hang"),
                _tool(lambda name: name, "echo")]

    def render_task(self, instance):
        return f"task {instance}"

    def score(self, instance, answer):
        return float(answer == str(instance)), {}

    def solve(self, instance):
        return [Action(content=str(instance))]


def _calls(*names):
    return {"tool_calls": [{"name": n, "arguments": {"name": "a"}} for n in names]}


def test_step_counts_tool_failures_and_never_raises():
    env = _BrokenEnv(tool_timeout=None)
    env.reset(3)
    obs, reward, done, info = env.step(_calls("div", "setty", "echo", "nope"))
    assert obs.tool_results[2] == "a" and not done
    assert obs.tool_results[0].startswith('error: tool "div" failed: ZeroDivisionError')
    assert obs.tool_results[1].startswith('error: tool "setty" returned a set')
    assert (info["tool_errors"], info["tool_crashes"], info["tool_timeouts"]) == (3, 2, 0)
    assert env.step({"content": "3"})[1] == 1.0


def test_a_tool_past_its_deadline_is_a_timeout_and_leaves_at_most_one_thread():
    """Deterministic: the hanging tool waits on an event the test sets only after the checks. While the timed-out call
    runs, further calls are refused (no second thread starts); once it ends, calls run again.
    Mutation tried: joining without a deadline hangs (the test's 30 s gate); starting a worker per call while one
    still runs fails `started == 1`."""
    import threading

    gate = threading.Event()
    env = _BrokenEnv(gate, tool_timeout=0.05)
    env.reset(0)
    obs, _, _, info = env.step(_calls("hang"))
    assert obs.tool_results == ('error: tool "hang" timed out after 0.05 s',)
    assert (info["tool_errors"], info["tool_timeouts"]) == (1, 1)
    obs, _, _, info = env.step(_calls("echo", "hang"))
    assert obs.tool_results == ('error: tool "echo" not run: an earlier call timed out and is still running',
                                'error: tool "hang" not run: an earlier call timed out and is still running')
    assert env.started == 1 and info["tool_timeouts"] == 2
    gate.set()
    env._runaway.join(5)
    assert not env._runaway.is_alive()
    assert env.step(_calls("echo"))[0].tool_results == ("a",)


def test_hooks_are_public_and_tools_are_built_on_first_use():
    """The constructor-order trap is gone: `_BrokenEnv` sets its fields after `super().__init__()` and a subclass
    that never calls it works with the class defaults."""
    class NoInit(_BrokenEnv):
        def __init__(self):
            self.gate = None

    env = NoInit()
    assert env.max_steps == 4 and env.tool_timeout == 10.0
    assert [t.name for t in env.tools] == ["div", "setty", "hang", "echo"]
    assert env.tools is env.tools  # built once
    env.reset(5)
    assert env.render_task(env.instance) == "task 5" and env.verify("5") == 1.0

    class Bad(_BrokenEnv):
        def make_tools(self):
            return [_tool(str, "a"), {"name": "b"}]
    with pytest.raises(TypeError, match=r"Bad.make_tools\(\)\[1\]: expected a dsv32_jax.posttrain.envs.Tool, got dict"):
        Bad().tools


def test_hooks_with_the_wrong_signature_fail_when_the_class_is_defined():
    """The earlier hooks (private `_make_tools`, `score(answer)`) name the hook and its new signature at class
    definition. Mutation tried: without `Env.__init_subclass__` both classes define and fail only mid-episode."""
    with pytest.raises(TypeError, match=r"Old._make_tools: the hook is public now; rename it make_tools\(self\)"):
        class Old(Env):
            def _make_tools(self):
                return []
    with pytest.raises(TypeError, match=r"Old.score\(self, answer\): the hook is called as score\(self, instance, "
                                        r"answer\)"):
        class Old(Env):  # noqa: F811
            def score(self, answer):
                return 0.0, {}


def test_one_set_of_tool_call_types_and_the_helpers_are_exported():
    from dsv32_jax.posttrain import chat, envs

    assert envs.ToolCall is chat.ToolCall
    assert issubclass(envs.Tool, chat.Tool) and chat.as_tool(make_env("lookup").tools[0]).name == "get"
    for name in ("integer_score", "parse_integer", "compact_json", "unique_names", "sanitize", "register",
                 "ToolOutput", "check_schema"):
        assert name in envs.__all__ and hasattr(envs, name), name
    with pytest.raises(ValueError, match="function must be callable"):
        Tool("t", "d", NAME_SCHEMA)


def test_register_import_path_and_instances(tmp_path, monkeypatch):
    """Mutation tried: `make_env` without the import-path branch fails with "unknown environment"."""
    from dsv32_jax.posttrain.envs import registry

    monkeypatch.setattr(registry, "ENVS", dict(registry.ENVS))
    (tmp_path / "my_env_pkg.py").write_text(
        "from dsv32_jax.posttrain.envs import LookupEnv\n\nclass MyEnv(LookupEnv):\n    name = 'mine'\n\n"
        "def not_an_env():\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("my_env_pkg:MyEnv", max_steps=2)
    assert type(env).__name__ == "MyEnv" and env.max_steps == 2
    assert make_env(env) is env
    with pytest.raises(ValueError, match="got an Env instance"):
        make_env(env, max_steps=3)
    with pytest.raises(ValueError, match=r"environment 'nope_pkg:X': cannot import module 'nope_pkg'"):
        make_env("nope_pkg:X")
    with pytest.raises(ValueError, match=r"module 'my_env_pkg' has no callable 'Missing'"):
        make_env("my_env_pkg:Missing")
    with pytest.raises(TypeError, match="built a int, not a dsv32_jax.posttrain.envs.Env"):
        make_env("my_env_pkg:not_an_env")
    registry.register("mine", type(env))
    assert type(make_env("mine")) is type(env)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("mine", make_env)
    with pytest.raises(ValueError, match="without ':'"):
        registry.register("a:b", make_env)


@pytest.mark.parametrize("returned", [float("nan"), float("inf"), -float("inf"), None, "high"])
def test_a_non_finite_verifier_reward_is_zero_and_reported(returned):
    """A verifier's nan passed the [0, 1] clamp (max(nan, 0) is nan) and made its whole group's advantages, the GRPO
    loss and every gradient nan; what the environment returns is data: reward 0, the reason in info."""

    class Odd(_BrokenEnv):
        def score(self, instance, answer):
            return returned, {"why": "0 / 0"}

    env = Odd(tool_timeout=None)
    env.reset(3)
    _, reward, done, info = env.step({"content": "3"})
    assert reward == 0.0 and done and not info["success"] and info["why"] == "0 / 0"
    assert info["reward_error"] == f"Odd.score() returned {returned!r}, not a finite number: reward 0"
    env.reset(3)
    assert env.verify("3") == 0.0


@pytest.mark.parametrize("returned,reward,details", [
    (0.5, 0.5, {}), ((1.0, None), 1.0, {}), ((0.25, ["why"]), 0.25, {"details_error": "Odd.score() returned details "
                                                                                     "['why'], not a dict: ignored"}),
    ((0.5, {}, "extra"), 0.0, {"reward_error": "Odd.score() returned (0.5, {}, 'extra'), not a finite number: "
                                               "reward 0"})])
def test_a_verifier_that_returns_another_shape_is_data(returned, reward, details):
    """score() must return (reward, details); a bare number or None details ended the rollout with "cannot unpack
    non-iterable float object" / "'NoneType' object is not iterable", naming neither score() nor the environment.
    Now a bare number is the reward, None details are none, other details are noted, another shape scores 0."""

    class Odd(_BrokenEnv):
        def score(self, instance, answer):
            return returned

    env = Odd(tool_timeout=None)
    env.reset(3)
    _, got, done, info = env.step({"content": "3"})
    assert got == reward and done and info["success"] == (reward == 1.0)
    assert {k: info[k] for k in details} == details
    assert not set(info) & ({"details_error", "reward_error"} - set(details))
    env.reset(3)
    assert env.verify("3") == reward  # (it returned score()'s raw value: the whole 3-tuple for the last case)


@pytest.mark.parametrize("returned,reward,error", [
    ("0.7", 0.0, "Odd.score() returned '0.7', not a finite number: reward 0"),
    (b"1", 0.0, "Odd.score() returned b'1', not a finite number: reward 0"),
    (5, 1.0, "Odd.score() returned 5, outside [0, 1]: clamped to 1, not a success"),
    (-0.5, 0.0, "Odd.score() returned -0.5, outside [0, 1]: clamped to 0, not a success"),
    (1.0000001, 1.0, "Odd.score() returned 1.0000001, outside [0, 1]: clamped to 1, not a success"),
    (True, 1.0, None), (np.float32(1.0), 1.0, None), (np.int64(0), 0.0, None), (0.25, 0.25, None)])
def test_a_verifier_reward_outside_the_contract_is_reported_and_no_success(returned, reward, error):
    """score()'s reward must be a number in [0, 1]. A string that float() reads ("0.7") was taken as the reward, and
    a 5 was clamped to 1 and counted as a success, both unreported: a broken verifier trained the policy as if it
    were right. Now a string scores 0 and an out-of-range number is clamped, each named in info["reward_error"],
    and neither is a success; a bool or a numpy scalar in range is a reward as before."""

    class Odd(_BrokenEnv):
        def score(self, instance, answer):
            return returned, {}

    env = Odd(tool_timeout=None)
    env.reset(3)
    _, got, done, info = env.step({"content": "3"})
    assert got == reward and type(got) is float and done
    assert info.get("reward_error") == error
    assert info["success"] == (error is None and reward == 1.0)
    env.reset(3)  # verify() checks as step() does (it returned "0.7", 5, b"1" as they came)
    got = env.verify("3")
    assert got == reward and type(got) is float


def test_a_verifier_past_its_deadline_scores_zero_and_one_that_raises_ends_the_episode():
    """score() had no deadline (only tools had): a verifier that hangs on a model's answer (a backtracking regex)
    held the rollout, and the training step, for ever. Past Env.score_timeout the answer scores 0, named in the
    info; score()'s own exception still reaches the caller (the environment's bug)."""
    import time

    class Slow(_BrokenEnv):
        score_timeout = 0.2

        def score(self, instance, answer):
            if answer == "boom":
                raise ZeroDivisionError("verifier bug")
            time.sleep(5 if answer == "hang" else 0)
            return 1.0, {}

    env = Slow(tool_timeout=None)
    env.reset(3)
    t0 = time.perf_counter()
    _, reward, done, info = env.step({"content": "hang"})
    assert time.perf_counter() - t0 < 2 and reward == 0.0 and done and not info["success"]
    assert info["reward_error"] == "Slow.score() ran past score_timeout=0.2 s: reward 0"
    env.reset(3)
    assert env.step({"content": "fine"})[1] == 1.0
    env.reset(3)
    assert env.verify("hang") == 0.0 and env.verify("fine") == 1.0
    with pytest.raises(ZeroDivisionError, match="verifier bug"):
        env.step({"content": "boom"})


def test_trip_verifier_answers_that_json_cannot_read_score_zero():
    """An integer of over 4300 digits makes json.loads raise a plain ValueError (not JSONDecodeError), deep nesting a
    RecursionError: model text, so a zero reward with the reason, never an exception out of the rollout."""
    inst = make_env("trip").generate(7)
    for answer in ("9" * 4400, '{"plan": [' + "9" * 4400 + "]}", "[" * 100_000, "{"):
        reward, info = score_plan(inst, answer)
        assert reward == 0.0 and info["reason"] == "answer is not json", (answer[:20], info)
