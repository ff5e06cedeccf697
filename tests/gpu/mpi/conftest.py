"""Real-device MPI tests: a failure on any rank aborts the whole job (tests/_mpi_abort.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/gpu: gpu_env
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests
from _mpi_abort import pytest_runtest_makereport  # noqa: E402,F401


def pytest_terminal_summary(terminalreporter):
    import gpu_env

    from mpi4py import MPI

    total = MPI.COMM_WORLD.allreduce(gpu_env.CALLS[0]) if MPI.Is_initialized() else gpu_env.CALLS[0]
    terminalreporter.write_line(f"device collectives: {gpu_env.CALLS[0]} on this rank, {total} on all ranks")
