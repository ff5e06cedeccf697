#!/usr/bin/env bash
# Produce bench/results/: every table, JSON and PNG that bench/results/README.md quotes, each .txt opening with
# the exact command that made it.  Takes ~15 minutes on 2 cores.
#   PYTHON=/path/to/venv/bin/python bash bench/run_results.sh            (Open MPI from that venv)
#   bash bench/run_results.sh --mpich                                   (also MPICH: bench/setup_mpich.sh)
#   MPICH_PYTHON=/path/to/venv-mpich/bin/python bash bench/run_results.sh
# ITERS/WARMUP override the iteration counts (default 30/14; the size tuner's trials run in the warmup and the first iterations).
# ONLY=REGEX runs only the results whose name matches (e.g. ONLY=rs_ag after a change to reduce_scatter/allgather).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--mpich" ]; then
  bash bench/setup_mpich.sh /tmp/venv-mpich || exit 1
  MPICH_PYTHON=${MPICH_PYTHON:-/tmp/venv-mpich/bin/python}
fi
PY=${PYTHON:-$(command -v python)}
MPIRUN=${MPIRUN:-$(dirname "$PY")/mpirun}
OUT=${OUT:-bench/results}
ITERS=${ITERS:-30}
WARMUP=${WARMUP:-14}
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1}
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
export PRTE_MCA_rmaps_default_mapping_policy=${PRTE_MCA_rmaps_default_mapping_policy:-:oversubscribe}
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-1200}
mkdir -p "$OUT"
status=0

run() {  # run NAME CMD...: stdout (table) to $OUT/NAME.txt after a header with the command and conditions
  local name=$1; shift
  [[ -z "${ONLY:-}" || "$name" =~ $ONLY ]] || return 0
  { echo "# command: $*"; echo "# date: $(date -u +%FT%TZ); load average: $(cut -d' ' -f1-3 /proc/loadavg); cpus: $(nproc)"
    echo "# git: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- ddlkernels || echo +dirty)"; } > "$OUT/$name.txt"
  echo "== $name: $*" >&2
  "$@" >> "$OUT/$name.txt" || { echo "!! $name exited $?" >&2; status=1; }
  cat "$OUT/$name.txt"
}

SWEEP=(-b 4K -e 64M -f 2 -n "$ITERS" -w "$WARMUP" -d float32 -o sum --no-progress)
# The main sweeps twice (a minute apart: the machine's speed wanders), out of place, then once in place.
for rep in "" _repeat; do
  for n in 2 4; do
    run "allreduce_np${n}_float32$rep" "$MPIRUN" -n $n "$PY" bench/sweeps/allreduce.py "${SWEEP[@]}" --impls ddlkernels,ring,mpi,link,pyring,copy \
      --json "$OUT/allreduce_np${n}_float32$rep.json" --plot "$OUT/allreduce_np${n}_float32$rep.png"
  done
done
# The first sweep again with every buffer on 4 KiB pages (--pages small), where MPI's copy between processes and
# the link run slower (docs/benchmarks.md, "Buffers").
run allreduce_np2_float32_small "$MPIRUN" -n 2 "$PY" bench/sweeps/allreduce.py "${SWEEP[@]}" --pages small \
  --impls ddlkernels,ring,mpi,link,pyring,copy \
  --json "$OUT/allreduce_np2_float32_small.json" --plot "$OUT/allreduce_np2_float32_small.png"
run allreduce_np2_float32_inplace "$MPIRUN" -n 2 "$PY" bench/sweeps/allreduce.py "${SWEEP[@]}" --place in --impls ddlkernels,ring,mpi,link \
  --json "$OUT/allreduce_np2_float32_inplace.json" --plot "$OUT/allreduce_np2_float32_inplace.png"
# Half precision (the compiled float16/bfloat16 kernels of ddlkernels/kernels/half.py).  MPI has no bfloat16
# type, so that MPI line is skipped.
run allreduce_np2_half "$MPIRUN" -n 2 "$PY" bench/sweeps/allreduce.py -b 64K -e 64M -f 4 -n "$ITERS" -w "$WARMUP" -d float16,bfloat16 \
  -o sum --no-progress --impls ddlkernels,ring,mpi,link --json "$OUT/allreduce_np2_half.json" --plot "$OUT/allreduce_np2_half.png"
# Pipeline chunk size (ring forced at every size), one line per chunk, against the link.
run chunk_np2 "$MPIRUN" -n 2 "$PY" bench/sweeps/allreduce.py -b 1M -e 64M -f 4 -n "$ITERS" -w 3 --no-progress \
  --impls ddlkernels,link --small-bytes 0 --chunk-bytes 256K,1M,4M,16M \
  --json "$OUT/chunk_np2.json" --plot "$OUT/chunk_np2.png"
# MPI's own algorithms forced, beside ours (one mpirun per algorithm, merged).
run allreduce_np2_tuned "$PY" bench/sweeps/allreduce.py --launch 2 --mpi-algorithm ring,rabenseifner,recursive_doubling \
  -b 64K -e 64M -f 4 -n "$ITERS" -w "$WARMUP" --no-progress \
  --json "$OUT/allreduce_np2_tuned.json" --plot "$OUT/allreduce_np2_tuned.png"
for n in 2 4; do run rs_ag_np${n}_float32 "$MPIRUN" -n $n "$PY" bench/sweeps/allreduce.py --collective reduce_scatter,allgather -b 4K -e 64M -f 4 \
    -n "$ITERS" -w "$WARMUP" --no-progress --json "$OUT/rs_ag_np${n}_float32.json" --plot "$OUT/rs_ag_np${n}_float32.png"
done
# Inputs (allgather: shards) in Communicator.empty's shared memory, which peers read in place, beside the plain line.
for n in 2 4; do run shared_np${n}_float32 "$MPIRUN" -n $n "$PY" bench/sweeps/allreduce.py --collective all -b 64K -e 64M -f 4 -n "$ITERS" \
    -w "$WARMUP" -d float32 -o sum --no-progress --impls ddlkernels,shared,mpi,link \
    --json "$OUT/shared_np${n}_float32.json" --plot "$OUT/shared_np${n}_float32.png"
done
# Kernels: one process, then both ranks at once (memory bandwidth shared, as inside the ring).
run kernels_np1 "$PY" -m pytest bench/kernels/bench_reduce.py bench/kernels/bench_pack.py bench/studies/bench_plan.py -q --color=no \
  --bench-rounds 30 --benchmark-json "$OUT/kernels_np1.json"
run kernels_np2 "$MPIRUN" -n 2 "$PY" -m mpi4py -m pytest bench/kernels/bench_reduce.py -q --color=no -k "float32 or interleaved" \
  --bench-rounds 30 --benchmark-json "$OUT/kernels_np2.json"
# A job's first calls on an empty Numba cache, then on the cache it left (mpirun launched by the script).
for n in 2 4; do run first_calls_np$n "$PY" bench/studies/first_calls.py --ranks $n; done
# The kernel's copy between processes (process_vm_readv/writev) against memcpy: the ceiling of the "cma" path.
run kernel_copy "$PY" bench/kernels/kernel_copy.py --rounds 9
# What a process's first half-precision reduction costs: Numba compiling, then loading its cache.
run half_compile "$PY" bench/kernels/half_compile.py
if [ -n "${MPICH_PYTHON:-}" ]; then
  run allreduce_np2_mpich "$(dirname "$MPICH_PYTHON")/mpirun" -n 2 "$MPICH_PYTHON" bench/sweeps/allreduce.py "${SWEEP[@]}" --impls ddlkernels,ring,mpi,link \
    --json "$OUT/allreduce_np2_mpich.json" --plot "$OUT/allreduce_np2_mpich.png"
fi
exit $status
