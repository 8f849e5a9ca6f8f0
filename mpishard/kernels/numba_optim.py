"""The optimizers' updates as Numba loops: one pass over the vectors, on the CPU.

Imported only by [`mpishard.kernels.optim`][mpishard.kernels.optim], and only when a fused update
runs on NumPy arrays (so ``import mpishard`` never imports Numba). Each loop
does, per element, the operations of its NumPy twin in the twin's order and in
the arrays' precision (the scalars arrive already cast to the arrays' dtype):
no reassociation, no fused multiply-add (Numba's default leaves LLVM's
``fp-contract`` off), IEEE square root and division, so the results equal the
twin's bit for bit. ``error_model="numpy"``: a division by zero gives
infinity or NaN, as NumPy does, instead of raising.

``cache=True`` keeps the compiled machine code in ``__pycache__`` (or Numba's
user cache where that is not writable; where neither is, every process
compiles), so only the first process on a machine pays the compilation (0.3-1 s
per dtype and array layout; loading it back takes 0.15 s).
"""

from __future__ import annotations

import numpy as np

from .select import import_numba

numba = import_numba()   # without Numba's colorama: no ESC[0m on stdout at exit

__all__ = ["adam", "sgd", "sgd_plain"]


def _jit(fn):
    try:
        return numba.njit(cache=True, nogil=True, error_model="numpy")(fn)
    except RuntimeError:      # "no locator available": nowhere writable to cache
        return numba.njit(nogil=True, error_model="numpy")(fn)


@_jit
def adam(p, g, m, v, b1, b2, c1, c2, eps_hat, step_size, decay, l2, scale,
         use_l2):  # pragma: no cover - compiled
    """Adam/AdamW on ``p, m, v`` in place; see
    [`mpishard.kernels.optim.adam_update`][mpishard.kernels.optim.adam_update]."""
    for i in range(p.shape[0]):
        pi = p[i] * decay            # AdamW's decay (decay == 1 is exact otherwise)
        gi = g[i]
        if use_l2:
            gi = pi * l2 + gi * scale
        t = gi * c1
        mi = m[i] * b1 + t
        t = gi * c2
        t = t * gi
        vi = v[i] * b2 + t
        t = np.sqrt(vi) + eps_hat
        t = mi / t
        t = t * step_size
        p[i] = pi - t
        m[i] = mi
        v[i] = vi


@_jit
def sgd(p, g, buf, lr, scale, wd, mom, use_wd, has_buf, first,
        nesterov):  # pragma: no cover - compiled
    """SGD with weight decay and/or momentum; see
    [`mpishard.kernels.optim.sgd_update`][mpishard.kernels.optim.sgd_update].

    Without momentum ``buf`` is any array (never read or written).
    """
    for i in range(p.shape[0]):
        pi = p[i]
        d = pi * wd + g[i] * scale if use_wd else g[i] * scale
        if has_buf:
            b = d if first else buf[i] * mom + d
            buf[i] = b
            d = b * mom + d if nesterov else b
        p[i] = pi - d * lr


@_jit
def sgd_plain(p, g, lr_scale):  # pragma: no cover - compiled
    """``p -= g * lr_scale``: SGD without momentum or decay."""
    for i in range(p.shape[0]):
        p[i] = p[i] - g[i] * lr_scale
