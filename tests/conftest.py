"""Import mpishard first, so each MPI rank limits its BLAS threads before NumPy loads."""

import mpishard  # noqa: F401
