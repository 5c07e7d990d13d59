"""Tool environments (dsv32_jax/posttrain/envs): checks added by mutation testing, each guarding a bug the rest of the
suite let through. Expected values come from the task text, the module docstrings or hand-worked arithmetic, never
from the code under test."""

import json
import re

import pytest

from dsv32_jax.posttrain.envs import Tool, ToolCall, make_env
from dsv32_jax.posttrain.envs.helpers import integer_score, parse_integer
from dsv32_jax.posttrain.envs.tools import sanitize

KEY_SCHEMA = {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}


# --- the integer verifier ---

@pytest.mark.parametrize("answer, value", [
    ("41", 41), (" -7 ", -7), ("0", 0),
    ("41 or 42", None), ("41abc", None), ("x41", None), ("41.0", None), ("4 1", None), ("", None),
    # (red-team audit: \d and \s took every Unicode digit and space, '8１' scored as 81)
    ("４２", None), ("٤٢", None), ("8１", None), ("\u00a042", None), ("42\n", 42),
])
def test_parse_integer_takes_only_an_integer(answer, value):
    """helpers.parse_integer: optional spaces around an optional '-' and digits, nothing else (docstring). Mutants
    guarded: `match` instead of `fullmatch` ("41 or 42" read as 41: a hedge scores 1.0) and a pattern that also
    takes a decimal tail ("41.0")."""
    assert parse_integer(answer) == value


def test_integer_score_needs_the_exact_value():
    """A negative answer is not its absolute value: calculator tasks have negative answers ("compute 3-10" is -7).
    Mutant guarded: comparing magnitudes."""
    assert integer_score("-7", -7)[0] == 1.0
    assert integer_score("7", -7)[0] == 0.0 and integer_score("-41", 41)[0] == 0.0


# --- lookup ---

def _asked_keys(task: str) -> list[str]:
    return re.findall(r'"([a-z]+)"', task)


def test_lookup_answer_is_the_sum_of_the_values_the_task_names():
    """Solved from the task text alone: the quoted keys, each looked up with the tool, summed (one key: its value).
    Mutants guarded: the answer of a sum task being the first key's value, and the task text quoting the first key
    twice (the second key then appears nowhere the model can read it)."""
    env = make_env("lookup")
    kinds = set()
    for seed in range(40):
        obs = env.reset(seed)
        keys = _asked_keys(obs.task)
        kinds.add(len(keys))
        assert len(set(keys)) == len(keys) and obs.task.startswith("find the")
        values = [int(env.call_tool(ToolCall("get", {"key": k}))) for k in keys]
        assert env.verify(str(sum(values))) == 1.0, (seed, obs.task)
        if len(keys) == 2:
            assert env.verify(str(values[0])) == 0.0 or values[1] == 0
    assert kinds == {1, 2}


def test_lookup_sum_fraction_and_value_range():
    """sum_fraction=0 gives single-key tasks only, 1 sums only (docstring: "one key's value or the sum of two");
    values are 0-99 and use that range; keys are 2-3 letters, both lengths occurring; a fraction outside [0, 1] is
    refused. Mutants guarded: the comparison inverted (invisible at the default 0.5), values drawn from 0-9, keys of
    2 letters only, a looser range check."""
    singles = [len(make_env("lookup", sum_fraction=0.0).generate(s).asked) for s in range(30)]
    sums = [len(make_env("lookup", sum_fraction=1.0).generate(s).asked) for s in range(30)]
    assert set(singles) == {1} and set(sums) == {2}
    tables = [make_env("lookup").generate(s).table for s in range(50)]
    values = [v for t in tables for v in t.values()]
    assert {len(k) for t in tables for k in t} == {2, 3}
    assert min(values) >= 0 and max(values) <= 99 and max(values) >= 90 and len(set(values)) > 50
    for bad in (-0.1, 1.5, 2.5):
        with pytest.raises(ValueError, match="sum_fraction"):
            make_env("lookup", sum_fraction=bad)


# --- tools ---

def test_tool_failure_text_is_bounded_and_names_are_identifiers():
    """A crashing tool's message is cut to 160 characters + "..." (a tool that raises with a huge message must not
    flood the context); tool names are lowercase identifiers (they are rendered into the system prompt, inside
    CHARSET); sanitize lowercases what it echoes. Mutants guarded: no cut, no name check, no lowercasing (a
    mistyped "QD" echoed as "__")."""
    def boom(key):
        raise RuntimeError("x" * 1000)

    text = Tool("boom", "raises", KEY_SCHEMA, boom).call({"key": "a"})
    assert text == 'error: tool "boom" failed: RuntimeError: ' + "x" * 160 + "..."
    for bad in ("Get", "get-key", "1get", ""):
        with pytest.raises(ValueError, match="lowercase identifier"):
            Tool(bad, "", KEY_SCHEMA, lambda key: key)
    assert sanitize("QD") == "qd" and sanitize("A'b\n") == "a_b_"


# --- calculator ---

_OPS = {"add": lambda a, b: a + b, "subtract": lambda a, b: a - b, "multiply by": lambda a, b: a * b,
        "divide by": lambda a, b: a // b}


def _solve_words(task: str) -> int:
    """'start with 17, multiply by 23, then add 45' -> ((17 * 23) + 45), '/' as floor division (the env's rule)."""
    head, *steps = task.split(", ")
    value = int(head.removeprefix("start with "))
    for step in steps:
        op, number = step.removeprefix("then ").rsplit(" ", 1)
        value = _OPS[op](value, int(number))
    return value


def test_calculator_tasks_solved_from_their_text():
    """Every task read as a person would: a chain in words computed step by step, an expression evaluated by
    Python with // (test-only oracle, as in test_envs.py); the verifier takes exactly that value. Mutants guarded:
    "/" worded as "multiply by", and a chain naming the wrong operand at its first step."""
    env = make_env("calculator")
    kinds = set()
    for seed in range(60):
        task = env.reset(seed).task
        if task.startswith("start with "):
            kinds.add("words")
            value = _solve_words(task)
        else:
            kinds.add("expr")
            value = eval(task.removeprefix("compute ").replace("/", "//"))  # noqa: S307 (test-only oracle)
        assert env.verify(str(value)) == 1.0, (seed, task, value)
    assert kinds == {"words", "expr"}


def test_calculator_limits_hold_for_negative_results_and_odd_digits():
    """The 10**15 magnitude limit is on |result| (docstring: "a result beyond 10**15 is an error"), and only ASCII
    digits are numbers ("²" is a bad character, an error result, not a crash). Mutants guarded: `out >
    MAX_MAGNITUDE` (a huge negative passes) and the character filter without `isascii`."""
    from dsv32_jax.posttrain.envs import ToolError
    from dsv32_jax.posttrain.envs.calculator import evaluate

    with pytest.raises(ToolError, match="result beyond"):
        evaluate("0-999999999999999-999999999999999")  # -(2 * 10**15 - 2); each step alone fits
    with pytest.raises(ToolError, match='unexpected "_" at 0'):
        evaluate("²")
    env = make_env("calculator")
    env.reset(0)
    out = env.run_tool(ToolCall("calc", {"expr": "²+1"}))
    assert out.status == "error" and out.text.startswith("error: unexpected")


# --- trip ---

def _hand_instance():
    """Two legs, hand-priced: kal 2 nights (qe 45/night rating 3, zu 30/night rating 2), ruv 1 night (mo 40 rating
    5, pa 20 rating 3); min rating 3, budget 130. Rated >= 3: qe+mo = 2*45+40 = 130, qe+pa = 2*45+20 = 110;
    zu (rating 2) is out. Both fit the budget, the cheapest is qe+pa (110)."""
    from dsv32_jax.posttrain.envs.trip import Hotel, TripInstance

    hotels = (Hotel("qe", "kal", 45, 3), Hotel("zu", "kal", 30, 2), Hotel("mo", "ruv", 40, 5),
              Hotel("pa", "ruv", 20, 3))
    return TripInstance(("kal", "ruv", "dit"), hotels, (("kal", 2), ("ruv", 1)), 130, 3)


def test_trip_plans_rated_exactly_the_minimum_are_feasible():
    """"every hotel rated at least 3" includes 3: feasible_plans keeps qe+mo and qe+pa (worked out by hand in
    _hand_instance) and the oracle picks qe+pa at 110. Mutant guarded: `rating > min_rating` in the generator's
    brute force (qe, rated exactly 3, dropped: no feasible plan, while the verifier accepts it)."""
    from dsv32_jax.posttrain.envs.trip import feasible_plans, score_plan, solve_trip

    inst = _hand_instance()
    assert sorted(tuple(h.name for h in p) for p in feasible_plans(inst)) == [("qe", "mo"), ("qe", "pa")]
    assert [h.name for h in solve_trip(inst)] == ["qe", "pa"]
    plan = {"plan": [{"city": "kal", "hotel": "qe", "nights": 2}, {"city": "ruv", "hotel": "pa", "nights": 1}]}
    assert score_plan(inst, json.dumps(plan))[0] == 1.0


def test_trip_verifier_costs_the_asked_nights_and_refuses_extra_legs():
    """The budget check costs the trip as asked (2 nights at qe + 1 at mo = 130 <= 130) whatever nights the answer
    states (4 nights would be 220), and a plan with an extra leg is not a full-credit answer. Mutants guarded: cost
    from the answer's nights (the nights check then also costs the budget check: wrong nights fail twice), and
    `len(plan) >= len(legs)`."""
    from dsv32_jax.posttrain.envs.trip import score_plan

    inst = _hand_instance()
    legs = [{"city": "kal", "hotel": "qe", "nights": 4}, {"city": "ruv", "hotel": "mo", "nights": 1}]
    reward, info = score_plan(inst, json.dumps({"plan": legs}))
    assert info["cost"] == 130 and info["checks"]["budget"] and not info["checks"]["nights_0"]
    assert reward == 9 / 10  # 4 checks per leg + legs + budget = 10; only nights_0 fails
    right = [dict(legs[0], nights=2), legs[1]]
    assert score_plan(inst, json.dumps({"plan": right}))[0] == 1.0
    reward, info = score_plan(inst, json.dumps({"plan": right + [{"city": "dit", "hotel": "pa", "nights": 1}]}))
    assert reward < 1.0 and not info["checks"]["legs"]


def test_trip_list_hotels_is_name_price_rating():
    """list_hotels returns [name,price,rating] per hotel (its description, which the model reads), agreeing with
    get_hotel's named fields. Mutant guarded: price and rating swapped in the list."""
    env = make_env("trip")
    for seed in range(5):
        env.reset(seed)
        for city in env.instance.cities:
            for name, price, rating in json.loads(env.call_tool(ToolCall("list_hotels", {"city": city}))):
                hotel = json.loads(env.call_tool(ToolCall("get_hotel", {"name": name})))
                assert (hotel["city"], hotel["price"], hotel["rating"]) == (city, price, rating)
                assert 1 <= rating <= 5 and price >= 20


def test_trip_missing_leg_scores_only_what_the_plan_states():
    """A plan naming only the first leg: leg 0's four checks hold, leg 1's four fail (nothing was said about it),
    and so do `legs` and `budget`: 4/10. Mutant guarded: scoring a missing leg against the plan's last entry (its
    rating check then passes: 5/10)."""
    from dsv32_jax.posttrain.envs.trip import score_plan

    reward, info = score_plan(_hand_instance(), json.dumps({"plan": [{"city": "kal", "hotel": "qe", "nights": 2}]}))
    assert reward == 4 / 10 and info["cost"] is None


def test_trip_task_states_the_verifiers_constraints():
    """The task text states the legs in order, the budget and the minimum rating the verifier checks. Mutant
    guarded: a task that states another minimum rating than the one scored."""
    env = make_env("trip")
    for seed in range(20):
        task = env.reset(seed).task
        inst = env.instance
        m = re.fullmatch(r"plan a trip: (.*)\. total budget (\d+), every hotel rated at least (\d)", task)
        assert m, task
        legs = [(c, int(n)) for c, n in re.findall(r"([a-z]+) for (\d) nights?", m.group(1))]
        assert legs == list(inst.legs) and int(m.group(2)) == inst.budget and int(m.group(3)) == inst.min_rating


# --- registry ---

def test_register_is_idempotent_for_the_same_factory(monkeypatch):
    """Registering the same factory under its name again is a no-op (a module imported twice, a notebook cell run
    again); another factory needs replace=True. Mutant guarded: refusing any name already registered."""
    from dsv32_jax.posttrain.envs import LookupEnv, register, registry

    monkeypatch.setattr(registry, "ENVS", dict(registry.ENVS))

    class Mine(LookupEnv):
        name = "mine"

    assert register("mine", Mine) is Mine and register("mine", Mine) is Mine
    with pytest.raises(ValueError, match="already registered"):
        register("mine", LookupEnv)
    assert register("mine", LookupEnv, replace=True) is LookupEnv and type(make_env("mine")) is LookupEnv
