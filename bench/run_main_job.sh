#!/usr/bin/env bash
# Set everything up in .venv (idempotent) and run the main job: 4 ranks
# allreduce a sweep of sizes (4 KiB .. 64 MiB float32), check every result,
# and print an nccl-tests-style table beside MPI's own Allreduce -- or, where
# every rank has a GPU (CuPy), the same on GPU buffers beside the hand-rolled
# D2H + MPI + H2D loop, gloo and NCCL (--device host/cuda to choose).
# Extra arguments go to `python -m ddlkernels job` (e.g. -b 1M -e 256M).
set -euo pipefail
cd "$(dirname "$0")/.."
bash bench/setup_env.sh
# Running as root and with more ranks than cores must just work.
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1}
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
export PRTE_MCA_rmaps_default_mapping_policy=${PRTE_MCA_rmaps_default_mapping_policy:-:oversubscribe}
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-900}
exec .venv/bin/mpirun -n "${RANKS:-4}" .venv/bin/python -m mpi4py -m ddlkernels job "$@"
