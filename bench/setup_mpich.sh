#!/usr/bin/env bash
# The --mpich recipe: a second virtual environment whose MPI is the PyPI `mpich` wheel (MPICH 5,
# Hydra's mpirun), with ddlkernels installed editable from this checkout.  mpi4py's wheel picks the
# MPI library at run time, so nothing is compiled.  Idempotent.
#   bash bench/setup_mpich.sh [VENV]          (default /tmp/venv-mpich)
#   VENV/bin/mpirun -n 2 VENV/bin/python bench/sweeps/allreduce.py -b 4K -e 64M -f 2 --json m.json --plot m.png
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/tmp/venv-mpich}
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import mpi4py, numpy, ml_dtypes, numba, tqdm, matplotlib, ddlkernels" 2>/dev/null \
   || [ ! -x "$VENV/bin/mpirun" ]; then
  "$VENV/bin/pip" install -q numpy mpi4py mpich ml_dtypes numba tqdm matplotlib -e .
fi
"$VENV/bin/python" -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
