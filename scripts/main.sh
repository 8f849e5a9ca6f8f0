#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the main job on 4 MPI ranks:
#   1. a small GPT trained on the Python standard library's own source (character level),
#   2. an MLP surrogate of the 1-D Burgers equation, trained on solutions of a NumPy solver,
# both with DDP, nothing downloaded; then draw their loss curves into out/loss.png.
# Per-run output: out/<run>/metrics.jsonl and out/<run>/checkpoints/.
# Extra arguments go to `mpishard train` (for example --example gpt --strategy zero2,
# or --strategy hybrid --tp 2 --pp 2 --micro-batches 4); MPISHARD_RANKS changes the 4.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
bash scripts/setup.sh
source scripts/mpienv.sh
venv=${MPISHARD_VENV:-$repo/.venv}
mkdir -p out
stamp=$(mktemp)
trap 'rm -f "$stamp"' EXIT
mpirun $MPISHARD_MPIRUN_FLAGS -n "${MPISHARD_RANKS:-4}" "$venv/bin/mpishard" train --out out "$@"
# The metrics files this job wrote (not those of earlier runs of other examples).
mapfile -t metrics < <(find out -name metrics.jsonl -newer "$stamp" | sort -r)
if [ ${#metrics[@]} -gt 0 ]; then
  "$venv/bin/mpishard" plot "${metrics[@]}" -o out/loss.png
fi
