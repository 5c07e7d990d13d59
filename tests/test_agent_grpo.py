"""Agentic GRPO (train/agent_grpo.py) on CPU with a tiny model: cold-start SFT on the environments' demonstrations
lowers the assistant-token loss, a GRPO step over multi-turn trajectories runs with every stabilizer, the sampler's
log-probs equal the trainer's at pi_old, and per-domain KL weights reach the batch."""

import numpy as np

from dsv32_jax.train.agent_grpo import AgentLearner, sft_batch
from dsv32_jax.train.config import default_config


def _config(**agent):
    c = default_config()
    c.stage, c.steps, c.mesh, c.log_every = "agent", 1, "", 1000
    c.model_overrides = {"index_topk": 16, "num_hidden_layers": 2, "vocab_size": 1536}
    c.optimizer.schedule, c.optimizer.warmup_steps, c.optimizer.lr = "constant", 0, 3e-3
    c.agent.update(dict(envs="lookup,calculator", codec="bpe", tasks_per_step=2, group_size=2, max_turns=4,
                        max_new_tokens=12, capacity=768, eval_episodes=2, cold_start_steps=0, cold_start_batch=2, top_k=8,
                        max_candidates=16))
    c.agent.kl_weights = {"code": 0.05}
    c.agent.update(agent)
    return c


def test_sft_batch_trains_only_on_the_assistant_tokens():
    ids, mask = [5, 6, 7, 8, 9], [0, 0, 1, 1, 1]
    b = sft_batch([(ids, mask)], 8)
    np.testing.assert_array_equal(b["targets"][0, :4], ids[1:])
    np.testing.assert_array_equal(b["loss_mask"][0], [0, 1, 1, 1, 0, 0, 0, 0])  # predicts tokens 7, 8, 9
    np.testing.assert_array_equal(b["segment_ids"][0], [1] * 5 + [0] * 3)


def test_cold_start_then_one_grpo_step_over_trajectories(tmp_path):
    lrn = AgentLearner(_config(recall_mix=0.5), str(tmp_path))
    assert lrn.beta == {"lookup": 0.0, "calculator": 0.05}  # the calculator's domain is "code"
    assert np.isfinite(lrn.recall_stage(1, 2)).all()  # the recall stage: copying conversations
    sft = lrn.cold_start(4, 2)  # one demonstration + one copying conversation a step
    print("cold-start SFT loss", sft)
    assert sft[-1] < sft[0]
    batch, stats = lrn.rollout(0)
    assert batch["gen"].sum() > 0
    assert all(np.isclose(b, 0.0) or np.isclose(b, 0.05) for b in batch["beta"])
    metrics = lrn.update(batch)
    print({k: round(v, 6) for k, v in metrics.items()})
    assert metrics["logprob_mismatch_max"] < 1e-4  # sampler vs teacher-forced trajectory at pi_old
    for key in ("kl", "opsm_masked_fraction", "clip_fraction", "indexer_kl", "grad_norm"):
        assert np.isfinite(metrics[key]), key
    assert metrics["indexer_kl"] > 0


def test_rl_learning_rate_is_the_grpo_steps_own(tmp_path):
    """config.agent.rl_lr: the GRPO update runs with it, not with config.optimizer.lr (3e-3 here). Adam's first
    step moves every parameter by about lr (the bias-corrected m / sqrt(v) is +-1), so after one GRPO update at
    rl_lr = 1e-5 no parameter moves by more than ~1e-5 (at 3e-3 they would move ~300x more); a negative value is
    refused naming the field."""
    import pytest
    import jax

    lrn = AgentLearner(_config(rl_lr=1e-5, group_size=2, tasks_per_step=1), str(tmp_path))
    batch, _ = lrn.rollout(0)
    before = jax.tree.map(np.asarray, jax.device_get(lrn.state[0]))
    lrn.update(batch)
    after = jax.tree.map(np.asarray, jax.device_get(lrn.state[0]))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)))
    assert 5e-6 < moved < 2e-5, moved
    with pytest.raises(ValueError, match="agent.rl_lr"):
        AgentLearner(_config(rl_lr=-1.0), str(tmp_path / "c"))
