import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv32_jax.checkpoint.fp8_weights import dequant_fp8
from dsv32_jax.model.fp8 import (act_dequant, act_quant, fake_quant, fp8_scale, hadamard_matrix,
                           hadamard_rotate, ue8m0_round_up)


def test_hadamard_is_orthonormal_and_sylvester():
    h = hadamard_matrix(128).astype(np.float64) / np.sqrt(128)
    np.testing.assert_allclose(h @ h.T, np.eye(128), atol=1e-12)
    np.testing.assert_array_equal(hadamard_matrix(2), [[1, 1], [1, -1]])
    h4 = hadamard_matrix(4)
    np.testing.assert_array_equal(h4, np.block([[hadamard_matrix(2), hadamard_matrix(2)],
                                                [hadamard_matrix(2), -hadamard_matrix(2)]]))
    with pytest.raises(ValueError):
        hadamard_matrix(96)


def test_hadamard_preserves_dot_products(rng):
    q, k = rng.standard_normal((2, 5, 128)).astype(np.float32)
    hq, hk = np.asarray(hadamard_rotate(jnp.asarray(q))), np.asarray(hadamard_rotate(jnp.asarray(k)))
    np.testing.assert_allclose((hq * hk).sum(-1), (q * k).sum(-1), rtol=1e-4, atol=1e-4)
    assert not np.allclose(hq, q)


def test_act_quant_spec_example():
    x = np.zeros(128, np.float32)
    x[0], x[5] = 3.7, -1.0
    codes, scale = act_quant(jnp.asarray(x))
    assert float(scale[0]) == 2.0**-6  # smallest power of two >= 3.7 / 448
    assert codes.dtype == jnp.float8_e4m3fn
    expected = (x / 2.0**-6).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(codes).view(np.uint8), expected.view(np.uint8))
    assert float(np.max(np.abs(np.asarray(codes, np.float32)))) <= 448


def test_ue8m0_is_exact_power_of_two_ceiling(rng):
    s = rng.uniform(1e-6, 10, 1000).astype(np.float32)
    s = np.concatenate([s, 2.0 ** np.arange(-20, 5, dtype=np.float32)])
    r = np.asarray(ue8m0_round_up(jnp.asarray(s)))
    assert np.all(r >= s) and np.all(r < 2 * s)
    assert np.all(np.log2(r) == np.round(np.log2(r)))


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_non_finite_group_stays_non_finite_with_either_scale_format(bad):
    """ue8m0 turned an inf / NaN group's scale into 1.0 (frexp's exponent 0): the inf came back as a finite 448 and
    the group's other entries on a scale-1 grid (0.3 -> 0.3125), hiding the overflow that scale_fmt=None shows."""
    x = np.full((2, 128), 0.3, np.float32)
    x[0, 3] = bad
    for fmt in ("ue8m0", None):
        codes, scale = act_quant(jnp.asarray(x), scale_fmt=fmt)
        back = np.asarray(act_dequant(codes, scale))
        assert not np.isfinite(back[0, 3]) and not np.isfinite(float(scale[0, 0])), fmt
        np.testing.assert_allclose(back[1], x[1], rtol=2.0**-4)  # the finite group is untouched
    assert float(ue8m0_round_up(jnp.float32(bad))) != 1.0


def test_non_ue8m0_scale_and_roundtrip_error(rng):
    x = jnp.asarray(rng.standard_normal((4, 256)) * 3, jnp.float32)
    codes, scale = act_quant(x, scale_fmt=None)
    np.testing.assert_allclose(np.asarray(scale), np.abs(np.asarray(x)).reshape(4, 2, 128).max(-1) / 448, rtol=1e-6)
    back = np.asarray(act_dequant(codes, scale))
    # e4m3 keeps 3 mantissa bits: relative error per element <= 2^-4 (plus subnormal floor)
    err = np.abs(back - np.asarray(x))
    bound = np.abs(np.asarray(x)) * 2.0**-4 + np.repeat(np.asarray(scale), 128, -1) * 2.0**-9
    assert np.all(err <= bound)
    np.testing.assert_array_equal(np.asarray(fake_quant(x, scale_fmt=None)), back)


def test_fp8_scale_is_the_ieee_quotient_eager_and_under_jit(rng):
    """jax 0.12.1's XLA turns amax / 448 into amax * fl(1/448) under jit: 84 / 448 came out 0.18750001, not 0.1875,
    and x / s then rounded exact e4m3 ties (28.5 / 0.1875 = 152) to the other neighbour (CI, 2026-12-06: 0.19% of
    the bf16 codes). numpy's f32 division is the IEEE quotient; every amax must give exactly it, in both modes."""
    import jax

    amax = np.concatenate([
        np.exp(rng.uniform(np.log(1e-4), np.log(3e38), 20000)),  # every binade from the 1e-4 floor to the f32 max
        rng.integers(1, 1 << 16, 20000) * 2.0 ** rng.integers(-20, 20, 20000),  # short mantissas: bf16 / fp8 values
        448.0 * 2.0 ** np.arange(-13, 100), [84.0, 1e-4, 448.0 - 2.0**-15],
    ]).astype(np.float32)
    want = amax / np.float32(448)
    with jax.numpy_dtype_promotion("strict"):
        eager, jitted = np.asarray(fp8_scale(jnp.asarray(amax))), np.asarray(jax.jit(fp8_scale)(jnp.asarray(amax)))
    np.testing.assert_array_equal(eager, want)
    np.testing.assert_array_equal(jitted, want)
    special = np.asarray(jax.jit(fp8_scale)(jnp.asarray([np.inf, np.nan], jnp.float32)))
    assert special[0] == np.inf and np.isnan(special[1])
    # act_quant under jit, scale and codes, against numpy's IEEE arithmetic on bf16-like rows (short mantissas make
    # exact e4m3 ties common: the row [84, 28.5, ...] has scale 0.1875 and 28.5 / 0.1875 = 152, a tie, to 160)
    x = (rng.integers(-255, 256, (512, 128)) * 2.0 ** rng.integers(-8, 4, (512, 1))).astype(np.float32)
    x[0] = 28.5
    x[0, 0] = 84.0
    codes, scale = jax.jit(lambda x: act_quant(x, scale_fmt=None))(jnp.asarray(x))
    s = np.maximum(np.abs(x).max(-1, keepdims=True), np.float32(1e-4)) / np.float32(448)
    np.testing.assert_array_equal(np.asarray(scale), s)
    want = np.clip(x / s, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(codes).view(np.uint8), want.view(np.uint8))
    assert float(codes[0, 1].astype(jnp.float32)) == 160.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fake_quant_is_differentiated_straight_through(rng, dtype):
    """The FP8-KV simulation changes the forward only: d fake_quant(x) . g / dx = g at every gradient magnitude.
    (Autodiff of the round trip casts g to e4m3 without a scale: at |g| ~ 1e-3 every entry came out 0.)"""
    import jax

    x = jnp.asarray(rng.standard_normal((4, 256)) * 3, dtype)
    codes, scale = act_quant(x)
    np.testing.assert_array_equal(np.asarray(fake_quant(x), np.float32),
                                  np.asarray(act_dequant(codes, scale, dtype), np.float32))
    for magnitude in (1.0, 1e-3, 1e-6):
        g = jnp.asarray(rng.standard_normal((4, 256)) * magnitude, dtype)
        got = jax.grad(lambda x: jnp.sum((fake_quant(x) * g).astype(jnp.float32)))(x)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(g, np.float32))


def test_fp8_kv_training_gradient_reaches_the_kv_projection():
    """A model with the FP8 latent cache simulated (RunOptions.fp8_kv) trains its c_kv producers: the LM loss's
    gradient w.r.t. kv_a_proj is within 10% of the bf16-cache model's (it was exactly 0)."""
    import jax
    from flax import nnx

    from dsv32_jax import RunOptions, Transformer, load_preset
    from dsv32_jax.train import losses

    cfg = load_preset("tiny").replace(num_hidden_layers=1)
    tok = jnp.asarray(np.random.default_rng(0).integers(2, cfg.vocab_size, (2, 24)), jnp.int32)
    batch = dict(targets=jnp.roll(tok, -1, 1), loss_mask=jnp.ones((2, 24), jnp.float32).at[:, -1].set(0))
    grads = {}
    for fp8_kv in (False, True):
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0), options=RunOptions(fp8_kv=fp8_kv)))
        g = jax.grad(lambda p: losses.lm_loss(nnx.merge(graphdef, p)(tok, mtp=False), batch))(params)
        grads[fp8_kv] = np.asarray(g["layers"][0]["attn"]["kv_a_proj"]["kernel"][...])[:, :cfg.kv_lora_rank]
    assert np.mean(grads[True] == 0) < 0.01
    rel = np.linalg.norm(grads[True] - grads[False]) / np.linalg.norm(grads[False])
    assert 0 < rel < 0.1, rel


def test_checkpoint_dequant_crops_ragged_edges(rng):
    """float64 per-element oracle for the 128x128 block dequantization of checkpoint weights (kv_a's 576 rows)."""
    w = rng.standard_normal((576, 200)).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(0.5, 2.0, (5, 2)).astype(np.float32)  # not powers of two
    out = dequant_fp8(w, s)
    ref = np.empty((576, 200), np.float64)
    for i in range(576):
        for j in range(200):
            ref[i, j] = float(w[i, j]) * s[i // 128, j // 128]
    np.testing.assert_allclose(out, ref, rtol=1e-7)
    with pytest.raises(ValueError, match="scale shape"):
        dequant_fp8(w, s[:4])


def test_fp8_scales_at_the_edges_against_spec_values():
    """Mutation survivors (tests/mutate.sh, 2026-11-30), against values from the spec, not the code: act_quant's
    amax floor is 1e-4 (reference_spec.md, FP8 formats), so a group of tiny activations gets the ue8m0 scale
    2^ceil(log2(1e-4 / 448)) = 2^-22 (a floor of 1e-6 passed); quantize_fp8 gives an all-zero 128 x 128 block the
    scale 1.0, not 0 (whose codes dequantize to NaN); a checkpoint's inf weight_scale_inv makes convert_tensor report
    the tensor non-finite (the check looked at the codes only)."""
    import jax.numpy as jnp

    from dsv32_jax.checkpoint import fp8_weights as fw
    from dsv32_jax.model.fp8 import act_quant

    x = jnp.full((1, 128), 1.234e-9, jnp.float32).at[0, 0].set(1e-5)
    _, scale = act_quant(x)
    assert float(scale[0, 0]) == 2.0 ** np.ceil(np.log2(1e-4 / 448)) == 2.0 ** -22
    w = np.zeros((128, 256), np.float32)
    w[:, 128:] = np.random.default_rng(0).standard_normal((128, 128))
    codes, scale = fw.quantize_fp8(w)
    assert scale[0, 0] == 1.0 and np.isfinite(fw.dequant_fp8(codes, scale)).all()
    np.testing.assert_array_equal(fw.dequant_fp8(codes, scale)[:, :128], 0.0)
    bad = scale.copy()
    bad[0, 0] = np.inf
    assert fw.convert_tensor(codes, scale, np.float32, False)[1]
    assert not fw.convert_tensor(codes, bad, np.float32, False)[1]
