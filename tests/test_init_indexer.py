"""init_from a checkpoint without indexer weights (the paper's warm-up starts from DeepSeek-V3.1-Terminus, an HF
`deepseek_v3` checkpoint): the lightning indexers are initialized fresh, everything else is loaded.

Fixture tests/fixtures/deepseek_v3_short (tools/make_hf_v3_fixture.py): the hf_short V3.2 fixture without its
indexer tensors, saved as `deepseek_v3`; its logits come from HF transformers' DeepseekV3ForCausalLM."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, rel_err
from flax import nnx

import dsv32_jax
from dsv32_jax.model.options import RunOptions
from dsv32_jax.checkpoint.safetensors_io import CheckpointError

V3 = os.path.join(FIXTURES, "deepseek_v3_short")
V32 = os.path.join(FIXTURES, "hf_short")
DENSE = RunOptions(dsa=False, attention="dense")


def _indexers(model) -> list:
    out = []

    def walk(node):
        for key, value in node.items():
            if key == "indexer":
                out.extend(jax.tree.leaves(value))
            elif isinstance(value, dict):
                walk(value)

    walk(nnx.to_pure_dict(nnx.state(model)))
    return out


def _non_indexers(model) -> dict:
    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model)))
    return {k: v for k, v in flat.items() if "indexer" not in k}


def test_deepseek_v3_checkpoint_loads_with_fresh_indexers_and_matches_hf():
    golden = np.load(os.path.join(V3, "golden.npz"))
    model = dsv32_jax.from_pretrained(V3, dtype=jnp.float32, options=DENSE, seed=3)  # init_indexer="auto"
    logits = model(jnp.asarray(golden["tokens"]))
    assert rel_err(logits, golden["logits"]) <= 1e-5  # every non-indexer weight was loaded, and rightly
    fresh = dsv32_jax.Transformer(model.config, rngs=nnx.Rngs(3), dtype=jnp.float32)
    got, want = _indexers(model), _indexers(fresh)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert model.config.index_n_heads > 0  # the indexer geometry: V3.2's defaults (config.json has none)


def test_deepseek_v3_checkpoint_with_init_indexer_load_names_the_missing_tensor():
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.0\.self_attn\.indexer\."):
        dsv32_jax.from_pretrained(V3, dtype=jnp.float32, init_indexer="load")


def test_v32_checkpoint_with_fresh_indexers_loads_everything_else():
    loaded = dsv32_jax.from_pretrained(V32, dtype=jnp.float32)
    fresh = dsv32_jax.from_pretrained(V32, dtype=jnp.float32, init_indexer="fresh", seed=5)
    a, b = _non_indexers(loaded), _non_indexers(fresh)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
    new = _indexers(dsv32_jax.Transformer(fresh.config, rngs=nnx.Rngs(5), dtype=jnp.float32))
    for got, want, old in zip(_indexers(fresh), new, _indexers(loaded)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert not np.array_equal(np.asarray(got), np.asarray(old))


def test_v32_checkpoint_missing_an_indexer_tensor_is_an_error(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "ckpt"
    shutil.copytree(V32, path)
    weights = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.self_attn.indexer.wk.weight"
    del weights[name]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"missing tensor '{name}'"):
        dsv32_jax.from_pretrained(str(path), dtype=jnp.float32)
    with open(path / "config.json") as f:
        assert json.load(f)["model_type"] == "deepseek_v32"


def test_bad_init_indexer_value():
    with pytest.raises(ValueError, match="init_indexer must be one of"):
        dsv32_jax.from_pretrained(V3, init_indexer="random")


def test_warmup_trainer_starts_from_a_deepseek_v3_checkpoint(tmp_path):
    """config.init_from = the V3 fixture: the warm-up builds its model from it (fresh indexers) and one step
    changes only the indexers."""
    from dsv32_jax.train.config import base_config
    from dsv32_jax.train.trainer import Trainer

    c = base_config("warmup_tiny")
    c.init_from, c.model_overrides = V3, {"index_n_heads": 4, "index_head_dim": 32, "index_topk": 8}
    c.data.seq_len, c.data.batch_size, c.mesh, c.optimizer.warmup_steps = 16, 2, "", 0
    trainer = Trainer(c, str(tmp_path / "w"))
    before = {k: np.array(v) for k, v in nnx.traversals.flatten_mapping(nnx.to_pure_dict(trainer.ts.state[0])).items()}
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, trainer.cfg.vocab_size, (2, 16)).astype(np.int32)
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, 1), "segment_ids": np.ones((2, 16), np.int32),
             "positions": np.tile(np.arange(16, dtype=np.int32), (2, 1)), "loss_mask": np.ones((2, 16), np.float32)}
    metrics = trainer.train_step(batch)
    assert np.isfinite(float(metrics["loss"]))
    after = nnx.traversals.flatten_mapping(nnx.to_pure_dict(trainer.ts.state[0]))
    changed = {k for k in before if not np.array_equal(before[k], np.asarray(after[k]))}
    assert changed and all("indexer" in k for k in changed), sorted(changed)[:5]
    # the frozen rest is the checkpoint's: the embedding equals the V3 fixture's tensor
    from safetensors.numpy import load_file
    embed = load_file(os.path.join(V3, "model.safetensors"))["model.embed_tokens.weight"]
    key = next(k for k in after if k[-1] == "embed" or k[0] == "embed")
    np.testing.assert_array_equal(np.asarray(after[key]), embed.astype(np.float32))


def test_deepseek_v3_converts_to_orbax_with_fresh_indexers(tmp_path):
    """hf-to-orbax of the paper's starting point (a deepseek_v3 checkpoint, no indexer tensors) used to stop at
    the first missing indexer tensor; now the converter writes fresh indexers (init_indexer="auto", recorded in the
    meta), equal to `from_pretrained(..., init_indexer="fresh")`'s from the same seed, and the rest of the model
    gives HF's logits."""
    from dsv32_jax.checkpoint import convert, orbax_io

    out = str(tmp_path / "orbax")
    convert.hf_to_orbax(V3, out, dtype="float32", seed=3, progress=False)
    assert orbax_io.read_meta(out)["indexers"] == {"fresh": True, "seed": 3}
    model = dsv32_jax.from_pretrained(out, dtype=jnp.float32, options=DENSE)
    golden = np.load(os.path.join(V3, "golden.npz"))
    assert rel_err(model(jnp.asarray(golden["tokens"])), golden["logits"]) <= 1e-5
    hf_fresh = dsv32_jax.from_pretrained(V3, dtype=jnp.float32, init_indexer="fresh", seed=3)
    got, want = _indexers(model), _indexers(hf_fresh)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.0\.self_attn\.indexer\."):
        convert.hf_to_orbax(V3, str(tmp_path / "load"), dtype="float32", init_indexer="load", progress=False)


def test_auto_keeps_indexer_tensors_of_a_checkpoint_labelled_deepseek_v3(tmp_path):
    """"auto" used to decide by the model_type label alone: a checkpoint labelled deepseek_v3 that holds indexer
    tensors had them silently replaced by random ones."""
    path = tmp_path / "ckpt"
    shutil.copytree(V32, path)
    with open(path / "config.json") as f:
        raw = json.load(f)
    raw["model_type"] = "deepseek_v3"
    with open(path / "config.json", "w") as f:
        json.dump(raw, f)
    relabelled = dsv32_jax.from_pretrained(str(path), dtype=jnp.float32)
    loaded = dsv32_jax.from_pretrained(V32, dtype=jnp.float32)
    for a, b in zip(_indexers(relabelled), _indexers(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_overrides_reach_orbax_checkpoints(tmp_path):
    """from_pretrained(overrides=...) was ignored for orbax checkpoints and workdirs (the recorded config won,
    silently): now applied; a change of a stored shape is refused by name unless the indexers start fresh."""
    from dsv32_jax.checkpoint import convert

    out = str(tmp_path / "orbax")
    convert.hf_to_orbax(V32, out, dtype="float32", progress=False)
    base = dsv32_jax.from_pretrained(out, dtype=jnp.float32)
    topk = dsv32_jax.from_pretrained(out, dtype=jnp.float32, overrides={"index_topk": 3})
    assert topk.config.index_topk == 3 != base.config.index_topk
    heads = {"index_n_heads": 2 * base.config.index_n_heads}
    with pytest.raises(CheckpointError, match=r"parameter 'layers/0/attn/indexer/.*' has shape"):
        dsv32_jax.from_pretrained(out, dtype=jnp.float32, overrides=heads)
    fresh = dsv32_jax.from_pretrained(out, dtype=jnp.float32, overrides=heads, init_indexer="fresh", seed=1)
    assert fresh.config.index_n_heads == heads["index_n_heads"]
    a, b = _non_indexers(base), _non_indexers(fresh)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
    want = _indexers(dsv32_jax.Transformer(fresh.config, rngs=nnx.Rngs(1), dtype=jnp.float32))
    for got, new in zip(_indexers(fresh), want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(new))
