"""Every Python block of the documentation runs as written.

The pages: README.md, CHANGELOG.md, benchmarks/README.md and every page of the
site (``docs/**/*.md``). The conventions, which the site's *Install and quick
start* page states for readers:

* Each ```` ```python ```` block is a program, run in a fresh temporary folder.
* A block whose first line is ``# continues the block above`` is appended to the
  block before it on the same page: the chain runs once, as one program.
* A chain runs under ``mpirun -n 2``, unless the HTML comment right before its
  first block says ``<!-- mpirun -n N -->`` (another number of ranks) or
  ``<!-- one process -->`` (plain ``python``).
* ``<!-- not run: REASON -->`` right before a block keeps it out, with the reason
  shown as the skip message; such marks are rare, and a test checks that the
  reason is not empty.

Speed: the chains of one page that run at the same number of ranks run in one
job (``docs_blocks_runner.py``: one process per rank runs them one after another,
each as ``__main__`` in a folder of its own), which saves a job start and an
import of the library per chain. A failure stays attributable: a chain that
fails there, and every chain the job did not reach, runs again alone, as a user
would run it (``mpirun -n N python block.py``), and that run decides its test.

The extractor is ours (forty lines) rather than ``pytest-markdown-docs`` or
``phmdoctest``: neither runs a block under ``mpirun``, and these blocks are MPI
programs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from mpijobs import REPO, mpi_env, mpirun, mpirun_command

pytestmark = pytest.mark.launch

CONTINUES = "# continues the block above"
RUNNER = Path(__file__).with_name("docs_blocks_runner.py")
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*(mpirun -n (\d+)|one process|not run:(.*?))\s*-->\s*$")
_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
BATCH_TIMEOUT = 600      # seconds for the job of one page's chains at one rank count
ALONE_TIMEOUT = 300      # seconds for one chain run alone


def pages() -> list[Path]:
    """The Markdown pages whose Python blocks run: the site's and the repository's."""
    found = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "benchmarks" / "README.md"]
    found += sorted((REPO / "docs").rglob("*.md"))
    return [p for p in found if p.exists()]


@dataclass
class Chain:
    """Blocks of one page that run as one program."""

    page: str                     # the page, relative to the repository
    line: int                     # line of the first block's fence
    ranks: int                    # 0: plain python, one process
    skip: str | None = None       # the reason, when not run
    blocks: list[tuple[int, str]] = field(default_factory=list)   # (first line, source)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def program(self) -> str:
        return "\n".join(f"# ---- {self.page} line {line}\n{source}"
                         for line, source in self.blocks)


def page_chains(text: str, page: str = "page.md") -> list[Chain]:
    """The Python programs of a page, by the conventions above.

    Raises:
        ValueError: a block continues nothing, or a mark is malformed.
    """
    lines = text.splitlines()
    chains: list[Chain] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if m.group(1) == "python":
            source = "\n".join(lines[start + 1:j]) + "\n"
            mark = _MARK.match(lines[start - 1]) if start > 0 else None
            if source.startswith(CONTINUES):
                if not chains or mark:
                    raise ValueError(f"{page} line {start + 1}: a block that continues "
                                     f"must follow a Python block and carry no mark")
                chains[-1].blocks.append((start + 1, source))
            else:
                ranks, skip = 2, None
                if mark and mark.group(2):
                    ranks = int(mark.group(2))
                elif mark and mark.group(1) == "one process":
                    ranks = 0
                elif mark:
                    skip = mark.group(3).strip()
                    if not skip:
                        raise ValueError(f"{page} line {start}: 'not run:' needs a reason")
                chains.append(Chain(page, start + 1, ranks, skip, [(start + 1, source)]))
        i = j + 1
    return chains


CHAINS = [chain for path in pages()
          for chain in page_chains(path.read_text(), str(path.relative_to(REPO)))]


class Batches:
    """The chains of one page at one rank count, run once in one job; results by chain."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.results: dict[str, list[dict]] = {}   # chain id -> one result per rank
        self.done: set[tuple[str, int]] = set()

    def result(self, chain: Chain) -> list[dict] | None:
        """What each rank said of ``chain`` in its page's job (None: not reached)."""
        key = (chain.page, chain.ranks)
        if key not in self.done:
            self.done.add(key)
            self._run([c for c in CHAINS if (c.page, c.ranks) == key and not c.skip])
        return self.results.get(chain.id)

    def _run(self, chains: list[Chain]) -> None:
        folder = self.folder / re.sub(r"\W", "_", f"{chains[0].page}_{chains[0].ranks}")
        folder.mkdir(parents=True)
        spec = folder / "spec.json"
        spec.write_text(json.dumps({"folder": str(folder), "programs": [
            {"id": c.id, "source": c.program()} for c in chains]}))
        if chains[0].ranks == 0:
            command = [sys.executable, str(RUNNER), "--one-process", str(spec)]
        else:
            command = mpirun_command(chains[0].ranks, str(RUNNER), str(spec), quiet=True)
        # Its own session: on a timeout the whole job (mpirun, the ranks) is killed.
        with open(folder / "job.log", "w") as log:   # for a person who debugs the runner
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                    env=mpi_env(), cwd=folder, start_new_session=True)
            try:
                proc.wait(timeout=BATCH_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        ranks = max(chains[0].ranks, 1)
        for index, chain in enumerate(chains):
            files = [folder / f"{index}.{rank}.json" for rank in range(ranks)]
            if all(f.exists() for f in files):
                self.results[chain.id] = [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def batches(tmp_path_factory) -> Batches:
    return Batches(tmp_path_factory.mktemp("docs-blocks"))


def run_alone(chain: Chain, folder: Path) -> tuple[int, str]:
    """``chain`` as one program, as a user runs it: exit status and output. Run from
    ``folder`` (mpirun's ranks start in the working folder)."""
    script = folder / "block.py"
    script.write_text(chain.program())
    if chain.ranks == 0:   # python block.py
        proc = subprocess.run([sys.executable, str(script)], env=mpi_env(), cwd=folder,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=ALONE_TIMEOUT)
        return proc.returncode, proc.stdout
    code, output, _ = mpirun(chain.ranks, [str(script)], timeout=ALONE_TIMEOUT)
    return code, output


def test_the_extractor_follows_the_conventions():
    text = "\n".join([
        "```python", "a = 1", "```",
        "```python", CONTINUES, "assert a == 1", "```",
        "<!-- one process -->", "```python", "b = 2", "```",
        "<!-- mpirun -n 4 -->", "```python", "c = 3", "```",
        "<!-- not run: needs a GPU -->", "```python", "import cupy", "```",
        "```bash", "echo not python", "```",
    ])
    chains = page_chains(text)
    assert [(c.line, c.ranks, c.skip, len(c.blocks)) for c in chains] == [
        (1, 2, None, 2), (9, 0, None, 1), (13, 4, None, 1), (17, 2, "needs a GPU", 1)]
    assert "assert a == 1" in chains[0].program()
    with pytest.raises(ValueError, match="continues"):
        page_chains("\n".join(["```python", CONTINUES, "```"]))
    with pytest.raises(ValueError, match="reason"):
        page_chains("\n".join(["<!-- not run: -->", "```python", "x = 1", "```"]))


def test_the_pages_have_blocks_and_few_are_left_out():
    assert {c.page for c in CHAINS} >= {"README.md", "docs/guide/data.md"}
    assert len(CHAINS) >= 20
    assert sum(c.skip is not None for c in CHAINS) <= 2, [c.id for c in CHAINS if c.skip]


@pytest.mark.parametrize("chain", CHAINS, ids=[c.id for c in CHAINS])
def test_docs_block_runs(chain: Chain, batches: Batches, tmp_path: Path, monkeypatch):
    if chain.skip:
        pytest.skip(f"{chain.id}: {chain.skip}")
    said = batches.result(chain)
    if said is not None and all(r["status"] == "ok" for r in said):
        return
    monkeypatch.chdir(tmp_path)
    code, output = run_alone(chain, tmp_path)
    assert code == 0, (f"{chain.page}: the block at line {chain.line} failed "
                       f"({chain.ranks or 1} rank(s)):\n{output[-6000:]}")
    if said is not None:   # it failed after the page's earlier blocks, in one process
        warnings.warn(f"{chain.id} failed in its page's job but runs alone: "
                      + next(r["output"] for r in said if r["status"] != "ok")[-2000:],
                      stacklevel=1)


def test_links_outside_the_site_resolve():
    """Relative links of the pages that mkdocs does not build point at files that exist
    (``mkdocs build --strict`` checks the site's own pages, anchors included)."""
    broken = []
    for page in (REPO / "README.md", REPO / "CHANGELOG.md", REPO / "benchmarks" / "README.md"):
        for target, _ in _LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken
