"""CPU agentic post-training on the trip-planning environment: the lookup demo's pipeline (configs/agent_lookup.py:
span recall stage, cold start, GRPO over multi-turn trajectories) on one-leg trips ('plan a trip: "qkj" for 3
nights. total budget 185, every hotel rated at least 3': list_hotels for the city, then a JSON plan; 2-3 hotels a
city, exactly one of them within the rating and the budget). The verifier's reward is the fraction of its checks
that hold (the city, the nights, a hotel of that city, its rating, the plan's length, the cost within the budget), so
the cold start gets partial credit and GRPO has a signal to improve on: `eval_reward` / `eval_success` after the
cold start (`pre_eval_*`) against after GRPO (BENCHMARKS.md, "Agentic post-training").

Status (seed 0, 32 held-out tasks): greedy reward 0.19 after the cold start -> 0.25 after 5 GRPO steps -> 0.26 at
steps 10-20 (success 1/32 throughout), measured continuing (`init_from`) from a two-leg run (`legs` (2, 2): recall
x 800, 300 cold-start steps, reward 0.02) with 150 one-leg cold-start steps (the last 50 at 3e-4) before GRPO.
This config's own pipeline from random initialization (recall x 800, 300 cold-start steps on one leg, the last 100
at 3e-4; seed 0) falls short: greedy reward 0.04 after the cold start, 0.04-0.06 after 5-15 GRPO steps, 62-86% of the
sampled episodes malformed, so most groups score all zero and GRPO has no signal. A longer cold start (~600 steps)
is the next thing to measure. Two legs: the answers did not become JSON plans within 300 cold-start steps.

City and hotel names of the 11 letters no merge of the shipped BPE contains (as the lookup demo's keys); episodes
are ~500 BPE tokens (~70 of them the model's), so `index_topk` covers them (1,024) and the indexer is not trained,
as in the lookup demo.

    python -m dsv32_jax.train.main --config=configs/agent_trip.py --workdir=runs/agent/trip
"""
from dsv32_jax.configs import agent_lookup


def get_config():
    c = agent_lookup.get_config()
    c.model_overrides["index_topk"] = 1024
    c.agent.envs = "trip"
    c.agent.env_kwargs = {"trip": {"name_letters": agent_lookup.KEY_LETTERS, "legs": (1, 1), "quote": True}}
    c.agent.capacity = 768
    c.agent.max_new_tokens = 80
    c.agent.max_turns = 3
    c.agent.cold_start_steps = 600
    c.agent.recall_chars = agent_lookup.KEY_LETTERS + "0123456789\""  # what trip calls and plans copy
    c.agent.eval_every = 5
    return c
