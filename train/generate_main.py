"""Generate text from a checkpoint: `dsv32-generate --ckpt=DIR --prompt="..."` (or `python -m
dsv32_jax.train.generate_main`).

--ckpt: an HF checkpoint directory (config.json + safetensors), a dsv32-jax orbax checkpoint (dsv32-convert
hf-to-orbax) or a training workdir (dsv32-train --workdir=W: its latest checkpoint, or --step). The tokenizer is
the checkpoint's own: tokenizer.json in an HF / orbax directory (read with `tokenizers`), and for a workdir the one
its trainer recorded (data.tokenizer: "byte" for the built-in demo data, or a tokenizer.json); --tokenizer overrides
it ("byte", "chat:tiny", "chat:bpe" -- the shipped chat BPE --, or a tokenizer.json / a directory holding one).

One prompt (--prompt) streams its completion to stdout as the tokens come. --prompts_file reads JSONL (one object
per line with "prompt": a string, or with --chat also "messages": [{"role": ..., "content": ...}]) and --out
writes JSONL (each input object plus "completion" and "completion_tokens"), written to a temporary file and
renamed at the end. --chat renders the prompt as a user turn of the DeepSeek-V3.2 chat format (--thinking: the
model opens a <think> block first; default off). --temperature=0 is greedy decoding; --top_k / --top_p truncate.

Attention: DSA over the lightning indexer's top-k keys (--attention: in plain JAX, on the Pallas kernels, or the
masked dense reference; --indexer_fp8 / --fp8_kv: the official inference code's FP8 indexer and FP8 latent cache).
A checkpoint whose indexers were never trained (an HF DeepSeek-V3.1-Terminus checkpoint, a conversion with fresh
indexers, a dense-stage workdir) attends to every earlier token instead, with a note on stderr (--dsa=on|off forces
either).

Errors name the file, the flag or the line: a checkpoint without a tokenizer, a prompt longer than the model's
context (config max_position_embeddings), an empty prompts file, a line that is not a JSON object.
"""

from __future__ import annotations

import json
import math
import os
import sys

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("ckpt", None, "HF checkpoint dir, dsv32-jax orbax checkpoint dir, or training workdir")
flags.DEFINE_string("prompt", None, "one prompt (text)")
flags.DEFINE_string("prompts_file", None, "JSONL prompts: one object per line with 'prompt' (or 'messages' with --chat)")
flags.DEFINE_string("out", None, "JSONL output for --prompts_file (default: stdout only)")
flags.DEFINE_boolean("chat", False, "encode the prompt as a user turn of the DeepSeek-V3.2 chat format")
flags.DEFINE_boolean("thinking", False, "with --chat: thinking mode (the assistant turn opens with <think>)")
flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate at most per prompt (cut to the model's context)")
flags.DEFINE_float("temperature", 1.0, "sampling temperature; 0 = greedy")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling: keep the most likely tokens up to this probability mass")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_string("mesh", "", "device mesh for the parameters, e.g. 'fsdp:2,tensor:4' (default: one device)")
flags.DEFINE_string("tokenizer", None, "override the checkpoint's tokenizer: 'byte', 'chat:tiny', 'chat:bpe', or a "
                    "tokenizer.json path (or a directory holding one)")
flags.DEFINE_integer("step", None, "training workdirs: the checkpoint step (default: the latest)")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute / parameter dtype")
flags.DEFINE_integer("top_k", 0, "sample among the k most likely tokens only (0: no top-k truncation)")
flags.DEFINE_integer("max_candidates", 0, "the candidate set --top_k / --top_p cut from: the N most likely tokens; 0 "
                     "(default): the whole vocabulary with --top_p < 1 (the exact nucleus: one top-k over the "
                     "vocabulary per token), else max(64, --top_k). A smaller N caps the nucleus (faster)")
flags.DEFINE_enum("dsa", "auto", ["auto", "on", "off"],
                  "DeepSeek Sparse Attention: 'on' attends to the lightning indexer's top-k keys, 'off' to every "
                  "earlier token; 'auto': off when the checkpoint's indexers were never trained (an HF checkpoint "
                  "without indexer weights such as DeepSeek-V3.1-Terminus, a conversion that initialized them fresh, "
                  "a dense-stage training workdir), on otherwise")
flags.DEFINE_enum("attention", "sparse", ["sparse", "kernel", "dense"],
                  "how DSA attends: gathered top-k rows in plain JAX (sparse), the Pallas kernels (kernel: GPU / "
                  "TPU), or the masked dense reference (dense)")
flags.DEFINE_boolean("indexer_fp8", False, "select with the production indexer (Hadamard-rotated e4m3, as the "
                     "official inference code runs it)")
flags.DEFINE_boolean("fp8_kv", False, "keep the latent cache in FP8 (e4m3 with per-token scales), as the official "
                     "inference code does")


class GenerateError(ValueError):
    """Bad input to dsv32-generate; the message names the file, flag or line."""


# ------------------------------------------------------------------------------------------------ tokenizers
class _CodecTokenizer:
    """A chat codec (TinyCodec / HFCodec) as a tokenizer; encodes chat markup as its special ids."""

    def __init__(self, codec, name):
        self.codec, self.name = codec, name
        self.vocab_size, self.eos_id = codec.vocab_size, codec.eos_id

    def encode(self, text):
        return self.codec.encode(text)

    def decode(self, ids):
        return self.codec.decode(ids)


def _make(spec: str, where: str):
    from dsv32_jax.posttrain import chat
    from dsv32_jax.train.data.tokenizers import make_tokenizer

    if spec == "chat:tiny":
        return _CodecTokenizer(chat.TinyCodec.printable(), spec)
    if spec == "chat:bpe":
        return _CodecTokenizer(chat.load_tokenizer(), spec)
    try:
        return make_tokenizer(spec)
    except FileNotFoundError as e:
        raise GenerateError(f"{where}: {e}") from None


def resolve_tokenizer(ckpt: str, override: str | None = None, step: int | None = None):
    """The checkpoint's tokenizer (see the module docstring), or `override`; errors name the missing file and the
    --tokenizer flag."""
    from dsv32_jax.checkpoint import orbax_io

    if override:
        return _make(override, "--tokenizer")
    hint = ("; pass one with --tokenizer=PATH (a tokenizer.json or a directory holding one, 'byte' for byte-level "
            "models such as the built-in demo, 'chat:tiny' / 'chat:bpe' for the agent demos' codecs)")
    if orbax_io.is_training_workdir(ckpt):
        meta = orbax_io.training_checkpoint(ckpt, step).meta
        spec = meta.get("tokenizer") if isinstance(meta, dict) else None
        if spec is None:
            own = os.path.join(ckpt, "tokenizer.json")
            if os.path.isfile(own):
                return _make(own, ckpt)
            raise GenerateError(f"{ckpt}: training workdir records no tokenizer (its checkpoint meta has no "
                                f"'tokenizer' field: written before dsv32-jax recorded it) and {own} is missing"
                                + hint)
        if spec not in ("byte", "chat:tiny", "chat:bpe") and not os.path.isfile(spec):
            raise GenerateError(f"{ckpt}: the recorded tokenizer {spec} is missing" + hint)
        return _make(spec, ckpt)
    path = os.path.join(ckpt, "tokenizer.json")
    if not os.path.isfile(path):
        raise GenerateError(f"{ckpt}: no tokenizer ({path} is missing)" + hint)
    return _make(path, ckpt)


# -------------------------------------------------------------------------------------------------- prompts
def read_prompts(path: str, chat: bool) -> list[dict]:
    """The JSONL objects of a prompts file (blank lines skipped); each has 'prompt' (a string) or, with chat,
    'messages'. Errors name the file and the line number."""
    rows = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise GenerateError(f"--prompts_file={path}: cannot read ({e.strerror})") from None
    with f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise GenerateError(f"{path}:{n}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise GenerateError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise GenerateError(f"{path}:{n}: expected a JSON object with 'prompt', got {type(obj).__name__}")
            if chat and "messages" in obj:
                if not isinstance(obj["messages"], list) or not obj["messages"]:
                    raise GenerateError(f"{path}:{n}: 'messages' must be a non-empty list of messages")
            elif not isinstance(obj.get("prompt"), str):
                need = "'prompt' (a string) or 'messages'" if chat else "'prompt' (a string)"
                raise GenerateError(f"{path}:{n}: field {need} missing")
            rows.append((n, obj))
    if not rows:
        raise GenerateError(f"{path}: empty prompts file (no JSON lines); expected one object per line like "
                            '{"prompt": "..."}')
    return rows


def encode_prompt(tok, obj: dict, chat: bool, thinking: bool) -> list[int]:
    if not chat:
        return list(tok.encode(obj["prompt"]))
    from dsv32_jax.posttrain.chat import encoding

    messages = obj.get("messages") or [{"role": "user", "content": obj["prompt"]}]
    if isinstance(tok, _CodecTokenizer):
        return encoding.encode_tokens(messages, tok.codec, thinking=thinking)[0]
    if hasattr(tok, "chat_codec"):  # an HF tokenizer: the markup's specials as ids, the contents as plain text (a
        try:  # user's "<｜end▁of▁sentence｜>" stays text), one BOS
            codec = tok.chat_codec()
        except ValueError as e:
            raise GenerateError(f"--chat: tokenizer {tok.name} cannot encode the chat format: {e}") from None
        return encoding.encode_tokens(messages, codec, thinking=thinking)[0]
    return list(tok.encode(encoding.encode(messages, thinking=thinking)))  # bytes: no special ids at all


# ------------------------------------------------------------------------------------------------- running
def stream_text(tok, tokens, write) -> list[int]:
    """Consumes a token stream, writing the newly decoded text after each token (the whole completion is
    re-decoded, so multi-byte characters and merged pieces come out whole); returns the ids."""
    ids, shown = [], ""
    for t in tokens:
        ids.append(t)
        text = tok.decode(ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
            continue
        if text.startswith(shown):
            write(text[len(shown):])
        shown = text
    text = tok.decode(ids)
    if text != shown and text.startswith(shown):
        write(text[len(shown):])
    return ids


def write_jsonl_atomic(path: str, rows: list[dict]) -> None:
    """Writes `rows` as JSONL through `<path>.tmp-<pid>` and a rename; on any failure (a full disk, a rename
    onto a directory) the temporary file is removed, so nothing half-written is left beside `path`."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp) and not os.path.isdir(tmp):
            os.remove(tmp)
        raise


def run(ckpt: str, prompts: list[tuple[str, dict]], *, out: str | None = None, chat: bool = False,
        thinking: bool = False, max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
        seed: int = 0, mesh: str = "", tokenizer: str | None = None, step: int | None = None,
        dtype: str = "float32", top_k: int = 0, dsa: str = "auto", attention: str = "sparse",
        indexer_fp8: bool = False, fp8_kv: bool = False, max_candidates: int = 0, write=None,
        note=None) -> list[dict]:
    """Loads the checkpoint, encodes and checks every prompt (before generating anything), then generates and
    streams each completion through `write` (default: stdout). prompts: (label for errors, object) pairs.
    dsa / attention / indexer_fp8 / fp8_kv: the model's RunOptions (`--dsa` explains "auto"); `note` (default:
    stderr) gets one line when "auto" turns DSA off. Returns the output rows."""
    import jax
    import jax.numpy as jnp

    import dsv32_jax
    from dsv32_jax.posttrain.generate import check_prompt, generate_stream
    from dsv32_jax.posttrain.sampler import MIN_TEMPERATURE, SamplingConfig

    if write is None:
        def write(s):
            sys.stdout.write(s)
            sys.stdout.flush()
    if not os.path.exists(ckpt):
        raise GenerateError(f"--ckpt={ckpt}: does not exist")
    # nan passes a `< 0` test and inf samples uniformly: both refused here, by the flag's name
    if not (math.isfinite(temperature) and (temperature == 0 or temperature >= MIN_TEMPERATURE)):
        raise GenerateError(f"--temperature={temperature}: must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise GenerateError(f"--top_p={top_p}: must be in (0, 1]")
    if max_new_tokens < 1:
        raise GenerateError(f"--max_new_tokens={max_new_tokens}: must be >= 1")
    if top_k < 0:
        raise GenerateError(f"--top_k={top_k}: must be >= 0; 0 = no top-k truncation")
    if max_candidates < 0:
        raise GenerateError(f"--max_candidates={max_candidates}: must be >= 0; 0 = the whole vocabulary with --top_p "
                            "< 1, else max(64, --top_k)")
    if 0 < max_candidates < top_k:
        raise GenerateError(f"--top_k={top_k} exceeds --max_candidates={max_candidates} (the candidate set top_k cuts "
                            "from): raise --max_candidates, or leave it at 0")
    if dsa not in ("auto", "on", "off"):
        raise GenerateError(f"--dsa={dsa}: must be auto, on or off")
    if out:  # before any generation, not after it
        if os.path.isdir(out):
            raise GenerateError(f"--out={out}: is a directory (give a file path for the JSONL output)")
        if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            raise GenerateError(f"--out={out}: directory {os.path.dirname(os.path.abspath(out))} does not exist")
    tok = resolve_tokenizer(ckpt, tokenizer, step)
    if dsa == "auto":
        from dsv32_jax.checkpoint.loading import untrained_indexers

        why = untrained_indexers(ckpt, step)
        if why:
            (note or (lambda m: print(m, file=sys.stderr, flush=True)))(
                f"note: {why}: attending to every earlier token (--dsa=on selects with these indexers anyway)")
        dsa = "off" if why else "on"
    options = dsv32_jax.RunOptions(attention=attention, dsa=dsa == "on", indexer_fp8=indexer_fp8, fp8_kv=fp8_kv)
    model = dsv32_jax.from_pretrained(ckpt, dtype=jnp.dtype(dtype), mesh=mesh or None, step=step, include_mtp=False,
                                      options=options)
    if tok.vocab_size > model.config.vocab_size:
        raise GenerateError(f"tokenizer {tok.name}: {tok.vocab_size} ids, more than the model's vocab_size "
                            f"{model.config.vocab_size} ({ckpt}); pass the model's own tokenizer with --tokenizer")
    encoded = []
    for label, obj in prompts:
        try:
            ids = encode_prompt(tok, obj, chat, thinking)
        except ValueError as e:  # a chat message the format refuses (ChatFormatError): named with its file:line
            raise GenerateError(f"{label}: {e}") from None
        check_prompt(model, len(ids), max_new_tokens, where=label)
        encoded.append(ids)
    eos = tok.eos_id if tok.eos_id is not None else -1
    vocab = min(tok.vocab_size, model.config.vocab_size)
    if not max_candidates:  # (SamplingConfig's default of 64 cut --top_p=0.99 to the 64 likeliest ids, silently)
        max_candidates = max(vocab, top_k) if top_p < 1 else max(SamplingConfig.max_candidates, top_k)
    cfg = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature or 1.0, greedy=temperature == 0,
                         top_k=top_k, top_p=top_p, max_candidates=max_candidates, eos_id=eos, pad_id=0,
                         vocab_size=tok.vocab_size if tok.vocab_size < model.config.vocab_size else 0)
    rng = jax.random.key(seed)
    rows = []
    for i, ((label, obj), ids) in enumerate(zip(prompts, encoded)):
        if len(prompts) > 1:
            write(f"\n### {label}\n" if i else f"### {label}\n")
        gen = stream_text(tok, generate_stream(model, ids, cfg, jax.random.fold_in(rng, i)), write)
        write("\n")
        rows.append(dict(obj, completion=tok.decode(gen), completion_tokens=len(gen)))
    if out:
        write_jsonl_atomic(out, rows)
    return rows


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if not FLAGS["verbosity"].present:  # (orbax's and jax's INFO lines, ~70 of them, buried the notes and errors)
        logging.set_verbosity(logging.WARNING)
    if not FLAGS.ckpt:
        raise app.UsageError("--ckpt is required (an HF checkpoint, an orbax checkpoint or a training workdir)")
    if (FLAGS.prompt is None) == (FLAGS.prompts_file is None):
        raise app.UsageError("give exactly one of --prompt and --prompts_file")
    if FLAGS.thinking and not FLAGS.chat:
        raise app.UsageError("--thinking applies to chat prompts: add --chat")
    try:
        if FLAGS.prompts_file:
            prompts = [(f"{FLAGS.prompts_file}:{n}", obj) for n, obj in read_prompts(FLAGS.prompts_file, FLAGS.chat)]
        else:
            prompts = [("--prompt", {"prompt": FLAGS.prompt})]
        run(FLAGS.ckpt, prompts, out=FLAGS.out, chat=FLAGS.chat, thinking=FLAGS.thinking,
            max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_p=FLAGS.top_p, seed=FLAGS.seed,
            mesh=FLAGS.mesh, tokenizer=FLAGS.tokenizer, step=FLAGS.step, dtype=FLAGS.dtype, top_k=FLAGS.top_k,
            dsa=FLAGS.dsa, attention=FLAGS.attention, indexer_fp8=FLAGS.indexer_fp8, fp8_kv=FLAGS.fp8_kv,
            max_candidates=FLAGS.max_candidates)
    except (GenerateError, ValueError, OSError) as e:  # ValueError: PromptTooLongError, CheckpointError, ...
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def cli() -> None:
    """Console script `dsv32-generate`."""
    sys.modules["__main__"].__doc__ = __doc__
    app.run(main)


if __name__ == "__main__":
    cli()
