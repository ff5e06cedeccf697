"""The MPI test sessions' rule: a failure on any rank aborts the whole job instead of leaving the others waiting.

Every rank runs the same test file; a test that fails on one rank only would
leave the other ranks inside the next collective forever.  So the first
failure is printed with its rank and the job is aborted, and ``mpirun``
exits non-zero at once (``MPIEXEC_TIMEOUT`` is the backstop for a hang that
raises nothing).  Imported by the conftest.py of tests/mpi and tests/gpu/mpi.
"""

import sys

import pytest


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
