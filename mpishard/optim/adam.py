"""``Adam`` and ``AdamW``: PyTorch's update rule, fused and chunked over a flat range."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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

    The update reads ``params``, ``grads``, ``m``, ``v`` and writes ``params``,
    ``m``, ``v`` once each: the vectors are processed in cache-sized chunks
    (:data:`~mpishard.optim.base.CHUNK_ELEMENTS`), with ``grad_scale`` and the bias
    corrections folded into scalar factors. The results equal PyTorch's formula up
    to rounding (the factors are grouped differently), and are bit-identical for
    any chunking and for any split of the vector into separately updated ranges.

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
        xp, chunks, (a, b) = self._chunks(params)
        lr, scale = float(lr), float(grad_scale)
        b1, b2 = self.betas
        wd = self.weight_decay
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        # lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
        #   = [lr * sqrt(bc2) / bc1] * m / (sqrt(v) + [eps * sqrt(bc2)])
        bc1 = 1.0 - b1 ** step
        sqrt_bc2 = math.sqrt(1.0 - b2 ** step)
        step_size = lr * sqrt_bc2 / bc1
        eps_hat = self.eps * sqrt_bc2
        decay = 1.0 - lr * wd if self.decoupled_weight_decay else 1.0
        l2 = wd if not self.decoupled_weight_decay else 0.0
        # With L2 decay the gradient is built in scratch ``a`` (scale applied
        # there); otherwise grads are read in place and the scale is folded into
        # the moment coefficients.
        k = 1.0 if l2 else scale
        c1, c2 = (1.0 - b1) * k, (1.0 - b2) * k * k
        multiply, sqrt, divide = xp.multiply, xp.sqrt, xp.divide
        full = b.shape[0]
        for start, stop in chunks:
            p, g = params[start:stop], grads[start:stop]
            m, v = exp_avg[start:stop], exp_avg_sq[start:stop]
            n = stop - start
            t = b if n == full else b[:n]
            if decay != 1.0:
                p *= decay
            if l2:
                d = a if n == full else a[:n]
                multiply(p, l2, d)
                if scale == 1.0:
                    d += g
                else:
                    multiply(g, scale, t)
                    d += t
                g = d
            # Twelve in-place passes over the chunk, all in cache (out= positional).
            multiply(g, c1, t)
            m *= b1
            m += t
            multiply(g, c2, t)
            t *= g
            v *= b2
            v += t
            sqrt(v, t)
            t += eps_hat
            divide(m, t, t)
            t *= step_size
            p -= t


@dataclass
class AdamW(Adam):
    """AdamW, as ``torch.optim.AdamW``: decoupled weight decay.

    ``params *= 1 - lr * weight_decay``, then the :class:`Adam` step with
    ``g = grads * grad_scale`` (no L2 term).
    """

    weight_decay: float = 1e-2

    decoupled_weight_decay = True
