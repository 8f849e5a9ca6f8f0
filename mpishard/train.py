"""The training loop with rank-0 progress, a summary and a metrics file."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

import numpy as np

from .strategies.base import DataParallelOptimizer, TrainResult

__all__ = ["run_training"]


def run_training(strategy: DataParallelOptimizer, model: Any, data: Any, epochs: int,
                 batch_size: int, *, seed: int = 0, metrics_path: str | None = None,
                 validation: tuple[Any, Any] | None = None,
                 out: TextIO | None = None) -> TrainResult:
    """Train for ``epochs`` epochs, one line of progress per epoch on rank 0.

    Each epoch's line shows the mean training loss, the validation loss (when
    ``validation`` is given; every rank computes it on its own copy, no
    communication), samples per second and the time left. ``metrics_path``
    receives one JSON object per epoch. Collective over the strategy's data group.
    """
    rank0 = strategy.config.comm.Get_rank() == 0
    out = out or sys.stdout
    metrics = open(metrics_path, "w") if (metrics_path and rank0) else None
    total = TrainResult()
    t_start = time.perf_counter()
    try:
        for epoch in range(epochs):
            result = strategy.optimize(model, data, epochs=1, batch_size=batch_size, seed=seed)
            total.losses.extend(result.losses)
            total.steps += result.steps
            total.samples += result.samples
            total.epochs += 1
            elapsed = time.perf_counter() - t_start
            record = {"epoch": epoch + 1, "step": strategy.step_count,
                      "loss": float(np.mean(result.losses)),
                      "samples_per_s": result.samples_per_second,
                      "lr": strategy.current_lr(), "elapsed_s": elapsed}
            if validation is not None:
                record["val_loss"] = evaluate(model, *validation)
            if rank0:
                eta = elapsed / (epoch + 1) * (epochs - epoch - 1)
                val = f"  val {record['val_loss']:.5f}" if validation is not None else ""
                out.write(f"epoch {epoch + 1:>3}/{epochs}  loss {record['loss']:.5f}{val}  "
                          f"{record['samples_per_s']:,.0f} samples/s  eta {eta:5.1f} s\n")
                out.flush()
                if metrics is not None:
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
    finally:
        if metrics is not None:
            metrics.close()
    total.seconds = time.perf_counter() - t_start
    return total


def evaluate(model: Any, x: Any, y: Any) -> float:
    """Mean loss of ``model`` on ``(x, y)`` without touching its gradients:
    cross-entropy for integer targets, mean squared error otherwise."""
    prediction = np.asarray(model.forward(x), dtype=np.float64)
    y = np.asarray(y)
    if np.issubdtype(y.dtype, np.integer):
        shifted = prediction - prediction.max(axis=1, keepdims=True)
        log_z = np.log(np.exp(shifted).sum(axis=1))
        return float(np.mean(log_z - shifted[np.arange(len(y)), y]))
    diff = prediction - y
    return float(np.mean(diff * diff))
