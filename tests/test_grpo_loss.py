"""GRPO stabilizers: unbiased-KL gradient (exact expectation on a categorical), OPSM truth table, group checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv32_jax.train.grpo_loss import (check_groups, group_advantages, grpo_loss, opsm_mask, processed_logprobs,
                             unbiased_kl)


def categorical(rng, n=7):
    return [jnp.asarray(rng.standard_normal(n) * s, jnp.float32) for s in (1.0, 1.0, 1.0)]


def test_unbiased_kl_gradient_is_the_true_kl_gradient_in_expectation(rng):
    """E_{x ~ pi_old}[grad (pi_theta/pi_old)(x) k3(x)] = grad KL(pi_theta || pi_ref) exactly, for pi_theta != pi_old;
    plain k3 (no ratio) gives a different gradient."""
    theta, old, ref = categorical(rng)
    logp_old = jax.nn.log_softmax(old)
    logp_ref = jax.nn.log_softmax(ref)
    p_old = jnp.exp(logp_old)

    def expected(th, with_ratio):
        logp = jax.nn.log_softmax(th)
        per_sample = unbiased_kl(logp, logp_old, logp_ref) if with_ratio else (
            jnp.exp(logp_ref - logp) - (logp_ref - logp) - 1.0)
        return jnp.sum(p_old * per_sample)  # exact expectation over the categorical

    def true_kl(th):
        logp = jax.nn.log_softmax(th)
        return jnp.sum(jnp.exp(logp) * (logp - logp_ref))

    g_true = jax.grad(true_kl)(theta)
    g_unbiased = jax.grad(expected)(theta, True)
    g_k3 = jax.grad(expected)(theta, False)
    np.testing.assert_allclose(g_unbiased, g_true, atol=1e-5)
    assert float(jnp.max(jnp.abs(g_k3 - g_true))) > 1e-2
    assert float(expected(theta, True)) == pytest.approx(float(true_kl(theta)), rel=1e-4)


def test_unbiased_kl_is_accurate_near_the_reference(rng):
    """Early in RL the policy is the reference to ~1e-3 in log-prob, where k3 = e^x - x - 1 ~ x^2 / 2 ~ 5e-7 per
    token: computed as exp(x) - x - 1 in float32 it is rounding (exp(x) is known to ~6e-8). Summed over tokens
    against float64 of the same float32 inputs: measured 2.2e-6 relative at log-ratio scale 1e-3, 2.1e-7 at 1e-2;
    mutant exp(x) - x - 1 (caught): 1.4e-2 and 1.4e-5."""
    for scale in (1e-2, 1e-3):
        logp = (rng.standard_normal((8, 64)) - 3).astype(np.float32)
        logp_ref = (logp + scale * rng.standard_normal(logp.shape)).astype(np.float32)
        logp_old = (logp + 0.01 * rng.standard_normal(logp.shape)).astype(np.float32)
        x = logp_ref.astype(np.float64) - logp.astype(np.float64)
        ref = np.exp(logp.astype(np.float64) - logp_old) * (np.expm1(x) - x)
        got = np.asarray(unbiased_kl(jnp.asarray(logp), jnp.asarray(logp_old), jnp.asarray(logp_ref)), np.float64)
        assert abs(got.sum() - ref.sum()) <= 2e-5 * ref.sum(), (scale, got.sum(), ref.sum())


def test_opsm_truth_table():
    # rows: (advantage, mean log(pi_old/pi_theta)) -> kept?
    cases = [(-1.0, 0.9, 0.0), (-1.0, 0.1, 1.0), (1.0, 0.9, 1.0), (1.0, 0.1, 1.0), (0.0, 0.9, 1.0), (-0.5, 0.5, 1.0)]
    adv = jnp.asarray([c[0] for c in cases])
    div = jnp.asarray([c[1] for c in cases])
    t = 4
    logp = jnp.zeros((len(cases), t))
    logp_old = jnp.broadcast_to(div[:, None], (len(cases), t))
    mask = jnp.ones((len(cases), t))
    keep, measured = opsm_mask(logp, logp_old, adv, mask, delta=0.5)
    np.testing.assert_allclose(np.asarray(measured), np.asarray(div), atol=1e-7)
    np.testing.assert_array_equal(np.asarray(keep), [c[2] for c in cases])


def test_opsm_mask_multiplies_only_the_policy_gradient(rng):
    b, t = 2, 5
    logp = jnp.asarray(rng.standard_normal((b, t)) * 0.1 - 1, jnp.float32)
    logp_old = logp + 1.0  # far off-policy: mean log(pi_old/pi_theta) = 1 > delta
    logp_ref = logp - 0.3
    adv = jnp.asarray([-1.0, 1.0])
    mask = jnp.ones((b, t))
    beta = jnp.asarray([0.5, 0.5])
    loss, m = grpo_loss(logp, logp_old, logp_ref, adv, mask, beta, delta=0.5)
    assert float(m["opsm_masked_fraction"]) == 0.5
    g = jax.grad(lambda lp: grpo_loss(lp, logp_old, logp_ref, adv, mask, beta, delta=0.5)[0])(logp)
    g_kl = jax.grad(lambda lp: jnp.mean(jnp.sum(unbiased_kl(lp, logp_old, logp_ref) * 0.5, -1) / t))(logp)
    np.testing.assert_allclose(np.asarray(g)[0], np.asarray(g_kl)[0], rtol=1e-5)  # masked row: KL only


def test_token_mean_per_sequence_then_mean():
    """Eq. (5): a sequence's weight does not grow with its length. Advantages [1, -1] over 6 and 2 tokens at ratio 1:
    pg_t = -A, so each row's token mean is -1 and +1 and the loss is 0; a global token mean over the batch (the
    mutation `loss = sum(mask * per_token) / sum(mask)`) gives (6 x -1 + 2 x 1) / 8 = -0.5, and a per-sequence token
    SUM (no 1/|o_i|) gives (-6 + 2) / 2 = -2. The gradient w.r.t. each token's log-prob is -A_i / (B |o_i|)."""
    logp = jnp.zeros((2, 6))
    mask = jnp.asarray([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]], jnp.float32)
    adv = jnp.asarray([1.0, -1.0])
    loss, m = grpo_loss(logp, logp, logp, adv, mask, jnp.zeros(2))
    assert float(loss) == pytest.approx(0.0, abs=1e-7)
    assert float(m["pg_loss"]) == pytest.approx(0.0, abs=1e-7)
    g = jax.grad(lambda lp: grpo_loss(lp, logp, logp, adv, mask, jnp.zeros(2))[0])(logp)
    expected = np.asarray(mask) * (-np.asarray(adv)[:, None] / (2 * np.asarray(mask).sum(1, keepdims=True)))
    np.testing.assert_allclose(np.asarray(g), expected, atol=1e-7)


def numpy_clipped_surrogate(logp, logp_old, adv, mask, eps):
    """-min(r A, clip(r, 1 - eps, 1 + eps) A) per token, token mean per row, mean over rows (float64)."""
    r = np.exp(np.asarray(logp, np.float64) - np.asarray(logp_old, np.float64))
    a = np.asarray(adv, np.float64)[:, None]
    pg = -np.minimum(r * a, np.clip(r, 1 - eps, 1 + eps) * a)
    mask = np.asarray(mask, np.float64)
    return np.mean((pg * mask).sum(1) / mask.sum(1)), pg


def test_ppo_ratio_clipping_outside_the_trust_region():
    """Ratios on both sides of [1 - eps, 1 + eps] with positive and negative advantages, against numpy. The clip
    binds (min picks the clipped term) for r > 1 + eps with A > 0 and for r < 1 - eps with A < 0: those tokens get
    zero gradient; r < 1 - eps with A > 0 and r > 1 + eps with A < 0 stay unclipped (pessimistic bound) and keep
    theirs. Mutation `clipped = ratio * a` (no clip): the loss moves from 0.05 to -0.025 and the clipped tokens get
    gradient, both fail; mutation `jnp.maximum` for `jnp.minimum`: fails the values."""
    eps = 0.2
    ratios = np.array([[1.5, 0.5, 1.1, 1.0], [1.5, 0.5, 0.9, 1.0]])
    adv = np.array([1.0, -1.0])
    logp_old = np.full(ratios.shape, -1.0)
    logp = logp_old + np.log(ratios)
    mask = np.ones(ratios.shape)
    args = [jnp.asarray(x, jnp.float32) for x in (logp, logp_old)]
    loss, m = grpo_loss(args[0], args[1], args[1], jnp.asarray(adv, jnp.float32), jnp.asarray(mask, jnp.float32),
                        jnp.zeros(2), eps=eps, delta=1e9)
    ref, pg = numpy_clipped_surrogate(logp, logp_old, adv, mask, eps)
    # row 0 (A=+1): -[1.2, 0.5, 1.1, 1.0]; row 1 (A=-1): [1.5, 0.8, 0.9, 1.0]
    np.testing.assert_allclose(pg, [[-1.2, -0.5, -1.1, -1.0], [1.5, 0.8, 0.9, 1.0]], atol=1e-12)
    assert ref == pytest.approx(0.05)
    assert float(loss) == pytest.approx(ref, abs=1e-6)
    assert float(m["clip_fraction"]) == pytest.approx(2 / 8)
    g = np.asarray(jax.grad(lambda lp: grpo_loss(lp, args[1], args[1], jnp.asarray(adv, jnp.float32),
                                                 jnp.asarray(mask, jnp.float32), jnp.zeros(2), eps=eps,
                                                 delta=1e9)[0])(args[0]))
    clipped = np.array([[1, 0, 0, 0], [0, 1, 0, 0]], bool)
    np.testing.assert_array_equal(g[clipped], 0.0)
    # unclipped tokens: d/dlogp of -r A / (B T) = -r A / 8
    np.testing.assert_allclose(g[~clipped], (-ratios * adv[:, None] / 8)[~clipped], rtol=1e-5)


def test_advantages_and_group_checks():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = np.array([0, 0, 1, 1, 2, 2])
    np.testing.assert_allclose(group_advantages(rewards, groups), [0.5, -0.5, -0.5, 0.5, 0.0, 0.0])
    prompts = np.array([[1, 2], [1, 2], [3, 4], [3, 4], [5, 6], [5, 6]])
    check_groups(groups, prompts, 2)
    with pytest.raises(ValueError, match="mixes different prompts"):
        check_groups(groups, prompts[[0, 2, 1, 3, 4, 5]], 2)
    with pytest.raises(ValueError, match="has 3 completions"):
        check_groups(np.array([0, 0, 0, 1, 2, 2]), prompts, 2)


def test_processed_logprobs_restrict_to_kept_set(rng):
    logits = jnp.asarray(rng.standard_normal((1, 1, 10)), jnp.float32)
    kept_ids = jnp.asarray([[[3, 7, 1]]])
    kept_mask = jnp.asarray([[[True, True, False]]])
    tok = jnp.asarray([[7]])
    logp, ent, mass = processed_logprobs(logits, tok, kept_ids, kept_mask, 1.0)
    z = np.asarray(logits)[0, 0]
    expected = z[7] - np.log(np.exp(z[3]) + np.exp(z[7]))
    assert float(logp[0, 0]) == pytest.approx(expected, abs=1e-6)
    p = np.exp(z) / np.exp(z).sum()
    assert float(mass[0, 0]) == pytest.approx(p[3] + p[7], rel=1e-5)
    assert float(ent[0, 0]) > 0


def test_slots_the_sampler_never_wrote_give_finite_loss_and_gradients(rng):
    """After an early stop the sampler leaves kept ids 0, kept mask False and the token pad_id: with a pad id that is
    not 0 that slot's kept set was empty, its log-prob nan, and the masked loss (mask x nan) nan."""
    logits = jnp.asarray(rng.standard_normal((1, 2, 10)), jnp.float32)
    kept_ids = jnp.asarray([[[3, 7, 1], [0, 0, 0]]])
    kept_mask = jnp.asarray([[[True, True, False], [False, False, False]]])
    tok, mask = jnp.asarray([[7, 5]]), jnp.asarray([[1.0, 0.0]])  # pad_id 5 in the unwritten slot
    old = jnp.asarray([[-0.5, 0.0]])

    def loss(logits):
        logp, _, _ = processed_logprobs(logits, tok, kept_ids, kept_mask, 1.0)
        return grpo_loss(logp, old, old, jnp.asarray([1.0]), mask, jnp.asarray([0.1]))[0], logp

    (value, logp), grad = jax.value_and_grad(loss, has_aux=True)(logits)
    z = np.asarray(logits, np.float64)[0, 0]
    assert float(logp[0, 0]) == pytest.approx(z[7] - np.log(np.exp(z[3]) + np.exp(z[7])), abs=1e-6)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
    assert not np.any(np.asarray(grad)[0, 1])  # the masked slot contributes nothing


def test_processed_logprobs_match_numpy_at_a_temperature_with_the_sampled_token_kept():
    """log pi(token) under the sampler's processed distribution, against float64 numpy: logits / T, restricted to the
    recorded kept set plus the sampled token (a kept set the sampler recorded without it, e.g. its mask cut at
    top-p before the token it then drew, still holds it), renormalized; the full softmax at T without a kept set;
    entropy and the untruncated mass of the set. The tests before used T = 1 only: a step that dropped the
    temperature (or the sampled token from its set) passed them (tests/mutate.sh survivors, 2026-11-30)."""
    from dsv32_jax.train.grpo_loss import processed_logprobs

    rng = np.random.default_rng(7)
    logits = rng.standard_normal((2, 3, 12)).astype(np.float32) * 2
    kept_ids = rng.permuted(np.tile(np.arange(12), (2, 3, 1)), axis=-1)[..., :5].astype(np.int32)
    kept_mask = np.ones((2, 3, 5), bool)
    kept_mask[..., 3:] = False  # the last two candidates were cut (top-p)
    tokens = kept_ids[..., 0].copy()
    tokens[0, 1] = kept_ids[0, 1, 4]  # a token recorded outside the kept mask: it is in its own set
    for temp in (1.0, 0.7, 1.6):
        z = logits.astype(np.float64) / temp
        logp, ent, mass = (np.asarray(x) for x in processed_logprobs(logits, tokens, kept_ids, kept_mask, temp))
        full = z - np.log(np.exp(z).sum(-1, keepdims=True))
        for b, t in np.ndindex(2, 3):
            keep = kept_mask[b, t] | (kept_ids[b, t] == tokens[b, t])
            ids = kept_ids[b, t][keep]
            logq = z[b, t, ids] - np.log(np.exp(z[b, t, ids]).sum())
            want = logq[list(ids).index(tokens[b, t])]
            np.testing.assert_allclose(logp[b, t], want, rtol=1e-5, atol=1e-6, err_msg=f"T={temp} {b},{t}")
            np.testing.assert_allclose(ent[b, t], -(np.exp(logq) * logq).sum(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(mass[b, t], np.exp(full[b, t, ids]).sum(), rtol=1e-5, atol=1e-6)
        logp_full, ent_full, _ = processed_logprobs(logits, tokens, kept_ids[..., :0], kept_mask[..., :0], temp)
        np.testing.assert_allclose(np.asarray(logp_full), np.take_along_axis(full, tokens[..., None], -1)[..., 0],
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(ent_full), -(np.exp(full) * full).sum(-1), rtol=1e-5, atol=1e-6)
