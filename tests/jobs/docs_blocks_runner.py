"""Run the Python programs of one docs page, one after another, in one process per rank.

    mpirun -n N python docs_blocks_runner.py SPEC.json     # blocks of N ranks
    python docs_blocks_runner.py --one-process SPEC.json   # blocks of one process

``SPEC.json`` holds ``{"folder": ..., "programs": [{"id": ..., "source": ...}]}``.
Each program runs as ``__main__`` in a fresh module, in a folder of its own
(``folder/<index>``), and each rank writes ``folder/<index>.<rank>.json``
(``{"status": "ok" | "failed", "output": ...}``, the output being what the
program printed through ``sys.stdout`` and ``sys.stderr``). The ranks meet at a
barrier between programs. A program that fails ends the job
(``MPI_Abort``: the other ranks may be waiting for it in a collective);
``tests/jobs/test_docs_blocks.py`` then runs it, and every program after it,
alone. Only the standard library, mpi4py and what the programs import.
"""

from __future__ import annotations

import mpishard  # noqa: F401  (first: each rank limits its BLAS threads before NumPy loads)

# isort: split
import contextlib
import faulthandler
import io
import json
import os
import sys
import traceback
import types
from pathlib import Path

__all__ = ["main"]


def _run(source: str, name: str) -> tuple[str, str]:
    """Run ``source`` as ``__main__``; its status and what it printed."""
    module = types.ModuleType("__main__")
    module.__file__ = name
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = module
    out = io.StringIO()
    status = "ok"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compile(source, name, "exec"), module.__dict__)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            status = "failed"
            out.write(f"SystemExit({exc.code!r})\n")
    except BaseException:
        status = "failed"
        out.write(traceback.format_exc())
    finally:
        sys.modules["__main__"] = saved
        # A program's watchdog (mpishard.comm.stuck.watch) must not fire in the next one.
        faulthandler.cancel_dump_traceback_later()
    return status, out.getvalue()


def main(argv: list[str]) -> int:
    one_process = argv[:1] == ["--one-process"]
    spec = json.loads(Path(argv[-1]).read_text())
    folder = Path(spec["folder"])
    world = None
    if not one_process:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
    rank = 0 if world is None else world.Get_rank()
    for index, program in enumerate(spec["programs"]):
        where = folder / str(index)
        where.mkdir(parents=True, exist_ok=True)
        if world is not None:
            world.Barrier()
        os.chdir(where)
        status, output = _run(program["source"], f"<{program['id']}>")
        (folder / f"{index}.{rank}.json").write_text(
            json.dumps({"status": status, "output": output}))
        if status != "ok":
            sys.stderr.write(f"[docs blocks] {program['id']} failed on rank {rank}\n{output}")
            sys.stderr.flush()
            if world is not None:
                world.Abort(1)
            return 1
    if world is not None:
        world.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
