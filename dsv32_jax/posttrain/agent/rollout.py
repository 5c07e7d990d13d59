"""Batched multi-turn rollouts of a JAX model in tool environments: `run_episode` (episode.py) for every row, the
model's completions sampled together by one `MultiTurnSampler` over one decode cache.

Each row's episode runs `run_episode` unchanged (chat encoding, parsing, tools on the host, context strategies,
segments) in its own thread; its policy hands the prompt to the driver and blocks. When every unfinished episode
is waiting, the driver appends each row's NEW context (the prompt's suffix after what the row's cache already holds:
the tool results and the next generation prompt) to the cache and samples all rows' next completions in one jitted
call; a row whose prompt does not extend its cached context (a context strategy rewrote the history) restarts in a
fresh segment of the cache. Rows that finish their episode stop generating; the others go on. When the next
step would not fit the cache's `capacity` slots (shared by all rows: every step takes the longest row's piece plus
`max_new_tokens`), the waiting rows get an empty completion, which ends their episodes as "context full".

`BatchedRollout.run(envs, seeds)` returns the Trajectories and the sampler's slot layout (tokens, segments,
positions, the generated-token mask, the sampler's log-probs, kept sets, routing and indexer selections): the
teacher-forcing batch of the whole trajectories for GRPO.

A model vocabulary larger than the codec's (padded) is masked: the sampler never emits an id the codec cannot
decode (`SamplingConfig.vocab_size`, set to the codec's here); a smaller one is refused. When an episode raises (an
environment's bug; tool failures never raise), the rollout stops and raises a RuntimeError naming the FIRST row
that failed, its environment and seed, chained to that row's exception.

On several processes (`jax.distributed`) each process runs the episodes of its own block of rows
(`sharding.process_rows`: environments, tools and verifiers are called once per episode, not once per process,
and need not be deterministic); before each sampling step the processes exchange their rows' prompts, so every
process drives the same jitted steps, and at the end the trajectories, so every process returns all of them. A
failure on any process stops every process, naming the row and the process.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

import jax

from dsv32_jax.model import sharding as shd
from dsv32_jax.posttrain import chat
from dsv32_jax.posttrain.agent.episode import Trajectory, run_episode
from dsv32_jax.posttrain.envs import Env
from dsv32_jax.posttrain.sampler import MultiTurnSampler, SamplingConfig


class _Aborted(Exception):
    """Raised in the episode threads still waiting when the rollout stops (not a failure of their own)."""


class _RowPolicy:
    def __init__(self, driver: "BatchedRollout", row: int):
        self.driver, self.row = driver, row

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        return self.driver._request(self.row, list(prompt_ids), max_new_tokens)


class BatchedRollout:
    """`BatchedRollout(model, codec, cfg, capacity).run(envs, seeds, **run_episode_kwargs)`."""

    def __init__(self, model, codec: chat.Codec, cfg: SamplingConfig, capacity: int, seed: int = 0):
        if cfg.eos_id != codec.eos_id:
            raise ValueError(f"SamplingConfig.eos_id={cfg.eos_id} but the codec's EOS id is {codec.eos_id}")
        vocab = model.config.vocab_size if model is not None else codec.vocab_size  # None: a test's scripted sampler
        if vocab < codec.vocab_size:
            raise ValueError(f"the model's vocab_size {vocab} is smaller than the codec's {codec.vocab_size}: the "
                             "model cannot emit every token of the chat format")
        if cfg.vocab_size and cfg.vocab_size != codec.vocab_size:
            raise ValueError(f"SamplingConfig.vocab_size={cfg.vocab_size} but the codec has {codec.vocab_size} ids")
        if vocab > codec.vocab_size:
            cfg = dataclasses.replace(cfg, vocab_size=codec.vocab_size)
        self.model, self.codec, self.cfg, self.capacity, self.seed = model, codec, cfg, capacity, seed

    def _request(self, row: int, prompt: list[int], limit: int) -> list[int]:
        with self._cond:
            self._pending[row] = (prompt, limit)
            self._cond.notify_all()
            self._cond.wait_for(lambda: row in self._results or self._abort)
            if self._abort:
                raise _Aborted
            return self._results.pop(row)

    def run(self, envs: Sequence[Env], seeds: Sequence[int], **episode_kwargs) -> tuple[list[Trajectory], dict]:
        b = len(envs)
        if len(seeds) != b:
            raise ValueError(f"BatchedRollout.run: {len(envs)} envs but {len(seeds)} seeds")
        first: dict[int, int] = {}
        for row, env in enumerate(envs):  # (the rows' episodes run side by side: one instance holds one task)
            if id(env) in first:
                raise ValueError(f"BatchedRollout.run: envs[{row}] is the same instance as envs[{first[id(env)]}]: "
                                 "each row needs its own environment (its episode's state: task, steps, done); "
                                 "make one per row, e.g. [make_env(name) for _ in range(n)]")
            first[id(env)] = row
        sampler = MultiTurnSampler(self.model, b, self.capacity, self.cfg)
        self._cond = threading.Condition()
        self._pending, self._results, self._abort = {}, {}, False
        mine = shd.process_rows(b)  # the rows whose episodes run on this process (all of them on one process)
        finished, errors, trajectories = set(), [], [None] * b  # errors: (row, exception) in the order they came
        cached: list[list[int]] = [[] for _ in range(b)]  # what each row's current cache segment holds

        def work(row):
            try:
                trajectories[row] = run_episode(envs[row], seeds[row], _RowPolicy(self, row), self.codec,
                                                **episode_kwargs)
            except _Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 (re-raised by the driver)
                with self._cond:
                    errors.append((row, e))
            finally:
                with self._cond:
                    finished.add(row)
                    self._cond.notify_all()

        if jax.process_count() > 1:  # the same rows everywhere; and the processes' first collective of the run is
            # made while their host work is even (jax's CPU collectives give up when a process joins its first one
            # more than 30 s late, which one process's slow environment would otherwise cause at the first turn)
            rows = [(type(e).__name__, e.name, int(s)) for e, s in zip(envs, seeds)]
            every = shd.gather_objects("BatchedRollout.run: the rows", rows)
            odd = next((p for p, got in enumerate(every) if got != every[0]), None)
            if odd is not None:
                raise ValueError(f"BatchedRollout.run: process {odd} has other rows (environment, seed) than process "
                                 f"0: every process must call run with the same envs and seeds")
        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in mine]
        for t in threads:
            t.start()
        turn, failed = 0, None  # failed: (process, row, "Type: message") of the first failure, on every process
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: len(self._pending) + len(finished - set(self._pending)) >= len(mine))
                    pending = dict(self._pending)
                    self._pending.clear()
                    error = (errors[0][0], f"{type(errors[0][1]).__name__}: {errors[0][1]}") if errors else None
                # every process's waiting rows and first failure (on one process: its own, nothing sent)
                every = shd.gather_objects("BatchedRollout: the rows' prompts", (pending, error))
                failed = next(((p, *e) for p, (_, e) in enumerate(every) if e is not None), None)
                if failed:
                    break
                pending = {row: req for got, _ in every for row, req in got.items()}
                if not pending:
                    break
                pieces, live = [[] for _ in range(b)], [False] * b
                for row, (prompt, _) in pending.items():
                    if prompt[:len(cached[row])] != cached[row] or not cached[row]:
                        if cached[row]:
                            sampler.restart(row)
                        cached[row] = []
                    pieces[row] = prompt[len(cached[row]):]
                    live[row] = True
                # the step takes as many cache slots as its longest piece: when it does not fit, the rows with the
                # longest pieces (a row that restarted prefills its whole context again) get an empty completion
                # (run_episode: "context full") until the others fit; before, one such row emptied every row's turn
                for row in sorted(pending, key=lambda r: (-len(pieces[r]), r)):
                    if sampler.fits(pieces):
                        break
                    pieces[row], live[row] = [], False
                if any(live):
                    # a row's episode keeps at most its own limit (run_episode: max_new_tokens, the context room):
                    # the sampled ids past it are not trained on
                    limits = [pending[row][1] if row in pending else 0 for row in range(b)]
                    outs = sampler.step(pieces, live, jax.random.fold_in(jax.random.key(self.seed), turn), limits)
                    turn += 1
                else:  # the shared cache is full: these rows' completions are empty (run_episode: "context full")
                    outs = [[] for _ in range(b)]
                with self._cond:
                    for row, (prompt, limit) in pending.items():
                        cached[row] = prompt + outs[row]
                        if row in mine:
                            self._results[row] = outs[row][:limit]
                    self._cond.notify_all()
        finally:  # (the episodes still waiting end: a failure here or on another process, or an exception)
            with self._cond:
                self._abort = True
                self._cond.notify_all()
            for t in threads:
                t.join(timeout=60)
        if failed:
            p, row, text = failed
            own = next((e for r, e in errors if r == row), None) if p == jax.process_index() else None
            where = f" on process {p}" if jax.process_count() > 1 else ""
            raise RuntimeError(f"episode of row {row} ({envs[row].name or type(envs[row]).__name__}, seed "
                               f"{seeds[row]}) failed{where}: {text}") from own
        if jax.process_count() > 1:  # every row's trajectory on every process (rewards and batch use them all);
            # process_map's blocks are `mine`: each process sends the trajectories of its own rows
            trajectories = shd.process_map("BatchedRollout: the trajectories",
                                           lambda row: portable(trajectories[row], envs[row]), range(b))
        return trajectories, jax.device_get(sampler.layout())


def portable(t: Trajectory, env: Env) -> Trajectory:
    """`t` as it can travel to the other processes (pickle): a value of its `info` (what the environment returned:
    data) that does not survive a pickle round trip becomes its repr; an `instance` (the environment's own task
    object, which language_consistency reads) that does not is an error of the environment: a ValueError naming it."""
    import pickle

    def travels(v) -> bool:
        try:
            pickle.loads(pickle.dumps(v))
            return True
        except Exception:  # noqa: BLE001
            return False

    def text(v) -> str:
        try:
            return repr(v)
        except Exception as e:  # noqa: BLE001 (data: never a crash)
            return f"<{type(v).__name__}: repr failed: {type(e).__name__}>"

    if not travels(t.instance):
        raise ValueError(f"{env.name or type(env).__name__}: its task instance ({type(t.instance).__name__}) does "
                         "not survive a pickle round trip: on several processes each process runs its own rows' "
                         "episodes and sends their trajectories, instance included, to the others")
    if travels(t.info):
        return t
    return dataclasses.replace(t, info={k: v if travels(v) else text(v) for k, v in t.info.items()})
