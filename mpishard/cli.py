"""The ``mpishard`` command: ``info`` (and more subcommands as they arrive)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

__all__ = ["environment_info", "main"]


def environment_info() -> dict[str, object]:
    """What this process sees: MPI library, world size, h5py, CuPy, CUDA-awareness."""
    from mpi4py import MPI

    import numpy

    from . import __version__
    from .comm.cuda import cuda_aware_reason

    info: dict[str, object] = {
        "mpishard": __version__,
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
        "mpi_standard": "%d.%d" % MPI.Get_version(),
        "mpi4py": __import__("mpi4py").__version__,
        "world_size": MPI.COMM_WORLD.Get_size(),
        "numpy": numpy.__version__,
        "threads_per_rank": os.environ.get("OMP_NUM_THREADS", "unset"),
    }
    try:
        import h5py

        info["h5py"] = h5py.__version__
        info["hdf5"] = h5py.version.hdf5_version
        info["h5py_mpi"] = bool(h5py.get_config().mpi)
    except ImportError:
        info["h5py"] = None
        info["h5py_mpi"] = False
    try:
        import cupy

        info["cupy"] = cupy.__version__
        try:
            info["gpus"] = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as exc:  # CUDARuntimeError: driver or device missing
            info["gpus"] = 0
            info["gpu_error"] = str(exc).splitlines()[0]
    except ImportError:
        info["cupy"] = None
        info["gpus"] = 0
    aware, why = cuda_aware_reason()
    info["cuda_aware_mpi"] = aware
    info["cuda_aware_reason"] = why
    return info


def _info(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    info = environment_info()
    if MPI.COMM_WORLD.Get_rank() != 0:
        return 0
    if args.json:
        print(json.dumps(info))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpishard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print the MPI, HDF5 and GPU environment")
    info.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    info.set_defaults(func=_info)
    _add_train_parser(sub)
    return parser


class UsageError(Exception):
    """A problem with the command line: one line on rank 0, exit code 2."""


def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train a model on N ranks (mpirun -n N mpishard train)")
    train.add_argument("--strategy", default="ddp", help="ddp or zero2 (default ddp)")
    train.add_argument("--example", default="burgers",
                       help="built-in dataset: burgers (surrogate of the 1-D Burgers equation)")
    train.add_argument("--samples", type=int, default=8192, help="dataset size")
    train.add_argument("--hidden", default="256,256", help="hidden layer widths")
    train.add_argument("--activation", default="gelu", help="relu, gelu or tanh")
    train.add_argument("--optimizer", default="adamw", help="sgd, adam or adamw")
    train.add_argument("--lr", type=float, default=2e-3)
    train.add_argument("--epochs", type=int, default=30)
    train.add_argument("--batch-size", type=int, default=256, help="global batch size")
    train.add_argument("--accumulation-steps", type=int, default=1)
    train.add_argument("--dtype", default="float32", help="float32 or float64")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--metrics", default=None, help="write per-epoch JSON lines here")
    train.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    import numpy as np
    from mpi4py import MPI

    from .config import ShardingConfiguration
    from .examples import burgers_dataset
    from .nn import MLP
    from .optim import get_optimizer
    from .optim.schedules import CosineSchedule
    from .strategies import DDPOptimizer, ZeRO2Optimizer
    from .train import run_training

    strategies = {"ddp": DDPOptimizer, "zero2": ZeRO2Optimizer}
    comm = MPI.COMM_WORLD
    if args.strategy not in strategies:
        raise UsageError(f"unknown strategy {args.strategy!r}: choose one of {', '.join(strategies)}")
    if args.example != "burgers":
        raise UsageError(f"unknown example {args.example!r}: the built-in one is 'burgers'")
    if args.dtype not in ("float32", "float64"):
        raise UsageError(f"--dtype must be float32 or float64, got {args.dtype!r}")
    try:
        hidden = [int(h) for h in args.hidden.split(",") if h]
    except ValueError:
        raise UsageError(f"--hidden must be comma-separated integers, got {args.hidden!r}") from None
    if args.batch_size % (comm.size * args.accumulation_steps):
        raise UsageError(
            f"--batch-size {args.batch_size} does not split across {comm.size} ranks x "
            f"{args.accumulation_steps} micro-batches; use a multiple of "
            f"{comm.size * args.accumulation_steps}")
    dtype = np.dtype(args.dtype)
    x, y = burgers_dataset(args.samples + 1024, seed=args.seed, dtype=dtype)
    train_data, validation = (x[:-1024], y[:-1024]), (x[-1024:], y[-1024:])
    model = MLP([x.shape[1], *hidden, y.shape[1]], activation=args.activation, loss="mse",
                dtype=dtype, seed=args.seed)
    steps = args.epochs * (args.samples // args.batch_size)
    try:
        optimizer = get_optimizer(args.optimizer, lr=args.lr)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    strategy = strategies[args.strategy](
        optimizer, ShardingConfiguration(comm), model=model,
        accumulation_steps=args.accumulation_steps,
        schedule=CosineSchedule(total_steps=steps, warmup_steps=min(100, steps // 10)))
    rank0 = comm.rank == 0
    if rank0:
        print(f"mpishard train: {args.strategy} on {comm.size} rank(s), MLP {model.params.size:,} "
              f"parameters, Burgers surrogate, {args.samples} samples, batch {args.batch_size}")
    from .train import evaluate

    start_loss = evaluate(model, *validation)
    result = run_training(strategy, model, train_data, args.epochs, args.batch_size,
                          seed=args.seed, metrics_path=args.metrics, validation=validation)
    final_loss = evaluate(model, *validation)
    strategy.verify_in_sync()
    memory = comm.gather(strategy.memory_report()["total"], root=0)
    if rank0:
        print(f"done: validation loss {start_loss:.4f} -> {final_loss:.5f} "
              f"({start_loss / final_loss:.0f}x lower) in {result.seconds:.1f} s, "
              f"{result.samples_per_second:,.0f} samples/s")
        print("memory per rank (MiB): " + ", ".join(f"{m / 2**20:.1f}" for m in memory))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        # Every rank finds the same problem in the same arguments: only rank 0
        # says it, and no rank is left waiting in a collective.
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"mpishard: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
