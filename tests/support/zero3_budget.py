"""The ZeRO-3 budget tests' model, budget and peak (``tests/mpi/test_zero3_budget.py``,
``tests/faults/test_zero3_budget_ulfm.py``).

A float64 GPT whose whole parameter vector with its Adam state (``3 P`` bytes,
``P`` the parameters' bytes) exceeds a per-rank budget at 4 ranks, while its
ZeRO-3 shard fits: the budget is ``k P / N`` (``k`` vectors sharded over ``N``
ranks: the parameters, the reduced gradient and the two Adam moments, 4; more
where a phase holds more, such as the buddy copies of fault tolerance) plus a
fixed allowance for what does not scale with the model (gathered and gradient
buckets, workspaces, a layer's scratch at construction, a checkpoint's pieces).

The peak is tracemalloc's (NumPy registers its buffers with it), less what was
held before the measured region (the imports and JIT compilations, done by
``warm_up`` first). The serial reference is computed once, on rank 0, the
budget not yet enforced (the test's own process: the "machine with the
memory"), and broadcast: ``serial_reference``.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from typing import Any, NamedTuple

import numpy as np
from reference import train_serial

from mpishard import ShardingConfiguration
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.kernels.select import FUSED_MIN_ELEMENTS
from mpishard.nn import GPT
from mpishard.optim import AdamW
from mpishard.strategies import ZeRO3Optimizer
from mpishard.train import evaluate

__all__ = ["ALLOWANCE", "BLOCK", "OPTIONS", "STEPS", "Peak", "Reference", "batch", "budget",
           "make", "optimizer", "serial_reference", "warm_up"]

# 16 blocks of 111,936 parameters (0.85 MiB) and few tokens: the parameters, not
# the activations, are what does not fit. One row of SEQ tokens a rank.
VOCAB, SEQ, D, HEADS, LAYERS = 64, 4, 96, 4, 16       # 1.8M parameters, P = 13.8 MiB
STEPS = 3
OPTIONS = {"bucket_mb": 1.0, "gather_mb": 1.0}        # one block a bucket
BLOCK = 12 * D * D + 13 * D                            # a TransformerBlock's parameters
PARAMETERS = LAYERS * BLOCK + (VOCAB + SEQ) * D + 2 * D + D * VOCAB
# What does not scale with the model: 8 blocks (the gathered buckets, in use and
# prefetched; the two gradient slots; the reduce method's measurement at attach;
# a layer's scratch and draws at construction) and 6 MiB (the workspaces of the
# training and the evaluation, a checkpoint's pieces). Measured at 1 rank, the
# most: 6.2 blocks (5.3 MiB) at the attach, 11.2 MiB in all after the save.
ALLOWANCE = 8 * BLOCK * 8 + 6 * 2**20


def make(**kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The GPT's ``(class, *args)`` and keyword arguments (float64, seed 4)."""
    return (GPT, VOCAB, SEQ, D, HEADS, LAYERS), dict(dtype=np.float64, seed=4, **kwargs)


def optimizer() -> AdamW:
    return AdamW(lr=1e-3, weight_decay=0.01)


def batch(step: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Global batch ``step``: ``rows`` rows of SEQ tokens and their next tokens."""
    rng = np.random.default_rng([21, step])
    x = rng.integers(0, VOCAB, (rows, SEQ))
    return x, np.roll(x, -1, axis=1)


def budget(parameter_bytes: int, ranks: int, shards: int = 4) -> int:
    """The per-rank budget at ``ranks`` ranks: ``shards`` shards of the vector
    (4: the parameters, the reduced gradient and the two Adam moments; 7 in a
    load, which holds 3 more, what it read, until all is verified) and the
    allowance."""
    return shards * parameter_bytes // ranks + ALLOWANCE


def warm_up(comm: Any, path: str | None) -> None:
    """Everything once on a tiny model, outside the measured region: the imports
    and JIT compilations (numba's: tens of MiB of Python objects, once per
    process) are a fixed cost, not the model's. A save and a load at ``path``
    (None: none). Collective over ``comm``."""
    config = ShardingConfiguration(comm)
    zero3 = ZeRO3Optimizer(optimizer(), config, **OPTIONS)
    model = zero3.build(GPT, VOCAB, SEQ, 8, 2, 1, dtype=np.float64, seed=1)
    x, y = batch(0, comm.size)
    zero3.train_step(x[:1], y[:1])
    evaluate(model, x, y, batch=4)
    if path is not None:
        save_checkpoint(path, model, zero3)
        load_checkpoint(path, model, zero3)
    config.free()
    # The fused update runs on shards of at least FUSED_MIN_ELEMENTS: compile it here.
    opt, vector = optimizer(), np.zeros(FUSED_MIN_ELEMENTS)
    opt.update(vector, vector.copy(), opt.init_state(vector.size, vector.dtype, np), 1, 1e-3,
               1.0)


class Reference(NamedTuple):
    """The serial run's results, on every rank."""

    params: np.ndarray          # the parameters after the steps
    state: dict[str, np.ndarray]
    losses: np.ndarray
    evaluation: float           # evaluate() on the held-out batch after the steps


def serial_reference(comm: Any, batches: list[tuple[np.ndarray, np.ndarray]],
                     held_out: tuple[np.ndarray, np.ndarray]) -> Reference:
    """One process on each whole global batch of ``batches``
    (``tests/support/reference.py``), computed on rank 0 of ``comm`` (an mpi4py
    communicator) and broadcast: a real reference, once per job instead of once
    per rank."""
    values: tuple[Any, ...] = ()
    if comm.rank == 0:
        args, kwargs = make()
        serial = args[0](*args[1:], **kwargs)
        opt = optimizer()
        state = opt.init_state(serial.params.size, serial.params.dtype, np)
        run = train_serial(serial, opt, batches, state=state)
        values = (serial.params, state, run.losses, evaluate(serial, *held_out, batch=1))
    # The others wait asleep: a rank spinning in the Bcast would take the cores
    # rank 0 computes on (the tests oversubscribe them).
    ready = comm.Ibarrier()
    while not ready.Test():
        time.sleep(0.01)
    meta = comm.bcast(None if comm.rank else
                      (sorted(values[1]), values[2], values[3]), root=0)
    names, losses, evaluation = meta
    params = values[0] if comm.rank == 0 else np.empty(PARAMETERS)
    state = values[1] if comm.rank == 0 else {name: np.empty(PARAMETERS) for name in names}
    for vector in [params] + [state[name] for name in names]:
        comm.Bcast(vector, root=0)
    return Reference(params, state, np.asarray(losses), float(evaluation))


class Peak:
    """tracemalloc's peak above ``base`` (what was held at the start), over ``with``
    blocks, by phase."""

    def __init__(self) -> None:
        self.peak = 0
        self.base = 0
        self.phases: dict[str, int] = {}

    def start(self) -> None:
        """Start tracing; what is held now is the base."""
        tracemalloc.start()
        gc.collect()
        self.base = tracemalloc.get_traced_memory()[0]

    def __call__(self, phase: str) -> _Phase:
        return _Phase(self, phase)

    def sample(self, phase: str) -> int:
        """Count the peak since the last reset in ``phase`` (the most of every
        sample), and reset it; the peak above the base."""
        peak = tracemalloc.get_traced_memory()[1] - self.base
        tracemalloc.reset_peak()
        self.phases[phase] = max(self.phases.get(phase, 0), peak)
        self.peak = max(self.peak, peak)
        return peak


class _Phase:
    def __init__(self, owner: Peak, phase: str) -> None:
        self.owner, self.phase = owner, phase

    def __enter__(self) -> _Phase:
        gc.collect()
        tracemalloc.reset_peak()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.owner.sample(self.phase)
