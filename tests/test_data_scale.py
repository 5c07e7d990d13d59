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


def _byte_text(cfg):
    """The document bytes of every batch of a finite (num_epochs=1, unshuffled) byte-tokenized stream."""
    toks = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in make_iterator(cfg, vocab_size=256)])
    return bytes(toks.astype(np.uint8))


def test_skip_bad_records_skips_what_the_source_refuses_naming_each(tmp_path, caplog):
    """A record without the text field, a line of invalid JSON and a non-string text stopped the run at that record,
    and at every resume; with data.skip_bad_records they read as empty documents, each named in a warning, and the
    stream is the good documents (the first line, which the start-up check reads, is good)."""
    import logging

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "first good"}\n{"body": "no text field"}\n{"text": "broken\n{"text": 5}\n'
                    '{"text": "second good"}\n')
    cfg = DataConfig(source="jsonl", paths=(str(path),), seq_len=8, batch_size=1, shuffle=False, num_epochs=1)
    with pytest.raises(KeyError, match=r"d\.jsonl, line 2: text field 'text' missing"):
        _byte_text(cfg)
    with caplog.at_level(logging.WARNING):
        text = _byte_text(DataConfig(**{**cfg.__dict__, "skip_bad_records": True}))
    assert text == b"first good" + b"second good"
    warned = [r.getMessage() for r in caplog.records if "skip_bad_records" in r.getMessage()]
    assert len(warned) == 3, warned
    for line, what in ((2, "text field 'text' missing"), (3, "invalid JSON"), (4, "text field 'text' holds int, expected a string")):
        assert any(f"d.jsonl, line {line}: {what}" in w for w in warned), (line, warned)
    assert any("(3 record(s) skipped by this process so far)" in w for w in warned), warned  # (threads: any order)


@pytest.mark.parametrize("kind", ["gzip", "bzip2", "xz", "zstd"])
def test_a_compressed_file_is_refused_by_name(tmp_path, kind):
    """A .jsonl.gz failed at its first line with "invalid JSON (... byte 0x8b ...)" and a compressed .txt would have
    trained on the compressed bytes: both are refused at start-up naming the file and the compression."""
    import bz2
    import gzip
    import lzma

    body = b'{"text": "hello"}\n' * 4
    packed = {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress,
              "zstd": lambda b: b"\x28\xb5\x2f\xfd" + b"\x00" * 8}[kind](body)  # (zstd: its magic, no codec needed)
    for source, name in (("jsonl", "d.jsonl"), ("text", "d.txt")):
        path = tmp_path / name
        path.write_bytes(packed)
        cfg = DataConfig(source=source, paths=(str(path),), seq_len=8, batch_size=1)
        with pytest.raises(ValueError, match=rf"^data source '{source}': {path} is {kind}-compressed"):
            make_iterator(cfg, vocab_size=256)
    path.write_bytes(b"BZh is how this plain text starts\n")  # (a text that merely starts like bzip2's magic)
    cfg = DataConfig(source="text", paths=(str(path),), seq_len=8, batch_size=1, shuffle=False, num_epochs=1)
    assert _byte_text(cfg) == b"BZh is how this plain text starts\n"


def test_a_directory_with_hf_dataset_metadata_reads_only_its_data_files(tmp_path):
    """A directory the HF datasets library wrote holds dataset_info.json / state.json beside the data: they were
    read as JSON lines and stopped the run at start-up (no text field); they are skipped like hidden files."""
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "alpha"}\n{"text": "beta"}\n')
    (folder / "dataset_info.json").write_text('{"description": "", "features": {"text": {"dtype": "string"}}}\n')
    (folder / "state.json").write_text('{"_data_files": [{"filename": "train.jsonl"}]}\n')
    cfg = DataConfig(source="jsonl", paths=(str(folder),), seq_len=8, batch_size=1, shuffle=False, num_epochs=1)
    assert _byte_text(cfg) == b"alphabeta"
