"""train/data/ paths the rest of test_data.py does not pin down (found by mutation testing of the pipeline and its
sources): each test names the bug it guards; expected values are literals derived in the docstrings or computed
from the documents with plain Python."""

import numpy as np
from test_data import _hf_checkpoint, finite, take, texts, write_arrayrecord, write_jsonl, write_parquet

from dsv32_jax.train import data
from dsv32_jax.train.data import DataConfig, make_iterator, make_tokenizer



def test_min_doc_tokens_keeps_documents_of_exactly_that_length(tmp_path):
    """data.min_doc_tokens drops documents *shorter* than it: one of exactly min_doc_tokens tokens is kept (an
    off-by-one `>` dropped it; eval's long-context split sets min_doc_tokens = seq_len)."""
    path = write_jsonl(tmp_path / "d.jsonl", ["abcde", "abcdef", "abcdefg"])  # 5, 6, 7 byte tokens
    got = texts(take(make_iterator(finite("jsonl", [path], min_doc_tokens=6, add_eos=False), vocab_size=256)))
    assert got == ["abcdef", "abcdefg"]


def test_null_text_fields_are_skipped_as_empty_documents(tmp_path):
    """A JSONL / ArrayRecord record whose text field is null (common in exported datasets) is an empty document,
    skipped (module docstring), not a "holds NoneType" error."""
    path = tmp_path / "n.jsonl"
    path.write_text('{"text": "first"}\n{"text": null}\n{"text": "last"}\n')
    assert texts(take(make_iterator(finite("jsonl", [str(path)]), vocab_size=256))) == ["first", "last"]
    ar = write_arrayrecord(tmp_path / "n.array_record", [b'{"text": null}', b'{"text": "z"}'])
    assert texts(take(make_iterator(finite("arrayrecord", [ar]), vocab_size=256))) == ["z"]


def test_jsonl_line_index_across_read_chunks(tmp_path):
    """JSONL files are indexed in 16 MiB blocks; the newline offsets of every block after the first must be shifted
    by the bytes before it (a missing shift corrupted every line past 16 MiB). Chunks of 7 bytes here; expected:
    the byte spans of the non-empty lines computed with Python's str.split."""
    from dsv32_jax.train.data.sources import _line_spans

    text = '{"text": "a"}\n\n{"text": "bcdefgh"}\n{"text": "ij"}\n\n\n{"text": "klmnopqrstu"}'
    (tmp_path / "c.jsonl").write_bytes(text.encode())
    want, pos = [], 0
    for line in text.split("\n"):
        if line:
            want.append((pos, pos + len(line)))
        pos += len(line) + 1
    for chunk in (7, 13, 1 << 24):
        starts, ends = _line_spans(str(tmp_path / "c.jsonl"), chunk=chunk)
        assert list(zip(starts.tolist(), ends.tolist())) == want, chunk


def test_text_piece_cut_without_a_newline_lands_on_a_character_boundary(tmp_path):
    """A text file piece is cut at the next newline; where none follows within the look-ahead (a line longer than
    64 KiB), the cut must move past UTF-8 continuation bytes, else a character is split into two U+FFFD."""
    from dsv32_jax.train.data.sources import TextSource

    raw = ("ü" * 10).encode()  # 2 bytes per character: odd offsets are continuation bytes
    (tmp_path / "u.txt").write_bytes(raw)
    with open(tmp_path / "u.txt", "rb") as f:
        assert TextSource._cut(f, 5, len(raw), look=4) == 6  # byte 5 is 0xBC (continuation); 6 starts a character
        assert TextSource._cut(f, 4, len(raw), look=4) == 4


def test_shuffle_depends_on_the_seed(tmp_path):
    """The per-epoch document shuffle is a function of data.seed: the same seed gives the same order, another seed
    another order (a shuffle with a fixed seed passed every other test). Rows unshuffled (window 0) so that the
    document order is visible; 20 documents, so two seeds agreeing by chance has probability 1/20!."""
    docs = [f"doc {i:02d}" for i in range(20)]
    path = write_jsonl(tmp_path / "s.jsonl", docs)
    order = lambda seed: texts(take(make_iterator(  # noqa: E731
        finite("jsonl", [path], shuffle=True, shuffle_window=0, seed=seed), vocab_size=256)))
    a, b = order(1), order(2)
    assert sorted(a) == sorted(b) == docs
    assert a == order(1) and a != b


def test_parquet_row_group_order_changes_between_epochs(tmp_path):
    """BlockShuffleMapDataset permutes the row groups anew each epoch (seeded by (seed, epoch)); with the epoch
    dropped from that seed (or a stale per-epoch cache) every epoch visited the row groups in the same order, and with
    it dropped from the rows' seed every row group kept its inner order. 8 row groups of 3 rows: equal group orders
    by chance have probability 1/8!."""
    import grain

    docs = [f"doc {i:02d}" for i in range(24)]
    src, blocks = data.make_source(DataConfig(source="parquet",
                                              paths=(write_parquet(tmp_path / "p.parquet", docs, row_group_size=3),)))
    ds = data.BlockShuffleMapDataset(grain.MapDataset.source(src), blocks, seed=5).repeat(2)
    group = lambda d: int(d.split()[1]) // 3  # noqa: E731  (row group of a document)
    orders, inner = [], []
    for epoch in range(2):
        got = [ds[epoch * 24 + i] for i in range(24)]
        seen = [group(d) for d in got]
        assert sorted(got) == docs
        assert all(len(set(seen[k:k + 3])) == 1 for k in range(0, 24, 3)), "a row group is read contiguously"
        orders.append(seen[::3])
        inner.append({seen[k]: got[k:k + 3] for k in range(0, 24, 3)})  # row order inside each row group
    assert orders[0] != orders[1]
    assert inner[0] != inner[1]  # the rows inside a group are reshuffled too (all 8 equal by chance: 1/6^8)


def test_four_shards_on_two_processes_keep_the_global_row_order():
    """data.shards = 4 on 2 processes: process p holds the contiguous shards [2p, 2p + 1] (the rows its devices own),
    so process 0's rows followed by process 1's equal the one-process global batch. A strided assignment (shards
    p, p + 2) agreed with it only for shards == process count."""
    cfg = DataConfig(seq_len=16, batch_size=4, seed=2, shards=4, shuffle_window=0)
    one = make_iterator(cfg, vocab_size=256)
    parts = [make_iterator(cfg, vocab_size=256, process_index=p, process_count=2) for p in (0, 1)]
    try:
        assert [p.ids for p in parts] == [[0, 1], [2, 3]]
        for _ in range(2):
            full, halves = next(one), [next(p) for p in parts]
            for key in full:
                np.testing.assert_array_equal(full[key], np.concatenate([h[key] for h in halves]), err_msg=key)
    finally:
        for it in [one, *parts]:
            it.close()


def test_bos_is_not_doubled_when_the_post_processor_adds_it(tmp_path):
    """A tokenizer whose post-processor already prepends BOS, with add_bos_token in tokenizer_config.json (the usual
    Llama-style pair), must yield one BOS, not two."""
    from tokenizers import processors

    tok = _hf_checkpoint(tmp_path / "t", {"bos_token": "<bos>", "add_bos_token": True})
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tok.save(str(tmp_path / "t" / "tokenizer.json"))
    ids = make_tokenizer(str(tmp_path / "t")).encode("the cat")
    assert ids == [bos, tok.token_to_id("the"), tok.token_to_id("cat")]


def test_eos_precedence_tokenizer_config_then_config_json_lists(tmp_path):
    """EOS comes from tokenizer_config.json's eos_token first (it was ignored whenever a well-known name such as
    "</s>" was in the vocabulary), then from config.json's eos_token_id, whose list form (Llama 3 style) means its
    first id. "<bos>" (id 2 of this vocabulary) is used as the EOS so that no fallback can produce it."""
    ref = _hf_checkpoint(tmp_path / "a", {"eos_token": {"content": "<bos>"}})
    assert make_tokenizer(str(tmp_path / "a")).eos_id == ref.token_to_id("<bos>") != ref.token_to_id("</s>")
    _hf_checkpoint(tmp_path / "b", {})
    with open(tmp_path / "b" / "config.json", "w") as f:
        f.write('{"eos_token_id": [2, 1]}')
    assert make_tokenizer(str(tmp_path / "b")).eos_id == 2


def test_tokenizer_one_id_larger_than_the_model_vocabulary_is_refused():
    """The byte tokenizer has 256 ids (0..255): a model with vocab_size 255 has no row for id 255 (boundary of the
    `tokenizer.vocab_size > vocab_size` check); 256 is fine."""
    import pytest

    assert make_tokenizer("byte", vocab_size=256).vocab_size == 256
    with pytest.raises(ValueError, match="'byte' has 256 ids but the model's vocab_size is 255"):
        make_tokenizer("byte", vocab_size=255)


def test_eos_is_not_doubled_when_the_post_processor_appends_it(tmp_path):
    """data.add_eos (the default) ends every document with the tokenizer's EOS; a tokenizer whose post-processor
    already appends it (T5-style "$A </s>") got a second one, and the model was trained to predict EOS after EOS.
    The packed row holds "the cat </s>" once, then the next document."""
    from tokenizers import processors

    tok = _hf_checkpoint(tmp_path / "t", {"eos_token": "</s>"})
    eos = tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", eos)])
    tok.save(str(tmp_path / "t" / "tokenizer.json"))
    path = write_jsonl(tmp_path / "d.jsonl", ["the cat", "the dog"])
    cfg = DataConfig(source="jsonl", paths=(path,), tokenizer=str(tmp_path / "t"), seq_len=8, batch_size=1,
                     num_epochs=1, shuffle=False)
    row = next(make_iterator(cfg, vocab_size=tok.get_vocab_size()))
    the, cat, dog = (tok.token_to_id(w) for w in ("the", "cat", "dog"))
    real = row["segment_ids"][0] > 0
    assert row["tokens"][0][real].tolist() == [the, cat, eos, the, dog, eos]
    assert row["segment_ids"][0][real].tolist() == [1, 1, 1, 2, 2, 2]


def test_special_token_strings_in_documents_are_text_unless_parsing_is_asked_for(tmp_path):
    """A document quoting "<｜User｜>" or "<｜end▁of▁sentence｜>" (a log, a web page about chat models) became the
    special ids mid-row, EOS trained as a target (red-team audit; the chat codec already read such strings in
    messages as text). data.special_tokens="text" (default) tokenizes them as the characters they are: no special
    id but the EOS the pipeline appends, and the ids decode back to the document; "parse" (a corpus rendered with a
    chat template on purpose) gives the special ids. The shipped BPE tokenizer's specials are the references."""
    import pytest

    from dsv32_jax.posttrain.chat.codecs import CHAT_TOKENIZER_PATH
    from dsv32_jax.posttrain.chat.tokens import EOS, USER

    path = str(CHAT_TOKENIZER_PATH)
    doc = f"quoted log: {USER}hi{EOS} more text here"
    jsonl = write_jsonl(tmp_path / "d.jsonl", [doc])
    tok = make_tokenizer(path)
    eos, user = tok._tok.token_to_id(EOS), tok._tok.token_to_id(USER)
    specials = {t for t in (eos, user) if t is not None}
    assert len(specials) == 2

    def ids(mode):
        cfg = finite("jsonl", [jsonl], tokenizer=path, seq_len=64, special_tokens=mode)
        b = take(make_iterator(cfg, vocab_size=2048))[0]
        seg = b["segment_ids"][0]
        return [int(x) for x in b["tokens"][0][seg > 0]]

    as_text, parsed = ids("text"), ids("parse")
    assert as_text[-1] == eos and not specials & set(as_text[:-1]), as_text
    assert tok.decode(as_text[:-1]).endswith(doc)
    assert [x for x in parsed if x in specials] == [user, eos, eos]  # (and the EOS the pipeline appends)

    with pytest.raises(ValueError, match=r"data\.special_tokens must be 'text' or 'parse', got 'yes'"):
        finite("jsonl", [jsonl], special_tokens="yes")

    # a grain worker process gets a pickled copy: it keeps the mode; a tokenizer made without one (dsv32-generate's
    # prompts, rendered with the chat template) parses them
    import pickle

    for mode, has_specials in (("text", False), ("parse", True)):
        copy = pickle.loads(pickle.dumps(make_tokenizer(path, special_tokens=mode)))
        assert bool(specials & set(copy.encode(doc))) == has_specials, mode
    assert user in make_tokenizer(path).encode(doc)
