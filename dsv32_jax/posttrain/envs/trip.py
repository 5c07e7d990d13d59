"""`trip`: small constrained trip planning, a miniature of the paper's synthesized general-agent tasks (section 3.2).

A seed generates a world of 3-4 cities with 2-3 hotels each (name, price per night, rating 1-5), a trip of 2-3 of
those cities in order with 1-3 nights each, a total budget and a minimum rating, like the paper's task factory:
environment + tools + task + verifier. Generation brute-forces every hotel choice and keeps an instance only when
some plan satisfies all constraints and at most `max_feasible_fraction` of the plans do (so picking hotels at random,
even knowing their names, rarely succeeds). Hard to solve without the tools, easy to verify.

    task:   plan a trip: kal for 2 nights, then ruv for 1 night. total budget 140, every hotel rated at least 3
    call:   list_hotels {"city":"kal"} -> [["qe",45,4],["zu",30,2]]      get_hotel {"name":"qe"} ->
            {"name":"qe","city":"kal","price":45,"rating":4}
    answer: {"plan":[{"city":"kal","hotel":"qe","nights":2},{"city":"ruv","hotel":"mo","nights":1}]}

City and hotel names are drawn from `name_letters` (default all 26 letters; the CPU demo uses letters no merge of the
shipped BPE contains, so a name is one token a letter wherever it appears); `quote=True` quotes the cities in the task
('plan a trip: "qkj" for 3 nights, ...'), so a BPE splits them as in the calls (unquoted, a leading space merges
into the first letter where the BPE has that merge).

The verifier checks, for each leg of the trip, the city (in order), the nights, that the hotel is in that city and
its rating; and the plan's length and total cost. The reward is the fraction of those checks that hold (0 for an
answer that is not the JSON object above); success only when all hold.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from typing import Any, Sequence

from dsv32_jax.posttrain.chat import ToolCall
from dsv32_jax.posttrain.envs.base import Action, Env
from dsv32_jax.posttrain.envs.helpers import LETTERS, unique_names
from dsv32_jax.posttrain.envs.tools import Tool, ToolError, compact_json, sanitize

PRICE_STEP = 5


@dataclasses.dataclass(frozen=True)
class Hotel:
    name: str
    city: str
    price: int  # per night
    rating: int  # 1-5


@dataclasses.dataclass(frozen=True)
class TripInstance:
    cities: tuple[str, ...]
    hotels: tuple[Hotel, ...]
    legs: tuple[tuple[str, int], ...]  # (city, nights) in visiting order
    budget: int
    min_rating: int

    def hotels_in(self, city: str) -> list[Hotel]:
        return [h for h in self.hotels if h.city == city]

    def hotel(self, name: str) -> Hotel | None:
        return next((h for h in self.hotels if h.name == name), None)


def plan_cost(instance: TripInstance, hotels: Sequence[Hotel]) -> int:
    return sum(h.price * nights for h, (_, nights) in zip(hotels, instance.legs))


def feasible_plans(instance: TripInstance) -> list[tuple[Hotel, ...]]:
    """Brute force: every choice of one hotel per leg that meets the rating and the budget."""
    choices = itertools.product(*(instance.hotels_in(city) for city, _ in instance.legs))
    return [p for p in choices if all(h.rating >= instance.min_rating for h in p)
            and plan_cost(instance, p) <= instance.budget]


def solve_trip(instance: TripInstance) -> tuple[Hotel, ...] | None:
    """The cheapest feasible plan (ties: by hotel names), or None when there is none."""
    plans = feasible_plans(instance)
    return min(plans, key=lambda p: (plan_cost(instance, p), [h.name for h in p])) if plans else None


def render_plan(instance: TripInstance, hotels: Sequence[Hotel]) -> str:
    return compact_json({"plan": [{"city": city, "hotel": h.name, "nights": nights}
                                  for h, (city, nights) in zip(hotels, instance.legs)]})


class TripEnv(Env):
    name = "trip"
    domain = "general"
    instructions = 'answer with json {"plan":[{"city":"c","hotel":"h","nights":1}]} with one entry per city in order.'

    def __init__(self, max_steps: int = 4, cities: tuple[int, int] = (3, 4), hotels: tuple[int, int] = (2, 3),
                 legs: tuple[int, int] = (2, 3), nights: tuple[int, int] = (1, 3), price: tuple[int, int] = (20, 95),
                 max_feasible_fraction: float = 1 / 3, name_letters: str = LETTERS, quote: bool = False):
        for field, (lo, hi), least in (("cities", cities, 2), ("hotels", hotels, 2), ("legs", legs, 1),
                                       ("nights", nights, 1), ("price", price, PRICE_STEP)):
            if not least <= lo <= hi:
                raise ValueError(f"trip: {field} must be a range (lo, hi) with {least} <= lo <= hi, got {(lo, hi)}")
        if legs[1] > cities[0]:
            raise ValueError(f"trip: legs {legs} can visit more cities than the fewest generated, cities={cities}")
        if not 0.0 < max_feasible_fraction <= 1.0:
            raise ValueError(f"trip: max_feasible_fraction must be in (0, 1], got {max_feasible_fraction}")
        n = len(set(name_letters))
        if n < 3 or not set(name_letters) <= set(LETTERS) or n**2 < cities[1] * hotels[1]:
            raise ValueError(f"trip: name_letters must be at least 3 distinct lowercase letters, enough for "
                             f"{cities[1] * hotels[1]} distinct 2-letter hotel names; got {name_letters!r}")
        self.name_letters, self.quote = "".join(sorted(set(name_letters))), bool(quote)
        self.ranges = {"cities": cities, "hotels": hotels, "legs": legs, "nights": nights, "price": price}
        self.max_feasible_fraction = max_feasible_fraction
        super().__init__(max_steps)

    def generate(self, seed: int) -> TripInstance:
        rng = random.Random(seed)
        for _ in range(1000):
            instance = self._draw(rng)
            plans = feasible_plans(instance)
            total = 1
            for city, _ in instance.legs:
                total *= len(instance.hotels_in(city))
            if plans and len(plans) <= self.max_feasible_fraction * total:
                return instance
        raise RuntimeError(f"trip: no instance with at most {self.max_feasible_fraction:.2f} feasible plans "
                           f"in 1000 draws for seed {seed}; raise max_feasible_fraction")

    def _draw(self, rng: random.Random) -> TripInstance:
        r = self.ranges
        cities = unique_names(rng, rng.randint(*r["cities"]), (3,), letters=self.name_letters)
        per_city = [rng.randint(*r["hotels"]) for _ in cities]
        names = iter(unique_names(rng, sum(per_city), (2,), letters=self.name_letters))
        lo, hi = r["price"][0] // PRICE_STEP, r["price"][1] // PRICE_STEP
        hotels = tuple(Hotel(next(names), city, PRICE_STEP * rng.randint(lo, hi), rng.randint(1, 5))
                       for city, n in zip(cities, per_city) for _ in range(n))
        legs = tuple((city, rng.randint(*r["nights"])) for city in rng.sample(cities, rng.randint(*r["legs"])))
        min_rating = rng.randint(2, 4)
        draft = TripInstance(tuple(cities), hotels, legs, 10**9, min_rating)
        best = solve_trip(draft)
        budget = plan_cost(draft, best) + PRICE_STEP * rng.randint(0, 3) if best else 0
        return dataclasses.replace(draft, budget=budget)

    def make_tools(self) -> list[Tool]:
        def schema(key: str, what: str) -> dict[str, Any]:
            return {"type": "object", "properties": {key: {"type": "string", "description": what}}, "required": [key]}
        return [Tool("list_hotels", "returns [name,price,rating] for each hotel of a city (price per night)",
                     schema("city", "city name"), self._list_hotels),
                Tool("get_hotel", "returns the city, price per night and rating of a hotel",
                     schema("name", "hotel name"), self._get_hotel)]

    def _list_hotels(self, city: str) -> str:
        if city not in self.instance.cities:
            raise ToolError(f'no city "{sanitize(city)}"')
        return compact_json([[h.name, h.price, h.rating] for h in self.instance.hotels_in(city)])

    def _get_hotel(self, name: str) -> str:
        h = self.instance.hotel(name)
        if h is None:
            raise ToolError(f'no hotel "{sanitize(name)}"')
        return compact_json({"name": h.name, "city": h.city, "price": h.price, "rating": h.rating})

    def render_task(self, instance: TripInstance) -> str:
        q = '"' if self.quote else ""
        legs = ", then ".join(f"{q}{city}{q} for {n} night{'s' if n > 1 else ''}" for city, n in instance.legs)
        return f"plan a trip: {legs}. total budget {instance.budget}, every hotel rated at least {instance.min_rating}"

    def score(self, instance: TripInstance, answer: str) -> tuple[float, dict[str, Any]]:
        return score_plan(instance, answer)

    def solve(self, instance: TripInstance) -> list[Action]:
        plan = solve_trip(instance)
        calls = [ToolCall("list_hotels", {"city": city}) for city, _ in instance.legs]
        picks = ", ".join(f"{h.name} in {city} {h.price}*{n}" for h, (city, n) in zip(plan, instance.legs))
        return [Action(tool_calls=calls, reasoning="list the hotels of " + " and ".join(c for c, _ in instance.legs)),
                Action(content=render_plan(instance, plan),
                       reasoning=f"rating at least {instance.min_rating}: {picks}, total {plan_cost(instance, plan)} "
                                 f"of {instance.budget}")]


def _parse_plan(answer: str) -> list[dict[str, Any]] | str:
    """The plan's entries, or the reason the answer is not a plan."""
    try:
        data = json.loads(answer)
    except (ValueError, TypeError, RecursionError):  # ValueError: JSONDecodeError, or an integer of > 4300 digits
        return "answer is not json"
    if not isinstance(data, dict) or not isinstance(data.get("plan"), list):
        return 'answer has no "plan" list'
    for i, entry in enumerate(data["plan"]):
        if not isinstance(entry, dict):
            return f"plan[{i}] is not an object"
        for key, kind in (("city", str), ("hotel", str), ("nights", int)):
            if not isinstance(entry.get(key), kind) or isinstance(entry.get(key), bool):
                return f'plan[{i}].{key} is missing or not {"a string" if kind is str else "an integer"}'
    return data["plan"]


def score_plan(instance: TripInstance, answer: str) -> tuple[float, dict[str, Any]]:
    """(fraction of checks that hold, details): per leg city / nights / hotel in city / rating, then length and
    budget. An answer that is not a plan scores 0."""
    plan = _parse_plan(answer)
    if isinstance(plan, str):
        return 0.0, {"reason": plan, "checks": {}}
    checks: dict[str, bool] = {}
    hotels = [instance.hotel(entry["hotel"]) for entry in plan]
    for i, (city, nights) in enumerate(instance.legs):
        entry, hotel = (plan[i], hotels[i]) if i < len(plan) else ({}, None)
        checks[f"city_{i}"] = entry.get("city") == city
        checks[f"nights_{i}"] = entry.get("nights") == nights
        checks[f"hotel_{i}"] = hotel is not None and hotel.city == city
        checks[f"rating_{i}"] = hotel is not None and hotel.rating >= instance.min_rating
    checks["legs"] = len(plan) == len(instance.legs)
    # The cost of the trip as asked (its nights), so wrong nights cannot buy the budget check.
    ok = len(plan) >= len(instance.legs) and all(hotels[:len(instance.legs)])
    cost = sum(h.price * n for h, (_, n) in zip(hotels, instance.legs)) if ok else None
    checks["budget"] = cost is not None and cost <= instance.budget
    failed = [k for k, ok in checks.items() if not ok]
    return sum(checks.values()) / len(checks), {"reason": "failed " + ",".join(failed) if failed else "correct",
                                                "checks": checks, "cost": cost}
