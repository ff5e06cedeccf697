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


def missing_rank(call, before=None, late=False, **options):
    """Every rank but the last runs ``call(comm)`` on a fresh Communicator; returns the timeout it raised.

    ``before(comm)``: run by every rank first (a window to allocate, say); ``options``: of the Communicator.
    ``late``: the last rank makes the call after the others gave up (for one MPI call, which then completes:
    a blocking call abandoned by a timeout stays in MPI until the missing rank makes it).
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
    if late and RANK == ODD:
        call(comm)
    return err


@needs_two
def test_ring_timeout_names_the_peer_step_and_chunk():
    n = 64 * P
    # Every rank runs the call once first: the reduce loop loaded from Numba's cache (a fraction of a second
    # per process) would otherwise spend the 1 s of ranks further down the ring on the way to their step.
    run = (lambda c, **kw: c.allreduce(np.ones(n, np.float32), dims=(P,), chunk_bytes=64, **kw))
    err = missing_rank(run, before=lambda c: run(c, timeout=60))
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
    # The tuner's first trial is MPI's blocking allreduce, made on a helper thread and waited for with the deadline.
    err = missing_rank(lambda c: c.allreduce(np.ones(4, np.float64)), late=True)
    if RANK != ODD:
        assert "waiting to complete MPI_Allreduce (a rank has not joined)" in str(err)


@needs_two
@pytest.mark.parametrize("n", [5, 300_000], ids=["whole", "pieces"])
def test_timeout_in_the_shared_memory_barrier(n):
    """The window's barriers are flags polled from Python under a deadline: a missing rank is named as one."""
    x = rank_data(n, RANK, P, np.float32)
    # The window is created first by every rank (its creation is timed too, and a first creation imports Numba).
    err = missing_rank(lambda c: c.allreduce(x), before=lambda c: c.allreduce(x, timeout=60), shm=True)
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
    """small_bytes fixed above the size: MPI's own blocking calls, made on a helper thread (the same calls as a
    rank without a timeout makes) and waited for with the deadline; a missing rank names the call."""

    def rs(c):
        c.small_bytes = 1 << 30
        c.reduce_scatter(np.ones(n, np.float64))

    def ag(c):
        c.small_bytes = 1 << 30
        lo, hi = c.shard_range(n)
        c.allgather(np.ones(hi - lo), count=n)

    block = "_block" if n % P == 0 else ""
    err = missing_rank(rs, late=True)
    if RANK != ODD:
        assert f"waiting to complete MPI_Reduce_scatter{block} (a rank has not joined)" in str(err), str(err)
    err = missing_rank(ag, late=True)
    if RANK != ODD:
        want = "MPI_Allgather " if n % P == 0 else "MPI_Allgatherv"
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


# -- hidden collectives: the setup a call makes behind the user's back waits under the call's deadline ---------


@needs_two
def test_the_lazily_created_communicator_waits_under_the_calls_timeout():
    """The module functions create a communicator's Communicator at its first call (a collective duplicate):
    with a rank absent, the others raise within the call's timeout instead of waiting for ever."""
    sub = COMM.Dup()  # left with the abandoned duplicate pending on the waiting ranks: never used again
    if RANK != ODD:
        with pytest.raises(ddlkernels.CollectiveTimeout, match="MPI_Comm_idup") as info:
            ddlkernels.allreduce(np.ones(4), comm=sub, timeout=TIMEOUT)
        assert info.value.rank == RANK and info.value.timeout == TIMEOUT
    COMM.Barrier()


@needs_two
def test_the_first_window_creation_waits_under_the_deadline():
    """The first call through the shared-memory window creates it (collective): a rank absent there is a
    timeout, not a hang."""
    err = missing_rank(lambda c: c.allreduce(rank_data(300, RANK, P, np.float32)), shm=True)
    if RANK != ODD:
        assert "waiting to complete the shared-memory window's creation" in str(err), str(err)


@needs_two
def test_the_first_single_copy_call_waits_under_the_deadline():
    """The single-copy allreduce sets the window's flags up at its first call: the same."""

    def settled_on_cma(c):
        if "cma" not in c.algorithms:
            pytest.skip("process_vm_readv is not permitted between these ranks")
        x = rank_data(1 << 14, RANK, P, np.float64)
        c.settle(x, "cma")
        c.allreduce(x)

    err = missing_rank(settled_on_cma)
    if RANK != ODD:
        assert "waiting to complete the shared-memory window's creation" in str(err), str(err)


@needs_two
def test_the_progress_engine_is_created_under_the_communicators_timeout():
    """allreduce_async's first call creates the progress engine (a collective duplicate) under the
    Communicator's timeout."""
    dc = ddlkernels.Communicator(timeout=TIMEOUT)
    if RANK != ODD:
        with pytest.raises(ddlkernels.CollectiveTimeout, match="MPI_Comm_idup"):
            ddlkernels.allreduce_async(np.ones(8), comm=dc)
    COMM.Barrier()


@needs_two
def test_a_late_rank_completes_the_abandoned_call_then_a_new_communicator_works():
    """The waiting ranks give up, drop their arrays and allocate others; the late rank then makes the call,
    which completes on every rank into memory MPI still owns (once freed: a segfault in the next MPI call).
    A new Communicator then works on every rank."""
    import gc

    n = 300_000  # 2.4 MB: MPI moves it in fragments, each written where the abandoned call said
    dc = ddlkernels.Communicator(timeout=TIMEOUT)
    x = rank_data(n, RANK, P, np.float64)
    want = sum(rank_data(n, r, P, np.float64) for r in range(P))
    junk = []
    if RANK != ODD:
        with pytest.raises(ddlkernels.CollectiveTimeout):
            dc.allreduce(x)
        del x
        gc.collect()
        junk = [np.full(n, 7.0) for _ in range(8)]  # where the call's arrays were, if they were freed
    COMM.Barrier()
    if RANK == ODD:
        assert np.array_equal(dc.allreduce(x), want)  # the same trial (MPI's allreduce) as the others'
    fresh = ddlkernels.Communicator(timeout=60)
    for k in range(3):
        y = rank_data(n // 3 + k, RANK, P, np.float64, salt=k)
        assert np.array_equal(fresh.allreduce(y), sum(rank_data(n // 3 + k, r, P, np.float64, salt=k) for r in range(P)))
    assert all((j == 7.0).all() for j in junk), "the late call wrote into memory freed since"
    fresh.free()
    dc.free()  # after a timeout: keeps everything, frees nothing collectively


@needs_two
def test_a_per_call_timeout_leaves_the_communicator_unusable_on_its_fast_path_too():
    """A Communicator without a timeout of its own, a size settled (served by the fast path), one call with
    ``timeout=`` that a rank misses: the next plain call must refuse too, not run on the broken communicator."""
    from ddlkernels.select.tuner import tuning_calls

    dc = ddlkernels.Communicator(COMM)
    x = rank_data(4, RANK, P, np.float64)
    for _ in range(tuning_calls(x.nbytes, len(dc.candidates(x))) + 1):
        dc.allreduce(x)
    if RANK != ODD:
        with pytest.raises(ddlkernels.CollectiveTimeout):
            dc.allreduce(x, timeout=TIMEOUT)
        with pytest.raises(RuntimeError, match="this Communicator is unusable"):
            dc.allreduce(x)
    COMM.Barrier()
    if RANK == ODD:  # late: completes an MPI call the others abandoned; times out alone in the window's barrier
        try:
            dc.allreduce(x, timeout=TIMEOUT)
        except ddlkernels.CollectiveTimeout:
            pass
