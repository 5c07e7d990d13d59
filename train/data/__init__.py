"""Training data: sources -> tokenizer -> grain pipeline of packed, resumable token rows.

    config.py      DataConfig (`config.data` of an experiment)
    tokenizers.py  ByteTokenizer, HFTokenizer (tokenizer.json), make_tokenizer
    sources.py     built-in corpus, JSONL, Parquet, ArrayRecord, text files; make_source
    pipeline.py    grain transformations (shuffles, packing), make_dataset / make_iterator; the batch contract is
                   documented there
"""

from dsv32_jax.train.data.config import SOURCES, DataConfig
from dsv32_jax.train.data.pipeline import BlockShuffleMapDataset, PackIterDataset, make_dataset, make_iterator
from dsv32_jax.train.data.sources import (ArrayRecordSource, JsonlSource, ListSource, ParquetSource, TextSource,
                                          builtin_documents, make_source, resolve_paths)
from dsv32_jax.train.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, make_tokenizer

__all__ = ["SOURCES", "ArrayRecordSource", "BlockShuffleMapDataset", "ByteTokenizer", "DataConfig", "HFTokenizer",
           "JsonlSource", "ListSource", "PackIterDataset", "ParquetSource", "TextSource", "Tokenizer",
           "builtin_documents", "make_dataset", "make_iterator", "make_source", "make_tokenizer", "resolve_paths"]
