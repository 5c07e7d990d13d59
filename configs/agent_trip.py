"""CPU agentic post-training on the trip-planning environment: the lookup demo's pipeline (configs/agent_lookup.py:
span recall stage, cold start, GRPO over multi-turn trajectories) on two-city trips ('plan a trip: "qkj" for 3 nights,
then "vqw" for 1 night. total budget 185, every hotel rated at least 3': list_hotels for both cities in one turn, then
a JSON plan). The verifier's reward is the fraction of its checks that hold (per leg: city, nights, hotel in that
city, rating; the plan's length and its total cost within the budget), so the cold start gets partial credit and
GRPO has a signal to improve on: `eval_reward` / `eval_success` after the cold start (`pre_eval_*`) against after
GRPO (BENCHMARKS.md, "Agentic post-training").

Status: not learned yet. After 800 recall and 200 + 100 cold-start steps (the last 100 with quoted cities) greedy
reward 0.02, success 0/32: the answers are not yet JSON plans, so every GRPO group has zero reward variance.

City and hotel names of the 11 letters no merge of the shipped BPE contains (as the lookup demo's keys); episodes
are ~620 BPE tokens (134 of them the model's), so `index_topk` covers them (1,024) and the indexer is not trained,
as in the lookup demo.

    python -m dsv32_jax.train.main --config=configs/agent_trip.py --workdir=runs/agent/trip
"""
from dsv32_jax.configs import agent_lookup


def get_config():
    c = agent_lookup.get_config()
    c.model_overrides["index_topk"] = 1024
    c.agent.envs = "trip"
    c.agent.env_kwargs = {"trip": {"name_letters": agent_lookup.KEY_LETTERS, "legs": (2, 2), "quote": True}}
    c.agent.capacity = 768
    c.agent.max_new_tokens = 80
    c.agent.max_turns = 3
    c.agent.cold_start_steps = 300
    c.agent.eval_every = 5
    return c
