"""Parity with HF transformers' DeepseekV32ForCausalLM on committed golden fixtures (tools/make_hf_golden.py)."""

import glob
import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, rel_err

import dsv32_jax
from dsv32_jax import RunOptions

CASES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(FIXTURES, "hf_*")))


def load(case, **options):
    path = os.path.join(FIXTURES, case)
    model = dsv32_jax.from_pretrained(path, dtype=jnp.float32, options=RunOptions(**options))
    return model, np.load(os.path.join(path, "golden.npz"))


def test_fixtures_present():
    assert CASES == ["hf_long", "hf_moe_bias", "hf_short"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("impl", [dict(attention="sparse"), dict(attention="dense", mla_mode="mha")])
def test_logits_and_selections_match_hf(case, impl):
    model, gold = load(case, **impl)
    logits, aux = model(jnp.asarray(gold["tokens"]), return_aux=True)
    err = rel_err(logits, gold["logits"])
    print(f"{case} {impl}: max rel err {err:.2e}")
    assert err <= 1e-4
    for layer in range(model.config.num_hidden_layers):
        ours = np.sort(np.where(np.asarray(aux["topk"][layer]) < 0, np.iinfo(np.int32).max,
                                np.asarray(aux["topk"][layer])), axis=-1)
        theirs = np.sort(np.where(gold[f"topk_l{layer}"] < 0, np.iinfo(np.int32).max, gold[f"topk_l{layer}"]), axis=-1)
        np.testing.assert_array_equal(ours, theirs, err_msg=f"layer {layer} selections differ")


@pytest.mark.parametrize("case", CASES)
def test_dense_attention_matches_hf_dense(case):
    model, gold = load(case, dsa=False)
    assert rel_err(model(jnp.asarray(gold["tokens"])), gold["dense_logits"]) <= 1e-4


def test_selection_matters_in_long_cases():
    """The fixtures can tell sparse from dense: a port that ignored the top-k would fail the parity test."""
    for case in ("hf_long", "hf_moe_bias"):
        gold = np.load(os.path.join(FIXTURES, case, "golden.npz"))
        assert rel_err(gold["logits"], gold["dense_logits"]) > 0.1
    gold = np.load(os.path.join(FIXTURES, "hf_short", "golden.npz"))
    np.testing.assert_array_equal(gold["logits"], gold["dense_logits"])


@pytest.mark.parametrize("case", ["hf_long", "hf_moe_bias"])
def test_greedy_generation_with_the_decode_cache_matches_hf_generate(case):
    """Token for token equal to HF `generate` (greedy; generate.json, tools/make_hf_golden.py) with our decode
    caches (MLA latents + indexer keys): 16 prompt + 16 new tokens with index_topk 8, so the top-k selection is
    active for most decode steps. HF's cached and uncached generate agree on these fixtures (recorded)."""
    import json

    from dsv32_jax.posttrain.generate import generate_ids
    from dsv32_jax.posttrain.sampler import SamplingConfig

    path = os.path.join(FIXTURES, case)
    with open(os.path.join(path, "generate.json")) as f:
        gold = json.load(f)
    assert gold["cached_equals_uncached"] and gold["min_top2_logit_margin"] > 1e-4
    model = dsv32_jax.from_pretrained(path, dtype=jnp.float32)
    n_new = gold["max_new_tokens"]
    assert len(gold["prompt"][0]) + n_new > 2 * model.config.index_topk
    cfg = SamplingConfig(max_new_tokens=n_new, greedy=True, eos_id=-1)
    for row, prompt in enumerate(gold["prompt"]):
        got = generate_ids(model, prompt, cfg)
        assert got == gold[gold["reference"]][row], f"{case} row {row}: {got} != {gold[gold['reference']][row]}"
