"""Every Python block of README.md runs as written.

The conventions, which README.md states under "Using the library":

* Each ```` ```python ```` block is a program, run in a fresh temporary folder.
* A block whose first line is ``# continues the block above`` is appended to the
  block before it: the chain runs once, as one program.
* A chain runs under ``mpirun -n 2`` (conftest's :func:`mpirun`), unless the HTML
  comment right before its first block says ``<!-- mpirun -n N -->`` (another
  number of ranks) or ``<!-- one process -->`` (plain ``python``).
* ``<!-- not run: REASON -->`` right before a block keeps it out, with the reason
  shown as the skip message; such marks are rare, and a test checks that the
  reason is not empty.

The extractor is ours (forty lines) rather than ``pytest-markdown-docs`` or
``phmdoctest``: neither runs a block under ``mpirun``, and blocks of this README are
MPI programs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import REPO, mpi_env, mpirun

pytestmark = pytest.mark.launch

README = REPO / "README.md"
CONTINUES = "# continues the block above"
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*(mpirun -n (\d+)|one process|not run:(.*?))\s*-->\s*$")


@dataclass
class Chain:
    """Blocks that run as one program."""

    line: int                     # README line of the first block's fence
    ranks: int                    # 0: plain python, one process
    skip: str | None = None       # the reason, when not run
    blocks: list[tuple[int, str]] = field(default_factory=list)   # (first line, source)

    def program(self) -> str:
        parts = []
        for line, source in self.blocks:
            parts.append(f"# ---- README.md line {line}\n{source}")
        return "\n".join(parts)


def readme_chains(text: str) -> list[Chain]:
    """The Python programs of a README, by the conventions above.

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
                    raise ValueError(f"README.md line {start + 1}: a block that continues "
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
                        raise ValueError(f"README.md line {start}: 'not run:' needs a reason")
                chains.append(Chain(start + 1, ranks, skip, [(start + 1, source)]))
        i = j + 1
    return chains


CHAINS = readme_chains(README.read_text())


def test_the_extractor_follows_the_conventions():
    text = "\n".join([
        "```python", "a = 1", "```",
        "```python", CONTINUES, "assert a == 1", "```",
        "<!-- one process -->", "```python", "b = 2", "```",
        "<!-- mpirun -n 4 -->", "```python", "c = 3", "```",
        "<!-- not run: needs a GPU -->", "```python", "import cupy", "```",
        "```bash", "echo not python", "```",
    ])
    chains = readme_chains(text)
    assert [(c.line, c.ranks, c.skip, len(c.blocks)) for c in chains] == [
        (1, 2, None, 2), (9, 0, None, 1), (13, 4, None, 1), (17, 2, "needs a GPU", 1)]
    assert "assert a == 1" in chains[0].program()
    with pytest.raises(ValueError, match="continues"):
        readme_chains("\n".join(["```python", CONTINUES, "```"]))
    with pytest.raises(ValueError, match="reason"):
        readme_chains("\n".join(["<!-- not run: -->", "```python", "x = 1", "```"]))


def test_few_blocks_are_left_out():
    assert len(CHAINS) >= 6
    assert sum(c.skip is not None for c in CHAINS) <= 2, [c.line for c in CHAINS if c.skip]


@pytest.mark.parametrize("chain", CHAINS, ids=[f"line{c.line}" for c in CHAINS])
def test_readme_block_runs(chain: Chain, tmp_path: Path, monkeypatch):
    if chain.skip:
        pytest.skip(f"README.md line {chain.line}: {chain.skip}")
    script = tmp_path / f"readme_line{chain.line}.py"
    script.write_text(chain.program())
    monkeypatch.chdir(tmp_path)
    if chain.ranks == 0:   # as a user runs it: python script.py
        proc = subprocess.run([sys.executable, str(script)], env=mpi_env(), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=300)
        code, output = proc.returncode, proc.stdout
    else:
        code, output, _ = mpirun(chain.ranks, [str(script)], timeout=300)
    assert code == 0, (f"README.md block at line {chain.line} failed "
                       f"({chain.ranks or 1} rank(s)):\n{output[-6000:]}")
