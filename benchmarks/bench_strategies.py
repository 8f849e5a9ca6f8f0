"""Step time of DDP and ZeRO-2 beside raw mpi4py collectives (and PyTorch DDP).

Run under mpirun; prints one JSON line per measurement on rank 0::

    mpirun -n 2 python benchmarks/bench_strategies.py            # both models
    mpirun -n 2 python benchmarks/bench_strategies.py --models small --steps 30

For each model (float32, Adam, batch 64 per rank) and each strategy it reports the
mean step time split into forward+backward, communication, optimizer and
parameter gather, the samples per second, and, measured in the same run on the
same bytes, a raw ``Allreduce`` (DDP) or ``Reduce_scatter`` + ``Allgatherv``
(ZeRO-2). ``comm_ratio`` is the library's communication time over the raw
collectives', both with overlap switched off so the whole cost is visible (the
library's taken on the rank that reached the collective last, so the other ranks'
compute skew is not counted as communication); the overlapped step's exposed
communication is reported beside it. If PyTorch is
installed, its DDP (gloo backend) trains the same model in the same job.

Set OMP_NUM_THREADS (the script defaults it to cores / ranks) so ranks do not
fight over cores; on a 2-core machine 4 ranks are oversubscribed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_ranks = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
_threads = str(max(1, (os.cpu_count() or 1) // _ranks))
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, _threads)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpishard import ShardingConfiguration  # noqa: E402
from mpishard.comm import FlatComm  # noqa: E402
from mpishard.comm.ring import RingComm  # noqa: E402
from mpishard.flat import shard_ranges  # noqa: E402
from mpishard.nn import MLP  # noqa: E402
from mpishard.optim import Adam  # noqa: E402
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer  # noqa: E402

MODELS = {
    "small": [784, 1024, 1024, 10],            # ~1.9M parameters
    "large": [1024, 4096, 4096, 1024, 10],     # ~25M parameters
}
BATCH_PER_RANK = 64


def emit(record: dict) -> None:
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps(record), flush=True)


def timed(fn, repeats: int, comm: MPI.Comm, prepare=None) -> float:
    """Mean seconds of ``fn`` after one warm-up, the slowest rank's figure.

    ``prepare`` runs before each call, untimed, followed by a barrier.
    """
    fn()
    if prepare is None:
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        mine = (time.perf_counter() - t0) / repeats
    else:
        mine = 0.0
        for _ in range(repeats):
            prepare()
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            mine += time.perf_counter() - t0
        mine /= repeats
    return comm.allreduce(mine, op=MPI.MAX)


def raw_collectives(n: int, comm: MPI.Comm, repeats: int) -> dict:
    """Plain mpi4py on ``n`` float32: what the library's communication is compared to.

    Before each call the buffer is rewritten (untimed), as a backward pass
    rewrites the gradient before every reduction: reducing the same hot buffer
    again and again measured up to 3x faster than that here, which no training
    step sees. The hot-loop figures are reported beside, as ``*_hot_s``.
    """
    buf = np.ones(n, dtype=np.float32)
    rewrite = lambda: buf.fill(1.0)   # noqa: E731
    counts = [len(s) for s in shard_ranges(n, comm.size)]
    recv = np.empty(counts[comm.rank], dtype=np.float32)
    displs = np.concatenate(([0], np.cumsum(counts[:-1]))).tolist()
    def ar():
        comm.Allreduce(MPI.IN_PLACE, buf)

    def rs_ag():
        comm.Reduce_scatter(buf, recv, counts)
        comm.Allgatherv(MPI.IN_PLACE, [buf, (counts, displs)])

    def ar_ag():   # what ZeRO-2 does when Allreduce measured faster
        comm.Allreduce(MPI.IN_PLACE, buf)
        comm.Allgatherv(MPI.IN_PLACE, [buf, (counts, displs)])

    # The same sums as rings of point-to-point messages (mpishard.comm.ring).
    ring = RingComm(FlatComm(comm, "bench"))

    def ring_ar():
        ring.Allreduce(buf)

    def ring_rs_ag():
        ring.Reduce_scatter(buf, recv, counts)
        comm.Allgatherv(MPI.IN_PLACE, [buf, (counts, displs)])

    out = {}
    for name, fn in (("allreduce", ar), ("reduce_scatter_allgather", rs_ag),
                     ("allreduce_allgather", ar_ag), ("ring_allreduce", ring_ar),
                     ("ring_reduce_scatter_allgather", ring_rs_ag)):
        out[f"raw_{name}_s"] = timed(fn, repeats, comm, prepare=rewrite)
        out[f"raw_{name}_hot_s"] = timed(fn, repeats, comm)
    ring.free()
    return out


def run_strategy(cls, sizes, steps: int, comm: MPI.Comm, overlap: bool) -> dict:
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((BATCH_PER_RANK, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], BATCH_PER_RANK)
    model = MLP(sizes, dtype=np.float32, seed=0)
    dist = cls(Adam(lr=1e-4), ShardingConfiguration(comm), model=model, overlap=overlap)
    for _ in range(3):
        dist.train_step(x, y)
    comm.Barrier()
    dist.reset_timings()
    t0 = time.perf_counter()
    for _ in range(steps):
        dist.train_step(x, y)
    total = comm.allreduce((time.perf_counter() - t0) / steps, op=MPI.MAX)
    parts = {f"{k}_s": comm.allreduce(v / steps, op=MPI.MAX) for k, v in dist.timings.items()}
    # The rank that reaches a collective last waits for nobody: its time is the
    # cost of the communication itself, without the other ranks' compute skew.
    for key in ("communication", "gather"):
        parts[f"{key}_min_s"] = comm.allreduce(dist.timings[key] / steps, op=MPI.MIN)
    record = {"step_s": total, **parts,
              "samples_per_s": BATCH_PER_RANK * comm.size / total,
              "memory": dist.memory_report()}
    record["reduction"] = dist.reduction_timings.get("choice", "flat")
    if isinstance(dist, ZeRO2Optimizer):
        record["reduce_method"] = dist.core.reduction.method   # the one "auto" chose
        record["reduce_probe_s"] = dist.reduce_timings
    return record


def run_torch(sizes, steps: int, comm: MPI.Comm) -> dict | None:
    try:
        import torch
        import torch.distributed as tdist
    except ImportError:
        return None
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if not tdist.is_initialized():
        port = comm.bcast(29500 + int(time.time()) % 1000, root=0)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        tdist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    net = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    rng = np.random.default_rng(comm.rank)
    x = torch.from_numpy(rng.standard_normal((BATCH_PER_RANK, sizes[0])).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, sizes[-1], BATCH_PER_RANK))

    def step():
        opt.zero_grad(set_to_none=False)
        loss_fn(net(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    total = timed(step, steps, comm)
    return {"step_s": total, "samples_per_s": BATCH_PER_RANK * comm.size / total,
            "torch": torch.__version__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,large")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    oversubscribed = comm.size > (os.cpu_count() or 1)
    for name in args.models.split(","):
        sizes = MODELS[name]
        n = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
        steps = args.steps if name == "small" else max(5, args.steps // 4)
        base = {"model": name, "sizes": sizes, "parameters": n, "ranks": comm.size,
                "threads_per_rank": int(os.environ["OMP_NUM_THREADS"]),
                "oversubscribed": oversubscribed, "dtype": "float32", "optimizer": "adam",
                "batch_per_rank": BATCH_PER_RANK}
        raw = raw_collectives(n, comm, repeats=steps) if comm.size > 1 else {}
        throughput = {}
        for label, cls in (("ddp", DDPOptimizer), ("zero2", ZeRO2Optimizer)):
            plain = run_strategy(cls, sizes, steps, comm, overlap=False)
            overlapped = run_strategy(cls, sizes, steps, comm, overlap=True)
            throughput[label] = overlapped["samples_per_s"]
            record = {**base, "strategy": label, **overlapped,
                      "no_overlap": {k: v for k, v in plain.items() if k.endswith("_s")}}
            if raw:
                if label == "ddp":
                    raw_s = raw["raw_ring_allreduce_s" if plain["reduction"] == "ring"
                                else "raw_allreduce_s"]
                    ours = plain["communication_min_s"]
                else:
                    raw_s = raw[{"allreduce": "raw_allreduce_allgather_s",
                                 "ring": "raw_ring_reduce_scatter_allgather_s"}.get(
                        plain.get("reduce_method"), "raw_reduce_scatter_allgather_s")]
                    ours = plain["communication_min_s"] + plain["gather_min_s"]
                record.update(raw_s=raw_s, comm_ratio=ours / raw_s, raw=raw)
            emit(record)
        if not args.no_torch:
            torch_record = run_torch(sizes, steps, comm)
            if torch_record is not None:
                ratios = {f"{k}_over_torch": v / torch_record["samples_per_s"]
                          for k, v in throughput.items()}
                emit({**base, "strategy": "torch_ddp_gloo", **torch_record, **ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
