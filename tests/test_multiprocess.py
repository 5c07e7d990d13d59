"""Sharded and multi-process training on CPU devices: the dense and sparse stages (with MTP, balance loss and the
bias update) give the same losses, gradient norms and held-out losses on 1 device, on 8 devices of one process
(fsdp:2,tensor:2,expert:2) and on 2 processes x 4 devices with jax.distributed on localhost (gloo collectives; the
batch's rows split over the processes: data.shards = 2, each process reading its own document shard); and a
checkpoint written by the 2 processes (parameters, optimizer state, both shards' data positions) is resumed by 1
process (sparse stage), continuing exactly like the uninterrupted run. Losses AND gradient norms are compared
(Adam's first steps are nearly sign-only, so equal losses alone would not catch a wrong gradient); few steps, since
float noise can later flip a near-tied routing / top-k choice. The sharded runs accumulate gradients over 2
microbatches (config.microbatches), the 1-device run takes each batch whole: the same step."""

import json
import os

import numpy as np
import pytest
from conftest import run_processes

MESH = "fsdp:2,tensor:2,expert:2"
STEPS = 3  # the 2-process run stops at 2 (a checkpoint), the resumed run does step 3

SCRIPT = r"""
import json, os, sys
pid, nproc, port, root, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
meshes = sys.argv[6].split(";")
stages = sys.argv[7].split(",")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={8 // nproc}"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
if nproc > 1:
    jax.distributed.initialize(f"localhost:{port}", nproc, pid)
sys.path.insert(0, os.getcwd())
from tests.test_train import load_config
from dsv32_jax.train import data as data_lib
from dsv32_jax.train.trainer import Trainer

out = {}
for stage in stages:
  for mesh in meshes:
    config = load_config(f"{stage}_tiny", steps=steps, log_every=1000, mesh=mesh, init_from="", **{
        "data.seq_len": 32, "data.batch_size": 8, "data.shards": 2, "checkpoint.every": 2,
        "checkpoint.use_async": False, "optimizer.warmup_steps": 1, "optimizer.lr": 1e-3, "eval.every": 2,
        "eval.batches": 1,
        "loss.mtp_weight": 0.1, "loss.balance_weight": 1e-2, "loss.bias_update_speed": 1e-3,
        "microbatches": 1 if mesh == "fsdp:1" else 2})
    # 2 layers (a dense one and an MoE one) + the MTP layer: every kind of block, less to compile
    config.model_overrides = {"initializer_range": 0.3, "index_topk": 8, "num_hidden_layers": 2}
    trainer = Trainer(config, os.path.join(root, stage, mesh))
    i, n = trainer.data_shard
    it = data_lib.make_iterator(data_lib.DataConfig(**config.data.to_dict()), vocab_size=trainer.cfg.vocab_size,
                                process_index=i, process_count=n)
    try:
        out[f"{stage} {mesh}"] = [(h["step"], h["loss"], h["grad_norm"], h.get("eval_loss", float("nan")))
                                  for h in trainer.fit(it)]
    finally:
        it.close()
print("RESULT " + json.dumps({"process": jax.process_index(), "devices": jax.device_count(),
                              "local_devices": jax.local_device_count(), "out": out}), flush=True)
"""


def _run(nproc: int, root: str, steps: int, meshes=(MESH,), stages=("dense", "sparse")) -> list[dict]:
    return run_processes(SCRIPT, nproc, root, str(steps), ";".join(meshes), ",".join(stages))


@pytest.mark.heavy
@pytest.mark.xdist_group("multiprocess")
def test_one_device_eight_devices_and_two_processes_agree_and_resume_across(tmp_path):
    root = str(tmp_path)
    ref = _run(1, os.path.join(root, "one"), STEPS, meshes=("fsdp:1", MESH))[0]
    two = _run(2, os.path.join(root, "two"), STEPS - 1)
    # the 2-process sparse workdir (with MTP, DSA, MoE: the richest state) continued by 1 process
    resumed = _run(1, os.path.join(root, "two"), STEPS, stages=("sparse",))[0]
    assert ref["devices"] == 8 and ref["local_devices"] == 8
    assert [r["process"] for r in two] == [0, 1]
    assert all(r["devices"] == 8 and r["local_devices"] == 4 for r in two)
    for stage in ("dense", "sparse"):
        single = np.asarray(ref["out"][f"{stage} fsdp:1"])
        want = np.asarray(ref["out"][f"{stage} {MESH}"])
        print(stage, "1 device (step, loss, grad norm):", single.tolist(), "1 x 8:", want.tolist())
        np.testing.assert_array_equal(want[:, 0], [1, 2, 3])
        np.testing.assert_allclose(want[:, 1:], single[:, 1:], rtol=1e-5)
        assert want[0, 1] != want[1, 1]  # the steps saw different data and the loss moved
        for r in two:  # every process sees the same global metrics
            got = np.asarray(r["out"][f"{stage} {MESH}"])
            print(stage, f"2 x 4 (process {r['process']}):", got.tolist())
            np.testing.assert_array_equal(got[:, 0], want[:STEPS - 1, 0])
            np.testing.assert_allclose(got[:, 1:], want[:STEPS - 1, 1:], rtol=1e-5)
            assert np.isfinite(got[-1, 3])  # the held-out loss at the last step: the same rows on 2 processes
        # the 2-process checkpoint (step 2) holds both processes' data positions and resumes on 1 process
        ckpt = os.path.join(root, "two", stage, MESH, "checkpoints", str(STEPS - 1))
        with open(os.path.join(ckpt, "data", "metadata")) as f:
            data = json.load(f)
        assert data["num_shards"] == 2 and sorted(data["shards"]) == ["0", "1"]
        if stage != "sparse":
            continue
        got = np.asarray(resumed["out"][f"{stage} {MESH}"])
        print(stage, "resumed on 1 process:", got.tolist())
        np.testing.assert_array_equal(got[:, 0], [STEPS])
        np.testing.assert_allclose(got[:, 1:], want[STEPS - 1:, 1:], rtol=1e-5)


@pytest.mark.heavy
@pytest.mark.xdist_group("multiprocess")
def test_a_tensor_axis_across_processes_shares_the_batch_rows(tmp_path):
    """mesh tensor:2,expert:4 on 2 processes x 4 devices: the mesh's outermost axis of size > 1, tensor, spans the
    processes, so both processes' devices own all 8 rows of the batch (over expert). Each process used to load its
    process index's half (rows it does not own) and build a [4, 32] "global" batch of its own: another loss on each
    process (8.18 vs 8.36 at step 1), then a hang. Now both load row block 0 of 1 (trainer.data_shard) and the
    losses and gradient norms equal one device's."""
    mesh = "tensor:2,expert:4"
    ref = _run(1, os.path.join(str(tmp_path), "one"), 2, meshes=("fsdp:1",), stages=("dense",))[0]
    two = run_processes(SCRIPT, 2, os.path.join(str(tmp_path), "two"), "2", mesh, "dense", timeout=400)
    want = np.asarray(ref["out"]["dense fsdp:1"])
    for r in two:
        got = np.asarray(r["out"][f"dense {mesh}"])
        print(f"process {r['process']}:", got.tolist(), "1 device:", want.tolist())
        np.testing.assert_array_equal(got[:, 0], [1, 2])
        np.testing.assert_allclose(got[:, 1:], want[:, 1:], rtol=1e-5)


POSTTRAIN_SCRIPT = r"""
import json, os, sys
pid, nproc, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={8 // nproc}"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
if nproc > 1:
    jax.distributed.initialize(f"localhost:{port}", nproc, pid)
import jax.numpy as jnp
import numpy as np
from flax import nnx
sys.path.insert(0, os.getcwd())
from tests.test_train import load_config
from dsv32_jax import Transformer, load_preset
from dsv32_jax.model import sharding as shd
from dsv32_jax.posttrain.sampler import MultiTurnSampler, SamplingConfig
from dsv32_jax.train.agent_grpo import AgentLearner
from dsv32_jax.train.grpo import GRPOLearner

MESH = "fsdp:8"
def numbers(history):
    return [{k: float(v) for k, v in h.items() if isinstance(v, (int, float)) and not k.endswith("_s")}
            for h in history]

out = {}
# three turns of 8 rows over one decode cache, the rows split over the devices of both processes; a row restarts
cfg = load_preset("tiny").replace(initializer_range=0.1, index_topk=8, num_hidden_layers=2)
mesh = shd.make_mesh(MESH)
with shd.use_mesh(mesh):
    model = Transformer(cfg, rngs=nnx.Rngs(7), dtype=jnp.float32)
    scfg = SamplingConfig(max_new_tokens=5, temperature=1.0, top_k=12, max_candidates=16, eos_id=1, pad_id=0)
    sampler = MultiTurnSampler(model, batch=8, capacity=128, cfg=scfg)
    rng = np.random.default_rng(3)
    last = [[] for _ in range(8)]
    for t in range(3):
        live = [t == 0 or i % (t + 1) == 0 for i in range(8)]
        if t == 2:
            sampler.restart(4)
        pieces = [(last[i][-2:] + [int(x) for x in rng.integers(2, cfg.vocab_size, 2 + (i + t) % 5)]) if live[i]
                  else [] for i in range(8)]
        last = sampler.step(pieces, live, jax.random.key(t))
    rec = sampler.layout()
out["turns"] = {"tokens": rec["tokens"].tolist(), "logprobs": rec["logprobs"].tolist(),
                "generated": rec["generated"].tolist(), "type": type(rec["tokens"]).__name__}

c = load_config("grpo_tiny", steps=2, log_every=1000, mesh=MESH, **{
    "grpo.tasks": "map", "grpo.prompts_per_step": 4, "grpo.eval_every": 0, "checkpoint.every": 1000,
    "checkpoint.use_async": False})
c.model_overrides = dict(c.model_overrides, num_hidden_layers=2)
learner = GRPOLearner(c, os.path.join(root, "grpo"))
judged = []  # the reward calls made on this process (a generative reward model's judge: one call per sample)
learner.rewards = {k: (lambda s, f=f: judged.append(1) or f(s)) for k, f in learner.rewards.items()}
out["grpo"] = numbers(learner.fit())
out["reward_calls"] = len(judged)

from dsv32_jax.posttrain.envs.lookup import LookupEnv
spoken = []  # the language hook's calls on this process (a language classifier: one call per episode)
LookupEnv.language_consistency = lambda self, instance, text: spoken.append(1) or (len(text) % 5) / 4
c = load_config("agent_tiny", steps=1, log_every=1000, mesh=MESH, **{
    "checkpoint.use_async": False, "agent.cold_start_steps": 2, "agent.tasks_per_step": 2,
    "agent.eval_episodes": 4, "agent.language_weight": 0.5})
c.model_overrides = dict(c.model_overrides, num_hidden_layers=2)
out["agent"] = numbers(AgentLearner(c, os.path.join(root, "agent")).fit())
out["language_calls"] = len(spoken)
print("RESULT " + json.dumps({"process": jax.process_index(), "out": out}), flush=True)
"""


@pytest.mark.heavy
@pytest.mark.xdist_group("multiprocess")
def test_grpo_agent_and_multi_turn_sampling_on_two_processes_equal_one(tmp_path):
    """GRPO (2 steps), the agent stage (a cold start, then 1 step of multi-turn rollouts and GRPO over them) and
    three turns of MultiTurnSampler with a restart, their batches' rows split over the devices of 2 processes x 4:
    the same metrics, trajectories and log-probs as 1 process x 8 devices. Each rollout used to read its sampled
    tokens with np.asarray, which raises for an array whose rows live on another process's devices: no post-training
    ran on more than one host. Each GRPO reward (a judge model's call) and each agent episode's language reward is
    computed once, by one of the processes."""
    one = _run_posttrain(1, os.path.join(str(tmp_path), "one"))
    two = _run_posttrain(2, os.path.join(str(tmp_path), "two"))
    want = one[0]["out"]
    assert want["turns"]["type"] == "ndarray" and sum(map(sum, want["turns"]["generated"])) > 8
    # every sample's reward computed once, by one process, the samples split evenly over the processes
    assert want["reward_calls"] > 0 and [r["out"]["reward_calls"] for r in two] == [want["reward_calls"] // 2] * 2
    # and each agent episode's language hook called once (it used to run on every process), its reward in the metrics
    assert want["language_calls"] > 0 and [r["out"]["language_calls"] for r in two] == [want["language_calls"] // 2] * 2
    assert "language_reward" in want["agent"][0]
    for r in two:
        got = r["out"]
        print(f"process {r['process']}: grpo", got["grpo"], "agent", got["agent"])
        np.testing.assert_array_equal(got["turns"]["tokens"], want["turns"]["tokens"])
        np.testing.assert_array_equal(got["turns"]["generated"], want["turns"]["generated"])
        np.testing.assert_allclose(got["turns"]["logprobs"], want["turns"]["logprobs"], rtol=1e-5, atol=1e-6)
        for stage in ("grpo", "agent"):
            assert [sorted(h) for h in got[stage]] == [sorted(h) for h in want[stage]]
            for g, w in zip(got[stage], want[stage]):
                np.testing.assert_allclose([g[k] for k in sorted(w)], [w[k] for k in sorted(w)], rtol=1e-4,
                                           atol=1e-6, err_msg=stage)
    assert len(want["grpo"]) == 2 and len(want["agent"]) == 1


def _run_posttrain(nproc: int, root: str) -> list[dict]:
    return run_processes(POSTTRAIN_SCRIPT, nproc, root, timeout=900)


CHECK_SCRIPT = r"""
import json, os, sys
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.distributed.initialize(f"localhost:{port}", nproc, pid)
import numpy as np
sys.path.insert(0, os.getcwd())
from dsv32_jax.model import sharding as shd
from jax.sharding import NamedSharding, PartitionSpec as P

full = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
mesh = shd.make_mesh("fsdp:4")
rows = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P(shd.BATCH_AXES)), lambda i: full[i])
got = shd.host_value({"rows": rows, "local": np.ones(2), "scalar": 3})
shd.check_same_on_processes("the same", [[1, 2], [3]], np.arange(4), "text")
errors = []
for odd in ([1.0, 2.0 + jax.process_index()], np.asarray([1.0, 2.0 + 1e-6 * jax.process_index()], np.float32)):
    try:
        shd.check_same_on_processes("the rewards", odd)
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
print("RESULT " + json.dumps({"rows": got["rows"].tolist(), "local": got["local"].tolist(),
                              "scalar": int(got["scalar"]), "spread": not rows.is_fully_addressable, "errors": errors}),
      flush=True)
"""


@pytest.mark.xdist_group("multiprocess")
def test_host_values_are_whole_and_differing_host_values_are_named(tmp_path):
    """On 2 processes: host_value of an array whose rows live on both processes' devices is the whole array on each;
    check_same_on_processes passes equal values and names the values and the process when they differ."""
    for r in run_processes(CHECK_SCRIPT, 2, timeout=300):
        assert r["spread"]
        np.testing.assert_array_equal(r["rows"], np.arange(24).reshape(8, 3))
        assert r["local"] == [1.0, 1.0] and r["scalar"] == 3
        for error in r["errors"]:  # a list (its repr) and an array (its bytes) that differ
            assert error and error.startswith("the rewards: process 1 computed other values than process 0"), error


ROLLOUT_SCRIPT = r"""
import json, os, sys, threading
pid, nproc, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.distributed.initialize(f"localhost:{port}", nproc, pid)
sys.path.insert(0, os.getcwd())
from dsv32_jax.model import sharding as shd
from dsv32_jax.posttrain import chat
from dsv32_jax.posttrain.agent import rollout as rollout_lib
from dsv32_jax.posttrain.agent.episode import OraclePolicy
from dsv32_jax.posttrain.envs import LookupEnv, Tool
from dsv32_jax.posttrain.sampler import SamplingConfig
from tests.test_multiturn import _scripted_sampler
me = jax.process_index()

class Outside(LookupEnv):  # a tool behind an outside service: each call logged, its answer names the process
    def make_tools(self):
        get = super().make_tools()[0]
        def call(key):
            with open(os.path.join(root, f"calls-{me}"), "a") as f:
                f.write(key + "\n")
            return f"{get.function(key)} (served to process {me})"
        return [Tool(get.name, get.description, get.parameters, call)]

    def score(self, instance, answer):  # details the verifier returns that do not pickle: data, kept as repr
        reward, details = super().score(instance, answer)
        return reward, dict(details, handle=threading.Lock())

class Boom(LookupEnv):
    def generate(self, seed):
        raise KeyError("boom")

codec = chat.TinyCodec.printable()
cfg = SamplingConfig(max_new_tokens=512, eos_id=codec.eos_id, pad_id=codec.pad_id)


out = {}
envs = [Outside() for _ in range(5)]
rollout_lib.MultiTurnSampler = _scripted_sampler([OraclePolicy(Outside(), codec, s) for s in range(5)])
trajs, _ = rollout_lib.BatchedRollout(None, codec, cfg, capacity=4096).run(envs, list(range(5)), max_turns=8)
out["trajs"] = [{"success": t.success, "tool_calls": t.tool_calls, "history": [m.content for m in t.history],
                 "handle": t.info.get("handle")} for t in trajs]
envs[3] = Boom()
try:
    rollout_lib.BatchedRollout(None, codec, cfg, capacity=4096).run(envs, list(range(5)), max_turns=8)
except RuntimeError as e:
    out["failure"] = [str(e), type(e.__cause__).__name__]
envs[3] = Outside()
try:  # the processes disagree on the rows
    rollout_lib.BatchedRollout(None, codec, cfg, capacity=4096).run(envs, [0, 1, 2, 3, 4 + me], max_turns=8)
except ValueError as e:
    out["rows_failure"] = str(e)
out["map"] = shd.process_map("squares", lambda x: [x * x, jax.process_index()], range(5))
def odd(x):
    if x == 4:
        raise ValueError("no 4")
    return x
try:
    shd.process_map("odd", odd, range(5))
except Exception as e:
    out["map_failure"] = [type(e).__name__, str(e)]
try:
    shd.gather_objects("the lock", threading.Lock() if me == 1 else 1)
except ValueError as e:
    out["gather_failure"] = str(e)
class Unpickles(Exception):
    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")
try:
    shd.gather_objects("the error", Unpickles(7, "odd") if me == 1 else 1)
except ValueError as e:
    out["unpickle_failure"] = str(e)
print("RESULT " + json.dumps({"process": me, "out": out}), flush=True)
"""


@pytest.mark.xdist_group("multiprocess")
def test_each_process_runs_its_own_rows_episodes_and_every_process_gets_every_trajectory(tmp_path):
    """BatchedRollout on 2 processes with a scripted sampler: process 0 runs the episodes of rows 0-1, process 1 those
    of rows 2-4 (an environment behind an outside service is called once per tool call, not once per process, and
    may answer differently on each process), and both return the same 5 trajectories; a verifier's detail that does
    not pickle arrives as its repr. An episode that raises on process 1 stops both processes, naming row 3 and the
    process, and so does a call whose rows differ between the processes. sharding.process_map: each process computes
    its block, every process gets every result, and a failure raises on every process; gather_objects names the
    process whose value does not pickle. Mutants: every process running every row (tool calls doubled), no gather of
    the trajectories (rows of the other process None)."""
    root = str(tmp_path)
    results = run_processes(ROLLOUT_SCRIPT, 2, root, timeout=300)
    calls = [open(os.path.join(root, f"calls-{p}")).read().split() for p in range(2)]
    trajs = results[0]["out"]["trajs"]
    owner = [0, 0, 1, 1, 1]
    for row, t in enumerate(trajs):
        assert t["success"] and t["tool_calls"] >= 1, t
        results_text = [h for h in t["history"] if "(served to process" in h]
        assert len(results_text) == t["tool_calls"] and all(f"process {owner[row]})" in h for h in results_text), t
        assert t["handle"].startswith("<unlocked _thread.lock"), t["handle"]
    assert [len(c) for c in calls] == [sum(trajs[r]["tool_calls"] for r in range(5) if owner[r] == p)
                                       for p in range(2)]
    for r in results:
        out = r["out"]
        assert out["trajs"] == trajs
        assert out["failure"][0] == "episode of row 3 (lookup, seed 3) failed on process 1: KeyError: 'boom'"
        assert out["failure"][1] == ("KeyError" if r["process"] == 1 else "NoneType")
        assert out["rows_failure"].startswith("BatchedRollout.run: process 1 has other rows (environment, seed) "
                                              "than process 0"), out["rows_failure"]
        assert out["map"] == [[0, 0], [1, 0], [4, 1], [9, 1], [16, 1]]
        assert out["map_failure"] == (["ValueError", "no 4"] if r["process"] == 1 else
                                      ["RuntimeError", "odd: process 1 failed: ValueError: no 4"])
        assert out["gather_failure"].startswith("the lock: process 1 could not send its value to the other "
                                                "processes (pickle): TypeError"), out["gather_failure"]
        unpickle = out["unpickle_failure"]
        assert unpickle.startswith("the error: process 1 could not send its value to the other processes (pickle): "
                                   "TypeError when unpickling"), unpickle


SLOW_SCRIPT = r"""
import json, os, sys, time
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.distributed.initialize(f"localhost:{port}", nproc, pid)
sys.path.insert(0, os.getcwd())
from dsv32_jax.posttrain import chat
from dsv32_jax.posttrain.agent import rollout as rollout_lib
from dsv32_jax.posttrain.agent.episode import OraclePolicy
from dsv32_jax.posttrain.envs import LookupEnv
from dsv32_jax.posttrain.sampler import SamplingConfig
from tests.test_multiturn import _scripted_sampler

class Slow(LookupEnv):  # a task generator behind a slow service, on process 1's row only
    def generate(self, seed):
        if seed == 3:
            time.sleep(40)
        return super().generate(seed)

codec = chat.TinyCodec.printable()
cfg = SamplingConfig(max_new_tokens=512, eos_id=codec.eos_id, pad_id=codec.pad_id)
rollout_lib.MultiTurnSampler = _scripted_sampler([OraclePolicy(LookupEnv(), codec, s) for s in range(4)])
t0 = time.perf_counter()
trajs, _ = rollout_lib.BatchedRollout(None, codec, cfg, capacity=4096).run([Slow() for _ in range(4)], [0, 1, 2, 3])
print("RESULT " + json.dumps({"success": [t.success for t in trajs], "s": time.perf_counter() - t0}), flush=True)
"""


@pytest.mark.heavy
@pytest.mark.xdist_group("multiprocess")
def test_a_process_whose_environment_is_slow_to_start_does_not_break_the_rollout():
    """2 processes, the environment of process 1's row taking 40 s to set up its task: the rollout finishes on both.
    jax's CPU collectives give up when a process joins its FIRST collective more than 30 s after the others ("Gloo
    context initialization failed: DEADLINE_EXCEEDED"); the rollout's first collective is now made before any
    episode starts (found by an audit: the first prompt exchange, after the slow reset, aborted both processes).
    Mutant: without that first exchange both processes fail."""
    for r in run_processes(SLOW_SCRIPT, 2, timeout=300):
        assert r["success"] == [True] * 4 and r["s"] >= 40, r
