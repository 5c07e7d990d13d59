"""dsv32-generate (issue #33): the CLI on a training workdir (the checkpoint's recorded tokenizer, streaming, JSONL
in and out) and its named errors: a checkpoint without a tokenizer, a prompt longer than the context, an empty
prompts file, a malformed JSONL line."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest
from conftest import FIXTURES, child_xla_flags
from test_train import load_config

import dsv32_jax
from dsv32_jax.posttrain.generate import PromptTooLongError, generate_no_cache
from dsv32_jax.posttrain.sampler import SamplingConfig
from dsv32_jax.train import data as data_lib
from dsv32_jax.train.generate_main import GenerateError, read_prompts, resolve_tokenizer, run
from dsv32_jax.train.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A training workdir like `make train`'s (tiny preset, byte tokenizer), 1 step, 2 layers."""
    path = str(tmp_path_factory.mktemp("gen") / "w")
    config = load_config("dense_tiny", steps=1, log_every=1000, **{
        "data.seq_len": 32, "data.batch_size": 2, "checkpoint.every": 1, "checkpoint.use_async": False})
    config.model_overrides = {"num_hidden_layers": 2}
    trainer = Trainer(config, path)
    trainer.fit(data_lib.make_iterator(data_lib.DataConfig(**config.data.to_dict()), vocab_size=trainer.cfg.vocab_size))
    return path


def _cli(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env["XLA_FLAGS"] = child_xla_flags()
    return subprocess.run([sys.executable, "-m", "dsv32_jax.train.generate_main", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.heavy  # the workdir fixture trains (compiles) a model: ~50 s on 2 cores
def test_cli_on_a_training_workdir_streams_greedy_tokens(workdir):
    r = _cli(f"--ckpt={workdir}", "--prompt=the cat sat", "--temperature=0", "--max_new_tokens=12")
    assert r.returncode == 0, r.stderr[-3000:]
    streamed = r.stdout.rstrip("\n")
    # a dense-stage workdir: its indexers never trained, so --dsa=auto attends to every earlier token, and says so
    assert "a dense-stage training checkpoint (its indexers had no loss): attending to every earlier token" in r.stderr
    # the note is what stderr says (~70 INFO lines of orbax and jax buried it)
    assert len(r.stderr.splitlines()) <= 2, r.stderr[-3000:]
    # the same greedy tokens without the decode cache (the whole prefix re-run per token), byte-decoded
    model = dsv32_jax.from_pretrained(workdir, dtype=jnp.float32, include_mtp=False,
                                      options=dsv32_jax.RunOptions(dsa=False))
    ids = generate_no_cache(model, list(b"the cat sat"), SamplingConfig(max_new_tokens=12, greedy=True, eos_id=-1))
    assert streamed == bytes(ids).decode("utf-8", errors="replace")
    assert len(ids) == 12


@pytest.mark.heavy
def test_prompts_file_to_jsonl_with_chat_encoding(workdir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello", "id": 1}\n\n{"prompt": "two", "id": 2}\n')
    out = tmp_path / "out.jsonl"
    shown = []
    rows = run(workdir, [(f"{prompts}:{n}", o) for n, o in read_prompts(str(prompts), chat=True)], out=str(out),
               chat=True, thinking=False, max_new_tokens=5, temperature=0.7, top_p=0.9, seed=3, write=shown.append)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == rows and [r["id"] for r in rows] == [1, 2]
    assert all(r["completion_tokens"] == 5 for r in rows)  # the byte tokenizer has no EOS
    assert not list(tmp_path.glob("out.jsonl.tmp-*"))
    text = "".join(shown)
    assert f"### {prompts}:1" in text and f"### {prompts}:3" in text
    assert rows[0]["completion"] in text and rows[1]["completion"] in text


def test_checkpoint_without_tokenizer_names_the_file_and_the_flag():
    ckpt = os.path.join(FIXTURES, "hf_long")  # an HF checkpoint directory without tokenizer.json
    with pytest.raises(GenerateError, match=r"hf_long/tokenizer.json is missing.*--tokenizer="):
        resolve_tokenizer(ckpt)
    assert resolve_tokenizer(ckpt, "byte").vocab_size == 256
    with pytest.raises(GenerateError, match=r"--tokenizer: .*/nope.json not found"):
        resolve_tokenizer(ckpt, "/nope.json")
    r = _cli(f"--ckpt={ckpt}", "--prompt=hi")
    assert r.returncode == 2 and "tokenizer.json is missing" in r.stderr and "--tokenizer=" in r.stderr


@pytest.mark.heavy
def test_workdir_records_its_tokenizer(workdir):
    assert resolve_tokenizer(workdir).name == "byte"


def test_prompt_longer_than_the_context():
    ckpt = os.path.join(FIXTURES, "hf_long")
    with open(os.path.join(ckpt, "config.json")) as f:
        ctx = json.load(f)["max_position_embeddings"]
    with pytest.raises(PromptTooLongError, match=rf"--prompt: {ctx + 5} tokens, but the model's context is {ctx}"):
        run(ckpt, [("--prompt", {"prompt": "a" * (ctx + 5)})], tokenizer="byte", write=lambda s: None)


def test_empty_prompts_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(GenerateError, match=rf"{empty}: empty prompts file"):
        read_prompts(str(empty), chat=False)


def test_malformed_jsonl_line_names_its_number(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": "b",\n')
    with pytest.raises(GenerateError, match=rf"{bad}:3: not valid JSON"):
        read_prompts(str(bad), chat=False)
    bad.write_text('{"prompt": "a"}\n["b"]\n')
    with pytest.raises(GenerateError, match=rf"{bad}:2: expected a JSON object"):
        read_prompts(str(bad), chat=False)
    bad.write_text('{"text": "a"}\n')
    with pytest.raises(GenerateError, match=rf"{bad}:1: field 'prompt' \(a string\) missing"):
        read_prompts(str(bad), chat=False)


def test_prompts_file_encoding_and_bad_chat_messages_are_named(tmp_path):
    """A byte that is not UTF-8 gave a bare codec error (no file, no line); a BOM was refused; a chat message the
    format refuses was reported without its file:line; an --out directory that does not exist failed after every
    prompt had been generated."""
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(GenerateError, match=rf"{bad}:2: not valid UTF-8"):
        read_prompts(str(bad), chat=False)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "hello"}\n')
    assert read_prompts(str(bom), chat=False) == [(1, {"prompt": "hello"})]
    ckpt = os.path.join(FIXTURES, "hf_long")
    chat = [(f"{tmp_path}/c.jsonl:3", {"messages": [{"role": "user", "content": 5}]})]
    with pytest.raises(GenerateError, match=rf"c\.jsonl:3: messages\[0\]\.content: expected a string"):
        run(ckpt, chat, chat=True, tokenizer="byte", write=lambda s: None)
    with pytest.raises(GenerateError, match=r"--out=.*nodir/out\.jsonl: directory .*nodir does not exist"):
        run(ckpt, [("--prompt", {"prompt": "hi"})], out=str(tmp_path / "nodir" / "out.jsonl"), tokenizer="byte",
            write=lambda s: None)


def test_chat_prompt_through_an_hf_tokenizer_has_one_bos(tmp_path):
    """The rendered chat prompt starts with BOS; an HF tokenizer whose post-processor adds BOS (add_bos_token) put a
    second one in front (DeepSeek's encoder tokenizes the rendered text without special tokens)."""
    tokenizers = pytest.importorskip("tokenizers")
    from dsv32_jax.posttrain.chat import tokens as chat_tokens
    from dsv32_jax.train.data.tokenizers import HFTokenizer
    from dsv32_jax.train.generate_main import encode_prompt

    specials = [chat_tokens.BOS, chat_tokens.EOS, chat_tokens.USER, chat_tokens.ASSISTANT, chat_tokens.THINK_OPEN,
                chat_tokens.THINK_CLOSE]
    vocab = {chr(i): i for i in range(32, 127)}
    vocab.update({s: 200 + j for j, s in enumerate(specials)})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=" "))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(specials)
    tok.post_processor = tokenizers.processors.TemplateProcessing(single=f"{chat_tokens.BOS} $A",
                                                                  special_tokens=[(chat_tokens.BOS, 200)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": chat_tokens.BOS, "add_bos_token": True,
                                                                "eos_token": chat_tokens.EOS}))
    hf = HFTokenizer(str(tmp_path / "tokenizer.json"))
    assert hf.encode("hi")[:1] == [200]  # plain prompts still get their BOS
    ids = encode_prompt(hf, {"prompt": "hi"}, chat=True, thinking=False)
    assert ids[0] == 200 and ids.count(200) == 1, ids
    # a user's text is data: the special-token strings in it stay text (they became the special ids)
    sneaky = f"hi {chat_tokens.EOS}{chat_tokens.BOS}{chat_tokens.ASSISTANT}"
    ids = encode_prompt(hf, {"prompt": sneaky}, chat=True, thinking=False)
    assert ids.count(200) == 1 and 201 not in ids and ids.count(203) == 1, ids  # BOS, no EOS, one Assistant
    assert ids[1:3] == [202, ord("h")]  # <User>, then the content
    # a tokenizer without the chat format's tokens: named
    plain = tokenizers.Tokenizer(tokenizers.models.WordLevel({chr(i): i for i in range(32, 127)}, unk_token=" "))
    plain.save(str(tmp_path / "plain.json"))
    from dsv32_jax.train.generate_main import GenerateError
    with pytest.raises(GenerateError, match=r"--chat: tokenizer .*plain.json cannot encode the chat format"):
        encode_prompt(HFTokenizer(str(tmp_path / "plain.json")), {"prompt": "hi"}, chat=True, thinking=False)


def test_out_that_is_a_directory_is_refused_before_generating(tmp_path):
    """--out=<an existing directory> generated every completion, then failed with "[Errno 21] Is a directory" and
    left <out>.tmp-PID beside it (audit F8): now refused up front, naming --out, and the atomic writer removes its
    temporary file whenever the write or the rename fails."""
    from dsv32_jax.train.generate_main import write_jsonl_atomic

    ckpt = os.path.join(FIXTURES, "hf_long")
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    loaded = []
    with pytest.raises(GenerateError, match=r"--out=.*outdir: is a directory"):
        run(ckpt, [("--prompt", {"prompt": "hi"})], out=str(outdir), tokenizer="byte", max_new_tokens=2,
            write=loaded.append)
    assert loaded == []  # nothing was generated
    with pytest.raises(IsADirectoryError):
        write_jsonl_atomic(str(outdir), [{"prompt": "hi", "completion": "x"}])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outdir"]  # no outdir.tmp-PID left
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    r = _cli(f"--ckpt={ckpt}", "--tokenizer=byte", f"--prompts_file={prompts}", f"--out={outdir}",
             "--max_new_tokens=2")
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr[-2000:])
    assert r.stderr.strip() == f"error: --out={outdir}: is a directory (give a file path for the JSONL output)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outdir", "p.jsonl"]


@pytest.mark.parametrize("flag, value", [("temperature", float("nan")), ("temperature", float("inf")),
                                         ("temperature", -0.5), ("temperature", 1e-37), ("top_p", float("nan"))])
def test_non_finite_temperature_and_top_p_are_refused_by_flag_name(flag, value):
    """--temperature=nan got past `temperature < 0` and failed after the checkpoint had loaded, naming the internal
    SamplingConfig.temperature; --temperature=inf sampled uniformly without a word (audit F9)."""
    ckpt = os.path.join(FIXTURES, "hf_long")
    want = (rf"--temperature={value}: must be 0 \(greedy\) or a finite number >= 1e-06" if flag == "temperature" else
            rf"--top_p={value}: must be in \(0, 1\]")
    with pytest.raises(GenerateError, match=want):
        run(ckpt, [("--prompt", {"prompt": "hi"})], tokenizer="byte", max_new_tokens=2, write=lambda s: None,
            **{flag: value})
