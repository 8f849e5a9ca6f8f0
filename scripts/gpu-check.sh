#!/usr/bin/env bash
# The GPU check of issues 23 and 33, as one command on a bare GPU machine:
#
#   bash scripts/gpu-check.sh            # everything (about 7 minutes on an H100)
#   bash scripts/gpu-check.sh --no-bench # the tests and the job only
#   bash scripts/gpu-check.sh --bench-only
#   bash scripts/gpu-check.sh --kernels 1 # the tests with the fused kernels on only
#
# Needs Python 3 with CuPy and NumPy (PyTorch for the comparison, h5py for the
# HDF5 tests); no network. What is missing of MPI is installed from the wheels in
# .whl/ of the checkout (Open MPI 5, mpi4py 4, pytest-mpi: see the device notes
# of issue 23) into a virtual environment that also sees the base environment
# (a .pth file), $GPU_CHECK_VENV (default /tmp/mpishard-gpu-venv).
#
# Then, each printing one JSON line: the tests marked gpu at 1 and 2 ranks, with
# the fused CUDA kernels off and on (MPISHARD_GPU_KERNELS=0/1, or the modes
# --kernels names); the tests marked gpu that start their own jobs; `mpishard
# train --device cuda` on 2 ranks (both examples, a few steps);
# benchmarks/bench_reproducible.py --device cuda (reproducible mode against the
# default step) at 1 and 2 ranks; benchmarks/bench_gpu_attention.py (the fused
# attention against the unfused path, PyTorch's SDPA and the NumPy twin);
# benchmarks/bench_gpu.py against PyTorch eager at 1 rank (DDP, ZeRO-2 and
# ZeRO-3; kernels off, on, on without the fused attention; the step replayed as
# a CUDA graph), once more with TF32 products, and at 2 ranks (their own JSON
# lines). The tests marked gpu include the fused attention's
# (tests/unit/test_kernels_attention.py: kernels against the twin, the GPT with
# and without it, CUDA-graph replay, TF32) and ZeRO-3's on CuPy. Logs go to
# $GPU_CHECK_LOGS (default /tmp/mpishard-gpu-check). Exit code: 0 when every
# check passed, 1 when one failed, 2 for bad arguments, 3 when no GPU is seen.
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }
tests=1 bench=1 kernel_modes="0 1"
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bench) bench=0 ;;
    --bench-only) tests=0 ;;
    --kernels)
      shift
      case "${1:-}" in
        0|1|"0 1"|"1 0"|0,1|1,0) kernel_modes=${1//,/ } ;;
        *) echo "gpu-check.sh: --kernels takes 0, 1 or 0,1, got '${1:-}'" >&2; exit 2 ;;
      esac ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu-check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ "$tests" = 0 ] && [ "$bench" = 0 ]; then
  echo "gpu-check.sh: --no-bench and --bench-only leave nothing to run" >&2; exit 2
fi

cd "$(dirname "$0")/.." || exit 2
repo=$PWD
py=${PYTHON:-python3}
logs=${GPU_CHECK_LOGS:-/tmp/mpishard-gpu-check}
venv=${GPU_CHECK_VENV:-/tmp/mpishard-gpu-venv}
mkdir -p "$logs"
failed=0
t_start=$(date +%s)

json() {  # json CHECK OK SECONDS DETAIL
  "$py" -c 'import json, sys; print(json.dumps({"check": sys.argv[1], "ok": sys.argv[2] == "1",
    "seconds": float(sys.argv[3]), "detail": sys.argv[4]}))' "$1" "$2" "$3" "$4"
}

# --- a GPU? ------------------------------------------------------------------------------
gpu=$("$py" - 2>&1 <<'EOF'
import cupy
n = cupy.cuda.runtime.getDeviceCount()
name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
print(f"{n} x {name.decode() if isinstance(name, bytes) else name}, CuPy {cupy.__version__}")
EOF
)
if [ $? -ne 0 ]; then
  reason=$(printf '%s\n' "$gpu" | grep -v '^\s*$' | tail -n 1)
  "$py" -c 'import json, sys; print(json.dumps({"check": "gpu", "ok": False,
    "reason": "no GPU: " + sys.argv[1]}))' "${reason:-CuPy sees no CUDA device}"
  exit 3
fi
json gpu 1 0 "$gpu"

# --- MPI: the base environment's, or the wheels of .whl/ in a virtual environment -----
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# A CUDA-aware MPI built by hand ($GPU_CHECK_CUDA_MPI: its install prefix, with an
# mpi4py built against it on the Python path; docs/guide/gpus.md) goes first.
if [ -n "${GPU_CHECK_CUDA_MPI:-}" ]; then
  export PATH="$GPU_CHECK_CUDA_MPI/bin:$PATH"
  export LD_LIBRARY_PATH="$GPU_CHECK_CUDA_MPI/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if ! command -v mpirun >/dev/null || ! "$py" -c "import mpi4py.MPI, pytest_mpi" 2>/dev/null; then
  t0=$(date +%s)
  if [ ! -x "$venv/bin/mpirun" ]; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
      json mpi 0 0 "no mpirun or mpi4py here, and no wheels in $repo/.whl to install them from"
      exit 1
    fi
    { "$py" -m venv "$venv" || "$py" -m venv --without-pip "$venv"; } >"$logs/venv.log" 2>&1
    site=$("$venv/bin/python" -c "import site; print(site.getsitepackages()[0])")
    "$py" -c "import site; print(site.getsitepackages()[0])" >"$site/base-environment.pth"
    if [ -x "$venv/bin/pip" ]; then pip=("$venv/bin/python" -m pip)
    else pip=("$py" -m pip --python "$venv/bin/python"); fi
    if ! "${pip[@]}" install -q --no-index --no-deps --no-compile .whl/*.whl \
        >>"$logs/venv.log" 2>&1; then
      json mpi 0 $(( $(date +%s) - t0 )) "installing .whl/*.whl failed: see $logs/venv.log"
      exit 1
    fi
  fi
  export PATH="$venv/bin:$PATH"
  py="$venv/bin/python"
  json mpi 1 $(( $(date +%s) - t0 )) "installed from .whl/ into $venv"
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export OMPI_MCA_btl=${OMPI_MCA_btl:-self,sm,tcp} MPISHARD_MPIRUN_FLAGS="--oversubscribe"
mpirun=(mpirun --oversubscribe)
json mpi 1 0 "$(mpirun --version 2>&1 | head -n 1); $("$py" -c 'import mpi4py; print("mpi4py", mpi4py.__version__)')"
# Whether device buffers go to MPI directly (mpishard's own test of the library).
json cuda-aware-mpi 1 0 "$("$py" -c 'from mpishard.comm.cuda import cuda_aware_reason
aware, why = cuda_aware_reason(); print(("yes: " if aware else "no: ") + why)' 2>&1 | tail -n 1)"

bench_line() {  # bench_line NAME SECONDS LOGBASE COMMAND...: its JSON lines, or one saying it failed
  local name=$1 limit=$2 base=$3; shift 3
  local t0
  t0=$(date +%s)
  timeout "$limit" "$@" 2>"$base.err" | tee "$base.jsonl"
  if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    failed=1
    json "$name" 0 $(( $(date +%s) - t0 )) "see $base.err"
  fi
}

run_check() {  # run_check NAME LOG COMMAND...: one JSON line from pytest's summary or the status
  local name=$1 log=$2; shift 2
  local t0 rc summary
  t0=$(date +%s)
  "$@" >"$log" 2>&1
  rc=$?
  summary=$(grep -aE '[0-9]+ (passed|failed|error)' "$log" | tail -n 1 \
            | sed -e 's/\x1b\[[0-9;]*m//g' -e 's/=//g' -e 's/^ *//;s/ *$//')
  # pytest exits 5 when nothing was selected: not a failure of the code.
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then failed=1; fi
  json "$name" "$([ $rc -eq 0 ] || [ $rc -eq 5 ] && echo 1 || echo 0)" \
    $(( $(date +%s) - t0 )) "${summary:-exit $rc} (log $log)"
}

if [ "$tests" = 1 ]; then
  for kernels in $kernel_modes; do
    export MPISHARD_GPU_KERNELS=$kernels
    run_check "gpu-tests-1-rank-kernels-$kernels" "$logs/tests-1-$kernels.log" \
      timeout 300 "${mpirun[@]}" -n 1 "$py" -m pytest -q -p no:cacheprovider --with-mpi \
      -m "gpu and not launch" tests
    run_check "gpu-tests-2-ranks-kernels-$kernels" "$logs/tests-2-$kernels.log" \
      timeout 300 "${mpirun[@]}" -n 2 "$py" -m pytest -q -p no:cacheprovider --with-mpi \
      -m "gpu and mpi and not launch" tests
  done
  export MPISHARD_GPU_KERNELS=1
  run_check "gpu-job-tests" "$logs/tests-jobs.log" \
    timeout 300 "$py" -m pytest -q -p no:cacheprovider -m "gpu and launch" tests
  run_check "train-device-cuda" "$logs/train.log" \
    timeout 300 "${mpirun[@]}" -n 2 "$py" -m mpishard train --device cuda --samples 512 \
    --max-steps 40 --epochs 2 --out "$logs/train-out" --no-progress
  grep -a "done:\|stopped at" "$logs/train.log" | while read -r line; do
    json train-summary 1 0 "$line"
  done
fi

if [ "$bench" = 1 ]; then
  # Reproducible mode against the default step on the GPU (issue 22): the deposit's
  # CUDA kernels at 1 and 2 ranks, the twin's CuPy calls at 1 rank beside them, and
  # one unit per rank (--unit-rows rank) at 1 and 2 ranks.
  for spec in "1 1" "2 1" "1 0" "1 1 rank" "2 1 rank"; do
    set -- $spec
    tag="$1-$2${3:+-$3}"
    t0=$(date +%s)
    MPISHARD_GPU_KERNELS=$2 timeout 240 "${mpirun[@]}" -n "$1" "$py" \
      benchmarks/bench_reproducible.py --device cuda --models small gpt --dtypes float32 \
      --rounds 5 ${3:+--unit-rows "$3"} 2>"$logs/bench-repro-$tag.err" \
      | tee "$logs/bench-repro-$tag.jsonl" \
      || { failed=1; json "bench-reproducible-$tag" 0 $(( $(date +%s) - t0 )) \
      "see $logs/bench-repro-$tag.err"; }
  done
  # The fused attention alone (issue 33): time against the unfused path and
  # PyTorch's SDPA, error against the NumPy twin. One process, no MPI.
  bench_line bench-gpu-attention 150 "$logs/bench-attention" \
    "$py" benchmarks/bench_gpu_attention.py --torch
  # The steps against PyTorch eager at 1 rank: the GPT with the fused attention
  # on and off and as a CUDA graph, ZeRO-3 beside DDP and ZeRO-2; then with TF32.
  bench_line bench-1-rank-gpt 240 "$logs/bench-1-gpt" "${mpirun[@]}" -n 1 "$py" \
    benchmarks/bench_gpu.py --torch --graphs --models gpt --strategies ddp,zero2,zero3 \
    --kernels reference,fused,fused-noattn
  bench_line bench-1-rank-mlp 150 "$logs/bench-1-mlp" "${mpirun[@]}" -n 1 "$py" \
    benchmarks/bench_gpu.py --torch --graphs --models mlp --strategies ddp,zero2,zero3
  bench_line bench-1-rank-tf32 120 "$logs/bench-1-tf32" "${mpirun[@]}" -n 1 "$py" \
    benchmarks/bench_gpu.py --torch --graphs --tf32 --strategies ddp --kernels fused
  t0=$(date +%s)
  timeout 180 "${mpirun[@]}" -n 2 "$py" benchmarks/bench_gpu.py 2>"$logs/bench-2.err" \
    | tee "$logs/bench-2.jsonl" || { failed=1; json bench-2-ranks 0 $(( $(date +%s) - t0 )) \
    "see $logs/bench-2.err"; }
fi

json gpu-check "$([ $failed = 0 ] && echo 1 || echo 0)" $(( $(date +%s) - t_start )) \
  "logs in $logs"
exit $failed
