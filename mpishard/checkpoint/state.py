"""``save_checkpoint`` / ``load_checkpoint``: a training job's state, at any layout.

This module is the adapter between the strategies and the layout-free core
(`mpishard.checkpoint.write`, `mpishard.checkpoint.read`). A rank's
model holds a *local* flat vector of ``n`` elements whose tensors are slices of
*logical* tensors ([`TensorShard`][mpishard.nn.TensorShard]: the whole tensor
under DDP, ZeRO-2 and ZeRO-3; a tensor-parallel slice, or a copy replicated over the
tensor group, and only its pipeline stage's layers under 3D parallelism). Two
ranges of the local vector are named, on data-parallel rank ``r`` of ``N``:

* the **share** ``shard_ranges(n, N)[r]``: the part of a vector replicated over
  the data group (the parameters; DDP's optimizer state) that this rank writes,
  reads and verifies, so that no rank moves everything and each byte is
  checksummed once;
* the **state range** ``R`` of ``strategy.optimizer_state_shard()``: the whole
  vector under DDP, the rank's ZeRO shard under ZeRO-2 and ZeRO-3 (any ranges
  that partition the vector work); likewise the **parameter range** of
  ``strategy.parameter_shard()``: the whole vector, or the rank's ZeRO-3 shard
  (a vector held whole is written and read by shares, then gathered).

Of a tensor replicated over the tensor group only tensor rank 0 writes (and
verifies) its elements. A range of the local vector crosses tensor boundaries
and, inside a tensor, is a run of the slice's C order that
`flat_blocks` cuts into at most ``2 * ndim - 1``
hyperslabs of the slice, each shifted by the slice's offset into the logical
tensor. On load every rank reads its share of the parameters (and of replicated
state) into a staging buffer, every dataset is verified, and only then are the
parameters ``Allgatherv``-ed over the data group into the model and the state
copied into the optimizer's arrays, in place. Collective over the whole job
(the strategy's ``groups.world``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._version import __version__
from ..backend import array_namespace, is_device_array, to_numpy
from ..comm import FlatComm, from_comm
from ..errors import CheckpointError, CheckpointWarning
from ..flat import ParamLayout, Range, shard_ranges
from ..nn.shards import tensor_shards
from ..optim.schedules import schedule_from_dict
from ..protocols import DescribedModel, HasCore, StrategyCore
from .background import settle, snapshot, start_background_write
from .blocks import block_shape, block_size, flat_blocks
from .checksum import ALGORITHM
from .collective import agree_error
from .compare import (
    architecture_problem,
    schedule_text,
    setting_differences,
    strategy_settings,
)
from .format import (
    DATA,
    FORMAT,
    FORMAT_VERSION,
    MODEL,
    OPTIMIZER,
    PARAMS,
    CheckpointInfo,
    TensorRecord,
)
from .read import ReadRequest, open_checkpoint, read_blocks
from .write import _ALIGN, _ALIGN_THRESHOLD, Piece, write_checkpoint_file

__all__ = ["Placement", "load_checkpoint", "save_checkpoint"]

_STAGE_KEY = 1 << 32   # tensor order: pipeline stage first, then position in the stage


@dataclass
class Placement:
    """Where this rank's tensors sit in the logical model, and who it works with.

    ``world``: the whole job (every collective of a save or load);
    ``dp``: the ranks holding the same shard (parameters are split among them
    to be written and read, then gathered); both are the groups'
    [`FlatComm`][mpishard.comm.FlatComm] (``None``: one process, no MPI);
    ``tp_rank``: a tensor replicated over
    the tensor group is written and verified by tensor rank 0 only;
    ``pp_rank``: orders the stages' tensors; ``shards``: each local tensor's
    [`TensorShard`][mpishard.nn.TensorShard], by local name.
    """

    world: FlatComm | None
    dp: FlatComm | None
    tp_rank: int
    pp_rank: int
    shards: dict[str, Any]

    @classmethod
    def of(cls, model: Any, strategy: Any = None, comm: Any = None) -> Placement:
        """The placement of ``model`` under ``strategy`` (or, without one, its own
        configuration if it is a model-parallel model, else ``comm`` as one data group).

        ``comm``: a [`FlatComm`][mpishard.comm.FlatComm], an MPI intra-communicator
        (wrapped once here, as the group "checkpoint", without a timeout), or
        ``None`` for ``MPI.COMM_WORLD``; ignored when a configuration decides.
        """
        config = strategy.config if strategy is not None else getattr(model, "config", None)
        if config is not None and hasattr(config, "groups") and (
                strategy is not None or hasattr(model, "tensor_shards")):
            groups = config.groups
            dp = strategy.dp if strategy is not None else groups.dp
            c = groups.coordinates
            return cls(groups.world, dp, c.tp, c.pp, tensor_shards(model))
        flat = from_comm(comm, "checkpoint")
        return cls(flat, flat, 0, 0, tensor_shards(model))

    @classmethod
    def single(cls, model: Any) -> Placement:
        """One process holding the whole model (no MPI)."""
        return cls(None, None, 0, 0, tensor_shards(model))

    @contextmanager
    def file_io(self) -> Iterator[None]:
        """The calls inside wait under the file-I/O deadline (``io_timeout=``) on
        ``world`` and ``dp``: every wait of a save or load is one for some rank's
        reads or writes (rank 0's ``fsync`` included). Local."""
        with ExitStack() as stack:
            for group in {id(g): g for g in (self.world, self.dp) if g is not None}.values():
                stack.enter_context(group.deadline("io"))
            yield

    @property
    def dp_rank(self) -> int:
        return 0 if self.dp is None else self.dp.rank

    @property
    def dp_size(self) -> int:
        return 1 if self.dp is None else self.dp.size

    def key(self, ordinal: int) -> int:
        """The place in the whole model's order of the local tensor at ``ordinal``
        (stage first, then position in the stage)."""
        return self.pp_rank * _STAGE_KEY + ordinal

    def writes(self, name: str) -> bool:
        """Whether this rank writes (and verifies) its elements of tensor ``name``."""
        return self.tp_rank == 0 or not self.shards[name].replicated


# --- pieces of a flat vector -------------------------------------------------

def _runs(layout: ParamLayout, place: Placement, r: Range):
    """``(spec, shard, local element range, logical blocks)`` of range ``r`` of the
    local vector, tensor by tensor."""
    for spec in layout.tensors_in(r):
        shard = place.shards[spec.name]
        part = spec.range.intersect(r)
        starts = [s.start for s in shard.index]
        blocks = [tuple(slice(b.start + o, b.stop + o) for b, o in zip(blk, starts))
                  for blk in flat_blocks(part.start - spec.offset, part.stop - spec.offset,
                                         spec.shape)]
        yield spec, shard, part, blocks


def declared(layout: ParamLayout, place: Placement, group: str,
             dtype: Any) -> list[TensorRecord]:
    """The logical tensors behind ``layout``, in ``group``."""
    d = np.dtype(dtype).newbyteorder("<").str
    return [TensorRecord(group, place.shards[s.name].logical_name,
                         tuple(place.shards[s.name].logical_shape), d,
                         place.key(i)) for i, s in enumerate(layout)]


def vector_pieces(layout: ParamLayout, place: Placement, group: str, host: np.ndarray,
                  base: int, r: Range) -> list[Piece]:
    """The pieces this rank writes of range ``r`` of a local flat vector;
    ``host[x - base]`` is element ``x`` of the vector."""
    dtype = np.dtype(host.dtype).newbyteorder("<").str
    ordinal = {name: i for i, name in enumerate(layout.names)}
    out = []
    for spec, shard, part, blocks in _runs(layout, place, r):
        if not place.writes(spec.name):
            continue
        t = TensorRecord(group, shard.logical_name, tuple(shard.logical_shape), dtype,
                         place.key(ordinal[spec.name]))
        at = part.start - base
        for blk in blocks:
            n = block_size(blk)
            out.append(Piece(t, blk, host[at:at + n].reshape(block_shape(blk))))
            at += n
    return out


def page_aligned_shares(layout: ParamLayout, place: Placement, itemsize: int) -> list[Range]:
    """The data group's shares of a replicated vector to write: `shard_ranges`
    with each boundary moved to the nearest element that starts a 4 KiB page
    of the file (a whole tensor of at least 64 KiB, whose dataset starts on a
    page, at a multiple of 4 KiB from its start), so that no two ranks write
    one page (on a parallel file system, one lock). Any partition gives the
    same file and checksums. Local (every rank computes the same)."""
    shares = shard_ranges(layout.size, place.dp_size)
    cuts = [0]
    for r in shares[1:]:
        cuts.append(max(cuts[-1], _page_cut(layout, place, itemsize, r.start)))
    cuts.append(layout.size)
    return [Range(a, b) for a, b in zip(cuts, cuts[1:])]


def _page_cut(layout: ParamLayout, place: Placement, itemsize: int, x: int) -> int:
    """The element nearest ``x`` starting a page of its dataset (``x`` where
    none: a small tensor, a tensor-parallel slice, a boundary between tensors)."""
    found = layout.tensors_in(Range(x, x + 1))
    if not found:
        return x
    spec = found[0]
    shard = place.shards[spec.name]
    if (tuple(shard.shape) != tuple(shard.logical_shape)
            or spec.size * itemsize < _ALIGN_THRESHOLD):
        return x
    unit = _ALIGN // math.gcd(_ALIGN, itemsize)
    below = spec.offset + (x - spec.offset) // unit * unit
    above = min(below + unit, spec.offset + spec.size)
    return below if x - below <= above - x else above


def vector_requests(info: CheckpointInfo, layout: ParamLayout, place: Placement, group: str,
                    out: np.ndarray, base: int, r: Range) -> list[ReadRequest]:
    """Read requests filling ``out[x - base]`` with element ``x`` of the local vector
    for ``x`` in ``r``; verified where this rank would write."""
    requests = []
    for spec, shard, part, blocks in _runs(layout, place, r):
        record = info.tensors[f"{group}/{shard.logical_name}"]
        verify = place.writes(spec.name)
        at = part.start - base
        for blk in blocks:
            n = block_size(blk)
            requests.append(ReadRequest(record, blk, out[at:at + n].reshape(block_shape(blk)),
                                        verify))
            at += n
    return requests


# --- what the caller passed ---------------------------------------------------

def as_strategy(optimizer: Any) -> StrategyCore | None:
    """The strategy core of ``optimizer`` (a public strategy's ``core``, or a core),
    None for None; else TypeError."""
    if optimizer is None:
        return None
    if isinstance(optimizer, HasCore):
        optimizer = optimizer.core
    if isinstance(optimizer, StrategyCore):
        return optimizer
    raise TypeError(f"expecting a training strategy (DDPOptimizer, ZeRO2Optimizer, "
                    f"ZeRO3Optimizer, HybridShardedOptimizer, ElasticOptimizer) or None, "
                    f"got {type(optimizer).__name__}")


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


#: The keys of a strategy's ``data_position`` (all ints), stored as ``/data``.
DATA_POSITION_KEYS = ("epoch", "samples_consumed", "seed", "batch_size", "num_samples", "shuffle")
#: Keys stored when the position has them: ``batches``, a stream's batch count
#: (`BatchStream`).
OPTIONAL_POSITION_KEYS = ("batches",)


def _data_record(strategy: Any) -> dict[str, int] | None:
    """The strategy's ``data_position`` (kept current by the training loop) as
    the ``/data`` attributes, or None when it has none.

    Raises:
        ValueError: a position without one of the keys.
    """
    position = getattr(strategy, "data_position", None)
    if position is None:
        return None
    missing = [k for k in DATA_POSITION_KEYS if k not in position]
    if missing:
        raise ValueError(f"strategy.data_position lacks {missing}: expecting the keys "
                         f"{list(DATA_POSITION_KEYS)}, got {sorted(position)}")
    return {k: int(position[k]) for k in DATA_POSITION_KEYS + OPTIONAL_POSITION_KEYS
            if k in position}


def root_attrs(kind: str, step: int, epoch: int, world: int, dp: int, tp: int, pp: int,
               strategy: str, dtype: Any, schedule: Any = None,
               settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``/`` attributes of format version 1 (``settings`` only when given)."""
    extra = {} if settings is None else {"settings": _json(settings)}
    return {**extra,
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": kind,
        "library_version": __version__, "step": int(step), "epoch": int(epoch),
        "world_size": int(world), "dp": int(dp), "tp": int(tp), "pp": int(pp),
        "strategy": str(strategy), "dtype": np.dtype(dtype).name,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "checksum": ALGORITHM, "schedule": _json(schedule),
    }


def model_attrs(model: Any) -> dict[str, Any] | None:
    """``/model`` attributes: the architecture (when known) and the metadata, from a
    [`DescribedModel`][mpishard.protocols.DescribedModel] (None for any other model)."""
    if not isinstance(model, DescribedModel):
        return None
    arch = model.architecture()
    meta = model.training_metadata()
    if arch is None and meta is None:
        return None
    return {"class": type(model).__name__, "architecture": _json(arch), "metadata": _json(meta)}


def _local(a: Any) -> np.ndarray:
    return to_numpy(a) if is_device_array(a) else a


# --- save ------------------------------------------------------------------------

def save_checkpoint(path: str | os.PathLike, model: Any, optimizer: Any = None, *,
                    comm: Any = None, driver: str = "auto", durable: bool = True,
                    asynchronous: bool = False) -> str:
    """Write the training state to the HDF5 file ``path``, atomically.

    With a strategy ([`DDPOptimizer`][mpishard.strategies.ddp.DDPOptimizer],
    [`ZeRO2Optimizer`][mpishard.strategies.zero2.ZeRO2Optimizer],
    [`ZeRO3Optimizer`][mpishard.strategies.zero3.ZeRO3Optimizer],
    [`HybridShardedOptimizer`][mpishard.strategies.hybrid.HybridShardedOptimizer],
    [`ElasticOptimizer`][mpishard.strategies.elastic.ElasticOptimizer]) as
    ``optimizer``: the parameters, the optimizer state, the step, its
    ``data_position`` (epoch, samples consumed, ...), its
    learning-rate schedule and the layout; collective over the whole job
    (``strategy.config.world``, under its timeout: a rank that does not take
    part is named, with the call and the group, instead of a hang). Each rank
    writes its share of its parameters and its part of the state, as logical
    tensors. With ``optimizer=None`` only the parameters, collective over
    ``comm`` (a [`FlatComm`][mpishard.comm.FlatComm] or an MPI communicator;
    ``MPI.COMM_WORLD`` by default; a model-parallel model's own configuration
    when it has one).

    ``driver``: ``"auto"`` (``"direct"``: rank 0 lays the file out, every rank
    writes its bytes into it with ``pwrite``; ``MPISHARD_CHECKPOINT_DRIVER``
    overrides), ``"direct"``, ``"mpio"`` (parallel HDF5) or ``"serial"`` (through
    rank 0); the same file from each (`mpishard.checkpoint.write`).
    ``durable``: the file and its folder are on disk when this returns (fsync).

    ``asynchronous``: return once this rank has copied its part of the state
    (into buffers reused by the next save; pinned host memory for CuPy); the
    file is written by a thread and appears at ``path``, complete and durable,
    at the commit: the next save or load,
    [`wait_for_checkpoint`][mpishard.checkpoint.wait_for_checkpoint], or a step
    boundary of the training loop
    (`mpishard.checkpoint.background`). A
    failed background write is raised there, on every rank. ``driver`` does not
    apply (rank 0 creates the file, every rank writes its bytes into it).

    Returns the absolute path written (to be written, when asynchronous).

    Raises:
        TypeError: ``optimizer`` is not a strategy.
        ValueError: ``model`` is not the strategy's model; an unknown driver.
        CheckpointError: the folder is missing, a name cannot be stored, writing
            failed (no file appears at ``path``); on every rank.
    """
    strategy = as_strategy(optimizer)
    place = Placement.of(model, strategy, comm)
    # A save's memory is counted without tracemalloc (the "save" phase never
    # traces), which made rank 0's HDF5 layout three times as slow.
    with place.world.during(f"save_checkpoint({os.fspath(path)})"), place.file_io(), \
            _memory_phase(strategy, "save"):
        settle()   # a save in flight is committed (or its failure raised) first
        if asynchronous:
            snap = snapshot()
            try:
                tensors, pieces, attrs = _contents(path, model, strategy, place, snap.take)
            except BaseException:
                snap.finish()
                raise
            # Rank 0's copies go on in a thread while it creates the file; the
            # others copy in this thread while they wait for it (a helper thread
            # there would share the cores with this one's polling).
            snap.start(background=place.world is None or place.world.rank == 0)
            return start_background_write(path, place.world, tensors, pieces, attrs,
                                          durable=durable, order_groups=(PARAMS,),
                                          ready=snap.finish, meanwhile=snap.copy_now)
        tensors, pieces, attrs = _contents(path, model, strategy, place, _local)
        return write_checkpoint_file(path, place.world, tensors, pieces, attrs, driver=driver,
                                     durable=durable, order_groups=(PARAMS,))


def _contents(path: str | os.PathLike, model: Any, strategy: Any, place: Placement,
              local: Any) -> tuple[list[TensorRecord], list[Piece], dict[str, dict[str, Any]]]:
    """The datasets, this rank's pieces (its ranges of the vectors through
    ``local``: a host view or a snapshot's copy) and the attributes of a save."""
    world = place.world
    # The first call of a save is this agreement, under the timeout: a rank that
    # does not come is named here, before any HDF5 collective (which cannot be timed).
    problem = _sharded_problem(path, model, strategy)
    if strategy is not None and strategy.model is not model:
        problem = ValueError(f"{os.fspath(path)}: the model is not the one attached to "
                             f"the strategy (attach it, or pass strategy.model)")
    elif strategy is not None:
        try:
            _data_record(strategy)
        except ValueError as exc:
            problem = exc
    agree_error(world, problem)
    layout: ParamLayout = model.layout
    n = layout.size
    held, params = (Range(0, n), model.params) if strategy is None else strategy.parameter_shard()
    dtype = np.dtype(params.dtype)
    share = page_aligned_shares(layout, place, dtype.itemsize)[place.dp_rank]
    mine = share if held == Range(0, n) else held   # ZeRO-3: the shard is the share
    tensors = declared(layout, place, PARAMS, dtype)
    pieces = vector_pieces(layout, place, PARAMS,
                           local(params[mine.start - held.start:mine.stop - held.start]),
                           mine.start, mine)
    attrs: dict[str, dict[str, Any]] = {PARAMS: {}}
    if strategy is None:
        meta = model.training_metadata() if isinstance(model, DescribedModel) else None
        steps = (meta or {}).get("steps", 0)
        size = world.size
        attrs["/"] = root_attrs("training", steps, 0, size, size, 1, 1, "none", dtype)
    else:
        topo = strategy.config.topology
        record = _data_record(strategy)
        schedule = strategy.schedule
        attrs["/"] = root_attrs("training", strategy.step_count,
                                record["epoch"] if record else 0,
                                world.size, topo.dp, topo.tp, topo.pp,
                                strategy.strategy, dtype,
                                schedule.to_dict() if hasattr(schedule, "to_dict") else None,
                                strategy_settings(strategy))
        # Where the schedule is: the step, and the learning rate it gave there.
        attrs["/"]["lr"] = float(strategy.current_lr())
        state_range, state = strategy.optimizer_state_shard()
        replicated = state_range == Range(0, n)   # DDP: write my share, as the parameters
        mine = share if replicated else state_range
        names = list(state)
        hyper = strategy.optimizer.hyperparameters()
        attrs[OPTIMIZER] = {"name": str(hyper.get("name", type(strategy.optimizer).__name__)),
                            "hyperparameters": _json(hyper), "state_names": _json(names)}
        for s in names:
            group = f"{OPTIMIZER}/{s}"
            part = state[s][mine.start - state_range.start:mine.stop - state_range.start]
            tensors += declared(layout, place, group, dtype)
            pieces += vector_pieces(layout, place, group, local(part), mine.start, mine)
        if record is not None:
            attrs[DATA] = record
    extra = model_attrs(model)
    if extra is not None:
        attrs[MODEL] = extra
    return tensors, pieces, attrs


# --- load ------------------------------------------------------------------------

def local_problem(info: CheckpointInfo, layout: ParamLayout, place: Placement,
                  dtype: Any) -> str | None:
    """Why this rank's tensors cannot be loaded from ``info``, or None."""
    if np.dtype(dtype).name != info.dtype:
        return (f"{info.path}: the file holds {info.dtype} parameters, the model "
                f"{np.dtype(dtype).name}")
    # Tensors are named by their model-wide (logical) name and shape, and placed by
    # their position in the file: a rank's index inside its pipeline stage or its
    # tensor-parallel slice would mean nothing to the reader.
    for spec in layout:
        shard = place.shards[spec.name]
        name, shape = shard.logical_name, tuple(shard.logical_shape)
        rec = info.tensors.get(f"{PARAMS}/{name}")
        if rec is None:
            return (f"{info.path}: a different model: the model's tensor {name} {shape} is not "
                    f"in the file ({len(info.order)} tensors, {info.parameter_count} "
                    f"parameters; its first: {info.order[:3]})")
        if tuple(rec.shape) != shape:
            return (f"{info.path}: a different model: tensor {name} (number "
                    f"{info.order.index(name)} of the {len(info.order)} in the file) is "
                    f"{tuple(rec.shape)} in the file, {shape} in the model")
    return None


def global_problem(info: CheckpointInfo, names: set[str]) -> str | None:
    """Why a model of the logical tensors ``names`` is not the file's, or None."""
    missing = sorted(set(info.order) - names)
    if missing:
        return (f"{info.path}: a different model: the file has {len(info.order)} tensors, "
                f"the model {len(names)}; the model lacks {missing[:3]}")
    return None


def _state_problem(info: CheckpointInfo, strategy: Any) -> str | None:
    if info.optimizer is None:
        return f"{info.path}: holds no optimizer state (kind {info.kind!r})"
    name = strategy.optimizer.hyperparameters().get("name", type(strategy.optimizer).__name__)
    if info.optimizer.get("name") != name:
        return (f"{info.path}: written with optimizer {info.optimizer.get('name')}, "
                f"loading into {name}")
    _, state = strategy.optimizer_state_shard()
    if list(state) != info.state_names:
        return (f"{info.path}: optimizer state {info.state_names} in the file, "
                f"{list(state)} in {name} (different hyperparameters, e.g. momentum?)")
    return None


def _allgather_into(comm: FlatComm | None, stage: np.ndarray, dest: Any,
                    shares: list[Range]) -> None:
    """``dest`` (the full vector, NumPy or CuPy) from every rank's ``stage`` (its
    share; ``shares`` are consecutive). Collective over ``comm``.

    Gathered on the host and copied to a device ``dest`` once: a staging buffer
    of the model's size kept by the communicator would outlive the load.
    """
    host = dest if not is_device_array(dest) else np.empty(dest.shape, dtype=dest.dtype)
    if comm is None or comm.size == 1:
        host[...] = stage
    elif dest.size < 2**31:
        comm.Allgatherv(host, [len(s) for s in shares], slot="checkpoint-load", sendbuf=stage)
    else:   # counts and displacements of MPI-3 are C ints: broadcast by pieces
        for r, s in enumerate(shares):
            if comm.rank == r:
                host[s.start:s.stop] = stage
            for at in range(s.start, s.stop, 1 << 30):
                comm.Bcast(host[at:min(at + (1 << 30), s.stop)], root=r, slot="checkpoint-load")
    if host is not dest:
        array_namespace(dest).copyto(dest, array_namespace(dest).asarray(host))


def load_checkpoint(path: str | os.PathLike, model: Any, optimizer: Any = None, *,
                    comm: Any = None, strict_architecture: bool = True) -> CheckpointInfo:
    """Load a checkpoint written at any layout into ``model`` (and ``optimizer``).

    With a strategy: attaches ``model`` if it is not attached yet, then sets the
    parameters, the optimizer state (in place), ``step_count`` and
    ``data_position`` (the dict of the file's ``/data``, or None when it has
    none), from which the training loop's sampler goes on;
    collective over the whole job (``strategy.config.world``). With
    ``optimizer=None`` only the parameters, collective over ``comm``
    (``MPI.COMM_WORLD`` by default). Everything is read and verified before
    anything is changed: on an error the model and optimizer are as they were.

    The model's architecture record (``model.architecture()``: activation,
    widths, heads, ...; not its seed or dtype) is compared with the file's, when
    both have one: another architecture is an error that lists the differences,
    unless ``strict_architecture=False``.

    The strategy's settings are the caller's: its optimizer hyperparameters,
    clipping (``max_grad_norm``) and accumulation are kept, and where they
    differ from the file's a [`CheckpointWarning`][mpishard.errors.CheckpointWarning] says
    so (on rank 0). The learning-rate schedule likewise, except that a strategy
    made without one (``schedule=None``) takes the file's
    (``schedule_from_dict(info.schedule)``). What was found different or taken
    is listed in ``info.notes``, the same on every rank.

    Returns the file's [`CheckpointInfo`][mpishard.checkpoint.CheckpointInfo].

    Raises:
        FileNotFoundError: no file at ``path`` (every rank).
        CheckpointError: a truncated, damaged or foreign file, an unknown format
            version, another model (tensor names, shapes, dtype or architecture),
            another optimizer class or state; on every rank, naming the file.
    """
    strategy = as_strategy(optimizer)
    place = Placement.of(model, strategy, comm)
    with place.world.during(f"load_checkpoint({os.fspath(path)})"), place.file_io(), \
            _memory_phase(strategy, "load"):
        settle()   # a save in flight is committed (or its failure raised) first
        if strategy is not None and strategy.model is not model:
            strategy.attach(model)
        return _load(path, model, strategy, place, strict_architecture)


def _load(path: str | os.PathLike, model: Any, strategy: Any, place: Placement,
          strict_architecture: bool = True) -> CheckpointInfo:
    world = place.world
    # The first call of a load is the agreement on the header (rank 0 reads it),
    # under the timeout; loading uses no HDF5 collective (each rank reads alone).
    info = open_checkpoint(os.path.abspath(os.fspath(path)), world)
    agree_error(world, _sharded_problem(path, model, strategy))
    layout: ParamLayout = model.layout
    n = layout.size
    held, params = (Range(0, n), model.params) if strategy is None else strategy.parameter_shard()
    dtype = np.dtype(params.dtype)
    problem = local_problem(info, layout, place, dtype)
    # Agreed on first: a pipeline stage sees only its own tensors' shapes, so a
    # shape mismatch on one stage must win over the architecture on another.
    agree_error(world, CheckpointError(problem) if problem else None)
    names = {s.logical_name for s in place.shards.values()}
    if world is not None and world.size > 1:
        names = set().union(*world.allgather(sorted(names)))
    problem = global_problem(info, names)   # the same on every rank
    if problem:
        raise CheckpointError(problem)
    problem = architecture_problem(info, model, strict_architecture)
    if problem is None and strategy is not None:
        problem = _state_problem(info, strategy)
    agree_error(world, CheckpointError(problem) if problem else None)

    shares = shard_ranges(n, place.dp_size)
    share = shares[place.dp_rank]
    whole_params = _whole(place, held, n, info, "parameter")
    mine = share if whole_params else held
    params_stage = np.empty(len(mine), dtype=dtype)
    requests = vector_requests(info, layout, place, PARAMS, params_stage, mine.start, mine)
    stages: dict[str, np.ndarray] = {}
    replicated = True
    if strategy is not None:
        state_range, state = strategy.optimizer_state_shard()
        replicated = _whole(place, state_range, n, info, "optimizer-state")
        mine = share if replicated else state_range
        for s in info.state_names:
            stages[s] = np.empty(len(mine), dtype=dtype)
            requests += vector_requests(info, layout, place, f"{OPTIMIZER}/{s}", stages[s],
                                        mine.start, mine)
    read_blocks(info, world, requests)

    # Verified everywhere: commit.
    if whole_params:
        _allgather_into(place.dp, params_stage, params, shares)
    else:
        xp = array_namespace(params)
        xp.copyto(params, xp.asarray(params_stage))
    if strategy is not None:
        for s, stage in stages.items():
            if replicated:
                _allgather_into(place.dp, stage, state[s], shares)
            else:
                xp = array_namespace(state[s])
                xp.copyto(state[s], xp.asarray(stage))
        strategy.step_count = info.step
        # The training loop restores its sampler from this on entry (ints, as kept).
        strategy.data_position = (None if info.data is None else
                                  {k: int(info.data[k]) for k in
                                   DATA_POSITION_KEYS + OPTIONAL_POSITION_KEYS
                                   if k in info.data})
        _settings(info, strategy, world)
    return info


def _sharded_problem(path: str | os.PathLike, model: Any, strategy: Any) -> Exception | None:
    """A model whose parameters a ZeRO-3 strategy holds, given without it."""
    if strategy is None and getattr(model, "params", 0) is None:
        return CheckpointError(
            f"{os.fspath(path)}: the model's parameters are sharded (ZeRO-3): pass its "
            f"strategy, or use the whole vector inside strategy.gathered_parameters()")
    return None


def _whole(place: Placement, held: Range, n: int, info: CheckpointInfo, what: str) -> bool:
    """Whether every rank of the data group holds the whole vector (``held`` is
    this rank's range of it), else check that the ranges partition it.

    Decided from every rank's range, so that all ranks take the same branch (a
    one-element ZeRO vector is "whole" on rank 0 and empty elsewhere). Not
    ``tuple(held)``: Range's ``__len__`` is its length, which ``tuple()`` takes as
    a size hint and allocates. Collective over ``place.dp``.

    Raises:
        CheckpointError: the ranges do not partition the vector (on every rank).
    """
    pair = (held.start, held.stop)
    every = place.dp.allgather(pair) if place.dp_size > 1 else [pair]
    if all(r == (0, n) for r in every):
        return True
    ranges = sorted(every)
    covered = all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    if not (covered and ranges[0][0] == 0 and ranges[-1][1] == n):
        raise CheckpointError(f"{info.path}: the strategy's {what} ranges {ranges} do not "
                              f"partition the {n} elements")
    return False


def _settings(info: CheckpointInfo, strategy: Any, world: FlatComm | None) -> None:
    """Compare the strategy's settings with the file's, take the file's schedule
    where the strategy has none, and say what was found (``info.notes``; a
    warning on rank 0)."""
    info.notes = setting_differences(info, strategy)
    if info.notes:
        text = "; ".join(info.notes)
        if world is None or world.rank == 0:
            warnings.warn(f"{info.path}: the strategy's settings differ from the checkpoint's, "
                          f"and are kept: {text}", CheckpointWarning, stacklevel=4)
    if strategy.schedule is None and info.schedule is not None:
        strategy.schedule = schedule_from_dict(info.schedule)
        info.notes.append(f"schedule: taken from the file, {schedule_text(info.schedule)}")


def _memory_phase(strategy: StrategyCore | None, name: str) -> AbstractContextManager:
    """The strategy's memory phase ``name`` (``memory_report``), or nothing."""
    return nullcontext() if strategy is None else strategy.memory_phase(name)
