"""Streaming text generation from a loaded `Transformer` with the decode caches (the MLA latent cache and the
indexer key cache of `Transformer.decode`, as the sampler uses them): one jitted prefill over the prompt, then one
jitted step per token whose sampled id comes back to the host at once, so a caller can print it as it comes.

`generate_stream(model, ids, cfg, rng)` yields token ids; `generate_ids` collects them; `generate_no_cache` is the
baseline that re-runs the whole prefix for every token (same tokens; `bench/generate.py` compares the speed).
Sampling is the sampler's own (`dsv32_jax.posttrain.sampler.sample_token`: temperature, top-k / top-p inside a
bounded candidate set, or greedy argmax).

Layer: posttrain (uses the model; the command line lives in `dsv32_jax.train.generate_main`, which adds tokenizers
and checkpoint resolution).
"""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dsv32_jax.posttrain.sampler import SamplingConfig, bucketed, prompt_layout, sample_token


class PromptTooLongError(ValueError):
    """A prompt does not fit the model's context (config.max_position_embeddings)."""


PROMPT_BUCKET = 16  # prompts are left-padded to a bucket of this base (`sampler.bucketed`: fewer prefill programs)
CACHE_BUCKET = 256  # the decode cache's slots are a bucket of this base (one decode step program per bucket)


def context_length(model) -> int:
    return int(model.config.max_position_embeddings)


def check_prompt(model, n_prompt: int, max_new_tokens: int, where: str = "prompt") -> int:
    """The number of tokens that can be generated after a prompt of n_prompt ids (max_new_tokens, cut to the
    context); raises PromptTooLongError (naming `where` and both lengths) when the prompt leaves no room."""
    ctx = context_length(model)
    if n_prompt == 0:
        raise ValueError(f"{where}: empty prompt (no token ids)")
    if n_prompt >= ctx:
        raise PromptTooLongError(f"{where}: {n_prompt} tokens, but the model's context is {ctx} tokens "
                                 f"(config max_position_embeddings); shorten the prompt to at most {ctx - 1} tokens")
    return max(0, min(max_new_tokens, ctx - n_prompt))


@functools.partial(jax.jit, static_argnums=(0, 6))
def _prefill(graphdef, state, cache, tokens, segments, positions, cfg: SamplingConfig, rng):
    model = nnx.merge(graphdef, state)
    logits, cache, _ = model.decode(tokens, cache, 0, positions, segments)
    tok, _, _, _ = sample_token(logits[:, -1], rng, cfg)
    return tok, cache


@functools.partial(jax.jit, static_argnums=(0, 6), donate_argnums=(2,))
def _step(graphdef, state, cache, token, slot, position, cfg: SamplingConfig, rng):
    model = nnx.merge(graphdef, state)
    logits, cache, _ = model.decode(token[:, None], cache, slot, position[:, None], jnp.ones_like(token)[:, None])
    tok, _, _, _ = sample_token(logits[:, -1], rng, cfg)
    return tok, cache


def _prompt_ids(model, ids: Sequence[int], cfg: SamplingConfig) -> list[int]:
    """The prompt as ints, checked against the model's vocabulary (with cfg's vocab_size and pad_id): under jit an
    id outside it embeds as NaN (jnp.take's fill), and argmax of NaN logits is token 0."""
    ids = [int(i) for i in ids]
    vocab = model.config.vocab_size
    cfg.check_vocab(vocab)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"prompt: token id {bad[0]} outside the model's vocabulary [0, {vocab})")
    return ids


def generate_stream(model, ids: Sequence[int], cfg: SamplingConfig, rng=None) -> Iterator[int]:
    """Yields up to cfg.max_new_tokens sampled ids after the prompt `ids` (stops after cfg.eos_id, which is
    yielded; eos_id < 0: never stops early), each as soon as it is sampled. The prompt is left-padded to its
    bucket (`sampler.bucketed` of base PROMPT_BUCKET; padding is segment 0: invisible to attention and the indexer)
    and the cache holds prompt + max_new_tokens slots, rounded up to a bucket of base CACHE_BUCKET within the context
    (the unused slots are segment 0, invisible): the prefill compiles once per prompt bucket, the decode step once
    per cache bucket. rng: a jax key (default key(0)); step i samples with fold_in(rng, i)."""
    ids = _prompt_ids(model, ids, cfg)
    n_new = check_prompt(model, len(ids), cfg.max_new_tokens)
    if n_new == 0:
        return
    rng = jax.random.key(0) if rng is None else rng
    width = bucketed(len(ids), PROMPT_BUCKET)
    if width + n_new > context_length(model):  # near the context: multiples of 16, the cache at most 15 slots past
        width = -(-len(ids) // PROMPT_BUCKET) * PROMPT_BUCKET  # (a bucket's padding put it up to 1/8 past it, and
        # every prompt length there had a cache size, a decode program, of its own: review)
    total = width + n_new
    if total <= context_length(model):  # (a bucket past the context: the context, one program too)
        total = min(bucketed(total, CACHE_BUCKET), context_length(model))
    segments, positions = prompt_layout(jnp.asarray([len(ids)], jnp.int32), width, total)
    tokens = jnp.asarray([[cfg.pad_id] * (width - len(ids)) + ids], jnp.int32)
    graphdef, state = nnx.split(model)
    tok, cache = _prefill(graphdef, state, model.init_cache(1, total), tokens, segments[:, :width],
                          positions[:, :width], cfg, jax.random.fold_in(rng, 0))
    for i in range(n_new):
        token = int(tok[0])
        yield token
        if token == cfg.eos_id or i + 1 == n_new:
            return
        tok, cache = _step(graphdef, state, cache, tok, jnp.int32(width + i), jnp.asarray([len(ids) + i], jnp.int32),
                           cfg, jax.random.fold_in(rng, i + 1))


def generate_ids(model, ids: Sequence[int], cfg: SamplingConfig, rng=None) -> list[int]:
    """`generate_stream` collected into a list."""
    return list(generate_stream(model, ids, cfg, rng))


@functools.partial(jax.jit, static_argnums=(0, 4))
def _full_step(graphdef, state, tokens, last, cfg: SamplingConfig, rng):
    model = nnx.merge(graphdef, state)
    logits = model(tokens, return_aux=False)
    row = jax.lax.dynamic_index_in_dim(logits, last, axis=1, keepdims=False)
    tok, _, _, _ = sample_token(row, rng, cfg)
    return tok


def generate_no_cache(model, ids: Sequence[int], cfg: SamplingConfig, rng=None) -> list[int]:
    """The same sampling without a decode cache: every token re-runs the model over the whole sequence (held in
    one buffer of prompt + max_new_tokens ids, so one compilation; causal attention makes the unfilled tail
    invisible to the positions read). The speed baseline of bench/generate.py, and a check of the cache."""
    ids = _prompt_ids(model, ids, cfg)
    n_new = check_prompt(model, len(ids), cfg.max_new_tokens)
    rng = jax.random.key(0) if rng is None else rng
    graphdef, state = nnx.split(model)
    buf = jnp.asarray([ids + [cfg.pad_id] * n_new], jnp.int32)
    out: list[int] = []
    for i in range(n_new):
        tok = _full_step(graphdef, state, buf, jnp.int32(len(ids) + i - 1), cfg, jax.random.fold_in(rng, i))
        token = int(tok[0])
        out.append(token)
        if token == cfg.eos_id:
            break
        buf = buf.at[0, len(ids) + i].set(token)
    return out
