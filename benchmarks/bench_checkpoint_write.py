"""The synchronous checkpoint write against file-per-process POSIX writes and ``numpy.save``.

Run it under mpirun at each size of job; one JSON line per measurement::

    mpirun -n 2 python benchmarks/bench_checkpoint_write.py --sizes 256MiB,1GiB

For each size S (parameters + Adam's two state vectors, float32; a ZeRO-2
state filled with random numbers, as in ``bench_checkpoint.py``), with and
without fsync (``durable``), side by side, alternating (the order rotates from
one repeat to the next), ``--repeats`` times:

* ``checkpoint``: ``save_checkpoint`` by every rank into one new HDF5 file
  (the default driver, or ``--drivers``: each is a column of its own);
* ``async_wait``: ``save_checkpoint(..., asynchronous=True)`` then
  ``wait_for_checkpoint()``: the background writer's path, waited for;
* ``file_per_process``: every rank writes the same bytes as its share of the
  checkpoint (its ranges of the parameters and of both state vectors) into a
  file of its own, with ``os.pwrite`` in 16 MiB pieces, then ``fsync`` when
  durable: the file system's speed for this job, the bound the single file is
  measured against (``vs_fpp`` = file-per-process time / checkpoint time);
* ``numpy_save``: rank 0 alone writes the three whole vectors with
  ``numpy.save`` (fsynced when durable), the others wait.

Every kind writes new files while the previous run's are still there, as a
training job does; those are removed afterwards, untimed. Dirty pages are
flushed (``os.sync``, untimed) before each run, so that no run pays for
another's write-back. Times are the slowest rank's (a barrier before and
after); min and median of the repeats are printed; GB/s are 1e9 bytes of S per
second.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

# The sizes, the model and the timing of the read/write benchmark, shared.
from bench_checkpoint import emit, empty, fresh_folder, numpy_save, parse_size, sharded_state, timed
from mpi4py import MPI

from mpishard.checkpoint import save_checkpoint, wait_for_checkpoint

WORLD = MPI.COMM_WORLD
PIECE = 16 << 20


def file_per_process(path: str, arrays: list[np.ndarray], durable: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        at = 0
        for a in arrays:
            raw = memoryview(a.reshape(-1).view(np.uint8))
            for k in range(0, len(raw), PIECE):
                piece = raw[k:k + PIECE]
                while len(piece):
                    n = os.pwrite(fd, piece, at)
                    piece, at = piece[n:], at + n
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def writers(folder: str, model: Any, zero2: Any, mine: list[np.ndarray],
            whole: list[np.ndarray], drivers: list[str],
            durable: bool) -> dict[str, Callable[[int], Any]]:
    """The kinds of write compared, each a function of the repeat's number."""
    rank = WORLD.rank
    kinds: dict[str, Callable[[int], Any]] = {}
    for d in drivers:
        kinds[f"checkpoint_{d}"] = lambda k, d=d: save_checkpoint(
            os.path.join(folder, f"ckpt-{d}-{k % 2}.h5"), model, zero2, driver=d,
            durable=durable)
    kinds["async_wait"] = lambda k: (save_checkpoint(
        os.path.join(folder, f"async-{k % 2}.h5"), model, zero2, durable=durable,
        asynchronous=True), wait_for_checkpoint())
    kinds["file_per_process"] = lambda k: file_per_process(
        os.path.join(folder, f"fpp-{k % 2}-{rank}.bin"), mine, durable)
    kinds["numpy_save"] = lambda k: numpy_save(folder, whole, durable, k) if rank == 0 \
        else None
    return kinds


def stats(xs: list[float]) -> dict[str, float]:
    return {"min": round(min(xs), 4), "median": round(statistics.median(xs), 4)}


def bench(size: int, folder: str, repeats: int, drivers: list[str],
          only: list[str] | None = None) -> None:
    n_ranks, rank = WORLD.size, WORLD.rank
    layout, _, model, zero2 = sharded_state(size)
    lo, hi = zero2.shard.start, zero2.shard.stop
    mine = [model.params[lo:hi]] + [v[:hi - lo] for v in zero2.state.values()]
    whole = ([model.params] + [np.empty(layout.size, dtype=np.float32)] * 2
             if rank == 0 else [])   # numpy.save's bytes: the state's values do not matter
    nbytes = 3 * layout.size * 4
    gb = nbytes / 1e9
    save_checkpoint(os.path.join(folder, "warm.h5"), model, zero2, durable=False)
    if rank == 0:
        os.remove(os.path.join(folder, "warm.h5"))

    for durable in (False, True):
        kinds = writers(folder, model, zero2, mine, whole, drivers, durable)
        if only:   # file-per-process is always measured: the reference
            kinds = {k: v for k, v in kinds.items() if k in only or k == "file_per_process"}
        times: dict[str, list[float]] = {name: [] for name in kinds}
        names = list(kinds)
        for k in range(repeats):
            turn = k % len(names)
            for name in names[turn:] + names[:turn]:
                times[name].append(timed(WORLD, lambda run=kinds[name], k=k: run(k), sync=True))
            if rank == 0:   # the previous run's files, untimed
                old = f"-{(k + 1) % 2}"
                for f in os.listdir(folder):
                    if f.rsplit(".", 1)[0].endswith(old) or f"{old}-" in f:
                        os.remove(os.path.join(folder, f))
            WORLD.Barrier()
        fpp = times["file_per_process"]
        others = [name for name in times if name != "file_per_process"]
        emit({"kind": "write", "bytes": nbytes, "ranks": n_ranks, "durable": durable,
              "repeats": repeats,
              **{f"{name}_s": stats(t) for name, t in times.items()},
              **{f"{name}_GBps": round(gb / statistics.median(t), 3)
                 for name, t in times.items()},
              # file-per-process time / this kind's time: 1.0 is the file system's speed
              **{f"{name}_vs_fpp": {"min": round(min(fpp) / min(times[name]), 3),
                                    "median": round(statistics.median(fpp)
                                                    / statistics.median(times[name]), 3)}
                 for name in others}})
    empty(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256MiB,1GiB",
                        help="model + optimizer-state bytes, comma separated")
    parser.add_argument("--folder", default="/tmp/mpishard-bench-checkpoint-write")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--drivers", default="auto",
                        help="save_checkpoint drivers, comma separated: auto, direct, mpio, serial")
    parser.add_argument("--kinds", default="",
                        help="only these kinds, comma separated (checkpoint_auto, async_wait, "
                             "numpy_save; file_per_process always): all by default")
    args = parser.parse_args()
    import h5py

    folder = fresh_folder(args.folder)
    emit({"kind": "environment", "ranks": WORLD.size, "cores": os.cpu_count(),
          "load_1min": round(os.getloadavg()[0], 2), "h5py": h5py.__version__,
          "hdf5": h5py.version.hdf5_version, "h5py_mpi": bool(h5py.get_config().mpi),
          "folder": folder})
    for text in args.sizes.split(","):
        bench(parse_size(text.strip()), folder, args.repeats, args.drivers.split(","),
              [k for k in args.kinds.split(",") if k])
    if WORLD.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
