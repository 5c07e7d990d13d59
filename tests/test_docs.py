"""The documentation runs as written: README.md's and docs/*.md's code blocks that are marked runnable.

Marking convention (an HTML comment, which GitHub does not render, on the line right before a fenced block):

    <!-- runnable -->            the block runs in `make test`
    <!-- runnable: heavy -->     the block runs in `make test-heavy` (40 s or more on 2 CPU cores)

followed by a fence of ```python or ```bash (anything else is an error). Per page and per kind (fast / heavy), the
marked blocks run in document order in ONE subprocess of this interpreter (the repository's venv), in a fresh
temporary directory that stands in for the repository root: it holds copies of configs/, tools/, bench/ and
tests/fixtures/, never the repository itself, so nothing is written into the tree. Python blocks share one
namespace and bash blocks run with `bash -euo pipefail`, so a block may use the names and the files of the blocks
before it; heavy blocks run apart from the fast ones and must stand on their own. In bash blocks `python`,
`dsv32-train`, `dsv32-convert` and `dsv32-plot` are the venv's, TMPDIR is inside the temporary directory, and
JAX_PLATFORMS=cpu. A failing block fails the test, naming its file and line; so does a page that lost all its
marked blocks (nothing is silently tested).

Also checked: README.md stays short (<= 110 lines), and every relative link in README.md, docs/*.md and
BENCHMARKS.md points to a file that exists and, for a markdown file with #anchor, to one of its headings.
tests/test_environments_guide.py runs docs/environments.md's blocks in-process too (and checks the guide's names).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from conftest import child_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# Pages that must keep at least one marked block (fast or heavy).
MUST_RUN = ("README.md", "docs/training.md", "docs/checkpoints.md", "docs/kernels.md", "docs/agentic.md",
            "docs/multihost.md", "docs/environments.md")
LINK_CHECKED = ["README.md", "BENCHMARKS.md"] + [p for p in PAGES if p.startswith("docs/")]
README_MAX_LINES = 110
COPIED = ("configs", "tools", "bench", os.path.join("tests", "fixtures"))  # what the blocks may read, as copies
MARKER = re.compile(r"^<!-- runnable(?P<heavy>: heavy)? -->\s*$")
FENCE = re.compile(r"^(?P<fence>```+|~~~+)\s*(?P<info>[^`]*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int  # line of the block's first code line in the page (1-based)
    lang: str
    heavy: bool
    code: str


def runnable_blocks(page: str) -> list[Block]:
    """The marked blocks of `page` (relative to the repository root), in document order. A marker that is not
    right before a python / bash fence raises ValueError naming the line."""
    lines = open(os.path.join(ROOT, page), encoding="utf-8").read().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if not m:
            i += 1
            continue
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        lang = fence["info"].split()[0] if fence and fence["info"].strip() else None
        if lang not in ("python", "bash"):
            raise ValueError(f"{page}:{i + 1}: a runnable marker must be followed by a ```python or ```bash fence, "
                             f"not {lines[i + 1] if i + 1 < len(lines) else 'the end of the file'!r}")
        end = i + 2
        while end < len(lines) and lines[end].strip() != fence["fence"]:
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{i + 2}: the runnable block is not closed")
        blocks.append(Block(page, i + 3, lang, bool(m["heavy"]), "\n".join(lines[i + 2:end]) + "\n"))
        i = end + 1
    return blocks


ALL_BLOCKS = {page: runnable_blocks(page) for page in PAGES}
FAST_PAGES = [p for p, bs in ALL_BLOCKS.items() if any(not b.heavy for b in bs)]
HEAVY_PAGES = [p for p, bs in ALL_BLOCKS.items() if any(b.heavy for b in bs)]

# Runs the blocks of one page in order: python in one namespace (line numbers in tracebacks are the page's), bash as
# `bash -euo pipefail -c`. Exits non-zero at the first failing block, naming it.
DRIVER = r"""
import json, subprocess, sys, time
namespace = {"__name__": "__main__"}
for b in json.load(open(sys.argv[1], encoding="utf-8")):
    where = f"{b['page']}:{b['line']}"
    print(f"=== {where} ({b['lang']})", flush=True)
    t0 = time.time()
    if b["lang"] == "python":
        exec(compile("\n" * (b["line"] - 1) + b["code"], b["page"], "exec"), namespace)
    else:
        rc = subprocess.run(["bash", "-euo", "pipefail", "-c", b["code"]]).returncode
        if rc:
            sys.exit(f"FAILED: the bash block at {where} exited with {rc}")
    print(f"=== {where}: ok in {time.time() - t0:.1f} s", flush=True)
"""


def run_blocks(blocks: list[Block], workdir, timeout: int) -> str:
    for rel in COPIED:
        shutil.copytree(os.path.join(ROOT, rel), os.path.join(workdir, rel),
                        ignore=shutil.ignore_patterns("__pycache__"))
    os.makedirs(os.path.join(workdir, "tmp"))
    spec = os.path.join(workdir, "tmp", "blocks.json")
    with open(spec, "w", encoding="utf-8") as f:
        json.dump([dataclasses.asdict(b) for b in blocks], f)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH", "VIRTUAL_ENV")}
    env["XLA_FLAGS"] = child_xla_flags()
    env.update(JAX_PLATFORMS="cpu", MPLBACKEND="Agg", PYTHONUNBUFFERED="1", TMPDIR=os.path.join(workdir, "tmp"),
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    t0 = time.time()
    res = subprocess.run([sys.executable, "-c", DRIVER, spec], cwd=workdir, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert res.returncode == 0, f"a runnable block failed (exit {res.returncode}):\n{res.stdout[-8000:]}"
    print("".join(f"\n{line}" for line in res.stdout.splitlines() if line.startswith("=== ") and " ok in " in line))
    print(f"{blocks[0].page}: {len(blocks)} blocks in {time.time() - t0:.1f} s")
    return res.stdout


def test_pages_keep_runnable_blocks():
    """Mutation tried: removing README.md's marker fails here (and leaves no README case to run)."""
    assert sum(map(len, ALL_BLOCKS.values())) > 0, "no runnable block anywhere: nothing would be tested"
    lost = [p for p in MUST_RUN if not ALL_BLOCKS.get(p)]
    assert not lost, f"these pages have no block marked <!-- runnable --> any more: {lost}"


def test_marker_parsing(tmp_path, monkeypatch):
    """The parser takes the fence after the marker and refuses a marker on anything but python / bash."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    (tmp_path / "a.md").write_text("x\n<!-- runnable -->\n```bash\necho 1\n```\n```python\nno()\n```\n"
                                   "<!-- runnable: heavy -->\n```python\nyes()\n```\n")
    assert runnable_blocks("a.md") == [Block("a.md", 4, "bash", False, "echo 1\n"),
                                       Block("a.md", 11, "python", True, "yes()\n")]
    (tmp_path / "b.md").write_text("<!-- runnable -->\n```text\nout\n```\n")
    with pytest.raises(ValueError, match="b.md:1"):
        runnable_blocks("b.md")


@pytest.mark.parametrize("page", FAST_PAGES)
def test_runnable_blocks(page, tmp_path):
    """Mutation tried: a wrong expected value in docs/agentic.md's episode block fails its page, naming the line."""
    run_blocks([b for b in ALL_BLOCKS[page] if not b.heavy], tmp_path, timeout=900)


@pytest.mark.heavy  # training chains, a two-process run, the agent stage: 1-3 min each on 2 cores
@pytest.mark.parametrize("page", HEAVY_PAGES)
def test_runnable_blocks_heavy(page, tmp_path):
    run_blocks([b for b in ALL_BLOCKS[page] if b.heavy], tmp_path, timeout=1200)


def test_failing_block_fails(tmp_path):
    """The runner reports a failing block (bash and python) instead of passing it by."""
    for code, lang in (("true\nfalse\necho after\n", "bash"), ("raise SystemExit(3)\n", "python")):
        with pytest.raises(AssertionError, match="a runnable block failed"):
            run_blocks([Block("x.md", 5, lang, False, code)], tmp_path / lang, timeout=120)


def test_readme_is_short():
    n = len(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move details to docs/"


def _outside_fences(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    out, fence = [], None
    for line in text.split("\n"):
        m = FENCE.match(line.strip())
        if fence is None and m:
            fence = m["fence"]
        elif fence is not None and line.strip() == fence:
            fence = None
        elif fence is None:
            out.append(line)
    return out


def github_anchors(path: str) -> set[str]:
    """The heading anchors GitHub generates for a markdown file: the heading's text in lower case, punctuation
    dropped (code spans keep their text), spaces to hyphens; -1, -2, ... for repeats."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _outside_fences(open(path, encoding="utf-8").read()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m[1].lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_relative_links_resolve():
    """Mutation tried: a link to docs/trainig.md, or to BENCHMARKS.md#grpo-on-gpu, fails."""
    bad = []
    for page in LINK_CHECKED:
        path = os.path.join(ROOT, page)
        for line in _outside_fences(open(path, encoding="utf-8").read()):
            for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
                if not os.path.exists(dest):
                    bad.append(f"{page}: {target} (no {os.path.relpath(dest, ROOT)})")
                elif anchor and dest.endswith(".md") and anchor not in github_anchors(dest):
                    bad.append(f"{page}: {target} (no heading with anchor #{anchor})")
    assert not bad, "broken relative links:\n" + "\n".join(bad)
