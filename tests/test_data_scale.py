"""What the data pipeline meets at scale that the small-corpus tests do not: many files, large rows."""

import json
import os
import resource
import time

import numpy as np
import pytest

from dsv32_jax.train.data import DataConfig, make_iterator


def test_a_corpus_of_more_files_than_open_descriptors_allowed(tmp_path):
    """Shuffled reads over 300 JSONL files under RLIMIT_NOFILE = (descriptors open now) + 100: one cached descriptor
    per file ran into EMFILE ("Too many open files") after ~100 files."""
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(300):
        with open(folder / f"part-{i:05d}.jsonl", "w") as f:
            f.write(json.dumps({"text": f"file {i} " * 8}) + "\n")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + 100 if os.path.isdir("/proc/self/fd") else 200
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.skip("hard RLIMIT_NOFILE too low")
    cfg = DataConfig(source="jsonl", paths=(str(folder),), seq_len=64, batch_size=2, shuffle=True, num_epochs=2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        it = make_iterator(cfg, vocab_size=256)
        seen = sum(int((b["positions"] == 0).sum() - 0) for b in it)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert seen >= 2 * 300  # every document of both epochs was read (a piece starts at position 0)


def test_batches_are_packed_ahead_of_the_consumer(tmp_path, monkeypatch):
    """The next batch is packed while the consumer (the train step) runs: the packer is called again after next()
    returned without another next() (it ran only inside next(), so data time added to every step)."""
    from dsv32_jax.train.data import pipeline

    calls = []
    real = pipeline._with_next_tokens
    monkeypatch.setattr(pipeline, "_with_next_tokens", lambda ids: (calls.append(1), real(ids))[1])
    path = tmp_path / "d.jsonl"
    with open(path, "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"document {i} " * 20}) + "\n")
    cfg = DataConfig(source="jsonl", paths=(str(path),), seq_len=64, batch_size=2, shuffle=False)
    it = make_iterator(cfg, vocab_size=256)
    try:
        first = next(it)
        after_first = len(calls)
        deadline = time.time() + 30
        while len(calls) == after_first and time.time() < deadline:
            time.sleep(0.05)
        assert len(calls) > after_first, "no document was packed between two next() calls"
        state = it.get_state()  # the state is the consumer's (after `first`), not the prefetcher's
        second = next(it)
        it2 = make_iterator(cfg, vocab_size=256)
        it2.set_state(state)
        again = next(it2)
        it2.close()
        for k in second:
            np.testing.assert_array_equal(second[k], again[k])
        assert not np.array_equal(first["tokens"], second["tokens"])
    finally:
        it.close()


def test_invalid_utf8_in_a_jsonl_line_is_replacement_text(tmp_path):
    """A raw invalid UTF-8 byte inside a JSONL string (scraped text) decodes to U+FFFD, as in text files; it raised
    "invalid JSON" and stopped the run at that line (every resume met it again)."""
    path = tmp_path / "bad.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"text": "good one"}\n{"text": "caf\\u00e9 caf\xe9 \xff end"}\n{"text": "good two"}\n')
    cfg = DataConfig(source="jsonl", paths=(str(path),), seq_len=16, batch_size=1, shuffle=False, num_epochs=1)
    toks = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in make_iterator(cfg, vocab_size=256)])
    text = bytes(toks.astype(np.uint8)).decode("utf-8")
    assert text == "good one" + "café caf\ufffd \ufffd end" + "good two"


def test_the_shards_of_one_process_share_one_source(tmp_path, monkeypatch):
    """data.shards=4 on one process indexes the corpus once (each shard built its own JSONL line index / Parquet
    row-group cache: 4x the start-up time and memory), and the batches are those of 4 processes."""
    from dsv32_jax.train.data import pipeline

    path = tmp_path / "d.jsonl"
    with open(path, "w") as f:
        for i in range(64):
            f.write(json.dumps({"text": f"document {i} " * (i % 7 + 1)}) + "\n")
    builds = []
    real = pipeline.make_source
    monkeypatch.setattr(pipeline, "make_source", lambda cfg: (builds.append(1), real(cfg))[1])
    cfg = DataConfig(source="jsonl", paths=(str(path),), seq_len=32, batch_size=4, shards=4, num_epochs=1,
                     shuffle_window=1)
    one = list(make_iterator(cfg, vocab_size=256))
    assert len(builds) == 1
    parts = [list(make_iterator(cfg, vocab_size=256, process_index=p, process_count=4)) for p in range(4)]
    assert len(one) == min(map(len, parts)) > 0
    for b, rows in zip(one, zip(*parts)):
        for k in b:
            np.testing.assert_array_equal(b[k], np.concatenate([r[k] for r in rows]))
