"""Which GPU each rank uses: ``mpishard train --device cuda`` and ``mpishard info``.

Every rank of a node sees the node's GPUs (or those ``CUDA_VISIBLE_DEVICES``
shows it) and takes ``local rank % GPUs``: with 4 ranks and 4 GPUs on a node,
one each; with 2 ranks on 1 GPU, both share it; under Slurm with
``--gpus-per-task=1`` each task sees one device and takes it. ``--gpu-index``
overrides the rule ([`mpishard.backend.gpu_for_rank`][mpishard.backend.gpu_for_rank]). CuPy is
imported only here, when a GPU is asked for.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from types import ModuleType

from ..backend import gpu_for_rank
from .communicator import FlatComm
from .nodes import node_map

__all__ = ["GpuChoice", "choose_gpu", "gpu_map"]


@dataclass(frozen=True)
class GpuChoice:
    """One rank's device: its index among the devices it sees, their number,
    the rank's place on its node, why this device, and the device's name."""

    world_rank: int
    host: str
    local_rank: int
    device: int
    visible: int
    why: str
    name: str

    def describe(self) -> str:
        return (f"rank {self.world_rank} on {self.host} (local {self.local_rank}): GPU "
                f"{self.device} of {self.visible}, {self.name} ({self.why})")


def _cupy() -> ModuleType:
    """CuPy with at least one device, or RuntimeError saying what is missing."""
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(f"CuPy is not installed ({exc}); install the cupy-cuda12x or "
                           f"cupy-cuda13x wheel that matches the CUDA driver, or use "
                           f"--device cpu") from None
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:   # CUDARuntimeError: no driver, no device
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RuntimeError(f"CuPy sees no CUDA device ({first}); use --device cpu") from None
    if count < 1:
        raise RuntimeError("CuPy sees no CUDA device; use --device cpu")
    return cupy


def _local_rank(world: FlatComm) -> int:
    """This rank's place among the ranks of its node. Collective over ``world``."""
    nodes = node_map(world)
    return nodes.ranks_on(nodes.node_of[world.rank]).index(world.rank)


def choose_gpu(world: FlatComm, index: int | None = None) -> tuple[ModuleType, GpuChoice]:
    """Make this rank's GPU CuPy's current device; return CuPy and the choice.
    Collective over ``world`` (the node map), then local.

    Raises:
        RuntimeError: CuPy is missing, sees no device, or ``index`` is not one of
            this rank's devices (on the ranks where it is so: the caller agrees).
    """
    local = _local_rank(world)
    cupy = _cupy()
    visible = int(cupy.cuda.runtime.getDeviceCount())
    try:
        device, why = gpu_for_rank(local, visible, index,
                                   os.environ.get("CUDA_VISIBLE_DEVICES"))
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None
    cupy.cuda.Device(device).use()
    name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return cupy, GpuChoice(world.rank, socket.gethostname(), local, device, visible, why, name)


def gpu_map(world: FlatComm) -> list[str] | str:
    """Each rank's GPU as [`choose_gpu`][mpishard.comm.choose_gpu] would choose it (one line per
    rank, on every rank), or why there is none (the lowest such rank's reason).
    Collective over ``world``; makes no device current."""
    local = _local_rank(world)
    try:
        cupy = _cupy()
        visible = int(cupy.cuda.runtime.getDeviceCount())
        device, why = gpu_for_rank(local, visible, None, os.environ.get("CUDA_VISIBLE_DEVICES"))
        name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        mine: str | tuple[str] = GpuChoice(world.rank, socket.gethostname(), local, device,
                                           visible, why, name).describe()
    except (RuntimeError, ValueError) as exc:
        mine = (f"rank {world.rank} on {socket.gethostname()}: {exc}",)
    every = world.allgather(mine)
    problems = [m[0] for m in every if isinstance(m, tuple)]
    return problems[0] if problems else every
