"""GRPO end to end on CPU: the tiny MoE + DSA model learns a verifiable task from chance; a length penalty
shortens responses; keep routing / keep sampling mask hold through the learner; exact resume; rewards."""


import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.learning import perturb_params, run_seed
from tests.test_train import load_config
from dsv32_jax.train import rl_tasks
from dsv32_jax.train.grpo import GRPOLearner
from dsv32_jax.train.steps import forward_logprobs
from dsv32_jax.posttrain.sampler import SamplingConfig


def learner(workdir, steps, **overrides):
    config = load_config("grpo_tiny", steps=steps, log_every=1000, **{
        "grpo.tasks": "map", "checkpoint.every": 1000, "checkpoint.use_async": False, **overrides})
    return GRPOLearner(config, str(workdir))


def evals(history, key="eval_accuracy"):
    return [h[key] for h in history if key in h]


@pytest.fixture(scope="session")
def map_run(tmp_path_factory):
    """70 GRPO steps on map-a-digit from random init (seed from the fixture's name; DSV32_TEST_PERTURB perturbs the
    initial parameters, see tests/learning.py). Shared by the two learning tests below (same xdist group)."""
    lrn = learner(tmp_path_factory.mktemp("map"), 70, seed=run_seed("tests/test_grpo.py::map_run"))
    perturb_params(lrn.state[0])
    lrn.ref = jax.tree.map(jnp.copy, lrn.state[0])
    start = lrn.evaluate()["eval_accuracy"]
    return dict(learner=lrn, start=start, history=lrn.fit())


@pytest.mark.heavy
@pytest.mark.xdist_group("grpo_map")
def test_learns_map_a_digit_from_chance(map_run):
    """Greedy accuracy over the 10 inputs, every 10 steps. Measured over DSV32_TEST_SEED=0..4 and 0..1 with
    DSV32_TEST_PERTURB=1e-6 (2026-11-24, 2-core CPU), 7 runs:
    start 0.0-0.1; first eval (step 10) 0.4-0.8; every run reaches 1.0 and ends at 1.0."""
    start, history = map_run["start"], map_run["history"]
    acc = evals(history)
    print(f"map: greedy accuracy start {start}, every 10 steps {acc}")
    assert start <= 0.3  # chance is 1/32 per token
    assert max(acc) >= 0.9 and acc[-1] >= 0.8
    assert history[-1]["routing_agreement"] == 1.0  # sampler and trainer route identically at pi_old
    assert history[-1]["logprob_mismatch_max"] < 1e-4


@pytest.mark.heavy
@pytest.mark.xdist_group("grpo_map")
def test_length_penalty_shortens_responses_while_accuracy_holds(map_run, tmp_path):
    """The map-trained policy is accurate but never stops (no reward for EOS): it fills all 4 new tokens. 40 more
    steps with the length penalty (-0.1 per token beyond 1, -0.5 without EOS) from that policy, against the map run
    itself as the control. Measured over DSV32_TEST_SEED=0..4 and 0..1 with DSV32_TEST_PERTURB=1e-6
    (2026-11-24, 2-core CPU), 7 runs:
    control length 3.62-3.92 (finished 0.01-0.17); with the penalty the last 5 steps average 1.00-1.34 tokens
    (finished 1.00); greedy accuracy during the 40 steps: minimum 0.8, mean 0.85-1.0."""
    base = map_run["learner"]
    control = [h["response_length"] for h in map_run["history"]][-10:]
    control_finished = map_run["history"][-1]["finished_fraction"]
    lrn = learner(tmp_path, 40, seed=base.config.seed, **{"grpo.length_target": 1})
    lrn.state = jax.tree.map(jnp.copy, base.state)
    lrn.ref = jax.tree.map(jnp.copy, base.state[0])
    history = lrn.fit()
    lengths = [h["response_length"] for h in history]
    acc = evals(history)
    print(f"length: control {np.mean(control):.2f} (finished {control_finished:.2f}); with the penalty "
          f"{np.mean(lengths[:5]):.2f} -> {np.mean(lengths[-5:]):.2f} (finished {history[-1]['finished_fraction']:.2f});"
          f" accuracy {acc}")
    assert np.mean(lengths[-5:]) < np.mean(control) - 2.0
    assert np.mean(lengths[-5:]) < 1.6
    assert history[-1]["finished_fraction"] > 0.9
    assert np.mean(acc) >= 0.7 and min(acc) >= 0.6  # 10 greedy prompts per eval: 0.1 is one prompt


@pytest.mark.slow  # 1.5 min alone, 6.5-7 min loaded: too long for the heavy suite's CI budget; runs recorded in BUILD.md
def test_learns_sum_of_two_digits_from_chance(tmp_path):
    """The first 100 of configs/grpo_sum_tiny.py's 300 steps (the same schedule, so the run is a prefix of the
    demo's), greedy accuracy over all 100 prompts every 10 steps; about 1.5 min alone on 2 CPU cores (a third of the
    4.6 min the 300 steps took on 2026-11-22), 6.5-7 min on a loaded one. Measured over DSV32_TEST_SEED=0..4
    (2026-11-27, 2-core CPU, loaded), seeds 0, 1, 2, 3, 4: start 0.02, 0.05, 0.00, 0.07, 0.05; at step 100 0.87,
    0.57, 0.67, 0.80, 0.58 (min 0.57, median 0.67, max 0.87); at step 50 0.71, 0.36, 0.47, 0.55, 0.35; the lowest of
    steps 60-100 0.77, 0.42, 0.51, 0.67, 0.41; seed 0 with DSV32_TEST_PERTURB=1e-6: 0.02 -> 0.84 (step 50: 0.68,
    lowest of steps 60-100: 0.70). Bounds: the end >= 0.4 (four times the 0.1 of a constant answer; 0.17
    below the lowest run) and no eval of steps 60-100 below 0.3 (0.11 below). Mutation: the policy-gradient term
    zeroed (train/grpo_loss.py `per_token = 0.0 * pg * keep[:, None] + ...`, only the KL to the initial policy
    left): 0.02 -> 0.01-0.03 at every eval, fails (tests/mutate.sh, 2026-11-27).
    It replaces the slow 300-step test, whose bound (max >= 0.9, last >= 0.85) came from one run (0.10 -> 0.49 at
    step 100 -> 0.93, c3ba2df) and failed at 50a4766 (0.04 -> max 0.87, same config and seed). Not a regression in
    the GRPO code: the same seed's start moved 0.10 -> 0.04, so that was another draw, and all five runs above are
    past the first run's 0.49 at step 100; where a run levels off (0.87-0.93) varies with the draw, so one run of
    the demo is not a bound."""
    from tests.test_train import load_config as load
    config = load("grpo_sum_tiny", steps=100, log_every=1000, seed=run_seed("tests/test_grpo.py::test_learns_sum"),
                  **{"checkpoint.every": 1000, "checkpoint.use_async": False})
    lrn = GRPOLearner(config, str(tmp_path))
    perturb_params(lrn.state[0])
    lrn.ref = jax.tree.map(jnp.copy, lrn.state[0])
    start = lrn.evaluate()["eval_accuracy"]
    acc = evals(lrn.fit())
    print(f"sum: greedy accuracy start {start}, every 10 steps {acc}")
    assert start <= 0.2  # constant answers score 0.1
    assert acc[-1] >= 0.4 and min(acc[5:]) >= 0.3


@pytest.mark.heavy  # 21 s on 2 cores
def test_keep_routing_and_sampling_mask_through_the_learner(tmp_path):
    lrn = learner(tmp_path, 0)
    batch, _ = lrn.rollout(0)
    diag = jax.device_get(lrn.steps.diagnostics(lrn.state[0], batch))
    assert diag["logprob_mismatch_max"] < 1e-5 and diag["routing_agreement"] == 1.0
    # perturb the parameters until the live router flips some expert choices
    model = nnx.merge(lrn.graphdef, lrn.state)[0]
    for layer in (1, 2):
        router = model.layers[layer].ffn.router
        router[...] = router[...] + jax.random.normal(jax.random.key(layer), router.shape) * 0.5
    _, _, _, native = forward_logprobs(model, batch, 1.0, replay=False)
    _, _, _, replayed = forward_logprobs(model, batch, 1.0, replay=True)
    flipped = 0
    for k, ids in batch["routing"].items():
        valid = np.asarray(batch["segments"]) > 0
        np.testing.assert_array_equal(np.asarray(replayed["routing"][k])[valid], np.asarray(ids)[valid])
        flipped += int(np.any(np.asarray(native["routing"][k])[valid] != np.asarray(ids)[valid]))
    assert flipped > 0
    # the train step itself replays the sampler's routing: its ratio pi_theta / pi_old is the replayed forward's (a
    # step that routed natively passed every test: tests/mutate.sh survivor, 2026-11-30)
    from dsv32_jax.train.steps import grpo_train_step

    batch = dict(batch, logp_ref=batch["logp_old"])
    mask = np.asarray(batch["mask"], np.float64)
    ratio = {r: float(np.sum(mask * np.exp(np.asarray(forward_logprobs(model, batch, 1.0, replay=r)[0], np.float64)
                                         - np.asarray(batch["logp_old"], np.float64))) / mask.sum())
             for r in (True, False)}
    _, metrics = grpo_train_step(nnx.state((model, nnx.merge(lrn.graphdef, lrn.state)[1])), batch,
                                 graphdef=lrn.graphdef, temperature=1.0, eps=0.2, delta=0.5)
    assert abs(ratio[True] - ratio[False]) > 1e-4, ratio
    np.testing.assert_allclose(float(metrics["ratio_mean"]), ratio[True], rtol=1e-5)


@pytest.mark.heavy  # 20 s or more on 2 cores
def test_indexer_keeps_learning_during_rl_without_touching_the_policy_gradient(tmp_path):
    """grpo.indexer_weight (default 1): the eq. (4) KL trains the indexer during RL. Its inputs are detached, so the
    rest of the model takes exactly the update it takes with the term off (weight 0: the indexer stays put). The
    RL forward does not run the MTP layers."""
    from dsv32_jax.model import sharding as shd
    from dsv32_jax.train import steps as steps_lib

    lrn = learner(tmp_path, 0, **{"optimizer.warmup_steps": 0})  # a non-zero learning rate at the first step
    assert lrn.g.indexer_weight == 1.0
    batch, _ = lrn.rollout(0)
    off = steps_lib.compile_grpo_steps(
        graphdef=lrn.graphdef, model_graphdef=lrn.model_graphdef, state_shardings=lrn.shardings,
        batch_sharding=lrn.batch_sharding, temperature=lrn.sampling.temperature, eps=lrn.g.eps, delta=lrn.g.delta,
        indexer_weight=0.0)
    with shd.use_mesh(lrn.mesh):
        batch = jax.device_put(batch, lrn.batch_sharding)
        batch["logp_ref"] = lrn.steps.reference(lrn.ref, batch)
        before = {k: np.array(v) for k, v in nnx.traversals.flatten_mapping(nnx.to_pure_dict(lrn.state[0])).items()}
        on_state, on_metrics = lrn.steps.train(jax.tree.map(jnp.copy, lrn.state), batch)
        off_state, off_metrics = off.train(jax.tree.map(jnp.copy, lrn.state), batch)
    on = nnx.traversals.flatten_mapping(nnx.to_pure_dict(on_state[0]))
    off_p = nnx.traversals.flatten_mapping(nnx.to_pure_dict(off_state[0]))
    indexer = [k for k in before if "indexer" in k]
    assert indexer and float(on_metrics["indexer_kl"]) > 0 and "indexer_kl" not in off_metrics
    unchanged = [k for k in indexer if k[0] != "mtp" and np.array_equal(np.asarray(on[k]), before[k])]
    assert not unchanged, unchanged
    assert all(np.array_equal(np.asarray(off_p[k]), before[k]) for k in indexer)  # and the MTP layer is not run
    main = [k for k in before if "indexer" not in k]
    assert any(not np.array_equal(np.asarray(off_p[k]), before[k]) for k in main)
    for k in main:
        np.testing.assert_allclose(np.asarray(on[k]), np.asarray(off_p[k]), rtol=1e-6, atol=1e-7, err_msg=str(k))
    _, _, _, aux = forward_logprobs(nnx.merge(lrn.graphdef, lrn.state)[0], batch, 1.0, replay=True)
    assert aux["mtp_logits"] == [] and max(aux["routing"]) < lrn.cfg.num_hidden_layers


def test_group_ids_never_mix_prompts(tmp_path):
    lrn = learner(tmp_path, 0, **{"grpo.tasks": "map,sum,rev"})
    items, group_ids = lrn.sample_prompts(3)
    assert len(items) == lrn.g.prompts_per_step * lrn.g.group_size
    for g in np.unique(group_ids):
        members = [items[i] for i in np.nonzero(group_ids == g)[0]]
        assert len(members) == lrn.g.group_size and all(m == members[0] for m in members)


@pytest.mark.heavy
def test_grpo_resume_is_exact(tmp_path):
    straight = learner(tmp_path / "a", 4).fit()
    learner(tmp_path / "b", 2, **{"checkpoint.every": 2}).fit()
    resumed = learner(tmp_path / "b", 4, **{"checkpoint.every": 2}).fit()
    assert [h["step"] for h in resumed] == [3, 4]
    for a, b in zip(straight[2:], resumed):
        assert a["loss"] == b["loss"] and a["reward_mean"] == b["reward_mean"]


def sample(response, answer=(5,), finished=True, language="digits", kind="map"):
    return rl_tasks.Sample(kind, (14, 3, 13), tuple(answer), tuple(response), finished, language)


def test_rewards():
    assert rl_tasks.outcome_reward(sample([5, 9])) == 1.0
    assert rl_tasks.outcome_reward(sample([4])) == 0.0
    assert rl_tasks.outcome_reward(sample([2, 9, 4], answer=(2, 3, 4), kind="rev")) == pytest.approx(2 / 3)
    pen = rl_tasks.length_penalty(1, per_token=0.1, unfinished=0.5)
    assert pen(sample([5])) == 0.0 and pen(sample([5, 6, 7])) == pytest.approx(-0.2)
    assert pen(sample([5], finished=False)) == -0.5
    assert rl_tasks.language_consistency(sample([5, 20, 6, 21])) == 0.5
    assert rl_tasks.language_consistency(sample([20, 21], language="letters")) == 1.0
    grm = rl_tasks.GenerativeRewardModel(rl_tasks.rule_based_judge, rl_tasks.default_rubric)
    assert grm(sample([5])) == 1.0  # ends with EOS, short, right answer
    assert grm(sample([4, 4, 4], finished=False)) == 0.0
    assert grm(sample([4])) == pytest.approx(2 / 3)
    total = rl_tasks.make_reward("map", length_target=1, language_weight=0.5, grm_weight=1.0)
    assert total(sample([5])) == pytest.approx(1.0 + 0.0 + 0.5 + 1.0)
    with pytest.raises(ValueError, match="no verdict"):
        rl_tasks.GenerativeRewardModel(lambda q: "", rl_tasks.default_rubric)(sample([5]))
    s = rl_tasks.to_sample("map", (14, 3, 13), (5,), "digits", [5, 1, 0, 0])
    assert s.response == (5,) and s.finished


def test_letters_prompts_exercise_the_language_reward(tmp_path):
    """grpo.letters=0.5: about half of the copy prompts are in letters; the learner's reward (outcome + 0.5 x
    language consistency) scores a correct answer in the prompt's language above the same answer in the other."""
    lrn = learner(tmp_path, 0, **{"grpo.tasks": "copy", "grpo.letters": 0.5, "grpo.language_weight": 0.5})
    items, _ = lrn.sample_prompts(0)
    langs = [lang for _, (_, _, lang) in items[::lrn.g.group_size]]
    assert 0.2 < langs.count("letters") / len(langs) < 0.8, langs
    for kind, (prompt, answer, lang) in items[::lrn.g.group_size]:
        alphabet = rl_tasks.LETTERS if lang == "letters" else rl_tasks.DIGITS
        assert set(prompt[1:-1]) <= set(alphabet) and set(answer) <= set(alphabet)
        other = rl_tasks.DIGITS if lang == "letters" else rl_tasks.LETTERS
        right = rl_tasks.to_sample(kind, prompt, answer, lang, list(answer) + [rl_tasks.EOS])
        wrong = rl_tasks.to_sample(kind, prompt, answer, lang, [other[0]] * 3 + [rl_tasks.EOS])
        assert lrn.rewards[kind](right) == 1.5 and lrn.rewards[kind](wrong) == 0.0
    with pytest.raises(ValueError, match="config.grpo.letters"):
        learner(tmp_path, 0, **{"grpo.letters": 1.5})


@pytest.mark.heavy  # 22 s on 2 cores
def test_off_policy_sequence_mask_fires_in_the_learner(tmp_path):
    """Two epochs x two minibatches at a high learning rate: the second epoch's minibatches are off-policy, and with
    a small delta the off-policy sequence mask drops negative-advantage sequences there (masked fraction > 0 in the
    learner's averaged metrics); the first update of every step is on-policy, so it never masks more than 3/4."""
    lrn = learner(tmp_path, 1, **{"grpo.delta": 1e-4, "grpo.epochs": 2, "grpo.minibatches": 2,
                                  "optimizer.lr": 3e-2})
    batch, _ = lrn.rollout(0)
    masked = lrn.update(batch)["opsm_masked_fraction"]
    print("opsm_masked_fraction", masked)
    assert 0.0 < masked <= 0.75


def test_a_group_of_one_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"config.grpo.group_size must be >= 2 .*got 1"):
        learner(tmp_path, 1, **{"grpo.group_size": 1, "grpo.minibatches": 1})


def test_sampling_errors_name_the_config_field(tmp_path):
    """They named SamplingConfig's field, which no config file or flag has."""
    with pytest.raises(ValueError, match=r"config\.grpo\.top_k=100 must be in \[0, max_candidates=32\]"):
        learner(tmp_path, 1, **{"grpo.top_k": 100})
    with pytest.raises(ValueError, match=r"config\.grpo\.max_candidates must be >= 1, got 0"):
        learner(tmp_path, 1, **{"grpo.top_k": 0, "grpo.max_candidates": 0})


@pytest.mark.heavy  # 20 s or more on 2 cores
def test_a_nucleus_cut_by_max_candidates_is_reported(tmp_path, caplog):
    """top_p's nucleus is taken among the max_candidates most likely tokens; on the near-flat distribution of a
    fresh model, 4 candidates of 32 ids hold far less than top_p=0.95 of the mass, and top_p silently acted as
    top_k=4 (audit, 2026-12-07). The learner says so once, naming the fields."""
    from dsv32_jax.train.grpo import nucleus_capped

    lrn = learner(tmp_path, 10, **{"grpo.top_p": 0.95, "grpo.max_candidates": 4, "grpo.prompts_per_step": 2,
                                   "grpo.eval_every": 0})
    with caplog.at_level("WARNING", logger="absl"):
        history = [lrn.run_step() for _ in range(2)]  # (two of ten steps: no evaluation)
    warned = [r.getMessage() for r in caplog.records if "max_candidates" in r.getMessage()]
    assert all(h["kept_mass"] < 0.5 for h in history), history  # (about 4/32 of a near-flat distribution, and more)
    assert len(warned) == 1, warned  # once, not at every step
    assert re.search(r"step 1: the sampled tokens' kept sets held 0\.\d\d of the probability mass \(metric kept_mass\), "
                     r"not config\.grpo\.top_p=0\.95: the nucleus is cut inside the config\.grpo\.max_candidates=4 ",
                     warned[0]), warned[0]
    # every id a candidate: the nucleus holds top_p (0.957 measured for this learner at 32 candidates), no warning
    assert nucleus_capped("grpo", SamplingConfig(top_p=0.95, max_candidates=32), 0.957) is None
    # top_k the tighter cut (its kept set may hold less by design), top_p off, greedy: nothing to report
    for cfg in (SamplingConfig(top_k=2, top_p=0.9, max_candidates=4), SamplingConfig(top_p=1.0, max_candidates=4),
                SamplingConfig(greedy=True, top_p=0.9, max_candidates=4)):
        assert nucleus_capped("grpo", cfg, 0.1) is None
    assert nucleus_capped("agent", SamplingConfig(top_k=4, top_p=0.9, max_candidates=4), 0.84).startswith(
        "the sampled tokens' kept sets held 0.84")
    assert nucleus_capped("agent", SamplingConfig(top_p=0.9, max_candidates=4), 0.86) is None


def test_kl_weights_of_an_unknown_task_are_refused(tmp_path):
    """A misspelled task in grpo.kl_weights silently took grpo.kl_weight instead (a task outside this run's mix
    is fine: a config may name more)."""
    import ml_collections

    with pytest.raises(ValueError, match=r"config\.grpo\.kl_weights\.mapp: not a task \(one of copy, map, rev, sum\)"):
        learner(tmp_path, 1, **{"grpo.kl_weights": ml_collections.ConfigDict({"mapp": 0.1})})


def test_both_learners_report_a_capped_nucleus_once(caplog):
    """The GRPO and the agent learner log the capped-nucleus warning (kept_mass 0.3 < top_p 0.9 - 0.05 with 4
    candidates) once, at the first step that shows it, naming their own section; a step whose update reports no
    kept_mass (a stubbed learner) is no reason to warn. Rollout, update and evaluation are stubbed."""
    import types

    from dsv32_jax.train.agent_grpo import AgentLearner

    for cls, field, section in ((GRPOLearner, "g", "grpo"), (AgentLearner, "a", "agent")):
        lrn = object.__new__(cls)
        lrn.step, lrn.config = 0, types.SimpleNamespace(steps=10)
        setattr(lrn, field, types.SimpleNamespace(eval_every=0, cold_start_steps=0, recall_steps=0))
        lrn.sampling = SamplingConfig(top_p=0.9, max_candidates=4)
        lrn.rollout = lambda step: ({}, {"reward_mean": 0.0})
        kept = iter([{}, {"kept_mass": 0.3}, {"kept_mass": 0.2}, {"kept_mass": 0.3}])
        lrn.update = lambda batch, kept=kept: {"loss": 0.0, **next(kept)}
        caplog.clear()
        with caplog.at_level("WARNING", logger="absl"):
            for _ in range(4):
                lrn.run_step()
        warned = [r.getMessage() for r in caplog.records if "kept_mass" in r.getMessage()]
        assert len(warned) == 1, (section, warned)
        assert warned[0].startswith(f"step 2: the sampled tokens' kept sets held 0.30 of the probability mass "
                                    f"(metric kept_mass), not config.{section}.top_p=0.9: "), warned[0]


@pytest.mark.parametrize("every,want", [(0, [5]), (2, [2, 4, 5]), (1, [1, 2, 3, 4, 5])])
def test_eval_every_zero_evaluates_at_the_end_only(every, want):
    """config.grpo.eval_every / config.agent.eval_every = 0 (0 means off elsewhere in the config) failed with a
    bare ZeroDivisionError after the first step's rollout and update; now it evaluates only at the last step. The
    learners' rollout, update and evaluation are stubbed (run_step's schedule alone)."""
    import types

    from dsv32_jax.train.agent_grpo import AgentLearner

    for cls, field in ((GRPOLearner, "g"), (AgentLearner, "a")):
        lrn = object.__new__(cls)
        lrn.step, lrn.config, evaluated = 0, types.SimpleNamespace(steps=5), []
        setattr(lrn, field, types.SimpleNamespace(eval_every=every, cold_start_steps=0, recall_steps=0))
        lrn.rollout = lambda step: ({}, {"reward_mean": 0.0})
        lrn.update = lambda batch: {"loss": 0.0}
        lrn.evaluate = lambda lrn=lrn, evaluated=evaluated: evaluated.append(lrn.step) or {"eval_accuracy": 0.0}
        for _ in range(5):
            lrn.run_step()
        assert evaluated == want, (cls.__name__, evaluated)
