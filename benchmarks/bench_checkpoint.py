"""Checkpoint write and read throughput beside ``numpy.save`` / ``numpy.load`` of the same bytes.

Run it under mpirun at several sizes of job; it prints one JSON line per measurement::

    mpirun -n 4 python benchmarks/bench_checkpoint.py --sizes 256MiB,1GiB --folder /tmp/ckbench

For each size S (parameters + Adam's two state vectors, float32, so the
parameters are S/3) a model of 8 layers is trained by nobody: its parameters and
a ZeRO-2 optimizer state are filled with random numbers, then

* ``write``: ``save_checkpoint`` by all ranks into a new file (the previous one
  stays until the next run has written, as in training), against ``numpy.save`` of the three
  full vectors by rank 0 alone (the others wait), both to the same folder,
  alternating, ``--repeats`` times; once without and once with fsync
  (``durable``; numpy's files are fsynced too then). Like for like, numpy writes
  new files too (``ratio``); ``numpy_overwrite`` truncates and rewrites the same
  files instead, reusing their page cache (``ratio_vs_overwrite``);
* ``read``: ``load_checkpoint`` into ZeRO-2 at the writing layout (``plain``), the
  same from a file written by N-1 ranks (``reshard``: every shard boundary moves),
  and ``numpy.load`` of the three vectors by rank 0;
* ``integrity``: the seal (digest of the HDF5 structure, by rank 0) and the
  checksum throughput of one rank.

Times are the slowest rank's (a barrier before and after), the median of the
repeats; GB/s are 1e9 bytes per second of S. Page cache: reads are served from
memory for numpy and HDF5 alike (the files were just written); writes land in
the page cache unless fsynced; dirty pages are flushed (untimed) before each run
so that no run pays for another's write-back, and the three kinds of write take
turns at going first. In a virtual machine whose host backs guest memory lazily
(``first_touch_GBps`` in the first line), page-cache writes are fast only on
pages the guest used recently, which makes non-durable writes of either kind
vary by 10x from run to run there; durable (fsynced) writes are the steadier
comparison on such machines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from mpishard import ShardingConfiguration
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.checkpoint.checksum import run_checksum
from mpishard.checkpoint.container import seal_file, verify_file
from mpishard.flat import ParamLayout
from mpishard.nn import FunctionModel
from mpishard.optim import Adam
from mpishard.strategies import ZeRO2Optimizer

WORLD = MPI.COMM_WORLD
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def parse_size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * factor)
    return int(text)


def layout_for(total_bytes: int, layers: int = 8, width: int = 1024) -> ParamLayout:
    """8 layers of (rows, width) weights and (width,) biases, float32: ~total/3 bytes."""
    elements = total_bytes // (3 * 4)
    rows = max(1, (elements // layers - width) // width)
    layout = ParamLayout()
    for i in range(layers):
        layout.add(f"{i}.weight", (rows, width))
        layout.add(f"{i}.bias", (width,))
    return layout


def unused(params, x, y):   # the benchmark never trains
    raise NotImplementedError


def timed(comm: Any, fn: Callable[[], Any], sync: bool = False) -> float:
    """Seconds of ``fn()`` on the slowest rank. With ``sync``, dirty pages of earlier
    runs are flushed first (untimed), so that no run pays for another's write-back."""
    if sync and comm.rank == 0:
        os.sync()
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    comm.Barrier()
    return time.perf_counter() - t0


def emit(record: dict[str, Any]) -> None:
    if WORLD.rank == 0:
        print(json.dumps(record), flush=True)


def numpy_save(folder: str, arrays: list[np.ndarray], durable: bool, run: int,
               overwrite: bool = False) -> None:
    """``numpy.save`` of each array into new files (the previous run's stay, as a
    checkpoint's previous file does; ``run`` alternates the names), or with
    ``overwrite`` into the same files, truncated and rewritten."""
    new = "numpy" if overwrite else f"numpy-{run % 2}"
    for i, a in enumerate(arrays):
        with open(os.path.join(folder, f"{new}-{i}.npy"), "wb") as f:
            np.save(f, a)
            if durable:
                f.flush()
                os.fsync(f.fileno())


def remove(folder: str, names: list[str]) -> None:
    for name in names:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            os.remove(path)


def numpy_load(folder: str, count: int) -> list[np.ndarray]:
    return [np.load(os.path.join(folder, f"numpy-{i}.npy")) for i in range(count)]


def sharded_state(size: int) -> tuple[ParamLayout, np.ndarray, FunctionModel,
                                      ZeRO2Optimizer]:
    """``layout_for(size)``, its random parameters, the model and a ZeRO-2 Adam over
    WORLD whose state shards are random (rank r's seed r + 1), at step 1000."""
    layout = layout_for(size)
    params = np.random.default_rng(0).standard_normal(layout.size, dtype=np.float32)
    model = FunctionModel(unused, params, layout)
    zero2 = ZeRO2Optimizer(Adam(lr=1e-3), ShardingConfiguration(WORLD),
                           reduce_method="reduce_scatter", model=model)
    shard_rng = np.random.default_rng(WORLD.rank + 1)
    for v in zero2.state.values():
        v[...] = shard_rng.standard_normal(v.size, dtype=np.float32)
    zero2.step_count = 1000
    return layout, params, model, zero2


def fresh_folder(base: str) -> str:
    """``base``/n<ranks>, made empty by rank 0; collective over WORLD."""
    folder = os.path.join(base, f"n{WORLD.size}")
    if WORLD.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    WORLD.Barrier()
    return folder


def empty(folder: str) -> None:
    """Rank 0 removes the files in ``folder`` once every rank is done; collective over WORLD."""
    WORLD.Barrier()
    for name in os.listdir(folder) if WORLD.rank == 0 else ():
        os.remove(os.path.join(folder, name))
    WORLD.Barrier()


def bench(size: int, folder: str, repeats: int) -> None:
    n_ranks, rank = WORLD.size, WORLD.rank
    layout, params, model, zero2 = sharded_state(size)
    full = zero2.synchronize_optimizer_state()
    arrays = [model.params, full["exp_avg"], full["exp_avg_sq"]]
    nbytes = sum(a.nbytes for a in arrays)
    del full
    gb = nbytes / 1e9

    for durable in (False, True):
        # As a training job saves: a new file while the previous one is still
        # there; the previous is deleted afterwards (untimed, for both).
        ck, nps, over = [], [], []
        for k in range(repeats):
            path = os.path.join(folder, f"ckpt-{k % 2}.h5")
            runs = [
                # The lambdas run inside this iteration: binding now is only for clarity.
                (ck, lambda path=path, durable=durable: save_checkpoint(
                    path, model, zero2, durable=durable)),
                (nps, lambda durable=durable, k=k: numpy_save(folder, arrays, durable, k)
                 if rank == 0 else None),
                (over, lambda durable=durable, k=k: numpy_save(folder, arrays, durable, k, True)
                 if rank == 0 else None),
            ]
            # Each goes first in turn: the run right after the previous files were
            # deleted gets their still-warm pages, which matters in a VM (see above).
            for times, run in runs[k % 3:] + runs[:k % 3]:
                times.append(timed(WORLD, run, sync=True))
            if rank == 0:
                remove(folder, [f"ckpt-{(k + 1) % 2}.h5"] +
                       [f"numpy-{(k + 1) % 2}-{i}.npy" for i in range(len(arrays))])
        c, s, o = statistics.median(ck), statistics.median(nps), statistics.median(over)
        emit({"kind": "write", "bytes": nbytes, "ranks": n_ranks, "durable": durable,
              "checkpoint_s": round(c, 4), "checkpoint_GBps": round(gb / c, 3),
              "checkpoint_best_GBps": round(gb / min(ck), 3),
              "numpy_save_s": round(s, 4), "numpy_save_GBps": round(gb / s, 3),
              "numpy_save_best_GBps": round(gb / min(nps), 3),
              "numpy_overwrite_GBps": round(gb / o, 3),
              "ratio": round(s / c, 3), "ratio_vs_overwrite": round(o / c, 3),
              "runs_s": {"checkpoint": [round(t, 3) for t in ck],
                         "numpy": [round(t, 3) for t in nps],
                         "numpy_overwrite": [round(t, 3) for t in over]}})

    # A file written by N-1 ranks: loading it at N moves every shard boundary.
    reshard_path = os.path.join(folder, "ckpt-reshard.h5")
    if n_ranks > 1:
        sub = WORLD.Split(0 if rank < n_ranks - 1 else MPI.UNDEFINED, rank)
        if sub != MPI.COMM_NULL:
            other = FunctionModel(unused, params, layout)
            writer = ZeRO2Optimizer(Adam(lr=1e-3), ShardingConfiguration(sub),
                                    reduce_method="reduce_scatter", model=other)
            for v in writer.state.values():
                v[...] = 1.0
            save_checkpoint(reshard_path, other, writer, durable=False)
            del other, writer
            sub.Free()
        WORLD.Barrier()
    plain, reshard, npl = [], [], []
    for _ in range(repeats):
        plain.append(timed(WORLD, lambda: load_checkpoint(path, model, zero2)))
        if n_ranks > 1:
            reshard.append(timed(WORLD, lambda: load_checkpoint(reshard_path, model, zero2)))
        npl.append(timed(WORLD, lambda: numpy_load(folder, len(arrays)) if rank == 0 else None))
    p, s = statistics.median(plain), statistics.median(npl)
    record = {"kind": "read", "bytes": nbytes, "ranks": n_ranks,
              "plain_s": round(p, 4), "plain_GBps": round(gb / p, 3),
              "numpy_load_s": round(s, 4), "numpy_load_GBps": round(gb / s, 3),
              "plain_vs_numpy": round(s / p, 3)}
    if reshard:
        r = statistics.median(reshard)
        record.update({"reshard_from_ranks": n_ranks - 1, "reshard_s": round(r, 4),
                       "reshard_GBps": round(gb / r, 3), "reshard_vs_plain": round(p / r, 3)})
    emit(record)

    # Integrity: what the seal and the checksums cost.
    if rank == 0:
        import h5py

        with h5py.File(path, "r") as f:
            ub = f.userblock_size
            extents = []
            f.visititems(lambda _, o: extents.append((o.id.get_offset(), o.id.get_storage_size()))
                         if isinstance(o, h5py.Dataset) and o.size else None)
        t0 = time.perf_counter()
        seal_file(path, ub, extents, durable=False)
        t1 = time.perf_counter()
        verify_file(path)
        t2 = time.perf_counter()
        sample = model.params[:min(model.params.size, 64 << 20)]
        t3 = time.perf_counter()
        run_checksum(sample, 0)
        t4 = time.perf_counter()
        emit({"kind": "integrity", "bytes": nbytes, "file_bytes": os.path.getsize(path),
              "seal_s": round(t1 - t0, 5), "verify_seal_s": round(t2 - t1, 5),
              "checksum_GBps_one_core": round(sample.nbytes / (t4 - t3) / 1e9, 2)})
    empty(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256MiB,1GiB",
                        help="model + optimizer-state bytes, comma separated")
    parser.add_argument("--folder", default="/tmp/mpishard-bench-checkpoint")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    import h5py

    folder = fresh_folder(args.folder)
    # Fresh memory is slow to touch in some virtual machines (the host backs guest
    # pages lazily); numpy.load and every loader allocate, so say what it costs here.
    t0 = time.perf_counter()
    np.ones(256 << 20, dtype=np.uint8)
    first_touch = (256 << 20) / (time.perf_counter() - t0) / 1e9
    emit({"kind": "environment", "ranks": WORLD.size, "cores": os.cpu_count(),
          "first_touch_GBps": round(first_touch, 2),
          "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version,
          "h5py_mpi": bool(h5py.get_config().mpi),
          "driver": os.environ.get("MPISHARD_CHECKPOINT_DRIVER", "auto"), "folder": folder})
    for text in args.sizes.split(","):
        bench(parse_size(text.strip()), folder, args.repeats)
    if WORLD.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
