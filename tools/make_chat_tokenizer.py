"""Regenerate dsv32_jax/assets/chat_tokenizer.json: a small byte-level BPE tokenizer for the chat format.

Trained with HF ``tokenizers`` on the built-in corpus (``dsv32_jax.train.data.builtin.builtin_documents``: pydoc
topics + stdlib docstrings) plus the tools prompt of ``dsv32_jax.posttrain.chat``, with every string of
``dsv32_jax.posttrain.chat.SPECIAL_TOKENS`` registered as a special (added) token, so each is one id (PAD = 0, BOS = 1,
EOS = 2, ...). Deterministic for a given Python version (the corpus comes from the running interpreter) and
``tokenizers`` version: single-threaded training, fixed corpus order.

    python tools/make_chat_tokenizer.py [--vocab-size 1536] [--out dsv32_jax/assets/chat_tokenizer.json]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported: one thread, one merge order

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from dsv32_jax.posttrain.chat import CHAT_TOKENIZER_PATH, SPECIAL_TOKENS, TOOLS_PROMPT, HFCodec  # noqa: E402
from dsv32_jax.train.data.builtin import builtin_documents  # noqa: E402


def build(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = list(builtin_documents()) + [TOOLS_PROMPT]
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    return tok


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=1536)
    ap.add_argument("--out", default=str(CHAT_TOKENIZER_PATH))
    args = ap.parse_args(argv)
    tok = build(args.vocab_size)
    HFCodec(tok)  # every special is one id
    tok.save(args.out, pretty=True)
    with open(args.out, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    print(f"wrote {args.out}: {tok.get_vocab_size()} ids, sha256 {digest} (python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
