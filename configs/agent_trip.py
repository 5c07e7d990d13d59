"""CPU agentic post-training on the trip-planning environment: the lookup demo's pipeline (configs/agent_lookup.py:
span recall stage, cold start, GRPO over multi-turn trajectories) on one-leg trips ('plan a trip: "qkj" for 3
nights. total budget 185, every hotel rated at least 3': list_hotels for the city, then a JSON plan; 2-3 hotels a
city, exactly one of them within the rating and the budget). The verifier's reward is the fraction of its checks
that hold (the city, the nights, a hotel of that city, its rating, the plan's length, the cost within the budget), so
the cold start gets partial credit and GRPO has a signal to improve on: `eval_reward` / `eval_success` after the
cold start (`pre_eval_*`) against after GRPO (BENCHMARKS.md, "Agentic post-training").

Status (BENCHMARKS.md, "Agentic post-training"; 32 held-out tasks, 2 CPU cores, ~40 minutes alone with its 30 GRPO
steps): greedy reward 0.00 before training -> 0.34 after the cold start (success 4/32) -> 0.40 after 30 GRPO steps
(5/32) with seed 0 (0.33-0.36 at steps 5-25, 0.39-0.40 at 35-60); with seed 4405 0.00 -> 0.40 (5/32) -> 0.36 (3/32).
The cold start gets there at both seeds; GRPO's effect on the greedy policy is within the spread of two seeds
(+0.06, -0.04), though it lowers the sampled episodes' format errors (seed 0: 0.39 -> 0.13-0.25 at steps 40-60).
What is left is copying: 10 of the 32 held-out tasks end without a plan, each one inspected after a list_hotels call
with a miscopied city (an A-B-A name, the third letter copied from the first). Not better (BENCHMARKS.md,
"three attempts"): sampling GRPO at temperature 0.7 (0.34 -> 0.39, fewer malformed calls, more miscopies), GRPO at
1e-3 (KL 0.5, 0.30 after 15 steps), recovery demonstrations (`recovery_fraction=0.25`: 0.24 after the cold start).
The recall stage copies the characters of names and numbers (`recall_chars`): with the default alphabet (digits, all
letters) and 300 cold-start steps the same pipeline reached 0.04 after the cold start and GRPO had no signal (62-86%
malformed episodes). Two legs: the answers did not become JSON plans within 300 cold-start steps.
`agent.eval_samples` = 8 also evaluates the sampled policy, the one GRPO optimizes (32 tasks x 8 samples, ~1 CPU
minute an evaluation): it samples far worse than it decodes (seed 0: reward 0.21, format errors 0.32), and the
first 10-20 GRPO steps double those format errors before anything improves (BENCHMARKS.md, "the sampled policy").

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
    c.agent.epochs = 2  # two epochs of two minibatches a rollout batch: four clipped updates a GRPO step
    c.agent.minibatches = 2
    c.agent.eval_every = 10
    c.agent.eval_samples = 8
    c.steps = 40
    return c
