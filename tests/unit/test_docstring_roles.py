"""No Sphinx roles in mpishard's docstrings: the API pages are rendered by mkdocstrings.

mkdocstrings reads Google-style Markdown docstrings, so a reStructuredText role
(``:class:`~mpishard.x.Y```) is printed raw on the API pages. A reference to an object is
written as an autorefs link instead, ``[`Y`][mpishard.x.Y]`` (an identifier the API pages
render; ``mkdocs build --strict`` fails on one they do not), or as plain ``code`` for a
name no page renders. This test reads the source (no import, no build), so a new role
fails at once; scripts/test.sh also greps the built site for them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "mpishard"

ROLE = re.compile(r":(class|meth|attr|func|mod|data|exc|obj|const):`")


def docstrings(tree: ast.AST):
    """(line, text) of every docstring: a string that is a statement of its own (the
    module's, a class's, a function's, and an attribute's after its assignment)."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            yield node.lineno, node.value.value


def test_no_sphinx_roles_in_docstrings():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for line, text in docstrings(ast.parse(path.read_text(), str(path))):
            for m in ROLE.finditer(text):
                row = line + text.count("\n", 0, m.start())
                found.append(f"mpishard/{rel}:{row}: {text[m.start():m.start() + 60]!r}")
    assert not found, (
        f"{len(found)} Sphinx role(s) in docstrings, printed raw by mkdocstrings; write "
        "[`Name`][mpishard.module.Name] (a rendered identifier) or plain `code`:\n"
        + "\n".join(found))

