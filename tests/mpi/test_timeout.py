"""timeout=: a rank that never joins turns into CollectiveTimeout naming the phase, step, chunk and peer.

The last rank skips one collective on a fresh Communicator; every other rank
must raise within the timeout, name the rank it was waiting on, and then
refuse to use that Communicator again (its messages are still in flight).
COMM_WORLD is untouched, so a barrier resynchronises the job afterwards.
With a timeout that does not expire, results are exact (tests/mpi/test_validate.py
and the fuzz test run calls with timeouts too).
"""

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels
from helpers import assert_close, rank_data

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
ODD = P - 1
TIMEOUT = 1.0

needs_two = pytest.mark.skipif(P < 2, reason="needs 2 or more ranks for one to be missing")


def missing_rank(call, before=None, **options):
    """Every rank but the last runs ``call(comm)`` on a fresh Communicator; returns the timeout it raised.

    ``before(comm)``: run by every rank first (a window to allocate, say); ``options``: of the Communicator.
    """
    comm = ddlkernels.Communicator(timeout=TIMEOUT, **options)
    if before is not None:
        before(comm)
    err = None
    if RANK != ODD:
        with pytest.raises(ddlkernels.CollectiveTimeout) as info:
            call(comm)
        err = info.value
        assert err.rank == RANK and err.timeout == TIMEOUT
        with pytest.raises(RuntimeError, match="this Communicator is unusable: an earlier collective timed out"):
            comm.allreduce(np.ones(3))
    COMM.Barrier()
    return err


@needs_two
def test_ring_timeout_names_the_peer_step_and_chunk():
    n = 64 * P
    err = missing_rank(lambda c: c.allreduce(np.ones(n, np.float32), dims=(P,), chunk_bytes=64))
    if RANK != ODD:
        # Flat ring: rank r receives from r - 1.  Rank 0 waits for the missing
        # rank in step 0; each later rank gets one step further before it
        # waits for a predecessor that is itself stuck.
        assert err.collective == "allreduce"
        assert err.peer == (RANK - 1) % P
        assert err.step == RANK
        assert err.phase == "reduce-scatter along dimension 1 (phase 0)"
        assert err.chunk == "0 of 4"
        assert str(err).startswith(
            f"allreduce timed out after 1 s on rank {RANK}: waiting to receive from rank {(RANK - 1) % P} in "
            f"reduce-scatter along dimension 1 (phase 0), step {RANK}, chunk 0 of 4 (elements ["
        )


@needs_two
def test_small_message_timeout_on_mpi_path():
    err = missing_rank(lambda c: c.allreduce(np.ones(4, np.float64)))
    if RANK != ODD:
        assert "waiting to complete MPI_Iallreduce (a rank has not joined)" in str(err)


@needs_two
@pytest.mark.parametrize("n", [5, 300_000], ids=["whole", "pieces"])
def test_timeout_in_the_shared_memory_barrier(n):
    """The window's barriers are flags polled from Python under a deadline: a missing rank is named as one."""
    x = rank_data(n, RANK, P, np.float32)
    err = missing_rank(lambda c: c.allreduce(x), before=lambda c: c.allreduce(x), shm=True)
    if RANK != ODD:
        assert str(err).startswith("allreduce timed out after 1 s")
        assert "waiting to complete the barrier of the shared-memory allreduce (a rank has not joined)" in str(err)


@needs_two
def test_timeout_in_the_argument_check_and_allgather():
    err = missing_rank(lambda c: c.allgather(np.ones(3), validate=True))
    if RANK != ODD:
        assert str(err).startswith("allgather timed out after 1 s")
        assert "the argument check (MPI_Iallreduce)" in str(err)
    err = missing_rank(lambda c: c.allgather(np.ones(3)))
    if RANK != ODD:
        assert "MPI_Iallgather" in str(err)


@needs_two
@pytest.mark.parametrize("n", [4 * P, 4 * P + 1], ids=["equal-shards", "unequal-shards"])
def test_timeout_on_mpis_own_reduce_scatter_and_allgather(n):
    """small_bytes fixed above the size: MPI's own calls, polled; a missing rank names the call."""

    def rs(c):
        c.small_bytes = 1 << 30
        c.reduce_scatter(np.ones(n, np.float64))

    def ag(c):
        c.small_bytes = 1 << 30
        lo, hi = c.shard_range(n)
        c.allgather(np.ones(hi - lo), count=n)

    block = "_block" if n % P == 0 else ""
    err = missing_rank(rs)
    if RANK != ODD:
        assert f"waiting to complete MPI_Ireduce_scatter{block} (a rank has not joined)" in str(err), str(err)
    err = missing_rank(ag)
    if RANK != ODD:
        want = "MPI_Iallgather " if n % P == 0 else "MPI_Iallgatherv"
        assert f"waiting to complete {want}" in str(err) + " ", str(err)


def test_results_with_a_timeout_that_does_not_expire():
    comm = ddlkernels.Communicator(timeout=120)
    for n, dims, dt in [(0, None, np.float32), (5, None, np.float64), (4097, (P,), np.float16), (30011, None, np.int64)]:
        x = rank_data(n, RANK, P, dt)
        inputs = COMM.allgather(x)
        assert_close(comm.allreduce(x, "sum", dims=dims, chunk_bytes=4096), inputs, "sum", dt, f"n={n}")
        y = x.copy()
        comm.allreduce(y, "max", out=y, timeout=60)
        assert_close(y, inputs, "max", dt)
    comm.free()
