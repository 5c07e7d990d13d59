"""Data files shipped with dsv32_jax: ``chat_tokenizer.json`` (the chat BPE tokenizer; ``dsv32_jax.posttrain.chat``)."""
