"""Gaps found by mutation testing (tests/mutate.sh) of the training infrastructure and the MoE / MTP model code:
each test names the mutant it catches. Expected values come from numpy or from hand-derived literals."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv32_jax import RunOptions, Transformer, load_preset
from dsv32_jax.model.moe import blocked_experts


def _silu(a):
    return a / (1 + np.exp(-a))


def test_blocked_experts_keep_every_row_when_padding_needs_more_blocks_than_the_rows_fill():
    """blocked_experts pads each expert's last block: with every expert local the blocks needed can exceed
    ceil(N k / block) (here 5 tokens x top-2 = 10 rows, block 4: ceil(10/4) = 3, but the experts' 3, 3, 2, 2 rows
    take 1 + 1 + 1 + 1 = 4 blocks). Mutant: the scan's step count without its "+ E" allowance
    (`steps = -(-(-(-n * k // block)) // blocks_per_step)`) drops the last expert's rows (tokens 3 and 4's expert 3).
    Reference: a float64 numpy loop over (token, slot)."""
    rng = np.random.default_rng(0)
    n, k, g, d, i = 5, 2, 4, 6, 5
    ids = np.array([[0, 1], [0, 1], [0, 2], [1, 3], [2, 3]], np.int32)  # expert rows: 3, 3, 2, 2
    x = rng.standard_normal((n, d))
    weights = rng.uniform(0.2, 1.0, (n, k))
    wg, wu, wd = (rng.standard_normal(s) * 0.5 for s in ((g, d, i), (g, d, i), (g, i, d)))
    want = np.zeros((n, d))
    for t in range(n):
        for j, e in enumerate(ids[t]):
            want[t] += weights[t, j] * (_silu(x[t] @ wg[e]) * (x[t] @ wu[e])) @ wd[e]
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    got = blocked_experts(f32(x), jnp.asarray(ids), f32(weights), f32(wg), f32(wu), f32(wd), jnp.int32(0),
                          block=4, blocks_per_step=1)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------ MTP wiring
@pytest.fixture(scope="module")
def moe_mtp():
    """One MoE decoder layer (layer 0) + one MTP layer, dense attention; shared by the tests below (one init)."""
    cfg = load_preset("tiny").replace(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=1,
                                      initializer_range=0.3)
    return cfg, Transformer(cfg, rngs=nnx.Rngs(3), options=RunOptions(dsa=False, attention="dense"))


def test_mtp_routing_is_recorded_under_its_own_layer_key_not_over_the_main_layers(moe_mtp):
    """aux["routing"] holds the main MoE layer 0 under key 0 and the MTP block under key num_hidden_layers (= 1),
    as the checkpoint numbers them (the balance loss and the bias update read them by key). Mutant: the MTP layer's
    aux collected under key j (`key = j`) overwrites layer 0's routing with the MTP block's, so the bias update of
    layer 0 would count the MTP block's loads. Reference: the main layer's routing of a forward without the MTP
    layers (mtp=False). And a replayed routing reaches the MTP block under that key: mutant `routing.get(j)` in
    mtp_hidden replays main layer j's recorded experts in the MTP block."""
    cfg, model = moe_mtp
    tokens = jnp.asarray(np.random.default_rng(1).integers(2, cfg.vocab_size, (2, 12)), jnp.int32)
    _, main_only = model(tokens, return_aux=True, mtp=False)
    _, aux = model(tokens, return_aux=True)
    assert sorted(aux["routing"]) == [0, 1]
    np.testing.assert_array_equal(np.asarray(aux["routing"][0]), np.asarray(main_only["routing"][0]))
    # the MTP block routes its own (different) inputs: were it the main layer's, the keys would not tell them apart
    assert not np.array_equal(np.sort(np.asarray(aux["routing"][1]), -1), np.sort(np.asarray(aux["routing"][0]), -1))
    assert sorted(aux["router_prob"]) == [0, 1]
    # replaying a routing {layer: ids} replays the MTP block's own entry (key 1), not main layer 0's
    custom = np.stack([[np.random.default_rng(i).choice(cfg.n_routed_experts, cfg.num_experts_per_tok, replace=False)
                        for i in range(12)]] * 2).astype(np.int32)
    _, replayed = model(tokens, routing={0: aux["routing"][0], 1: jnp.asarray(custom)}, return_aux=True)
    np.testing.assert_array_equal(np.asarray(replayed["routing"][1]), custom)
    np.testing.assert_array_equal(np.asarray(replayed["routing"][0]), np.asarray(aux["routing"][0]))


def _packed_batch(vocab, rng):
    """Two rows of packed documents with a padding tail: row 0 = docs of 5 and 4 tokens + 3 padding, row 1 = docs of
    7 and 5 tokens. 21 real tokens, but only 17 LM targets (each document's last token has none)."""
    seg = np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 7 + [2] * 5])
    tokens = np.where(seg > 0, rng.integers(2, vocab, seg.shape), 0)
    pos = np.zeros_like(seg)
    for r in range(2):
        for s in (1, 2):
            pos[r, seg[r] == s] = np.arange((seg[r] == s).sum())
    loss_mask = np.zeros(seg.shape, np.float32)
    loss_mask[:, :-1] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
    targets = np.where(loss_mask > 0, np.roll(tokens, -1, 1), 0)
    return seg, tokens, {"tokens": jnp.asarray(tokens, jnp.int32), "targets": jnp.asarray(targets, jnp.int32),
                         "segment_ids": jnp.asarray(seg, jnp.int32), "positions": jnp.asarray(pos, jnp.int32),
                         "loss_mask": jnp.asarray(loss_mask)}


def _np_nll(logits, targets):
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]


def test_lm_and_mtp_losses_are_means_over_their_own_target_counts(moe_mtp):
    """steps.lm_objective's lm_loss = sum of the NLL over loss_mask / sum(loss_mask) (17 targets here, not the 21
    real tokens), mtp_loss (D = 1) = the mean over the positions t whose t+1 and t+2 lie in t's document (13 here:
    17 minus one per document) of -log p_mtp(token t+2). Mutants: batch_totals' "lm" count over the real tokens
    (`count(batch["segment_ids"] > 0)`) -> lm_loss x 17/21; its "mtp" count over the LM targets
    (`count(batch["loss_mask"])`) -> mtp_loss x 13/17. Reference: numpy cross-entropy of the model's logits with
    masks from a loop over documents."""
    from dsv32_jax.train import steps

    cfg, model = moe_mtp
    seg, tokens, batch = _packed_batch(cfg.vocab_size, np.random.default_rng(2))
    weights = steps.LossWeights(indexer_weight=0.0, mtp_weight=0.5, balance_weight=0.0)
    loss, (metrics, _, token_mask) = steps.lm_objective(model, batch, stage="dense", weights=weights, model_cfg=cfg)
    # the token mask the bias update counts expert loads over (and the KL / balance loss average over): every real
    # token, the documents' last ones included (mutant: `token_mask = batch["loss_mask"]`)
    np.testing.assert_array_equal(np.asarray(token_mask), (seg > 0).astype(np.float32))
    logits, aux = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                        return_aux=True)
    lm_mask, mtp_mask = np.zeros(seg.shape), np.zeros(seg.shape)
    lm_tgt, mtp_tgt = np.zeros(seg.shape, int), np.zeros(seg.shape, int)
    for r in range(seg.shape[0]):
        for t in range(seg.shape[1]):
            for ahead, m, tg in ((1, lm_mask, lm_tgt), (2, mtp_mask, mtp_tgt)):
                j = t + ahead
                if j < seg.shape[1] and seg[r, t] > 0 and np.all(seg[r, t:j + 1] == seg[r, t]):
                    m[r, t], tg[r, t] = 1.0, tokens[r, j]
    assert lm_mask.sum() == 17 and mtp_mask.sum() == 13 and (seg > 0).sum() == 21
    want_lm = (_np_nll(logits, lm_tgt) * lm_mask).sum() / lm_mask.sum()
    want_mtp = (_np_nll(aux["mtp_logits"][0], mtp_tgt) * mtp_mask).sum() / mtp_mask.sum()
    assert float(metrics["lm_loss"]) == pytest.approx(want_lm, rel=1e-5)
    assert float(metrics["mtp_loss"]) == pytest.approx(want_mtp, rel=1e-5)
    assert float(loss) == pytest.approx(want_lm + 0.5 * want_mtp, rel=1e-5)


# ------------------------------------------------------------------------------------------------ GRPO learner
def _np_log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_grpo_policy_and_reference_logprobs_score_each_sampled_token_under_its_previous_position(moe_mtp):
    """forward_logprobs: completion token i (sequence slot P + i) is scored by the logits at slot P - 1 + i, at the
    sampling temperature (0.7), with the recorded routing replayed (keep routing); grpo_reference_logprobs: the same
    under the reference's OWN routing. Mutants: `logits[:, p:]` (off by one: each token scored by its own slot's
    logits), the reference replaying the policy's recorded routing (`replay=True`). Reference: numpy
    log_softmax(logits / T) of full-model forwards with and without the routing, at the slots derived by hand."""
    from dsv32_jax.train import steps

    cfg, model = moe_mtp  # layer 0: MoE (forward_logprobs runs no MTP layer)
    rng = np.random.default_rng(6)
    b, p, g, k, temp = 2, 4, 5, cfg.num_experts_per_tok, 0.7
    tokens = rng.integers(2, cfg.vocab_size, (b, p + g)).astype(np.int32)
    routing = {0: jnp.asarray(np.stack([[rng.choice(cfg.n_routed_experts, k, replace=False) for _ in range(p + g)]
                                        for _ in range(b)]), jnp.int32)}
    batch = {"prompts": jnp.asarray(tokens[:, :p]), "tokens": jnp.asarray(tokens),
             "positions": jnp.broadcast_to(jnp.arange(p + g, dtype=jnp.int32), (b, p + g)),
             "segments": jnp.ones((b, p + g), jnp.int32), "routing": routing, "gen": jnp.asarray(tokens[:, p:]),
             "kept_ids": jnp.zeros((b, g, 0), jnp.int32), "kept_mask": jnp.zeros((b, g, 0), bool)}
    replayed = np.asarray(model(batch["tokens"], routing=routing))
    native = np.asarray(model(batch["tokens"]))
    assert np.abs(replayed - native).max() > 1e-3  # the recorded routing is not the model's own

    def want(logits):
        logp = _np_log_softmax(logits / temp)
        return np.array([[logp[r, p - 1 + i, tokens[r, p + i]] for i in range(g)] for r in range(b)])

    logp, _, _, _ = steps.forward_logprobs(model, batch, temp, replay=True)
    np.testing.assert_allclose(np.asarray(logp), want(replayed), rtol=1e-5, atol=1e-5)
    graphdef, state = nnx.split(model)
    ref = steps.grpo_reference_logprobs(state, batch, graphdef=graphdef, temperature=temp)
    np.testing.assert_allclose(np.asarray(ref), want(native), rtol=1e-5, atol=1e-5)


def test_minibatch_updates_train_on_every_row_once_per_epoch_in_equal_minibatches():
    """grpo.minibatch_updates(epochs=2, minibatches=4) over 8 rows: 8 updates, in order, each on 2 rows; each
    epoch's minibatches partition the 8 rows (every sampled row trained on once per epoch), every array of the
    batch indexed by the same rows; the metrics are the mean over the 8 updates. Mutants: every minibatch the first
    `mb` rows of the permutation (`order[:mb]`), a single epoch (`range(1)`). A stand-in train function records
    what it was given."""
    from dsv32_jax.train.grpo import minibatch_updates

    seen = []

    def train(state, mb):
        adv, x = np.asarray(mb["adv"]), np.asarray(mb["x"])
        seen.append(adv.astype(int).tolist())
        np.testing.assert_array_equal(x, adv * 10.0 + 1.0)  # rows of every array stay together
        return state + 1, {"value": jnp.float32(len(seen))}

    batch = {"adv": jnp.arange(8, dtype=jnp.float32), "x": jnp.arange(8, dtype=jnp.float32) * 10.0 + 1.0}
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state, metrics = minibatch_updates(train, 0, batch, epochs=2, minibatches=4, sharding=sharding,
                                       rng=np.random.default_rng(0))
    assert state == 8 and len(seen) == 8 and all(len(rows) == 2 for rows in seen)
    for epoch in range(2):
        assert sorted(r for rows in seen[4 * epoch:4 * epoch + 4] for r in rows) == list(range(8))
    assert metrics == {"value": pytest.approx(4.5)}  # mean of 1..8


# ------------------------------------------------------------------------------------------ checkpoints / loop
class _Tiny(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros((3, 2), jnp.float32))
        self.b = nnx.Param(jnp.zeros((2,), jnp.float32))


def test_checkpoint_restore_puts_the_saved_arrays_of_the_requested_step_into_the_state(tmp_path):
    """checkpointing.save at steps 1 and 2 (different values), then restore(step 1) into a zeroed state: the state
    holds step 1's arrays (updated in place) and the JSON item comes back. Mutant: restore returning without
    writing the restored arrays into the state (`nnx.replace_by_pure_dict` dropped): the run resumes with fresh
    parameters while its step counter says otherwise. Values: hand-set literals."""
    from dsv32_jax.train import checkpointing

    cfg = types.SimpleNamespace(every=1, keep=None, use_async=False)
    module = _Tiny()
    state = nnx.state(module)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, state)
    values = {1: (np.arange(6.0).reshape(3, 2), np.array([7.0, 8.0])), 2: (-np.ones((3, 2)), np.array([0.5, 0.25]))}
    with checkpointing.manager(str(tmp_path), cfg) as mngr:
        for step, (w, b) in values.items():
            module.w[...], module.b[...] = jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32)
            assert checkpointing.save(mngr, step, arrays={"params": nnx.state(module)}, json={"meta": {"step": step}})
        mngr.wait_until_finished()
        assert checkpointing.latest_step(mngr) == 2
        target = jax.tree.map(jnp.zeros_like, nnx.state(_Tiny()))
        out = checkpointing.restore(mngr, 1, arrays={"params": (target, shardings)}, json=("meta",))
    assert out["meta"] == {"step": 1}
    np.testing.assert_array_equal(np.asarray(target["w"][...]), values[1][0])
    np.testing.assert_array_equal(np.asarray(target["b"][...]), values[1][1])


class _CountingStage:
    """A loop stage that records what run_loop asks of it; `start`: the step its restored checkpoint holds."""

    def __init__(self, start=None):
        self.step, self.start, self.saved, self.restored = 0, start, [], []

    def restore_checkpoint(self, mngr, step):
        self.restored.append(step)
        self.step = step

    def run_step(self):
        self.step += 1
        return {"loss": 1.0}

    def save_checkpoint(self, mngr, step, force):
        from dsv32_jax.train import checkpointing

        self.saved.append((step, force))
        return checkpointing.save(mngr, step, arrays={}, json={"meta": {"step": step}}, force=force)


def test_loop_forces_the_last_steps_checkpoint_and_a_rerun_resumes_from_it(tmp_path):
    """run_loop to config.steps = 6 with checkpoints every 4 steps: steps 1..6 run, the last one saved FORCED (6 is
    off the interval: without it a finished run's last 2 steps are lost); a second run_loop to 9 in the same workdir
    restores step 6 (the latest) and runs 7..9. Mutants: the final step not forced (`force=stop.requested`), the
    restore of another step than the latest."""
    from dsv32_jax.train import loop
    from tests.test_train import load_config

    config = load_config("dense_tiny", steps=6, log_every=1000)
    config.checkpoint.every, config.checkpoint.use_async = 4, False
    first = _CountingStage()
    history = loop.run_loop(first, workdir=str(tmp_path), config=config, keys=("loss",), desc="t")
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert first.saved[-1] == (6, True) and all(not f for _, f in first.saved[:-1])
    config.steps = 9
    second = _CountingStage()
    history = loop.run_loop(second, workdir=str(tmp_path), config=config, keys=("loss",), desc="t")
    assert second.restored == [6]
    assert [h["step"] for h in history] == [7, 8, 9]


@pytest.mark.parametrize("stage,mtp_weight", [("warmup", 0.3), ("dense", 0.0), ("sparse", 0.3)])
def test_the_trainer_trains_exactly_its_stages_parameters(tmp_path, stage, mtp_weight):
    """The paper's stages: the dense warm-up trains the lightning indexer only (the rest frozen); dense
    pre-training everything but the (unused) indexer; sparse training everything. MTP parameters are trained iff
    loss.mtp_weight > 0. Checked on the Trainer's own filter (abstract model, nothing allocated). Mutants: the
    Trainer building the warm-up's filter as another stage's (`trainable_filter("sparse" ...)`: the warm-up would
    update the main model), mtp=True regardless of loss.mtp_weight."""
    from dsv32_jax.train.config import default_config
    from dsv32_jax.train.trainer import Trainer

    c = default_config()
    c.stage, c.loss.mtp_weight = stage, mtp_weight
    c.model_overrides = {"num_hidden_layers": 2, "num_nextn_predict_layers": 1}
    trainer = Trainer(c, str(tmp_path / "w"), allocate=False)
    model = nnx.eval_shape(lambda: Transformer(trainer.cfg, rngs=nnx.Rngs(0)))
    every = [tuple(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    trained = {tuple(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, trainer.filter))}
    indexer = {p for p in every if "indexer" in p}
    mtp = {p for p in every if p[0] == "mtp"}
    assert indexer and mtp
    if stage == "warmup":
        want = indexer
    else:
        want = set(every) - (indexer if stage == "dense" else set()) - (set() if mtp_weight else mtp)
    assert trained == want


def test_the_train_step_updates_the_mtp_blocks_bias_from_the_mtp_blocks_own_loads(tmp_path):
    """One dense-stage step of a model with one MoE layer and one (MoE) MTP layer, bias_update_speed 1e-2: layer 0's
    bias moves by 0.01 x sign(mean load - load) of layer 0's routing, the MTP block's by that of ITS routing (aux key
    num_hidden_layers), both counted in numpy over the real tokens under the step's starting parameters. Mutant:
    every load applied to a main layer (`ffn = model.layers[min(key, n - 1)].ffn`): the MTP block's bias never
    moves and layer 0's takes both updates. Also the logged lr is the one this update used (lr(0) = 0 of a 4-step
    linear warm-up): mutant `step = optimizer.step[...]` (after the update's increment) logs lr(1) = 0.25."""
    from tests.test_microbatch import random_batch, step_fn, tiny_config

    from dsv32_jax.train.trainer import Trainer

    c = tiny_config("dense", mtp=True)
    c.loss.balance_weight = 0.0
    c.optimizer.warmup_steps = 4  # linear warm-up 0 -> lr over 4 steps: the first update's lr is lr(0) = 0
    trainer = Trainer(c, str(tmp_path / "w"), allocate=False)
    model, opt = trainer._build()
    graphdef, state = nnx.split((model, opt))
    batch = {k: jnp.asarray(v) for k, v in random_batch(np.random.default_rng(7), trainer.cfg.vocab_size).items()}
    _, aux = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"], return_aux=True)
    real = np.asarray(batch["segment_ids"]) > 0
    e = trainer.cfg.n_routed_experts
    before = [np.asarray(model.layers[0].ffn.bias[...]), np.asarray(model.mtp[0].block.ffn.bias[...])]
    new_state, metrics = step_fn(trainer, graphdef, 1)(state, batch)
    assert float(metrics["lr"]) == 0.0  # the lr this (first) update used, not the next one's 0.25
    new_model = nnx.merge(graphdef, new_state)[0]
    after = [np.asarray(new_model.layers[0].ffn.bias[...]), np.asarray(new_model.mtp[0].block.ffn.bias[...])]
    for key in (0, 1):
        load = np.bincount(np.asarray(aux["routing"][key])[real].reshape(-1), minlength=e).astype(np.float64)
        assert np.any(load != load.mean())
        np.testing.assert_allclose(after[key] - before[key], 0.01 * np.sign(load.mean() - load), atol=1e-7,
                                   err_msg=f"routing key {key}")


def test_indexer_kl_is_the_mean_over_layers_of_each_layers_token_mean():
    """losses.indexer_kl: per layer the KL averaged over the real tokens (mask), then the MEAN over layers (the
    logged indexer_kl and the sparse loss's term). Hand-computed: layer 0's KL on its 3 real tokens 1, 2, 3 -> 2;
    layer 3's 4, 6, 8 -> 6; mean over the 2 layers 4 (a sum would be 8); captured mass per layer likewise.
    Mutant: `jnp.sum` over the layers."""
    from dsv32_jax.train import losses

    mask = jnp.asarray([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    aux = {"indexer_kl": {0: jnp.asarray([[1.0, 2.0, 50.0], [3.0, 50.0, 50.0]]),
                          3: jnp.asarray([[4.0, 6.0, 50.0], [8.0, 50.0, 50.0]])},
           "indexer_captured": {0: jnp.asarray([[0.5, 0.5, 0.0], [0.8, 0.0, 0.0]])}}
    kl, metrics = losses.indexer_kl(aux, mask)
    assert float(kl) == pytest.approx(4.0)
    assert float(metrics["indexer_kl/0"]) == pytest.approx(2.0) and float(metrics["indexer_kl/3"]) == pytest.approx(6.0)
    assert float(metrics["captured_mass/0"]) == pytest.approx(0.6)
    # with a whole batch's token count (a microbatch's share): 2 + 3 + ... over total = 6 tokens
    share, _ = losses.indexer_kl(aux, mask, total=jnp.float32(6.0))
    assert float(share) == pytest.approx(2.0)  # (6 / 6 + 18 / 6) / 2


def _stub_learner():
    """A GRPOLearner without its model: tiny array states for the policy (params, opt) and the reference."""
    from dsv32_jax.model import sharding as shd
    from dsv32_jax.train.grpo import GRPOLearner

    lrn = object.__new__(GRPOLearner)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    states = []
    for fill in (1.0, 2.0, 3.0):  # policy params, optimizer state, reference
        m = _Tiny()
        m.w[...], m.b[...] = jnp.full((3, 2), fill), jnp.full((2,), fill)
        states.append(nnx.state(m))
    lrn.state, lrn.ref = (states[0], states[1]), states[2]
    lrn.shardings = tuple(jax.tree.map(lambda _: one, s) for s in lrn.state)
    lrn.mesh, lrn.batch_sharding, lrn.step = shd.make_mesh("fsdp:1"), one, 0
    lrn.cfg = load_preset("tiny")
    lrn.config = types.SimpleNamespace(seed=0)
    lrn.g = types.SimpleNamespace(epochs=1, minibatches=2)
    return lrn


def test_grpo_update_scores_the_reference_with_the_frozen_reference_and_trains_on_its_logprobs():
    """GRPOLearner.update: log pi_ref comes from the frozen reference state (not the current policy, which would make
    the KL term vanish at every step's start: no anchor to the initial model), diagnostics from the policy before
    any update, and the minibatches carry the reference's log-probs. The compiled steps are stand-ins that record
    their inputs. Mutant: `self.steps.reference(self.state[0], batch)`."""
    from dsv32_jax.train import steps

    lrn = _stub_learner()
    calls = {"reference": [], "diagnostics": [], "train": []}

    def reference(state, batch):
        calls["reference"].append(state)
        return jnp.full(batch["adv"].shape, -0.5)

    def diagnostics(state, batch):
        calls["diagnostics"].append(state)
        return {"logprob_mismatch_max": jnp.float32(0.0)}

    def train(state, batch):
        calls["train"].append(np.asarray(batch["logp_ref"]))
        return state, {"loss": jnp.float32(1.0)}

    policy, ref = lrn.state[0], lrn.ref
    lrn.steps = steps.GRPOSteps(train=train, reference=reference, diagnostics=diagnostics)
    out = lrn.update({"adv": jnp.arange(4, dtype=jnp.float32)})
    assert len(calls["reference"]) == 1 and calls["reference"][0] is ref
    assert calls["diagnostics"][0] is policy
    assert len(calls["train"]) == 2 and all(np.all(x == -0.5) for x in calls["train"])
    assert out["loss"] == 1.0 and out["logprob_mismatch_max"] == 0.0


def test_grpo_checkpoint_keeps_the_reference_apart_from_the_policy(tmp_path):
    """save_checkpoint / restore_checkpoint round trip of a learner whose policy (all 1), optimizer state (all 2) and
    reference (all 3) differ: after the restore into zeroed states each holds its own values and the step comes
    back. Mutant: the checkpoint's "ref" item written from the policy (`"ref": self.state[0]`): a resumed run's KL
    anchors to the policy at the checkpoint instead of the initial model."""
    from dsv32_jax.train import checkpointing

    lrn = _stub_learner()
    cfg = types.SimpleNamespace(every=1, keep=None, use_async=False)
    with checkpointing.manager(str(tmp_path), cfg) as mngr:
        assert lrn.save_checkpoint(mngr, 3, force=True)
        mngr.wait_until_finished()
        lrn.state = tuple(jax.tree.map(jnp.zeros_like, s) for s in lrn.state)
        lrn.ref = jax.tree.map(jnp.zeros_like, lrn.ref)
        lrn.restore_checkpoint(mngr, 3)
    assert lrn.step == 3
    for tree, fill in ((lrn.state[0], 1.0), (lrn.state[1], 2.0), (lrn.ref, 3.0)):
        for leaf in jax.tree.leaves(tree):
            np.testing.assert_array_equal(np.asarray(leaf), fill)


def test_resuming_a_checkpoint_of_another_stage_is_refused_naming_the_stage():
    """checkpointing.check_resume: a workdir whose checkpoint was written by the warm-up refuses a sparse-stage
    resume (the data position and step would carry over into another objective), naming config.stage; the same
    stage passes. Mutant: the stage comparison dropped (`if False:`), which check_stored catches only when the
    stages' trained parameter sets differ."""
    from dsv32_jax.train import checkpointing

    point = types.SimpleNamespace(meta={"stage": "warmup"}, cfg=load_preset("tiny"), workdir="W", step=7)
    with pytest.raises(checkpointing.ResumeError, match=r"config\.stage 'warmup' there, 'sparse' here"):
        checkpointing.check_resume(point, stage="sparse", model_cfg=load_preset("tiny"))
    checkpointing.check_resume(point, stage="warmup", model_cfg=load_preset("tiny"))


def test_resuming_with_other_data_files_is_warned_about_by_name(tmp_path, caplog):
    """A resume with other data.paths / tokenizer / text_field / add_eos restored the saved iterator position into
    another stream without a word. They may change (a dataset moved), so they are warned about, naming each; the
    tokenizer is compared as the checkpoint records it (an absolute tokenizer.json path)."""
    import logging

    from dsv32_jax.train import checkpointing

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    saved = {"source": "jsonl", "paths": ["a.jsonl"], "text_field": "text", "tokenizer": str(tmp_path / "tok"),
             "add_eos": True, "seq_len": 16, "batch_size": 2, "seed": 0, "shuffle": True}
    recorded = checkpointing.data_fingerprint(saved)
    assert recorded["tokenizer"] == str(tmp_path / "tok" / "tokenizer.json") and recorded["paths"] == ["a.jsonl"]
    point = types.SimpleNamespace(meta={"stage": "dense", "data_config": recorded}, workdir="W", step=7)
    with caplog.at_level(logging.WARNING):
        checkpointing.check_resume(point, stage="dense", data={**saved, "tokenizer": str(tmp_path / "tok" /
                                                                                           "tokenizer.json")})
        assert caplog.text == ""
        checkpointing.check_resume(point, stage="dense", data={**saved, "paths": ("b.jsonl",), "text_field": "body"})
    assert ("W: resuming step 7 with other data (config.data.paths ['a.jsonl'] there, ['b.jsonl'] here; "
            "config.data.text_field 'text' there, 'body' here)") in caplog.text
    with pytest.raises(checkpointing.ResumeError, match=r"config\.data\.seq_len 16 there, 32 here"):
        checkpointing.check_resume(point, stage="dense", data={**saved, "seq_len": 32})
    # the row-shuffle window orders the rows the position counts: another one is another stream (a checkpoint from
    # before the field was a config field recorded none: not compared); without shuffle there is no window
    assert "shuffle_window" not in recorded  # (written before the field: every such run had the default, 512)
    checkpointing.check_resume(point, stage="dense", data={**saved, "shuffle_window": 512})
    with pytest.raises(checkpointing.ResumeError, match=r"config\.data\.shuffle_window 512 there, 16 here"):
        checkpointing.check_resume(point, stage="dense", data={**saved, "shuffle_window": 16})
    windowed = types.SimpleNamespace(meta={"stage": "dense", "data_config": checkpointing.data_fingerprint(
        {**saved, "shuffle_window": 512})}, workdir="W", step=7)
    checkpointing.check_resume(windowed, stage="dense", data={**saved, "shuffle_window": 512})
    with pytest.raises(checkpointing.ResumeError, match=r"config\.data\.shuffle_window 512 there, 16 here"):
        checkpointing.check_resume(windowed, stage="dense", data={**saved, "shuffle_window": 16})
    unshuffled = types.SimpleNamespace(meta={"stage": "dense", "data_config": checkpointing.data_fingerprint(
        {**saved, "shuffle": False, "shuffle_window": 512})}, workdir="W", step=7)
    checkpointing.check_resume(unshuffled, stage="dense", data={**saved, "shuffle": False, "shuffle_window": 16})
    # a checkpoint from before data.special_tokens parsed special-token strings in the text: resuming with the new
    # default "text" is another stream (code review), "parse" is the same one
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        checkpointing.check_resume(point, stage="dense", data={**saved, "special_tokens": "parse"})
        assert caplog.text == ""
        checkpointing.check_resume(point, stage="dense", data={**saved, "special_tokens": "text"})
    assert "config.data.special_tokens 'parse' there, 'text' here" in caplog.text
    # the byte tokenizer has no special-token strings: its stream is the same in either mode, nothing to warn about
    byte = dict(saved, tokenizer="byte")
    point.meta["data_config"] = checkpointing.data_fingerprint(byte)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        checkpointing.check_resume(point, stage="dense", data={**byte, "special_tokens": "text"})
    assert caplog.text == ""


def test_a_data_state_of_another_shard_count_is_a_resume_error():
    """The pipeline's own refusal of a data state (another shard count) and grain's KeyError on a state of another
    layout were ValueErrors that the CLI printed as tracebacks (exit 1); they are ResumeErrors (one line, exit 2)
    naming the checkpoint's step."""
    from dsv32_jax.train import checkpointing, data as data_lib
    from dsv32_jax.train.config import default_config
    from dsv32_jax.train.trainer import Trainer

    config = default_config()
    config.data.shards = 2
    it = data_lib.make_iterator(data_lib.DataConfig(**config.data.to_dict()), vocab_size=256)
    unsharded = data_lib.make_iterator(data_lib.DataConfig(**{**config.data.to_dict(), "shards": 0}), vocab_size=256)
    for target, state, match in (
            (it, unsharded.get_state(), r"^checkpoint step 4: data state is one unsharded stream \(data\.shards=0 on "
                                        r"one process\), this run has 2 shards"),
            (it, {**it.get_state(), "num_shards": 3}, r"^checkpoint step 4: data state has 3 shards, this run 2"),
            (unsharded, it.get_state(), r"^checkpoint step 4: its data state does not fit this run's data pipeline")):
        fake = types.SimpleNamespace(restore=lambda mngr, step, state=state: state, config=config, _data_iter=target)
        with pytest.raises(checkpointing.ResumeError, match=match):
            Trainer.restore_checkpoint(fake, None, 4)


def test_the_trainers_eval_batches_come_from_the_heldout_documents():
    """eval.eval_data_config of a built-in training config reads the held-out split: every real row of the first
    eval batches is a piece of the held-out documents (their bytes: the byte tokenizer) and of no training document.
    Mutant: `d["split"] = "train"` (the periodic eval_loss measured on the training corpus)."""
    from dsv32_jax.train import eval as eval_lib
    from dsv32_jax.train.data import builtin_documents

    cfg = eval_lib.eval_data_config({"source": "builtin", "seq_len": 48, "batch_size": 2}, eval_lib._Cfg({}))
    held = "\x00".join(builtin_documents("heldout")).encode()
    train = "\x00".join(builtin_documents()).encode()
    checked = 0
    for b in eval_lib.eval_batches(cfg, 256, 2):
        for tokens, seg in zip(b["tokens"], b["segment_ids"]):
            piece = bytes(int(t) for t in tokens[seg == seg[0]][:-1] if 0 < t < 256)  # first document, no EOS
            if len(piece) >= 24:
                assert piece in held and piece not in train
                checked += 1
    assert checked >= 2


def test_the_long_heldout_split_keeps_only_documents_of_at_least_the_context():
    """eval_data_config(long=True) (the table's heldout-long column) keeps only documents of >= seq_len tokens
    (min_doc_tokens = seq_len; its filtering is tests/test_eval.py's): at a context of 1024 every document piece in
    the first batches comes from a held-out document of >= 1023 bytes (+ EOS), while the plain split at that context
    also packs a shorter one. Mutant: `d["min_doc_tokens"] = 0`."""
    from dsv32_jax.train import eval as eval_lib
    from dsv32_jax.train.data import builtin_documents

    n, data = 1024, {"source": "builtin", "seq_len": 8, "batch_size": 2}
    long_docs = [d.encode() for d in builtin_documents("heldout") if len(d.encode()) >= n - 1]
    short = {}
    for long in (True, False):
        cfg = eval_lib.eval_data_config(data, eval_lib._Cfg({}), n, long=long)
        assert cfg.seq_len == n and cfg.min_doc_tokens == (n if long else 0)
        pieces = []
        for b in eval_lib.eval_batches(cfg, 256, 3):
            for tokens, seg in zip(b["tokens"], b["segment_ids"]):
                for s in np.unique(seg[seg > 0]):
                    piece = bytes(int(t) for t in tokens[seg == s] if 1 < t < 256)  # the bytes, without EOS
                    if len(piece) >= 16:
                        pieces.append(piece)
        assert len(pieces) >= 6
        short[long] = sum(not any(p in d for d in long_docs) for p in pieces)
    assert short[True] == 0 and short[False] >= 1


def test_the_trainers_periodic_eval_uses_dsa_after_the_dense_stage(tmp_path, monkeypatch):
    """Trainer.evaluator: the dense stage's model is evaluated with dense attention, the warm-up's and sparse
    stage's with DSA (the model the stage produces: its indexer's top-k selection), with the run's chunk sizes and
    its indexer_fp8 (the FP8 selection it trains with; mutant: not carried over, the eval selected exactly), and
    with config.attention="kernel" its kernels.
    Evaluator.create is a stand-in that records its options; the trainer is built without its state. Mutant:
    `ATTENTIONS["dense"]` for every stage (the sparse run's eval_loss would measure dense attention)."""
    from dsv32_jax.model import sharding as shd
    from dsv32_jax.train import eval as eval_lib
    from dsv32_jax.train import steps
    from dsv32_jax.train.config import default_config
    from dsv32_jax.train.trainer import Trainer, run_options

    abstract = nnx.eval_shape(lambda: Transformer(load_preset("tiny"), rngs=nnx.Rngs(0)))

    class Stub(Trainer):
        model = property(lambda self: abstract)

    monkeypatch.setattr(eval_lib.Evaluator, "create", classmethod(lambda cls, batches, **kw: kw["options"]))

    def eval_options(**fields) -> dict:  # stage -> the options its Evaluator gets, for a config with `fields`
        seen = {}
        for stage in ("dense", "warmup", "sparse"):
            c = default_config()
            c.stage, c.eval.batches, c.data.seq_len, c.data.batch_size = stage, 1, 16, 2
            for k, v in fields.items():
                setattr(c, k, v)
            t = object.__new__(Stub)
            t.config, t.stage, t.cfg, t.options = c, stage, load_preset("tiny"), run_options(c)
            t.batch_sharding = steps.lm_batch_sharding(shd.make_mesh("fsdp:1"))
            t.ts = types.SimpleNamespace(shardings=(None, None))
            seen[stage] = t.evaluator()
        return seen

    seen = eval_options(attn_chunk=8, indexer_fp8=True)
    assert not seen["dense"].dsa and seen["dense"].attention == "dense"
    for stage in ("warmup", "sparse"):  # the run's selection: the FP8 scores it trains with (was the exact one)
        assert seen[stage].dsa and seen[stage].attention == "sparse" and seen[stage].indexer_fp8, stage
    assert not seen["dense"].indexer_fp8
    assert all(o.attn_chunk == 8 for o in seen.values())
    # a kernel run evaluates with its kernels (the selection and forward it trains with; it evaluated with the
    # plain-JAX reference: audit, 2026-12-07), the dense stage with the dense reference still
    seen = eval_options(attention="kernel", mla_fwd="mosaic_gpu")
    assert not seen["dense"].dsa and seen["dense"].attention == "dense"
    for stage in ("warmup", "sparse"):
        assert seen[stage].dsa and seen[stage].attention == "kernel" and seen[stage].mla_fwd == "mosaic_gpu", stage
        assert seen[stage].indexer_loss is None


def test_the_grpo_update_replays_the_recorded_routing():
    """steps._grpo_update (grpo_train_step and the trajectory step) computes pi_theta with replay=True (keep routing:
    the sampler's recorded experts, paper sec. 3.1), and takes one optimizer step on the GRPO loss. A stand-in
    logprobs_fn records the flag on a tiny module (no transformer). Mutant: `replay=False` in _grpo_update."""
    import optax

    from dsv32_jax.train import steps

    module = _Tiny()
    optimizer = nnx.Optimizer(module, optax.sgd(0.1), wrt=nnx.Param)
    graphdef, state = nnx.split((module, optimizer))
    flags = []

    def logprobs_fn(model, batch, temperature, replay):
        flags.append(replay)
        logp = jnp.zeros((2, 3)) + jnp.sum(model.w[...]) - 1.0
        return logp, jnp.zeros((2, 3)), jnp.ones((2, 3)), {}

    mask = jnp.ones((2, 3))
    batch = {"logp_old": jnp.full((2, 3), -1.0), "logp_ref": jnp.full((2, 3), -1.0), "adv": jnp.asarray([1.0, -1.0]),
             "beta": jnp.zeros((2,)), "segments": jnp.ones((2, 3), jnp.int32)}
    new_state, metrics = steps._grpo_update(state, batch, logprobs_fn, mask, graphdef=graphdef, temperature=1.0,
                                            eps=0.2, delta=10.0, indexer_weight=0.0)
    assert flags and all(f is True for f in flags)
    assert np.isfinite(float(metrics["loss"]))


def test_the_sparse_stage_warns_when_it_starts_from_untrained_indexers(monkeypatch, caplog):
    """Trainer._load_model: a sparse stage whose init_from holds indexers that never trained (untrained_indexers:
    a V3.1 HF checkpoint, a fresh-indexer conversion, a dense-stage workdir) or that sets init_indexer='fresh'
    logs one warning naming why and the warm-up it skipped; hf_long (trained indexers) and the warm-up stage itself
    log none. The trainer is built without its state (the loader runs for real on hf_long). Mutant: the check
    called for no stage."""
    import os

    from conftest import FIXTURES

    from dsv32_jax import ModelConfig
    from dsv32_jax.checkpoint import loading
    from dsv32_jax.train.config import default_config
    from dsv32_jax.train.trainer import Trainer

    hf = os.path.join(FIXTURES, "hf_long")

    def load(stage, init_indexer="auto"):
        t = object.__new__(Trainer)
        t.config = default_config()
        t.config.stage, t.config.init_indexer, t.stage = stage, init_indexer, stage
        t.cfg, t.dtype, t.param_dtype, t.mesh = ModelConfig.from_hf(hf), jnp.float32, jnp.float32, None
        caplog.clear()
        with caplog.at_level("WARNING", logger="absl"):
            t._load_model(hf)
        return [r.getMessage() for r in caplog.records if "never trained" in r.getMessage()]

    assert load("sparse") == []
    said = load("sparse", "fresh")
    assert len(said) == 1 and "(config.init_indexer='fresh')" in said[0] and "config.stage='warmup'" in said[0]
    monkeypatch.setattr(loading, "untrained_indexers", lambda path, step=None: f"{path}: no indexer tensors")
    (said,) = load("sparse")
    assert f"({hf}: no indexer tensors)" in said
    assert load("warmup") == [] and load("warmup", "fresh") == []


@pytest.mark.parametrize("stage", ["grpo", "agent"])
def test_post_training_stages_pass_init_indexer_and_warn_on_untrained_indexers(stage, tmp_path, monkeypatch):
    """The GRPO and agent learners load init_from with config.init_indexer (and config.seed for fresh indexers),
    which they dropped before (init_indexer='fresh' loaded the stored indexers), onto the learner's mesh (they
    loaded onto one device: every process read the whole checkpoint), then run the untrained-indexer check on what
    they loaded. Stand-ins: from_pretrained records its arguments and returns an abstract model of the checkpoint's
    architecture, the check stops the learner. Mutant: build_policy without the mesh."""
    import importlib
    import os

    from conftest import FIXTURES

    import dsv32_jax
    from dsv32_jax.train import trainer
    from dsv32_jax.train.config import default_config

    module = importlib.import_module("dsv32_jax.train." + {"grpo": "grpo", "agent": "agent_grpo"}[stage])

    class Checked(Exception):
        pass

    seen = {}

    def loader(path, **kw):
        seen.update(kw, path=path)
        cfg = dsv32_jax.ModelConfig.from_hf(path).replace(**kw["overrides"])
        return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))

    def check(config, init):
        raise Checked(init)

    monkeypatch.setattr(dsv32_jax, "from_pretrained", loader)
    monkeypatch.setattr(trainer, "warn_untrained_indexers", check)  # build_policy's check
    c = default_config()
    c.stage, c.mesh, c.init_from, c.init_indexer, c.seed = stage, "", os.path.join(FIXTURES, "hf_long"), "fresh", 3
    c.model_overrides = {"vocab_size": 2048}
    with pytest.raises(Checked, match="hf_long"):
        getattr(module, {"grpo": "GRPOLearner", "agent": "AgentLearner"}[stage])(c, str(tmp_path))
    assert (seen["init_indexer"], seen["seed"], seen["path"]) == ("fresh", 3, c.init_from)
    assert isinstance(seen["mesh"], jax.sharding.Mesh) and seen["mesh"].size == jax.device_count()


def _params(model):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_init_perturb_moves_a_fresh_models_parameters_by_that_relative_amount_the_same_way_at_every_seed():
    """config.init_perturb (the LM stages and GRPO on a fresh model; tools/train_sweep.sh's perturbed run): every
    floating parameter x -> x (1 + r N(0, 1)), the noise drawn independently of config.seed. Checked against the
    unperturbed model of the same seed: the relative change of the nonzero entries has standard deviation r (within
    10%) and zero mean, and the noise at seed 1 equals the noise at seed 0. Mutants: init_perturb ignored, the noise
    drawn from config.seed."""
    import ml_collections

    from dsv32_jax.train.trainer import fresh_model

    cfg = load_preset("tiny")

    def rel_noise(seed, r):
        conf = ml_collections.ConfigDict(dict(seed=seed, init_perturb=r))
        base = ml_collections.ConfigDict(dict(seed=seed, init_perturb=0.0))
        a = _params(fresh_model(base, cfg, jnp.float32, jnp.float32))
        b = _params(fresh_model(conf, cfg, jnp.float32, jnp.float32))
        return np.concatenate([(y[x != 0] - x[x != 0]) / x[x != 0] for x, y in zip(a, b)])

    n0, n1 = rel_noise(0, 1e-3), rel_noise(1, 1e-3)
    assert n0.size > 10_000
    assert abs(np.std(n0) / 1e-3 - 1) < 0.1 and abs(np.mean(n0)) < 1e-4, (np.std(n0), np.mean(n0))
    np.testing.assert_allclose(n1, n0, atol=1e-6)  # float32 rounding of x (1 + r N) only
    assert np.all(rel_noise(0, 0.0) == 0)


def test_the_lm_trainer_and_the_grpo_policy_start_from_the_perturbed_model_and_a_loaded_one_is_not_perturbed(
        tmp_path, monkeypatch):
    """config.init_perturb reaches the two places a run builds a fresh model: Trainer._build (dense pre-training
    from random init) and build_policy (GRPO from random init), and nothing else: a model loaded through init_from
    keeps the checkpoint's parameters (the perturbation is of a run's random initialization). Mutants: either
    call site building the model without it; build_policy perturbing the loaded model."""
    from dsv32_jax.train.config import default_config
    from dsv32_jax.train.trainer import Trainer, build_policy

    def trainer_params(r):
        c = default_config()
        c.stage, c.init_perturb, c.mesh = "dense", r, ""
        c.model_overrides = {"num_hidden_layers": 1}
        t = Trainer(c, str(tmp_path / f"w{r}"))
        return _params(nnx.merge(t.ts.graphdef, t.ts.state)[0])

    a, b = trainer_params(0.0), trainer_params(1e-2)
    assert all(x.shape == y.shape for x, y in zip(a, b))
    moved = np.concatenate([np.abs(y - x)[x != 0] / np.abs(x[x != 0]) for x, y in zip(a, b)])
    assert 0.005 < np.median(moved) < 0.01, np.median(moved)  # median |N(0, 1)| = 0.674

    c = default_config()
    c.stage, c.init_perturb = "grpo", 1e-2
    cfg = load_preset("tiny").replace(num_hidden_layers=1)
    fresh = _params(build_policy(c, cfg, jnp.float32, jnp.float32, resuming=False))
    c.init_perturb = 0.0
    plain = _params(build_policy(c, cfg, jnp.float32, jnp.float32, resuming=False))
    assert any(not np.array_equal(x, y) for x, y in zip(fresh, plain))

    import dsv32_jax
    saved = Transformer(cfg, rngs=nnx.Rngs(5))
    want = _params(saved)
    from dsv32_jax.train import trainer
    monkeypatch.setattr(dsv32_jax, "from_pretrained", lambda path, **kw: saved)  # stands in for a checkpoint
    monkeypatch.setattr(trainer, "warn_untrained_indexers", lambda config, init: None)
    c.init_perturb, c.init_from = 1e-2, str(tmp_path / "ckpt")
    loaded = _params(build_policy(c, cfg, jnp.float32, jnp.float32, resuming=False))
    assert all(np.array_equal(x, y) for x, y in zip(loaded, want))


def test_init_perturb_that_is_not_a_finite_number_is_refused_naming_the_field(tmp_path):
    from dsv32_jax.train.config import check_config, default_config

    c = default_config()
    c.init_perturb = float("nan")
    with pytest.raises(ValueError, match=r"config\.init_perturb must be a finite number"):
        check_config(c)


def test_build_policy_loads_through_the_lm_stages_loader(tmp_path, monkeypatch):
    """build_policy (GRPO, agent) and Trainer._load_model share `load_init`: the loaded policy is a model of this
    run's config with run_options(config), the loaded parameters unchanged, and a checkpoint whose architecture
    differs from the run's is refused naming config.init_from and the parameter (the post-training stages took any
    checkpoint's shapes before). Mutant: the options not passed to the rebuilt model."""
    import dsv32_jax
    from dsv32_jax.train import trainer
    from dsv32_jax.train.config import default_config

    cfg = load_preset("tiny").replace(num_hidden_layers=1)
    saved = Transformer(cfg, rngs=nnx.Rngs(5))
    monkeypatch.setattr(dsv32_jax, "from_pretrained", lambda path, **kw: saved)
    monkeypatch.setattr(trainer, "warn_untrained_indexers", lambda config, init: None)
    c = default_config()
    c.stage, c.init_from, c.remat = "grpo", str(tmp_path / "ckpt"), "full"
    model = trainer.build_policy(c, cfg, jnp.float32, jnp.float32, resuming=False)
    assert model.options == trainer.run_options(c) and model.options.remat == "full"
    assert model.config == cfg
    assert all(np.array_equal(x, y) for x, y in zip(_params(model), _params(saved)))
    with pytest.raises(ValueError, match=rf"config.init_from={c.init_from}: parameter layers/1/.* has shape None "
                                         r"there but \(.*\) in this run's model"):
        trainer.build_policy(c, cfg.replace(num_hidden_layers=2), jnp.float32, jnp.float32, resuming=False)


def test_setup_refuses_contexts_past_the_models(tmp_path):
    """Three settings ran past the model's context (max_position_embeddings) and were refused late or never (red-
    team audit): GRPO's max_new_tokens (refused by generate at the first rollout, a traceback naming no field),
    data.seq_len (trained at RoPE positions the config says the model does not have; generation then refused the
    model), and the eval CLI's --seq_lens. Each is refused at setup, naming its field."""
    from tests.test_train import load_config

    from dsv32_jax.train.grpo import GRPOLearner
    from dsv32_jax.train.trainer import Trainer

    config = load_config("grpo_tiny", steps=1, **{"grpo.max_new_tokens": 5000})
    with pytest.raises(ValueError, match=r"^config\.grpo\.max_new_tokens=5000 plus the tasks' prompt width \(\d+ "
                                         r"tokens\) exceeds the model's context of 2560 positions"):
        GRPOLearner(config, str(tmp_path / "g"))
    config = load_config("quickstart", steps=1, model_overrides={"max_position_embeddings": 32},
                         **{"data.seq_len": 64, "data.batch_size": 2})
    with pytest.raises(ValueError, match=r"^config\.data\.seq_len=64 exceeds the model's context of 32 positions"):
        Trainer(config, str(tmp_path / "t"))
    config = load_config("quickstart", steps=1, model_overrides={"max_position_embeddings": 32},
                         **{"data.seq_len": 32, "data.batch_size": 2, "eval.every": 1, "eval.seq_len": 48})
    with pytest.raises(ValueError, match=r"^config\.eval\.seq_len=48 exceeds the model's context of 32"):
        Trainer(config, str(tmp_path / "t"))  # (the held-out evaluation's rows: code review)
    config.eval.seq_len = 32
    Trainer(config, str(tmp_path / "t"))  # (rows of exactly the context are fine)


def test_the_context_is_checked_before_the_state_is_built_and_for_the_config_init_from_brings(tmp_path,
                                                                                               monkeypatch):
    """data.seq_len past the context is refused before the parameters are built (a 671B state took minutes to
    allocate before the error), and again for the model config that init_from's checkpoint brings (_init_state
    adopts it: its context may be shorter than the config's)."""
    from tests.test_train import load_config

    from dsv32_jax.train.trainer import Trainer

    built = []
    monkeypatch.setattr(Trainer, "_init_state", lambda self: built.append(self.cfg.max_position_embeddings))
    monkeypatch.setattr(Trainer, "_compile_step", lambda self: None)
    config = load_config("quickstart", steps=1, model_overrides={"max_position_embeddings": 32},
                         **{"data.seq_len": 64, "data.batch_size": 2})
    with pytest.raises(ValueError, match=r"^config\.data\.seq_len=64 exceeds the model's context of 32 positions"):
        Trainer(config, str(tmp_path / "a"))
    assert built == []  # (nothing built)

    def adopt(self):  # init_from's checkpoint: a model of 48 positions
        built.append(self.cfg.max_position_embeddings)
        self.cfg = self.cfg.replace(max_position_embeddings=48)

    monkeypatch.setattr(Trainer, "_init_state", adopt)
    config = load_config("quickstart", steps=1, model_overrides={"max_position_embeddings": 64},
                         **{"data.seq_len": 64, "data.batch_size": 2})
    with pytest.raises(ValueError, match=r"^config\.data\.seq_len=64 exceeds the model's context of 48 positions"):
        Trainer(config, str(tmp_path / "b"))
    assert built == [64]


def test_grpo_max_new_tokens_may_fill_the_context_after_the_prompt_and_not_one_more(tmp_path, monkeypatch):
    """The GRPO context check counts the prompt: max_new_tokens = context - prompt width fits (the last token at
    the last position), one more is refused at setup (the policy is not built here)."""
    import re

    from tests.test_train import load_config

    from dsv32_jax.train import grpo

    class Built(Exception):
        pass

    def build_policy(*a, **k):
        raise Built

    monkeypatch.setattr(grpo, "build_policy", build_policy)
    with pytest.raises(ValueError, match=r"max_new_tokens=5000 plus the tasks' prompt width") as e:
        grpo.GRPOLearner(load_config("grpo_tiny", steps=1, **{"grpo.max_new_tokens": 5000}), str(tmp_path / "a"))
    width = int(re.search(r"prompt width \((\d+) tokens\)", str(e.value)).group(1))
    assert 0 < width < 2560
    with pytest.raises(Built):  # (past the check)
        grpo.GRPOLearner(load_config("grpo_tiny", steps=1, **{"grpo.max_new_tokens": 2560 - width}),
                         str(tmp_path / "b"))
    with pytest.raises(ValueError, match=rf"^config\.grpo\.max_new_tokens={2561 - width} plus the tasks' prompt "
                                         rf"width \({width} tokens\) exceeds the model's context of 2560 positions"):
        grpo.GRPOLearner(load_config("grpo_tiny", steps=1, **{"grpo.max_new_tokens": 2561 - width}),
                         str(tmp_path / "c"))
