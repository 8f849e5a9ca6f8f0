"""What a run shows and records: the bar, the epoch lines and the metrics records.

Only rank 0 writes or prints; nothing here communicates, except the validation
loss at an epoch's end (collective wherever the model's ``forward`` is, and over
the group its rows are shared out over). The
metrics file's records are listed on the docs site's training-loop page.
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import Any

from ..comm import FlatComm
from ..errors import HandOver
from ..protocols import Model
from ..recovery import Recovered
from .evaluate import evaluate
from .options import Reporting
from .progress import Metrics, clock, progress_bar
from .result import TrainResult

__all__ = ["Reporter"]


class Reporter:
    """The bar, lines and metrics records of one ``run_training`` call.

    ``continuing``: the call continues a data position (the metrics file is then
    appended to unless ``append_metrics`` says otherwise).
    """

    def __init__(self, options: Reporting, rank0: bool, result: TrainResult,
                 epochs: int | None, total_steps: int | None, continuing: bool) -> None:
        self.options, self.rank0, self.result = options, rank0, result
        self.epochs, self.total_steps = epochs, total_steps
        self.out = options.out or sys.stdout
        append = continuing if options.append_metrics is None else options.append_metrics
        self.metrics = Metrics(options.metrics_path if rank0 else None, append)
        self.bar = (progress_bar(total_steps, result.first_step, options.label, self.out)
                    if rank0 and options.progress else None)
        self.t_start = time.perf_counter()
        self._window = self._epoch = (self.t_start, 0.0, 0, 0)   # (since, loss, steps, rows)
        self.last_val = (-1, float("nan"))
        self.lost_note = ""   # the next epoch line says that a rank was lost in its epoch

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def start(self, batch_size: int | None, per_epoch: int | None) -> None:
        """The ``start`` record, when the options give one."""
        if self.options.start_record is not None:
            self.metrics.record("start", **self.options.start_record,
                                first_step=self.result.first_step, epochs=self.epochs,
                                batch_size=batch_size, steps_per_epoch=per_epoch,
                                time=datetime.datetime.now().isoformat(timespec="seconds"))

    def step(self, step: int, epoch: int, loss: float, rows: int, lr: float) -> None:
        """After a step: the bar, and a ``step`` record every ``log_every`` steps."""
        since, total, steps, samples = self._epoch
        self._epoch = (since, total + loss, steps + 1, samples + rows)
        if self.bar is not None:
            self.bar.set_postfix_str(   # tqdm puts ", " before it
                f"loss {loss:.4f}, {self.result.samples / self.elapsed():,.0f} samples/s",
                refresh=False)
            self.bar.update(1)
        if not self.metrics.active:
            return
        since, total, steps, samples = self._window
        total, steps, samples = total + loss, steps + 1, samples + rows
        if steps >= self.options.log_every:
            now = time.perf_counter()
            self.metrics.record("step", step=step, epoch=epoch, loss=total / steps, lr=lr,
                                samples_per_s=samples / max(now - since, 1e-9),
                                elapsed_s=now - self.t_start)
            since, total, steps, samples = now, 0.0, 0, 0
        self._window = (since, total, steps, samples)

    def epoch_end(self, epoch: int, step: int, model: Model,
                  group: FlatComm | None = None) -> None:
        """An epoch is complete: its record (with the validation loss, its rows
        shared out over ``group``: [`evaluate`][mpishard.train.evaluate]) and line."""
        now = time.perf_counter()
        since, total, steps, samples = self._epoch
        values: dict[str, Any] = {"epoch": epoch, "step": step, "loss": total / max(steps, 1),
                                  "samples_per_s": samples / max(now - since, 1e-9),
                                  "elapsed_s": now - self.t_start}
        validation = self.options.validation
        if validation is not None:
            values["val_loss"] = evaluate(model, *validation, group=group)
            self.last_val = (step, values["val_loss"])
        self.metrics.record("epoch", **values)
        every = self.options.print_every
        if self.rank0 and every and (epoch % every == 0 or epoch in (1, self.epochs)):
            remaining = (self.total_steps - step) * (now - since) / max(steps, 1)
            val = f"  val {values['val_loss']:.4f}" if validation is not None else ""
            self.say(f"{self.options.label} epoch {epoch:>3}/{self.epochs}  step {step:>5}  "
                     f"loss {values['loss']:.4f}{val}  {values['samples_per_s']:,.0f} "
                     f"samples/s  eta {clock(remaining)}{self.lost_note}")
            self.lost_note = ""
        self._epoch = (time.perf_counter(), 0.0, 0, 0)

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        self.metrics.record("checkpoint", step=step, path=path, reason=reason)

    def recovered(self, event: Recovered, rank0: bool, world_size: int,
                  undone: bool) -> None:
        """The run went on without a lost rank: the record and a line; rank 0 may
        be a new rank now. ``undone``: this rank's means include steps done again."""
        if rank0 and not self.rank0 and self.options.metrics_path:   # rank 0 was lost
            self.metrics = Metrics(self.options.metrics_path, append=True)
        self.rank0 = rank0
        lost = ", ".join(map(str, event.lost_ranks))
        self.lost_note += f"  (lost rank(s) {lost} at step {event.step})"
        self.metrics.record("recovered", **{k: v for k, v in event.record().items()
                                            if k != "event"})
        if rank0 and (self.options.print_every or self.bar is not None):
            self.say(f"{self.options.label} recovered at step {event.step}: lost world "
                     f"rank(s) {lost}, going on with {world_size} ({event.seconds:.2f} s)")
        if undone:   # the epoch's and window's means start again from here
            self._window = self._epoch = (time.perf_counter(), 0.0, 0, 0)

    def hand_over(self, over: HandOver, step: int) -> None:
        """The process ends ([`HandOver`][mpishard.errors.HandOver]): where the job
        stops with it (a non-zero exit), the ``end`` record says why."""
        if over.exit_code != 0:
            self.metrics.record("end", step=step, stopped=over.stopped, reason=str(over))
        self.close()

    def validation_at_end(self, step: int, model: Model,
                          group: FlatComm | None = None) -> float:
        """The validation loss at ``step`` (the last epoch's, when it was then)."""
        validation = self.options.validation
        if validation is None:
            return float("nan")
        if self.last_val[0] == step:
            return self.last_val[1]
        return evaluate(model, *validation, group=group)

    def end(self, step: int) -> None:
        r = self.result
        self.metrics.record("end", step=step, final_loss=r.final_loss, val_loss=r.val_loss,
                            seconds=r.seconds, samples_per_s=r.samples_per_second,
                            stopped=r.stopped, checkpoint=r.checkpoint)

    def say(self, line: str) -> None:
        """A line on rank 0, above the bar when there is one."""
        if self.bar is not None:
            self.bar.write(line, file=self.out)
        else:
            self.out.write(line + "\n")
            self.out.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.metrics.close()
