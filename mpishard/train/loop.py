"""The one training loop, behind every ``optimize()``, ``ElasticOptimizer`` and ``mpishard train``.

:func:`run_training` reads each global batch through the resumable sampler,
gives every data-parallel rank its rows, runs the strategy's ``backward`` per
micro-batch and its ``step``, keeps the strategy's ``data_position`` current,
and after every step, in this order: calls the callback, writes a checkpoint
every ``checkpoint_every`` steps, and decides with every rank whether to stop
(a signal, :meth:`StopRequest.request`, the callback, ``max_steps``). A stop
writes a checkpoint at that step boundary first, so a relaunched or requeued
job resumes exactly there.

**Epochs are a total.** ``epochs`` counts from epoch 0: a strategy restored
from a checkpoint (its ``data_position`` says epoch 1, 48 samples in) trained
with ``epochs=3`` does the rest of epoch 1 and epoch 2, and a second
``optimize(epochs=3)`` after a complete first one does nothing. Every entry
point (``optimize()`` of each strategy, ``ElasticOptimizer``, ``mpishard
train``) follows this rule, so the same command resumes a job where it stopped.
``new_pass()`` (of a strategy) forgets the data position: the next call starts
at epoch 0 with its own seed and shuffle.

**The data position wins.** A call that continues a position (restored from a
checkpoint, or left by an earlier call) goes on with the position's seed and
shuffle; a ``seed``, ``shuffle`` or ``batch_size`` passed that differs from it
is reported once, on rank 0 (:class:`~mpishard.data.DataPositionWarning`),
saying what is used. **Data may grow** between calls (never shrink): each
epoch covers the samples present when it starts (:mod:`mpishard.data.sampler`).

**A stream** (:class:`~mpishard.data.BatchStream`) has no epochs: one step
per global batch, in the order they come, until the iterator ends
(``result.stopped == "exhausted"``), ``max_steps`` or a stop. A batch is read
only when its step is about to run (never one ahead, so a stop loses none),
and the data position counts the batches (``batches``), so a checkpoint
resumes the stream exactly (:mod:`mpishard.data.stream` says how a restarted
stream is placed).
"""

from __future__ import annotations

import datetime
import numbers
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from ..comm import ulfm
from ..data import (
    ArrayDataset,
    BatchStream,
    DataPositionWarning,
    SamplerState,
    ShardedSampler,
    position_conflicts,
    rank_rows,
    split_batch,
)
from ..errors import MpiShardError
from ..exitcodes import EXIT_STOPPED
from ..parallel.recovery import ShardBuddy, recover_in_place, recoverable, shrink_only
from ..parallel.zero2 import ZeRO2Optimizer
from ..protocols import CollectiveDataset, Dataset
from .evaluate import evaluate
from .progress import Metrics, clock, progress_bar
from .result import TrainResult
from .signals import StopRequest

__all__ = ["run_training"]


def run_training(strategy: Any, model: Any, data: Any, epochs: int | None = None,
                 batch_size: int | None = None, *,
                 shuffle: bool | None = None, seed: int | None = None, drop_last: bool = True,
                 callback: Callable[[int, float], Any] | None = None,
                 stop: StopRequest | None = None, max_steps: int | None = None,
                 checkpoints: Any = None, checkpoint_every: int = 0,
                 validation: tuple[Any, Any] | None = None,
                 metrics_path: str | None = None, append_metrics: bool = False,
                 progress: bool = False, out: TextIO | None = None, log_every: int = 10,
                 print_every: int = 0, label: str = "train",
                 start_record: dict[str, Any] | None = None,
                 batch_size_may_change: bool = False, min_workers: int = 1,
                 buddy_copies: bool = True) -> TrainResult:
    """Train ``model`` with ``strategy`` until ``epochs`` epochs are complete in
    total (see the module docstring), a stream ends, ``max_steps`` is reached,
    or a stop. Collective over ``strategy.config.world``.

    Args:
        strategy: a parallel-core strategy (``attach``, ``backward``, ``step``,
            ``data_position``); the model is attached if it is not yet.
        data: what ``optimize()`` takes (:class:`~mpishard.train.Trainable`):
            an ``(inputs, targets)`` pair (wrapped in
            :class:`~mpishard.data.ArrayDataset`), a
            :class:`~mpishard.protocols.Dataset` (every rank passes the same
            data and reads only its rows) or a
            :class:`~mpishard.protocols.CollectiveDataset` over ``strategy.dp``
            (:class:`~mpishard.data.LocalDataset`: rows spread over the ranks),
            or a :class:`~mpishard.data.BatchStream` (global batches as they
            come, one step each; ``epochs``, ``seed`` and ``shuffle`` None).
        batch_size: the global batch (a stream: None, any size; or the size
            every batch must have), split evenly over the data-parallel ranks
            and then into ``accumulation_steps`` micro-batches (and a pipelined
            model's micro-batches). The shuffle of an epoch depends on
            ``(seed, epoch)`` only, so any world size sees the same batches.
        shuffle, seed: the sampler's (None: True and 0); a strategy with a
            ``data_position`` (one restored from a checkpoint, or trained
            before) keeps its own, with a warning when they differ.
        drop_last: ``True`` drops the last incomplete batch of each epoch (every
            step sees exactly ``batch_size`` samples); ``False`` trains it as a
            short last step, its rows split over the ranks as evenly as possible
            (not for pipelined models).
        callback: ``callback(step, loss)`` after every step; returning True stops
            training there (``result.stopped == "callback"``). Without ``stop``
            it must return the same on every rank; with it, any rank's True stops all.
        stop: a :class:`StopRequest`, agreed on over the world after every step.
        max_steps: stop when the strategy's step count reaches it.
        checkpoints: a :class:`~mpishard.checkpoint.CheckpointManager`; with it a
            checkpoint is written every ``checkpoint_every`` steps (0: never on
            the way), at a stop, and at the end.
        validation: ``(x, y)`` evaluated at each epoch's end and at the end
            (:func:`~mpishard.train.evaluate`).
        metrics_path: JSON lines (rank 0 writes; appended with ``append_metrics``);
            see :mod:`mpishard.train.progress`.
        progress: a tqdm bar on rank 0. print_every: an epoch line on rank 0
            every that many epochs (and the first and last); 0: none.
        start_record: written as the ``start`` metrics event, when given.
        batch_size_may_change: no warning when ``batch_size`` differs from the
            position's (``ElasticOptimizer`` under ``scale-lr``).
        min_workers: with fault tolerance on, fewer survivors than this after a
            lost rank write a checkpoint and end the process with 75 (see below).
        buddy_copies: with fault tolerance on and ZeRO-2, each rank keeps copies
            of its right neighbour's shard (parameters and optimizer state) and of
            its own from before the update, refreshed every step
            (:class:`~mpishard.parallel.shardcopy.ShardBuddy`: Adam, three
            shards of parameters and state; one neighbour exchange of the state a
            step), so a rank lost at any point of a step is recovered exactly;
            False: a lost shard rolls back to the newest checkpoint.

    **A lost rank** (fault tolerance on: ``ShardingConfiguration(fault_tolerance=)``
    under ``mpirun --with-ft ulfm``; :mod:`mpishard.comm.ulfm`): a rank that dies
    anywhere in a step (forward, backward, a bucket's reduction, ZeRO-2's
    Allgatherv, the step's Allreduce, the stop agreement, a checkpoint save, an
    evaluation) makes the others' call fail; they rebuild the strategy over the
    survivors (:func:`~mpishard.parallel.recovery.recover_in_place`: DDP from
    the survivor with the newest step, nothing lost; ZeRO-2 from the buddy
    copies, at the last step every survivor completed or the one before it,
    nothing lost, or else rolled back to the newest checkpoint; a 3D layout
    of two or more replicas drops the replicas that lost a rank, whose alive
    ranks end their process with status 0, and goes on with the whole ones),
    re-split the global batch over themselves and go on
    (a step that was interrupted is trained again, over the survivors).
    Each recovery is a ``recovered`` metrics record, a line on rank 0 (with
    ``progress`` or ``print_every``) and an entry of ``result.recoveries``;
    ``strategy.config`` is then the survivors' configuration. The process
    ends instead (:func:`mpishard.comm.ulfm.leave`, status 75, one line on the
    survivors' rank 0 saying why), so that ``mpishard run`` relaunches from a
    checkpoint: fewer survivors than ``min_workers`` (after writing a
    checkpoint), a 3D layout where no replica is whole (one replica, or each
    lost a rank: the newest checkpoint on disk is where it resumes), ZeRO-2 with
    neither a buddy copy of the lost shard nor ``checkpoints``.

    Raises:
        ValueError: on every rank: ``batch_size`` does not split over the ranks
            and micro-batches or exceeds the dataset; the data has fewer samples
            than the data position's epoch covers, or the ranks disagree on its
            length; a collective dataset over another group than ``strategy.dp``;
            a stream's batches that the ranks disagree on
            (:mod:`mpishard.data.stream`); a stream continuing a dataset's
            position or the other way round (call ``new_pass()``).
    """
    world = strategy.config.world
    rank0 = world.rank == 0
    if strategy.model is not model:
        strategy.attach(model)
    dp = strategy.dp
    micro = strategy.accumulation_steps
    # A pipelined model cuts each micro-batch again into its own micro-batches.
    pipeline = getattr(model, "micro_batches", 1)
    stream = data if isinstance(data, BatchStream) else None
    sampler: Any = None
    dataset: Any = None
    collective, local, x_full, y_full = False, 0, None, None

    def open_data(may_change: bool) -> tuple[Any, dict[str, int]]:
        """The sampler state and the data position, at the strategy's; this
        rank's buffers for its rows. Collective over the world (again after a
        recovery: the rows re-split over the survivors)."""
        nonlocal sampler, dataset, collective, local, x_full, y_full
        if stream is not None:
            return SamplerState(), _open_stream(   # a stream has no epochs: epoch 0
                strategy, stream, epochs, batch_size, seed, shuffle)
        dataset, collective, sampler, split = _open_dataset(
            strategy, data, epochs, batch_size, seed, shuffle, drop_last,
            may_change, micro * pipeline)
        local = split.local_size
        x_full, y_full = dataset.buffers(local, strategy.xp, model.params.dtype)
        return sampler.state, sampler.position()

    state, position = open_data(batch_size_may_change)
    strategy.data_position = position
    per_epoch = None if stream is not None else sampler.batches_per_epoch
    fault_tolerant = ulfm.is_on(world)

    def new_buddy() -> ShardBuddy | None:
        keep = fault_tolerant and buddy_copies and isinstance(strategy, ZeRO2Optimizer)
        return ShardBuddy(strategy) if keep else None

    buddy = new_buddy()
    # The data position after each of the last two steps, to go back to one of them.
    marks: dict[int, tuple[int, dict[str, int]]] = {
        strategy.step_count: (strategy.skipped_steps, dict(position))}

    start_step = strategy.step_count
    result = TrainResult(first_step=start_step, last_step=start_step)
    total_steps = None if per_epoch is None else epochs * per_epoch   # a stream: unknown
    if max_steps is not None:
        total_steps = max_steps if total_steps is None else min(total_steps, max_steps)
    out = out or sys.stdout
    metrics = Metrics(metrics_path if rank0 else None, append_metrics)
    bar = progress_bar(total_steps, start_step, label, out) if rank0 and progress else None
    saved_at = start_step   # a resumed run has its starting point on disk already
    last_val = (-1, float("nan"))
    lost_note = ""   # the next epoch line says that a rank was lost during its epoch

    def save(reason: str) -> None:
        nonlocal saved_at
        if checkpoints is None or saved_at == strategy.step_count:
            return
        path = checkpoints.save(model, strategy)
        saved_at = strategy.step_count
        result.checkpoint = path
        metrics.record("checkpoint", step=saved_at, path=path, reason=reason)

    if start_record is not None:
        metrics.record("start", **start_record, first_step=start_step, epochs=epochs,
                       batch_size=batch_size, steps_per_epoch=per_epoch,
                       time=datetime.datetime.now().isoformat(timespec="seconds"))
    t_start = time.perf_counter()
    t_window, window_loss, window_steps, window_samples = t_start, 0.0, 0, 0
    t_epoch, epoch_loss, epoch_steps, epoch_samples = t_start, 0.0, 0, 0
    try:
        while True:   # once, and again after each recovery from a lost rank
            try:
                if max_steps is not None and strategy.step_count >= max_steps:
                    result.stopped = "max_steps"
                while result.stopped is None and (stream is not None or state.epoch < epochs):
                    # --- one step: this rank's rows of the global batch -----------------
                    if stream is not None:   # read only now: a stop above reads no batch
                        got = stream.read(world, dp, strategy.xp, model.params.dtype,
                                          batch_size=batch_size,
                                          equal_parts=micro * pipeline if pipeline > 1 else 1)
                        if got is None:
                            result.stopped = "exhausted"
                            break
                        x, y, lo, rows = got
                        n = len(x)
                    else:
                        rows = sampler.current_batch_size()
                        lo, hi = rank_rows(rows, dp.size, dp.rank)
                        n = hi - lo
                        x, y = (x_full, y_full) if n == local else (x_full[:n], y_full[:n])
                        if collective:   # the rows come from the ranks that hold them
                            dataset.gather_batch(sampler.batch_indices(0, rows), x, y)
                        else:
                            dataset.gather(sampler.batch_indices(lo, hi), x, y)
                    for k in range(micro):
                        # Micro-batches as even as the ranks' shares; backward() weights each
                        # by its rows, so a short, unequal last batch is still its exact mean.
                        a, b = k * n // micro, (k + 1) * n // micro
                        strategy.backward(x[a:b], y[a:b], batch_start=lo + a, global_rows=rows)
                    loss = strategy.step()
                    if buddy is not None:
                        buddy.exchange()   # the lost shard survives with its neighbour
                    epoch_before = state.epoch
                    if stream is not None:
                        position["batches"] = stream.index
                        position["samples_consumed"] += rows
                        position["num_samples"] = position["samples_consumed"]
                        position["batch_size"] = rows
                    else:
                        sampler.advance()
                        position["epoch"] = state.epoch
                        position["samples_consumed"] = state.samples_consumed
                        # grown data joins at an epoch
                        position["num_samples"] = sampler.num_samples
                    step = strategy.step_count
                    marks[step] = (strategy.skipped_steps, dict(position))
                    marks.pop(step - 2, None)
                    result.losses.append(loss)
                    result.steps += 1
                    result.samples += rows
                    result.last_step = step

                    # --- what a step reports -------------------------------------------
                    epoch_loss += loss
                    epoch_steps += 1
                    epoch_samples += rows
                    if bar is not None:
                        elapsed = time.perf_counter() - t_start
                        bar.set_postfix_str(   # tqdm puts ", " before it
                            f"loss {loss:.4f}, {result.samples / elapsed:,.0f} samples/s",
                            refresh=False)
                        bar.update(1)
                    if metrics.active:
                        window_loss += loss
                        window_steps += 1
                        window_samples += rows
                        if window_steps >= log_every:
                            now = time.perf_counter()
                            metrics.record(
                                "step", step=step, epoch=state.epoch,
                                loss=window_loss / window_steps, lr=strategy.current_lr(),
                                samples_per_s=window_samples / max(now - t_window, 1e-9),
                                elapsed_s=now - t_start)
                            t_window, window_loss, window_steps, window_samples = now, 0.0, 0, 0

                    # --- after the step: callback, checkpoint, stop ------------------------
                    wants_stop = callback is not None and bool(callback(step, loss))
                    if checkpoint_every and step % checkpoint_every == 0:
                        save("interval")
                    if stop is not None:
                        result.stopped = stop.agree(world, "callback" if wants_stop else None)
                    elif wants_stop:
                        result.stopped = "callback"
                    if result.stopped is None and max_steps is not None and step >= max_steps:
                        result.stopped = "max_steps"

                    # --- the end of an epoch ---------------------------------------------
                    if state.epoch != epoch_before:
                        now = time.perf_counter()
                        values: dict[str, Any] = {
                            "epoch": state.epoch, "step": step, "loss": epoch_loss / epoch_steps,
                            "samples_per_s": epoch_samples / max(now - t_epoch, 1e-9),
                            "elapsed_s": now - t_start}
                        if validation is not None:
                            values["val_loss"] = evaluate(model, *validation)
                            last_val = (step, values["val_loss"])
                        metrics.record("epoch", **values)
                        if rank0 and print_every and (state.epoch % print_every == 0
                                                      or state.epoch in (1, epochs)):
                            remaining = (total_steps - step) * (now - t_epoch) / epoch_steps
                            val = (f"  val {values['val_loss']:.4f}"
                                   if validation is not None else "")
                            line = (f"{label} epoch {state.epoch:>3}/{epochs}  step {step:>5}  "
                                    f"loss {values['loss']:.4f}{val}  "
                                    f"{values['samples_per_s']:,.0f} samples/s  "
                                    f"eta {clock(remaining)}{lost_note}")
                            lost_note = ""
                            if bar is not None:
                                bar.write(line, file=out)   # above the bar
                            else:
                                out.write(line + "\n")
                                out.flush()
                        t_epoch = time.perf_counter()
                        epoch_loss, epoch_steps, epoch_samples = 0.0, 0, 0

                result.seconds = time.perf_counter() - t_start
                save(result.stopped or "end")
                break
            except Exception as exc:
                if not (fault_tolerant and ulfm.is_failure(exc)):
                    raise
                failure = exc
            # --- a rank died: go on over the survivors ---------------------------
            event = _recover(strategy, failure, checkpoints, label, buddy, marks)
            if buddy is not None:   # what the copies cost so far
                event["buddy_bytes"], event["buddy_seconds"] = buddy.nbytes, buddy.seconds
            buddy = new_buddy()
            world, dp = strategy.config.world, strategy.dp
            rank0 = world.rank == 0
            if rank0 and not metrics.active and metrics_path:   # rank 0 was lost
                metrics = Metrics(metrics_path, append=True)
            state, position = open_data(True)
            strategy.data_position = position
            step = strategy.step_count
            marks = {step: (strategy.skipped_steps, dict(position))}
            # What every survivor reports: the steps up to the agreed one.
            kept = max(0, step - start_step)
            undone = result.last_step != step   # this rank's figures include other steps
            losses = max(world.allgather(result.losses[:kept]), key=len)
            result.losses[:] = losses
            result.steps, result.last_step = len(losses), step
            result.recoveries.append(event)
            saved_at = min(saved_at, step)
            lost_note += (f"  (lost rank(s) {', '.join(map(str, event['lost_ranks']))} at "
                          f"step {step})")
            metrics.record("recovered", **{k: v for k, v in event.items() if k != "event"})
            if rank0 and (print_every or bar is not None):
                line = (f"{label} recovered at step {step}: lost world rank(s) "
                        f"{', '.join(map(str, event['lost_ranks']))}, going on with "
                        f"{world.size} ({event['seconds']:.2f} s)")
                if bar is not None:
                    bar.write(line, file=out)
                else:
                    out.write(line + "\n")
                    out.flush()
            if world.size < min_workers:
                save("too-few-workers")
                why = (f"{world.size} worker(s) left after losing world rank(s) "
                       f"{event['lost_ranks']}, fewer than min_workers={min_workers}: "
                       + (f"checkpoint {result.checkpoint} at step {step}" if checkpoints
                          is not None else "no checkpoint folder, nothing saved"))
                metrics.record("end", step=step, stopped="too-few-workers", reason=why)
                metrics.close()
                _leave(rank0, f"{label}: {why}; exiting with {EXIT_STOPPED} to be relaunched")
            if checkpoint_every and step % checkpoint_every == 0:
                save("interval")   # an interrupted save (or one the lost rank missed)
            if undone:   # the epoch's and window's means start again from here
                t_window, window_loss, window_steps, window_samples = (
                    time.perf_counter(), 0.0, 0, 0)
                t_epoch, epoch_loss, epoch_steps, epoch_samples = t_window, 0.0, 0, 0
        result.epochs = state.epoch
        if validation is not None:
            result.val_loss = (last_val[1] if last_val[0] == strategy.step_count
                               else evaluate(model, *validation))
        metrics.record("end", step=strategy.step_count, final_loss=result.final_loss,
                       val_loss=result.val_loss, seconds=result.seconds,
                       samples_per_s=result.samples_per_second, stopped=result.stopped,
                       checkpoint=result.checkpoint)
    finally:
        if bar is not None:
            bar.close()
        metrics.close()
    return result


def _recover(strategy: Any, exc: BaseException, checkpoints: Any, label: str,
             buddy: ShardBuddy | None, marks: dict[int, Any]) -> dict[str, Any]:
    """After a failure that says a rank died: the strategy rebuilt over the
    survivors, and the ``recovered`` event; or, where that cannot be done in
    place, one line on the survivors' rank 0 and the end of the process with
    status 75. Collective over the survivors."""
    why = recoverable(strategy)
    if why is not None:
        rec = shrink_only(strategy, exc)
        _leave(rec.world.rank == 0,
               f"{label}: lost world rank(s) {rec.lost} after step {rec.step}, cannot go on "
               f"in place ({why}); exiting with {EXIT_STOPPED} to be relaunched from the "
               f"newest checkpoint")
    try:
        return recover_in_place(strategy, exc, checkpoints=checkpoints, buddy=buddy,
                                marks=marks)[1]
    except MpiShardError as error:   # ZeRO-2: no copy of the lost shard, no checkpoint
        if not hasattr(error, "first_survivor"):
            raise
        _leave(error.first_survivor, f"{label}: {error}; exiting with {EXIT_STOPPED} to be "
                                     f"relaunched")
        raise


def _leave(speak: bool, line: str) -> None:
    """End this process with status 75 after a lost rank (no ``MPI_Finalize``:
    :func:`mpishard.comm.ulfm.leave`); ``speak``: say ``line`` on stderr first."""
    if speak:
        sys.stderr.write(f"[mpishard] {line}\n")
    ulfm.leave(EXIT_STOPPED)


def _open_dataset(strategy: Any, data: Any, epochs: Any, batch_size: Any, seed: int | None,
                  shuffle: bool | None, drop_last: bool, batch_size_may_change: bool,
                  parts: int) -> tuple[Any, bool, ShardedSampler, Any]:
    """The dataset (an ``(x, y)`` pair wrapped), whether it is collective, the
    sampler at the strategy's data position, and the batch split, checked on
    every rank (warnings on rank 0). Collective over the world."""
    world, dp = strategy.config.world, strategy.dp
    collective = isinstance(data, CollectiveDataset)
    dataset, problem = data, None
    if isinstance(data, Iterator):   # unpacking it would consume a live stream
        problem = (f"data is an iterator ({type(data).__name__}): wrap an iterator of "
                   f"(inputs, targets) batches in mpishard.data.BatchStream")
    elif not (collective or isinstance(data, Dataset)):
        try:   # an (inputs, targets) pair; the same check on every rank
            dataset = ArrayDataset(*data)
        except (TypeError, ValueError) as exc:
            problem = (f"expecting an (inputs, targets) pair of arrays, a Dataset, a "
                       f"LocalDataset or a BatchStream: {exc}")
    world.agree(problem, ValueError)
    problem, sampler, split = None, None, None
    # Every rank must see the same number of samples (a stream appended to on
    # one rank only would otherwise train different batches on each).
    lengths = (world.allreduce(len(dataset), op="min"), world.allreduce(len(dataset), op="max"))
    held = strategy.data_position
    try:
        if epochs is None or batch_size is None:
            raise ValueError(f"training on a {type(dataset).__name__} needs epochs and "
                             f"batch_size, got epochs={epochs!r}, batch_size={batch_size!r}")
        if held is not None and "batches" in held:
            raise ValueError(f"the data position is a stream's ({held['batches']} batches "
                             f"read): call new_pass() to train on a dataset")
        if lengths[0] != lengths[1]:
            raise ValueError(f"the ranks hold data of different lengths: {len(dataset)} "
                             f"samples here, between {lengths[0]} and {lengths[1]} over the "
                             f"world; every rank passes the same data (or a LocalDataset)")
        if collective and getattr(dataset.comm, "comm", None) is not dp.comm:
            raise ValueError(f"{type(dataset).__name__} exchanges rows over the "
                             f"{dataset.comm.name} group, but the strategy's data-parallel "
                             f"group is another: build it with the strategy's configuration")
        if (collective and held is not None and int(held["samples_consumed"]) > 0
                and int(held.get("num_samples", len(dataset))) != len(dataset)):
            # Rows added on any rank but the last shift the union's indices: the
            # rest of the epoch would repeat some samples and skip others.
            raise ValueError(f"the rank-local data changed from {held['num_samples']} to "
                             f"{len(dataset)} samples in the middle of epoch "
                             f"{held['epoch']}: finish the epoch on the rows it started "
                             f"with, or call new_pass()")
        split = split_batch(batch_size, dp.size, parts)
        if not drop_last and parts > strategy.accumulation_steps:
            raise ValueError("drop_last=False is not available for a pipelined model "
                             f"({parts // strategy.accumulation_steps} micro-batches): its "
                             f"micro-batches must be equal")
        if not isinstance(epochs, numbers.Integral) or epochs < 0:
            raise ValueError(f"epochs must be a non-negative integer, got {epochs!r}")
        sampler = _sampler(held, len(dataset), batch_size, seed, shuffle, drop_last)
    except ValueError as exc:
        problem = str(exc)
    world.agree(problem, ValueError)
    if held is not None and world.rank == 0:
        for text in position_conflicts(held, seed=seed, shuffle=shuffle,
                                       batch_size=None if batch_size_may_change else batch_size):
            warnings.warn(f"optimize(): {text}", DataPositionWarning, stacklevel=4)
    assert sampler is not None and split is not None
    return dataset, collective, sampler, split


def _open_stream(strategy: Any, stream: BatchStream, epochs: Any, batch_size: Any,
                 seed: int | None, shuffle: bool | None) -> dict[str, int]:
    """The data position of a stream placed at the strategy's (batches before it
    skipped, or none): ``batches`` (the index of the next batch) and
    ``samples_consumed`` (the rows read before it), the other keys of a
    position (``epoch`` 0, ``num_samples`` = ``samples_consumed``, ``seed``
    and ``shuffle`` 0, ``batch_size`` the last batch's rows) for checkpoints.
    Collective over the world."""
    world = strategy.config.world
    held, problem = strategy.data_position, None
    if epochs is not None:
        problem = (f"a BatchStream has no epochs: it trains one step per batch until it "
                   f"ends (or max_steps, a stop); got epochs={epochs!r}, expecting None")
    elif seed is not None or shuffle is not None:
        problem = (f"a BatchStream yields its batches in its own order: seed and shuffle "
                   f"do not apply (got seed={seed!r}, shuffle={shuffle!r})")
    elif batch_size is not None and (not isinstance(batch_size, numbers.Integral)
                                     or batch_size < 1):
        problem = f"batch_size must be a positive integer or None, got {batch_size!r}"
    elif held is not None and "batches" not in held:
        problem = (f"the data position is a dataset's (epoch {held['epoch']}, "
                   f"{held['samples_consumed']} samples in): call new_pass() to train on "
                   f"a stream")
    world.agree(problem, ValueError)
    at = None if held is None else int(held["batches"])
    index = stream.start(at, world)
    consumed = 0 if held is None else int(held["samples_consumed"])
    last = int(held["batch_size"]) if held is not None else int(batch_size or 0)
    return {"epoch": 0, "samples_consumed": consumed, "seed": 0, "batch_size": last,
            "num_samples": consumed, "shuffle": 0, "batches": index}


def _sampler(position: dict[str, int] | None, num_samples: int, batch_size: int,
             seed: int | None, shuffle: bool | None, drop_last: bool) -> ShardedSampler:
    """A sampler at the strategy's data position (its epoch finishing over the
    samples it started with; more samples join at the next epoch), or at the
    start of epoch 0."""
    seed = 0 if seed is None else seed
    shuffle = True if shuffle is None else shuffle
    if position is None:
        return ShardedSampler(num_samples, batch_size, seed=seed, shuffle=shuffle,
                              drop_last=drop_last)
    if batch_size > num_samples:
        raise ValueError(f"global batch size {batch_size} is larger than the dataset "
                         f"({num_samples} samples)")
    return ShardedSampler.from_position(position, batch_size, drop_last, seed=seed,
                                        shuffle=shuffle, num_samples=num_samples)
