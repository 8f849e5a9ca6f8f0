"""The array backends of the tests: the ``xp`` fixture (imported by ``tests/conftest.py``).

``xp`` is NumPy, and CuPy where it imports and sees a CUDA device (those cases are
marked ``gpu`` and skipped, with the reason, elsewhere).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

__all__ = ["cupy_or_skip", "xp"]


def cupy_or_skip() -> ModuleType:
    """CuPy, or a skip that says why it cannot be used here."""
    try:
        import cupy
    except ImportError as exc:
        pytest.skip(f"CuPy is not installed ({exc})")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, no device
        pytest.skip(f"CuPy sees no CUDA device ({type(exc).__name__}: {exc})")
    if count < 1:
        pytest.skip("CuPy sees no CUDA device (device count 0)")
    return cupy


@pytest.fixture(params=[pytest.param("numpy", id="numpy"),
                        pytest.param("cupy", id="cupy", marks=pytest.mark.gpu)])
def xp(request) -> ModuleType:
    """The array library of the test: ``numpy``, or ``cupy`` where a device exists."""
    return np if request.param == "numpy" else cupy_or_skip()
