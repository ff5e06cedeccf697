"""Choices a rank makes alone never make the ranks run different algorithms or MPI calls.

In place or out of place, a ``timeout=``, an input in shared memory, a
strided input: ranks may differ in each within one call.  Each test makes
enough calls of a size for the tuner to try every candidate and settle,
with the ranks choosing differently call by call, and checks every result
exactly and that every rank ran the same algorithm in every call.
``validate=True`` (where used) would name a disagreement instead of letting
it hang.
"""

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels
from ddlkernels.select.tuner import tuning_calls
from helpers import rank_data

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
ODD = P - 1

needs_two = pytest.mark.skipif(P < 2, reason="needs 2 or more ranks to differ")

#: float64 elements: MPI's own calls and the window (latency-bound), the single copy, the ring's range
SIZES = [5, 700, 9000, 140_000]


def calls_to_settle(dc, n):
    cands = dc.candidates(np.zeros(n, np.float64))
    return tuning_calls(8 * n, len(cands)) + 3


def placed(k, x, shared):
    """Call ``k``'s input on this rank, and where its result goes: the ranks choose differently call by call."""
    how = (k + RANK) % 4
    if how == 0:
        return x.copy(), "inplace"
    if how == 1:
        return x, "new"
    if how == 2:
        strided = np.empty(2 * x.size)
        strided[::2] = x
        return strided[::2], "out"
    shared[...] = x
    return shared, "out"


@needs_two
@pytest.mark.parametrize("n", SIZES)
def test_placement_contiguity_and_shared_inputs_differ_across_ranks(n):
    with ddlkernels.Communicator(COMM, validate=True) as dc:
        shared = dc.empty(n, np.float64)
        for k in range(calls_to_settle(dc, n)):
            x = rank_data(n, RANK, P, np.float64, salt=k)
            want = sum(rank_data(n, r, P, np.float64, salt=k) for r in range(P))
            src, how = placed(k, x, shared)
            keep = src.copy()
            if how == "inplace":
                y = dc.allreduce(src, out=src)
            elif how == "new":
                y = dc.allreduce(src)
            else:
                y = dc.allreduce(src, out=np.empty(n))
            assert np.array_equal(y, want), (n, k, how, dc.last_algorithm)
            if how != "inplace":
                assert np.array_equal(src, keep), "an out-of-place call wrote its input"
            algos = COMM.allgather(dc.last_algorithm)
            assert len(set(algos)) == 1, (n, k, algos)
        del shared


@needs_two
@pytest.mark.parametrize("n", [5, 9000])
def test_a_timeout_on_some_ranks_only(n):
    """Every third call one rank passes ``timeout=``, the others do not: they must make the same MPI calls
    (a blocking and a nonblocking collective never match).  reduce_scatter and allgather through the tuner, and
    (with and without ``count``) at a fixed small_bytes through MPI's own calls; the argument check runs on some
    calls too."""
    mpi = ddlkernels.Communicator(COMM, small_bytes=1 << 30)
    tuned = ddlkernels.Communicator(COMM)
    for k in range(calls_to_settle(tuned, n)):
        t = 30 if k % 3 == 0 and RANK == k % P else None
        x = rank_data(n, RANK, P, np.float64, salt=k)
        want = sum(rank_data(n, r, P, np.float64, salt=k) for r in range(P))
        assert np.array_equal(tuned.allreduce(x, timeout=t), want), (k, tuned.last_algorithm)
        assert np.array_equal(tuned.allreduce(x, timeout=t, validate=k % 2 == 0), want)
        lo, hi = tuned.shard_range(n)  # the window's compiled loops (no deadline) meet its Python loops (deadline)
        shard = tuned.reduce_scatter(x, timeout=t)
        assert np.array_equal(shard, want[lo:hi]), (k, tuned.last_algorithm)
        assert np.array_equal(tuned.allgather(shard, count=n, timeout=t), want), (k, tuned.last_algorithm)
        lo, hi = mpi.shard_range(n)
        shard = mpi.reduce_scatter(x, timeout=t)
        assert np.array_equal(shard, want[lo:hi]) and mpi.last_algorithm == "mpi"
        assert np.array_equal(mpi.allgather(shard, count=n, timeout=t), want)
        assert np.array_equal(mpi.allgather(shard, timeout=t if k % 2 else None), want)
        assert np.array_equal(mpi.allreduce(x, timeout=t), want) and mpi.last_algorithm == "mpi"
    mpi.free()
    tuned.free()
