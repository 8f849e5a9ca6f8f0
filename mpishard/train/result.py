"""``TrainResult``: what every training run returns (``optimize()``, ``mpishard train``)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TrainResult"]


@dataclass
class TrainResult:
    """What [`run_training`][mpishard.train.run_training] returns, the same on every rank.

    Attributes:
        losses: the global mean loss (over the rows of the global batch) of each
            step this call ran.
        steps: optimizer steps this call took (updates; a step refused with
            ``nonfinite="skip"`` is not one, as in ``step_count``).
        skipped_steps: steps this call refused (``nonfinite="skip"``); their
            losses are in ``losses`` too.
        epochs: epochs complete in total when the call returned (counting from
            epoch 0, so those before a resume count too).
        seconds: wall-clock seconds of the loop.
        samples: samples trained on by this call (all ranks together).
        stopped: why training ended before ``epochs`` epochs were complete:
            ``"SIGUSR1"``, ``"SIGTERM"`` (or the reason given to
            [`request`][mpishard.train.StopRequest.request]), ``"callback"`` (the
            callback returned True), ``"max_steps"``, or ``"exhausted"`` (a
            [`BatchStream`][mpishard.data.BatchStream] ended: its normal end); ``None``
            when every epoch ran.
        first_step, last_step: the strategy's step count when the call began and
            when it returned.
        val_loss: the validation loss at the end (nan without validation data).
        checkpoint: the path of the last checkpoint this call wrote, or None.
        recoveries: one ``recovered`` event (a dict: ``lost_ranks``, ``step``,
            ``world_size``, ``seconds``, ...) per lost rank this call went on
            without, in place (fault tolerance on; see
            [`recover_in_place`][mpishard.recovery.recover_in_place]); empty otherwise.
        spare: on a spare rank (``ShardingConfiguration(spares=K)``): ``"unused"``,
            released at the end without being promoted (nothing else is set), or
            ``"promoted"``, it took a lost rank's place (its figures are then the
            run's); None on the other ranks.
    """

    losses: list[float] = field(default_factory=list)
    steps: int = 0
    skipped_steps: int = 0
    epochs: int = 0
    seconds: float = 0.0
    samples: int = 0
    stopped: str | None = None
    first_step: int = 0
    last_step: int = 0
    val_loss: float = float("nan")
    checkpoint: str | None = None
    recoveries: list[dict] = field(default_factory=list)
    spare: str | None = None

    @property
    def samples_per_second(self) -> float:
        """``samples / seconds`` (nan when no time passed)."""
        return self.samples / self.seconds if self.seconds > 0 else float("nan")

    @property
    def final_loss(self) -> float:
        """The global mean loss of the last step run (nan when none ran)."""
        return self.losses[-1] if self.losses else float("nan")
