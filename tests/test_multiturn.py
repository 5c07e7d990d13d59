"""Multi-turn sampling over one decode cache (dsv32_jax.sampler.MultiTurnSampler): the recorded log-probs, kept
sets, expert routing and indexer selections of every generated token equal a teacher-forced forward over the whole
trajectory's layout, with rows that stop at different turns and pieces of different lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv32_jax import Transformer, load_preset
from dsv32_jax.sampler import MultiTurnSampler, SamplingConfig
from dsv32_jax.train.grpo_loss import processed_logprobs


@pytest.fixture(scope="module")
def trajectory():
    cfg = load_preset("tiny").replace(initializer_range=0.1, index_topk=8)
    model = Transformer(cfg, rngs=nnx.Rngs(7), dtype=jnp.float32)
    rng = np.random.default_rng(11)
    scfg = SamplingConfig(max_new_tokens=6, temperature=1.0, top_k=12, max_candidates=16, eos_id=1, pad_id=0)
    sampler = MultiTurnSampler(model, batch=3, capacity=160, cfg=scfg)
    turns = [([5, 9, 3], [True, True, True]), ([4, 0, 7], [True, False, True]), ([3, 0, 0], [True, False, False])]
    outs = []
    for t, (lengths, live) in enumerate(turns):
        pieces = [[int(x) for x in rng.integers(2, cfg.vocab_size, n)] for n in lengths]
        outs.append(sampler.step(pieces, live, jax.random.key(t)))
    return model, sampler, outs, turns


def test_generated_tokens_match_the_teacher_forced_forward(trajectory):
    model, sampler, outs, turns = trajectory
    rec = jax.device_get(sampler.layout())
    for t, (lengths, live) in enumerate(turns):  # rows that stopped get nothing; live rows get 1..6 tokens
        for i in range(3):
            assert (len(outs[t][i]) > 0) == live[i]
    logits, aux = model(jnp.asarray(rec["tokens"]), positions=jnp.asarray(rec["positions"]),
                        segment_ids=jnp.asarray(rec["segments"]), return_aux=True, mtp=False)
    gen = rec["generated"] > 0
    assert gen.sum() == sum(len(o) for turn in outs for o in turn)
    # each generated token was sampled from the previous slot's logits (the last piece token or the previous one)
    prev = np.asarray(logits)[:, :-1]
    logp, _, _ = processed_logprobs(jnp.asarray(prev), jnp.asarray(rec["tokens"][:, 1:]),
                                    jnp.asarray(rec["kept_ids"][:, 1:]), jnp.asarray(rec["kept_mask"][:, 1:]), 1.0)
    diff = np.abs(np.asarray(logp) - rec["logprobs"][:, 1:])[gen[:, 1:]]
    print(f"{gen.sum()} generated tokens; max |logp sampler - teacher forced| = {diff.max():.2e}")
    assert diff.max() < 1e-5
    real = rec["segments"] > 0
    for k, ids in rec["routing"].items():
        native = np.sort(np.asarray(aux["routing"][k]), -1)
        np.testing.assert_array_equal(native[real], np.sort(ids, -1)[real], err_msg=f"routing layer {k}")
    assert rec["topk"], "the DSA layers recorded their selections"
    for k, sel in rec["topk"].items():
        native = np.asarray(aux["topk"][k])
        for b, t in zip(*np.nonzero(real)):
            want = set(int(x) for x in sel[b, t] if x >= 0)
            got = set(int(x) for x in native[b, t] if x >= 0)
            assert got == want, (k, b, t, sorted(got), sorted(want))


def test_positions_continue_per_row_and_padding_is_invisible(trajectory):
    _, sampler, outs, turns = trajectory
    rec = jax.device_get(sampler.layout())
    for i in range(3):
        real = rec["segments"][i] > 0
        np.testing.assert_array_equal(rec["positions"][i][real], np.arange(real.sum()))  # 0, 1, 2, ... per row
        total = sum(n for lengths, _ in turns for n in [lengths[i]]) + sum(len(o[i]) for o in outs)
        assert real.sum() == total
    assert sampler.index == rec["tokens"].shape[1] <= sampler.capacity
    with pytest.raises(ValueError, match="live row 0 has no new context"):
        sampler.step([[], [], []], [True, False, False], jax.random.key(9))
    with pytest.raises(ValueError, match="exceed the capacity"):
        sampler.step([[5] * 200, [], []], [True, False, False], jax.random.key(9))
