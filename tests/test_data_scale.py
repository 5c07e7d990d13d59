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
        seen = sum(int((b["positions"] == 0).sum()) for b in it)
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
        f.write(b'\xef\xbb\xbf{"text": "good \xff one"}\n{"text": "caf\\u00e9 caf\xe9 \xff end"}\n{"text": "good two"}\n')
    cfg = DataConfig(source="jsonl", paths=(str(path),), seq_len=16, batch_size=1, shuffle=False, num_epochs=1)
    toks = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in make_iterator(cfg, vocab_size=256)])
    text = bytes(toks.astype(np.uint8)).decode("utf-8")
    assert text == "good \ufffd one" + "café caf\ufffd \ufffd end" + "good two"  # (a BOM before a bad byte too)


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
    monkeypatch.setattr(pipeline, "make_source", lambda cfg, **kw: (builds.append(1), real(cfg, **kw))[1])
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


def test_a_process_that_exits_without_closing_its_iterator_exits_cleanly(tmp_path):
    """The prefetch thread packs ahead; a process that took a few batches and ended without closing the iterator
    (a script, a run that returned) aborted at interpreter exit, "terminate called without an active exception"
    and exit status 134, when that daemon thread was inside grain's C++ window shuffle. Iterators are closed at
    exit. (Deterministic before the fix with 16-row windows: 4 of 4 runs aborted.)"""
    import subprocess
    import sys

    script = tmp_path / "take.py"
    script.write_text("from dsv32_jax.train.data import DataConfig, make_iterator\n"
                      "it = make_iterator(DataConfig(seq_len=128, batch_size=8, shuffle_window=16), vocab_size=256)\n"
                      "for _ in range(3):\n    next(it)\nprint('took 3')\n")
    for _ in range(2):
        res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0 and res.stdout.strip() == "took 3", (res.returncode, res.stderr[-2000:])
        assert "terminate called" not in res.stderr, res.stderr[-2000:]


def test_parquet_keeps_few_files_open_and_reads_a_corrupt_row_group_once(tmp_path, monkeypatch):
    """A Parquet corpus kept one open file per file read (thousands of files: EMFILE); at most MAX_OPEN stay open.
    A row group that fails to decode is remembered: with skip_bad_records each of its rows was a full decode attempt
    (a 100K-row group, 100K decodes)."""
    pytest.importorskip("pyarrow")
    from tests.test_data import write_parquet

    from dsv32_jax.train.data.sources import ParquetSource, SkipBadRecords

    files = [str(write_parquet(tmp_path / f"p{i:03d}.parquet", [f"doc {i} a", f"doc {i} b"])) for i in range(40)]
    monkeypatch.setattr(ParquetSource, "MAX_OPEN", 5)
    src = ParquetSource(files, "text")
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    assert [src[2 * i + 1] for i in range(40)] == [f"doc {i} b" for i in range(40)]
    assert len(src._files_open) == 5
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) <= before + 5
    calls = []

    class Corrupt:
        def read_row_group(self, *a, **k):
            calls.append(1)
            raise OSError("Corrupt snappy compressed data")

        def close(self):
            pass

    fresh = SkipBadRecords(ParquetSource(files[:1], "text"))
    fresh.source._files_open[0] = Corrupt()
    assert [fresh[i] for i in range(2)] + [fresh[0]] == ["", "", ""]
    assert calls == [1] and fresh.skipped == 3


def test_the_shards_of_one_process_share_a_parquet_cache_sized_for_all_of_them(tmp_path):
    """data.shards=4 on one process: one Parquet source whose row-group cache holds 4 readers' groups (each shard
    had its own 4; one cache of 4 for 4 drifting readers decodes a group again for most rows)."""
    pytest.importorskip("pyarrow")
    from tests.test_data import write_parquet

    from dsv32_jax.train.data import ShardedBatches
    from dsv32_jax.train.data.sources import ParquetSource

    path = write_parquet(tmp_path / "d.parquet", [f"document {i} " * 4 for i in range(64)])
    cfg = DataConfig(source="parquet", paths=(str(path),), seq_len=32, batch_size=4, shards=4, num_epochs=1)
    batches = ShardedBatches(cfg, vocab_size=256)
    sources = {id(s) for it in batches.iters for s in [_parquet_source_of(it)]}
    assert len(sources) == 1
    assert _parquet_source_of(batches.iters[0]).cached_row_groups == 4 * ParquetSource.CACHED_ROW_GROUPS


def _parquet_source_of(iterator):
    """The ParquetSource under a grain iterator (its MapDataset.source)."""
    from dsv32_jax.train.data.sources import ParquetSource

    seen, todo = set(), [iterator]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, ParquetSource):
            return node
        for v in list(getattr(node, "__dict__", {}).values()):
            if isinstance(v, (list, tuple)):
                todo.extend(v)
            elif hasattr(v, "__dict__"):
                todo.append(v)
    raise AssertionError("no ParquetSource under the iterator")


def test_check_inputs_refuses_a_compressed_file_before_anything_is_built(tmp_path):
    """The compressed-file check runs in check_inputs (what a run calls before it builds its model state)."""
    import gzip

    from dsv32_jax.train.data import check_inputs

    path = tmp_path / "d.jsonl"
    path.write_bytes(gzip.compress(b'{"text": "x"}\n'))
    with pytest.raises(ValueError, match=r"is gzip-compressed"):
        check_inputs(DataConfig(source="jsonl", paths=(str(path),)))


def test_skip_bad_records_skips_in_worker_processes_too(tmp_path):
    """With data.worker_count the records are read in spawned worker processes: SkipBadRecords travels there (a
    pickle) and skips there, and the rows are those of the in-process pipeline."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "first good"}\n{"body": "no text field"}\n{"text": 7}\n{"text": "second good"}\n')
    cfg = DataConfig(source="jsonl", paths=(str(path),), seq_len=8, batch_size=1, shuffle=False, num_epochs=1,
                     skip_bad_records=True, worker_count=1)
    assert _byte_text(cfg) == b"first good" + b"second good"


def test_the_data_pipeline_benchmark_runs_and_reports_each_case(tmp_path):
    """bench/data_pipeline.py end to end at toy sizes (a BPE trained on its corpus, two windows): one JSON line per
    case with the fields BENCHMARKS.md quotes, a resumed first batch, rates > 0."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, os.path.join(root, "bench", "data_pipeline.py"), "--docs=60", "--bpe=400",
                          "--seconds=0.5", "--seq_lens=256", "--batch=2", "--shuffle_windows=4,1"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert lines[0]["bpe_vocab"] <= 400 and lines[0]["bytes_per_token"] > 1
    cases = lines[1:]
    assert [c["shuffle_window"] for c in cases] == [4, 1]
    for c in cases:
        assert c["tokenizer"] == "tokenizer.json" and c["seq_len"] == 256 and c["batches"] > 0
        assert c["tokens_per_s"] > 0 and c["tokens_per_cpu_s"] > 0 and c["resume_first_batch_s"] >= 0
