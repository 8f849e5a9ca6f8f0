"""A folder of checkpoints: names by step, the latest found by scanning, the last K kept."""

from __future__ import annotations

import numbers
import os
import re
from typing import Any

from ..errors import CheckpointError
from .background import after_commit, poll_checkpoint, settle, wait_for_checkpoint
from .collective import agree_error
from .container import verify_file
from .format import CheckpointInfo
from .state import Placement, as_strategy, load_checkpoint, save_checkpoint
from .write import TEMP_MARK

__all__ = ["CheckpointManager", "checkpoint_name", "latest_checkpoint", "list_checkpoints"]


def checkpoint_name(prefix: str, step: int) -> str:
    """``<prefix>-<step, 10 digits>.h5``: names sort by step."""
    return f"{prefix}-{int(step):010d}.h5"


def _pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}-(\d+)\.h5$")


def list_checkpoints(folder: str | os.PathLike, prefix: str = "ckpt") -> list[tuple[int, str]]:
    """``(step, path)`` of the complete checkpoints in ``folder``, oldest first.

    Temporary files of saves in progress or interrupted (``*.tmp-*``) are not
    listed: a file has its final name only once every rank finished writing it.
    """
    pattern = _pattern(prefix)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = pattern.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(os.fspath(folder), name)))
    return sorted(found)


def latest_checkpoint(folder: str | os.PathLike, prefix: str = "ckpt", *,
                      verify: bool = False) -> str | None:
    """The path of the checkpoint with the highest step in ``folder``, or None.

    With ``verify``, a file whose seal does not check (size and HDF5 structure,
    not the tensor data) is skipped for the one before it. In this process only.
    """
    for _, path in reversed(list_checkpoints(folder, prefix)):
        if not verify:
            return path
        try:
            verify_file(path)
            return path
        except (CheckpointError, FileNotFoundError):
            continue
    return None


class CheckpointManager:
    """Save to ``folder/<prefix>-<step>.h5``, keep the last ``keep``, resume from the latest.

    Example::

        manager = CheckpointManager("runs/ckpt", keep=3)
        manager.load_latest(model, zero2)            # nothing to do on a fresh start
        zero2.optimize(model, data, epochs=1, batch_size=256)
        manager.save(model, zero2)                   # collective

    Every method that takes a model is collective over the whole job (or
    ``comm`` without a strategy), like [`save_checkpoint`][mpishard.checkpoint.save_checkpoint];
    rank 0 creates the folder, scans it and prunes it.

    ``async_=True``: `save` returns after the snapshot and the file is written in
    the background (`mpishard.checkpoint.background`);
    it appears, and older ones are pruned, only at the commit: the next `save`,
    `poll` once every rank's write is done (the training loop calls it after
    each step), `wait`, or the end of ``optimize()``.
    """

    def __init__(self, folder: str | os.PathLike, keep: int | None = 3, prefix: str = "ckpt",
                 *, driver: str = "auto", durable: bool = True, async_: bool = False) -> None:
        if keep is not None and (not isinstance(keep, numbers.Integral)
                                 or isinstance(keep, bool) or keep < 1):
            raise ValueError(f"keep must be a positive integer or None, got {keep!r}")
        if not prefix or "/" in prefix or os.sep in prefix:
            raise ValueError(f"prefix must be a plain file name part, got {prefix!r}")
        self.folder = os.path.abspath(os.fspath(folder))
        self.keep = None if keep is None else int(keep)
        self.prefix = prefix
        self.driver = driver
        self.durable = durable
        self.async_ = bool(async_)

    def path(self, step: int) -> str:
        return os.path.join(self.folder, checkpoint_name(self.prefix, step))

    def checkpoints(self) -> list[tuple[int, str]]:
        return list_checkpoints(self.folder, self.prefix)

    def latest(self) -> str | None:
        return latest_checkpoint(self.folder, self.prefix)

    def save(self, model: Any, optimizer: Any = None, *, step: int | None = None,
             comm: Any = None) -> str:
        """Save ``model`` and ``optimizer`` (a strategy, or None for the
        parameters only) as ``<prefix>-<step>.h5``, at ``step`` (the strategy's
        ``step_count`` by default), then delete all but the last ``keep``
        checkpoints and any interrupted temporaries. Collective as
        [`save_checkpoint`][mpishard.checkpoint.save_checkpoint]. Returns the path written."""
        comm = Placement.of(model, as_strategy(optimizer), comm).world
        if step is None:
            step = optimizer.step_count if optimizer is not None else 0
        with comm.during(f"CheckpointManager.save of {self.path(step)}"), comm.deadline("io"):
            settle()   # the save in flight first: durable, then pruned (its hook)
            error = None
            if comm.rank == 0:
                try:
                    os.makedirs(self.folder, exist_ok=True)
                    self._remove_temporaries()
                except OSError as exc:
                    error = CheckpointError(f"{self.folder}: cannot create the folder: {exc}")
            agree_error(comm, error)
            path = save_checkpoint(self.path(step), model, optimizer, comm=comm,
                                   driver=self.driver, durable=self.durable,
                                   asynchronous=self.async_)
            if self.async_:
                after_commit(lambda: self._pruned(comm))
            else:
                self._pruned(comm)
        return path

    def poll(self) -> str | None:
        """Commit the save in flight if every rank has written its part, else
        nothing (then prune). Collective over the job (a small ``Allreduce`` while
        a save is in flight). Returns the path committed, or None."""
        return poll_checkpoint()

    def wait(self) -> str | None:
        """Wait for the save in flight and commit it (then prune). Collective over
        the job. Returns the path committed, or None when none was in flight.

        Raises:
            CheckpointError: the save failed on some rank (on every rank).
        """
        return wait_for_checkpoint()

    def _pruned(self, comm: Any) -> None:
        if comm.rank == 0:
            self._prune()
        comm.barrier()   # nobody scans the folder while rank 0 is pruning it

    def load_latest(self, model: Any, optimizer: Any = None, *, comm: Any = None,
                    strict_architecture: bool = True) -> CheckpointInfo | None:
        """Load the latest checkpoint, if there is one (rank 0 scans, all agree),
        as [`load_checkpoint`][mpishard.checkpoint.load_checkpoint] does. Returns its info, or
        None when the folder holds none."""
        comm = Placement.of(model, as_strategy(optimizer), comm).world
        with comm.during(f"CheckpointManager.load_latest from {self.folder}"), \
                comm.deadline("io"):
            settle()
            path = comm.bcast(self.latest() if comm.rank == 0 else None, root=0)
            if path is None:
                return None
            return load_checkpoint(path, model, optimizer, comm=comm,
                                   strict_architecture=strict_architecture)

    def _prune(self) -> None:
        if self.keep is None:
            return
        for _, path in self.checkpoints()[:-self.keep]:
            try:
                os.remove(path)
            except OSError:
                pass   # gone already, or not ours to remove: keeping it is harmless

    def _remove_temporaries(self) -> None:
        # Left by a save that was interrupted (a rank killed): never complete,
        # never listed; they would only fill the disk.
        head = f"{self.prefix}-"
        for name in os.listdir(self.folder):
            if name.startswith(head) and TEMP_MARK in name:
                try:
                    os.remove(os.path.join(self.folder, name))
                except OSError:
                    pass

