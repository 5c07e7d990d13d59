"""train/data/ (dsv32_jax.train.data): sources, tokenizers, packing (invariants and the training signal against a
numpy reference), determinism, exact resume, host sharding."""

import collections
import json
import os

import numpy as np
import pytest

from dsv32_jax.train import data
from dsv32_jax.train.data import DataConfig, make_dataset, make_iterator, make_tokenizer

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé — text with “quotes” and emoji 🦊 survives the round trip.",
    "short",
    "A much longer document that will not fit into one row of sixteen tokens, so it is split across "
    "several rows, and every piece continues where the previous one stopped.",
    "x",
    "Line one\nline two\n\nparagraph two",
]


def take(it, n=None):
    out = []
    for batch in it:
        out.append(batch)
        if n is not None and len(out) == n:
            break
    return out


def rows(batches):
    return [{k: v[i] for k, v in b.items()} for b in batches for i in range(len(b["tokens"]))]


def documents(batches):
    """Token lists of the documents in stream order (needs rows in order: shuffle_window=0)."""
    docs, cur = [], []
    for row in rows(batches):
        for t in range(len(row["tokens"])):
            if row["segment_ids"][t] == 0:
                continue
            cur.append(int(row["tokens"][t]))
            if row["loss_mask"][t] == 0:
                docs.append(cur)
                cur = []
    assert not cur, "stream ended inside a document"
    return docs


def texts(batches):
    return [bytes(d).decode("utf-8") for d in documents(batches)]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def write_jsonl(path, docs, field="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")
    return str(path)


def write_parquet(path, docs, field="text", row_group_size=2):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=row_group_size)
    return str(path)


def write_arrayrecord(path, records):
    from array_record.python.array_record_module import ArrayRecordWriter

    w = ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        w.write(r)
    w.close()
    return str(path)


def finite(source, paths, **kw):
    kw = {"seq_len": 16, "batch_size": 1, "num_epochs": 1, "shuffle": False, **kw}
    return DataConfig(source=source, paths=tuple(paths), **kw)


# ---------------------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_roundtrip():
    tok = make_tokenizer("byte", vocab_size=256)
    text = "héllo wörld 🦊\n\ttabs"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.eos_id is None and tok.vocab_size == 256
    assert tok.decode(ids) == text
    with pytest.raises(ValueError, match="'byte' has 256 ids but the model's vocab_size is 100"):
        make_tokenizer("byte", vocab_size=100)


def _hf_checkpoint(folder, config=None):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat", "the dog ran"],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>", "<bos>"]))
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    if config is not None:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
    return tok


def test_hf_tokenizer_from_checkpoint_dir(tmp_path):
    ref = _hf_checkpoint(tmp_path / "ckpt", {"eos_token": {"content": "</s>"}})
    tok = make_tokenizer(str(tmp_path / "ckpt"), vocab_size=64)
    assert tok.vocab_size == ref.get_vocab_size() and tok.eos_id == ref.token_to_id("</s>")
    ids = tok.encode("the cat ran")
    assert ids == ref.encode("the cat ran").ids and tok.decode(ids) == "the cat ran"
    assert make_tokenizer(str(tmp_path / "ckpt" / "tokenizer.json")).encode("the dog") == ref.encode("the dog").ids
    with pytest.raises(ValueError, match=r"tokenizer\.json' has \d+ ids but the model's vocab_size is 3"):
        make_tokenizer(str(tmp_path / "ckpt"), vocab_size=3)
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found"):
        make_tokenizer(str(tmp_path))

    # BOS from tokenizer_config.json; EOS from config.json when tokenizer_config.json has none.
    _hf_checkpoint(tmp_path / "b", {"bos_token": "<bos>", "add_bos_token": True})
    with open(tmp_path / "b" / "config.json", "w") as f:
        json.dump({"eos_token_id": 1}, f)
    tok = make_tokenizer(str(tmp_path / "b"))
    assert tok.eos_id == 1 and tok.encode("the cat")[0] == ref.token_to_id("<bos>")

    # Through the pipeline: every document ends with EOS (masked), tokens decode back to the text.
    path = write_jsonl(tmp_path / "d.jsonl", ["the cat sat", "the dog ran on the mat"])
    batches = take(make_iterator(finite("jsonl", [path], tokenizer=str(tmp_path / "ckpt"), seq_len=4),
                                 vocab_size=64))
    docs = documents(batches)
    assert [d[-1] for d in docs] == [tok.eos_id] * 2
    assert [ref.decode(d[:-1]) for d in docs] == ["the cat sat", "the dog ran on the mat"]


# ---------------------------------------------------------------------------------------------------- sources


@pytest.mark.parametrize("source", ["jsonl", "parquet", "arrayrecord", "text"])
def test_source_round_trip(tmp_path, source):
    half = len(DOCS) // 2
    if source == "jsonl":
        paths = [write_jsonl(tmp_path / "a.jsonl", DOCS[:half] + [""]),
                 write_jsonl(tmp_path / "b.jsonl", DOCS[half:])]
        with open(paths[0], "a") as f:
            f.write("\n  \n")  # blank lines are ignored
    elif source == "parquet":
        paths = [write_parquet(tmp_path / "a.parquet", DOCS[:half]), write_parquet(tmp_path / "b.parquet", DOCS[half:])]
    elif source == "arrayrecord":  # raw UTF-8 records and JSON records with the text field
        records = [d.encode() if i % 2 else json.dumps({"text": d}).encode() for i, d in enumerate(DOCS)]
        paths = [write_arrayrecord(tmp_path / "a.array_record", records[:half]),
                 write_arrayrecord(tmp_path / "b.array_record", records[half:])]
    else:
        for i, d in enumerate(DOCS):
            (tmp_path / f"doc{i:02d}.txt").write_text(d, encoding="utf-8")
        paths = [str(tmp_path / "doc0*.txt")]
    # In order: every document exactly once, split across rows, nothing dropped (batch_size 1).
    assert texts(take(make_iterator(finite(source, paths), vocab_size=256))) == DOCS
    # Shuffled documents, 2 epochs: each epoch a permutation of the corpus.
    got = texts(take(make_iterator(finite(source, paths, shuffle=True, shuffle_window=0, num_epochs=2, seed=3),
                                   vocab_size=256)))
    assert sorted(got[:len(DOCS)]) == sorted(DOCS) and sorted(got[len(DOCS):]) == sorted(DOCS)
    assert got != DOCS * 2
    # Shuffled rows too: same tokens overall.
    batches = take(make_iterator(finite(source, paths, shuffle=True, seq_len=8, batch_size=2), vocab_size=256))
    toks = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in batches])
    total = sum(len(d.encode()) for d in DOCS)
    assert len(toks) <= total and total - len(toks) < 2 * 8  # at most the final partial batch is dropped
    if source == "text":
        assert texts(take(make_iterator(finite(source, [str(tmp_path)]), vocab_size=256))) == DOCS


def test_text_source_splits_large_files(tmp_path):
    text = "".join(f"line {i} ünïcode\n" for i in range(500)) + "tail without newline"
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    src = data.TextSource([str(tmp_path / "big.txt")], piece_bytes=1000)
    pieces = [src[i] for i in range(len(src))]
    assert len(pieces) > 5 and "".join(pieces) == text
    assert all(p.endswith("\n") for p in pieces[:-1])


def test_a_utf8_byte_order_mark_is_not_text(tmp_path):
    """A BOM at a text file's start was a document's first character (U+FEFF: 3 byte tokens); one before an
    ArrayRecord JSON record made the record raw text (its markup trained on). JSONL accepted it already."""
    (tmp_path / "a.txt").write_bytes("\ufeffhello\nworld\n".encode("utf-8"))
    src = data.TextSource([str(tmp_path / "a.txt")], piece_bytes=8)
    assert "".join(src[i] for i in range(len(src))) == "hello\nworld\n"
    (tmp_path / "b.jsonl").write_bytes("\ufeff".encode() + b'{"text": "x"}\n{"text": "y"}\n')
    jsonl = data.JsonlSource([str(tmp_path / "b.jsonl")], "text")
    assert [jsonl[0], jsonl[1]] == ["x", "y"]
    ar = write_arrayrecord(tmp_path / "c.array_record", ["\ufeff".encode() + json.dumps({"text": "z"}).encode()])
    assert data.ArrayRecordSource([ar], "text")[0] == "z"


def test_a_lone_surrogate_in_a_json_string_is_replacement_text(tmp_path):
    """JSON may spell a lone surrogate ("\\ud800": common in scraped data); it decoded to a str that no tokenizer can
    encode (UnicodeEncodeError deep in the pipeline, no file named). It becomes U+FFFD, as invalid bytes do; an
    escaped surrogate pair stays the one character it spells."""
    (tmp_path / "s.jsonl").write_text('{"text": "a\\ud800b"}\n{"text": "\\udfff"}\n{"text": "\\ud83d\\ude00 ok"}\n')
    jsonl = data.JsonlSource([str(tmp_path / "s.jsonl")], "text")
    assert [jsonl[i] for i in range(3)] == ["a\ufffdb", "\ufffd", "\U0001F600 ok"]
    ar = write_arrayrecord(tmp_path / "s.array_record", [b'{"text": "x\\udc80"}'])
    assert data.ArrayRecordSource([ar], "text")[0] == "x\ufffd"
    rows = take(make_iterator(DataConfig(source="jsonl", paths=(str(tmp_path / "s.jsonl"),), seq_len=4, batch_size=1,
                                         shuffle=False, num_epochs=1), vocab_size=256))
    assert sum(int(r["loss_mask"].sum()) for r in rows) > 0


def test_parquet_block_shuffle_is_a_permutation(tmp_path):
    docs = [f"doc {i}" for i in range(23)]
    paths = [write_parquet(tmp_path / "a.parquet", docs[:10], row_group_size=3),
             write_parquet(tmp_path / "b.parquet", docs[10:], row_group_size=4)]
    src, blocks = data.make_source(DataConfig(source="parquet", paths=tuple(paths)))
    assert len(src) == 23 and list(blocks) == [0, 3, 6, 9, 10, 14, 18, 22, 23]
    import grain

    ds = data.BlockShuffleMapDataset(grain.MapDataset.source(src), blocks, seed=1).repeat(2)
    e0, e1 = [ds[i] for i in range(23)], [ds[i] for i in range(23, 46)]
    assert sorted(e0) == sorted(docs) and sorted(e1) == sorted(docs) and e0 != e1 and e0 != docs


# ---------------------------------------------------------------------------------------------------- packing


def _random_docs(n, seed=0):
    rng = np.random.default_rng(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    lengths = rng.choice([0, 1, 2, 5, 12, 30, 70], size=n)
    return [" ".join(rng.choice(words, size=k)) for k in lengths]


def test_packing_invariants(tmp_path):
    docs = _random_docs(120)
    path = write_jsonl(tmp_path / "r.jsonl", docs)
    seq = 32
    batches = take(make_iterator(finite("jsonl", [path], seq_len=seq, shuffle=True, seed=5, shuffle_window=0),
                                 vocab_size=256))  # batch_size 1: nothing dropped
    assert all(b["tokens"].shape == (1, seq) for b in batches)
    dtypes = {k: v.dtype for k, v in batches[0].items()}
    assert dtypes == {"tokens": np.int32, "targets": np.int32, "segment_ids": np.int32, "positions": np.int32,
                      "loss_mask": np.float32}
    rs = rows(batches)
    for i, r in enumerate(rs):
        seg, pos, tok, tgt, mask = r["segment_ids"], r["positions"], r["tokens"], r["targets"], r["loss_mask"]
        real = seg > 0
        n = int(real.sum())
        assert real[:n].all() and not real[n:].any(), "padding only at the end of a row"
        assert seg[0] == 1 and np.all(np.diff(seg[:n]) >= 0) and np.all(np.diff(seg[:n]) <= 1)
        assert np.all(mask[~real] == 0) and np.all(tok[~real] == 0)
        for s in range(1, seg.max() + 1):
            idx = np.flatnonzero(seg == s)
            np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))  # positions restart per segment
            # inside a segment the target is the next token
            np.testing.assert_array_equal(tgt[idx[:-1]], tok[idx[1:]])
            assert np.all(mask[idx[:-1]] == 1)
            last = idx[-1]
            if mask[last] == 1:  # the document continues: only at a row end, into the next row's segment 1
                assert last == seq - 1 and i + 1 < len(rs)
                nxt = rs[i + 1]
                assert nxt["segment_ids"][0] == 1 and nxt["positions"][0] == 0 and tgt[last] == nxt["tokens"][0]
            else:
                assert tgt[last] == 0
    assert sorted(texts(batches)) == sorted(d for d in docs if d)


def _id_tokenizer(folder, n):
    """A tokenizer.json whose word "t<k>" is id k (1 <= k <= n; "[UNK]" is 0): any id sequence can be a document."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"t{k}": k for k in range(1, n + 1)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    return os.path.join(folder, "tokenizer.json")


@pytest.mark.parametrize("shuffle_window", [0, 4])
def test_training_pairs_match_a_numpy_reference(tmp_path, rng, shuffle_window):
    """The packed rows carry exactly the documents' next-token training signal: the multiset of (document, position
    in document, token, target, loss_mask) over all real tokens equals a reference computed from the documents alone,
    whatever the splits at row ends (documents shorter, equal to, longer than seq_len, empty), document shuffle and
    row-window shuffle. Every token id is used once in the corpus, so a token names its document and position."""
    seq, epochs = 16, 2
    lengths = np.concatenate([[0, 1, 2, seq - 1, seq, seq + 1, 3 * seq + 5, 0],
                              rng.integers(0, 3 * seq, size=24)])
    rng.shuffle(lengths)
    ids = rng.permutation(int(lengths.sum())) + 1
    docs = np.split(ids, np.cumsum(lengths)[:-1])
    where = {int(t): (d, i) for d, doc in enumerate(docs) for i, t in enumerate(doc)}
    texts = [" ".join(f"t{t}" for t in doc) if len(doc) else " " * (d % 2) for d, doc in enumerate(docs)]

    ref = collections.Counter()  # the reference: next token of the same document, loss on all but the last token
    for d, doc in enumerate(docs):
        for i in range(len(doc)):
            last = i == len(doc) - 1
            ref[(d, i, int(doc[i]), 0 if last else int(doc[i + 1]), 0.0 if last else 1.0)] += epochs

    cfg = finite("jsonl", [write_jsonl(tmp_path / "d.jsonl", texts)], seq_len=seq, shuffle=True,
                 seed=int(rng.integers(1 << 31)), shuffle_window=shuffle_window, num_epochs=epochs, add_eos=False,
                 tokenizer=_id_tokenizer(tmp_path / "tok", len(ids)))
    got = collections.Counter()
    for r in rows(take(make_iterator(cfg, vocab_size=len(ids) + 1))):
        seg, tok, tgt, mask, pos = r["segment_ids"], r["tokens"], r["targets"], r["loss_mask"], r["positions"]
        assert np.all(tok[seg == 0] == 0) and np.all(tgt[seg == 0] == 0) and np.all(mask[seg == 0] == 0)
        for t in np.flatnonzero(seg):
            d, i = where[int(tok[t])]
            got[(d, i, int(tok[t]), int(tgt[t]), float(mask[t]))] += 1
        for s in range(1, int(seg.max()) + 1):  # a segment is one contiguous piece of one document
            idx = np.flatnonzero(seg == s)
            (d0, i0), (d1, i1) = where[int(tok[idx[0]])], where[int(tok[idx[-1]])]
            assert d0 == d1 and [where[int(x)] for x in tok[idx]] == [(d0, i0 + k) for k in range(len(idx))]
            np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))
            assert i0 == 0 or (s == 1 and idx[0] == 0), "a piece starts its document or a row"
            assert i1 == len(docs[d0]) - 1 or idx[-1] == seq - 1, "a piece ends its document or a row"
    assert got == ref


def test_resume_from_every_row_after_a_json_round_trip(tmp_path, rng):
    """Resuming from the state after any number of rows (a JSON round trip, as in checkpoints) gives the rest of the
    stream: states with and without a document split across the row boundary."""
    docs = [" ".join(["w"] * int(n)) for n in rng.integers(0, 12, size=12)]  # 2 bytes per word: splits and exact fits
    cfg = finite("jsonl", [write_jsonl(tmp_path / "d.jsonl", docs)], seq_len=8, shuffle_window=0)
    ref = take(make_iterator(cfg, vocab_size=256))
    for k in range(len(ref) + 1):
        it = make_iterator(cfg, vocab_size=256)
        for _ in range(k):
            next(it)
        resumed = make_iterator(cfg, vocab_size=256)
        resumed.set_state(json.loads(json.dumps(it.get_state())))
        same(take(resumed), ref[k:])


def test_finite_epochs_drop_only_the_final_partial_batch(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", _random_docs(40, seed=1))
    one = rows(take(make_iterator(finite("jsonl", [path], seq_len=16), vocab_size=256)))
    three = rows(take(make_iterator(finite("jsonl", [path], seq_len=16, batch_size=3), vocab_size=256)))
    assert len(three) == 3 * (len(one) // 3) and len(one) % 3 != 0
    same(three, one[:len(three)])
    assert one[-1]["segment_ids"][-1] == 0  # the last partial row is padded, not dropped


# ---------------------------------------------------------------------------------------------------- order


def test_builtin_corpus():
    docs = data.builtin_documents()
    size = sum(len(d.encode()) for d in docs)
    assert len(docs) > 50 and size > 500_000
    assert any("statement" in d for d in docs[:100])
    assert data.make_source(DataConfig())[0].documents == list(docs)
    b = next(make_iterator(DataConfig(seq_len=64, batch_size=4), vocab_size=256))
    assert b["tokens"].shape == (4, 64) and b["tokens"].max() < 256


def test_determinism_and_exact_resume():
    cfg = DataConfig(seq_len=32, batch_size=4, seed=7, shuffle_window=16)
    it = make_iterator(cfg, vocab_size=256)
    first = take(it, 7)
    state = json.loads(json.dumps(it.get_state()))  # stored with checkpoints as JSON
    rest = take(it, 5)
    same(take(make_iterator(cfg, vocab_size=256), 12), first + rest)
    resumed = make_iterator(cfg, vocab_size=256)
    resumed.set_state(state)
    same(take(resumed, 5), rest)
    other = take(make_iterator(DataConfig(seq_len=32, batch_size=4, seed=8), vocab_size=256), 1)[0]
    assert not np.array_equal(other["tokens"], first[0]["tokens"])


@pytest.mark.parametrize("source,window", [("jsonl", 5), ("jsonl", 0), ("parquet", 5)])
def test_resume_across_epochs_and_windows(tmp_path, source, window):
    docs = _random_docs(30, seed=2)
    path = (write_jsonl(tmp_path / "r.jsonl", docs) if source == "jsonl"
            else write_parquet(tmp_path / "r.parquet", docs, row_group_size=4))
    cfg = DataConfig(source=source, paths=(path,), seq_len=16, batch_size=2, seed=11, shuffle_window=window)
    ref = take(make_iterator(cfg, vocab_size=256), 60)  # several epochs
    it = make_iterator(cfg, vocab_size=256)
    done = 0
    for k in (1, 3, 8, 20, 33):
        take(it, k - done)
        done = k
        state = json.loads(json.dumps(it.get_state()))
        resumed = make_iterator(cfg, vocab_size=256)
        resumed.set_state(state)
        same(take(resumed, 6), ref[k:k + 6])


@pytest.mark.parametrize("source", ["jsonl", "parquet"])
def test_multihost_shards_are_disjoint(tmp_path, source):
    docs = [f"document number {i:03d}" + " filler" * (i % 7) for i in range(41)]
    path = (write_jsonl(tmp_path / "h.jsonl", docs) if source == "jsonl"
            else write_parquet(tmp_path / "h.parquet", docs, row_group_size=6))
    cfg = finite(source, [path], shuffle=True, shuffle_window=0, batch_size=2, seed=4)
    shards = [texts(take(make_iterator(cfg, vocab_size=256, process_index=p, process_count=2))) for p in (0, 1)]
    assert shards[0] and shards[1] and not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == sorted(docs)
    b = next(make_iterator(cfg, vocab_size=256, process_index=1, process_count=2))
    assert b["tokens"].shape == (1, 16)
    with pytest.raises(ValueError, match="divisible"):
        make_dataset(DataConfig(batch_size=3), vocab_size=256, process_index=0, process_count=2)


def test_worker_processes_give_the_same_rows_and_resume():
    cfg = DataConfig(seq_len=32, batch_size=4, seed=3, shuffle_window=8)
    ref = take(make_iterator(cfg, vocab_size=256), 10)
    cfg = DataConfig(seq_len=32, batch_size=4, seed=3, shuffle_window=8, worker_count=2)
    it = make_iterator(cfg, vocab_size=256)
    try:
        same(take(it, 6), ref[:6])
        state = json.loads(json.dumps(it.get_state()))
    finally:
        it.close()
    it = make_iterator(cfg, vocab_size=256)
    try:
        it.set_state(state)
        same(take(it, 4), ref[6:])
    finally:
        it.close()


# ---------------------------------------------------------------------------------------------------- errors


def test_error_messages(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        make_dataset(finite("jsonl", [str(tmp_path / "nope.jsonl")]), vocab_size=256)
    with pytest.raises(FileNotFoundError, match=r"no files match .*\*\.parquet"):
        make_dataset(finite("parquet", [str(tmp_path / "*.parquet")]), vocab_size=256)
    with pytest.raises(ValueError, match="paths is empty"):
        DataConfig(source="jsonl")
    with pytest.raises(ValueError, match="data.source must be one of"):
        DataConfig(source="csv")
    # a path with the built-in corpus trained on the built-in corpus, silently (even a file that does not exist)
    with pytest.raises(ValueError, match=r"^data\.paths is set \('/nonexistent/x\.jsonl'\) but data\.source='builtin' "
                                         r"reads no files: set data\.source to their format \(jsonl, "):
        DataConfig(paths=("/nonexistent/x.jsonl",))

    path = write_jsonl(tmp_path / "f.jsonl", ["a", "b"], field="content")
    with pytest.raises(KeyError, match=r"f\.jsonl, line 1: text field 'text' missing"):
        make_dataset(finite("jsonl", [path]), vocab_size=256)
    with open(tmp_path / "g.jsonl", "w") as f:
        f.write('{"text": "ok"}\n{"text": 5}\n')
    with pytest.raises(ValueError, match=r"g\.jsonl, line 2: text field 'text' holds int"):
        take(make_iterator(finite("jsonl", [str(tmp_path / "g.jsonl")]), vocab_size=256))

    pq_path = write_parquet(tmp_path / "c.parquet", ["a"], field="body")
    with pytest.raises(KeyError, match=r"c\.parquet: Parquet column 'text' missing"):
        make_dataset(finite("parquet", [pq_path]), vocab_size=256)
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match=r"cannot read Parquet file .*bad\.parquet"):
        make_dataset(finite("parquet", [str(tmp_path / "bad.parquet")]), vocab_size=256)

    ar = write_arrayrecord(tmp_path / "x.array_record", [json.dumps({"body": "a"}).encode()])
    with pytest.raises(KeyError, match=r"x\.array_record.*text field 'text' missing"):
        make_dataset(finite("arrayrecord", [ar]), vocab_size=256)

    with pytest.raises(ValueError, match="vocab_size is 128"):
        make_dataset(DataConfig(), vocab_size=128)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no documents"):
        make_dataset(finite("jsonl", [str(tmp_path / "empty.jsonl")]), vocab_size=256)


@pytest.mark.heavy  # >= 20 s on 2 AMD EPYC cores (2026-12-01): out of make test's 15 minutes
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_stream_with_no_usable_document_raises_instead_of_hanging(tmp_path, shuffle):
    """Documents that are all empty, or all shorter than data.min_doc_tokens, on an endless stream: an error after
    two passes that names the source and the field (an endless stream of rejected documents never yields a batch)."""
    blank = write_jsonl(tmp_path / "blank.jsonl", ["  ", "\n", ""])
    with pytest.raises(ValueError, match=r"6 documents in a row of data source 'jsonl' .*blank\.jsonl.*min_doc_tokens"):
        next(make_iterator(finite("jsonl", [blank], num_epochs=None, shuffle=shuffle), vocab_size=256))
    short = write_jsonl(tmp_path / "short.jsonl", ["abc", "defgh", "ij"])
    with pytest.raises(ValueError, match=r"documents in a row .*short\.jsonl.*min_doc_tokens"):
        next(make_iterator(finite("jsonl", [short], num_epochs=None, shuffle=shuffle, min_doc_tokens=6),
                           vocab_size=256))
    with pytest.raises(ValueError, match="built-in corpus's 'heldout' split"):
        next(make_iterator(DataConfig(split="heldout", seq_len=16, batch_size=1, min_doc_tokens=1 << 20),
                           vocab_size=256))
    # one usable document in the pass is enough, however many empty ones surround it
    mixed = write_jsonl(tmp_path / "mixed.jsonl", ["", " ", "abcdefgh", "", "ab"])
    rows = take(make_iterator(finite("jsonl", [mixed], num_epochs=None, shuffle=shuffle, min_doc_tokens=6),
                              vocab_size=256), 3)
    assert all(set(np.unique(r["tokens"])) == set(b"abcdefgh") for r in rows)


def test_window_shuffle_permutes_rows_within_windows_only():
    """grain's WindowShuffleIterDataset gives the training signal of an unshuffled stream: the same rows, each
    window of `shuffle_window` rows permuted in place (rows of one long document spread over batches, no row lost)."""
    window, batch, n_batches = 8, 2, 16
    plain = take(make_iterator(DataConfig(seq_len=32, batch_size=batch, seed=3, shuffle_window=0), vocab_size=256),
                 n_batches)
    shuffled = take(make_iterator(DataConfig(seq_len=32, batch_size=batch, seed=3, shuffle_window=window),
                                  vocab_size=256), n_batches)
    rows = lambda bs: [r.tobytes() for b in bs for r in np.concatenate(  # noqa: E731
        [b["tokens"], b["targets"], b["segment_ids"]], axis=1)]
    a, b = rows(plain), rows(shuffled)
    for w in range(0, len(a), window):
        assert sorted(a[w:w + window]) == sorted(b[w:w + window]), f"window {w // window} holds other rows"
    assert a != b


def test_fixed_shards_give_the_same_global_batch_on_any_process_count():
    """data.shards = 2: one process yields both shards' rows in shard order; two processes yield one half each;
    a merged state of both processes resumes either layout; a different shard count is refused by name."""
    from dsv32_jax.train.data import merge_states

    cfg = DataConfig(seq_len=16, batch_size=4, seed=2, shards=2, shuffle_window=4)
    one = make_iterator(cfg, vocab_size=256)
    parts = [make_iterator(cfg, vocab_size=256, process_index=p, process_count=2) for p in (0, 1)]
    for _ in range(3):
        full = next(one)
        halves = [next(p) for p in parts]
        for key in full:
            np.testing.assert_array_equal(full[key], np.concatenate([h[key] for h in halves]))
    assert full["tokens"].shape == (4, 16) and halves[0]["tokens"].shape == (2, 16)
    merged = json.loads(json.dumps(merge_states([p.get_state() for p in parts])))
    want = next(one)
    resumed = make_iterator(cfg, vocab_size=256)  # the 2-process state, continued by 1 process
    resumed.set_state(merged)
    same([next(resumed)], [want])
    with pytest.raises(ValueError, match="data state has 2 shards, this run 4"):
        make_iterator(DataConfig(seq_len=16, batch_size=4, seed=2, shards=4), vocab_size=256).set_state(merged)
    with pytest.raises(ValueError, match="multiple of the process count 3"):
        make_iterator(cfg, vocab_size=256, process_index=0, process_count=3)
    with pytest.raises(ValueError, match="divisible by data.shards 3"):
        DataConfig(batch_size=4, shards=3)
    for it in [one, resumed, *parts]:
        it.close()


def test_resolve_paths_reads_data_files_once(tmp_path):
    """A directory's data files by extension (corpus.txt.gz, part.parquet.crc and files under .cache/ were read as
    data), each file once however it is named (a directory plus a glob over it, a relative and an absolute path,
    doubled every document), and an existing file whose name holds glob characters as that file."""
    from dsv32_jax.train.data.sources import resolve_paths

    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / ".cache").mkdir()
    for name in ("a.txt", "sub/c.txt", "a.txt.gz", "a.txt.orig", ".cache/b.txt", "_SUCCESS", ".a.txt.crc",
                 "shard[0].txt", "t.array_record-00000-of-00002"):
        (d / name).write_text("x")
    got = resolve_paths([str(d)], suffixes=(".txt",), what="t")
    assert [os.path.relpath(p, d) for p in got] == ["a.txt", "shard[0].txt", "sub/c.txt"]
    again = resolve_paths([str(d), str(d / "*.txt"), os.path.relpath(d / "a.txt")], suffixes=(".txt",), what="t")
    assert again == got
    assert resolve_paths([str(d / "shard[0].txt")], suffixes=(".txt",), what="t") == [str(d / "shard[0].txt")]
    assert [os.path.basename(p) for p in resolve_paths([str(d)], suffixes=("array_record", "arrayrecord"),
                                                        what="t")] == ["t.array_record-00000-of-00002"]


def test_parquet_dictionary_encoded_text_column(tmp_path):
    """A dictionary-encoded string column (what a pandas 'category' column writes) is text: it was refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = ["alpha", "beta", "alpha", "gamma"]
    path = str(tmp_path / "dict.parquet")
    pq.write_table(pa.table({"text": pa.array(docs).dictionary_encode()}), path, row_group_size=2)
    assert pq.ParquetFile(path).schema_arrow.field("text").type.value_type == pa.string()
    rows = take(make_iterator(finite("parquet", [path], seq_len=8), vocab_size=256))
    got = b"".join(np.asarray(r["tokens"][0][r["segment_ids"][0] > 0], np.uint8).tobytes() for r in rows)
    assert got == "".join(docs).encode()
