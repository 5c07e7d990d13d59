import numpy as np
import jax.numpy as jnp
import pytest

from dsv32_jax import load_preset
from dsv32_jax.model.rope import apply_rope_half, apply_rope_interleaved, rope_angles, yarn_inv_freq


def test_yarn_table_671b():
    cfg = load_preset("deepseek_v32_671b")
    f = yarn_inv_freq(cfg).astype(np.float64)
    base = 1.0 / (10000.0 ** (np.arange(0, 64, 2) / 64))
    assert f[0] == 1.0
    assert f[31] == pytest.approx(3.334e-6, rel=1e-3)
    np.testing.assert_allclose(f[:11], base[:11], rtol=1e-6)  # i <= low = 10: unchanged
    np.testing.assert_allclose(f[23:], base[23:] / 40, rtol=1e-6)  # i >= high = 23: interpolated by 40
    assert np.all((f[11:23] < base[11:23]) & (f[11:23] > base[11:23] / 40))


def test_softmax_scale_671b():
    cfg = load_preset("deepseek_v32_671b")
    assert cfg.softmax_scale == pytest.approx(0.13523378, abs=1e-8)
    assert cfg.replace(rope_type="default").softmax_scale == pytest.approx(192**-0.5)
    assert cfg.rope_attention_factor == 1.0


def _angles(rng, n):
    theta = rng.uniform(-3, 3, size=(n,)).astype(np.float32)
    return jnp.cos(theta), jnp.sin(theta), theta


def test_interleaved_pairs_adjacent_dims(rng):
    x = rng.standard_normal((3, 8)).astype(np.float32)
    cos, sin, theta = _angles(rng, 4)
    out = np.asarray(apply_rope_interleaved(jnp.asarray(x), cos, sin))
    z = (x[:, 0::2] + 1j * x[:, 1::2]) * np.exp(1j * theta)  # pair (2i, 2i+1) as a complex number
    np.testing.assert_allclose(out[:, 0::2], z.real, atol=1e-5)
    np.testing.assert_allclose(out[:, 1::2], z.imag, atol=1e-5)


def test_half_pairs_split_dims(rng):
    x = rng.standard_normal((3, 8)).astype(np.float32)
    cos, sin, theta = _angles(rng, 4)
    out = np.asarray(apply_rope_half(jnp.asarray(x), cos, sin))
    rotate_half = np.concatenate([-x[:, 4:], x[:, :4]], axis=-1)
    c2, s2 = np.tile(np.cos(theta), 2), np.tile(np.sin(theta), 2)
    np.testing.assert_allclose(out, x * c2 + rotate_half * s2, atol=1e-5)
    assert not np.allclose(out, np.asarray(apply_rope_interleaved(jnp.asarray(x), cos, sin)))


@pytest.mark.parametrize("rope", [apply_rope_half, apply_rope_interleaved])
def test_scores_depend_only_on_relative_position(rope, rng):
    cfg = load_preset("tiny")
    inv = yarn_inv_freq(cfg)
    q = jnp.asarray(rng.standard_normal(cfg.qk_rope_head_dim), jnp.float32)
    k = jnp.asarray(rng.standard_normal(cfg.qk_rope_head_dim), jnp.float32)

    def score(pq, pk):
        cq, sq = rope_angles(jnp.asarray(pq), inv)
        ck, sk = rope_angles(jnp.asarray(pk), inv)
        return float(jnp.dot(rope(q, cq, sq), rope(k, ck, sk)))

    assert score(7, 3) == pytest.approx(score(107, 103), rel=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 5), rel=1e-3)
