"""The model library's refusals of bad input, by name (audit of 2026-12-06): each case below either gave NaN
logits silently, replayed something other than what was recorded, switched a path on with a truthy string, or
failed deep inside jax naming nothing. The valid neighbour of each case still runs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv32_jax import RunOptions, Transformer, load_preset
from dsv32_jax.model.config import ConfigError
from dsv32_jax.posttrain.generate import generate_ids
from dsv32_jax.posttrain.sampler import SamplingConfig, generate


@pytest.fixture(scope="module")
def model():
    return Transformer(load_preset("tiny").replace(num_nextn_predict_layers=0), rngs=nnx.Rngs(0))


def _prompt(model, pad_id=0):
    toks = jnp.asarray([[pad_id] * 3 + [5, 9, 33, 4, 71]], jnp.int32)
    seg = jnp.asarray([[0] * 3 + [1] * 5], jnp.int32)
    pos = jnp.asarray([[0] * 3 + list(range(5))], jnp.int32)
    return toks, seg, pos


def test_decode_checks_the_token_ids_as_the_forward_does(model):
    """decode embedded an id of 300 (vocabulary 256) as NaN (jnp.take's fill) and returned NaN logits for every
    row; an out-of-range id in a padding slot, invisible to attention, did the same."""
    vocab = model.config.vocab_size
    toks, seg, pos = _prompt(model)
    logits, _, _ = model.decode(toks, model.init_cache(1, 8), 0, pos, seg)
    assert np.isfinite(np.asarray(logits)).all()
    for bad in (_prompt(model, pad_id=vocab)[0], toks.at[0, 4].set(300)):
        with pytest.raises(ValueError, match=rf"^token ids must be in \[0, vocab_size={vocab}\), got range"):
            model.decode(bad, model.init_cache(1, 8), 0, pos, seg)
    with pytest.raises(ValueError, match=r"^tokens must be integers, got dtype float32"):
        model.decode(toks.astype(jnp.float32), model.init_cache(1, 8), 0, pos, seg)
    with pytest.raises(ValueError, match=r"^decode: segment_ids \[B, T\] are required"):
        model.decode(toks, model.init_cache(1, 8), 0, pos, None)
    with pytest.raises(ValueError, match=r"^tokens must hold at least one position, got shape \(2, 0\)"):
        model(jnp.zeros((2, 0), jnp.int32))


def test_a_pad_id_outside_the_vocabulary_is_refused_by_every_sampler(model):
    """SamplingConfig.pad_id fills the prompt's left padding and the finished rows: one outside the vocabulary
    made every row's logits NaN (greedy streams of 0s)."""
    vocab = model.config.vocab_size
    cfg = SamplingConfig(max_new_tokens=3, greedy=True, eos_id=-1)
    assert len(generate_ids(model, [5, 9, 33], cfg)) == 3
    bad = SamplingConfig(max_new_tokens=3, greedy=True, eos_id=-1, pad_id=vocab)
    msg = rf"^SamplingConfig\.pad_id={vocab} must be a token id of the model, in \[0, {vocab}\)"
    with pytest.raises(ValueError, match=msg):
        generate_ids(model, [5, 9, 33], bad)
    prompts = jnp.asarray([[0, 5, 9], [7, 8, 9]], jnp.int32)
    with pytest.raises(ValueError, match=msg):
        generate(model, prompts, jnp.asarray([2, 3]), jax.random.key(0), bad)
    with pytest.raises(ValueError, match=rf"^prompts: token ids must be in \[0, vocab_size={vocab}\), got range "
                                         rf"\[5, {vocab}\] \(padding included\)"):
        generate(model, prompts.at[0, 0].set(vocab), jnp.asarray([2, 3]), jax.random.key(0), cfg)


def test_the_decode_cache_must_fit_the_batch_and_the_options(model):
    toks, seg, pos = _prompt(model)
    with pytest.raises(ValueError, match=r"^decode: the cache holds 2 rows and tokens 1: call init_cache\(1, \.\.\.\)"):
        model.decode(toks, model.init_cache(2, 8), 0, pos, seg)
    fp8 = Transformer(model.config, rngs=nnx.Rngs(0), options=RunOptions(fp8_kv=True))
    for built, run, option in ((fp8, model, "fp8_kv"), (model, fp8, "fp8_kv")):
        with pytest.raises(ValueError, match=rf"^decode: the cache was built with {option}="
                                             rf"{built.options.fp8_kv} and "
                                             rf"model\.options has {option}={run.options.fp8_kv}: call init_cache"):
            run.decode(toks, built.init_cache(1, 8), 0, pos, seg)
    idx = Transformer(model.config, rngs=nnx.Rngs(0), options=RunOptions(indexer_fp8=True))
    with pytest.raises(ValueError, match=r"^decode: the cache was built with indexer_fp8=False and model\.options "
                                         r"has indexer_fp8=True"):
        idx.decode(toks, model.init_cache(1, 8), 0, pos, seg)
    assert np.isfinite(np.asarray(fp8.decode(toks, fp8.init_cache(1, 8), 0, pos, seg)[0])).all()


def test_positions_and_segments_must_have_the_tokens_shape(model):
    toks = jnp.zeros((2, 6), jnp.int32)
    with pytest.raises(ValueError, match=r"^positions must have the tokens' shape \[B, T\] = \(2, 6\), got \(2, 7\)"):
        model(toks, positions=jnp.zeros((2, 7), jnp.int32))
    with pytest.raises(ValueError, match=r"^segment_ids must have the tokens' shape \[B, T\] = \(2, 6\), got \(6,\)"):
        model(toks, segment_ids=jnp.ones((6,), jnp.int32))


def test_routing_replay_is_checked_by_layer_shape_and_range(model):
    """Replayed expert ids of another width were reshaped silently (1 or 3 experts per token), a key of a dense
    layer was ignored, and an id outside [0, n_routed_experts) gave NaN logits or another expert's weight."""
    cfg = model.config
    toks = jnp.asarray(np.arange(12).reshape(2, 6) % cfg.vocab_size, jnp.int32)
    _, aux = model(toks, return_aux=True)
    routing = aux["routing"]  # dense layers: None, MoE layers: [2, 6, k]
    moe = [i for i, r in routing.items() if r is not None]
    dense = [i for i, r in routing.items() if r is None]
    assert moe and dense
    replayed = model(toks, routing=routing)  # what was recorded replays (the None entries included)
    assert np.isfinite(np.asarray(replayed)).all()
    k, e, layer = cfg.num_experts_per_tok, cfg.n_routed_experts, moe[0]
    ids = routing[layer]
    for bad, msg in (
            (ids[..., :1], rf"^routing\[{layer}\]: expert ids must be integers of shape \[B, T, num_experts_per_tok\] "
                           rf"= \(2, 6, {k}\), got int32 \(2, 6, 1\)"),
            (ids[:1], rf"^routing\[{layer}\]: .* got int32 \(1, 6, {k}\)"),
            (ids.at[0, 0, 0].set(e), rf"^routing\[{layer}\]: expert ids must be in \[0, n_routed_experts={e}\), "
                                     rf"got range \[0, {e}\]"),
            (ids.at[0, 0, 0].set(-1), rf"^routing\[{layer}\]: expert ids must be in .* got range \[-1, ")):
        with pytest.raises(ValueError, match=msg):
            model(toks, routing={**routing, layer: bad})
    with pytest.raises(ValueError, match=rf"^routing\[{dense[0]}\]: not an MoE layer of this model \(its MoE "
                                         rf"layers: {re.escape(str(moe))}\)"):
        model(toks, routing={dense[0]: ids})
    with pytest.raises(ValueError, match=r"^routing\[9\]: not an MoE layer"):
        model(toks, routing={9: ids})


@pytest.mark.parametrize("field,value,msg", [
    ("dsa", "false", r"^RunOptions\.dsa must be True or False, got 'false'"),
    ("indexer_fp8", "False", r"^RunOptions\.indexer_fp8 must be True or False, got 'False'"),
    ("fp8_kv", 1, r"^RunOptions\.fp8_kv must be True or False, got 1"),
    ("scan_layers", None, r"^RunOptions\.scan_layers must be True or False, got None"),
    ("attn_chunk", "64", r"^RunOptions\.attn_chunk must be an integer >= 1, got '64'"),
    ("index_chunk", 2.5, r"^RunOptions\.index_chunk must be an integer >= 1, got 2\.5"),
    ("attn_chunk", True, r"^RunOptions\.attn_chunk must be an integer >= 1, got True"),
])
def test_run_options_check_their_types(field, value, msg):
    """dsa="false" ran DSA and indexer_fp8="False" the FP8 path (non-empty strings are truthy); a string or
    float chunk failed later inside jax."""
    RunOptions(**{field: {"attn_chunk": 32, "index_chunk": 64}.get(field, False)})
    with pytest.raises(ValueError, match=msg):
        RunOptions(**{field: value})
    assert RunOptions(dsa=np.bool_(False)).dsa == np.bool_(False)
    assert RunOptions(attn_chunk=np.int64(16)).attn_chunk == 16


def test_transformer_options_must_be_run_options():
    with pytest.raises(ValueError, match=r"^Transformer: options must be a RunOptions, got dict"):
        Transformer(load_preset("tiny"), rngs=nnx.Rngs(0), options={"attention": "dense"})


@pytest.mark.parametrize("field,value,msg", [
    ("n_shared_experts", -1, r"field 'n_shared_experts' must be >= 0, got -1"),
    ("rope_theta", 0.0, r"field 'rope_theta' must be a finite number > 0, got 0\.0"),
    ("rope_theta", -1.0, r"field 'rope_theta' must be a finite number > 0"),
    ("rope_factor", 0.0, r"field 'rope_scaling\.factor' must be a finite number >= 1 for yarn, got 0\.0"),
    ("rope_factor", -2.0, r"field 'rope_scaling\.factor' must be a finite number >= 1"),
    ("rope_factor", 0.5, r"field 'rope_scaling\.factor' must be a finite number >= 1 for yarn, got 0\.5"),  # (0, 1)
    ("rope_beta_fast", 0.0, r"field 'rope_scaling\.beta_fast' must be a finite number > 0"),
    ("rope_beta_slow", -1.0, r"field 'rope_scaling\.beta_slow' must be a finite number > 0"),
    ("rope_original_max_position_embeddings", 0,
     r"field 'rope_scaling\.original_max_position_embeddings' must be >= 1, got 0"),
    ("max_position_embeddings", 0, r"field 'max_position_embeddings' must be a positive integer, got 0"),
])
def test_model_config_ranges_are_named(field, value, msg):
    """Each of these built a model that failed in MLIR, in math ("math domain error", ZeroDivisionError) or ran
    with NaN logits (rope factor 0)."""
    cfg = load_preset("tiny")
    with pytest.raises(ConfigError, match=msg):
        cfg.replace(**{field: value}).validate()
    if field.startswith("rope_") and field != "rope_theta":  # the yarn fields are not read by default RoPE
        cfg.replace(rope_type="default", **{field: value}).validate()
