"""The package as a user gets it: build a wheel, install it into a fresh virtualenv (outside the repository), run
the README's runnable Python snippets as written and the console scripts. Slow (a venv install: ~1-2 minutes with a
warm pip cache; needs the package index or a cache)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_snippets() -> list[str]:
    """README.md's Python blocks marked runnable (`<!-- runnable -->` before the fence, tests/test_docs.py's
    convention; test_docs runs them in the repository's venv, this test from the installed wheel)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"^<!-- runnable -->\n```python\n(.*?)^```", f.read(), flags=re.S | re.M)


def test_readme_has_python_snippets():
    assert readme_snippets(), "README.md lost its runnable ```python usage snippet"


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"  # setuptools writes build/ next to the sources: build from a copy of the tracked files
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if os.path.exists(os.path.join(ROOT, rel)):
            os.makedirs(os.path.dirname(src / rel), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), src / rel)
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(src)],
                   check=True, cwd=tmp, capture_output=True)
    (wheel,) = wheels.glob("dsv32_jax-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], cwd=tmp, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp, venv


def run(venv, cwd, *args, timeout=600, rc=0):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["JAX_PLATFORMS"] = "cpu"
    res = subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == rc, f"{args}: {res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res.stdout + res.stderr


@pytest.mark.heavy  # 67 s on 2 cores with the wheel build and install (2026-11-27); was slow and never ran
def test_wheel_install_runs_the_readme_and_the_console_scripts(installed):
    tmp, venv = installed
    py, bindir = str(venv / "bin" / "python"), venv / "bin"
    # nothing of the repository is importable from here: only the installed wheel
    out = run(venv, tmp, py, "-c", "import dsv32_jax, dsv32_jax.train, dsv32_jax.kernels, dsv32_jax.configs; "
              "print(dsv32_jax.__file__)")
    assert "site-packages" in out and ROOT not in out
    for top_level in ("train", "pallas_kernels", "configs"):  # everything lives under the dsv32_jax namespace
        res = subprocess.run([py, "-c", f"import {top_level}"], cwd=tmp, capture_output=True, text=True)
        assert res.returncode != 0 and "ModuleNotFoundError" in res.stderr, top_level
    for i, snippet in enumerate(readme_snippets()):
        path = tmp / f"readme_{i}.py"
        path.write_text(snippet)
        run(venv, tmp, py, str(path))
    for script in ("dsv32-train", "dsv32-convert", "dsv32-plot"):
        assert (bindir / script).exists(), script
    # absl's --help exits 1; it must show the commands
    assert "orbax-to-hf" in run(venv, tmp, str(bindir / "dsv32-convert"), "--help", rc=1)
    assert "--workdir" in run(venv, tmp, str(bindir / "dsv32-train"), "--help", rc=1)
    # the experiment configs ship with the package: the default run needs no repository checkout
    out = run(venv, tmp, str(bindir / "dsv32-train"), "--config.steps=2", "--config.log_every=1",
              "--config.data.seq_len=32", "--config.data.batch_size=2", f"--workdir={tmp / 'run'}",
              "--config.init_from=")
    assert (tmp / "run" / "metrics.jsonl").exists(), out
