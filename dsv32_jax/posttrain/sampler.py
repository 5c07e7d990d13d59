"""Jitted sampler: prefill + decode with the MLA latent cache and the indexer key cache (DSA decode selects
top-k over the cached keys), left-padded prompts with per-row lengths, EOS / max-length stopping, and no host
round trip per token (one `lax.while_loop`).

Per generated token it records what GRPO's stabilizers need: the token, its log-probability under the
PROCESSED distribution (temperature, then top-k / top-p inside a bounded candidate set, renormalized: pi_old),
the kept set (candidate ids + keep mask: "keep sampling mask"), and for every prompt and generated token the
MoE expert ids per layer ("keep routing").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv32_jax.model import sharding as shd


MIN_TEMPERATURE = 1e-6  # below it, sample greedily (greedy=True)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k truncation
    top_p: float = 1.0  # 1.0: no nucleus truncation; the nucleus is cut inside the max_candidates most likely ids
    max_candidates: int = 64  # bounded candidate set for top-k / top-p (never a full-vocabulary sort)
    greedy: bool = False
    eos_id: int = 1
    pad_id: int = 0
    # > 0: only ids below it are ever sampled (a codec's vocabulary inside a larger, padded model vocabulary); the
    # logits beyond it are masked and the kept set records the allowed ids, so GRPO's log-probs see the same support
    vocab_size: int = 0

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def num_candidates(self, vocab: int) -> int:
        k = min(self.max_candidates, vocab)
        return min(self.top_k, k) if self.top_k > 0 else k

    def kept_width(self, vocab: int) -> int:
        """K, the candidates recorded per token for a model vocabulary of `vocab` ids: 0 when sampling is over the
        full vocabulary; all `vocab_size` ids when only the mask restricts it. Checks the ids against the model's
        vocabulary first (check_vocab)."""
        self.check_vocab(vocab)
        limit = self.vocab_size or vocab
        if self.truncated:
            return self.num_candidates(limit)
        return limit if limit < vocab else 0

    def check_vocab(self, vocab: int) -> None:
        """vocab_size and pad_id against the model's vocabulary of `vocab` ids: a pad id outside it embedded as NaN
        (jnp.take's fill), and the padding slots, invisible to attention, still turned every row's logits NaN."""
        if self.vocab_size > vocab:
            raise ValueError(f"SamplingConfig.vocab_size={self.vocab_size} exceeds the model's vocabulary of {vocab}")
        if not 0 <= self.pad_id < vocab:
            raise ValueError(f"SamplingConfig.pad_id={self.pad_id} must be a token id of the model, in [0, {vocab})")

    def __post_init__(self):
        # (nan refused too; inf sampled uniformly; below MIN_TEMPERATURE logits / T overflow float32 or T flushes to
        # 0: NaN log-probs and a wrong token, where greedy decoding is what was meant)
        if not MIN_TEMPERATURE <= self.temperature < float("inf") and not self.greedy:
            raise ValueError(f"SamplingConfig.temperature must be finite and >= {MIN_TEMPERATURE} (use greedy=True "
                             f"for argmax decoding), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_candidates < 1:
            raise ValueError(f"SamplingConfig.max_candidates must be >= 1, got {self.max_candidates}")
        if not 0 <= self.top_k <= self.max_candidates:
            raise ValueError(f"SamplingConfig.top_k={self.top_k} must be in [0, max_candidates={self.max_candidates}] "
                             "(0: no top-k truncation; the candidate set bounds every truncation): raise "
                             "max_candidates with top_k")
        if self.vocab_size < 0:
            raise ValueError(f"SamplingConfig.vocab_size must be >= 0 (0: the model's), got {self.vocab_size}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rollout:
    tokens: jnp.ndarray  # [B, T] generated tokens (pad after EOS)
    mask: jnp.ndarray  # [B, T] bool: generated tokens up to and including EOS
    logprobs: jnp.ndarray  # [B, T] log pi_old(token) under the processed distribution
    kept_ids: jnp.ndarray  # [B, T, K] candidate ids (K = 0 when sampling is not truncated)
    kept_mask: jnp.ndarray  # [B, T, K] bool: candidates inside the top-k / top-p kept set
    routing: dict  # MoE layer -> expert ids [B, P + T, k] for every prompt and generated token
    topk: dict  # layer -> indexer selections [B, P + T, index_topk'] (slot indices)


def prompt_layout(prompt_lengths: jnp.ndarray, prompt_width: int, total: int):
    """Left padding: (segment ids [B, total] with 0 on padding and 1 on real tokens, RoPE positions [B, total])."""
    pad = prompt_width - prompt_lengths[:, None]
    idx = jnp.arange(total)[None, :]
    return (idx >= pad).astype(jnp.int32), jnp.maximum(idx - pad, 0).astype(jnp.int32)


def processed_logits(logits: jnp.ndarray, cfg: SamplingConfig):
    """Temperature, the vocabulary mask (`cfg.vocab_size`), then the bounded candidate set: returns (candidate logits
    [..., K], ids [..., K], keep [..., K]) for truncated or masked sampling, or (logits / T, None, None) for plain
    sampling over the full vocabulary. Greedy decoding with temperature <= 0 takes the argmax of the logits (which
    no temperature moves) and records log-probs at temperature 1."""
    temperature = cfg.temperature if cfg.temperature > 0 else 1.0  # (only greedy reaches <= 0: __post_init__)
    scaled = logits.astype(jnp.float32) / temperature
    vocab = scaled.shape[-1]
    k = cfg.kept_width(vocab)
    if not k:
        return scaled, None, None
    if cfg.vocab_size:
        scaled = jnp.where(jnp.arange(vocab) < cfg.vocab_size, scaled, -jnp.inf)
    vals, ids = jax.lax.top_k(scaled, k)
    keep = jnp.ones(vals.shape, bool)
    if cfg.top_p < 1.0:
        # the nucleus of the model's distribution (over the allowed ids), or, after a top-k cut, of the top-k
        # renormalized (HF's order): the candidate bound only caps it (softmax over the candidates kept 31 of a
        # 52-token nucleus at vocab 256, 64 candidates, top_p 0.9)
        probs = jnp.exp(vals - jax.nn.logsumexp(vals if cfg.top_k else scaled, axis=-1, keepdims=True))
        keep = (jnp.cumsum(probs, axis=-1) - probs) < cfg.top_p  # the most likely candidate is always kept
    return vals, ids, keep


def sample_token(logits: jnp.ndarray, rng, cfg: SamplingConfig):
    """logits [B, V] -> (token [B], logprob [B] under the processed distribution, kept ids [B, K], keep [B, K])."""
    b = logits.shape[0]
    vals, ids, keep = processed_logits(logits, cfg)
    if ids is None:
        ids, keep = jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), bool)
        logp = jax.nn.log_softmax(vals, axis=-1)
        tok = jnp.argmax(vals, -1) if cfg.greedy else jax.random.categorical(rng, vals, axis=-1)
        return tok.astype(jnp.int32), jnp.take_along_axis(logp, tok[:, None], -1)[:, 0], ids, keep
    masked = jnp.where(keep, vals, -jnp.inf)
    choice = jnp.argmax(masked, -1) if cfg.greedy else jax.random.categorical(rng, masked, axis=-1)
    logp = jnp.take_along_axis(jax.nn.log_softmax(masked, axis=-1), choice[:, None], -1)[:, 0]
    tok = jnp.take_along_axis(ids, choice[:, None], -1)[:, 0]
    return tok.astype(jnp.int32), logp, ids.astype(jnp.int32), keep


def _decode_loop(model, last, cache, slot0, next_pos, row_seg, done, rng, cfg: SamplingConfig, widths: dict):
    """Samples up to cfg.max_new_tokens tokens per row that is not `done`: step i samples from `last` (the logits
    of each row's latest token), writes the token into cache slot slot0 + i at RoPE position next_pos + i with
    segment row_seg (0 once the row is done: invisible), and records it. widths: {"routing"/"topk": {layer:
    width}}. Returns (cache, steps run, Rollout with routing / top-k of the generated tokens [B, T, .])."""
    b, t = last.shape[0], cfg.max_new_tokens
    k_cand = cfg.kept_width(model.config.vocab_size)

    def buf(shape, dtype, fill=0):
        return jnp.full(shape, fill, dtype)

    def put(x, v, i):
        return jax.lax.dynamic_update_slice_in_dim(x, v.astype(x.dtype), i, axis=1)

    init = dict(i=jnp.int32(0), last=last, cache=cache, done=done,
                tokens=buf((b, t), jnp.int32, cfg.pad_id), mask=buf((b, t), bool), logprobs=buf((b, t), jnp.float32),
                kept_ids=buf((b, t, k_cand), jnp.int32), kept_mask=buf((b, t, k_cand), bool),
                routing={k: buf((b, t, w), jnp.int32) for k, w in widths["routing"].items()},
                topk={k: buf((b, t, w), jnp.int32, -1) for k, w in widths["topk"].items()})

    def body(s):
        i = s["i"]
        tok, logp, ids, keep = sample_token(s["last"], jax.random.fold_in(rng, i), cfg)
        alive = ~s["done"]
        tok = jnp.where(alive, tok, cfg.pad_id)
        out = dict(s, i=i + 1, done=s["done"] | (tok == cfg.eos_id),
                   tokens=put(s["tokens"], tok[:, None], i), mask=put(s["mask"], alive[:, None], i),
                   logprobs=put(s["logprobs"], jnp.where(alive, logp, 0.0)[:, None], i),
                   kept_ids=put(s["kept_ids"], ids[:, None], i), kept_mask=put(s["kept_mask"], keep[:, None], i))
        logits, out["cache"], a = model.decode(tok[:, None], s["cache"], slot0 + i, (next_pos + i)[:, None],
                                               jnp.where(alive, row_seg, 0)[:, None])
        out["last"] = logits[:, -1]
        out["routing"] = {k: put(s["routing"][k], a["routing"][k], i) for k in s["routing"]}
        out["topk"] = {k: put(s["topk"][k], a["topk"][k], i) for k in s["topk"]}
        return out

    s = jax.lax.while_loop(lambda s: (s["i"] < t) & ~jnp.all(s["done"]), body, init)
    return s["cache"], s["i"], Rollout(tokens=s["tokens"], mask=s["mask"], logprobs=s["logprobs"],
                                       kept_ids=s["kept_ids"], kept_mask=s["kept_mask"], routing=s["routing"],
                                       topk=s["topk"])


def _layer_widths(aux) -> dict:
    return {name: {k: v.shape[-1] for k, v in aux[name].items() if v is not None} for name in ("routing", "topk")}


@functools.partial(jax.jit, static_argnums=(0, 5))
def _generate(graphdef, state, prompts, prompt_lengths, rng, cfg: SamplingConfig) -> Rollout:
    model = nnx.merge(graphdef, state)
    b, p = prompts.shape
    total = p + cfg.max_new_tokens
    seg, pos = prompt_layout(prompt_lengths, p, total)
    logits, cache, aux = model.decode(prompts, model.init_cache(b, total), 0, pos[:, :p], seg[:, :p])
    widths = _layer_widths(aux)
    _, _, r = _decode_loop(model, logits[:, -1], cache, p, prompt_lengths, jnp.ones((b,), jnp.int32),
                           jnp.zeros((b,), bool), rng, cfg, widths)
    # routing / selections of the prompt and the generated tokens, [B, P + T, .]
    routing = {k: jnp.concatenate([aux["routing"][k].astype(jnp.int32), v], 1) for k, v in r.routing.items()}
    topk = {k: jnp.concatenate([aux["topk"][k].astype(jnp.int32), v], 1) for k, v in r.topk.items()}
    return dataclasses.replace(r, routing=routing, topk=topk)


def generate(model, prompts, prompt_lengths, rng, cfg: SamplingConfig) -> Rollout:
    """Samples up to cfg.max_new_tokens per row. prompts [B, P] int32 LEFT-padded, prompt_lengths [B]."""
    # the checks below read the inputs on the host once (they were read back from the device four times)
    host_p, host_n = (None if isinstance(x, jax.core.Tracer) else np.asarray(shd.host_value(x))
                      for x in (prompts, prompt_lengths))
    prompts = jnp.asarray(prompts, jnp.int32)
    lengths = jnp.asarray(prompt_lengths, jnp.int32)
    if prompts.ndim != 2 or lengths.shape != prompts.shape[:1]:
        raise ValueError(f"prompts must be [B, P] with prompt_lengths [B]; got {prompts.shape} and {lengths.shape}")
    if host_n is not None:  # (concrete: a length past the padded width mislays every position)
        bad = [int(n) for n in host_n if not 1 <= n <= prompts.shape[1]]
        if bad:
            raise ValueError(f"prompt_lengths must be in [1, P={prompts.shape[1]}] (the prompts' padded width); "
                             f"got {bad[:4]}")
    cfg.check_vocab(model.config.vocab_size)
    if host_p is not None and host_p.size:  # (padding too: a NaN row poisons every row)
        lo, hi = int(host_p.min()), int(host_p.max())
        if lo < 0 or hi >= model.config.vocab_size:
            raise ValueError(f"prompts: token ids must be in [0, vocab_size={model.config.vocab_size}), got range "
                             f"[{lo}, {hi}] (padding included)")
    ctx = int(model.config.max_position_embeddings)
    longest = prompts.shape[1] if host_n is None else int(host_n.max())
    if longest + cfg.max_new_tokens > ctx:  # (RoPE past the trained context: the model extrapolates, silently)
        raise ValueError(f"generate: a prompt of {longest} tokens plus max_new_tokens={cfg.max_new_tokens} exceeds the "
                         f"model's context of {ctx} positions (config max_position_embeddings)")
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, prompts, lengths, rng, cfg)


def sequence_layout(prompt_lengths, prompt_width: int, rollout: Rollout):
    """Teacher-forcing layout of [prompts ; rollout.tokens] that reproduces the sampler's view: segment ids
    [B, P+T] (0 on left padding and after EOS) and RoPE positions [B, P+T]."""
    total = prompt_width + rollout.tokens.shape[1]
    seg, pos = prompt_layout(jnp.asarray(prompt_lengths, jnp.int32), prompt_width, total)
    gen_seg = rollout.mask.astype(jnp.int32)
    seg = jnp.concatenate([seg[:, :prompt_width], gen_seg], axis=1)
    return seg, pos


# ------------------------------------------------------------------------------------------ multi-turn continuation
@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _append(graphdef, state, cache, index, pieces, piece_pos, piece_seg):
    """Appends `pieces` [B, L] (left-padded: segment 0 on padding) at cache slots [index, index + L). Returns (the
    logits of each row's last piece token [B, V], new cache, routing and top-k of the piece slots)."""
    model = nnx.merge(graphdef, state)
    logits, cache, aux = model.decode(pieces, cache, index, piece_pos, piece_seg)
    widths = _layer_widths(aux)
    return (logits[:, -1], cache, {k: aux["routing"][k] for k in widths["routing"]},
            {k: aux["topk"][k] for k in widths["topk"]})


@functools.partial(jax.jit, static_argnums=(0, 9, 10), donate_argnums=(2,))
def _sample_after(graphdef, state, cache, last, slot0, next_pos, row_seg, live, rng, cfg: SamplingConfig,
                  widths: tuple):
    """Samples up to cfg.max_new_tokens tokens per live row from `last` into cache slots slot0, slot0 + 1, ...,
    positions from next_pos [B]. widths: `_layer_widths` as nested tuples (static). Returns (new cache, number of
    decode steps run, Rollout of the generated tokens). Its shapes do not depend on the pieces' width (slot0 is
    traced): one compile serves every turn, where appending compiles once per piece width."""
    model = nnx.merge(graphdef, state)
    return _decode_loop(model, last, cache, slot0, next_pos, row_seg, ~live, rng, cfg,
                        {name: dict(w) for name, w in widths})


PIECE_BUCKET = 16  # a step's pieces are padded to a bucket of this base (`bucketed`)


def bucketed(n: int, base: int) -> int:
    """n (>= 1) rounded up to its bucket: a multiple of `base` up to 16 * base, above that a multiple of base times
    the power of two that keeps the steps at most 1/8 of n. Padding to it adds at most max(base, n / 8) slots, and
    the lengths up to L fall into about 16 + 8 * log2(L / (16 * base)) buckets, so a program keyed on the width
    compiles that often (plain multiples of 16 took one program per 16 slots: 8,192 for a 128K context)."""
    n = max(int(n), 1)
    step = base * max(1, (1 << (n - 1).bit_length()) // (16 * base))
    return -(-n // step) * step


class MultiTurnSampler:
    """Batched multi-turn sampling over one decode cache: `step(pieces, live)` appends each row's new context
    tokens (a prompt, or tool results + the next generation prompt) after everything the row has seen, and samples
    the row's next completion; the MLA latent cache and the indexer key cache are extended, never recomputed.

    Rows advance in lockstep over shared cache slots: a row's piece is left-padded to the batch's longest
    (padding is segment 0, invisible to attention and to the indexer), RoPE positions continue per row, rows that
    have finished their episode get only padding. `restart(row)` starts a row's context over (a context strategy
    rewrote its history): its later slots get a new segment id, so its earlier slots become invisible to it.
    `record` holds, per slot [B, slots], in host memory (numpy, whole on every process): token, segment (1 real /
    0 padding), position, generated (1 on sampled tokens), the sampler's log-prob and kept set, and routing / indexer
    selections per layer: the teacher-forcing layout of the whole trajectory (train/steps.py's trajectory step
    replays it). On several processes every process runs every row's environment: `step` checks that they all
    pass the same pieces."""

    def __init__(self, model, batch: int, capacity: int, cfg: SamplingConfig, bucket: int = PIECE_BUCKET):
        ctx = int(model.config.max_position_embeddings)
        if capacity > ctx:  # (a row's positions never pass the slots used: capacity <= context bounds them)
            raise ValueError(f"MultiTurnSampler: capacity={capacity} slots exceed the model's context of {ctx} "
                             "positions (config max_position_embeddings)")
        self.graphdef, self.state = nnx.split(model)
        self.cfg, self.b, self.capacity, self.bucket = cfg, batch, capacity, bucket
        self.cache = model.init_cache(batch, capacity)
        self.index = 0
        self.next_pos = [0] * batch
        self.row_seg = [1] * batch
        k = cfg.kept_width(model.config.vocab_size)
        self.record = {"tokens": np.full((batch, capacity), cfg.pad_id, np.int32),
                       "segments": np.zeros((batch, capacity), np.int32),
                       "positions": np.zeros((batch, capacity), np.int32),
                       "generated": np.zeros((batch, capacity), np.float32),
                       "logprobs": np.zeros((batch, capacity), np.float32),
                       "kept_ids": np.zeros((batch, capacity, k), np.int32),
                       "kept_mask": np.zeros((batch, capacity, k), bool), "routing": {}, "topk": {}}

    def restart(self, row: int) -> None:
        """Row `row` continues in a fresh context (segment id + 1, positions from 0)."""
        self.row_seg[row] += 1
        self.next_pos[row] = 0

    def _width(self, pieces: list[list[int]]) -> int:
        """Slots a step's pieces take: the longest piece rounded up to its bucket (`bucketed`)."""
        return bucketed(max([len(p) for p in pieces] + [1]), self.bucket)

    def fits(self, pieces: list[list[int]]) -> bool:
        """Whether `step(pieces, ...)` fits the remaining cache slots (the pieces' width + max_new_tokens)."""
        return self.index + self._width(pieces) + self.cfg.max_new_tokens <= self.capacity

    def step(self, pieces: list[list[int]], live, rng, limits=None) -> list[list[int]]:
        """pieces: per row, the ids to append (may be empty for finished rows); live [B] bool: rows that generate.
        Returns each live row's sampled ids (up to and including EOS, or cut at cfg.max_new_tokens). limits [B]
        (None: cfg.max_new_tokens each): how many of a row's sampled ids its caller keeps; the record marks only
        those as generated (the rest stay in the cache as context nobody trains on)."""
        live = np.asarray(live, bool)
        if len(pieces) != self.b or live.shape != (self.b,):
            raise ValueError(f"MultiTurnSampler.step: {len(pieces)} pieces / live {live.shape} for batch {self.b}")
        for i in np.flatnonzero(live):
            if not pieces[i]:
                raise ValueError(f"MultiTurnSampler.step: live row {i} has no new context (a prompt, or tool results "
                                 "and the generation prompt) to continue from")
        width = self._width(pieces)
        if not self.fits(pieces):
            raise ValueError(f"MultiTurnSampler: {self.index} slots used + {width} (piece) + "
                             f"{self.cfg.max_new_tokens} (max_new_tokens) exceed the capacity {self.capacity}")
        toks = np.full((self.b, width), self.cfg.pad_id, np.int32)
        seg = np.zeros((self.b, width), np.int32)
        pos = np.zeros((self.b, width), np.int32)
        for i, piece in enumerate(pieces):
            n = len(piece)
            start = self.next_pos[i]
            if n:  # padding slots keep position 0 (segment 0: never attended, never selected)
                pos[i, width - n:] = start + np.arange(n)
                toks[i, width - n:] = piece
                seg[i, width - n:] = self.row_seg[i]
                self.next_pos[i] = start + n
        # every process runs the rows' environments itself and the step takes these as replicated inputs
        shd.check_same_on_processes("MultiTurnSampler.step: the pieces / live rows / limits", pieces, live,
                                    [] if limits is None else list(limits))
        # two programs: appending the pieces compiles once per piece width, sampling once (it held the whole decode
        # loop and compiled again for every width: 3-6.5 s each for the tiny agent model; audit, 2026-12-07)
        last, self.cache, piece_routing, piece_topk = _append(
            self.graphdef, self.state, self.cache, jnp.int32(self.index), jnp.asarray(toks), jnp.asarray(pos),
            jnp.asarray(seg))
        widths = tuple((name, tuple((k, v.shape[-1]) for k, v in new.items()))
                       for name, new in (("routing", piece_routing), ("topk", piece_topk)))
        self.cache, steps, r = _sample_after(
            self.graphdef, self.state, self.cache, last, jnp.int32(self.index + width), jnp.asarray(pos[:, -1] + 1),
            jnp.asarray(self.row_seg, jnp.int32), jnp.asarray(live), rng, self.cfg, widths)
        # the step's outputs on the host, whole on every process (a batch-sharded rollout spans several hosts), cut
        # to the decode steps taken there: a device slice by the data-dependent count compiled a dynamic slice per
        # output array for every new count (7-14 compiles a turn once rows stop early; audit, 2026-12-07)
        steps, r, piece_routing, piece_topk = shd.host_value((steps, r, piece_routing, piece_topk))
        steps = int(steps)
        r = jax.tree.map(lambda x: x[:, :steps], r)
        gen_pos = pos[:, -1][:, None] + 1 + np.arange(steps)[None, :]
        mask = r.mask
        generated = mask.astype(np.float32)
        if limits is not None:  # (a row's mask is a prefix: its sampled ids up to EOS)
            generated *= np.cumsum(mask, axis=1) <= np.asarray(limits, np.int64)[:, None]
        self._write(self.index, toks, seg, pos, np.zeros_like(seg, np.float32), None, piece_routing, piece_topk)
        self._write(self.index + width, r.tokens, mask.astype(np.int32) * np.asarray(self.row_seg, np.int32)[:, None],
                    gen_pos, generated, r, r.routing, r.topk)
        out = []
        for i in range(self.b):
            ids = [int(x) for x, m in zip(r.tokens[i], mask[i]) if m]
            self.next_pos[i] += len(ids)
            out.append(ids if live[i] else [])
        self.index += width + steps
        return out

    def _write(self, at, toks, seg, pos, generated, r, routing, topk):
        rec = self.record

        def put(name, v, store=rec):
            store[name][:, at:at + v.shape[1]] = v

        put("tokens", toks), put("segments", seg), put("positions", pos), put("generated", generated)
        if r is not None:
            put("logprobs", r.logprobs), put("kept_ids", r.kept_ids), put("kept_mask", r.kept_mask)
        for name, new in (("routing", routing), ("topk", topk)):
            for k, v in new.items():
                if k not in rec[name]:
                    fill = -1 if name == "topk" else 0
                    rec[name][k] = np.full((self.b, self.capacity, v.shape[-1]), fill, np.int32)
                put(k, v, rec[name])

    def layout(self) -> dict:
        """The record trimmed to the slots used (numpy, the same on every process): the teacher-forcing batch of
        the whole trajectory."""
        n = self.index
        rec = {k: v[:, :n] for k, v in self.record.items() if k not in ("routing", "topk")}
        rec["routing"] = {k: v[:, :n] for k, v in self.record["routing"].items()}
        rec["topk"] = {k: v[:, :n] for k, v in self.record["topk"].items()}
        return rec
