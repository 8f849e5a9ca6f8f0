"""``Trainable``: the ``optimize()`` method the public strategies add to their parallel core."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .loop import run_training
from .result import TrainResult

__all__ = ["Trainable"]


class Trainable:
    """Mixin giving a parallel-core strategy (:mod:`mpishard.parallel`) the training
    loop as ``optimize()``: ``class DDPOptimizer(Trainable, parallel.DDPOptimizer)``.
    """

    def optimize(self, model: Any, data: Any, epochs: int | None = None,
                 batch_size: int | None = None, *,
                 shuffle: bool | None = None, seed: int | None = None, drop_last: bool = True,
                 callback: Callable[[int, float], Any] | None = None,
                 **options: Any) -> TrainResult:
        """Train ``model`` on ``data`` with global batch ``batch_size`` until
        ``epochs`` epochs are complete in total (or, on a stream of batches,
        until it ends). Collective over the world of the strategy's
        configuration.

        Args:
            model: a model (:class:`~mpishard.protocols.Model`); attached to the
                strategy if it is not yet.
            data: one of
                * an ``(inputs, targets)`` pair of arrays (NumPy, CuPy, or h5py
                  datasets: rows are read on demand), wrapped in
                  :class:`~mpishard.data.ArrayDataset`;
                * a :class:`~mpishard.protocols.Dataset`: ``len(data)``,
                  ``data.buffers(rows, xp, float_dtype) -> (x_out, y_out)``
                  (called once) and ``data.gather(indices, x_out, y_out)``
                  (each step, this rank's rows; not collective), such as
                  :class:`~mpishard.data.ArrayDataset`,
                  :class:`~mpishard.data.StreamingDataset` (appended to between
                  calls) or :class:`~mpishard.data.HDF5Dataset`. Every rank
                  passes the same data and reads only its rows of each batch;
                * a :class:`~mpishard.protocols.CollectiveDataset` such as
                  :class:`~mpishard.data.LocalDataset`: each rank holds its own
                  rows, the dataset is their union in data-parallel rank order,
                  and each batch's rows move to the ranks that train on them;
                * a :class:`~mpishard.data.BatchStream`: an iterable of global
                  batches ``(x, y)`` that arrive while training runs (a
                  simulation's snapshots), one optimizer step each, in their
                  order, until it ends (``result.stopped == "exhausted"``);
                  every rank yields the whole batch, or with ``local=True`` its
                  own rows of it. No epochs, seed or shuffle (leave them None);
                  the data position counts its batches
                  (:mod:`mpishard.data.stream`).

                Data may grow between calls (never shrink): each epoch covers the
                samples present when it starts.
            epochs: (required, except for a stream, where it is None) the
                total, counted from epoch 0 of the data position: after
                a checkpoint is loaded (or a first ``optimize()``), the call trains
                only the epochs left, so ``optimize(model, data, epochs=10, ...)``
                resumes a job of 10 epochs wherever it stopped, and a partly done
                epoch counts as not done. :meth:`new_pass` starts the count again.
            batch_size: the global batch, split evenly across the data-parallel
                ranks (then into ``accumulation_steps`` micro-batches). Required,
                except for a stream: None (any size), or the size every one of
                its global batches must have (checked).
            shuffle: shuffle each epoch (default True). The order of epoch ``e``
                is the permutation of ``(seed, e)``, whatever the number of
                ranks, so any world size sees the same batches.
            seed: the shuffle seed (default 0).
            drop_last: True (default) drops an epoch's last batch shorter than
                ``batch_size``; False trains it too, split over the ranks as
                evenly as possible (not for pipelined models).
            callback: ``callback(step, loss)`` after every step, ``step`` counted
                from 1 over the strategy's life (``step_count`` after the step),
                ``loss`` the global mean loss of the batch; returning True stops
                training there (``result.stopped == "callback"``); it must return
                the same on every rank (unless a ``stop`` request is given).
            options: the loop's (:func:`~mpishard.train.run_training`):
                ``progress``, ``metrics_path``, ``checkpoints`` with
                ``checkpoint_every``, ``max_steps``, ``stop``, ``validation``.

        A call that continues a data position (restored by ``load_checkpoint``
        or left by an earlier call) uses the position's seed and shuffle; a
        ``seed``, ``shuffle`` or ``batch_size`` that differs from the position's
        is reported once, on rank 0, as a
        :class:`~mpishard.data.DataPositionWarning` saying what is used (the
        batch size passed is used: the position is counted in samples).

        Returns:
            a :class:`~mpishard.train.TrainResult` (``losses``, ``final_loss``,
            ``steps``, ``epochs``, ``stopped``: None when every epoch ran,
            ``"exhausted"`` when a stream ended, else why it stopped early).

        Raises:
            ValueError: on every rank: ``batch_size`` does not split across the
                ranks and micro-batches or exceeds the dataset; the data shrank
                below the position's epoch; the ranks' data lengths differ; a
                stream's batches disagree between ranks, or it starts after the
                data position; a stream continues a dataset's position or the
                other way round (call :meth:`new_pass` first).
        """
        return run_training(self, model, data, epochs, batch_size, shuffle=shuffle, seed=seed,
                            drop_last=drop_last, callback=callback, **options)

    def new_pass(self) -> None:
        """Forget the data position: the next :meth:`optimize` starts at epoch 0
        of its data (all of it, however it has grown), with the seed and shuffle
        it is given, and counts ``epochs`` from there. The step count, model and
        optimizer state are kept; a stream's batch count starts again at its
        own index. Local (every rank calls it)."""
        self.data_position = None
