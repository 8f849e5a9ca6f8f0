"""The reproducible page's example prints the hash the page shows, with the settings
the page states (docs/guide/reproducible.md: the Python block, the command that
ran it, and what it printed: the hash and the reproducibility line).

The bits depend on the BLAS kernels, its threads and NumPy's float64 exp/log
(the page's "Across machines"): the command pins the first two and NumPy's
vector target. Where what this machine then prints differs from the page's
line in anything but Numba's target (which changes no bit), the page claims
nothing for it and the test skips, naming the difference.
"""

from __future__ import annotations

import re

import pytest
from mpijobs import REPO, mpirun

pytestmark = pytest.mark.launch

PAGE = REPO / "docs" / "guide" / "reproducible.md"
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def page_example() -> tuple[str, dict[str, str], list[str]]:
    """The page's first Python block, the variables of the command after it, and
    the lines of the output block after that."""
    blocks = _BLOCK.findall(PAGE.read_text())
    first = next(i for i, (lang, _) in enumerate(blocks) if lang == "python")
    (_, source), (lang, command), (_, printed) = blocks[first:first + 3]
    assert lang == "bash" and "mpirun -n 2" in command, command
    env = dict(re.findall(r"\b([A-Z][A-Z0-9_]*)=(\S+)", command))
    return source, env, printed.strip().splitlines()


def without_numba(line: str) -> str:
    return re.sub(r"; numba .*$", "", line.strip())


def test_the_pages_example_prints_the_pages_hash_with_its_settings(tmp_path):
    source, env, printed = page_example()
    assert env.get("OPENBLAS_CORETYPE") and env.get("OPENBLAS_NUM_THREADS"), env
    assert len(printed) == 2 and printed[1].startswith("BLAS "), printed
    import numpy
    from numpy._core._multiarray_umath import __cpu_features__

    unknown = set(env.get("NPY_DISABLE_CPU_FEATURES", "").split()) - set(__cpu_features__)
    if unknown:
        pytest.skip(f"this NumPy ({numpy.__version__}) does not know the features the "
                    f"page's command turns off: {sorted(unknown)}")
    script = tmp_path / "example.py"
    script.write_text(source)
    code, out, _ = mpirun(2, [str(script)], env=env, timeout=300)
    assert code == 0, out
    lines = [line for line in out.splitlines() if "steps; parameters" in line
             or line.startswith("BLAS ")]
    assert len(lines) == 2, out
    if without_numba(lines[1]) != without_numba(printed[1]):
        pytest.skip(f"this machine computes with other settings than the page's, for "
                    f"which the page states no hash: here '{lines[1]}', on the page "
                    f"'{printed[1]}'")
    assert lines[0] == printed[0], (
        f"same settings ({without_numba(lines[1])}), another hash: {lines[0]!r}, "
        f"the page shows {printed[0]!r}")
