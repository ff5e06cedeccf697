#!/usr/bin/env bash
# The real-device test suite (tests/gpu/) and the device benchmarks on a GPU machine, in one go, with a
# short summary last.
#
#   bash tests/gpu/prepare_wheels.sh     # beforehand, where pip reaches PyPI: MPI wheels into .device-wheels/
#   bash tests/gpu/run_on_device.sh      # on the GPU machine, .device-wheels/ carried along
#
# Steps (STEPS, a comma list run in its order; "tests" and "bench" name groups):
#   tests = kernels (both device backends in one process), then mpirun-nN for N in RANKS (tests/gpu/mpi file
#           by file, every rank on the GPU, never the Numba simulator; mpirun-nN-FILE runs one file)
#   bench = device-kernels (bench/kernels/device_kernels.py: kernels beside torch and CuPy), chunk-cost-n2
#           (bench/studies/chunk_cost.py: the cost of a staged chunk), device-sweep-n2 and -n4
#           (bench/sweeps/device_allreduce.py: ddlkernels beside the hand-rolled loop, gloo, NCCL where it
#           can run), their JSON beside the logs
#   in no group: sharded-n2 times device reduce_scatter and allgather at 2 ranks; ipc-schedules-nN the CUDA IPC
#   allreduce's schedules (bench/studies/ipc_schedules.py) at N ranks; ipc-profile-nN the library's IPC allreduce
#   under torch's profiler at N ranks (bench/studies/ipc_profile.py: CUDA calls and kernels per rank, Chrome
#   traces beside the logs); reduce-launch the reduce kernel's launch shapes (bench/studies/reduce_launch.py);
#   half-sums the f16/bf16 sums added in pairs against the same kernels widened (bench/studies/half_sums.py);
#   staged-pieces-nN the "host" algorithm's cuts of a call beside the host arrays' allreduce at N ranks
#   (bench/studies/staged_pieces.py)
# MPS=1 runs every step under CUDA's Multi-Process Service where nvidia-cuda-mps-control exists (started here with
# its pipes under $TMPDIR, stopped at exit): the ranks that share a GPU then share one context instead of taking
# turns on it (no card setting changes).
# A lent device runs one command for at most 10 minutes, so every step has a time limit (STEP_TIMEOUT, 300 s)
# and the whole run a deadline (DEADLINE, 570 s after the start): a step that cannot start 20 s before it is
# reported as not run.  Logs and JSON go to $TMPDIR/gpu-tests, and, after every step, into
# $OUT/gpu-tests.tar.gz where $OUT is set, so a run cut short still returns what it did.  Exits non-zero
# on any failure, time-out or step not run, on any skipped test (a skip here means the device was not used),
# and when no device is visible.  Last, the issue's targets judged on the JSON of this run
# (bench/sweeps/targets.py; a target missed is reported, not a failure of the run).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}
LOGDIR=${TMPDIR:-/tmp}/gpu-tests
mkdir -p "$LOGDIR"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NUMBA_ENABLE_CUDASIM=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe OMPI_MCA_rmaps_base_oversubscribe=1
RANKS=${RANKS:-2,3,4}
STEPS=${STEPS:-tests,bench}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
DEADLINE=${DEADLINE:-570}
t0=$(date +%s)

if ! "$PY" -c "from mpi4py import MPI; MPI.Get_library_version()" >/dev/null 2>&1; then
    if ! ls .device-wheels/*.whl >/dev/null 2>&1; then
        echo "run_on_device: no usable MPI here and no .device-wheels/: run tests/gpu/prepare_wheels.sh first"
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --upgrade .device-wheels/*.whl || exit 2
fi
PY=$("$PY" -c 'import sys; print(sys.executable)')  # mpirun's ranks must get this python, not the first on PATH
MPIRUN="$(dirname "$PY")/mpirun"
[ -x "$MPIRUN" ] || MPIRUN=$(command -v mpirun || true)
[ -n "$MPIRUN" ] || { echo "run_on_device: no mpirun"; exit 2; }

DEVICE=$("$PY" -c "import sys; sys.path.insert(0, 'tests/gpu'); import gpu_env as G; print(G.device_name() if G.cp else 'none: ' + G.REASON)")
echo "device: $DEVICE"
case "$DEVICE" in none*) echo "run_on_device: no CUDA device: nothing was tested"; exit 2 ;; esac
"$PY" - <<'PY'
import cupy, numpy, numba, sys
from mpi4py import MPI
try:
    import torch
    t = f"torch {torch.__version__} (CUDA {torch.version.cuda})"
except ImportError:
    t = "no torch"
print(f"python {sys.version.split()[0]}, numpy {numpy.__version__}, cupy {cupy.__version__}, numba {numba.__version__}, "
      f"{t}; {MPI.Get_library_version().splitlines()[0]}")
PY

if [ "${MPS:-0}" = 1 ]; then
    command -v nvidia-cuda-mps-control >/dev/null || { echo "run_on_device: MPS=1 but no nvidia-cuda-mps-control"; exit 2; }
    export CUDA_MPS_PIPE_DIRECTORY=${TMPDIR:-/tmp}/mps-pipe CUDA_MPS_LOG_DIRECTORY=${TMPDIR:-/tmp}/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "run_on_device: the MPS daemon did not start"; exit 2; }
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
    DEVICE="$DEVICE, under MPS"
fi

SUMMARY=()
FAILED=0
save_logs() {  # the logs so far, where the device tool brings them back
    [ -n "${OUT:-}" ] && tar -czf "$OUT/gpu-tests.tar.gz" -C "$LOGDIR" . 2>/dev/null
}
step() {  # step NAME COMMAND...: run under the step's time limit, log, and keep pytest's last line
    local name=$1; shift
    local s=$(date +%s)
    local left=$(( DEADLINE - (s - t0) ))
    if [ "$left" -lt 20 ]; then
        FAILED=1; SUMMARY+=("$name: NOT RUN (${left} s left of DEADLINE=$DEADLINE)"); return
    fi
    local limit=$(( left < STEP_TIMEOUT ? left : STEP_TIMEOUT ))
    echo "=== $name (at most $limit s): $*"
    MPIEXEC_TIMEOUT=$limit timeout -k 10 "$limit" "$@" 2>&1 | tee "$LOGDIR/$name.log"
    local rc=${PIPESTATUS[0]}
    local last=$(grep -aE "[0-9]+ (passed|failed|skipped|error)|wrong elements in all" "$LOGDIR/$name.log" | tail -1 | sed 's/=//g; s/^ *//')
    local calls=$(grep -aE "^device collectives:" "$LOGDIR/$name.log" | tail -1 | sed 's/.*, \([0-9]*\) on all ranks/\1/')
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        FAILED=1; last="TIMED OUT after $limit s: $last"
    elif [ "$rc" -ne 0 ] || grep -qE "[0-9]+ (failed|error)" <<<"$last" || grep -qE "[0-9]+ skipped" <<<"$last"; then
        FAILED=1; last="FAILED (exit $rc): $last"
    fi
    SUMMARY+=("$name: $last${calls:+; $calls device collectives}; $(( $(date +%s) - s )) s")
    save_logs
}
run_step() {  # run_step NAME: the command of each step
    local name=$1 n
    case "$name" in
        kernels) step kernels "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu --ignore=tests/gpu/mpi ;;
        mpirun-n*-test_*) n=${name#mpirun-n}; n=${n%%-*}  # one file: mpirun-n2-test_ipc_device
            step "$name" "$MPIRUN" -n "$n" "$PY" -m mpi4py tests/_mpi_pytest.py -q -rs "tests/gpu/mpi/${name#mpirun-n$n-}.py" ;;
        mpirun-n*) n=${name#mpirun-n}  # file by file: a failure aborts the whole MPI job, not the other files
            for f in tests/gpu/mpi/test_*.py; do
                step "$name-$(basename "$f" .py)" "$MPIRUN" -n "$n" "$PY" -m mpi4py tests/_mpi_pytest.py -q -rs "$f"
            done ;;
        device-kernels) step device-kernels "$PY" bench/kernels/device_kernels.py --json "$LOGDIR/device_kernels.json" ;;
        chunk-cost-n2) step chunk-cost-n2 "$MPIRUN" -n 2 "$PY" bench/studies/chunk_cost.py --device cuda \
            --json "$LOGDIR/chunk_cost_np2.json" ;;
        device-sweep-n*) n=${name#device-sweep-n}
            step "$name" "$MPIRUN" -n "$n" "$PY" bench/sweeps/device_allreduce.py --sizes 1M,64M,256M \
                --json "$LOGDIR/device_allreduce_np$n.json" ;;
        ipc-schedules-n*) n=${name#ipc-schedules-n}
            step "$name" "$MPIRUN" -n "$n" "$PY" bench/studies/ipc_schedules.py --sizes 1M,64M,256M ;;
        ipc-profile-n*) n=${name#ipc-profile-n}
            step "$name" "$MPIRUN" -n "$n" "$PY" bench/studies/ipc_profile.py --sizes 1M,256M \
                --trace-dir "$LOGDIR/ipc_profile_np$n" ;;
        reduce-launch) step reduce-launch "$PY" bench/studies/reduce_launch.py ;;
        half-sums) step half-sums "$PY" bench/studies/half_sums.py ;;
        staged-pieces-n*) n=${name#staged-pieces-n}
            step "$name" "$MPIRUN" -n "$n" "$PY" bench/studies/staged_pieces.py --sizes 64M,256M ;;
        sharded-n2) step sharded-n2 "$MPIRUN" -n 2 "$PY" -m ddlkernels bench --device cuda \
            --collective reduce_scatter,allgather -b 1M -e 256M -f 16 -n 5 -w 2 --json "$LOGDIR/device_sharded_np2.json" ;;
        *) echo "run_on_device: no step named $name"; FAILED=1; SUMMARY+=("$name: no such step") ;;
    esac
}
for item in ${STEPS//,/ }; do
    case "$item" in
        tests) for name in kernels $(for n in ${RANKS//,/ }; do echo "mpirun-n$n"; done); do run_step "$name"; done ;;
        bench) for name in device-kernels chunk-cost-n2 device-sweep-n2 device-sweep-n4; do run_step "$name"; done ;;
        *) run_step "$item" ;;
    esac
done

echo
echo "=== GPU suite summary ($DEVICE, $(( $(date +%s) - t0 )) s in all)"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
TARGETS=()  # issue 31's targets, judged on what this run measured
for f in "$LOGDIR"/device_allreduce_np*.json; do [ -f "$f" ] && TARGETS+=(--device "$f"); done
[ -f "$LOGDIR/device_kernels.json" ] && TARGETS+=(--device-kernels "$LOGDIR/device_kernels.json")
if [ ${#TARGETS[@]} -gt 0 ]; then
    echo; echo "=== targets ($DEVICE)"; "$PY" bench/sweeps/targets.py "${TARGETS[@]}" | tee "$LOGDIR/targets.txt"
fi
save_logs && echo "logs and JSON: \$OUT/gpu-tests.tar.gz"
if [ "$FAILED" -ne 0 ]; then echo "GPU SUITE FAILED"; exit 1; fi
echo "GPU SUITE PASSED"
