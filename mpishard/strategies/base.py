"""``Strategy``: what every public strategy is, a parallel core and the training loop."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ..flat import Range
from ..protocols import Model, StrategyCore
from ..train import TrainResult, run_training

__all__ = ["Strategy"]


class Strategy:
    """Base of the public strategies: a parallel core (``core``, from
    [`mpishard.parallel`][mpishard.parallel]) and the one training loop as ``optimize``.

    The core's methods and attributes are the strategy's (``backward``,
    ``step``, ``memory_report``, ``step_count``, ...): this class names the
    documented ones, and any other attribute is read from the core; a write to
    a name of the core goes to the core (``ddp.skipped_steps = 0``,
    ``ddp.schedule = f``: the option, checked), so nothing is hidden here.
    """

    def __init__(self, core: StrategyCore) -> None:
        #: The parallel core that does the work (attach, backward, step, state).
        self.core = core

    # --- training -----------------------------------------------------------------
    def optimize(self, model: Model, data: Any, epochs: int | None = None,
                 batch_size: int | None = None, *, shuffle: bool | None = None,
                 seed: int | None = None, drop_last: bool = True,
                 callback: Callable[[int, float], Any] | None = None,
                 **options: Any) -> TrainResult:
        """Train ``model`` on ``data`` with global batch ``batch_size`` until
        ``epochs`` epochs are complete in total (a stream: until it ends).
        Collective over ``config.world``.

        ``data``: an ``(inputs, targets)`` pair of arrays (NumPy, CuPy, h5py
        datasets), a [`Dataset`][mpishard.protocols.Dataset], a
        [`CollectiveDataset`][mpishard.protocols.CollectiveDataset] such as
        [`LocalDataset`][mpishard.data.LocalDataset], or a
        [`BatchStream`][mpishard.data.BatchStream]. ``callback(step, loss)`` runs after
        every step; True stops there. ``options``: ``progress``,
        ``print_every``, ``metrics_path``, ``checkpoints`` with
        ``checkpoint_every``, ``max_steps``, ``stop``, ``validation``, ... (the
        fields of [`Sampling`][mpishard.train.Sampling],
        [`Reporting`][mpishard.train.Reporting] and
        [`Checkpointing`][mpishard.train.Checkpointing]). The rules (epochs are a total,
        the data position wins, ...) are on the docs site's training-loop page.

        Returns:
            a [`TrainResult`][mpishard.train.TrainResult].

        Raises:
            ValueError: on every rank, for data, a batch size or epochs that
                cannot be trained (the message says which and why).
        """
        return run_training(self.core, model, data, epochs, batch_size, callback=callback,
                            shuffle=shuffle, seed=seed, drop_last=drop_last, **options)

    def new_pass(self) -> None:
        """Forget the data position: the next ``optimize`` starts at epoch 0.
        Local (every rank calls it)."""
        self.core.set_progress(data_position=None)

    # --- the core's interface -----------------------------------------------------
    def attach(self, model: Model) -> None:
        """Attach ``model`` (see the core). Collective over ``groups.dp``."""
        self.core.attach(model)

    def backward(self, x: Any, y: Any, *, batch_start: int | None = None,
                 global_rows: int | None = None) -> float:
        """Forward and backward on this rank's micro-batch; its local mean loss.
        Collective over ``groups.dp``."""
        return self.core.backward(x, y, batch_start=batch_start, global_rows=global_rows)

    def step(self) -> float:
        """Reduce, check, clip and update; the global mean loss. Collective over
        ``groups.dp`` (the world for hybrid layouts)."""
        return self.core.step()

    def train_step(self, x: Any, y: Any) -> float:
        """One step on this rank's batch in ``accumulation_steps`` micro-batches.
        Collective over ``groups.dp``."""
        return self.core.train_step(x, y)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients of the ``backward`` calls inside without communicating."""
        with self.core.no_sync():
            yield

    def verify_in_sync(self) -> None:
        """Check that every replica holds the same parameters. Collective over ``groups.dp``."""
        self.core.verify_in_sync()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by kind, with the total and the peak. Local."""
        return self.core.memory_report()

    def optimizer_state_shard(self) -> tuple[Range, dict[str, Any]]:
        """The world range of the optimizer state this rank holds, and the state. Local."""
        return self.core.optimizer_state_shard()

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[Any]:
        """The whole parameter vector for the ``with`` block (``model.params``; its
        ``forward`` on one rank alone). Under ZeRO-3 gathered on entry (collective
        over ``groups.dp``), each rank keeping its shard of it on exit; otherwise
        the model's own vector (local)."""
        with self.core.gathered_parameters() as params:
            yield params

    def synchronize_optimizer_state(self) -> dict[str, Any]:
        """The whole optimizer state on every rank. Collective over ``groups.dp``."""
        return self.core.synchronize_optimizer_state()

    def current_lr(self) -> float:
        """The learning rate of the current step, schedule applied."""
        return self.core.current_lr()

    def reset_timings(self) -> None:
        self.core.reset_timings()

    @property
    def step_count(self) -> int:
        """Optimizer steps taken over the strategy's life (restored from checkpoints)."""
        return self.core.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.core.set_progress(step_count=value)

    @property
    def data_position(self) -> dict[str, int] | None:
        """Where training is in the data (saved and restored with checkpoints)."""
        return self.core.data_position

    @data_position.setter
    def data_position(self, value: dict[str, int] | None) -> None:
        self.core.set_progress(data_position=value)

    def __getattr__(self, name: str) -> Any:
        # config, dp, model, optimizer, options, state, timings, skipped_steps, ...
        if name == "core":   # not set yet (during construction)
            raise AttributeError(name)
        return getattr(self.core, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # A name of the core (skipped_steps, an option such as schedule) is written
        # there, where it is read: not onto this facade, which would hide it.
        core = self.__dict__.get("core")
        if (core is None or name in self.__dict__ or hasattr(type(self), name)
                or not hasattr(core, name)):
            object.__setattr__(self, name, value)
        else:
            setattr(core, name, value)
