"""The ``mpishard`` command: ``info``, ``train``, ``ckpt inspect`` and ``ckpt verify``,
``plot``, ``plan`` and ``run``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from .errors import UsageError

__all__ = ["environment_info", "main"]


def environment_info() -> dict[str, object]:
    """What this process sees: MPI library, world size, h5py, CuPy, CUDA-awareness."""
    import numpy

    from . import __version__

    # Imported here, not at the top: importing mpishard.comm initialises MPI, and
    # only the commands that run as MPI ranks may (``mpishard run`` starts mpirun).
    from .comm import cuda_aware_reason, mpi_library_info, reproducibility_info, waiting

    info: dict[str, object] = {
        "mpishard": __version__,
        **mpi_library_info(),
        "numpy": numpy.__version__,
        "threads_per_rank": os.environ.get("OMP_NUM_THREADS", "unset"),
        # How untimed waits wait (comm/waiting.py; docs/install.md, "Waiting ranks").
        "waits": "nap" if waiting.naps() else "spin",
    }
    try:
        import h5py

        info["h5py"] = h5py.__version__
        info["hdf5"] = h5py.version.hdf5_version
        info["h5py_mpi"] = bool(h5py.get_config().mpi)
    except ImportError:
        info["h5py"] = None
        info["h5py_mpi"] = False
    info["checkpoint_driver"] = _checkpoint_driver(int(info.get("world_size", 1)))
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
    # What a reproducible run's bits depend on (docs/guide/reproducible.md).
    info["reproducibility"] = reproducibility_info()
    return info


def _checkpoint_driver(size: int) -> str:
    """The driver ``save_checkpoint(driver="auto")`` uses at ``size`` ranks, and why."""
    from .checkpoint.collective import DRIVER_ENV, resolve_driver

    named = os.environ.get(DRIVER_ENV, "").strip()
    why = f"{DRIVER_ENV}={named}" if named else f"{DRIVER_ENV} unset"
    try:
        return f"{resolve_driver('auto', size)} ({why})"
    except (ValueError, ImportError) as exc:
        return f"none: {exc}"


def _info(args: argparse.Namespace) -> int:
    from .comm import from_comm, gpu_map, node_map, world_rank  # initialises MPI

    info = environment_info()
    # The node map and the GPU of each rank: collective over the job (every rank
    # runs `mpishard info`).
    world = from_comm(None, "world")
    nodes = node_map(world)
    gpus = gpu_map(world)
    if world_rank() != 0:
        return 0
    if args.json:
        print(json.dumps({**info, "node_map": nodes.as_dict(), "gpu_map": gpus}))
        return 0
    info["nodes"] = nodes.describe()
    if isinstance(gpus, str):
        info["gpu_map"] = f"none: {gpus}"
    section = info.pop("reproducibility")
    width = max(len(k) for k in [*info, *section])
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    if not isinstance(gpus, str):
        print(f"{'gpu_map':<{width}}  --device cuda uses, by rank:")
        for line in gpus:
            print(f"{'':<{width}}    {line}")
    print("reproducibility (what the bits of reproducible=True depend on):")
    for key, value in section.items():
        print(f"  {key:<{width}}  {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .commands import add_plot_parser, add_train_parser

    parser = argparse.ArgumentParser(prog="mpishard")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser("info", help="print the MPI, HDF5 and GPU environment")
    info.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    info.set_defaults(func=_info)
    add_train_parser(sub)
    _add_ckpt_parser(sub)
    add_plot_parser(sub)
    from .commands.plan import add_plan_parser

    add_plan_parser(sub)
    from .launch.command import add_run_parser

    add_run_parser(sub)
    # Plain text (argparse prints it as it is), naming every subcommand added above.
    parser.description = (f"The mpishard command: {', '.join(sub.choices)}. "
                          f"mpishard COMMAND --help says more of each.")
    return parser


def _ckpt_inspect(args: argparse.Namespace) -> int:
    from .checkpoint import inspect_checkpoint
    from .errors import CheckpointError

    try:
        report = inspect_checkpoint(args.file, verify=not args.no_verify)
    except (CheckpointError, FileNotFoundError) as exc:
        print(f"mpishard ckpt inspect: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report))
        return 0 if report["ok"] else 1
    lay, data = report["layout"], report["data"]
    rows = [
        ("file", f"{report['path']} ({report['bytes']} bytes)"),
        ("format", f"mpishard-checkpoint v{report['format_version']}, kind {report['kind']}, "
                   f"written by mpishard {report['library_version']} at {report['created']}"),
        ("step", f"{report['step']} (epoch {report['epoch']})"),
        ("layout", f"world {lay['world_size']}: dp {lay['dp']}, tp {lay['tp']}, pp {lay['pp']}, "
                   f"strategy {lay['strategy']}"),
        ("parameters", f"{report['parameters']} {report['dtype']}"),
    ]
    if report["optimizer"] is not None:
        hyper = {k: v for k, v in report["optimizer"].items() if k != "name"}
        rows.append(("optimizer", f"{report['optimizer']['name']} {json.dumps(hyper)}; state "
                                  f"{', '.join(report['state_names']) or '(none)'}"))
    if report["schedule"] is not None or report["lr"] is not None:
        rows.append(("schedule", f"{json.dumps(report['schedule'])}, lr {report['lr']} at "
                                 f"step {report['step']}"))
    if data is not None:
        rows.append(("data", f"epoch {data['epoch']}, {data['samples_consumed']} of "
                             f"{data['num_samples']} samples consumed, batch {data['batch_size']}, "
                             f"seed {data['seed']}, shuffle {data['shuffle']}"))
    arch = report["architecture"]
    if arch is not None:   # version 1 lists {"type", "args"} layers; 2 is {"class", "args"}
        given = arch.get("args", {})
        layers = arch.get("layers", given.get("layers"))
        detail = (", ".join(x.get("class", x.get("type")) for x in layers) if layers
                  else ", ".join(f"{k}={json.dumps(v)}" for k, v in given.items()))
        rows.append(("architecture", f"{arch['class']}: {detail}"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    tensors = report["tensors"]
    name_w = max((len(t["path"]) for t in tensors), default=4)
    shape_w = max((len(str(tuple(t["shape"]))) for t in tensors), default=5)
    print(f"tensors ({len(tensors)}):")
    for t in tensors:
        status = {True: "ok", False: "CHECKSUM MISMATCH", None: "not verified"}[t["verified"]]
        print(f"  {t['path']:<{name_w}}  {str(tuple(t['shape'])):<{shape_w}}  {t['dtype']:<7}  "
              f"{t['checksum'][0]}:{t['checksum'][1]}  {status}")
    bad = sum(t["verified"] is False for t in tensors)
    if args.no_verify:
        print("checksums: not verified (--no-verify)")
    else:
        print(f"checksums: {len(tensors) - bad} of {len(tensors)} verified"
              + (f", {bad} MISMATCHED" if bad else ""))
    return 0 if report["ok"] else 1


def _ckpt_verify(args: argparse.Namespace) -> int:
    from .checkpoint import verify_checkpoint
    from .errors import CheckpointError

    failed = 0
    for path in args.files:
        try:
            info = verify_checkpoint(path)
        except (CheckpointError, FileNotFoundError) as exc:
            failed += 1
            print(f"FAIL  {exc}")
            continue
        print(f"OK    {info.path}: step {info.step}, {len(info.tensors)} tensors, "
              f"checksums verified")
    return 1 if failed else 0


def _add_ckpt_parser(sub: argparse._SubParsersAction) -> None:
    """``mpishard ckpt inspect FILE`` and ``mpishard ckpt verify FILE...``: one process,
    no MPI job needed."""
    ckpt = sub.add_parser("ckpt", help="look into checkpoint files")
    actions = ckpt.add_subparsers(dest="action", required=True)
    inspect = actions.add_parser("inspect", help="list what a checkpoint holds and verify it")
    inspect.add_argument("file")
    inspect.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    inspect.add_argument("--no-verify", action="store_true",
                         help="do not read the data to recompute the checksums")
    inspect.set_defaults(func=_ckpt_inspect)
    verify = actions.add_parser("verify", help="check files completely; exit 1 if any is bad")
    verify.add_argument("files", nargs="+", metavar="FILE")
    verify.set_defaults(func=_ckpt_verify)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        # train parses its own flags: a bad one is one line on rank 0, not
        # argparse's usage text from every rank.
        from .commands import train_main

        return train_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        # Every rank finds the same problem in the same arguments: only rank 0
        # says it, and no rank is left waiting in a collective.
        from .comm import world_rank  # initialises MPI: see environment_info

        if world_rank() == 0:
            print(f"mpishard: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
