"""``DDPOptimizer``: every replica holds everything; gradients are averaged."""

from __future__ import annotations

import time
from typing import Any

from ..flat import Range
from ..optim.clip import sum_of_squares
from ..protocols import Model
from .base import DataParallelOptimizer, _nbytes

__all__ = ["DDPOptimizer"]


class DDPOptimizer(DataParallelOptimizer):
    """Distributed data parallel: gradients summed with Allreduce, in buckets.

    Every data-parallel rank holds the full parameters, gradients and optimizer
    state and applies the same update, so the replicas stay identical. The
    gradient vector is cut into buckets of whole layers (``bucket_mb`` MiB) in
    backward order; with the library's models each bucket's non-blocking
    ``Iallreduce`` starts as soon as the backward pass has written it, so
    communication overlaps the rest of the backward. Averaging (1/N) and any
    clipping are folded into the optimizer's update, so they cost no extra pass.

    Args:
        optimizer: the update rule (:mod:`mpishard.optim`).
        config: the layout; data parallel over ``config.groups.dp``.
        model: attach at once (otherwise :meth:`attach` or :meth:`optimize` does).
        bucket_mb: bucket size in MiB.
        accumulation_steps: micro-batches per step; only the last communicates.
        max_grad_norm: clip by the global gradient norm.
        schedule: ``step -> factor`` of the learning rate.
        overlap: start bucket reductions during backward (library models only).

    Example::

        ddp = DDPOptimizer(Adam(lr=1e-3), ShardingConfiguration(comm))
        result = ddp.optimize(model, (x, y), epochs=3, batch_size=256)
    """

    strategy = "ddp"

    def _setup(self) -> None:
        model = self.model
        xp, n, dtype = self.xp, model.params.size, model.params.dtype
        self.state = self.optimizer.init_state(n, dtype, xp)
        # Models that cannot accumulate into their own gradient get a buffer.
        needs_buffer = self.accumulation_steps > 1 and not self._accumulates
        self._accum = xp.zeros(n, dtype=dtype) if needs_buffer else None
        self._next_bucket = 0
        self._syncing = False
        if self.bucketed:
            model.set_backward_hooks(self)

    @property
    def _grad_vector(self) -> Any:
        return self._accum if self._accum is not None else self.model.grads

    # Backward hooks (protocols.BackwardHooks): launch every bucket whose lowest
    # offset the backward has passed; buckets are ordered highest offsets first.
    def before(self, r: Range) -> None:
        pass

    def after(self, lo: int) -> None:
        if not self._syncing:
            return
        buckets = self.buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].start >= lo:
            self._launch(self._next_bucket)
            self._next_bucket += 1
        # Non-blocking collectives only move when MPI is entered: poke them.
        for handle in self._handles:
            handle.test()

    def _launch(self, index: int, blocking: bool = False) -> None:
        b = self.buckets[index]
        if self.dp.size == 1:
            return
        grads = self._grad_vector[b.start:b.stop]
        if blocking:
            # Nothing left to overlap with: the blocking Allreduce is the faster
            # one (Open MPI 4.1's libnbc Iallreduce measured ~2x slower here).
            self.dp.Allreduce(grads, slot=index)
        else:
            self._handles.append(self.dp.Iallreduce(grads, slot=index))

    def _launch_rest(self) -> None:
        """Reduce the buckets the backward pass has not launched, blocking."""
        while self._next_bucket < len(self.buckets):
            self._launch(self._next_bucket, blocking=True)
            self._next_bucket += 1

    def _backward(self, model: Model, x: Any, y: Any, micro: int) -> float:
        self._comm_in_backward = 0.0
        last = not self._no_sync and micro + 1 >= self.accumulation_steps
        self._syncing = last
        self._next_bucket = 0
        if self._accumulates:
            loss = model.forward_backward(x, y, accumulate=micro > 0)
        else:
            loss = model.forward_backward(x, y)
            if self._accum is not None:
                if micro == 0:
                    self._accum[...] = model.grads
                else:
                    self._accum += model.grads
        if last:
            t0 = time.perf_counter()
            self._launch_rest()
            self._comm_in_backward += time.perf_counter() - t0
        self._syncing = False
        return float(loss)

    def _finish_gradients(self) -> None:
        self._wait_all()
        self._launch_rest()   # all micro-batches ran under no_sync(): reduce now

    def _global_sum_of_squares(self) -> float:
        # Every replica holds the same summed gradient: no communication needed.
        return sum_of_squares(self._grad_vector)

    def _update(self, lr: float, grad_scale: float) -> None:
        self.optimizer.update(self.model.params, self._grad_vector, self.state,
                              self.step_count, lr, grad_scale)

    def _memory(self) -> dict[str, int]:
        model = self.model
        grads = model.grads.nbytes + (self._accum.nbytes if self._accum is not None else 0)
        return {"parameters": int(model.params.nbytes), "gradients": int(grads),
                "optimizer_state": _nbytes(self.state.values()), "buffers": 0}

    def synchronize_optimizer_state(self) -> dict[str, Any]:
        """The full optimizer state by name (DDP holds it whole already)."""
        return dict(self.state)

    def optimizer_state_shard(self) -> tuple[Range, dict[str, Any]]:
        """The world range of the optimizer state this rank holds, and the state."""
        return Range(0, self.model.params.size), self.state
