"""Lightning indexer eq. (1): exact scores against numpy, FP8 path against the exact path, top-k edge cases."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

from dsv32_jax import attention
from dsv32_jax.indexer import index_scores, index_scores_fp8, indexer_topk, quantize_indexer, select_topk


def numpy_scores(q, k, w):
    dots = np.einsum("bthd,bsd->bths", q.astype(np.float64), k.astype(np.float64))
    return np.einsum("bths,bth->bts", np.maximum(dots, 0), w.astype(np.float64))


def random_inputs(rng, b=2, t=24, h=8, d=128):
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    k = rng.standard_normal((b, t, d)).astype(np.float32)
    k[..., 3] *= 20  # an outlier channel: what the Hadamard rotation is for
    w = (rng.standard_normal((b, t, h)) * (h * d) ** -0.5).astype(np.float32)
    return q, k, w


def test_exact_scores_match_numpy(rng):
    q, k, w = random_inputs(rng)
    assert rel_err(index_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w)), numpy_scores(q, k, w)) < 1e-5


def test_fp8_scores_within_quantization_error_and_selection_overlap(rng):
    q, k, w = random_inputs(rng, t=256)
    exact = numpy_scores(q, k, w)
    q8, k8, ks, wq = quantize_indexer(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w))
    approx = np.asarray(index_scores_fp8(q8, k8, ks, wq))
    # e4m3 relative rounding 2^-4 on each operand: |error| <= ~2 * 2^-4 * sum_j |w_j| |q_j| |k| (loose, per row)
    bound = 2 * 2.0**-4 * np.einsum("bth,bth,bs->bts", np.abs(w), np.linalg.norm(q, axis=-1), np.linalg.norm(k, axis=-1))
    assert np.all(np.abs(approx - exact) <= bound)
    err = rel_err(approx, exact)
    assert err < 0.05, err
    t = q.shape[1]
    vis = np.tril(np.ones((t, t), bool))[None].repeat(2, 0)
    kk = 32
    top_exact = np.asarray(select_topk(jnp.asarray(exact, jnp.float32), jnp.asarray(vis), kk))
    top_fp8 = np.asarray(select_topk(jnp.asarray(approx), jnp.asarray(vis), kk))
    rows = [(b, i) for b in range(2) for i in range(kk, t)]
    overlap = np.mean([len(set(top_exact[b, i]) & set(top_fp8[b, i])) / kk for b, i in rows])
    print(f"fp8 vs exact: score rel err {err:.4f}, top-{kk} selection overlap {overlap:.3f}")
    assert overlap > 0.85


def test_select_topk_fewer_valid_keys_than_k():
    scores = jnp.asarray([[[0.5, 2.0, -1.0, 7.0, 3.0]]])
    valid = jnp.asarray([[[True, True, True, False, False]]])
    np.testing.assert_array_equal(np.asarray(select_topk(scores, valid, 4)), [[[1, 0, 2, -1]]])


@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_topk_chunked_causal_and_segmented(rng, fp8):
    q, k, w = random_inputs(rng, t=37)
    b, t = q.shape[:2]
    q_index = np.broadcast_to(np.arange(t), (b, t)).astype(np.int32)
    seg = np.zeros((b, t), np.int32)
    seg[1, 20:] = 1  # second document in row 1
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(w), jnp.asarray(q_index), jnp.asarray(seg), jnp.asarray(seg))
    full = np.asarray(indexer_topk(*args, 6, fp8=fp8, q_chunk=None))
    chunked = np.asarray(indexer_topk(*args, 6, fp8=fp8, q_chunk=5))
    np.testing.assert_array_equal(full, chunked)
    vis = np.asarray(attention.visible(*args[3:]))
    for bi in range(b):
        for ti in range(t):
            sel = full[bi, ti]
            n_visible = vis[bi, ti].sum()
            assert (sel >= 0).sum() == min(6, n_visible)
            assert all(vis[bi, ti, j] for j in sel if j >= 0)
    assert full.shape == (b, t, 6)
    # topk larger than the sequence: k = min(index_topk, S)
    assert indexer_topk(*args, 1000).shape == (b, t, t)
