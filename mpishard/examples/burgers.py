"""Training data for a surrogate of the 1-D viscous Burgers equation.

``u_t + u u_x = nu u_xx`` on the periodic interval [0, 1), solved with a
conservative finite-volume scheme (Rusanov flux for ``u^2/2``, central
diffusion) and explicit Euler steps under a CFL-limited time step. Many initial
conditions are advanced at once (samples along the first axis), so a dataset of
thousands of solutions takes a second. The surrogate learns the nonlinear map
from ``u(x, 0)`` to ``u(x, T)``: steepening fronts that a linear model cannot fit.
"""

from __future__ import annotations

import numpy as np

__all__ = ["burgers_dataset", "solve_burgers"]


def solve_burgers(u0: np.ndarray, t_final: float, nu: float = 0.01,
                  cfl: float = 0.4) -> np.ndarray:
    """Advance initial conditions ``u0`` (samples x grid points) to ``t_final``."""
    u = np.array(u0, dtype=np.float64)
    n = u.shape[-1]
    dx = 1.0 / n
    t = 0.0
    while t < t_final:
        speed = float(np.max(np.abs(u))) + 1e-12
        dt = min(cfl * dx / speed, 0.4 * dx * dx / nu, t_final - t)
        right = np.roll(u, -1, axis=-1)
        # Rusanov (local Lax-Friedrichs) flux of u^2/2 at the face i+1/2.
        a = np.maximum(np.abs(u), np.abs(right))
        flux = 0.25 * (u * u + right * right) - 0.5 * a * (right - u)
        diffusion = nu * (right - 2.0 * u + np.roll(u, 1, axis=-1)) / (dx * dx)
        u = u - dt / dx * (flux - np.roll(flux, 1, axis=-1)) + dt * diffusion
        t += dt
    return u


def burgers_dataset(samples: int = 4096, grid: int = 64, t_final: float = 0.2,
                    nu: float = 0.01, modes: int = 4, seed: int = 0,
                    dtype: type = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, targets)``: random smooth initial states and their solutions at
    ``t_final``, each ``(samples, grid)``. Initial states are sums of ``modes``
    Fourier modes with random amplitudes and phases (deterministic in ``seed``).
    """
    rng = np.random.default_rng(seed)
    x = np.arange(grid) / grid
    k = np.arange(1, modes + 1)
    amp = rng.standard_normal((samples, modes)) / k
    phase = rng.uniform(0, 2 * np.pi, (samples, modes))
    u0 = np.einsum("sm,smx->sx", amp, np.sin(2 * np.pi * k[None, :, None] * x[None, None, :]
                                           + phase[:, :, None]))
    return u0.astype(dtype), solve_burgers(u0, t_final, nu).astype(dtype)
