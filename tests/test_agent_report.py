"""train/agent_report.py (`make agent-demo`'s closing table and BENCHMARKS.md's seed sweeps): the three greedy
evaluations, the rollouts' success over the first / last window of GRPO steps, the min / median / max over runs,
and workdirs that hold no agentic run named instead of a traceback."""

import json
import os

import numpy as np
import pytest

from dsv32_jax.train import agent_report


def _write_run(path, cold_start: float, end: float, successes, step_s: float = 6.0):
    """A metrics.jsonl as AgentLearner writes it: step 1 carries the start and post-cold-start evaluations, the last
    step the final one; step 2 is logged twice (a resume re-logs it: the last row counts)."""
    os.makedirs(path, exist_ok=True)
    rows = []
    for i, s in enumerate(successes, start=1):
        row = {"step": i, "success": s, "kl": 1e-3 * i, "step_s": step_s}
        if i == 1:
            row.update(start_eval_success=0.0, start_eval_reward=0.0, pre_eval_success=cold_start,
                       pre_eval_reward=cold_start)
        if i == len(successes):
            row.update(eval_success=end, eval_reward=end)
        rows.append(row)
    rows.insert(1, dict(rows[1], success=-1.0))  # a stale copy of step 2, logged before the resumed one
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_summary_and_sweep_table_from_metrics(tmp_path, capsys):
    _write_run(tmp_path / "a", 0.5, 0.75, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    _write_run(tmp_path / "b", 0.9, 1.0, [0.8, 0.9, 1.0, 1.0, 1.0, 1.0], step_s=12.0)
    _write_run(tmp_path / "c", 0.7, 0.5, [0.6, 0.6, 0.6, 0.3, 0.3, 0.3])
    s = agent_report.summarize(agent_report.load(str(tmp_path / "a")), window=2)
    assert (s["start"], s["cold_start"], s["end"], s["end_step"]) == (0.0, 0.5, 0.75, 6)
    np.testing.assert_allclose([s["rollout_first"], s["rollout_last"], s["minutes"], s["kl_end"]],
                               [0.15, 0.55, 0.6, 6e-3])  # the resumed step 2 (0.2) counts, not its stale copy
    agent_report.main([str(tmp_path / r) for r in "abc"] + ["--window=3"])
    lines = capsys.readouterr().out.splitlines()
    cells = {line.split("|")[1].strip(): [float(x) for x in line.split("|")[2:-1]] for line in lines[2:]}
    np.testing.assert_allclose(cells["**min**"], [0.0, 0.5, 0.5, 0.2, 0.3, 0.6])
    np.testing.assert_allclose(cells["**median**"], [0.0, 0.7, 0.75, 0.6, 0.5, 0.6])
    np.testing.assert_allclose(cells["**max**"], [0.0, 0.9, 1.0, 0.9, 1.0, 1.2])
    # the minutes to 0.1 (b: 6 steps x 12 s), the success rates to 0.001
    assert "| **max** | 0.000 | 0.900 | 1.000 | 0.900 | 1.000 | 1.2 |" in lines


def test_paths_without_an_agentic_run_are_named(tmp_path, capsys):
    _write_run(tmp_path / "a", 0.5, 0.75, [0.1, 0.2, 0.3, 0.4])
    (tmp_path / "a.log").write_text("make agent-demo output\n")
    os.makedirs(tmp_path / "running")
    (tmp_path / "running" / "metrics.jsonl").write_text("")
    agent_report.main([str(tmp_path / "a"), str(tmp_path / "a.log"), str(tmp_path / "running")])
    out, err = capsys.readouterr()
    assert "a.log: not a workdir of stage 'agent'" in err and "running: no metrics in" in err
    assert "| after GRPO | 4 | 0.750 | 0.750 |" in out  # the one real run is still reported
    with pytest.raises(SystemExit) as e:
        agent_report.main([str(tmp_path / "a.log")])
    assert e.value.code == 2
    # a JSONL file whose rows are not metrics rows (no "step"): named with its line, not a KeyError traceback
    (tmp_path / "nostep.jsonl").write_text('{"x": 1}\n')
    with pytest.raises(SystemExit):
        agent_report.main([str(tmp_path / "nostep.jsonl")])
    assert "nostep.jsonl, line 1: not a metrics row" in capsys.readouterr().err
    from dsv32_jax.train import plot

    with pytest.raises(SystemExit, match=r"error: .*nostep\.jsonl, line 1: not a metrics row"):
        plot.main([str(tmp_path / "nostep.jsonl")])


def test_metrics_option_tabulates_each_key_from_the_last_row_holding_it(tmp_path, capsys):
    """--metrics=KEY,...: per run the value of each key in the last row that holds it (pre_eval_* from step 1,
    eval_* from the last evaluation, a resumed step's re-logged row over its stale copy), then min / median / max;
    a run without one of the keys is skipped, naming the key."""
    for name, (pre, caps) in {"a": (0.5, [0.1, 0.2]), "b": (0.9, [0.3, 0.7]), "c": (0.7, [0.0, 0.4])}.items():
        _write_run(tmp_path / name, pre, 1.0, [0.1, 0.2, 0.3])
        with open(tmp_path / name / "metrics.jsonl", "a") as f:  # two later evaluations of the small cache
            f.writelines(json.dumps({"step": 3 + i, "eval_success_cap384": c}) + "\n" for i, c in enumerate(caps))
    agent_report.main([str(tmp_path / r) for r in "abc"] + ["--metrics=pre_eval_success, eval_success_cap384"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| run | pre_eval_success | eval_success_cap384 |"
    cells = {line.split("|")[1].strip(): [float(x) for x in line.split("|")[2:-1]] for line in lines[2:]}
    np.testing.assert_allclose([cells[os.path.relpath(tmp_path / r)] for r in "abc"], [[0.5, 0.2], [0.9, 0.7],
                                                                                        [0.7, 0.4]])
    np.testing.assert_allclose(cells["**min**"], [0.5, 0.2])
    np.testing.assert_allclose(cells["**median**"], [0.7, 0.4])
    np.testing.assert_allclose(cells["**max**"], [0.9, 0.7])
    with pytest.raises(SystemExit) as e:
        agent_report.main([str(tmp_path / "a"), str(tmp_path / "b"), "--metrics=pre_eval_success,nope,eval_nope"])
    out, err = capsys.readouterr()
    assert e.value.code == 2
    assert err.count("no row holds nope, eval_nope") == 2 and not out


def test_plot_refuses_an_output_it_cannot_write_before_rendering_and_leaves_no_temporary(tmp_path, monkeypatch):
    """dsv32-plot --out: a directory, or a path under a regular file, was a FileExistsError / IsADirectoryError
    traceback (the directory case after rendering, leaving `<out>.tmp.png`); now one line naming --out, before any
    work. A failure while writing (here the rename) leaves neither the image nor a temporary. Found by an audit."""
    from dsv32_jax.train import plot

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 10}) + "\n"
                                               for s in range(1, 4)))
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    for out, message in ((tmp_path / "dir", r"^error: --out=.*dir is a directory"),
                         (tmp_path / "file" / "c.png", r"^error: --out=.*c\.png: Not a directory")):
        with pytest.raises(SystemExit, match=message):
            plot.main([str(run), f"--out={out}"])
    assert sorted(os.listdir(tmp_path)) == ["dir", "file", "run"] and not os.listdir(tmp_path / "dir")

    def no_rename(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(plot.os, "replace", no_rename)
    with pytest.raises(SystemExit, match=r"^error: --out=.*c\.png: Permission denied$"):
        plot.main([str(run), f"--out={tmp_path / 'c.png'}"])
    assert sorted(os.listdir(tmp_path)) == ["dir", "file", "run"]
    monkeypatch.undo()
    plot.main([str(run), f"--out={tmp_path / 'c.png'}"])
    assert sorted(os.listdir(tmp_path)) == ["c.png", "dir", "file", "run"]
