"""``ZeRO3Core``: parameters, gradients and optimizer state sharded over the data group."""

from __future__ import annotations

import contextlib
import hashlib
import numbers
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..backend import to_numpy
from ..comm import FlatComm, ulfm
from ..comm.gather import ParameterGather
from ..flat import Range, bucket_ranges, unit_ranges
from ..protocols import BACKWARD, FORWARD, Model, ShardableModel, UnitPassModel
from .zero2 import ZeRO2Core, ZeRO2Options

__all__ = ["ZeRO3Core", "ZeRO3Options"]


@dataclass(frozen=True)
class ZeRO3Options(ZeRO2Options):
    """:class:`~mpishard.parallel.ZeRO2Options` and ZeRO-3's own.

    Attributes:
        prefetch: start gathering the next bucket of parameters (``Iallgatherv``)
            while the layers of the current one compute; False: each bucket is
            gathered (``Allgatherv``) when its first layer needs it, one slot of
            parameters instead of two.
        keep_gathered: keep what a forward gathered for its backward (a slot per
            bucket: the whole vector's memory, one gather per forward, none in
            the backward); False: the backward gathers again what has left its slot.
        gather_mb: size of a bucket of gathered parameters in MiB (whole units:
            a layer larger than this is a bucket of its own); None: ``bucket_mb``.
    """

    prefetch: bool = True
    keep_gathered: bool = False
    gather_mb: float | None = None

    def problem(self) -> str | None:
        for name in ("prefetch", "keep_gathered"):
            if not isinstance(getattr(self, name), bool):
                return f"{name} must be True or False, got {getattr(self, name)!r}"
        mb = self.gather_mb
        if mb is not None and not (isinstance(mb, numbers.Real) and mb > 0):
            return f"gather_mb must be positive or None, got {mb!r}"
        return super().problem()


class ZeRO3Core(ZeRO2Core):
    """ZeRO stage 3: each data-parallel rank keeps 1/N of the parameters too.

    Gradients and optimizer state are ZeRO-2's (:class:`~mpishard.parallel.ZeRO2Core`:
    each bucket reduced to the shards during the backward, the optimizer on the
    shard). The parameters live only as this rank's shard (:meth:`parameter_shard`).
    A :class:`~mpishard.protocols.ShardableModel` (the library's models) reads
    its parameters from a few bucket-sized buffers: just before a layer runs,
    its bucket is gathered from every rank's shard
    (:class:`~mpishard.comm.gather.ParameterGather`, on a duplicate of the data
    group so the gathers keep their own order beside the gradient reductions),
    the next one gathering meanwhile (``prefetch``), and its slot is given to
    a later bucket once read; the backward gathers again what has left its slot
    (or nothing, with ``keep_gathered``). Nothing is gathered after the step:
    the optimizer updates the shard, and the next forward gathers the new values.

    A model without those hooks (a :class:`~mpishard.nn.FunctionModel`, a
    user's model) keeps its whole parameter vector and is trained as ZeRO-2
    does (the vector is ``Allgatherv``-ed after the update, so it is current
    whenever it is read); only its gradients and state are sharded. So does a
    model without parameters (a pipeline stage of activations only): its empty
    vector is all there is, and there is nothing to gather.

    While a model is attached, its ``params`` is None and its ``forward`` is
    collective over ``groups.dp`` (every rank gathers each bucket):
    :meth:`gathered_parameters` gives the whole vector for a while,
    :meth:`unshard` for good.

    Args and options: :class:`~mpishard.parallel.base.DataParallelCore`'s, and
    :class:`ZeRO3Options` (ZeRO-2's, ``prefetch``, ``keep_gathered``, ``gather_mb``).
    """

    strategy = "zero3"
    public = "ZeRO3Optimizer"

    Options = ZeRO3Options

    def __init__(self, optimizer: Any, config: Any = None, *, model: Model | None = None,
                 **options: Any) -> None:
        #: The parameter buckets and their gathers (None: a model without hooks).
        self.gather: ParameterGather | None = None
        #: The gathers' communicator: a duplicate of ``groups.dp``.
        self.gather_comm: FlatComm | None = None
        self._sharded = False     # the model reads its parameters through self.gather
        self._shard_store: Any = None
        self._units: list[Range] = []
        self._model_calls = 0     # forward/backward passes of the model so far
        super().__init__(optimizer, config, model=model, **options)

    # --- setting up -----------------------------------------------------------
    def attach(self, model: Model) -> None:
        """As ZeRO-2's (the whole vector taken from rank 0), then keep only this
        rank's shard: a :class:`~mpishard.protocols.ShardableModel` is bound to
        the gather buffers and its ``params`` becomes None. Collective over
        ``groups.dp``.

        Raises:
            TypeError: not a model (a model whose ``params`` is None is sharded
                by a ZeRO-3 strategy already: :meth:`unshard` it there), or
                parameters that are not float32/float64 1-D arrays (on every rank).
            MpiShardError: the parameter count or dtype differs between ranks.
        """
        super().attach(model)
        if not isinstance(model, ShardableModel) or self.layout.size == 0:
            # ZeRO-2's parameters: the model keeps its vector. (A pipeline stage of
            # activations only has nothing to gather; every rank of its data group
            # holds the same stage, so all of them skip the gathers alike.)
            return
        self._units = unit_ranges(self.layout)
        self._shard_store = self.xp.empty(len(self.shard), dtype=self.dtype)
        self.gather_comm = self.dp.dup(f"{self.dp.name} (parameter gathers)")
        if ulfm.is_on(self.dp):   # a lost rank is seen here too, as on the group
            ulfm.enable([self.gather_comm], evict_stuck=self.dp.evict_stuck)
        gather_mb = self.gather_mb if self.gather_mb is not None else self.bucket_mb
        elements = max(1, int(gather_mb * 2**20) // self.dtype.itemsize)
        self.gather = ParameterGather(
            list(reversed(bucket_ranges(self.layout, elements))), self.shards, self.dp.rank,
            self._shard_store, self.gather_comm, prefetch=self.prefetch,
            keep=self.keep_gathered)
        self.gather.allocate(self.xp, self.dtype)
        self._reshard()
        # The peak counts from here: the whole vector the model came with is gone.
        self._peak_bytes = self._current_bytes()

    def _reshard(self) -> None:
        """Keep this rank's shard of the model's whole vector, bind the model to the
        gather buffers and drop the vector. Local."""
        model, shard = self.model, self.shard
        self._shard_store[...] = model.params[shard.start:shard.stop]
        self._params_shard = self._shard_store
        self.gather.invalidate()
        model.bind_parameters(self.gather.views(self.layout))   # params is None now
        model.set_parameter_hooks(self.gather)
        self._sharded = True

    def _release(self) -> None:
        super()._release()
        if self.gather_comm is not None:
            self.gather_comm.free()
        self.gather_comm = None
        self.gather = None
        self._sharded = False

    def rebuild(self, config: Any) -> None:
        """As :meth:`~mpishard.parallel.DataParallelCore.rebuild`; the parameters
        are resharded over the new group: a model still bound to the gather
        buffers is given its whole vector first (gathered over the old
        ``groups.dp``: call :meth:`unshard` with the values where that group is
        broken). Collective over ``config.world`` (and the old ``groups.dp``)."""
        if self._sharded and self.model is not None and self.model.params is None:
            self.unshard()
        super().rebuild(config)

    # --- the whole vector, for a while or for good ----------------------------------
    def unshard(self, params: Any = None) -> None:
        """Give the model its whole parameter vector back and stop gathering:
        ``params`` (a whole vector, the same on every rank; local), or gathered
        from the shards (collective over ``groups.dp``). The core then trains the
        model as ZeRO-2 does, until :meth:`attach` or :meth:`rebuild` shards it
        again; another strategy may attach it."""
        model = self._require_model()
        if not self._sharded:
            if params is not None:
                model.params[...] = params
            return
        full = self.xp.empty(self.layout.size, dtype=self.dtype)
        if params is None:
            full[self.shard.start:self.shard.stop] = self._params_shard
            if self.dp.size > 1:
                self.dp.Allgatherv(full, self.shard_counts, slot="unshard")
        else:
            full[...] = params
        if params is None:
            self.gather.invalidate()
        else:       # given the values (a recovery): the group may be broken
            self.gather.drop()
        model.set_parameter_hooks(None)
        model.bind_parameters(lambda name: self.layout.view(full, name), full)
        self._params_shard = full[self.shard.start:self.shard.stop]
        self._sharded = False

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[Any]:
        """Within: ``model.params`` is the whole vector (gathered: collective over
        ``groups.dp``), and ``model.forward`` runs on any rank alone; writes to
        it are kept. On exit each rank takes its shard back from it and the
        vector is dropped (local). Yields the vector."""
        model = self._require_model()
        if not self._sharded:
            yield model.params
            return
        self.unshard()
        try:
            yield model.params
        finally:
            self._reshard()

    def parameter_shard(self) -> tuple[Range, Any]:
        """The world range of the parameters this rank holds, and them: its shard
        (the whole vector for a model without hooks). Writes to it are read by the
        next forward. Local."""
        if not self._sharded:
            return super().parameter_shard()
        self.gather.invalidate()     # the caller may write to it
        return self.shard, self._params_shard

    # --- one micro-batch ------------------------------------------------------------
    def backward(self, x: Any, y: Any, *, batch_start: int | None = None,
                 global_rows: int | None = None) -> float:
        gather = self.gather if self._sharded else None
        if gather is None:
            return super().backward(x, y, batch_start=batch_start, global_rows=global_rows)
        waited = gather.seconds
        if self._repro is None:
            loss = super().backward(x, y, batch_start=batch_start, global_rows=global_rows)
        else:
            loss = self._repro_backward(x, y, batch_start, global_rows)
        # Waiting for gathers is communication, not the model's compute (the
        # base class has counted it in forward_backward).
        waited = gather.seconds - waited
        self.timings["gather"] += waited
        self.timings["forward_backward"] -= waited
        return loss

    def _repro_backward(self, x: Any, y: Any, batch_start: int | None,
                        global_rows: int | None) -> float:
        """Reproducible mode runs one pass per unit of rows, and a short last batch
        gives the ranks unequal units: those with fewer join the others' gathers
        without a model, after their own passes. How many is agreed before any
        pass: a pass waits for its gathers, so a rank must not be waiting in
        another collective meanwhile."""
        if isinstance(self.model, UnitPassModel):
            # Its passes are the same on every rank already (_lockstep_passes).
            return super().backward(x, y, batch_start=batch_start, global_rows=global_rows)
        rows = len(x)
        # Without global_rows, as ReproducibleStep assumes: every rank has len(x).
        total = global_rows if global_rows is not None else \
            rows * self.accumulation_steps * self.dp.size
        unit = self._repro.unit_rows(total)
        most = int(self.dp.allreduce(rows, op="max")) // unit if unit else 0
        calls = self._model_calls
        loss = super().backward(x, y, batch_start=batch_start, global_rows=global_rows)
        for _ in range(most - (self._model_calls - calls)):
            self._replay(self._passes())
        return loss

    def _forward_backward(self, model: Model, x: Any, y: Any, accumulate: bool,
                          rows: int) -> float:
        self._model_calls += 1
        return super()._forward_backward(model, x, y, accumulate, rows)

    def _skip(self, micro: int) -> None:
        if not self._sharded:
            super()._skip(micro)
            return
        self._begin(micro)
        # The other ranks' passes gather every bucket, and (bucketed) launch each
        # gradient bucket from their backward's hooks: the same calls, in the same
        # order, with zero gradients.
        self._replay(self._passes())
        self.buckets.flush(zero=True, blocking=not self.bucketed)

    def _replay(self, phases: list[str]) -> None:
        """The hook calls the model's passes ``phases`` make, without a model: the
        parameter hooks around each unit, and in a bucketed backward the gradient
        hooks inside them, each unit's gradient zero. Collective over the
        gathers' group (and, bucketed, ``groups.dp``)."""
        gather = self.gather
        buckets = self.buckets if self.bucketed else None
        for phase in phases:
            backward = phase == BACKWARD
            for u in (reversed(self._units) if backward else self._units):
                gather.before(u, phase)
                if backward and buckets is not None:
                    buckets.before(u)
                    j = buckets.index_of(u.start)
                    b = buckets.ranges[j]
                    buckets.source(j)[u.start - b.start:u.stop - b.start].fill(0)
                    buckets.after(u)
                gather.after(u, phase)

    @property
    def _lockstep_passes(self) -> bool:
        return self._sharded

    def _passes(self) -> list[str]:
        """The phases of the parameter passes of one ``forward_backward``."""
        return [FORWARD, BACKWARD]

    def _gather_parameters(self) -> None:
        if not self._sharded:
            super()._gather_parameters()     # a model without hooks: ZeRO-2's Allgatherv
            return
        # Nothing is gathered after the step: the next forward gathers the new shard.
        self.gather.invalidate()

    # --- checks and reports -------------------------------------------------------------
    def verify_in_sync(self) -> None:
        """Each parameter lives on one rank only: check that every rank is at the
        same step and gathers the same whole vector (a hash of each bucket as
        gathered). Collective over ``groups.dp``.

        Raises:
            CommunicationError: on every rank, naming the ranks that differ.
        """
        if not self._sharded:
            super().verify_in_sync()
            return
        digest = hashlib.blake2b(digest_size=16)
        for _, values in self.gather.each_bucket():
            digest.update(to_numpy(values).tobytes())
        self._compare_digests(digest.hexdigest(), "ranks", "gathered parameter hash")

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: ``parameters`` (its shard), ``gathered`` (the
        gather buffers), gradients, optimizer state and buffers, with the total now
        and the peak since attach; ``gathered_peak``: the most parameter bytes
        gathered at once since attach."""
        report = super().memory_report()
        if self._sharded:
            report["gathered_peak"] = self.gather.peak * self.dtype.itemsize
        return report

    def _memory(self) -> dict[str, int]:
        report = super()._memory()       # "parameters": the shard, held without a vector
        if not self._sharded:
            return report
        return {"parameters": report.pop("parameters"), "gathered": self.gather.nbytes,
                **report}
