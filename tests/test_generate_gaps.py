"""Generation and sampling (dsv32_jax/posttrain/sampler.py, dsv32_jax/posttrain/generate.py, the dsv32-generate CLI in
train/generate_main.py): checks added by mutation testing (tests/mutate.sh), each guarding a mutant the rest of the
suite let through, named in its docstring. Expected values come from a cache-free re-implementation in this file (a
full forward of the model over a numpy-built layout, one `jax.random.categorical` / argmax per step), from numpy or
from the docstrings' literal contracts, never from the code under test."""

import functools
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES
from flax import nnx

from dsv32_jax import Transformer, load_preset
from dsv32_jax.posttrain.sampler import MultiTurnSampler, SamplingConfig, generate, processed_logits

P, T, TEMP = 6, 5, 0.5  # prompt width, new tokens, sampling temperature


@pytest.fixture(scope="module")
def model():
    cfg = load_preset("tiny").replace(initializer_range=0.1, vocab_size=32, index_topk=4, num_hidden_layers=1,
                                      first_k_dense_replace=0)  # one MoE layer with DSA attention
    return Transformer(cfg, rngs=nnx.Rngs(0))


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, positions, segments):
    logits, aux = nnx.merge(graphdef, state)(tokens, positions=positions, segment_ids=segments, return_aux=True,
                                             mtp=False)
    return logits, {name: {k: v for k, v in aux[name].items() if v is not None} for name in ("routing", "topk")}


def forward(model, tokens, positions, segments):
    """The model's full (cache-free) forward: (logits [B, S, V] numpy, {"routing"/"topk": {layer: numpy}})."""
    graphdef, state = nnx.split(model)
    logits, aux = _forward(graphdef, state, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                           jnp.asarray(segments, jnp.int32))
    return np.asarray(logits, np.float64), jax.tree.map(np.asarray, aux)


def left_padded_layout(lengths, width, total):
    """numpy: segments (1 on a row's real tokens, 0 on its left padding) and RoPE positions (0 at a row's first real
    token, 0 on the padding) for `total` slots whose first `width` hold the left-padded prompts."""
    pad = width - np.asarray(lengths)[:, None]
    idx = np.arange(total)[None, :]
    return (idx >= pad).astype(np.int32), np.maximum(idx - pad, 0).astype(np.int32)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), -1, keepdims=True))


def reference_generate(model, prompts, lengths, key, n_new, *, temperature=1.0, greedy=False, eos_id=-1, pad_id=0):
    """Cache-free sampling: step i runs the full forward over [prompts ; tokens so far] (one buffer of P + n_new
    slots: causal attention hides the unfilled tail), takes the logits at the row's latest token and draws with
    `jax.random.categorical(fold_in(key, i), logits / temperature)` (no truncation) or the argmax. A row stops after
    EOS (pad after it). Returns (tokens [B, n], mask [B, n], log softmax(logits / temperature)[token] [B, n] (greedy:
    temperature 1), full-forward logits [B, S, V])."""
    prompts = np.asarray(prompts)
    b, p = prompts.shape
    buf = np.concatenate([prompts, np.full((b, n_new), pad_id)], 1)
    seg, pos = left_padded_layout(lengths, p, p + n_new)
    toks, mask, logp = np.full((b, n_new), pad_id), np.zeros((b, n_new), bool), np.zeros((b, n_new))
    done = np.zeros(b, bool)
    for i in range(n_new):
        logits, _ = forward(model, buf, pos, seg)
        last = logits[:, p - 1 + i] / (1.0 if greedy else temperature)
        tok = (np.argmax(last, -1) if greedy else
               np.asarray(jax.random.categorical(jax.random.fold_in(key, i), jnp.asarray(last, jnp.float32), -1)))
        tok = np.where(done, pad_id, tok)
        toks[:, i], mask[:, i] = tok, ~done
        logp[:, i] = np.where(done, 0.0, np.take_along_axis(log_softmax(last), tok[:, None], -1)[:, 0])
        buf[:, p + i] = tok
        done |= tok == eos_id
    return toks, mask, logp, forward(model, buf, pos, seg)[0]


def prompts_and_lengths(seed=0, lengths=(6, 3)):
    rng = np.random.default_rng(seed)
    lens = np.asarray(lengths)
    toks = rng.integers(2, 32, (len(lens), P))
    return np.where(np.arange(P)[None] >= P - lens[:, None], toks, 0).astype(np.int32), lens.astype(np.int32)


# ------------------------------------------------------------------------------------------- SamplingConfig
def test_kept_width_literals():
    """kept_width (the K of the recorded kept set, docstring): 0 for plain sampling over the full vocabulary, the
    vocab_size ids when only the codec mask restricts sampling, num_candidates under truncation; a vocab_size equal
    to the model's is no restriction (K = 0), not an error. Mutants guarded: `return limit` (plain sampling
    recorded a [B, T, V] kept set of every id: V x the memory for GRPO batches, and K != 0 switches GRPO's log-probs
    to the candidate path) and `self.vocab_size >= vocab` (a codec as large as the model refused)."""
    assert SamplingConfig().kept_width(256) == 0
    assert SamplingConfig(vocab_size=256).kept_width(256) == 0
    assert SamplingConfig(vocab_size=100).kept_width(256) == 100
    assert SamplingConfig(vocab_size=100, top_k=5).kept_width(256) == 5
    assert SamplingConfig(top_p=0.9).kept_width(256) == 64
    assert SamplingConfig(top_p=0.9, max_candidates=64).kept_width(40) == 40
    vals, ids, keep = processed_logits(jnp.zeros((2, 256)), SamplingConfig(vocab_size=256))
    assert ids is None and keep is None and vals.shape == (2, 256)


@pytest.mark.parametrize("fields, match", [
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=-0.5), r"top_p must be in \(0, 1\], got -0.5"),
    (dict(vocab_size=-1), r"vocab_size must be >= 0 \(0: the model's\), got -1"),
])
def test_sampling_config_refuses_top_p_zero_and_a_negative_vocab_size(fields, match):
    """top_p = 0 keeps only the argmax (the first candidate is always kept): greedy under another name, with a
    temperature that changes nothing; a negative vocab_size masked every id. Mutants guarded: `0 <= self.top_p` and
    `self.vocab_size < -1`."""
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**fields)


def test_nucleus_keeps_the_token_that_reaches_top_p_and_no_more():
    """Two equally likely ids (probabilities exactly 0.5 each) and top_p = 0.5: the first already reaches 0.5, so
    the nucleus is that one id ("the smallest set whose mass reaches top_p"); just above 0.5 both are kept.
    Mutant guarded: `(cumsum - probs) <= cfg.top_p` (keeps the second too)."""
    logits = jnp.asarray([[0.0, 0.0, -30.0, -30.0]])
    _, _, keep = processed_logits(logits, SamplingConfig(top_p=0.5, max_candidates=4))
    assert np.asarray(keep)[0].tolist() == [True, False, False, False]
    _, _, keep = processed_logits(logits, SamplingConfig(top_p=0.5001, max_candidates=4))
    assert np.asarray(keep)[0].tolist() == [True, True, False, False]


# ---------------------------------------------------------------------------------------------- generate
@pytest.fixture(scope="module")
def sampled(model):
    """One `generate` call (two left-padded rows of lengths 6 and 3, temperature 0.5, pad_id 3) whose eos_id is a
    token row 0 draws at step 2 or 1 (by the cache-free reference), so row 0 stops early and row 1 goes on; and the
    reference's record of the same call (eos_id applied)."""
    prompts, lens = prompts_and_lengths(0)
    key = jax.random.key(123)
    free, _, _, _ = reference_generate(model, prompts, lens, key, T, temperature=TEMP, pad_id=3)
    eos = next(int(free[0, s]) for s in (2, 1) if free[0, s] not in free[0, :s] and free[0, s] not in free[1, :s + 2])
    want = reference_generate(model, prompts, lens, key, T, temperature=TEMP, eos_id=eos, pad_id=3)
    cfg = SamplingConfig(max_new_tokens=T, temperature=TEMP, eos_id=eos, pad_id=3)
    return dict(prompts=prompts, lens=lens, eos=eos, want=want, r=generate(model, prompts, lens, key, cfg))


def test_generate_equals_cache_free_sampling_with_one_key_per_step(sampled):
    """`generate` (prefill + decode over the MLA / indexer caches) draws the cache-free reference's tokens: step i
    samples categorical(fold_in(key, i), logits / T of the row's latest token) and records log softmax(logits /
    T)[token] (no truncation: no kept set, K = 0); row 0 stops at its EOS, row 1 goes on. Mutant guarded: one key
    for every decode step (`fold_in(rng, 0)` in _decode_loop: the draws of consecutive steps share their Gumbel
    noise; nothing else in the suite looked at which key a step used)."""
    r, (want_tok, want_mask, want_logp, _) = sampled["r"], sampled["want"]
    np.testing.assert_array_equal(np.asarray(r.tokens), want_tok)
    np.testing.assert_array_equal(np.asarray(r.mask), want_mask)
    assert want_mask[0].sum() < T and want_mask[1].sum() > want_mask[0].sum()
    np.testing.assert_allclose(np.asarray(r.logprobs), want_logp, atol=2e-5)
    assert np.asarray(r.kept_ids).shape == (2, T, 0)


def test_generate_checks_host_inputs_without_reading_anything_back_from_the_device(model, sampled):
    """`generate` checks the prompt lengths and ids on the host: given numpy inputs (as GRPO passes them) it reads
    nothing back from the device (it converted them to device arrays and read them back four times: counted at the
    array's host read, since on a CPU the transfer guard lets those through), and draws
    the same tokens as the cache-free reference."""
    cfg = SamplingConfig(max_new_tokens=T, temperature=TEMP, eos_id=sampled["eos"], pad_id=3)
    prompts, lens = np.asarray(sampled["prompts"]), np.asarray(sampled["lens"])
    from jax._src import array as jax_array  # (on a CPU the transfer guard lets host reads through: count them)

    reads = []
    value = jax_array.ArrayImpl._value

    def counted(self):
        reads.append(self.shape)
        return value.fget(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax_array.ArrayImpl, "_value", property(counted))
        r = generate(model, prompts, lens, jax.random.key(123), cfg)
    assert reads == []
    np.testing.assert_array_equal(np.asarray(r.tokens), sampled["want"][0])
    with pytest.raises(ValueError, match=r"prompt_lengths must be in \[1, P=6\]"):
        generate(model, jnp.asarray(prompts), jnp.asarray(lens) + P, jax.random.key(0), cfg)
    with pytest.raises(ValueError, match=r"got range \[0, 32\]"):
        generate(model, jnp.asarray(prompts).at[0, 0].set(32).at[1, 0].set(0), jnp.asarray(lens),
                 jax.random.key(0), cfg)


def test_steps_after_every_row_stopped_record_no_indexer_selection(model, sampled):
    """Both rows stop early (row 0 as in `sampled`; row 1's prompt searched, with the cache-free reference, for one
    that draws eos_id by step T - 2): the loop ends after the later EOS, and the steps it never ran keep the buffers'
    fills: pad tokens, mask 0, log-prob 0, and top-k -1 in every layer (the model's "empty slot", indexer.py).
    Mutant guarded: the top-k buffer filled with 0 (the record then says slot 0 was selected)."""
    prompts, lens, eos, key = sampled["prompts"].copy(), sampled["lens"], sampled["eos"], jax.random.key(123)
    for seed in range(400):
        prompts[1] = prompts_and_lengths(100 + seed)[0][1]
        _, mask, _, _ = reference_generate(model, prompts, lens, key, T, temperature=TEMP, eos_id=eos, pad_id=3)
        if mask.sum(1).max() < T:
            break
    else:
        raise AssertionError("no prompt found for row 1 that stops early")
    n = int(mask.sum(1).max())  # decode steps run
    r = generate(model, prompts, lens, key, SamplingConfig(max_new_tokens=T, temperature=TEMP, eos_id=eos, pad_id=3))
    np.testing.assert_array_equal(np.asarray(r.mask), mask)
    tokens, logp = np.asarray(r.tokens), np.asarray(r.logprobs)
    assert np.all(tokens[:, n:] == 3) and np.all(logp[:, n:] == 0.0)
    for k, sel in r.topk.items():
        sel = np.asarray(sel)
        assert np.all(sel[:, P + n:] == -1), (k, sel[:, P + n:])
        assert np.all(np.any(sel[:, P:P + 1] >= 0, -1)), (k, sel[:, P])  # a step that ran selected real slots


def test_generate_records_the_full_forwards_routing_and_selections(model, sampled):
    """Rollout.routing / .topk hold, for every prompt and generated token [B, P + T, .], the MoE experts and the
    indexer's selected slots that a full forward over [prompts ; tokens] gives (keep routing replays them).
    Reference: the cache-free forward's aux on the real tokens (experts as sorted ids, selections as sets; in the
    left-padded layout a slot index is the sequence index). Mutants guarded: the prompt's and the generated tokens'
    records concatenated in the wrong order (routing or top-k), and a cache one slot short (`p + max_new_tokens -
    1`: the last token's write lands on the slot before it, silently, under jit)."""
    r, prompts, lens = sampled["r"], sampled["prompts"], sampled["lens"]
    seq = np.concatenate([prompts, np.asarray(r.tokens)], 1)
    seg, pos = left_padded_layout(lens, P, P + T)
    seg[:, P:] = np.asarray(r.mask)
    _, aux = forward(model, seq, pos, seg)
    real = seg > 0
    assert sorted(r.routing) == sorted(aux["routing"]) and sorted(r.topk) == sorted(aux["topk"]) and r.topk
    for k, ids in aux["routing"].items():
        got = np.asarray(r.routing[k])
        assert got.shape == ids.shape
        np.testing.assert_array_equal(np.sort(got, -1)[real], np.sort(ids, -1)[real], err_msg=f"routing {k}")
    for k, sel in aux["topk"].items():
        got = np.asarray(r.topk[k])
        assert got.shape == sel.shape
        for b, t in zip(*np.nonzero(real)):
            assert set(got[b, t][got[b, t] >= 0]) == set(sel[b, t][sel[b, t] >= 0]), (k, b, t, got[b, t], sel[b, t])


# ------------------------------------------------------------------------------------------ MultiTurnSampler
def greedy_argmax(model, ids):
    """The greedy next token after `ids` (positions 0..n-1, one segment), from the full forward."""
    logits, _ = forward(model, np.asarray([ids]), np.arange(len(ids))[None], np.ones((1, len(ids))))
    return int(np.argmax(logits[0, -1]))


def recorded_logprobs_vs_full_forward(model, rec):
    """(recorded, full-forward) log-probs at T = 1 of every generated slot of a MultiTurnSampler layout: slot t's
    token under log softmax of the forward's logits at slot t - 1 (plain sampling; the layout is the teacher-forcing
    batch of the whole trajectory)."""
    logits, _ = forward(model, rec["tokens"], rec["positions"], rec["segments"])
    gen = rec["generated"][:, 1:] > 0
    want = np.take_along_axis(log_softmax(logits[:, :-1]), rec["tokens"][:, 1:, None], -1)[..., 0]
    return rec["logprobs"][:, 1:][gen], want[gen]


@pytest.fixture(scope="module")
def mt_cfg(model):
    """Greedy, 4 new tokens, eos_id = the greedy token after [5, 6, 7] (full forward): one config (one compilation
    per batch size) for the multi-turn tests."""
    return SamplingConfig(max_new_tokens=4, greedy=True, eos_id=greedy_argmax(model, [5, 6, 7]))


def test_multiturn_a_row_idle_for_a_turn_sees_none_of_its_decode_slots(model, mt_cfg):
    """Row 1 idles in turn 1 (not live: the decode loop still writes a pad token per step into its cache slots, at
    segment 0) and starts in turn 2: its greedy completion and log-probs equal a fresh one-row sampler's on the same
    piece, and every recorded log-prob equals the full forward's over the layout. Mutant guarded: the decode writing
    finished rows' tokens with their live segment (`row_seg` instead of `where(alive, row_seg, 0)`): the idle slots
    become context the layout does not have."""
    sampler = MultiTurnSampler(model, batch=2, capacity=64, cfg=mt_cfg)
    sampler.step([[5, 6, 7, 8], []], [True, False], jax.random.key(0))
    out = sampler.step([[9, 10], [11, 12, 13]], [True, True], jax.random.key(1))
    fresh = MultiTurnSampler(model, batch=1, capacity=64, cfg=mt_cfg)
    assert len(out[1]) >= 2 and out[1] == fresh.step([[11, 12, 13]], [True], jax.random.key(1))[0]
    rec, alone = jax.device_get(sampler.layout()), jax.device_get(fresh.layout())
    np.testing.assert_allclose(rec["logprobs"][1][rec["generated"][1] > 0],
                               alone["logprobs"][0][alone["generated"][0] > 0], atol=2e-5)
    got, want = recorded_logprobs_vs_full_forward(model, rec)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_multiturn_restart_starts_a_fresh_context(model, mt_cfg):
    """restart(row) (docstring): the row's later slots get segment id + 1 and positions from 0, so its earlier slots
    are invisible. After a first turn on [5, 6, 7, 8, 9] and a restart, the row's greedy completion of
    [10, 11, 12] and its log-probs equal a fresh sampler's; the record gives the new piece and its completion
    segment 2 and positions 0, 1, .... Mutants guarded: `row_seg += 0` (the old context stays visible), positions
    not reset, and the generated slots recorded with segment 1 instead of the row's current segment."""
    sampler = MultiTurnSampler(model, batch=1, capacity=64, cfg=mt_cfg)
    sampler.step([[5, 6, 7, 8, 9]], [True], jax.random.key(0))
    first = sampler.index
    sampler.restart(0)
    out = sampler.step([[10, 11, 12]], [True], jax.random.key(1))
    fresh = MultiTurnSampler(model, batch=1, capacity=64, cfg=mt_cfg)
    assert len(out[0]) >= 2 and out == fresh.step([[10, 11, 12]], [True], jax.random.key(1))
    rec, alone = jax.device_get(sampler.layout()), jax.device_get(fresh.layout())
    second = slice(first, None)
    real = rec["segments"][0, second] > 0
    n = 3 + len(out[0])
    assert rec["segments"][0, second][real].tolist() == [2] * n
    assert rec["positions"][0, second][real].tolist() == list(range(n))
    np.testing.assert_allclose(rec["logprobs"][0, second][rec["generated"][0, second] > 0],
                               alone["logprobs"][0][alone["generated"][0] > 0], atol=2e-5)
    got, want = recorded_logprobs_vs_full_forward(model, rec)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_multiturn_stops_when_every_row_finished_and_counts_only_the_slots_used(model, mt_cfg):
    """All rows at EOS after one token (eos_id = the greedy token after [5, 6, 7]): the step returns [eos], uses the
    16-slot piece + 1 decode slot (the loop stops early; `fits` then counts from 17), and the layout is 17 slots.
    Mutants guarded: the loop running all max_new_tokens steps after every row finished, and the index advanced by
    max_new_tokens instead of the steps run."""
    sampler = MultiTurnSampler(model, batch=1, capacity=64, cfg=mt_cfg)
    assert sampler.step([[5, 6, 7]], [True], jax.random.key(0)) == [[mt_cfg.eos_id]]
    assert sampler.index == 17
    assert jax.device_get(sampler.layout())["tokens"].shape == (1, 17)


def test_multiturn_width_and_fits_boundaries(model):
    """A step takes the longest piece rounded UP to the bucket (16) plus max_new_tokens slots, and fits when that is
    <= capacity: with capacity 20 and max_new_tokens 4, a 16-token piece fits exactly, 17 tokens (32 slots) do not.
    Mutants guarded: `(n // bucket + 1) * bucket` (an exact multiple takes a spare bucket) and `< capacity`."""
    sampler = MultiTurnSampler(model, batch=2, capacity=20, cfg=SamplingConfig(max_new_tokens=4))
    assert sampler._width([[1] * 16, []]) == 16 and sampler._width([[1] * 17, [2]]) == 32
    assert sampler._width([[], []]) == 16
    assert sampler.fits([[1] * 16, []]) and not sampler.fits([[1] * 17, []])


# ------------------------------------------------------------------------------ posttrain/generate.py (streaming)
def test_check_prompt_boundaries():
    """check_prompt (docstring): max_new_tokens cut to the context; a prompt of the whole context (or more) leaves
    no room and is refused; an empty prompt is refused. Context 16: 15 ids leave 1 new token, 12 leave 4 of 10, 16
    are refused. Mutants guarded: `n_prompt > ctx` (a prompt of exactly the context accepted, generating nothing),
    `ctx - n_prompt + 1` (one token past the context) and the empty-prompt check dropped."""
    from dsv32_jax.posttrain.generate import PromptTooLongError, check_prompt

    m = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=16))
    assert check_prompt(m, 15, 10) == 1 and check_prompt(m, 12, 10) == 4 and check_prompt(m, 5, 3) == 3
    with pytest.raises(PromptTooLongError, match=r"p: 16 tokens, but the model's context is 16 tokens .* at most 15"):
        check_prompt(m, 16, 1, where="p")
    with pytest.raises(ValueError, match=r"prompt: empty prompt \(no token ids\)"):
        check_prompt(m, 0, 4)


def test_streamed_ids_must_be_inside_the_vocabulary(model):
    """generate_stream and generate_no_cache refuse an id of the vocabulary's size (32 here: ids are 0..31) before
    running the model (generate_no_cache returned token 0 each step: the id embeds as NaN under jit). Mutant
    guarded: `0 <= i <= vocab`."""
    from dsv32_jax.posttrain.generate import generate_ids, generate_no_cache

    for fn in (generate_ids, generate_no_cache):
        with pytest.raises(ValueError, match=r"prompt: token id 32 outside the model's vocabulary \[0, 32\)"):
            fn(model, [5, 32], SamplingConfig(max_new_tokens=2))


def test_streaming_and_no_cache_generation_equal_the_reference_loop_and_stop_after_eos(model):
    """generate_ids (prefill + one cached step per token) and generate_no_cache draw the cache-free reference's
    tokens for a 5-token prompt at temperature 0.5: step i samples with fold_in(rng, i) (generate_stream's
    docstring); both stop after eos_id, which they yield (eos_id = the reference's last token that is new in it).
    Mutants guarded: the prefill sampling with `rng` itself, step i + 1 with fold_in(rng, i) (step 0's key again),
    and either loop without its EOS check (the suite's other generation tests all ran with eos_id = -1)."""
    from dsv32_jax.posttrain.generate import generate_ids, generate_no_cache

    ids = [7, 3, 9, 12, 4]
    key = jax.random.key(11)
    free, _, _, _ = reference_generate(model, np.asarray([ids]), np.asarray([5]), key, T, temperature=TEMP)
    stop = max(s for s in range(2, T) if free[0, s] not in free[0, :s])
    want = free[0, :stop + 1].tolist()
    cfg = SamplingConfig(max_new_tokens=T, temperature=TEMP, eos_id=want[-1])
    assert generate_ids(model, ids, cfg, key) == want
    assert generate_no_cache(model, ids, cfg, key) == want


# ------------------------------------------------------------------------------------------ the CLI (run, main)
HF_LONG = os.path.join(FIXTURES, "hf_long")  # vocab_size 256, eos 1, no tokenizer.json


def run_cli(prompts, **kw):
    from dsv32_jax.train.generate_main import run

    return run(HF_LONG, prompts, write=lambda s: None, **kw)


@pytest.fixture
def scripted_stream(monkeypatch):
    """Replaces generate_stream (run imports it at call time) by one that records (ids, cfg, rng) and yields the
    byte ids of "ok!"; returns the list of calls."""
    from dsv32_jax.posttrain import generate as gen

    calls = []

    def fake(model, ids, cfg, rng=None):
        calls.append(SimpleNamespace(ids=list(ids), cfg=cfg, rng=rng))
        yield from (ord(c) for c in "ok!")

    monkeypatch.setattr(gen, "generate_stream", fake)
    return calls


def test_run_passes_the_flags_into_the_sampling_config(scripted_stream):
    """run() builds the SamplingConfig from its flags and the tokenizer: --temperature=0 is greedy; the byte
    tokenizer (256 ids, no EOS) on a 256-id model: no vocabulary mask (0) and eos -1 (never stops early); prompt i
    samples with fold_in(key(seed), i); each row's completion is the decoded ids (all of them) and their count.
    Mutants guarded: every prompt sampled with the same key (`rng` for fold_in(rng, i)), and the completion missing
    its last token (`tok.decode(gen[:-1])`: the heavy CLI test only checks that it is a substring of the stream)."""
    rows = run_cli([("a", {"prompt": "hi"}), ("b", {"prompt": "hi", "id": 7})], temperature=0.0, top_p=0.9,
                   max_new_tokens=3, seed=5, tokenizer="byte")
    assert [c.ids for c in scripted_stream] == [list(b"hi")] * 2
    for i, c in enumerate(scripted_stream):
        assert (c.cfg.greedy, c.cfg.temperature, c.cfg.top_p, c.cfg.max_new_tokens) == (True, 1.0, 0.9, 3)
        assert (c.cfg.vocab_size, c.cfg.eos_id, c.cfg.pad_id) == (0, -1, 0)
        want = jax.random.key_data(jax.random.fold_in(jax.random.key(5), i))
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(c.rng)), np.asarray(want))
    assert rows == [{"prompt": "hi", "completion": "ok!", "completion_tokens": 3},
                    {"prompt": "hi", "id": 7, "completion": "ok!", "completion_tokens": 3}]


@pytest.mark.parametrize("kw,want", [
    (dict(top_p=0.99), 256),  # the exact nucleus: every id of the byte tokenizer / model
    (dict(top_p=0.99, tokenizer="chat:tiny"), 113),  # the tokenizer's ids only
    (dict(top_k=100), 100),  # (SamplingConfig refused top_k > its default 64 candidates)
    (dict(top_k=8), 64),
    (dict(top_p=0.9, max_candidates=32), 32),
    (dict(top_p=0.9, top_k=300), 300),  # (a top_k past the vocabulary: no error naming no flag; code review)
    (dict(top_k=32, max_candidates=32), 32),  # (top_k may take the whole candidate set)
])
def test_run_samples_top_p_from_the_whole_vocabulary_unless_told_otherwise(scripted_stream, kw, want):
    """dsv32-generate built SamplingConfig with its default 64 candidates: --top_p=0.99 on a flat distribution kept
    64 ids (mass 0.25), silently, and --top_k=100 failed with a message about a field no flag sets (red-team
    audit). --max_candidates (0: auto) sets the candidate set; auto is the whole vocabulary for top_p."""
    kw.setdefault("tokenizer", "byte")
    run_cli([("a", {"prompt": "hi"})], temperature=1.0, **kw)
    (c,) = scripted_stream
    assert c.cfg.max_candidates == want
    if kw.keys() & {"top_p"} and not kw.keys() & {"max_candidates", "top_k"}:  # a flat distribution's nucleus:
        logits = jnp.zeros((1, 256))
        _, ids, keep = processed_logits(logits, c.cfg)
        assert int(np.asarray(keep).sum()) >= int(0.99 * want)  # (nearly) every id


def test_run_masks_the_sampler_to_a_smaller_tokenizer_and_stops_at_its_eos(scripted_stream):
    """The 113-id chat:tiny codec (EOS id 2) on the 256-id model: the sampler's vocab_size is 113 (ids the codec
    cannot decode are never sampled) and its eos_id the codec's. Mutants guarded: the vocabulary mask dropped
    (`vocab_size=0`) and the tokenizer's EOS ignored (`eos = -1`)."""
    run_cli([("a", {"prompt": "hi"})], temperature=0.7, tokenizer="chat:tiny")
    (c,) = scripted_stream
    assert (c.cfg.vocab_size, c.cfg.eos_id, c.cfg.greedy, c.cfg.temperature) == (113, 2, False, 0.7)


@pytest.mark.parametrize("kw, match", [
    (dict(max_new_tokens=0), r"--max_new_tokens=0: must be >= 1"),
    (dict(top_p=0.0), r"--top_p=0.0: must be in \(0, 1\]"),
    (dict(max_candidates=-1), r"--max_candidates=-1: must be >= 0"),
    (dict(top_k=40, max_candidates=32), r"--top_k=40 exceeds --max_candidates=32 \(the candidate set"),
    (dict(ckpt="/nonexistent/ckpt"), r"--ckpt=/nonexistent/ckpt: does not exist"),
    (dict(tokenizer="chat:bpe"), r"tokenizer chat:bpe: 1536 ids, more than the model's vocab_size 256 \(.*hf_long\); "
                                 r"pass the model's own tokenizer with --tokenizer"),
])
def test_run_refuses_bad_flags_by_name(kw, match):
    """Each refusal names its flag (module docstring: errors name the file, the flag or the line). Mutants guarded:
    `max_new_tokens < 0` (0 reached SamplingConfig's internal message), `0 <= top_p` (likewise), the missing --ckpt
    check (a loader error instead), and a tokenizer larger than the model accepted (ids past the embedding)."""
    from dsv32_jax.train.generate_main import GenerateError, run

    ckpt = kw.pop("ckpt", HF_LONG)
    kw.setdefault("tokenizer", "byte")
    with pytest.raises(GenerateError, match=match):
        run(ckpt, [("--prompt", {"prompt": "hi"})], write=lambda s: None, **kw)


def test_run_refuses_a_tokenizer_one_id_larger_than_the_model(tmp_path):
    """The boundary of the same check: a tokenizer.json of 257 ids (a word-level vocabulary built here) on the
    256-id model is refused by name (the byte tokenizer's 256 ids pass: the other tests). Mutant guarded: the check
    loosened (`> vocab_size + 1000`: the 1536-id chat:bpe case above still fails, a few ids too many do not)."""
    tokenizers = pytest.importorskip("tokenizers")
    from dsv32_jax.train.generate_main import GenerateError

    vocab = {f"w{i}": i for i in range(257)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.save(str(tmp_path / "tokenizer.json"))
    want = r"tokenizer \S*tokenizer\.json: 257 ids, more than the model's vocab_size 256"
    with pytest.raises(GenerateError, match=want):
        run_cli([("--prompt", {"prompt": "w5"})], tokenizer=str(tmp_path / "tokenizer.json"))


def test_read_prompts_refuses_an_empty_messages_list(tmp_path):
    """--chat with "messages": [] is refused by file and line (an empty conversation renders to a prompt with no
    user turn). Mutant guarded: the emptiness check dropped."""
    from dsv32_jax.train.generate_main import GenerateError, read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"messages": []}\n')
    with pytest.raises(GenerateError, match=rf"{path}:2: 'messages' must be a non-empty list of messages"):
        read_prompts(str(path), chat=True)


def test_stream_text_writes_whole_characters_only():
    """stream_text with the byte tokenizer: "é€" arrives as 5 bytes; nothing written holds a replacement character
    and the pieces join to the text; a stream that ends inside a character still writes its decoded tail (one
    U+FFFD). Mutant guarded: writing while a UTF-8 sequence is incomplete (the U+FFFD is written, and the "é" never
    is); the final flush's removal is caught here too (and by the heavy CLI test)."""
    from dsv32_jax.train.data.tokenizers import make_tokenizer
    from dsv32_jax.train.generate_main import stream_text

    tok = make_tokenizer("byte")
    pieces = []
    ids = list("aé€".encode())
    assert stream_text(tok, iter(ids), pieces.append) == ids
    assert "".join(pieces) == "aé€" and not any("\ufffd" in p for p in pieces)
    pieces = []
    stream_text(tok, iter([0x61, 0xC3]), pieces.append)
    assert "".join(pieces) == "a\ufffd"


@pytest.fixture
def cli_main(monkeypatch):
    """main() after absl parses `args`, with run() replaced by a recorder; returns (exit status, run's kwargs)."""
    from absl import app

    from dsv32_jax.train import generate_main as gm

    def call(*args):
        seen = {}
        monkeypatch.setattr(gm, "run", lambda ckpt, prompts, **kw: seen.update(kw, ckpt=ckpt, prompts=prompts))
        gm.FLAGS.unparse_flags()
        try:
            gm.FLAGS(["dsv32-generate", *args])
            return gm.main(["dsv32-generate"]), seen
        except app.UsageError as e:
            return e, seen
        finally:
            gm.FLAGS.unparse_flags()
    return call


def test_main_checks_its_flags_and_passes_them_on(cli_main):
    """main(): exactly one of --prompt / --prompts_file, --thinking only with --chat (absl UsageErrors), and the
    sampling flags reach run(). Mutants guarded: both --prompt and --prompts_file accepted (the file silently
    ignored), --thinking without --chat accepted (it did nothing), and --top_p not passed on."""
    from absl import app

    status, seen = cli_main("--ckpt=c", "--prompt=hi", "--top_p=0.5", "--temperature=0.3", "--seed=4",
                            "--max_new_tokens=9", "--max_candidates=12")
    assert status == 0 and seen["prompts"] == [("--prompt", {"prompt": "hi"})]
    assert (seen["top_p"], seen["temperature"], seen["seed"], seen["max_new_tokens"]) == (0.5, 0.3, 4, 9)
    assert seen["max_candidates"] == 12
    for args, match in [(("--prompt=hi", "--prompts_file=p.jsonl"), "exactly one of --prompt and --prompts_file"),
                        ((), "exactly one of --prompt and --prompts_file"),
                        (("--prompt=hi", "--thinking"), "--thinking applies to chat prompts: add --chat")]:
        err, seen = cli_main("--ckpt=c", *args)
        assert isinstance(err, app.UsageError) and match in str(err) and not seen, (args, err)


def test_main_passes_the_attention_and_top_k_flags_on(cli_main):
    """--top_k, --dsa, --attention, --indexer_fp8 and --fp8_kv reach run() (defaults: 0, auto, sparse, off, off)."""
    status, seen = cli_main("--ckpt=c", "--prompt=hi")
    assert status == 0
    assert [seen[k] for k in ("top_k", "dsa", "attention", "indexer_fp8", "fp8_kv")] == [0, "auto", "sparse", False,
                                                                                          False]
    status, seen = cli_main("--ckpt=c", "--prompt=hi", "--top_k=7", "--dsa=off", "--attention=dense", "--indexer_fp8",
                            "--fp8_kv")
    assert [seen[k] for k in ("top_k", "dsa", "attention", "indexer_fp8", "fp8_kv")] == [7, "off", "dense", True, True]


@pytest.fixture
def loaded_options(monkeypatch):
    """Wraps dsv32_jax.from_pretrained (run calls it through the package) to record the options it is given."""
    import dsv32_jax

    seen, real = [], dsv32_jax.from_pretrained

    def spy(path, *args, options=None, **kw):
        seen.append(options)
        return real(path, *args, options=options, **kw)

    monkeypatch.setattr(dsv32_jax, "from_pretrained", spy)
    return seen


def test_run_builds_the_model_with_the_attention_flags(scripted_stream, loaded_options):
    """run(): the model's RunOptions come from --dsa / --attention / --indexer_fp8 / --fp8_kv, and --top_k reaches
    the SamplingConfig (before, generation always ran the default options: no FP8 indexer or FP8 cache as the
    official inference code runs, no kernels, and a checkpoint with untrained indexers selected at random).
    hf_long holds trained indexer tensors, so "auto" keeps DSA on and says nothing."""
    notes = []
    run_cli([("a", {"prompt": "hi"})], tokenizer="byte", note=notes.append)
    run_cli([("a", {"prompt": "hi"})], tokenizer="byte", dsa="off", attention="dense", indexer_fp8=True, fp8_kv=True,
            top_k=4)
    (auto, forced) = loaded_options
    assert (auto.dsa, auto.attention, auto.indexer_fp8, auto.fp8_kv) == (True, "sparse", False, False) and not notes
    assert (forced.dsa, forced.attention, forced.indexer_fp8, forced.fp8_kv) == (False, "dense", True, True)
    assert [c.cfg.top_k for c in scripted_stream] == [0, 4]
    from dsv32_jax.train.generate_main import GenerateError
    for kw, match in [(dict(top_k=-1), r"--top_k=-1: must be >= 0"), (dict(dsa="yes"), r"--dsa=yes: must be auto")]:
        with pytest.raises(GenerateError, match=match):
            run_cli([("a", {"prompt": "hi"})], tokenizer="byte", **kw)


def test_dsa_auto_attends_densely_where_the_indexers_were_never_trained(tmp_path, monkeypatch, scripted_stream,
                                                                         loaded_options):
    """`untrained_indexers`: an HF checkpoint without indexer tensors (DeepSeek-V3.1-Terminus), an orbax
    conversion that initialized them fresh (dsv32_meta.json "indexers": {"fresh": true}) and a dense-stage training
    workdir (meta "stage": "dense", as train/trainer.py records it) are named; hf_long (indexer tensors), a
    conversion that loaded them and a sparse-stage workdir are not. With --dsa=auto such a checkpoint generates with
    dsa=False and one note on stderr naming why; --dsa=on keeps the selection."""
    import json

    from dsv32_jax.checkpoint import orbax_io
    from dsv32_jax.checkpoint.loading import untrained_indexers
    from dsv32_jax.checkpoint.safetensors_io import HFCheckpoint, write_safetensors

    v3 = tmp_path / "v3"
    v3.mkdir()
    with open(os.path.join(HF_LONG, "config.json")) as f:
        cfg = json.load(f)
    (v3 / "config.json").write_text(json.dumps(dict(cfg, model_type="deepseek_v3")))
    src = HFCheckpoint(HF_LONG)
    name = next(n for n in src.names() if "indexer" not in n)
    write_safetensors(str(v3 / "model.safetensors"), {name: np.zeros((2, 2), np.float32)})
    assert untrained_indexers(HF_LONG) is None
    assert untrained_indexers(str(v3)) == f"{v3}: an HF checkpoint without lightning indexer tensors (model_type " \
                                         "'deepseek_v3')"
    for fresh in (True, False):
        conv = tmp_path / f"orbax_{fresh}"
        (conv / orbax_io.PARAMS_DIR).mkdir(parents=True)
        orbax_io.write_json(str(conv / orbax_io.META_FILE), {"format": orbax_io.FORMAT_NAME,
                                                             "version": orbax_io.FORMAT_VERSION,
                                                             "indexers": {"fresh": fresh}})
        assert (untrained_indexers(str(conv)) is not None) == fresh
    work = tmp_path / "work"
    (work / orbax_io.WORKDIR_CHECKPOINTS).mkdir(parents=True)
    for stage in ("dense", "warmup", "sparse", "grpo"):
        monkeypatch.setattr(orbax_io, "training_checkpoint",
                            lambda path, step=None, stage=stage: SimpleNamespace(meta={"stage": stage}))
        assert (untrained_indexers(str(work)) is not None) == (stage == "dense"), stage

    # through run(): hf_long under a deepseek_v3 label with its indexers hidden is what a V3.1 checkpoint looks like
    monkeypatch.setattr("dsv32_jax.checkpoint.loading.untrained_indexers", lambda path, step=None: f"{path}: why")
    notes = []
    run_cli([("a", {"prompt": "hi"})], tokenizer="byte", note=notes.append)
    run_cli([("a", {"prompt": "hi"})], tokenizer="byte", dsa="on", note=notes.append)
    assert [o.dsa for o in loaded_options] == [False, True]
    assert notes == [f"note: {HF_LONG}: why: attending to every earlier token (--dsa=on selects with these indexers "
                     "anyway)"]


def test_the_streaming_decode_step_compiles_once_per_cache_bucket(model):
    """generate_stream's cache held prompt width + max_new_tokens slots, so the decode step compiled again for every
    16-token prompt bucket (a prompts file of varied lengths: one compile per length bucket). The cache is rounded up
    to CACHE_BUCKET slots (the rest invisible, segment 0): prompts of 5, 20 and 40 tokens share one step program, and
    each still equals the cache-free generation."""
    from dsv32_jax.posttrain import generate as gen

    cfg = SamplingConfig(max_new_tokens=3, temperature=0.7, eos_id=-1, pad_id=0)
    before_step, before_prefill = gen._step._cache_size(), gen._prefill._cache_size()
    for n in (5, 20, 40):
        ids = [int(x) for x in np.random.default_rng(n).integers(2, 32, n)]
        assert gen.generate_ids(model, ids, cfg, jax.random.key(n)) == gen.generate_no_cache(model, ids, cfg,
                                                                                             jax.random.key(n))
    assert gen._step._cache_size() - before_step == 1
    assert gen._prefill._cache_size() - before_prefill == 3  # (one per 16-token prompt bucket)


@pytest.mark.parametrize("base", [16, 64, 256])
def test_buckets_pad_by_at_most_an_eighth_and_stay_few(base):
    """sampler.bucketed: every length up to 128K (and its bucket) rounds up to a multiple of `base`, pads by less than
    max(base, n / 8), never falls below a shorter length's bucket and is its own bucket; the lengths fall into at
    most 16 + 8 per doubling past 16 * base buckets (plain multiples of 16 gave 8,192 prefill / append programs)."""
    from dsv32_jax.posttrain.sampler import bucketed

    top = 1 << 17
    got = np.array([bucketed(n, base) for n in range(1, top + 1)])
    n = np.arange(1, top + 1)
    assert np.all(got >= n) and np.all(got % base == 0)
    assert np.all(got - n < np.maximum(base, n / 8))
    assert np.all(np.diff(got) >= 0)
    assert all(bucketed(int(b), base) == b for b in np.unique(got))
    assert len(np.unique(got)) <= 16 + 8 * max(0, np.log2(top / (16 * base)))
    assert bucketed(0, base) == base


def test_a_prompt_near_the_context_pads_by_16_and_its_cache_stays_within_15_slots_of_it(model, monkeypatch):
    """A prompt whose bucket plus max_new_tokens passes the context is padded to a multiple of 16 as before: its
    bucket (up to 1/8 of its length) made caches up to 6% past the context and a decode program per prompt length
    (review). Shorter prompts keep their buckets, within the context. The cache size is read where it is made."""
    from dsv32_jax.posttrain import generate as gen

    class Made(Exception):
        pass

    sizes = []

    def init_cache(self, batch, slots):
        sizes.append(slots)
        raise Made

    monkeypatch.setattr(type(model), "init_cache", init_cache)
    ctx = model.config.max_position_embeddings
    cfg = SamplingConfig(max_new_tokens=64, eos_id=-1, pad_id=0)
    for n in (ctx - 160, ctx - 100, ctx - 64, ctx - 40, ctx - 1, 300, 1000):
        with pytest.raises(Made):
            next(gen.generate_stream(model, [5] * n, cfg))
        n_new = min(64, ctx - n)
        want = -(-n // 16) * 16 + n_new  # (16-slot padding near the context)
        assert sizes[-1] <= max(ctx, want) and sizes[-1] >= n + n_new, (n, sizes[-1])
        assert sizes[-1] <= ctx + 15, (n, sizes[-1])


def test_prompts_past_256_tokens_share_a_prefill_program_per_bucket(model):
    """Prompts of 257-320 tokens took 4 prefill programs (one per 16 tokens); their buckets step by 32 past 256 tokens,
    so 2 programs, and each generation still equals the cache-free one (the extra left padding is invisible)."""
    from dsv32_jax.posttrain import generate as gen

    cfg = SamplingConfig(max_new_tokens=2, temperature=0.7, eos_id=-1, pad_id=0)
    before = gen._prefill._cache_size()
    for n in (257, 275, 289, 320):
        ids = [int(x) for x in np.random.default_rng(n).integers(2, 32, n)]
        assert gen.generate_ids(model, ids, cfg, jax.random.key(n)) == gen.generate_no_cache(model, ids, cfg,
                                                                                             jax.random.key(n))
    assert gen._prefill._cache_size() - before == 2


def test_the_streaming_cache_fills_a_context_that_is_a_whole_cache_bucket():
    """The decode cache is rounded up to its bucket of base CACHE_BUCKET within the context: a model whose context is
    exactly one bucket (256 positions) still gets one step program for prompts of 5 and 20 tokens (18 and 34 slots
    both round to 256 = the context). Mutant guarded: rounding only to a bucket strictly below the context (18 and
    34 slots: two step programs)."""
    from dsv32_jax.posttrain import generate as gen

    cfg = load_preset("tiny").replace(initializer_range=0.1, vocab_size=32, index_topk=4, num_hidden_layers=1,
                                      first_k_dense_replace=0, max_position_embeddings=gen.CACHE_BUCKET)
    small = Transformer(cfg, rngs=nnx.Rngs(1))
    sampling = SamplingConfig(max_new_tokens=2, temperature=0.7, eos_id=-1, pad_id=0)
    before = gen._step._cache_size()
    for n in (5, 20):
        ids = [int(x) for x in np.random.default_rng(n).integers(2, 32, n)]
        assert len(gen.generate_ids(small, ids, sampling, jax.random.key(n))) == 2
    assert gen._step._cache_size() - before == 1
