"""One MPI job per failure scenario, launched by tests/test_no_hang.py (``mpirun -n 4 python [-m mpi4py] this.py SCENARIO``).

Each scenario makes the job fail in one way; the test asserts that the job
exits non-zero within a bound instead of hanging, and that the output says why.

mismatch-count|dtype|op|dims   one rank passes a different argument, validate=True, uncaught
raise-mid-collective           rank 2's reduction kernel raises inside a ring step of a 4 MiB allreduce
raise-between-helper           rank 2 raises between collectives inside ddlkernels.abort_on_exception()
raise-between-bare             the same without the helper and without -m mpi4py (the control: it hangs)
stuck-rank-timeout             rank 3 never joins; the others have timeout=3 inside abort_on_exception()
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import ddlkernels

COMM = MPI.COMM_WORLD
RANK, P = COMM.Get_rank(), COMM.Get_size()
ODD = P - 1  # the rank that differs


def mismatch(kind):
    # The flat ring for all but the dims case, so that only the named field differs
    # (with dims=None the library may pick MPI's allreduce for one op and the ring for another).
    n, dtype, op, dims = 1000, np.float32, "sum", (P,) if kind != "dims" else None
    if RANK == ODD:
        if kind == "count":
            n = 1001
        elif kind == "dtype":
            dtype = np.float64
        elif kind == "op":
            op = "max"
        elif kind == "dims":
            dims = (P,)
    ddlkernels.allreduce(np.ones(n, dtype), op, dims=dims, validate=True)


def raise_mid_collective():
    from ddlkernels.backends import _numpy

    calls = {"n": 0}
    orig = _numpy.NumpyBackend.reduce

    def faulty(self, *a, **k):
        calls["n"] += 1
        if RANK == 2 and calls["n"] == 3:
            raise RuntimeError("injected fault in rank 2's reduction, mid-collective")
        return orig(self, *a, **k)

    _numpy.NumpyBackend.reduce = faulty
    x = np.ones(1 << 20, np.float32)
    ddlkernels.allreduce(x, dims=(P,), chunk_bytes=64 << 10)


def raise_between(helper):
    x = np.ones(1 << 18, np.float32)

    def body():
        ddlkernels.allreduce(x, dims=(P,))
        if RANK == 2:
            raise RuntimeError("rank 2 fails between collectives")
        ddlkernels.allreduce(x, dims=(P,))

    if helper:
        with ddlkernels.abort_on_exception():
            body()
    else:
        body()


def stuck_rank_timeout():
    # Creating a Communicator is collective and has no timeout: done by all.
    # Rank 0, whose ring predecessor is the stuck rank, waits 3 s; the others,
    # who wait on a predecessor that is itself stuck, 6 s.  With one timeout
    # for all, whichever rank entered the call first would time out first and
    # its MPI_Abort could kill rank 0 before its report (seen on a loaded
    # machine: rank 2's "waiting to receive from rank 1" ended the job).
    comm = ddlkernels.Communicator(timeout=3 if RANK == 0 else 6)
    x = np.ones(1 << 18, np.float32)
    comm.allreduce(x, dims=(P,))
    with ddlkernels.abort_on_exception():
        if RANK == ODD:
            time.sleep(600)  # alive but never joins (a deadlocked data loader, say)
        comm.allreduce(x, dims=(P,))


if __name__ == "__main__":
    scenario = sys.argv[1]
    if scenario.startswith("mismatch-"):
        mismatch(scenario.split("-", 1)[1])
    elif scenario == "raise-mid-collective":
        raise_mid_collective()
    elif scenario == "raise-between-helper":
        raise_between(True)
    elif scenario == "raise-between-bare":
        raise_between(False)
    elif scenario == "stuck-rank-timeout":
        stuck_rank_timeout()
    else:
        sys.exit(f"unknown scenario {scenario}")
    print(f"rank {RANK}: scenario {scenario} completed without error", flush=True)
