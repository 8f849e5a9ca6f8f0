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
"""

from __future__ import annotations

import datetime
import numbers
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from ..data import ArrayDataset, ShardedSampler, rank_rows, split_batch
from ..protocols import Dataset
from .evaluate import evaluate
from .progress import Metrics, clock, progress_bar
from .result import TrainResult
from .signals import StopRequest

__all__ = ["run_training"]


def run_training(strategy: Any, model: Any, data: Any, epochs: int, batch_size: int, *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                 callback: Callable[[int, float], Any] | None = None,
                 stop: StopRequest | None = None, max_steps: int | None = None,
                 checkpoints: Any = None, checkpoint_every: int = 0,
                 validation: tuple[Any, Any] | None = None,
                 metrics_path: str | None = None, append_metrics: bool = False,
                 progress: bool = False, out: TextIO | None = None, log_every: int = 10,
                 print_every: int = 0, label: str = "train",
                 start_record: dict[str, Any] | None = None) -> TrainResult:
    """Train ``model`` with ``strategy`` until ``epochs`` epochs are complete in
    total (see the module docstring), ``max_steps`` is reached, or a stop.
    Collective over ``strategy.config.world``.

    Args:
        strategy: a parallel-core strategy (``attach``, ``backward``, ``step``,
            ``data_position``); the model is attached if it is not yet.
        data: a :class:`~mpishard.protocols.Dataset` or an ``(inputs, targets)``
            pair of arrays (wrapped in :class:`~mpishard.data.ArrayDataset`).
            Every rank passes the same data; each reads only its rows.
        batch_size: the global batch, split evenly over the data-parallel ranks
            and then into ``accumulation_steps`` micro-batches (and a pipelined
            model's micro-batches). The shuffle of an epoch depends on
            ``(seed, epoch)`` only, so any world size sees the same batches.
        shuffle, seed: the sampler's; a strategy with a ``data_position`` (one
            restored from a checkpoint, or trained before) keeps its own.
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

    Raises:
        ValueError: on every rank: ``batch_size`` does not split over the ranks
            and micro-batches, exceeds the dataset, or the data position was
            made for another number of samples.
    """
    world = strategy.config.world
    rank0 = world.rank == 0
    if strategy.model is not model:
        strategy.attach(model)
    dataset = data if isinstance(data, Dataset) else ArrayDataset(*data)
    dp = strategy.dp
    micro = strategy.accumulation_steps
    problem, sampler, split = None, None, None
    try:
        # A pipelined model cuts each micro-batch again into its own micro-batches.
        pipeline = getattr(model, "micro_batches", 1)
        split = split_batch(batch_size, dp.size, micro * pipeline)
        if not drop_last and pipeline > 1:
            raise ValueError("drop_last=False is not available for a pipelined model "
                             f"({pipeline} micro-batches): its micro-batches must be equal")
        if not isinstance(epochs, numbers.Integral) or epochs < 0:
            raise ValueError(f"epochs must be a non-negative integer, got {epochs!r}")
        sampler = _sampler(strategy.data_position, len(dataset), batch_size, seed, shuffle,
                           drop_last)
    except ValueError as exc:
        problem = str(exc)
    world.agree(problem, ValueError)
    assert sampler is not None and split is not None
    position = strategy.data_position = sampler.position()
    state = sampler.state
    local = split.local_size
    x_full, y_full = dataset.buffers(local, strategy.xp, model.params.dtype)

    start_step = strategy.step_count
    result = TrainResult(first_step=start_step, last_step=start_step)
    per_epoch = sampler.batches_per_epoch
    total_steps = epochs * per_epoch
    if max_steps is not None:
        total_steps = min(total_steps, max_steps)
    out = out or sys.stdout
    metrics = Metrics(metrics_path if rank0 else None, append_metrics)
    bar = progress_bar(total_steps, start_step, label, out) if rank0 and progress else None
    saved_at = start_step   # a resumed run has its starting point on disk already
    last_val = (-1, float("nan"))

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
        if max_steps is not None and strategy.step_count >= max_steps:
            result.stopped = "max_steps"
        while result.stopped is None and state.epoch < epochs:
            # --- one step: this rank's rows of the global batch -----------------
            rows = sampler.current_batch_size()
            lo, hi = rank_rows(rows, dp.size, dp.rank)
            n = hi - lo
            x, y = (x_full, y_full) if n == local else (x_full[:n], y_full[:n])
            dataset.gather(sampler.batch_indices(lo, hi), x, y)
            for k in range(micro):
                # Micro-batches as even as the ranks' shares; backward() weights each
                # by its rows, so a short, unequal last batch is still its exact mean.
                a, b = k * n // micro, (k + 1) * n // micro
                strategy.backward(x[a:b], y[a:b], batch_start=lo + a, global_rows=rows)
            loss = strategy.step()
            epoch_before = state.epoch
            sampler.advance()
            position["epoch"] = state.epoch
            position["samples_consumed"] = state.samples_consumed
            step = strategy.step_count
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
                bar.set_postfix_str(f"loss {loss:.4f}, {result.samples / elapsed:,.0f} "
                                    f"samples/s", refresh=False)   # tqdm puts ", " before it
                bar.update(1)
            if metrics.active:
                window_loss += loss
                window_steps += 1
                window_samples += rows
                if window_steps >= log_every:
                    now = time.perf_counter()
                    metrics.record("step", step=step, epoch=state.epoch,
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
                    val = f"  val {values['val_loss']:.4f}" if validation is not None else ""
                    line = (f"{label} epoch {state.epoch:>3}/{epochs}  step {step:>5}  "
                            f"loss {values['loss']:.4f}{val}  "
                            f"{values['samples_per_s']:,.0f} samples/s  eta {clock(remaining)}")
                    if bar is not None:
                        bar.write(line, file=out)   # above the bar
                    else:
                        out.write(line + "\n")
                        out.flush()
                t_epoch, epoch_loss, epoch_steps, epoch_samples = time.perf_counter(), 0.0, 0, 0

        result.seconds = time.perf_counter() - t_start
        save(result.stopped or "end")
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


def _sampler(position: dict[str, int] | None, num_samples: int, batch_size: int, seed: int,
             shuffle: bool, drop_last: bool) -> ShardedSampler:
    """A sampler at the strategy's data position, or at the start of epoch 0."""
    if position is None:
        return ShardedSampler(num_samples, batch_size, seed=seed, shuffle=shuffle,
                              drop_last=drop_last)
    if int(position["num_samples"]) != num_samples:
        raise ValueError(f"the data has {num_samples} samples but the data position "
                         f"(restored from a checkpoint?) counts {position['num_samples']}")
    if batch_size > num_samples:
        raise ValueError(f"global batch size {batch_size} is larger than the dataset "
                         f"({num_samples} samples)")
    return ShardedSampler.from_position(position, batch_size, drop_last)
