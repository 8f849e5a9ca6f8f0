"""The serial reference of the distributed tests: one process on each whole global batch.

A distributed test trains with a strategy over its ranks and compares with this run,
computed in the same test. The reference knows nothing of the strategies under
test: one plain model (a ``ParallelMLP`` or ``GPT`` built without groups is the
serial model), the optimizer's ``update`` called directly, one step per global
batch. What a strategy does over its ranks (split the batch, accumulate
micro-batches, reduce in buckets, shard the optimizer state) must not change the
result, so the reference states the training rules once:

* step ``s`` (counted from 1) trains on the whole global batch ``s``: its loss is
  ``model.forward_backward(x, y)`` on all the batch's rows, whatever the split;
* clipping by global norm: the gradient's 2-norm, summed in float64 over the whole
  model, and the coefficient ``min(1, max_grad_norm / (norm + 1e-6))``;
* the learning rate of step ``s`` is ``optimizer.lr * schedule(s)`` (no schedule: 1);
* ``batch_context=True``: ``model.set_batch_context(s - 1, 0, rows)`` before each
  step, so dropout draws the masks of rows ``0..rows`` of batch ``s - 1`` (a strategy
  that says where each rank's rows sit in the global batch draws the same);
* the data order is the strategies' (:func:`sampler_batches`: ``ShardedSampler``,
  the whole batch as rank 0 of one rank reads it), or any list of global batches
  (a stream, hand-made batches of unequal pieces).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from mpishard.data import ShardedSampler

__all__ = ["SerialRun", "assert_shards_match", "classification_data", "sampler_batches",
           "train_serial"]


class SerialRun(NamedTuple):
    """What :func:`train_serial` returns."""

    model: Any          # the trained model (its params: the reference parameters)
    losses: np.ndarray  # the loss of each step, on its whole global batch
    norms: np.ndarray   # the gradient norm of each step, before clipping

    @property
    def params(self) -> np.ndarray:
        """A copy of the trained parameters."""
        return self.model.params.copy()


def classification_data(n: int = 96, features: int = 5, classes: int = 3,
                        seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of ``features`` normal inputs and the class (of ``classes``) a
    noisy random linear map picks: the small problem the strategy tests share."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features))
    w = rng.standard_normal((features, classes))
    y = np.argmax(x @ w + 0.3 * rng.standard_normal((n, classes)), axis=1)
    return x, y


def train_serial(model, optimizer, batches: Iterable[tuple[np.ndarray, np.ndarray]], *,
                 max_grad_norm: float | None = None,
                 schedule: Callable[[int], float] | None = None,
                 batch_context: bool = False,
                 state: dict[str, np.ndarray] | None = None) -> SerialRun:
    """Train ``model`` in place, one ``optimizer.update`` per global batch of ``batches``.

    ``max_grad_norm`` clips by global norm, ``schedule(step)`` scales the learning
    rate, ``batch_context`` places each batch at rows ``0..rows`` for dropout (the
    rules: this module's docstring). ``state``: the optimizer's state to start
    from and update in place (the caller reads it after); fresh when None.
    """
    if state is None:
        state = optimizer.init_state(model.params.size, model.params.dtype, np)
    losses, norms = [], []
    for step, (x, y) in enumerate(batches, 1):
        if batch_context:
            model.set_batch_context(step - 1, 0, len(x))
        losses.append(model.forward_backward(x, y))
        norm = math.sqrt(float(np.sum(model.grads.astype(np.float64) ** 2)))
        norms.append(norm)
        coef = 1.0
        if max_grad_norm is not None:
            coef = min(1.0, max_grad_norm / (norm + 1e-6))
        lr = optimizer.lr * (schedule(step) if schedule is not None else 1.0)
        optimizer.update(model.params, model.grads, state, step, lr, coef)
    return SerialRun(model, np.array(losses), np.array(norms))


def sampler_batches(x: np.ndarray, y: np.ndarray, batch_size: int, epochs: int | None = None,
                    *, steps: int | None = None, seed: int = 0,
                    drop_last: bool = True) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The global batches of ``(x, y)`` in the strategies' order, for ``epochs``
    epochs or the first ``steps`` batches: ``ShardedSampler(len(x), batch_size,
    seed, drop_last)``, the whole batch of each step (a short last one of an epoch
    when not ``drop_last``)."""
    if (epochs is None) == (steps is None):
        raise ValueError(f"expecting epochs or steps, got epochs={epochs}, steps={steps}")
    sampler = ShardedSampler(len(x), batch_size, seed=seed, drop_last=drop_last)
    given = 0
    while (sampler.state.epoch < epochs) if steps is None else (given < steps):
        idx = sampler.batch_indices(0, sampler.current_batch_size())
        yield x[idx], y[idx]
        given += 1
        sampler.advance()


def assert_shards_match(model, serial, rtol: float = 1e-10) -> None:
    """Every local tensor of a sharded ``model`` (tensor or pipeline parallel) equals
    its slice of the ``serial`` model's logical tensor, and together they cover
    ``model.params``."""
    checked = 0
    for name, shard in model.tensor_shards().items():
        local = model.layout.view(model.params, name)
        full = serial.layout.view(serial.params, shard.logical_name)
        np.testing.assert_allclose(local, full[shard.index], rtol=rtol, atol=rtol * 1e-2,
                                   err_msg=name)
        checked += local.size
    assert checked == model.params.size
