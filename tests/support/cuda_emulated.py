"""g++ build of CUDA sources against the CPU stand-in of ``cuda_emulation/``.

The emulated kernel tests (tests/unit/test_kernels_*emulated.py) write a C++ file
that includes ``shim.h`` and a launcher, and load it with ``build``: one
g++ run, a skip where the compiler lacks C++20 ``<barrier>``, the compiler's
error otherwise.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import numpy as np
import pytest

__all__ = ["HERE", "build", "ptr"]

#: The stand-in's headers and launchers (``-I`` of every build).
HERE = Path(__file__).resolve().parent / "cuda_emulation"


def build(code: str, out: Path, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Write ``code`` to ``out``.cpp, compile it to ``out``.so and load it."""
    out.with_suffix(".cpp").write_text(code)
    proc = subprocess.run(["g++", "-std=c++20", "-O1", *flags, "-shared", "-fPIC", "-pthread",
                           f"-I{HERE}", "-o", str(out.with_suffix(".so")),
                           str(out.with_suffix(".cpp"))], capture_output=True, text=True)
    if proc.returncode:
        if "barrier" in proc.stderr and "No such file" in proc.stderr:
            pytest.skip("g++ has no C++20 <barrier>")
        raise AssertionError(f"the kernels' source does not compile:\n{proc.stderr[-3000:]}")
    return ctypes.CDLL(str(out.with_suffix(".so")))


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    """The address of C-contiguous ``a``, as a kernel argument."""
    assert a.flags.c_contiguous
    return a.ctypes.data_as(ctypes.c_void_p)
