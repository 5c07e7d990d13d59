"""Multi-token prediction against independent references: the MTP targets and mask of packed documents (a numpy
loop over positions and segments), and the MTP module's shifted concatenation, projection, chaining between
depths and shared head (numpy around the model's own decoder block, which the HF parity tests hold)."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from flax import nnx

from dsv32_jax import RunOptions, Transformer, load_preset
from dsv32_jax.train.losses import mtp_loss, mtp_targets


def packed_batch(rng, b=3, t=24, vocab=50):
    """Rows of documents packed back to back (segment ids 1, 2, ...; 0 = trailing padding), targets = the next
    token of the same document, loss_mask = 1 where there is one."""
    tokens = rng.integers(2, vocab, (b, t))
    seg = np.zeros((b, t), np.int32)
    for r in range(b):
        pos, s = 0, 1
        while pos < t - 3:
            n = int(rng.integers(2, 9))
            seg[r, pos:pos + n] = s
            pos, s = pos + n, s + 1
    tokens = np.where(seg > 0, tokens, 0)
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    loss_mask = np.concatenate([same, np.zeros((b, 1), bool)], 1).astype(np.float32)
    targets = np.where(loss_mask > 0, np.concatenate([tokens[:, 1:], np.zeros((b, 1), int)], 1), 0)
    return tokens, seg, {"tokens": jnp.asarray(tokens, jnp.int32), "targets": jnp.asarray(targets, jnp.int32),
                         "loss_mask": jnp.asarray(loss_mask), "segment_ids": jnp.asarray(seg)}


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_mtp_targets_match_a_loop_over_documents(rng, depth):
    """Depth d at position t predicts token t+2+d of the same document: valid iff t..t+2+d all lie in t's (non-
    padding) segment. Mutations: one shift too few (`range(depth)` in mtp_targets) -> depth 0 predicts t+1; the
    mask not accumulated over the steps (`mask = step_mask`) -> positions whose document ends in between count."""
    tokens, seg, batch = packed_batch(rng)
    targets, mask = (np.asarray(a) for a in mtp_targets(batch, depth))
    b, t = tokens.shape
    ref_t, ref_m = np.zeros((b, t), int), np.zeros((b, t))
    for r in range(b):
        for i in range(t):
            j = i + 2 + depth
            if j < t and seg[r, i] > 0 and np.all(seg[r, i:j + 1] == seg[r, i]):
                ref_t[r, i], ref_m[r, i] = tokens[r, j], 1.0
    assert ref_m.sum() > 10
    np.testing.assert_array_equal(mask, ref_m)
    np.testing.assert_array_equal(np.where(ref_m > 0, targets, 0), ref_t)


def rms(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(w, np.float64)


def test_mtp_module_matches_a_numpy_reference_at_two_depths(rng):
    """Depth j: x = eh_proj([enorm(Emb(t_{i+1+j})) ; hnorm(h^{j-1}_i)]) (embedding half first, token past the end
    = 0), h^j = the MTP block (the model's DecoderLayer, run on the numpy x), logits = lm_head(norm_j(h^j)) with the
    main model's embedding and head; h^{-1} = the main model's final normed state, h^j feeds depth j+1 un-normed.
    Norm scales and the head are randomized so that swapping any two of them shows. Mutations: concatenation order
    swapped, shift by j+2, the main norm instead of the MTP norm, the normed h^j fed to the next depth: each fails,
    and so does the MTP loss against numpy cross-entropy of these logits on mtp_targets."""
    cfg = load_preset("tiny").replace(num_nextn_predict_layers=2, initializer_range=0.2, vocab_size=64)
    model = Transformer(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))), options=RunOptions())
    for norm in [model.norm] + [n for m in model.mtp for n in (m.enorm, m.hnorm, m.norm)]:
        norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, cfg.hidden_size), jnp.float32)
    tokens, _, batch = packed_batch(rng, b=2, t=20, vocab=64)
    logits, aux = model(batch["tokens"], return_aux=True)
    got = aux["mtp_logits"]
    assert len(got) == 2
    emb = np.asarray(model.embed[...], np.float64)
    head = np.asarray(model.lm_head.kernel[...], np.float64)
    pos = model.positions(batch["tokens"])
    h = np.asarray(aux["hidden"], np.float64)
    eps = cfg.rms_norm_eps
    for j, mtp in enumerate(model.mtp):
        nxt = np.concatenate([tokens[:, 1 + j:], np.zeros((tokens.shape[0], 1 + j), int)], 1)
        x = np.concatenate([rms(emb[nxt], mtp.enorm.scale[...], eps), rms(h, mtp.hnorm.scale[...], eps)], -1)
        x = x @ np.asarray(mtp.eh_proj.kernel[...], np.float64)
        h_new, _ = mtp.block(jnp.asarray(x, jnp.float32), pos, model.options)
        h = np.asarray(h_new, np.float64)
        ref = rms(h, mtp.norm.scale[...], eps) @ head
        err = rel_err(got[j], ref)
        print(f"MTP depth {j}: rel err {err:.2e}")
        assert err < 1e-4, f"depth {j}"
    # the MTP loss: mean over depths of the token mean of -log softmax(logits_j)[target] on the valid positions
    per_depth = []
    for j in range(2):
        t, m = (np.asarray(a) for a in mtp_targets(batch, j))
        z = np.asarray(got[j], np.float64)
        logp = z - z.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll = -np.take_along_axis(logp, t[..., None], -1)[..., 0]
        per_depth.append((nll * m).sum() / m.sum())
    assert float(mtp_loss(got, batch)) == pytest.approx(np.mean(per_depth), rel=1e-5)


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_mtp_weight_zero_leaves_the_mtp_layer_out_of_every_loss(rng, stage):
    """With loss.mtp_weight 0 (the default; every preset has an MTP layer) the MTP parameters are frozen, so the
    MTP layer must not change the objective: loss, metrics and gradients equal those of the same main-model
    weights without an MTP layer (fp32; measured equal to ~1e-7, bound 1e-5 relative). It ran: its indexer's KL
    joined the sparse stage's average (0.902 against 0.890, each main indexer's gradient scaled by 3/4 in a 3-layer
    model) and its router's balance loss reached the embedding through the MTP block's input (1.7e-3 off).
    Mutant: lm_objective without the mtp flag (the MTP layer runs)."""
    import jax

    from dsv32_jax.train import steps

    tokens, seg, batch = packed_batch(rng, b=2, t=24)
    starts = [[int(np.argmax(row == row[i])) for i in range(len(row))] for row in seg]  # each document's start
    batch["positions"] = jnp.asarray(np.arange(seg.shape[1])[None] - np.asarray(starts), jnp.int32)
    opts = RunOptions(dsa=stage == "sparse", attention="sparse" if stage == "sparse" else "dense", attn_chunk=8,
                      index_chunk=8)
    weights = steps.LossWeights(mtp_weight=0.0, balance_weight=0.1, indexer_weight=1.0)

    def objective(layers):
        cfg = load_preset("tiny").replace(num_hidden_layers=3, num_nextn_predict_layers=layers, index_topk=4,
                                          initializer_range=0.3)
        model = Transformer(cfg, rngs=nnx.Rngs(0), options=opts)
        graphdef, params, rest = nnx.split(model, nnx.Not(lambda path, _: "mtp" in map(str, path)), ...)

        def f(p):
            return steps.lm_objective(nnx.merge(graphdef, p, rest), batch, stage=stage, weights=weights,
                                      model_cfg=cfg)
        (loss, (metrics, _, _)), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
        return loss, metrics, nnx.to_pure_dict(grads)

    (l1, m1, g1), (l0, m0, g0) = objective(1), objective(0)
    assert set(m1) == set(m0) and "balance_loss" in m0
    for k in m0:
        assert abs(float(m1[k]) - float(m0[k])) <= 1e-5 * max(abs(float(m0[k])), 1e-6), (k, m1[k], m0[k])
    flat1, flat0 = nnx.traversals.flatten_mapping(g1), nnx.traversals.flatten_mapping(g0)
    assert set(flat1) == set(flat0)
    for k, v in flat0.items():
        assert rel_err(flat1[k], v) <= 1e-5 or float(jnp.abs(v).max()) == float(jnp.abs(flat1[k]).max()) == 0, k


def test_a_packed_documents_mtp_states_and_mtp_indexer_kl_equal_its_own(rng):
    """The MTP input at position t is Emb(t_{t+1+j}); at a document's last token(s) the shift read the next
    document's first token(s) (0 when the document runs alone). Those positions' MTP logits are masked, but the
    MTP layer's indexer KL there entered the loss (the whole loss in the warm-up): a packed row's gradient was not
    its documents' (15% on the MTP indexer's weights; packing audit). Now every position of a packed document,
    the last ones included, has the MTP logits and MTP-layer KL of the document alone (two MTP depths: the shift
    of depth 1 crosses the boundary at the last two tokens)."""
    import jax

    cfg = load_preset("tiny").replace(num_hidden_layers=1, first_k_dense_replace=1, num_nextn_predict_layers=2,
                                      index_topk=4)
    model = Transformer(cfg, rngs=nnx.Rngs(5), dtype=jnp.float32,
                        options=RunOptions(dsa=False, attention="dense", indexer_loss="dense"))
    lens = (7, 9, 4)
    docs = [rng.integers(2, cfg.vocab_size, n).astype(np.int32) for n in lens]

    def run(tokens, segments, positions):
        with jax.default_matmul_precision("highest"):
            _, aux = model(jnp.asarray(tokens)[None], positions=jnp.asarray(positions)[None],
                           segment_ids=jnp.asarray(segments)[None], return_aux=True, mtp=True)
        kl = [np.asarray(aux["indexer_kl"][cfg.num_hidden_layers + j])[0] for j in range(2)]
        return [np.asarray(x)[0] for x in aux["mtp_logits"]], kl

    packed = run(np.concatenate(docs + [np.zeros(3, np.int32)]),
                 np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)] + [np.zeros(3, int)]),
                 np.concatenate([np.arange(n) for n in lens] + [np.zeros(3, int)]))
    start = 0
    for doc in docs:
        alone = run(doc, np.ones(len(doc), int), np.arange(len(doc)))
        part = slice(start, start + len(doc))
        for j in range(2):
            assert rel_err(packed[0][j][part], alone[0][j]) < 1e-5, (len(doc), j)
            assert rel_err(packed[1][j][part], alone[1][j]) < 1e-4, (len(doc), j, packed[1][j][part], alone[1][j])
        start += len(doc)


def test_the_warmup_trains_the_mtp_layers_indexer_at_mtp_weight_zero(rng):
    """The warm-up trains every indexer, the MTP layer's too (its parameters are trainable there whatever
    loss.mtp_weight): at mtp_weight 0 the MTP layer still runs in the warm-up, so its indexer gets a gradient and
    its KL joins indexer_kl (the 4-indexer average differs from the 3 main indexers'). Mutant: the MTP layers run
    only for mtp_weight > 0."""
    import jax

    from dsv32_jax.train import steps

    tokens, seg, batch = packed_batch(rng, b=2, t=24)
    starts = [[int(np.argmax(row == row[i])) for i in range(len(row))] for row in seg]
    batch["positions"] = jnp.asarray(np.arange(seg.shape[1])[None] - np.asarray(starts), jnp.int32)
    opts = RunOptions(dsa=False, attention="dense", indexer_loss="dense", attn_chunk=8, index_chunk=8)  # (warm-up)
    weights = steps.LossWeights(mtp_weight=0.0, balance_weight=0.0, indexer_weight=1.0)

    def objective(layers):
        cfg = load_preset("tiny").replace(num_hidden_layers=3, num_nextn_predict_layers=layers, index_topk=4,
                                          initializer_range=0.3)
        model = Transformer(cfg, rngs=nnx.Rngs(0), options=opts)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def f(p):
            return steps.lm_objective(nnx.merge(graphdef, p, rest), batch, stage="warmup", weights=weights,
                                      model_cfg=cfg)
        (loss, (metrics, _, _)), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
        return float(metrics["indexer_kl"]), nnx.traversals.flatten_mapping(nnx.to_pure_dict(grads))

    (kl1, g1), (kl0, _) = objective(1), objective(0)
    mtp_indexer = {k: v for k, v in g1.items() if "mtp" in map(str, k) and "indexer" in map(str, k)}
    assert mtp_indexer and max(float(jnp.abs(v).max()) for v in mtp_indexer.values()) > 0, sorted(mtp_indexer)
    assert abs(kl1 - kl0) > 1e-4 * abs(kl0), (kl1, kl0)
