"""``Adam`` and ``AdamW``: PyTorch's update rule over a flat range (one fused kernel)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..kernels.optim import adam_update
from .base import FlatOptimizer, check_hyperparameter, check_range

__all__ = ["Adam", "AdamW"]


@dataclass
class Adam(FlatOptimizer):
    """Adam, as ``torch.optim.Adam`` (``amsgrad=False``); L2 ``weight_decay``.

    With ``g = grads * grad_scale + weight_decay * params`` and ``t = step``::

        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        params -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)

    State: ``{"exp_avg": m, "exp_avg_sq": v}``.

    The update ([`mpishard.kernels.optim.adam_update`][mpishard.kernels.optim.adam_update]) reads
    ``params``, ``grads``, ``m``, ``v`` and writes ``params``, ``m``, ``v`` once each: in one
    fused pass, or, in its NumPy twin, in cache-sized chunks
    (`CHUNK_ELEMENTS`), with ``grad_scale`` and the bias
    corrections folded into scalar factors. The results equal PyTorch's formula up
    to rounding (the factors are grouped differently), and are bit-identical for
    either implementation, any chunking and any split of the vector into
    separately updated ranges.

    Raises:
        ValueError: a negative or non-finite ``lr``, ``eps`` or ``weight_decay``;
            ``betas`` not two numbers in ``[0, 1)``.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    state_names = ("exp_avg", "exp_avg_sq")
    decoupled_weight_decay = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.lr = check_hyperparameter("lr", self.lr, 0.0)
        try:
            b1, b2 = self.betas
        except (TypeError, ValueError):
            raise ValueError(f"expecting betas as 2 numbers, got {self.betas!r}") from None
        self.betas = (check_hyperparameter("betas[0]", b1, 0.0, 1.0, high_open=True),
                      check_hyperparameter("betas[1]", b2, 0.0, 1.0, high_open=True))
        self.eps = check_hyperparameter("eps", self.eps, 0.0)
        self.weight_decay = check_hyperparameter("weight_decay", self.weight_decay, 0.0)

    def update(self, params: Any, grads: Any, state: dict[str, Any], step: int,
               lr: float, grad_scale: float = 1.0) -> None:
        """Update ``params`` in place from ``grads * grad_scale``; ``grads`` is only read."""
        check_range(params, grads, state, self.state_names, step)
        b1, b2 = self.betas
        lr, wd = float(lr), self.weight_decay
        # lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
        #   = [lr * sqrt(bc2) / bc1] * m / (sqrt(v) + [eps * sqrt(bc2)])
        bc1 = 1.0 - b1 ** step
        sqrt_bc2 = math.sqrt(1.0 - b2 ** step)
        adam_update(params, grads, state["exp_avg"], state["exp_avg_sq"], beta1=b1, beta2=b2,
                    step_size=lr * sqrt_bc2 / bc1, eps_hat=self.eps * sqrt_bc2,
                    decay=1.0 - lr * wd if self.decoupled_weight_decay else 1.0,
                    l2=0.0 if self.decoupled_weight_decay else wd,
                    grad_scale=float(grad_scale), chunk=self._chunk_length(params),
                    scratch=self._scratch)


@dataclass
class AdamW(Adam):
    """AdamW, as ``torch.optim.AdamW``: decoupled weight decay.

    ``params *= 1 - lr * weight_decay``, then the [`Adam`][mpishard.optim.Adam] step with
    ``g = grads * grad_scale`` (no L2 term).
    """

    weight_decay: float = 1e-2

    decoupled_weight_decay = True
