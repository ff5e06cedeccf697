"""One MPI job per failure scenario, launched by tests/test_no_hang.py (``mpirun -n 4 python [-m mpi4py] this.py SCENARIO``).

Each scenario makes the job fail in one way; the test asserts that the job
exits non-zero within a bound instead of hanging, and that the output says why.

mismatch-count|dtype|op|dims   one rank passes a different argument, validate=True, uncaught
raise-mid-collective           rank 2's reduction kernel raises inside a ring step of a 4 MiB allreduce
raise-between-helper           rank 2 raises between collectives inside ddlkernels.abort_on_exception()
raise-between-bare             the same without the helper and without -m mpi4py (the control: it hangs)
stuck-rank-timeout             rank 3 never joins; the others have timeout=3 inside abort_on_exception()
absent-first-call              rank 3 never makes the job's first call (timeout=3), which creates the default
                               Communicator: the others raise CollectiveTimeout, print after how long, and exit
absent-first-shm               the same at the first call through the shared-memory window (its creation)
absent-first-cma               the same at the first single-copy call (the window's flags are created then)
absent-engine                  the same at the first allreduce_async on a Communicator(timeout=3) (its engine)
timeout-caught-exit            rank 3 is 2.5 s late to a 2.4 MB allreduce; the others' timeout=1 expires, they
                               catch it, drop their arrays; rank 3's call then completes on every rank; a new
                               Communicator reduces correctly; every rank exits normally (exit status 0)
"""

import gc
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


def absent(first):
    """Rank 3 never makes ``first(x)``, a call with timeout=3 whose setup is a hidden collective; the others
    print when they raised, wait a moment (so that every rank prints before the first exception aborts the job)
    and raise."""
    x = np.ones(1 << 16, np.float32)
    if RANK == ODD:
        time.sleep(600)
    t0 = time.monotonic()
    try:
        first(x)
    except ddlkernels.CollectiveTimeout as e:
        print(f"rank {RANK}: CollectiveTimeout after {time.monotonic() - t0:.1f} s: {e}", flush=True)
        time.sleep(1)
        raise


def settled_on_cma(c, x):
    if "cma" not in c.algorithms:
        print(f"rank {RANK}: the single copy is not permitted here", flush=True)
        sys.exit(3)
    c.settle(x, "cma")
    return c


def timeout_caught_exit():
    n = 300_000
    dc = ddlkernels.Communicator(timeout=1)
    x = np.full(n, float(RANK))
    if RANK == ODD:
        time.sleep(2.5)
        y = dc.allreduce(x)  # completes the call the others abandoned
        assert (y == sum(range(P))).all()
    else:
        try:
            dc.allreduce(x)
        except ddlkernels.CollectiveTimeout as e:
            print(f"rank {RANK}: caught {str(e)[:60]}...", flush=True)
        del x
        gc.collect()
        junk = [np.full(n, 7.0) for _ in range(8)]
    fresh = ddlkernels.Communicator()
    z = fresh.allreduce(np.arange(1000.0) + RANK)
    assert (z == np.arange(1000.0) * P + sum(range(P))).all()
    if RANK != ODD:
        assert all((j == 7.0).all() for j in junk), "memory freed after the timeout was written"
    fresh.free()


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
    elif scenario == "absent-first-call":
        absent(lambda x: ddlkernels.allreduce(x, timeout=3))
    elif scenario == "absent-first-shm":
        c = ddlkernels.Communicator(shm=True, timeout=3)
        absent(c.allreduce)
    elif scenario == "absent-first-cma":
        c = ddlkernels.Communicator(timeout=3)
        absent(lambda x: settled_on_cma(c, x).allreduce(x))
    elif scenario == "absent-engine":
        c = ddlkernels.Communicator(timeout=3)
        absent(lambda x: ddlkernels.allreduce_async(x, comm=c).wait())
    elif scenario == "timeout-caught-exit":
        timeout_caught_exit()
    else:
        sys.exit(f"unknown scenario {scenario}")
    print(f"rank {RANK}: scenario {scenario} completed without error", flush=True)
