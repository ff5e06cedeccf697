#!/usr/bin/env bash
# The real-device test suite (tests/gpu/) on a GPU machine, in one go, with a short summary last.
#
#   bash tests/gpu/prepare_wheels.sh     # beforehand, where pip reaches PyPI: MPI wheels into .device-wheels/
#   bash tests/gpu/run_on_device.sh      # on the GPU machine, .device-wheels/ carried along
#
# Runs the kernels of both device backends in one process, then the collectives under
# mpirun -n 2, 3 and 4 (every rank on the GPU; with several GPUs each rank still uses the
# current one), never in the Numba simulator; then the kernels beside torch and CuPy
# (bench/kernels/device_kernels.py), the cost of a staged chunk (bench/studies/chunk_cost.py)
# and the device sweep (bench/sweeps/device_allreduce.py: ddlkernels beside the hand-rolled
# loop, gloo, NCCL where it can run) at 2 and 4 ranks, their JSON beside the logs.  Logs go to $OUT/gpu-tests (or $TMPDIR).  Exits
# non-zero on any failure, on any skipped test (a skip here means the device was not used),
# and when no device is visible.  RANKS=2,4 picks other rank counts; STEPS=tests or STEPS=bench
# runs one half (a device command may run 10 minutes); STEPS=sharded (not in the default) times
# device reduce_scatter and allgather (python -m ddlkernels bench --device cuda) at 2 ranks.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}
LOGDIR=${TMPDIR:-/tmp}/gpu-tests
mkdir -p "$LOGDIR"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NUMBA_ENABLE_CUDASIM=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe OMPI_MCA_rmaps_base_oversubscribe=1
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-600}
RANKS=${RANKS:-2,3,4}
STEPS=${STEPS:-tests,bench}  # tests: tests/gpu at RANKS; bench: the device benchmarks (two runs fit 10 minutes each)
t0=$(date +%s)

if ! "$PY" -c "from mpi4py import MPI; MPI.Get_library_version()" >/dev/null 2>&1; then
    if ! ls .device-wheels/*.whl >/dev/null 2>&1; then
        echo "run_on_device: no usable MPI here and no .device-wheels/: run tests/gpu/prepare_wheels.sh first"
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --upgrade .device-wheels/*.whl || exit 2
fi
MPIRUN="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")/mpirun"
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

SUMMARY=()
FAILED=0
step() {  # step NAME COMMAND...: run, log, and keep pytest's last line
    local name=$1; shift
    local s=$(date +%s)
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$LOGDIR/$name.log"
    local rc=${PIPESTATUS[0]}
    local last=$(grep -E "[0-9]+ (passed|failed|skipped|error)|wrong elements in all" "$LOGDIR/$name.log" | tail -1 | sed 's/=//g; s/^ *//')
    local calls=$(grep -E "^device collectives:" "$LOGDIR/$name.log" | tail -1 | sed 's/.*, \([0-9]*\) on all ranks/\1/')
    if [ "$rc" -ne 0 ] || grep -qE "[0-9]+ (failed|error)" <<<"$last" || grep -qE "[0-9]+ skipped" <<<"$last"; then
        FAILED=1
        last="FAILED (exit $rc): $last"
    fi
    SUMMARY+=("$name: $last${calls:+; $calls device collectives}; $(( $(date +%s) - s )) s")
}

if [[ ",$STEPS," == *,tests,* ]]; then
    step kernels "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu --ignore=tests/gpu/mpi
    for n in ${RANKS//,/ }; do
        step "mpirun-n$n" "$MPIRUN" -n "$n" "$PY" -m mpi4py tests/_mpi_pytest.py -q -rs tests/gpu/mpi
    done
fi
if [[ ",$STEPS," == *,bench,* ]]; then
    step device-kernels "$PY" bench/kernels/device_kernels.py --json "$LOGDIR/device_kernels.json"
    step chunk-cost-n2 "$MPIRUN" -n 2 "$PY" bench/studies/chunk_cost.py --device cuda \
        --json "$LOGDIR/chunk_cost_np2.json"
    for n in 2 4; do
        step "device-sweep-n$n" "$MPIRUN" -n "$n" "$PY" bench/sweeps/device_allreduce.py --sizes 1M,64M,256M \
            --json "$LOGDIR/device_allreduce_np$n.json"
    done
fi
if [[ ",$STEPS," == *,sharded,* ]]; then
    step sharded-n2 "$MPIRUN" -n 2 "$PY" -m ddlkernels bench --device cuda --collective reduce_scatter,allgather \
        -b 1M -e 256M -f 16 -n 5 -w 2 --json "$LOGDIR/device_sharded_np2.json"
fi

echo
echo "=== GPU suite summary ($DEVICE, $(( $(date +%s) - t0 )) s in all)"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
if [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/gpu-tests-${STEPS//,/-}.tar.gz" -C "$LOGDIR" . && echo "logs and JSON: \$OUT/gpu-tests-${STEPS//,/-}.tar.gz"
fi
if [ "$FAILED" -ne 0 ]; then echo "GPU SUITE FAILED"; exit 1; fi
echo "GPU SUITE PASSED"
