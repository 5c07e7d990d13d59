"""Held-out evaluation (train/eval.py): the held-out split, the loss it reports (checked against a float64 numpy
computation from the model's logits), the trainer's periodic eval_loss and the CLI table."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv32_jax import Transformer, load_preset
from dsv32_jax.train import eval as eval_lib
from dsv32_jax.train.config import default_config
from dsv32_jax.train.data import DataConfig, builtin_documents, make_dataset, make_iterator


def test_heldout_split_is_disjoint_and_the_long_split_keeps_long_documents():
    train, held = set(builtin_documents()), builtin_documents("heldout")
    assert len(held) > 20 and not train & set(held)
    n = 256
    cfg = DataConfig(split="heldout", seq_len=n, batch_size=1, shuffle=False, num_epochs=1, min_doc_tokens=n,
                     add_eos=False)
    long_docs = [d for d in held if len(d.encode()) >= n]
    assert 0 < len(long_docs) < len(held)
    stream = np.frombuffer("".join(long_docs).encode(), np.uint8)
    it = make_iterator(cfg, vocab_size=256)
    rows = [next(it) for _ in range(20)]
    got = np.concatenate([r["tokens"][0] for r in rows])
    np.testing.assert_array_equal(got, stream[:len(got)])  # exactly the long documents, in order
    for r in rows:  # every document fills at least a row: a row holds at most two of them
        assert r["segment_ids"].max() <= 2
    with pytest.raises(ValueError, match="data.split must be"):
        DataConfig(split="test")
    with pytest.raises(ValueError, match=r"data.split='heldout' applies to data.source='builtin' only"):
        make_dataset(DataConfig(source="jsonl", paths=("x.jsonl",), split="heldout"), vocab_size=256)
    with pytest.raises(ValueError, match="config.eval.paths"):
        eval_lib.eval_data_config({"source": "jsonl", "paths": ("a.jsonl",), "seq_len": 8, "batch_size": 2},
                                  {"batch_size": 0})
    with pytest.raises(ValueError, match=r"config.eval.paths is set but data.source='builtin' reads no files"):
        eval_lib.eval_data_config({"source": "builtin", "seq_len": 8, "batch_size": 2},
                                  {"batch_size": 0, "paths": ("held.jsonl",)})


def _numpy_loss(model, batches) -> float:
    nll, count = 0.0, 0.0
    for b in batches:
        logits = np.asarray(model(jnp.asarray(b["tokens"]), positions=jnp.asarray(b["positions"]),
                                  segment_ids=jnp.asarray(b["segment_ids"])), np.float64)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        picked = np.take_along_axis(logp, b["targets"][..., None].astype(np.int64), -1)[..., 0]
        nll += float(-(picked * b["loss_mask"]).sum())
        count += float(b["loss_mask"].sum())
    return nll / count


def test_eval_loss_is_the_token_weighted_mean_nll_with_dense_and_dsa_attention():
    cfg = load_preset("tiny").replace(initializer_range=0.3, index_topk=8)
    model = Transformer(cfg, rngs=nnx.Rngs(4), dtype=jnp.float32)
    batches = eval_lib.eval_batches(DataConfig(split="heldout", seq_len=48, batch_size=2), cfg.vocab_size, 2)
    losses = {}
    for attention in ("dense", "dsa"):
        got = eval_lib.evaluate_model(model, batches, attention)
        model.options = eval_lib.ATTENTIONS[attention]
        want = _numpy_loss(model, batches)
        assert got["tokens"] == sum(float(b["loss_mask"].sum()) for b in batches)
        assert abs(got["loss"] - want) <= 1e-5 * want, (attention, got, want)
        losses[attention] = got["loss"]
    assert abs(losses["dense"] - losses["dsa"]) > 1e-3  # 48 tokens > top-k 8: the selection changes the loss


def test_evaluating_another_model_of_the_same_architecture_compiles_nothing():
    """The eval table scores each workdir, split and length with a new Evaluator: each made its own jax.jit and
    compiled the same program again (8 compiles for 2 programs; audit, 2026-12-07). Another model of the same
    architecture and the same batches now compile nothing, and its loss is its own."""
    from jax import monitoring

    cfg = load_preset("tiny").replace(initializer_range=0.3, index_topk=8)
    batches = eval_lib.eval_batches(DataConfig(split="heldout", seq_len=32, batch_size=2), cfg.vocab_size, 1)
    first = eval_lib.evaluate_model(Transformer(cfg, rngs=nnx.Rngs(0)), batches, "dsa")
    compiles, counting = [], [True]
    monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: counting[0] and event == "/jax/core/compile/backend_compile_duration"
        and compiles.append(secs))
    second = eval_lib.evaluate_model(Transformer(cfg, rngs=nnx.Rngs(1)), batches, "dsa")
    counting[0] = False
    assert compiles == [] and abs(first["loss"] - second["loss"]) > 1e-4, (compiles, first, second)


@pytest.mark.heavy
def test_trainer_reports_heldout_loss_and_the_cli_writes_the_table(tmp_path):
    from dsv32_jax.train.run import run

    c = default_config()
    c.stage, c.steps, c.mesh, c.log_every = "sparse", 3, "", 1000
    c.data.seq_len, c.data.batch_size = 32, 2
    c.eval.every, c.eval.batches = 2, 2
    c.checkpoint.use_async = False
    c.model_overrides = {"index_topk": 8, "initializer_range": 0.3}
    workdir = str(tmp_path / "sparse")
    history = run(c, workdir)
    evals = [h.get("eval_loss") for h in history]
    assert evals[0] is None and evals[1] is not None and evals[2] is not None  # every 2 steps and the last
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        assert [("eval_loss" in json.loads(line)) for line in f] == [False, True, True]
    # the trainer's sharded evaluation = the single-process path on the final checkpoint, DSA attention
    import dsv32_jax
    model = dsv32_jax.from_pretrained(workdir, dtype=jnp.float32)
    batches = eval_lib.eval_batches(eval_lib.eval_data_config(c.data.to_dict(), c.eval), model.config.vocab_size, 2)
    want = eval_lib.evaluate_model(model, batches, "dsa")["loss"]
    assert abs(evals[2] - want) <= 1e-5 * want

    out = str(tmp_path / "eval")
    assert eval_lib.main([f"--workdirs={workdir}", "--seq_lens=32", "--batches=1", "--batch_size=2",
                          f"--out={out}"]) == 0
    with open(out + ".json") as f:
        table = json.load(f)
    assert {(r["attention"], r["split"]) for r in table["rows"]} == {
        (a, s) for a in ("dense", "dsa") for s in ("heldout", "heldout-long")}
    with open(out + ".md") as f:
        md = f.read()
    assert md.startswith("| model | attention |") and "| dsa |" in md and "heldout-long @ 32" in md
    with pytest.raises(SystemExit, match="does not exist"):
        eval_lib.main([f"--workdirs={tmp_path / 'nope'}"])


HF_SHORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf_short")


def test_cli_scores_held_out_files_through_the_data_flags(tmp_path, rng):
    """--source / --paths / --tokenizer / --text_field: the CLI scores the given files (it read the built-in
    corpus only). Its dense row equals the float64 numpy loss on the batches the data pipeline makes of the same
    file; a missing file, files with --source=builtin and a file source without files are named errors."""
    import dsv32_jax

    docs = ["".join(chr(c) for c in rng.integers(97, 123, int(n))) for n in rng.integers(30, 90, 12)]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    out = str(tmp_path / "eval")
    assert eval_lib.main([f"--workdirs={HF_SHORT}", "--seq_lens=40", "--batches=2", "--batch_size=2",
                          "--source=jsonl", f"--paths={held}", "--text_field=body", "--tokenizer=byte",
                          f"--out={out}"]) == 0
    with open(out + ".json") as f:
        rows = {(r["attention"], r["split"]): r for r in json.load(f)["rows"]}
    model = dsv32_jax.from_pretrained(HF_SHORT, dtype=jnp.float32)
    model.options = eval_lib.ATTENTIONS["dense"]
    cfg = DataConfig(source="jsonl", paths=(str(held),), text_field="body", seq_len=40, batch_size=2, seed=0)
    it = make_iterator(cfg, vocab_size=model.config.vocab_size)
    batches = [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(2)]
    assert set(np.unique(np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in batches]))) <= set(range(97, 123))
    want = _numpy_loss(model, batches)
    got = rows[("dense", "heldout")]
    assert got["tokens"] == sum(float(b["loss_mask"].sum()) for b in batches)
    assert abs(got["loss"] - want) <= 1e-5 * want, (got, want)
    assert rows[("dense", "heldout-long")]["tokens"] > 0  # documents of >= 40 tokens exist in the file

    for args, match in ((["--source=jsonl", f"--paths={tmp_path / 'nope.jsonl'}"], r"held-out data \(--source jsonl"),
                        (["--source=jsonl", f"--paths={held}"], r"held-out data .*line 1: text field 'text' missing"),
                        ([f"--paths={held}"], r"--paths is set .* but --source=builtin reads no files"),
                        (["--source=parquet"], r"--paths names no held-out files: --source=parquet needs them")):
        with pytest.raises(SystemExit, match=match):
            eval_lib.main([f"--workdirs={HF_SHORT}", "--seq_lens=40", "--batches=1", "--tokenizer=byte", *args])


def test_a_context_no_held_out_document_reaches_skips_only_the_long_split(tmp_path, rng):
    """Held-out files of short documents made the whole table fail ("no document to train on", naming
    data.min_doc_tokens, a field a CLI user never set): the long split at that context is skipped and named, the
    ordinary held-out column kept."""
    docs = ["".join(chr(c) for c in rng.integers(97, 123, int(n))) for n in rng.integers(20, 40, 12)]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = str(tmp_path / "eval")
    assert eval_lib.main([f"--workdirs={HF_SHORT}", "--seq_lens=24,64", "--batches=1", "--batch_size=2",
                          "--source=jsonl", f"--paths={held}", "--tokenizer=byte", f"--out={out}"]) == 0
    with open(out + ".json") as f:
        table = json.load(f)
    assert {(r["split"], r["seq_len"]) for r in table["rows"]} == {("heldout", 24), ("heldout-long", 24),
                                                                   ("heldout", 64)}
    assert table["skipped"] == {"heldout-long @ 64": "no held-out document of >= 64 tokens"}
    with open(out + ".md") as f:
        assert "Not evaluated: heldout-long @ 64 (no held-out document of >= 64 tokens)." in f.read()


def test_cli_refuses_an_unwritable_out_before_evaluating(tmp_path, monkeypatch):
    """--out=<a path under a regular file>/res computed the whole table, then died with a FileExistsError traceback
    (the --out parent was created only at the end; audit F10): now a one-line error naming --out, before any
    evaluation."""
    def evaluated(*args, **kwargs):
        raise AssertionError("evaluated before --out was checked")

    monkeypatch.setattr(eval_lib, "eval_table", evaluated)
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = str(afile / "res")
    with pytest.raises(SystemExit, match=rf"^error: --out={out}: Not a directory: {afile}$"):
        eval_lib.main([f"--workdirs={HF_SHORT}", "--seq_lens=32", "--batches=1", "--batch_size=2", "--tokenizer=byte",
                       f"--out={out}"])
    (tmp_path / "res.json").mkdir()
    with pytest.raises(SystemExit, match=r"^error: --out=.*/res: .*/res\.json is a directory$"):
        eval_lib.main([f"--workdirs={HF_SHORT}", "--seq_lens=32", "--tokenizer=byte", f"--out={tmp_path / 'res'}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "res.json"]  # nothing created, nothing half-written


def test_cli_reads_the_text_with_the_tokenizer_the_workdirs_record(tmp_path, monkeypatch, capsys):
    """The CLI's --tokenizer defaulted to "byte": a model trained with a tokenizer.json was scored on byte ids
    without a word. Now each workdir's recorded tokenizer is used, workdirs that disagree or record none need
    --tokenizer, and an explicit one that differs from a recording is warned about."""
    from types import SimpleNamespace

    from dsv32_jax.checkpoint import orbax_io

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    conv = tmp_path / "conv"  # a converted checkpoint with its tokenizer.json beside it
    conv.mkdir()
    (conv / "tokenizer.json").write_text("{}")
    records = {str(tmp_path / "bpe"): str(tok / "tokenizer.json"), str(tmp_path / "bpe2"): str(tok),
               str(tmp_path / "byte"): "byte", str(tmp_path / "old"): None}
    monkeypatch.setattr(orbax_io, "is_training_workdir", lambda p: p in records)
    monkeypatch.setattr(orbax_io, "training_checkpoint",
                        lambda p: SimpleNamespace(meta={} if records[p] is None else {"tokenizer": records[p]}))
    bpe, bpe2, byte, old = records
    for w in records:
        os.mkdir(w)
    assert eval_lib.eval_tokenizer([bpe]) == str(tok / "tokenizer.json")
    assert eval_lib.eval_tokenizer([bpe, bpe2]) == str(tok / "tokenizer.json")  # the same file, spelled two ways
    assert eval_lib.eval_tokenizer([byte]) == "byte"
    assert eval_lib.eval_tokenizer([str(conv)]) == str(conv / "tokenizer.json")
    with pytest.raises(ValueError, match=r"^--workdirs record different tokenizers \(.*bpe: .*tokenizer\.json; "
                                         r".*byte: byte\): a loss per token compares only under one; pass --tokenizer"):
        eval_lib.eval_tokenizer([bpe, byte])
    with pytest.raises(ValueError, match=r"^--workdirs: .*old record\(s\) no tokenizer .*: pass --tokenizer$"):
        eval_lib.eval_tokenizer([byte, old])
    assert eval_lib.eval_tokenizer([bpe, old], "byte") == "byte"
    assert capsys.readouterr().err == f"warning: --tokenizer=byte, but {bpe} was trained with {records[bpe]}\n"
    assert eval_lib.eval_tokenizer([bpe], str(tok)) == str(tok) and capsys.readouterr().err == ""

    seen = []  # the CLI hands the resolved tokenizer to the table
    monkeypatch.setattr(eval_lib, "eval_table", lambda *a, data, **k: seen.append(data["tokenizer"]) or {"rows": []})
    assert eval_lib.main([f"--workdirs={bpe}", "--seq_lens=32"]) == 0
    assert seen == [str(tok / "tokenizer.json")]
    with pytest.raises(SystemExit, match=r"^error: --workdirs record different tokenizers"):
        eval_lib.main([f"--workdirs={bpe},{byte}", "--seq_lens=32"])


def _table(path, dense, dsa_gap, model2="sparse (sparse, step 150)"):
    rows = [{"model": "dense (dense, step 300)", "attention": "dense", "split": "heldout", "seq_len": 128,
             "loss": dense, "tokens": 10.0},
            {"model": model2, "attention": "dsa", "split": "heldout", "seq_len": 128, "loss": dense + dsa_gap,
             "tokens": 10.0}]
    path.write_text(json.dumps({"rows": rows}))
    return str(path)


def test_the_sweep_summary_gives_min_median_max_of_each_loss_and_of_each_runs_gap_to_the_dense_row(tmp_path):
    """train/eval_sweep.py (tools/train_sweep.sh's last step): per cell min / median / max over the runs of the loss
    and of the difference to the first row *within each run*. Four runs, dense 2.0 / 3.0 / 2.5 / 2.2 and gaps
    +0.1 / -0.2 / +0.05 / +0.3: the gap's median is +0.075, where the difference of the medians would be 2.525 -
    2.35 = +0.175. Mutant: the gap taken as the rows' medians' difference."""
    from dsv32_jax.train import eval_sweep

    paths = [_table(tmp_path / f"{i}.json", d, g) for i, (d, g) in
             enumerate([(2.0, 0.1), (3.0, -0.2), (2.5, 0.05), (2.2, 0.3)])]
    s = eval_sweep.summarize(eval_sweep.read_tables(paths))
    dense, dsa = s["rows"]
    assert dense["gap"] is None
    np.testing.assert_allclose(dense["loss"], [2.0, 2.35, 3.0])
    np.testing.assert_allclose(dsa["gap"], [-0.2, 0.075, 0.3])  # median of (-0.2, 0.05, 0.1, 0.3)
    np.testing.assert_allclose(dsa["loss"], [2.1, 2.525, 2.8])  # 2.1, 2.5, 2.55, 2.8
    text = eval_sweep.markdown(s)
    assert "2.1000 / 2.5250 / 2.8000 (-0.2000 / +0.0750 / +0.3000)" in text


def test_the_sweep_summary_refuses_tables_of_different_shapes_naming_both_files(tmp_path, capsys):
    from dsv32_jax.train import eval_sweep

    a = _table(tmp_path / "a.json", 2.0, 0.1)
    b = _table(tmp_path / "b.json", 2.0, 0.1, model2="warmup (warmup, step 150)")
    with pytest.raises(SystemExit, match=r"b\.json and .*a\.json hold different tables"):
        eval_sweep.main([a, b])
    with pytest.raises(SystemExit, match="at least 2 runs"):
        eval_sweep.main([a])
    rows = json.loads(open(a).read())["rows"]  # the same cells, another first row: the gaps' base differs
    (tmp_path / "r.json").write_text(json.dumps({"rows": rows[::-1]}))
    with pytest.raises(SystemExit, match=r"r\.json and .*a\.json hold different tables \(cells in one only: \[\]; "
                                         r"first rows \('sparse \(sparse, step 150\)', 'dsa'\) / "
                                         r"\('dense \(dense, step 300\)', 'dense'\)\)"):
        eval_sweep.main([a, str(tmp_path / "r.json")])
    (tmp_path / "c.json").write_text("{not json")
    with pytest.raises(SystemExit, match=r"c\.json: not an eval table"):
        eval_sweep.main([a, str(tmp_path / "c.json")])
    assert eval_sweep.main([a, _table(tmp_path / "d.json", 3.0, 0.3), "--out", str(tmp_path / "o" / "s")]) == 0
    assert json.loads((tmp_path / "o" / "s.json").read_text())["rows"][1]["gap"] == pytest.approx([0.1, 0.2, 0.3])


def test_cli_refuses_a_context_past_the_models(capsys, monkeypatch):
    """--seq_lens past a model's max_position_embeddings scored it at RoPE positions it does not have (red-team
    audit): refused by name before any evaluation."""
    moe = os.path.join(os.path.dirname(HF_SHORT), "hf_moe_bias")  # max_position_embeddings 2560
    with pytest.raises(SystemExit, match=rf"^error: --seq_lens: 4096 exceeds the context of {moe}: 2560 positions "
                                         r"\(max_position_embeddings of its model config\)$"):
        eval_lib.main([f"--workdirs={moe}", "--seq_lens=128,4096", "--batches=1", "--batch_size=2",
                       "--tokenizer=byte"])
    # a context of exactly the model's (positions 0 .. 2559) is evaluated: past the check, to the held-out batches
    seen = []

    def batches(cfg, vocab_size, num_batches):
        seen.append(cfg.seq_len)
        raise RuntimeError("stop here")

    monkeypatch.setattr(eval_lib, "eval_batches", batches)
    with pytest.raises(RuntimeError, match="stop here"):
        eval_lib.eval_table([moe], [2560], 1, 2, data={"source": "builtin", "tokenizer": "byte"})
    assert seen == [2560]
    with pytest.raises(eval_lib.SeqLenError, match=rf"^2561 exceeds the context of {moe}: 2560 positions"):
        eval_lib.eval_table([moe], [2560, 2561], 1, 2, data={"source": "builtin", "tokenizer": "byte"})


def test_a_held_out_set_smaller_than_the_evaluation_is_repeated_with_a_warning(tmp_path, caplog):
    """The held-out stream repeats to fill --batches: a one-document file was scored as 17 tokens per column without
    a word (red-team audit). The batches are the same as before, and a warning says how many one pass holds."""
    import logging

    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"text": "hello there"}) + "\n")
    cfg = DataConfig(source="jsonl", paths=(str(path),), seq_len=8, batch_size=1, num_epochs=None, shuffle=False)
    with caplog.at_level(logging.WARNING):
        got = eval_lib.eval_batches(cfg, 256, 3)
    assert len(got) == 3
    assert "one pass holds 2 batch(es) of 1 x 8 tokens, fewer than the 3 evaluated" in caplog.text  # (11 bytes)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert len(eval_lib.eval_batches(cfg, 256, 2)) == 2
    assert "fewer than" not in caplog.text
