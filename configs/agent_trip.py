"""CPU agentic post-training on the trip-planning environment: the lookup demo's pipeline (configs/agent_lookup.py:
span recall stage, cold start, GRPO over multi-turn trajectories) on one-leg trips ('plan a trip: "qkj" for 3
nights. total budget 185, every hotel rated at least 3': list_hotels for the city, then a JSON plan; 2-3 hotels a
city, exactly one of them within the rating and the budget). The verifier's reward is the fraction of its checks
that hold (the city, the nights, a hotel of that city, its rating, the plan's length, the cost within the budget), so
the cold start gets partial credit and GRPO has a signal to improve on: `eval_reward` / `eval_success` after the
cold start (`pre_eval_*`) against after GRPO (BENCHMARKS.md, "Agentic post-training").

Status (BENCHMARKS.md, "Trip planning over seven seeds"; 32 held-out tasks, 60-90 minutes on one core): the greedy
reward goes 0.00 before training -> 0.38-0.54 after the cold start at seven seeds. `agent.eval_samples` = 8 also
evaluates the sampled policy, which is what GRPO optimizes (32 tasks x 8 samples at temperature 1.0, the same keys
at every evaluation, ~1 CPU minute). 40 GRPO steps of two epochs of two minibatches (`agent.epochs`,
`agent.minibatches`) raise its reward by >= 0.05 at six of the seven seeds (where printed: 0.272 -> 0.423, 0.261 ->
0.342, 0.312 -> 0.388) and change it by -0.007 at 4405 (0.296 -> 0.289), where the KL to the cold start reaches 0.53
after 40 steps and 0.91 after 50, and the policy drifts without gain. (Before two rollout fixes, masking the ids the
codec lacks and ending an overflowing row alone, three seeds gained 0.12-0.14 from a worse-sampling cold start.)
With one update a step (seed 0, old rollouts) it was 0.200 after 10 and 15 steps and gained only 0.02 / 0.04 after
40 / 60. Most of the gain is the plan after a right call (0.52 -> 0.73 of its checks at seed 0). What is left is
copying: about half of the sampled calls miscopy the city, the tool answers with an error, and the episode earns 0.
Not better (BENCHMARKS.md, "three attempts"): sampling GRPO at temperature 0.7, GRPO at 1e-3, recovery
demonstrations (`recovery_fraction=0.25`: 0.24 after the cold start), top-p 0.9. The recall stage copies the
characters of names and numbers (`recall_chars`): with the default alphabet (digits, all letters) and 300 cold-start
steps the same pipeline reached 0.04 after the cold start and GRPO had no signal (62-86% malformed episodes). Two
legs: the answers did not become JSON plans within 300 cold-start steps.

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
