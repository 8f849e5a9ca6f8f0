"""The training loop behind ``mpishard train``: progress on rank 0, metrics, checkpoints, stops.

:func:`run_training` drives a strategy's ``optimize()`` epoch by epoch and, after
every step, decides together with every rank whether to write a checkpoint
(every ``checkpoint_every`` steps), or to stop: at ``max_steps``, or because a
signal arrived (:class:`StopRequest`: ``SIGUSR1`` / ``SIGTERM``, what Slurm sends
before a time limit). A stop writes a checkpoint at that step boundary first,
so a requeued job resumes exactly there.

The metrics file holds one JSON object a line, each with an ``"event"``:
``start``, ``step`` (every ``log_every`` steps: mean loss since the last
record, learning rate, samples/s), ``epoch`` (mean loss of the epoch, the
validation loss), ``checkpoint`` and ``end``. A resumed run appends to it.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

__all__ = ["StopRequest", "TrainingReport", "evaluate", "interactive_output", "run_training"]


@dataclass
class TrainingReport:
    """What :func:`run_training` returns (the same on every rank)."""

    losses: list[float] = field(default_factory=list)   # global mean loss per step run
    first_step: int = 0          # the strategy's step count when the call began
    last_step: int = 0
    epochs_done: int = 0         # complete epochs, counting those before a resume
    samples: int = 0
    seconds: float = 0.0
    val_loss: float = float("nan")   # at the end (nan without validation data)
    stopped: str | None = None   # "SIGUSR1", "SIGTERM", "max_steps"; None: all epochs done
    checkpoint: str | None = None    # the last checkpoint written

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")

    @property
    def final_loss(self) -> float:
        """Mean training loss of the last (up to) 10 steps."""
        return float(np.mean(self.losses[-10:])) if self.losses else float("nan")


class StopRequest:
    """Turn ``signals`` into a request to checkpoint and stop at the next step.

    A handler only sets a flag; :func:`run_training` agrees on it across the
    ranks after each step (any rank that got the signal stops them all), so
    it does not matter whether the launcher signals one rank or every rank.
    Use as a context manager; the previous handlers come back on exit.
    Handlers can only be installed from the main thread; elsewhere this does nothing.
    """

    def __init__(self, signals: tuple[str, ...] = ("SIGUSR1", "SIGTERM")) -> None:
        self.signals = signals
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopRequest":
        import threading

        if threading.current_thread() is threading.main_thread():
            for name in self.signals:
                num = getattr(signal, name)
                self._previous[num] = signal.signal(num, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for num, previous in self._previous.items():
            signal.signal(num, previous)
        self._previous.clear()


class _Stop(Exception):
    """Raised from the step callback to leave ``optimize()`` at a step boundary."""


def interactive_output(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (stdout) reaches a person's terminal.

    Open MPI gives every rank a pseudo-terminal as stdout even when mpirun's
    own output goes to a file, so under mpirun the answer is mpirun's (the
    parent's) stdout; a Slurm batch job writes to a file unless ``srun --pty``.
    """
    stream = stream or sys.stdout
    try:
        if not stream.isatty():
            return False
    except (AttributeError, ValueError):
        return False
    if os.environ.get("SLURM_JOB_ID") and not os.environ.get("SLURM_PTY_PORT"):
        return False
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        try:
            target = os.readlink(f"/proc/{os.getppid()}/fd/1")
        except OSError:
            return False   # a remote daemon's stdout: not a terminal we can see
        return target.startswith(("/dev/pts/", "/dev/tty"))
    return True


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def run_training(strategy: Any, model: Any, data: Any, epochs: int, batch_size: int, *,
                 seed: int = 0, validation: tuple[Any, Any] | None = None,
                 metrics_path: str | None = None, append_metrics: bool = False,
                 progress: bool = False, out: TextIO | None = None,
                 checkpoints: Any = None, checkpoint_every: int = 0,
                 max_steps: int | None = None, stop: StopRequest | None = None,
                 log_every: int = 10, print_every: int = 1, label: str = "train",
                 start_record: dict[str, Any] | None = None) -> TrainingReport:
    """Train until ``epochs`` epochs are complete (counting from epoch 0, so a
    resumed strategy does only what is left), ``max_steps`` is reached, or
    ``stop`` has received a signal. Collective over ``strategy.config.comm``.

    ``data``: arrays ``(x, y)`` or a dataset (``__len__``, ``buffers``,
    ``gather``). ``validation``: ``(x, y)`` every rank evaluates at each
    epoch's end (no communication, except within a model-parallel model).
    ``progress``: a tqdm bar on rank 0 (loss, samples/s, ETA) instead of one
    line per ``print_every`` epochs (and the last). ``checkpoints``: a
    :class:`~mpishard.checkpoint.CheckpointManager`; with it a checkpoint is
    written every ``checkpoint_every`` steps (0: never on the way), at a stop,
    and at the end. ``metrics_path`` (rank 0 writes) gets JSON lines, appended
    to with ``append_metrics``.
    """
    comm = strategy.config.comm
    rank0 = comm.Get_rank() == 0
    out = out or sys.stdout
    n_samples = len(data) if hasattr(data, "gather") else len(data[0])
    per_epoch = max(n_samples // batch_size, 1)
    start_step = strategy.step_count
    total_steps = epochs * per_epoch
    if max_steps is not None:
        total_steps = min(total_steps, max_steps)
    report = TrainingReport(first_step=start_step, last_step=start_step)

    metrics = None
    if rank0 and metrics_path:
        os.makedirs(os.path.dirname(os.path.abspath(metrics_path)), exist_ok=True)
        metrics = open(metrics_path, "a" if append_metrics else "w")

    def record(event: str, **values: Any) -> None:
        if metrics is not None:
            metrics.write(json.dumps({"event": event, **values}) + "\n")
            metrics.flush()

    bar = None
    if rank0 and progress:
        import shutil

        from tqdm import tqdm

        # A rank's pseudo-terminal from mpirun has no size, and tqdm draws
        # nothing on a screen of 0 rows: say 80 x 24 unless the size is known.
        size = shutil.get_terminal_size((80, 24))
        bar = tqdm(total=total_steps, initial=min(start_step, total_steps), unit="step",
                   desc=label, file=out, ncols=min(size.columns, 100),
                   nrows=max(size.lines, 2), leave=True,
                   bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                              "[{elapsed}<{remaining}{postfix}]")

    window: list[float] = []
    # A resumed run has its starting point on disk already.
    saved_at = start_step if start_step > 0 else -1
    t_start = time.perf_counter()
    t_window = t_start

    def epoch_now() -> int:
        return strategy.sampler.state.epoch if strategy.sampler is not None else 0

    def save(reason: str) -> None:
        nonlocal saved_at
        if checkpoints is None or saved_at == strategy.step_count:
            return
        path = checkpoints.save(model, strategy)
        saved_at = strategy.step_count
        report.checkpoint = path
        record("checkpoint", step=strategy.step_count, path=path, reason=reason)

    def on_step(step: int, loss: float) -> None:
        nonlocal t_window
        report.losses.append(loss)
        report.samples += batch_size
        report.last_step = step
        window.append(loss)
        if bar is not None:
            elapsed = time.perf_counter() - t_start
            bar.set_postfix_str(f"loss {loss:.4f}, {report.samples / elapsed:,.0f} samples/s",
                                refresh=False)   # tqdm puts ", " before it
            bar.update(1)
        if len(window) >= log_every:
            now = time.perf_counter()
            record("step", step=step, epoch=epoch_now(), loss=float(np.mean(window)),
                   lr=strategy.current_lr(),
                   samples_per_s=len(window) * batch_size / max(now - t_window, 1e-9),
                   elapsed_s=now - t_start)
            window.clear()
            t_window = now
        reason = None
        if stop is not None:
            # Any rank's signal stops every rank: one tiny Allreduce per step.
            got = stop.received is not None
            if comm.Get_size() > 1:
                got = comm.allreduce(got, op=_lor())
            if got:
                names = comm.allgather(stop.received) if comm.Get_size() > 1 else [stop.received]
                reason = next((n for n in names if n), "signal")
        if reason is None and max_steps is not None and step >= max_steps:
            reason = "max_steps"
        if reason is not None:
            report.stopped = reason
            raise _Stop
        if checkpoint_every and step % checkpoint_every == 0:
            save("interval")

    if start_record is not None:
        record("start", **start_record, first_step=start_step, epochs=epochs,
               batch_size=batch_size, steps_per_epoch=per_epoch,
               time=datetime.datetime.now().isoformat(timespec="seconds"))
    try:
        while epoch_now() < epochs and report.stopped is None:
            if max_steps is not None and strategy.step_count >= max_steps:
                report.stopped = "max_steps"
                break
            before = len(report.losses)
            t_epoch = time.perf_counter()
            try:
                strategy.optimize(model, data, epochs=1, batch_size=batch_size, seed=seed,
                                  callback=on_step)
            except _Stop:
                pass
            if report.stopped is not None and strategy.sampler.state.samples_consumed:
                break   # stopped inside an epoch: no epoch record
            epoch_losses = report.losses[before:]
            seconds = time.perf_counter() - t_epoch
            values = {"epoch": epoch_now(), "step": strategy.step_count,
                      "loss": float(np.mean(epoch_losses)) if epoch_losses else float("nan"),
                      "samples_per_s": len(epoch_losses) * batch_size / max(seconds, 1e-9),
                      "elapsed_s": time.perf_counter() - t_start}
            if validation is not None:
                values["val_loss"] = evaluate(model, *validation)
            record("epoch", **values)
            shown = values["epoch"] % print_every == 0 or values["epoch"] in (1, epochs)
            if rank0 and shown:
                remaining = (total_steps - strategy.step_count) * seconds / max(len(epoch_losses), 1)
                val = f"  val {values['val_loss']:.4f}" if validation is not None else ""
                line = (f"{label} epoch {values['epoch']:>3}/{epochs}  step "
                        f"{strategy.step_count:>5}  loss {values['loss']:.4f}{val}  "
                        f"{values['samples_per_s']:,.0f} samples/s  eta {_clock(remaining)}")
                if bar is not None:
                    bar.write(line, file=out)   # above the bar
                else:
                    out.write(line + "\n")
                    out.flush()
        report.seconds = time.perf_counter() - t_start
        if report.stopped is not None:
            save(report.stopped)
        else:
            save("end")
        report.epochs_done = epoch_now()
        report.val_loss = evaluate(model, *validation) if validation is not None else float("nan")
        record("end", step=strategy.step_count, final_loss=report.final_loss,
               val_loss=report.val_loss, seconds=report.seconds,
               samples_per_s=report.samples_per_second, stopped=report.stopped,
               checkpoint=report.checkpoint)
    finally:
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
    return report


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}:{s:02d}"


def _lor():
    from mpi4py import MPI

    return MPI.LOR


def evaluate(model: Any, x: Any, y: Any, batch: int = 32) -> float:
    """Mean loss of ``model`` on ``(x, y)`` without touching its gradients:
    cross-entropy for integer targets (logits ``(..., classes)``, targets
    ``(...)``, as a GPT's), mean squared error otherwise. Evaluated ``batch``
    rows at a time (a GPT's activations for a whole validation set would take
    hundreds of MiB). Collective wherever the model's ``forward`` is (a tensor-
    or pipeline-parallel model)."""
    total, count = 0.0, 0
    for lo in range(0, len(x), batch):
        prediction = np.asarray(model.forward(x[lo:lo + batch]), dtype=np.float64)
        target = np.asarray(y[lo:lo + batch])
        if np.issubdtype(target.dtype, np.integer):
            prediction = prediction.reshape(-1, prediction.shape[-1])
            target = target.reshape(-1)
            shifted = prediction - prediction.max(axis=1, keepdims=True)
            log_z = np.log(np.exp(shifted).sum(axis=1))
            losses = log_z - shifted[np.arange(len(target)), target]
        else:
            diff = prediction - target.reshape(prediction.shape)
            losses = diff * diff
        total += float(losses.sum())
        count += losses.size
    return total / count if count else float("nan")
