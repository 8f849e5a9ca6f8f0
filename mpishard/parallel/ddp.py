"""``DDPCore``: every replica holds everything; gradients are averaged."""

from __future__ import annotations

from typing import Any

from ..comm import Handle
from ..flat import Range, shard_ranges
from ..protocols import Model
from .base import DataParallelCore, _nbytes

__all__ = ["DDPCore"]


class DDPCore(DataParallelCore):
    """Distributed data parallel: gradients summed with Allreduce, in buckets.

    Every data-parallel rank holds the full parameters, gradients and optimizer
    state and applies the same update, so the replicas stay identical. The
    gradient vector is cut into buckets of whole layers (``bucket_mb`` MiB) in
    backward order; with the library's models and ``overlap=True`` each bucket's
    non-blocking ``Iallreduce`` starts as soon as the backward pass has written it
    (:class:`~mpishard.comm.buckets.GradientBuckets`), so communication overlaps
    the rest of the backward (``overlap="auto"``, the default, does so where a
    stand-in backward measured it faster at attach; otherwise the buckets are
    reduced after the backward). Each rank's gradient is weighted by its rows, and
    averaging (1/rows of the global batch) and any clipping are folded into the
    optimizer's update, so they cost no extra pass.

    Args and options: :class:`~mpishard.parallel.base.DataParallelCore`'s
    (:class:`~mpishard.parallel.base.DataParallelOptions`).

    Example::

        ddp = DDPOptimizer(Adam(lr=1e-3), ShardingConfiguration(comm))
        result = ddp.optimize(model, (x, y), epochs=3, batch_size=256)
    """

    strategy = "ddp"
    public = "DDPOptimizer"

    def _setup(self) -> None:
        model = self.model
        xp, n, dtype = self.xp, model.params.size, model.params.dtype
        self.state = self.optimizer.init_state(n, dtype, xp)
        # Models that cannot accumulate into their own gradient get a buffer
        # (made here for accumulation_steps, on first need for no_sync()).
        needs_buffer = self.accumulation_steps > 1 and not self._accumulates
        self._accum = xp.zeros(n, dtype=dtype) if needs_buffer else None
        self.buckets.vector = self._grad_vector
        if self.bucketed:
            model.set_backward_hooks(self.buckets)
        # The buckets' reduction: over the data group, in two levels (inside the
        # nodes, then across) or as a ring, whichever measured faster at this size.
        self._release()   # attached before
        self.reduction_timings: dict[str, Any] = {}
        self.reducer = (self.dp if self.config.reproducible else
                        self._measured_reducer(self.buckets.largest, dtype, "allreduce",
                                               ring=True))

    @property
    def _grad_vector(self) -> Any:
        return self._accum if self._accum is not None else self.model.grads

    # --- how one bucket is reduced -------------------------------------------
    def _reduce(self, index: int, source: Any, blocking: bool) -> Handle | None:
        if self.dp.size == 1:
            return None
        if blocking:
            self.reducer.Allreduce(source, slot=index)
            return None
        return self.reducer.Iallreduce(source, slot=index)

    # --- one micro-batch --------------------------------------------------------
    def _begin(self, micro: int) -> bool:
        """Start a micro-batch; True when it is the step's last (it communicates)."""
        last = not self._no_sync and micro + 1 >= self.accumulation_steps
        self.buckets.begin(last)
        return last

    def _backward(self, model: Model, x: Any, y: Any, micro: int, rows: int) -> float:
        last = self._begin(micro)
        if self._accumulates and self._accum is None:
            loss = self._forward_backward(model, x, y, micro > 0, rows)
        else:
            if micro > 0 and self._accum is None:
                # no_sync() with a model that overwrites its gradient: keep the sum here.
                self._accum = self.xp.empty_like(model.grads)
                self._accum[...] = model.grads
                self.buckets.vector = self._accum
            loss = self._forward_backward(model, x, y, False, rows)
            if self._accum is not None:
                if micro == 0:
                    self._accum[...] = model.grads
                else:
                    self._accum += model.grads
        if last:
            self._reduce_rest()
        return loss

    def _skip(self, micro: int) -> None:
        last = self._begin(micro)
        if micro == 0:
            self._grad_vector.fill(0)
        if last:
            if self.bucketed:
                # The other ranks' backward launches every bucket non-blocking.
                self.buckets.flush(blocking=False)
            else:
                self._reduce_rest()

    def _reduce_rest(self) -> None:
        """Reduce the buckets the backward pass has not launched, blocking."""
        if not self.bucketed:
            self._check_local(self._grad_vector)
        self.buckets.flush()

    def _finish_gradients(self) -> None:
        self.buckets.wait()
        if not self.buckets.launched_all:
            self._reduce_rest()   # all micro-batches ran under no_sync(): reduce now

    # --- norm and update ----------------------------------------------------------
    def _norm_pieces(self, owned: list[Range]) -> list[Range]:
        # Every replica holds the same reduced gradient: each sums the squares of
        # its 1/N of it, so the check costs 1/N of a pass.
        mine = shard_ranges(self.model.params.size, self.dp.size)[self.dp.rank]
        return [r.intersect(mine) for r in owned]

    def _norm_vector(self) -> Any:
        return self._grad_vector

    def _update(self, lr: float, grad_scale: float) -> None:
        self.optimizer.update(self.model.params, self._grad_vector, self.state,
                              self.step_count, lr, grad_scale)

    # --- reproducible mode ------------------------------------------------------
    def _reduce_words(self, acc: Any) -> None:
        # Integer sums in float64 words: any Allreduce algorithm gives the same bits.
        # (A Reduce_scatter of the words, each rank converting its 1/N and an
        # Allgatherv of the gradient, moves fewer bytes but measured 10-60 % slower
        # with Open MPI 4.1 on one node, and mostly no faster at 4 ranks.)
        self.dp.Allreduce(acc.words, slot="repro-words")

    def _repro_target(self) -> tuple[Any, int, int]:
        return self._grad_vector, 0, self.model.params.size

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
