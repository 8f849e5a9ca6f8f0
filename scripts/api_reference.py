"""Write docs/api.md, the API reference, from the public names' docstrings.

    .venv/bin/python scripts/api_reference.py          # rewrite docs/api.md
    .venv/bin/python scripts/api_reference.py --check  # exit 1 if it is not current

Each public module's ``__all__`` in order; for a class its constructor's
signature, its docstring, then each public method and property (inherited ones
from the library included) with its signature and docstring. Written with
``inspect`` rather than Sphinx or pdoc: the reference is one Markdown page that
lives in the repository, is read on GitHub, and is checked to be current by
``tests/test_api_reference.py``, which needs no extra dependency.
"""

from __future__ import annotations

import mpishard  # noqa: F401  (first: BLAS threads are limited before NumPy loads)

# isort: split
import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "api.md"

#: The modules a user imports from, in the order of the README.
MODULES = [
    "mpishard",
    "mpishard.strategies",
    "mpishard.nn",
    "mpishard.optim",
    "mpishard.data",
    "mpishard.checkpoint",
    "mpishard.models",
    "mpishard.train",
    "mpishard.comm",
    "mpishard.comm.hierarchical",
    "mpishard.comm.ulfm",
    "mpishard.parallel.recovery",
    "mpishard.parallel.replicas",
    "mpishard.parallel.shardcopy",
    "mpishard.reprosum",
    "mpishard.errors",
]

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
_MODULE = re.compile(r"<module '([\w.]+)' from '[^']*'>")
_CLASS = re.compile(r"<class '([\w.]+)'>")


def _plain(text: str) -> str:
    """A repr without what differs between machines and runs (paths, addresses)."""
    return _CLASS.sub(r"\1", _MODULE.sub(r"\1", _ADDRESS.sub("", text)))


def _signature(obj) -> str:
    try:
        return _plain(str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return "(...)"


def _doc(obj) -> str:
    doc = inspect.getdoc(obj)
    return doc.strip() if doc else "(no docstring)"


def _definer(cls, name: str):
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    return cls


def _members(cls, documented: dict[type, str]) -> tuple[list[tuple[str, object]],
                                                         dict[str, list[str]]]:
    """Public methods and properties of ``cls`` defined by the library: those to
    show in full, and the names inherited from another documented class, by it."""
    out, inherited = [], {}
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        raw = inspect.getattr_static(cls, name)
        target = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
        if isinstance(target, property):
            owner = getattr(target.fget, "__module__", "") or ""
        elif inspect.isfunction(target):
            owner = target.__module__ or ""
        else:
            continue
        if not owner.startswith("mpishard"):
            continue
        definer = _definer(cls, name)
        if definer is not cls and definer in documented:
            inherited.setdefault(documented[definer], []).append(name)
        else:
            out.append((name, raw))
    return out, inherited


def _class(qual: str, cls, documented: dict[type, str]) -> list[str]:
    lines = [f"### class `{qual}{_signature(cls)}`", "", _doc(cls), ""]
    members, inherited = _members(cls, documented)
    for base, names in inherited.items():
        lines += [f"Inherited from `{base}`: " + ", ".join(f"`{n}`" for n in names) + ".", ""]
    for name, raw in members:
        if isinstance(raw, property):
            lines += [f"#### `{qual}.{name}` (property)", "", _doc(raw), ""]
        else:
            func = getattr(cls, name)
            lines += [f"#### `{qual}.{name}{_signature(func)}`", "", _doc(func), ""]
    return lines


def render() -> str:
    lines = ["# API reference", "",
             "Generated from the docstrings by `scripts/api_reference.py` (do not edit; "
             "run it after changing a public docstring or signature: "
             "`tests/test_api_reference.py` checks that this page is current).", ""]
    documented: dict[type, str] = {}
    for modname in MODULES:
        module = importlib.import_module(modname)
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name, None)
            if inspect.isclass(obj) and obj not in documented:
                documented[obj] = f"{modname}.{name}"
    for modname in MODULES:
        module = importlib.import_module(modname)
        lines += [f"## `{modname}`", "", _doc(module).split("\n\n")[0], ""]
        for name in getattr(module, "__all__", []):
            if name.startswith("__"):
                continue
            obj = getattr(module, name)
            where = f"{modname}.{name}"
            if inspect.isclass(obj):
                lines += _class(where, obj, documented)
            elif inspect.isfunction(obj):
                lines += [f"### `{where}{_signature(obj)}`", "", _doc(obj), ""]
            else:
                lines += [f"### `{where}`", "", f"`{_plain(repr(obj))}`", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with docs/api.md instead of writing it")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is not current: run .venv/bin/python scripts/api_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
