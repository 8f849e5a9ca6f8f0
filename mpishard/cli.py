"""The ``mpishard`` command: ``info`` (and more subcommands as they arrive)."""

from __future__ import annotations

import argparse
import json
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
