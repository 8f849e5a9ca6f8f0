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

    def optimize(self, model: Any, data: Any, epochs: int, batch_size: int, *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                 callback: Callable[[int, float], Any] | None = None,
                 **options: Any) -> TrainResult:
        """Train ``model`` on ``data`` with global batch ``batch_size`` until
        ``epochs`` epochs are complete in total. Collective over the world of
        the strategy's configuration.

        ``epochs`` counts from epoch 0: after a checkpoint is loaded (or a first
        ``optimize()``), the call trains only the epochs left, so ``optimize(model,
        data, epochs=10, ...)`` resumes a job of 10 epochs wherever it stopped.

        ``data`` is an ``(inputs, targets)`` pair of arrays (every rank passes the
        same data; each reads only its rows of each batch) or a
        :class:`~mpishard.protocols.Dataset` such as
        :class:`~mpishard.data.ArrayDataset` or
        :class:`~mpishard.hdf5data.HDF5Dataset`. Each global batch is split evenly
        across the data-parallel ranks and then into micro-batches; the shuffle of
        an epoch depends on ``(seed, epoch)`` only, so any world size sees the same
        batches. ``drop_last=False`` trains the last, short batch of each epoch
        too. ``callback(step, loss)`` runs after every step; returning True stops
        training there (``result.stopped == "callback"``); it must return the same
        on every rank. ``options`` go to :func:`~mpishard.train.run_training`
        (``progress``, ``metrics_path``, ``checkpoints``, ``checkpoint_every``,
        ``max_steps``, ``stop``, ``validation``, ...).

        Returns:
            a :class:`~mpishard.train.TrainResult` (``losses``, ``final_loss``, ...).

        Raises:
            ValueError: ``batch_size`` does not split across the ranks and
                micro-batches, or exceeds the dataset (on every rank).
        """
        return run_training(self, model, data, epochs, batch_size, shuffle=shuffle, seed=seed,
                            drop_last=drop_last, callback=callback, **options)
