#!/usr/bin/env bash
# Install everything (scripts/setup.sh), check the imports and style, and run the
# whole test suite:
#   0. lint-imports (the layer contracts of pyproject.toml: no upward import, no cycle,
#      only mpishard.comm imports mpi4py), ruff, and `mkdocs build --strict` (the
#      documentation site of docs/: a broken link, a missing page or an API page
#      that does not render fails the run);
#   1. the tests that need no MPI world (pure arithmetic, layers, optimizers, and
#      the tests that start their own mpirun), with plain pytest;
#   2. the MPI tests under `mpirun -n N python -m pytest --with-mpi` for N = 1, 2, 4,
#      and the model-parallel ones at N = 8 (the tp2-pp2-dp2 layout);
#   3. tests/test_ulfm*.py (hybrid layouts, the namespace cluster) in the fault-tolerant runtime
#      (.venv-ft, Open MPI 5 + ULFM).
# Extra arguments go to every pytest call (for example -x or -k ddp).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
bash scripts/setup.sh
py=${MPISHARD_VENV:-$repo/.venv}/bin/python
source scripts/mpienv.sh

venv=${MPISHARD_VENV:-$repo/.venv}
echo "== import contracts (lint-imports)"
"$venv/bin/lint-imports" --no-cache
echo "== ruff check"
"$venv/bin/ruff" check mpishard tests scripts benchmarks
echo "== documentation (mkdocs build --strict)"
# Into a temporary folder, removed afterwards: the check is that it builds. (Not
# --quiet: it silences the warnings, and then --strict has none to fail on.)
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --site-dir "$site" \
  || { rm -rf "$site"; exit 1; }
rm -rf "$site"

# The Slurm tests (tests/test_slurm.py) submit the batch scripts of slurm/ to a
# real single-node Slurm: start one here if none answers (the first time this
# installs Debian's slurm-wlm and munge). Where that fails they are skipped,
# with the reason.
if ! sinfo -h >/dev/null 2>&1; then
  echo "== starting a single-node Slurm for the Slurm tests"
  { MPISHARD_SLURM=1 bash scripts/setup.sh && bash scripts/slurm-local.sh start; } \
    || echo "== Slurm could not be started: tests/test_slurm.py will say why it skips"
fi

echo "== tests without an MPI world"
"$py" -m pytest -q -p no:cacheprovider --color=no -m "not mpi" "$@" tests

for n in 1 2 4; do
  echo "== mpirun -n $n python -m pytest --with-mpi"
  # timeout: a deadlocked collective must fail the run, not eat CI's 90 minutes.
  timeout --kill-after=30 1500 mpirun $MPISHARD_MPIRUN_FLAGS -n "$n" \
    "$py" -m pytest -q -p no:cacheprovider --color=no --with-mpi -m mpi "$@" tests
done
# The 3D layout tp2-pp2-dp2 needs 8 ranks: the model-parallel tests run there too.
echo "== mpirun -n 8 python -m pytest --with-mpi (3D layouts)"
timeout --kill-after=30 1500 mpirun $MPISHARD_MPIRUN_FLAGS -n 8 \
  "$py" -m pytest -q -p no:cacheprovider --color=no --with-mpi -m mpi "$@" tests/test_hybrid.py \
  tests/test_tensor_parallel.py
# The fault-tolerant runtime (Open MPI 5 with ULFM, in .venv-ft; scripts/setup.sh --ft):
# tests/test_ulfm*.py start their own `mpirun --with-ft ulfm` jobs there. Where that
# environment cannot be made, the tests run in the main one and skip, saying why.
echo "== fault-tolerant runtime: tests/test_ulfm*.py under .venv-ft (mpirun --with-ft ulfm)"
ftpy=${MPISHARD_FT_VENV:-$repo/.venv-ft}/bin/python
if ! bash scripts/setup.sh --ft; then
  echo "== the fault-tolerant runtime could not be made: tests/test_ulfm*.py skip"
  ftpy=$py
fi
timeout --kill-after=30 900 "$ftpy" -m pytest -q -p no:cacheprovider --color=no -rs "$@" \
  tests/test_ulfm.py tests/test_ulfm_train.py tests/test_ulfm_hybrid.py tests/test_ulfm_cluster.py
echo "== all test runs passed"
