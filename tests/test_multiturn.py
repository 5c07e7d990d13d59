"""Multi-turn sampling over one decode cache (dsv32_jax.posttrain.sampler.MultiTurnSampler): the recorded log-probs, kept
sets, expert routing and indexer selections of every generated token equal a teacher-forced forward over the whole
trajectory's layout, with rows that stop at different turns and pieces of different lengths."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv32_jax import Transformer, load_preset
from dsv32_jax.posttrain.sampler import MultiTurnSampler, SamplingConfig
from dsv32_jax.train.grpo_loss import processed_logprobs


@pytest.fixture(scope="session")
def trajectory():
    cfg = load_preset("tiny").replace(initializer_range=0.1, index_topk=8)
    model = Transformer(cfg, rngs=nnx.Rngs(7), dtype=jnp.float32)
    rng = np.random.default_rng(11)
    scfg = SamplingConfig(max_new_tokens=6, temperature=1.0, top_k=12, max_candidates=16, eos_id=1, pad_id=0)
    sampler = MultiTurnSampler(model, batch=3, capacity=160, cfg=scfg)
    turns = [([5, 9, 3], [True, True, True]), ([4, 0, 7], [True, False, True]), ([3, 0, 0], [True, False, False])]
    outs = []
    for t, (lengths, live) in enumerate(turns):
        pieces = [[int(x) for x in rng.integers(2, cfg.vocab_size, n)] for n in lengths]
        outs.append(sampler.step(pieces, live, jax.random.key(t)))
    return model, sampler, outs, turns


def test_generated_tokens_match_the_teacher_forced_forward(trajectory):
    model, sampler, outs, turns = trajectory
    rec = jax.device_get(sampler.layout())
    for t, (lengths, live) in enumerate(turns):  # rows that stopped get nothing; live rows get 1..6 tokens
        for i in range(3):
            assert (len(outs[t][i]) > 0) == live[i]
    logits, aux = model(jnp.asarray(rec["tokens"]), positions=jnp.asarray(rec["positions"]),
                        segment_ids=jnp.asarray(rec["segments"]), return_aux=True, mtp=False)
    gen = rec["generated"] > 0
    assert gen.sum() == sum(len(o) for turn in outs for o in turn)
    # each generated token was sampled from the previous slot's logits (the last piece token or the previous one)
    prev = np.asarray(logits)[:, :-1]
    logp, _, _ = processed_logprobs(jnp.asarray(prev), jnp.asarray(rec["tokens"][:, 1:]),
                                    jnp.asarray(rec["kept_ids"][:, 1:]), jnp.asarray(rec["kept_mask"][:, 1:]), 1.0)
    diff = np.abs(np.asarray(logp) - rec["logprobs"][:, 1:])[gen[:, 1:]]
    print(f"{gen.sum()} generated tokens; max |logp sampler - teacher forced| = {diff.max():.2e}")
    assert diff.max() < 1e-5
    real = rec["segments"] > 0
    for k, ids in rec["routing"].items():
        native = np.sort(np.asarray(aux["routing"][k]), -1)
        np.testing.assert_array_equal(native[real], np.sort(ids, -1)[real], err_msg=f"routing layer {k}")
    assert rec["topk"], "the DSA layers recorded their selections"
    for k, sel in rec["topk"].items():
        native = np.asarray(aux["topk"][k])
        for b, t in zip(*np.nonzero(real)):
            want = set(int(x) for x in sel[b, t] if x >= 0)
            got = set(int(x) for x in native[b, t] if x >= 0)
            assert got == want, (k, b, t, sorted(got), sorted(want))


def test_positions_continue_per_row_and_padding_is_invisible(trajectory):
    _, sampler, outs, turns = trajectory
    rec = jax.device_get(sampler.layout())
    for i in range(3):
        real = rec["segments"][i] > 0
        np.testing.assert_array_equal(rec["positions"][i][real], np.arange(real.sum()))  # 0, 1, 2, ... per row
        total = sum(n for lengths, _ in turns for n in [lengths[i]]) + sum(len(o[i]) for o in outs)
        assert real.sum() == total
    assert sampler.index == rec["tokens"].shape[1] <= sampler.capacity
    with pytest.raises(ValueError, match="live row 0 has no new context"):
        sampler.step([[], [], []], [True, False, False], jax.random.key(9))
    with pytest.raises(ValueError, match="exceed the capacity"):
        sampler.step([[5] * 200, [], []], [True, False, False], jax.random.key(9))


def test_batched_rollout_appends_only_new_context_and_rows_stop_at_different_turns(monkeypatch):
    """The driver with a scripted sampler (the environments' oracle completions): every episode succeeds, rows end
    after 2-4 turns, and what the driver appended to each row's cache (pieces) plus what it generated is exactly the
    row's final context (Trajectory.ids): nothing re-encoded, nothing lost."""
    from dsv32_jax.posttrain import chat
    from dsv32_jax.posttrain.agent import rollout as rollout_lib
    from dsv32_jax.posttrain.agent.episode import OraclePolicy
    from dsv32_jax.posttrain.envs import make_env

    codec = chat.TinyCodec.printable()
    envs = [make_env("lookup"), make_env("calculator"), make_env("lookup"), make_env("calculator")]
    seeds = [0, 1, 2, 3]
    scripts = [OraclePolicy(e, codec, s) for e, s in zip(envs, seeds)]
    seen = [[] for _ in envs]

    class ScriptedSampler:
        def __init__(self, model, b, capacity, cfg):
            self.turn = [0] * b

        def step(self, pieces, live, rng, limits=None):
            out = []
            for i, (piece, on) in enumerate(zip(pieces, live)):
                seen[i].extend(piece)
                ids = scripts[i].completions[self.turn[i]] if on else []
                self.turn[i] += bool(on)
                seen[i].extend(ids)
                out.append(list(ids))
            return out

        def fits(self, pieces):
            return True

        def restart(self, row):
            raise AssertionError("no context strategy here: rows never restart")

        def layout(self):
            return {}

    monkeypatch.setattr(rollout_lib, "MultiTurnSampler", ScriptedSampler)
    cfg = SamplingConfig(max_new_tokens=512, eos_id=codec.eos_id, pad_id=codec.pad_id)
    trajs, _ = rollout_lib.BatchedRollout(None, codec, cfg, capacity=4096).run(envs, seeds, max_turns=8)
    assert [t.success for t in trajs] == [True] * 4
    assert len({t.turns for t in trajs}) > 1, [t.turns for t in trajs]  # rows stop at different turns
    for i, t in enumerate(trajs):
        assert len(t.segments) == 1 and seen[i] == t.ids


def test_batched_rollout_with_the_model_records_every_generated_token():
    """The real sampler on a random tiny model: completions are garbage (no EOS within 8 tokens, or malformed), so
    every episode ends at its first turn with reward 0; the layout holds each row's prompt and completion."""
    from dsv32_jax.posttrain import chat
    from dsv32_jax.posttrain.agent.rollout import BatchedRollout
    from dsv32_jax.posttrain.envs import make_env

    codec = chat.TinyCodec.printable()
    cfg_m = load_preset("tiny").replace(index_topk=8)
    model = Transformer(cfg_m, rngs=nnx.Rngs(0), dtype=jnp.float32)
    scfg = SamplingConfig(max_new_tokens=8, eos_id=codec.eos_id, pad_id=codec.pad_id)
    envs = [make_env("lookup"), make_env("calculator")]
    trajs, rec = BatchedRollout(model, codec, scfg, capacity=2048).run(envs, [0, 1], max_new_tokens=8)
    assert all(t.reward == 0.0 and t.turns == 1 and "error" in t.info for t in trajs)
    for i, t in enumerate(trajs):
        real = rec["segments"][i] > 0
        np.testing.assert_array_equal(rec["tokens"][i][real], t.ids)
        assert rec["generated"][i].sum() == t.completions[0].length
    # an episode limit below the sampler's (run_episode's max_new_tokens): the sampler still draws 8 tokens a row,
    # the episode keeps 3, and only those 3 are marked generated (trained): the layout marked all 8 before
    trajs, rec = BatchedRollout(model, codec, scfg, capacity=2048).run(envs, [0, 1], max_new_tokens=3)
    for i, t in enumerate(trajs):
        assert t.info["error"].startswith("truncated") and t.completions[0].length == 3, t.info
        assert rec["generated"][i].sum() == 3 and (rec["segments"][i] > 0).sum() > len(t.ids)
        gen = rec["generated"][i] > 0
        np.testing.assert_array_equal(rec["tokens"][i][gen], t.ids[-3:])


def test_batched_rollout_ends_episodes_when_the_shared_cache_is_full():
    """A cache too small for a second turn: the oracle's first tool call runs, then the rows' episodes end as
    "context full" (no exception, no hung episode threads) instead of overflowing the sampler."""
    from dsv32_jax.posttrain import chat
    from dsv32_jax.posttrain.agent.rollout import BatchedRollout
    from dsv32_jax.posttrain.envs import make_env

    codec = chat.TinyCodec.printable()
    model = Transformer(load_preset("tiny").replace(index_topk=8), rngs=nnx.Rngs(0), dtype=jnp.float32)
    scfg = SamplingConfig(max_new_tokens=8, eos_id=codec.eos_id, pad_id=codec.pad_id)
    envs = [make_env("lookup"), make_env("lookup")]
    obs = envs[0].reset(0)
    prompt = len(chat.encode_tokens([chat.System(obs.system), chat.User(obs.task)], codec,
                                    tools=[chat.Tool(**t.spec()) for t in envs[0].tools], thinking=False)[0])
    capacity = -(-(prompt + 4) // 16) * 16 + 8 - 1  # one bucketed prompt + max_new_tokens does not fit
    trajs, rec = BatchedRollout(model, codec, scfg, capacity=capacity).run(envs, [0, 1], thinking=False,
                                                                          max_new_tokens=8)
    for t in trajs:
        assert t.reward == 0.0 and t.info["error"].startswith("context full"), t.info
    assert rec["tokens"].shape[1] == 0  # nothing was sampled


# --- robustness of the batched rollout (issue #32) ---

def _scripted_sampler(scripts):
    """A stand-in for MultiTurnSampler that replays each row's scripted completions (no model)."""
    class ScriptedSampler:
        def __init__(self, model, b, capacity, cfg):
            self.turn = [0] * b

        def step(self, pieces, live, rng, limits=None):
            out = []
            for i, on in enumerate(live):
                out.append(list(scripts[i].completions[self.turn[i]]) if on else [])
                self.turn[i] += bool(on)
            return out

        def fits(self, pieces):
            return True

        def restart(self, row):
            pass

        def layout(self):
            return {}
    return ScriptedSampler


def test_batched_rollout_reports_the_first_failing_row_and_chains_its_exception(monkeypatch):
    """Row 1's environment raises KeyError('boom') at reset while row 0 waits for its first completion: the error
    names row 1 (not the aborted row 0) and chains the KeyError. Mutation tried (the old code): recording the aborted
    rows' exception as their failure and reporting the lowest row reports row 0 and loses "boom"."""
    from dsv32_jax.posttrain import chat
    from dsv32_jax.posttrain.agent import rollout as rollout_lib
    from dsv32_jax.posttrain.agent.episode import OraclePolicy
    from dsv32_jax.posttrain.envs import LookupEnv

    class Boom(LookupEnv):
        def generate(self, seed):
            raise KeyError("boom")

    codec = chat.TinyCodec.printable()
    envs = [LookupEnv(), Boom()]
    scripts = [OraclePolicy(envs[0], codec, 0), None]
    monkeypatch.setattr(rollout_lib, "MultiTurnSampler", _scripted_sampler(scripts))
    cfg = SamplingConfig(max_new_tokens=512, eos_id=codec.eos_id, pad_id=codec.pad_id)
    with pytest.raises(RuntimeError, match=r"episode of row 1 \(lookup, seed 0\) failed: KeyError: 'boom'") as err:
        rollout_lib.BatchedRollout(None, codec, cfg, capacity=4096).run(envs, [0, 0], max_turns=8)
    assert isinstance(err.value.__cause__, KeyError) and err.value.__cause__.args == ("boom",)


def test_batched_rollout_survives_broken_tools(monkeypatch):
    """A tool that raises ZeroDivisionError and one that returns a set, called in the first turn of one row: the
    rollout finishes, both rows succeed, the failures are counted. Mutation tried: Tool.run catching only ToolError
    ends the rollout with "episode of row 1 ... failed: ZeroDivisionError"."""
    from dsv32_jax.posttrain import chat
    from dsv32_jax.posttrain.agent import rollout as rollout_lib
    from dsv32_jax.posttrain.agent.episode import ScriptedPolicy
    from dsv32_jax.posttrain.envs import LookupEnv, Tool

    schema = {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}

    class Broken(LookupEnv):
        def make_tools(self):
            return super().make_tools() + [Tool("div", "d", schema, lambda key: 1 // 0),
                                           Tool("setty", "s", schema, lambda key: {key})]

    codec = chat.TinyCodec.printable()
    envs = [Broken(sum_fraction=0.0), Broken(sum_fraction=0.0)]
    broken = chat.Assistant(tool_calls=[chat.ToolCall("div", {"key": "a"}), chat.ToolCall("setty", {"key": "a"})])
    scripts = [ScriptedPolicy(codec, envs[0].demonstration(0)),
               ScriptedPolicy(codec, [broken] + envs[1].demonstration(1))]
    monkeypatch.setattr(rollout_lib, "MultiTurnSampler", _scripted_sampler(scripts))
    cfg = SamplingConfig(max_new_tokens=512, eos_id=codec.eos_id, pad_id=codec.pad_id)
    trajs, _ = rollout_lib.BatchedRollout(None, codec, cfg, capacity=4096).run(envs, [0, 1], max_turns=8)
    assert [t.success for t in trajs] == [True, True]
    assert [(t.tool_errors, t.tool_crashes) for t in trajs] == [(0, 0), (2, 2)]
    assert trajs[1].history[3].content.startswith('error: tool "div" failed: ZeroDivisionError')


def test_a_larger_model_vocabulary_is_masked_to_the_codec():
    """The tiny preset's 256 ids with the 113-id TinyCodec: BatchedRollout masks the sampler to the codec, so every
    sampled id decodes, and the recorded log-probs (over the kept set: the codec's ids) equal the teacher-forced
    ones. A smaller model vocabulary is refused. Mutation tried: without the mask the sampler emits ids >= 113 and
    run_episode raises "outside the codec's vocabulary" (the old failure: "TinyCodec: id 161 outside")."""
    from types import SimpleNamespace

    from dsv32_jax.posttrain import chat
    from dsv32_jax.posttrain.agent.rollout import BatchedRollout
    from dsv32_jax.posttrain.envs import make_env

    codec = chat.TinyCodec.printable()
    cfg = load_preset("tiny").replace(index_topk=8, num_hidden_layers=2, first_k_dense_replace=2)
    model = Transformer(cfg, rngs=nnx.Rngs(3), dtype=jnp.float32)
    assert model.config.vocab_size == 256 > codec.vocab_size == 113
    scfg = SamplingConfig(max_new_tokens=12, temperature=3.0, eos_id=codec.eos_id, pad_id=codec.pad_id)
    roll = BatchedRollout(model, codec, scfg, capacity=2048)
    assert roll.cfg.vocab_size == 113 and roll.cfg.kept_width(256) == 113
    trajs, rec = roll.run([make_env("lookup"), make_env("calculator")], [0, 1], max_new_tokens=12, thinking=False)
    gen = rec["generated"] > 0
    assert gen.sum() == sum(c.length for t in trajs for c in t.completions) > 0
    assert rec["tokens"][gen].max() < codec.vocab_size
    logits = model(jnp.asarray(rec["tokens"]), positions=jnp.asarray(rec["positions"]),
                   segment_ids=jnp.asarray(rec["segments"]), mtp=False)
    logp, _, _ = processed_logprobs(logits[:, :-1], jnp.asarray(rec["tokens"][:, 1:]),
                                    jnp.asarray(rec["kept_ids"][:, 1:]), jnp.asarray(rec["kept_mask"][:, 1:]), 3.0)
    np.testing.assert_allclose(np.asarray(logp)[gen[:, 1:]], rec["logprobs"][:, 1:][gen[:, 1:]], atol=2e-5)
    with pytest.raises(ValueError, match="model's vocab_size 64 is smaller than the codec's 113"):
        BatchedRollout(SimpleNamespace(config=SimpleNamespace(vocab_size=64)), codec, scfg, 2048)
    with pytest.raises(ValueError, match="SamplingConfig.vocab_size=300 exceeds the model's vocabulary of 256"):
        SamplingConfig(vocab_size=300).kept_width(256)


def test_the_sampler_refuses_a_capacity_past_the_models_context():
    """A row's positions never pass the cache slots used, so capacity <= max_position_embeddings keeps every position
    inside the model's context; a larger capacity let long episodes run at positions the model never saw."""
    cfg = load_preset("tiny").replace(initializer_range=0.1, max_position_embeddings=64)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    scfg = SamplingConfig(max_new_tokens=4, eos_id=1, pad_id=0)
    assert MultiTurnSampler(model, batch=1, capacity=64, cfg=scfg).capacity == 64
    with pytest.raises(ValueError, match=r"MultiTurnSampler: capacity=65 slots exceed the model's context of 64 "
                                         r"positions \(config max_position_embeddings\)"):
        MultiTurnSampler(model, batch=1, capacity=65, cfg=scfg)


def test_a_trajectory_travels_between_processes_as_data_or_names_its_environment():
    """rollout.portable (what each process sends the others after a rollout on several processes): an info value
    the verifier returned that does not survive a pickle round trip (a lock; an exception whose __init__ unpickling
    cannot call; one whose repr raises too) becomes its repr, the rest stays as is; a task instance that does not
    is refused naming the environment. Found by an audit: a value that pickled but did not unpickle raised a bare
    TypeError on every process, a repr that raised left the other processes waiting. The 2-process rollout is
    tests/test_multiprocess.py."""
    import pickle
    import threading

    from dsv32_jax.posttrain import chat
    from dsv32_jax.posttrain.agent.episode import OraclePolicy, run_episode
    from dsv32_jax.posttrain.agent.rollout import portable
    from dsv32_jax.posttrain.envs import LookupEnv

    codec = chat.TinyCodec.printable()
    env = LookupEnv()
    t = run_episode(env, 3, OraclePolicy(env, codec, 3), codec)
    assert portable(t, env) is t
    class Unpickles(Exception):  # pickles, but its __init__ cannot take what unpickling passes
        def __init__(self, code, detail):
            super().__init__(f"{code}: {detail}")

    class NoRepr:
        def __reduce__(self):
            raise TypeError("no pickle")

        def __repr__(self):
            raise RuntimeError("no repr")

    lock, error = threading.Lock(), Unpickles(7, "odd")
    odd = dataclasses.replace(t, info=dict(t.info, handle=lock, error=error, other=NoRepr()))
    sent = pickle.loads(pickle.dumps(portable(odd, env)))
    assert sent.info == dict(t.info, handle=repr(lock), error=repr(error),
                             other="<NoRepr: repr failed: RuntimeError>"), sent.info
    assert sent.history == t.history and sent.instance == t.instance
    with pytest.raises(ValueError, match=r"^lookup: its task instance \(lock\) does not survive a pickle"):
        portable(dataclasses.replace(t, instance=lock), env)


def test_the_decode_loop_compiles_once_for_pieces_of_every_width():
    """Appending a turn's pieces compiles once per piece width (bucketed); the decode loop that follows does not
    depend on that width and compiles once: it used to be one program with the append, and every new width compiled
    the whole decode loop again (3-6.5 s each for the tiny agent model on CPU)."""
    from dsv32_jax.posttrain import sampler as sampler_mod

    cfg = load_preset("tiny").replace(index_topk=8)
    model = Transformer(cfg, rngs=nnx.Rngs(3), dtype=jnp.float32)
    scfg = SamplingConfig(max_new_tokens=3, temperature=1.0, top_k=7, max_candidates=9, eos_id=1, pad_id=0)  # (unique)
    sampler = MultiTurnSampler(model, batch=2, capacity=160, cfg=scfg, bucket=8)
    appends, samples = sampler_mod._append._cache_size(), sampler_mod._sample_after._cache_size()
    widths = set()
    for t, n in enumerate([3, 12, 20, 5]):
        pieces = [list(range(2, 2 + n)), list(range(3, 3 + n))]
        widths.add(sampler._width(pieces))
        sampler.step(pieces, [True, True], jax.random.key(t))
    assert len(widths) == 3
    assert sampler_mod._append._cache_size() - appends == len(widths)
    assert sampler_mod._sample_after._cache_size() - samples == 1
