"""MPI test session: a failure on any rank aborts the whole job instead of leaving the others waiting.

Every rank runs the same test file; a test that fails on one rank only would
leave the other ranks inside the next collective forever.  So the first
failure is printed with its rank and the job is aborted, and ``mpirun``
exits non-zero at once (``MPIEXEC_TIMEOUT`` is the backstop for a hang that
raises nothing).
"""

import os
import sys

import pytest

# Without a GPU, device tests run in the Numba CUDA simulator, which must be
# switched on before numba is first imported by any test module; deciding
# it here, before collection, keeps that independent of module order.
if "numba" not in sys.modules and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        if comm.Get_size() > 1:
            sys.stderr.write(f"\n[rank {comm.Get_rank()}/{comm.Get_size()}] FAILED {item.nodeid} ({report.when})\n")
            sys.stderr.write(str(report.longrepr) + "\n")
            sys.stderr.flush()
            comm.Abort(1)
