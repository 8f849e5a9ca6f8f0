#!/usr/bin/env bash
# Install everything (scripts/setup.sh: the MPI build of h5py, .venv-ft and Slurm in
# the background while step 0 runs), check the imports and style, and run the
# whole test suite:
#   0. lint-imports (the layer contracts of pyproject.toml: no upward import, no cycle,
#      only mpishard.comm imports mpi4py), ruff, and `mkdocs build --strict` (the
#      documentation site of docs/: a broken link, a missing page or an API page
#      that does not render fails the run); a violation fails the run;
#   1. tests/unit (no MPI world: pure arithmetic, layers, optimizers), pytest -n 2,
#      beside step 0; the few tests that need h5py after its build;
#   2. tests/jobs (each test starts its own mpirun or a whole program: launch, CLI,
#      Slurm, stalls, aborts, the elastic agent), plain pytest, 3 tests at a time
#      (they mostly wait on their jobs), then the tests marked timing, 2 at a time
#      with only tests/mpi at 1 rank (one process) beside them;
#   3. tests/cluster (jobs over the namespace cluster of scripts/cluster-local.sh);
#   4. tests/mpi under `mpirun -n N python -m pytest --with-mpi` for N = 1 (beside the
#      timing tests of step 2), 2, 4, and the tests marked layout3d at N = 8 (the
#      tp2-pp2-dp2 layout);
#   5. tests/faults (ULFM: hybrid layouts, the namespace cluster) in the fault-tolerant
#      runtime (.venv-ft, Open MPI 5 + ULFM).
# Extra arguments go to every pytest call (for example -x or -k ddp).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# Bytecode caches (__pycache__, ignored by git) are written even where the
# environment says not to (PYTHONDONTWRITEBYTECODE=1, as on the 2-core development
# machine): the suite starts thousands of Python processes (every rank of every
# job), and without the caches each compiles the library's ~130 modules again
# (0.33 s of CPU per process; tests/faults/test_spares_3d.py took 65 s without
# them, 46 s with them: docs/install.md). The sources are compiled once before
# the tests start (compileall writes where imports would not).
unset PYTHONDONTWRITEBYTECODE
# Each part's header says when it starts ([minutes:seconds] since the start): the
# differences are the costs of the parts (docs/install.md's table); each pytest run
# ends with its slowest tests (--durations).
# The CPU time of the parts finished so far (user + system of every process this
# script has waited for, from bash's `times`) follows: against twice the elapsed time
# (2 cores), how busy the machine was.
cpu_file=$(mktemp)
step() {
  local cpu
  times >"$cpu_file"   # in this shell: a subshell's `times` counts only its own children
  cpu=$(awk 'NR == 2 { gsub(/s/, ""); split($1, u, "m"); split($2, k, "m");
    printf "%d", u[1] * 60 + u[2] + k[1] * 60 + k[2] }' "$cpu_file")
  printf '== %s [%d:%02d, CPU %d:%02d]\n' "$1" $((SECONDS / 60)) $((SECONDS % 60)) \
    $((cpu / 60)) $((cpu % 60))
}
# Everything but the MPI build of h5py first; that build (about 4 minutes on one core
# on a new machine, a check afterwards), the fault-tolerant runtime (.venv-ft) and
# Slurm (for tests/jobs/test_slurm.py) are made in the background while the linters
# and the documentation run on the other core. Each says what it did in its log,
# printed when it fails.
MPISHARD_H5PY=later bash scripts/setup.sh
py=${MPISHARD_VENV:-$repo/.venv}/bin/python
source scripts/mpienv.sh
"$py" -m compileall -q -j 0 mpishard tests scripts benchmarks >/dev/null
setup_logs=$(mktemp -d)
# A run that stops early (a lint error) ends the setups it started, by their ids.
trap 'for pid in ${h5py_setup:-} ${ft_setup:-} ${slurm_setup:-} ${unit_tests:-} ${mpi_one:-}; do
  kill "$pid" 2>/dev/null || true; done; rm -f "$cpu_file"' EXIT
bash scripts/setup.sh >"$setup_logs/h5py.log" 2>&1 &
h5py_setup=$!
bash scripts/setup.sh --ft >"$setup_logs/ft.log" 2>&1 &
ft_setup=$!
# The Slurm tests submit the batch scripts of slurm/ to a real single-node Slurm:
# start one if none answers (the first time this installs Debian's slurm-wlm and
# munge). Where that fails they are skipped, with the reason.
slurm_setup=
if ! sinfo -h >/dev/null 2>&1; then
  { MPISHARD_H5PY=later MPISHARD_SLURM=1 bash scripts/setup.sh \
      && bash scripts/slurm-local.sh start; } >"$setup_logs/slurm.log" 2>&1 &
  slurm_setup=$!
fi

# tests/unit needs no MPI world, and but for a few tests no h5py: it runs now, beside
# the linters and the documentation (each of them one process, one core), with h5py
# made unimportable as it is on a new machine while the build runs
# (scripts/pytest_before_h5py.py); a test that stops on `import h5py` is written to
# $unit_deferred and runs after the build. Its output is printed after the documentation.
# Two pytest-xdist workers: in fresh clones of the same tests it ended at 2:09,
# against 2:22 in one process (whose BLAS threads use both cores already).
unit_deferred=$setup_logs/unit-deferred
PYTHONPATH="$repo/scripts${PYTHONPATH:+:$PYTHONPATH}" MPISHARD_DEFERRED="$unit_deferred" \
  "$py" -m pytest -q -p no:cacheprovider --color=no --durations=10 -n 2 -p pytest_before_h5py "$@" \
  tests/unit \
  >"$setup_logs/unit.log" 2>&1 &
unit_tests=$!

venv=${MPISHARD_VENV:-$repo/.venv}
step "import contracts (lint-imports)"
"$venv/bin/lint-imports" --no-cache
step "ruff check"
"$venv/bin/ruff" check mpishard tests scripts benchmarks
step "documentation (mkdocs build --strict)"
# The diagrams of docs/guide/img/ are drawn from the library by scripts/diagrams.py.
"$py" scripts/diagrams.py --check
# Into a temporary folder, removed afterwards: the check is that it builds. (Not
# --quiet: it silences the warnings, and then --strict has none to fail on.)
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --site-dir "$site" \
  || { rm -rf "$site"; exit 1; }
# No page may show a Sphinx role raw: mkdocstrings reads Markdown docstrings, so a
# role prints as ":class:`X`" (or, in a Returns section, "class: ~mpishard.x.Y"). A
# reference is an autorefs link, [`Y`][mpishard.x.Y], or plain `code` for a name no
# page renders (tests/unit/test_docstring_roles.py checks the source).
role_re=':(class|meth|func|attr|mod|exc|data|obj):(<code>|`)'
role_re+='|\b(class|meth|func|attr|mod|exc|data|obj):[[:space:]]*(<code>~?|~)mpishard\.'
raw_roles=$(grep -rnoE "$role_re" "$site" --include='*.html' \
  | sed "s|^$site/||" || true)
if [ -n "$raw_roles" ]; then
  echo "Raw Sphinx roles on the built site (page:line:text); write [\`Name\`][mpishard.x.Name]:"
  echo "$raw_roles"
  rm -rf "$site"
  exit 1
fi
rm -rf "$site"

step "the MPI build of h5py (scripts/setup.sh, in the background since the start)"
if ! wait "$h5py_setup"; then
  cat "$setup_logs/h5py.log"
  exit 1
fi
grep -a '^\[setup\]' "$setup_logs/h5py.log" || true
if [ -n "$slurm_setup" ]; then
  step "a single-node Slurm for the Slurm tests (started in the background)"
  wait "$slurm_setup" || { tail -n 20 "$setup_logs/slurm.log"
    echo "== Slurm could not be started: tests/jobs/test_slurm.py will say why it skips"; }
fi

step "tests without an MPI world (tests/unit, run beside the linters and the documentation)"
unit_status=0
wait "$unit_tests" || unit_status=$?
unit_tests=
cat "$setup_logs/unit.log"
[ "$unit_status" = 0 ] || exit "$unit_status"
if [ -s "$unit_deferred" ]; then
  step "the tests of tests/unit that need h5py (deferred until its build)"
  mapfile -t deferred < <(sort -u "$unit_deferred")
  # Exit status 5: extra arguments (-k) that select none of them.
  "$py" -m pytest -q -p no:cacheprovider --color=no "$@" "${deferred[@]}" || [ $? = 5 ]
fi
# pytest-xdist: 3 workers, each test's jobs on its own; the tests mostly wait on them.
# loadfile: a file's tests share a worker, so a module fixture (test_slurm's DDP job,
# test_docs_blocks' job of a page's blocks) runs once. (Not loadgroup: with pytest 9
# its groups are lost, pytest-xdist 3.8 renaming the tests by a field pytest 9 no
# longer reads, and the fixtures ran on several workers.)
step "whole jobs, each test its own mpirun (tests/jobs: 3 at a time)"
"$py" -m pytest -q -p no:cacheprovider --color=no --durations=15 -n 3 --dist loadfile \
  -m "not timing" "$@" tests/jobs
# The tests marked timing (timeouts of 2 s that every healthy rank must meet) after,
# two at a time, beside only tests/mpi at one rank (one process): alone, one at a
# time, they kept about a quarter of the 2 cores busy (73 s of CPU in all, against
# 2 min 35 s in a fresh clone's run), most of their time being the stalled ranks'
# sleeps and the timeouts themselves.
# worksteal: a worker that runs out takes tests from the other (the two agent tests
# of test_launch.py are the longest). The one-rank run's output follows theirs.
mpi_one_log=$setup_logs/mpi-1.log
timeout --kill-after=30 1500 mpirun $MPISHARD_MPIRUN_FLAGS -n 1 \
  "$py" -m pytest -q -p no:cacheprovider --color=no --durations=10 --with-mpi -m mpi "$@" \
  tests/mpi >"$mpi_one_log" 2>&1 &
mpi_one=$!
step "the tests of tests/jobs marked timing (2 at a time; tests/mpi at 1 rank beside them)"
"$py" -m pytest -q -p no:cacheprovider --color=no --durations=15 -n 2 --dist worksteal \
  -m timing "$@" tests/jobs
step "mpirun -n 1 python -m pytest --with-mpi (tests/mpi, run beside the timing tests)"
mpi_one_status=0
wait "$mpi_one" || mpi_one_status=$?
mpi_one=
cat "$mpi_one_log"
[ "$mpi_one_status" = 0 ] || exit "$mpi_one_status"
step "jobs over the nodes of the namespace cluster (tests/cluster)"
"$py" -m pytest -q -p no:cacheprovider --color=no --durations=15 -rs "$@" tests/cluster

for n in 2 4; do
  step "mpirun -n $n python -m pytest --with-mpi (tests/mpi)"
  # timeout: a deadlocked collective must fail the run, not eat CI's 90 minutes.
  timeout --kill-after=30 1500 mpirun $MPISHARD_MPIRUN_FLAGS -n "$n" \
    "$py" -m pytest -q -p no:cacheprovider --color=no --durations=10 --with-mpi -m mpi "$@" \
    tests/mpi
done
# The 3D layout tp2-pp2-dp2 needs 8 ranks: the tests marked layout3d run there too.
step "mpirun -n 8 python -m pytest --with-mpi (tests/mpi, 3D layouts)"
timeout --kill-after=30 1500 mpirun $MPISHARD_MPIRUN_FLAGS -n 8 \
  "$py" -m pytest -q -p no:cacheprovider --color=no --with-mpi -m "mpi and layout3d" "$@" tests/mpi
# The fault-tolerant runtime (Open MPI 5 with ULFM, in .venv-ft; scripts/setup.sh --ft):
# tests/faults start their own `mpirun --with-ft ulfm` jobs there. Where that
# environment cannot be made, the tests run in the main one and skip, saying why.
step "fault-tolerant runtime: tests/faults under .venv-ft (mpirun --with-ft ulfm)"
ftpy=${MPISHARD_FT_VENV:-$repo/.venv-ft}/bin/python
if ! wait "$ft_setup"; then
  tail -n 20 "$setup_logs/ft.log"
  echo "== the fault-tolerant runtime could not be made: tests/faults skip"
  ftpy=$py
fi
grep -a '^\[setup\]' "$setup_logs/ft.log" || true
rm -rf "$setup_logs"
timeout --kill-after=30 900 "$ftpy" -m pytest -q -p no:cacheprovider --color=no --durations=15 -rs \
  "$@" tests/faults
step "all test runs passed"
