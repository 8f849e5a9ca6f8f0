"""The optimizers' updates over a flat range: Adam/AdamW and SGD, each one function.

[`adam_update`][mpishard.kernels.optim.adam_update] and
[`sgd_update`][mpishard.kernels.optim.sgd_update] update the parameters (and state) of a flat
vector, or of a ZeRO shard of one, in place. Each runs, as
[`fused_on`][mpishard.kernels.select.fused_on] decides, either

* **fused**: one pass over the vectors, reading each input and writing each
  output once (Numba on NumPy arrays, a ``cupy.ElementwiseKernel`` on CuPy
  arrays); or
* **the NumPy twin** ([`adam_update_numpy`][mpishard.kernels.optim.adam_update_numpy],
  [`sgd_update_numpy`][mpishard.kernels.optim.sgd_update_numpy]): a dozen in-place array operations
  per cache-sized chunk, through ``xp``, so it runs on NumPy and CuPy alike. It is the reference,
  and the fallback where no fused version can run.

Both compute the same operations in the same order and precision (scalars
rounded to the arrays' dtype first, as NumPy does with a Python float), so
the fused update equals the twin bit for bit. The CuPy kernels are compiled
with ``--fmad=false`` to keep it so: NVRTC would otherwise contract a multiply
and an add into one rounding.

The coefficients are the optimizers' ([`mpishard.optim`][mpishard.optim]): for Adam, with
``g = grads * grad_scale`` (``+ l2 * params`` for L2 decay)::

    params *= decay                                    (AdamW: 1 - lr * wd; else 1)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g**2
    params -= step_size * m / (sqrt(v) + eps_hat)

Without L2 decay ``grad_scale`` is folded into the moments' coefficients
(``(1 - beta1) * s`` and ``(1 - beta2) * s * s``) rather than applied to ``g``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..backend import array_namespace
from .scratch import ScratchBuffers, chunk_bounds
from .select import fused_on

__all__ = [
    "adam_update",
    "adam_update_numpy",
    "sgd_update",
    "sgd_update_numpy",
]


# --- Adam / AdamW -------------------------------------------------------------

def adam_update(params: Any, grads: Any, exp_avg: Any, exp_avg_sq: Any, *, beta1: float,
                beta2: float, step_size: float, eps_hat: float, decay: float, l2: float,
                grad_scale: float, chunk: int, scratch: ScratchBuffers) -> None:
    """One Adam/AdamW step over 1-D ``params`` in place (see the module docstring).

    ``grads`` is only read. ``chunk`` and ``scratch`` (two work arrays) serve the
    NumPy twin; the fused kernels need neither. Local (no communication).
    """
    if params.shape[0] == 0:
        return
    xp = array_namespace(params)
    if not fused_on(xp, params.shape[0]):
        adam_update_numpy(params, grads, exp_avg, exp_avg_sq, beta1=beta1, beta2=beta2,
                          step_size=step_size, eps_hat=eps_hat, decay=decay, l2=l2,
                          grad_scale=grad_scale, chunk=chunk, scratch=scratch)
        return
    k = 1.0 if l2 else grad_scale
    dt = params.dtype.type
    args = (dt(beta1), dt(beta2), dt((1.0 - beta1) * k), dt((1.0 - beta2) * k * k),
            dt(eps_hat), dt(step_size), dt(decay), dt(l2), dt(grad_scale), bool(l2))
    if xp is np:
        _numba().adam(params, grads, exp_avg, exp_avg_sq, *args)
    else:
        _cupy_adam(xp)(grads, *args, params, exp_avg, exp_avg_sq)


def adam_update_numpy(params: Any, grads: Any, exp_avg: Any, exp_avg_sq: Any, *,
                      beta1: float, beta2: float, step_size: float, eps_hat: float,
                      decay: float, l2: float, grad_scale: float, chunk: int,
                      scratch: ScratchBuffers) -> None:
    """[`adam_update`][mpishard.kernels.optim.adam_update]'s NumPy twin: in-place ``xp`` passes,
    chunk by chunk."""
    xp = array_namespace(params)
    n = params.shape[0]
    if n == 0:
        return
    a, b = _work(xp, params, chunk, scratch)
    b1, b2, scale = beta1, beta2, grad_scale
    # With L2 decay the gradient is built in scratch ``a`` (scale applied there);
    # otherwise grads are read in place and the scale is folded into the moment
    # coefficients.
    k = 1.0 if l2 else scale
    c1, c2 = (1.0 - b1) * k, (1.0 - b2) * k * k
    multiply, sqrt, divide = xp.multiply, xp.sqrt, xp.divide
    full = b.shape[0]
    for start, stop in chunk_bounds(n, chunk):
        p, g = params[start:stop], grads[start:stop]
        m, v = exp_avg[start:stop], exp_avg_sq[start:stop]
        size = stop - start
        t = b if size == full else b[:size]
        if decay != 1.0:
            p *= decay
        if l2:
            d = a if size == full else a[:size]
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


# --- SGD ------------------------------------------------------------------------

def sgd_update(params: Any, grads: Any, momentum_buffer: Any | None, *, lr: float,
               momentum: float, nesterov: bool, weight_decay: float, grad_scale: float,
               first_step: bool, chunk: int, scratch: ScratchBuffers) -> None:
    """One SGD step over 1-D ``params`` in place, as ``torch.optim.SGD`` (``dampening=0``).

    With ``d = grads * grad_scale + weight_decay * params``: without a
    ``momentum_buffer`` ``params -= lr * d``; with one, ``buf = d`` on the
    ``first_step`` and ``buf = momentum * buf + d`` after, then ``params -= lr *
    (d + momentum * buf if nesterov else buf)``. ``grads`` is only read.
    Local (no communication).
    """
    if params.shape[0] == 0:
        return
    xp = array_namespace(params)
    if not fused_on(xp, params.shape[0]):
        sgd_update_numpy(params, grads, momentum_buffer, lr=lr, momentum=momentum,
                         nesterov=nesterov, weight_decay=weight_decay, grad_scale=grad_scale,
                         first_step=first_step, chunk=chunk, scratch=scratch)
        return
    dt = params.dtype.type
    if momentum_buffer is None and weight_decay == 0.0:
        # The twin's two passes: grad_scale folded into the learning rate.
        if xp is np:
            _numba().sgd_plain(params, grads, dt(lr * grad_scale))
        else:
            _cupy_sgd_plain(xp)(grads, dt(lr * grad_scale), params)
        return
    has_buf = momentum_buffer is not None
    args = (dt(lr), dt(grad_scale), dt(weight_decay), dt(momentum), weight_decay != 0.0)
    if xp is np:
        # Without momentum the loop takes params in the buffer's place, never touching it.
        _numba().sgd(params, grads, momentum_buffer if has_buf else params, *args, has_buf,
                     bool(first_step), bool(nesterov))
    elif has_buf:
        _cupy_sgd(xp)(grads, *args, bool(first_step), bool(nesterov), params,
                      momentum_buffer)
    else:
        _cupy_sgd_decay(xp)(grads, *args[:3], params)


def sgd_update_numpy(params: Any, grads: Any, momentum_buffer: Any | None, *, lr: float,
                     momentum: float, nesterov: bool, weight_decay: float,
                     grad_scale: float, first_step: bool, chunk: int,
                     scratch: ScratchBuffers) -> None:
    """[`sgd_update`][mpishard.kernels.optim.sgd_update]'s NumPy twin: in-place ``xp`` passes, chunk
    by chunk."""
    xp = array_namespace(params)
    n = params.shape[0]
    if n == 0:
        return
    a, b = _work(xp, params, chunk, scratch)
    scale, mom, wd = grad_scale, momentum, weight_decay
    buffer = momentum_buffer
    multiply, copyto = xp.multiply, xp.copyto
    for start, stop in chunk_bounds(n, chunk):
        size = stop - start
        p, g = params[start:stop], grads[start:stop]
        # d: the effective gradient, g itself when there is nothing to add.
        if buffer is None and wd == 0.0:
            # Plain SGD: grad_scale folds into the learning rate, two passes.
            t = b[:size]
            multiply(g, lr * scale, out=t)
            p -= t
            continue
        if scale == 1.0 and wd == 0.0:
            d = g
        else:
            d = a[:size]
            if wd == 0.0:
                multiply(g, scale, out=d)
            else:
                multiply(p, wd, out=d)
                if scale == 1.0:
                    d += g
                else:
                    t = b[:size]
                    multiply(g, scale, out=t)
                    d += t
        if buffer is not None:
            buf = buffer[start:stop]
            if first_step:
                copyto(buf, d)
            else:
                buf *= mom
                buf += d
            if nesterov:
                t = b[:size]
                multiply(buf, mom, out=t)
                t += d
                d = t
            else:
                d = buf
        t = b[:size]
        multiply(d, lr, out=t)
        p -= t


# --- implementations ------------------------------------------------------------

def _work(xp: Any, params: Any, chunk: int, scratch: ScratchBuffers) -> tuple[Any, Any]:
    """The twin's two work arrays of ``chunk`` elements (made once, then reused)."""
    if chunk < 1:
        raise ValueError(f"expecting chunk >= 1, got {chunk}")
    device = getattr(getattr(params, "device", None), "id", None)
    a, b = scratch.get(xp, params.dtype, chunk, device)[:2]
    return a, b


def _numba() -> Any:
    """The Numba kernels (`numba_optim`), imported at the first fused CPU update."""
    from . import numba_optim  # optional dependency: imported on first use only
    return numba_optim


# CuPy kernels: the same statements as the Numba loops, element by element.
# ``--fmad=false``: no multiply-add contraction, so each operation rounds as the
# twin's separate CuPy kernels do (IEEE sqrt and division are NVRTC's defaults).
_NVRTC_OPTIONS = ("--fmad=false",)

_ADAM_CUDA = """
T pi = p * decay;
T gi = g;
if (use_l2) { T w = pi * l2; T s = gi * scale; gi = w + s; }
T t = gi * c1;
T mi = m * b1; mi = mi + t;
t = gi * c2; t = t * gi;
T vi = v * b2; vi = vi + t;
t = sqrt(vi); t = t + eps_hat;
t = mi / t; t = t * step_size;
p = pi - t; m = mi; v = vi;
"""

# SGD with a momentum buffer (without one: _cupy_sgd_decay or _cupy_sgd_plain).
_SGD_CUDA = """
T pi = p;
T d;
if (use_wd) { T w = pi * wd; T s = g * scale; d = w + s; } else { d = g * scale; }
T b;
if (first) { b = d; } else { b = buf * mom; b = b + d; }
buf = b;
if (nesterov) { T t = b * mom; d = t + d; } else { d = b; }
T t = d * lr;
p = pi - t;
"""


@functools.cache
def _cupy_adam(cp: Any) -> Any:
    return cp.ElementwiseKernel(
        "T g, T b1, T b2, T c1, T c2, T eps_hat, T step_size, T decay, T l2, T scale, "
        "bool use_l2", "T p, T m, T v", _ADAM_CUDA, "mpishard_adam",
        options=_NVRTC_OPTIONS)


@functools.cache
def _cupy_sgd(cp: Any) -> Any:
    return cp.ElementwiseKernel(
        "T g, T lr, T scale, T wd, T mom, bool use_wd, bool first, bool nesterov",
        "T p, T buf", _SGD_CUDA, "mpishard_sgd", options=_NVRTC_OPTIONS)


@functools.cache
def _cupy_sgd_decay(cp: Any) -> Any:
    return cp.ElementwiseKernel(
        "T g, T lr, T scale, T wd", "T p",
        "T w = p * wd; T s = g * scale; T d = w + s; T t = d * lr; p = p - t;",
        "mpishard_sgd_decay", options=_NVRTC_OPTIONS)


@functools.cache
def _cupy_sgd_plain(cp: Any) -> Any:
    return cp.ElementwiseKernel("T g, T lr_scale", "T p", "T t = g * lr_scale; p = p - t;",
                                "mpishard_sgd_plain", options=_NVRTC_OPTIONS)
