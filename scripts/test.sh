#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the whole test suite:
#   1. the tests that need no MPI world (pure arithmetic, layers, optimizers, and
#      the tests that start their own mpirun), with plain pytest;
#   2. the MPI tests under `mpirun -n N python -m pytest --with-mpi` for N = 1, 2, 4.
# Extra arguments go to every pytest call (for example -x or -k ddp).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
bash scripts/setup.sh
py=${MPISHARD_VENV:-$repo/.venv}/bin/python
source scripts/mpienv.sh

echo "== tests without an MPI world"
"$py" -m pytest -q -p no:cacheprovider -m "not mpi" "$@" tests

for n in 1 2 4; do
  echo "== mpirun -n $n python -m pytest --with-mpi"
  # timeout: a deadlocked collective must fail the run, not eat CI's 90 minutes.
  timeout --kill-after=30 1500 mpirun $MPISHARD_MPIRUN_FLAGS -n "$n" \
    "$py" -m pytest -q -p no:cacheprovider --with-mpi -m mpi "$@" tests
done
echo "== all test runs passed"
