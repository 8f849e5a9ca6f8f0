"""``SGD``: stochastic gradient descent with momentum, PyTorch's rule, fused and chunked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
        xp, chunks, (a, b) = self._chunks(params)
        lr, scale = float(lr), float(grad_scale)
        mom, wd = self.momentum, self.weight_decay
        buffer = state["momentum_buffer"] if names else None
        multiply, copyto = xp.multiply, xp.copyto
        for start, stop in chunks:
            n = stop - start
            p, g = params[start:stop], grads[start:stop]
            # d: the effective gradient, g itself when there is nothing to add.
            if buffer is None and wd == 0.0:
                # Plain SGD: grad_scale folds into the learning rate, two passes.
                t = b[:n]
                multiply(g, lr * scale, out=t)
                p -= t
                continue
            if scale == 1.0 and wd == 0.0:
                d = g
            else:
                d = a[:n]
                if wd == 0.0:
                    multiply(g, scale, out=d)
                else:
                    multiply(p, wd, out=d)
                    if scale == 1.0:
                        d += g
                    else:
                        t = b[:n]
                        multiply(g, scale, out=t)
                        d += t
            if buffer is not None:
                buf = buffer[start:stop]
                if step == 1:
                    copyto(buf, d)
                else:
                    buf *= mom
                    buf += d
                if self.nesterov:
                    t = b[:n]
                    multiply(buf, mom, out=t)
                    t += d
                    d = t
                else:
                    d = buf
            t = b[:n]
            multiply(d, lr, out=t)
            p -= t
