#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the main job: the Burgers-equation
# surrogate trained with DDP on 4 MPI ranks. Extra arguments go to `mpishard train`
# (for example --strategy zero2 --epochs 60).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
bash scripts/setup.sh
source scripts/mpienv.sh
venv=${MPISHARD_VENV:-$repo/.venv}
mkdir -p out
exec mpirun $MPISHARD_MPIRUN_FLAGS -n "${MPISHARD_RANKS:-4}" "$venv/bin/mpishard" train \
  --metrics out/metrics.jsonl "$@"
