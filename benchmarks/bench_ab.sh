#!/usr/bin/env bash
# Step time of this tree against an earlier revision, side by side in one run.
#
#   bash benchmarks/bench_ab.sh REV [RANKS] [ROUNDS] [-- extra bench_strategies.py args]
#
# Runs bench_strategies.py (PyTorch left out) ROUNDS times from each tree,
# alternating (base, this, base, this, ...) so that a slow spell of the machine
# hits both alike, and prints its JSON lines with "tree": "base" or "this" added.
# The base is `git archive REV`, imported ahead of the installed package.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
rev=${1:?usage: bench_ab.sh REV [RANKS] [ROUNDS] [-- args]}
ranks=${2:-2}
rounds=${3:-3}
shift $(( $# < 3 ? $# : 3 ))
[ "${1:-}" = "--" ] && shift
py=${MPISHARD_VENV:-$repo/.venv}/bin/python
source scripts/mpienv.sh
base=$(mktemp -d)
trap 'rm -rf "$base"' EXIT
git archive "$rev" | tar -x -C "$base"
for round in $(seq "$rounds"); do
  for tree in base this; do
    root=$repo
    [ "$tree" = base ] && root=$base
    # Revisions up to 0.4 keep the benchmarks in scripts/, later ones in benchmarks/.
    bench=$root/benchmarks/bench_strategies.py
    [ -f "$bench" ] || bench=$root/scripts/bench_strategies.py
    PYTHONPATH=$root mpirun $MPISHARD_MPIRUN_FLAGS -n "$ranks" "$py" \
        "$bench" --no-torch "$@" \
      | "$py" -c 'import json, sys
decode = json.JSONDecoder().raw_decode
for line in sys.stdin:
    # (mpirun may join two of rank 0 lines, or another rank output, into one line)
    at = line.find("{")
    while at >= 0:
        try:
            r, end = decode(line, at)
        except ValueError:
            break
        r.update(tree=sys.argv[1], round=int(sys.argv[2]))
        print(json.dumps(r), flush=True)
        at = line.find("{", end)' "$tree" "$round"
  done
done
