"""Training data: sources -> tokenizer -> grain pipeline of packed, resumable token rows.

    config.py      DataConfig (`config.data` of an experiment)
    tokenizers.py  ByteTokenizer, HFTokenizer (tokenizer.json), make_tokenizer
    builtin.py     the built-in demo corpus (Python's own documentation)
    sources.py     JSONL, Parquet, ArrayRecord, text files (and the built-in corpus); make_source
    pipeline.py    grain transformations (shuffles, packing), make_dataset / make_iterator; the batch contract
                   (tokens / segment_ids / positions / targets / loss_mask, determinism, get_state / set_state
                   resume) is documented there
"""

from dsv32_jax.train.data.builtin import builtin_documents
from dsv32_jax.train.data.config import SOURCES, DataConfig
from dsv32_jax.train.data.pipeline import (BlockShuffleMapDataset, NoDocuments, ShardedBatches, check_inputs,
                                           make_dataset, make_iterator, merge_states, pack_documents)
from dsv32_jax.train.data.sources import (ArrayRecordSource, JsonlSource, ListSource, ParquetSource, TextSource,
                                          make_source, resolve_paths)
from dsv32_jax.train.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, make_tokenizer

__all__ = ["SOURCES", "ArrayRecordSource", "BlockShuffleMapDataset", "ByteTokenizer", "DataConfig", "HFTokenizer",
           "JsonlSource", "ListSource", "ParquetSource", "TextSource", "Tokenizer", "builtin_documents", "check_inputs",
           "make_dataset", "make_iterator", "make_source", "make_tokenizer", "merge_states", "pack_documents",
           "resolve_paths", "NoDocuments", "ShardedBatches"]
