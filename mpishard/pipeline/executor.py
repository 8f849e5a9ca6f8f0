"""Running a micro-batch schedule on one pipeline stage, with its neighbours."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..comm import FlatComm, Handle
from .schedules import Action, peak_in_flight, schedule

__all__ = ["PipelineStage"]


class PipelineStage:
    """One stage of a pipeline: a stage model and its place in the ``pp`` group.

    ``run(x, y)`` executes the named schedule for one optimizer step: micro-batch
    ``m`` is rows ``[m * b, (m + 1) * b)`` of the local batch. Activations go
    forward and their gradients back with ``Isend`` (completed at the end of the
    step; a slot's buffers are not touched again before that) and a blocking
    ``Recv`` when an action needs its input, which the schedules order so that
    no stage waits on a stage that waits on it (``tests/unit/test_schedules.py``
    simulates it). Collective over ``pp``.

    The stage model implements the stage API of
    [`LayerStack`][mpishard.nn.LayerStack].
    """

    def __init__(self, model: Any, pp: FlatComm, micro_batches: int, schedule_name: str) -> None:
        self.model = model
        self.pp = pp
        self.micro_batches = micro_batches
        self.schedule_name = schedule_name
        self.stage = pp.rank
        self.stages = pp.size
        self.actions = schedule(schedule_name, pp.size, micro_batches, pp.rank)
        # Micro-batch i uses slot i % slots: the micro-batches in flight on a stage
        # are always a window of consecutive indices no wider than the schedule's
        # peak (m for GPipe, p - stage for 1F1B), so this never collides, and it
        # is what makes 1F1B hold fewer activations than GPipe.
        self.slots = peak_in_flight(self.actions)
        self._recv: dict[tuple[str, int], Any] = {}
        self._sends: dict[tuple[str, int], Handle] = {}
        self._loss_buffer = np.zeros(1)   # the step's loss, broadcast from the last stage
        self._losses = np.zeros(micro_batches)     # run_units: each unit's loss
        self._short: dict[int, list[Action]] = {}   # run_units: passes of fewer units
        self.busy_seconds = 0.0     # time in the stage's own forward/backward
        self.step_seconds = 0.0     # wall time of run()

    # -- buffers ------------------------------------------------------------------
    def _buffer(self, kind: str, micro: int, shape: tuple[int, ...]) -> Any:
        key = (kind, micro)
        buf = self._recv.get(key)
        if buf is None or tuple(buf.shape) != shape:
            buf = self.model.xp.empty(shape, dtype=self.model.dtype)
            self._recv[key] = buf
        return buf

    # -- one step -------------------------------------------------------------------
    def run(self, x: Any, y: Any, *, accumulate: bool = False,
            context: tuple[int, int, int] | None = None, loss_scale: float = 1.0,
            before_backward: Callable[[int], None] | None = None,
            after_backward: Callable[[int], None] | None = None) -> float:
        """Forward and backward of all micro-batches; returns the mean loss of the
        step on every stage (broadcast from the last). Gradients are the sum of
        the micro-batches' (each a mean): the caller scales by ``1/micro_batches``.
        ``context = (step, first row, global batch)`` feeds dropout's masks.
        With ``before_backward``/``after_backward`` (called with the micro-batch's
        index around its backward) no backward accumulates: between them the
        stage's gradient is that micro-batch's alone, for the caller to take
        (hybrid ZeRO-3 reduces it to its shards there, bucket by bucket).

        Raises:
            ValueError: the local batch does not split into ``micro_batches``
                equal micro-batches.
        """
        m, rows = self.micro_batches, len(x)
        if rows % m:
            raise ValueError(f"the local batch of {rows} rows does not split into "
                             f"{m} micro-batches: make each rank's rows (of the batch, "
                             f"per accumulation step) a multiple of {m}, or choose "
                             f"micro_batches dividing {rows}")
        b = rows // m
        context_of = None
        if context is not None:
            step, start, global_size = context
            context_of = lambda i: (step, start + i * b, global_size)  # noqa: E731
        hooks = None if before_backward is None and after_backward is None else \
            (before_backward, after_backward)
        losses = self._run(lambda i: (x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]), m,
                           (b,) + tuple(x.shape[1:]), accumulate, context_of, loss_scale, hooks)
        return self._share_loss(sum(losses) / m)

    def run_units(self, xs: list[Any], ys: list[Any], losses: Any, *,
                  contexts: list[tuple[int, int, int]] | None = None, loss_scale: float = 1.0,
                  before_backward: Callable[[int], None] | None = None,
                  after_backward: Callable[[int], None] | None = None) -> None:
        """One pass of the schedule whose micro-batches are units of equal rows:
        unit ``i`` is ``(xs[i], ys[i])``, at most ``micro_batches`` of them. No
        backward accumulates: from ``after_backward(i)`` until the next unit's
        ``before_backward`` the stage's gradient is unit ``i``'s alone
        (``loss_scale`` times the gradient of its mean loss). ``losses[i]``
        receives each unit's mean loss, on every stage (one ``Bcast`` from the
        last). ``contexts[i] = (step, first row, global batch)`` feeds unit
        ``i``'s dropout masks. Collective over ``pp``.

        Raises:
            ValueError: no units, more than ``micro_batches``, or units of unequal rows.
        """
        count = len(xs)
        b = len(xs[0]) if count else 0
        if not 1 <= count <= self.micro_batches or any(len(v) != b for v in xs):
            raise ValueError(f"expecting 1 to {self.micro_batches} units of equal rows, got "
                             f"{[len(v) for v in xs]}")
        got = self._run(lambda i: (xs[i], ys[i]), count, (b,) + tuple(xs[0].shape[1:]), False,
                        None if contexts is None else contexts.__getitem__, loss_scale,
                        (before_backward, after_backward))
        buf = self._losses
        if self.model.is_last_stage:
            buf[:count] = got
        if self.stages > 1:
            self.pp.Bcast(buf[:count], root=self.stages - 1, slot="unit-losses")
        losses[:count] = buf[:count]

    def _run(self, piece: Callable[[int], tuple[Any, Any]], m: int,
             batch_shape: tuple[int, ...], accumulate: bool,
             context_of: Callable[[int], tuple[int, int, int]] | None, loss_scale: float,
             hooks: tuple[Callable[[int], None] | None, Callable[[int], None] | None] | None
             ) -> list[float]:
        """The schedule of ``m`` micro-batches, micro-batch ``i`` being
        ``piece(i)`` (of ``batch_shape``, its batch context ``context_of(i)``);
        each one's mean loss (on the last stage; empty elsewhere)."""
        t_start = time.perf_counter()
        model = self.model
        actions = self.actions if m == self.micro_batches else self._actions_for(m)
        first, last = model.is_first_stage, model.is_last_stage
        prev, nxt = self.stage - 1, self.stage + 1
        losses: list[float] = []
        backward_done = 0
        before, after = hooks if hooks is not None else (None, None)
        for kind, i in actions:
            k = i % self.slots
            if kind == "F":
                if first:
                    inp = piece(i)[0]
                else:
                    inp = self._buffer("act", k, model.stage_input_shape(batch_shape))
                    self.pp.Recv(inp, source=prev, tag=2 * i, slot=("act", k))
                self._wait_send("out", k)      # the slot's output buffer is rewritten
                t0 = time.perf_counter()
                if context_of is not None and hasattr(model, "set_batch_context"):
                    model.set_batch_context(*context_of(i))
                out = model.forward_stage(inp, micro=k)
                if last:
                    # loss_scale: gradients of loss_scale x the mean (the loss stays the mean).
                    losses.append(model.loss(piece(i)[1], micro=k, scale=loss_scale))
                self.busy_seconds += time.perf_counter() - t0
                if not last:
                    self._sends[("out", k)] = self.pp.Isend(out, dest=nxt, tag=2 * i,
                                                            slot=("out", k))
            else:
                grad = None
                if not last:
                    grad = self._buffer("grad", k, model.stage_output_shape(batch_shape))
                    self.pp.Recv(grad, source=nxt, tag=2 * i + 1, slot=("grad", k))
                self._wait_send("dx", k)
                if before is not None:
                    before(i)
                t0 = time.perf_counter()
                # Units (hooks given) never accumulate: each one's gradient alone.
                dx = model.backward_stage(grad, micro=k, accumulate=hooks is None and (
                    accumulate or backward_done > 0))
                backward_done += 1
                self.busy_seconds += time.perf_counter() - t0
                if after is not None:
                    after(i)
                if not first:
                    self._sends[("dx", k)] = self.pp.Isend(dx, dest=prev, tag=2 * i + 1,
                                                           slot=("dx", k))
        for handle in self._sends.values():
            handle.wait()
        self._sends.clear()
        self.step_seconds += time.perf_counter() - t_start
        return losses

    def _actions_for(self, m: int) -> list[Action]:
        """This stage's actions for a pass of ``m`` micro-batches (fewer than
        ``micro_batches``: the slots of the full pass suffice), made once."""
        actions = self._short.get(m)
        if actions is None:
            actions = self._short[m] = schedule(self.schedule_name, self.stages, m, self.stage)
        return actions

    def _wait_send(self, kind: str, slot: int) -> None:
        handle = self._sends.pop((kind, slot), None)
        if handle is not None:
            handle.wait()

    def activation_bytes(self) -> int:
        """Activation memory of this stage: its slots' workspaces and receive buffers."""
        held = sum(int(b.nbytes) for b in self._recv.values())
        return held + int(getattr(self.model, "activation_bytes", lambda: 0)())

    def forward(self, x: Any) -> Any:
        """Inference through the whole pipeline; the output on every stage.

        Not on the training path (it allocates): for evaluation and ``predict``.
        """
        model = self.model
        if model.is_first_stage:
            h = x
        else:
            h = model.xp.empty(model.stage_input_shape(tuple(x.shape)), dtype=model.dtype)
            self.pp.Recv(h, source=self.stage - 1, tag=0, slot="infer")
        out = model.forward(h)   # a new array; the full logits on the last stage
        if not model.is_last_stage:
            self.pp.Isend(out, dest=self.stage + 1, tag=0, slot="infer-out").wait()
        shape = self.pp.bcast(tuple(out.shape) if model.is_last_stage else None,
                              root=self.stages - 1)
        result = out if model.is_last_stage else model.xp.empty(shape, dtype=model.dtype)
        self.pp.Bcast(result, root=self.stages - 1, slot="infer-result")
        return result

    def _share_loss(self, loss: float) -> float:
        if self.stages == 1:
            return loss
        buf = self._loss_buffer
        buf[0] = loss if self.model.is_last_stage else 0.0
        self.pp.Bcast(buf, root=self.stages - 1, slot="loss")
        return float(buf[0])
