"""``SGD``: stochastic gradient descent with momentum, PyTorch's rule (one fused kernel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..kernels.optim import sgd_update
from .base import FlatOptimizer, check_hyperparameter, check_range

__all__ = ["SGD"]


@dataclass
class SGD(FlatOptimizer):
    """Stochastic gradient descent, as ``torch.optim.SGD`` with ``dampening=0``.

    With ``g = grads * grad_scale + weight_decay * params``::

        buf = g                         (step 1)
        buf = momentum * buf + g        (later steps)
        d   = g + momentum * buf  if nesterov  else  buf     (d = g without momentum)
        params -= lr * d

    State: ``{"momentum_buffer"}`` when ``momentum > 0``, else ``{}``.

    Raises:
        ValueError: a negative or non-finite ``lr``, ``momentum`` or
            ``weight_decay``; ``nesterov`` without momentum.
    """

    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.lr = check_hyperparameter("lr", self.lr, 0.0)
        self.momentum = check_hyperparameter("momentum", self.momentum, 0.0)
        self.weight_decay = check_hyperparameter("weight_decay", self.weight_decay, 0.0)
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"expecting a bool for nesterov, got {self.nesterov!r}")
        if self.nesterov and self.momentum == 0.0:
            raise ValueError(f"expecting momentum > 0 with nesterov=True, got {self.momentum}")

    @property
    def state_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("momentum_buffer",) if self.momentum > 0.0 else ()

    def update(self, params: Any, grads: Any, state: dict[str, Any], step: int,
               lr: float, grad_scale: float = 1.0) -> None:
        """Update ``params`` in place from ``grads * grad_scale``; ``grads`` is only read."""
        names = self.state_names
        check_range(params, grads, state, names, step)
        sgd_update(params, grads, state["momentum_buffer"] if names else None, lr=float(lr),
                   momentum=self.momentum, nesterov=self.nesterov,
                   weight_decay=self.weight_decay, grad_scale=float(grad_scale),
                   first_step=step == 1, chunk=self._chunk_length(params),
                   scratch=self._scratch)
