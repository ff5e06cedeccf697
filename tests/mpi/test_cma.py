"""The single-copy allreduce (ddlkernels._cma): peers' buffers read with process_vm_readv (and, where it
pushes, written with process_vm_writev).

Every rank of an ``mpirun`` here shares one node and one user; the tests
skip where there are no peers, and where the kernel refuses the reads (the
probe says so on every rank alike).
"""

import time

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels
from ddlkernels._cma import CmaAllreduce, probe
from ddlkernels._shm import ShmAllreduce
from helpers import assert_close, assert_same_on_all_ranks, rank_data

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
SIZES = sorted({0, 1, max(P - 1, 0), P + 1, 7, 13, 4097, 300_007})
# numpy's own ufunc dtypes (float16 and bfloat16 are not offered to this algorithm); uint8 wraps.
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.uint8]
NUMPY_OPS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
# push_from: never (the allgather reads the owners' blocks) or always (each folded piece written to the peers).
PUSH = pytest.mark.parametrize("push_from", [1 << 62, 0], ids=["pull", "push"])

needs_peers = pytest.mark.skipif(P == 1, reason="the single-copy allreduce needs 2 or more ranks")
PERMITTED = P > 1 and probe(COMM)  # collective, at import on every rank
needs_cma = pytest.mark.skipif(not PERMITTED, reason="process_vm_readv between these ranks is not permitted "
                                                     "(ptrace policy) or there are no peers")


def _fold(xs, op):
    """((x0 op x1) op x2) ...: the rank-order fold the algorithm computes, bit for bit."""
    want = xs[0].copy()
    for x in xs[1:]:
        NUMPY_OPS[op](want, x, out=want)
    return want


@needs_peers
def test_probe_agrees_on_every_rank():
    got = probe(COMM)
    assert COMM.allgather(got) == [got] * P
    assert got is PERMITTED


@needs_cma
@PUSH
@pytest.mark.parametrize("piece_bytes", [8, 100, 4096, 1 << 20], ids=lambda b: f"pieces{b}B")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(NUMPY_OPS))
def test_every_dtype_op_size_in_and_out_of_place(piece_bytes, dtype, op, push_from):
    """The rank-order fold, bit for bit and the same on every rank, for 0, 1, p - 1, p + 1, primes and a
    size of several default pieces, pieces smaller than p elements or not a multiple of the item; the input
    of an out-of-place call untouched; in place the same bits."""
    shm = ShmAllreduce(COMM, whole_below=0)
    cma = CmaAllreduce(shm, piece_bytes=piece_bytes, push_from=push_from)
    for n in SIZES:
        x = rank_data(n, RANK, P, dtype, salt=n % 97)
        keep = x.copy()
        want = _fold(COMM.allgather(x), op)
        out = np.full_like(x, 99)
        cma.run(x, out, op)
        what = f"n={n} {np.dtype(dtype).name} {op} pieces of {piece_bytes} B, push from {push_from} B"
        assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), what
        assert np.array_equal(x.view(np.uint8), keep.view(np.uint8)), f"{what}: input modified"
        assert_same_on_all_ranks(COMM, out, what)
        cma.run(x, x, op)
        assert np.array_equal(x.view(np.uint8), want.view(np.uint8)), f"{what}: in place"
    shm.free()  # collective: on success only; a failing rank aborts the job


@needs_cma
@PUSH
def test_ranks_with_and_without_a_deadline_meet_and_skewed_calls_read_only_their_own_data(push_from):
    """Half the ranks of each call poll their barriers from Python (a deadline), the others run the compiled
    loop: the same barriers and the same push rule.  One rank late by turns, each call's data new: without the
    barrier after a piece's reduce-scatter, or the last one, a fast rank would read a block not yet written or
    already overwritten by the next call (pushing: return before a peer's piece has landed)."""
    from ddlkernels._wait import Deadline

    shm = ShmAllreduce(COMM, whole_below=0)
    cma = CmaAllreduce(shm, piece_bytes=256, push_from=push_from)
    n = 1001
    x = np.empty(n, np.int64)
    for call in range(24):
        if (RANK + call) % P == 0:
            time.sleep(0.02)
        x[:] = (np.arange(n, dtype=np.int64) * 1000 + call) * P + RANK  # refilled right after the last call
        want = sum((np.arange(n, dtype=np.int64) * 1000 + call) * P + q for q in range(P))
        out = np.zeros(n, np.int64)
        deadline = Deadline("allreduce", RANK, 60.0) if (RANK + call) % 2 else None
        cma.run(x, out if call % 3 else x, "sum", deadline=deadline)
        assert np.array_equal(out if call % 3 else x, want), f"call {call}"
    shm.free()


@needs_cma
@PUSH
@pytest.mark.parametrize("python", [False, True], ids=["compiled", "python"])
def test_a_failed_read_raises_on_every_rank_and_the_next_call_works(python, push_from):
    """A read the kernel refuses (here: rank 0 told a wrong process id) fails the call on every rank --
    never a hang, never a silent garbage result -- and the barriers stay in step for the next call."""
    from ddlkernels._wait import Deadline

    shm = ShmAllreduce(COMM, whole_below=0)
    cma = CmaAllreduce(shm, piece_bytes=4096, push_from=push_from)
    x = rank_data(5000, RANK, P, np.float64)
    want = _fold(COMM.allgather(x), "sum")
    out = np.empty_like(x)
    cma.run(x, out, "sum")  # sets up the process ids
    good = cma._pids.copy()
    if RANK == 0:
        cma._pids[:] = 0x7FFFFFFF  # no such process
    deadline = Deadline("allreduce", RANK, 60.0) if python else None
    with pytest.raises(RuntimeError, match="process_vm_readv or process_vm_writev failed"):
        cma.run(x, out, "sum", deadline=deadline)
    cma._pids[:] = good
    out[:] = 0
    cma.run(x, out, "sum")
    assert np.array_equal(out, want)
    shm.free()
    out[:] = 0
    cma.run(x, out, "sum")  # the same prepared call allocates the window's flags again
    assert np.array_equal(out, want)
    shm.free()


@needs_cma
def test_the_tuner_weighs_it_and_a_size_settled_on_it_runs_on_both_paths():
    """From CMA_FROM bytes, for numpy's own dtypes and ops, "cma" is a candidate: the trials run it, and a
    size settled on it runs it on the fast path (MPI's types and ops) and the full one (``avg``, fused
    tensors), every call the rank-order fold; float16 is not offered it."""
    from ddlkernels._tuner import CMA_FROM, candidates, tuning_calls

    with ddlkernels.Communicator(COMM) as dc:
        assert dc._cma_ok
        _, below = dc._choices(CMA_FROM // 2, False, np.dtype(np.float64), "sum", None)
        _, half = dc._choices(CMA_FROM * 4, False, np.dtype(np.float16), "sum", None)
        assert "cma" not in below and "cma" not in half
        x = rank_data(CMA_FROM // 4, RANK, P, np.float64)  # 2 x CMA_FROM bytes
        inputs = COMM.allgather(x)
        _, cands = dc._choices(x.nbytes, False, x.dtype, "sum", None)
        assert cands == candidates(x.nbytes, shm=True, cma=True) and "cma" in cands
        n = tuning_calls(x.nbytes, len(cands))
        seen = [dc.allreduce(x) is not None and dc.last_algorithm for _ in range(n)]
        assert "cma" in seen, seen
        for inplace in (False, True):
            dc._tuner.settle(x.nbytes, cands, "cma", inplace)
        dc._fast.clear()
        want = _fold(inputs, "sum")
        for call in range(3):
            y = np.empty_like(x)
            assert dc.allreduce(x, out=y) is y and dc.last_algorithm == "cma"
            assert np.array_equal(y, want), f"call {call}"
            z = x.copy()
            dc.allreduce(z, out=z)
            assert np.array_equal(z, want) and dc.last_algorithm == "cma"
        assert any(h and h[0] == "cma" and callable(h[1]) for h in dc._fast.values()), dc._fast
        avg = dc.allreduce(x, "avg")
        assert dc.last_algorithm == "cma"
        assert_close(avg, inputs, "avg", np.float64, "avg through cma")
        # Fused tensors of one dtype: packed, then reduced in place by the settled algorithm.
        parts = [x[:1000].copy(), x[1000:].copy()]
        fused = ddlkernels.allreduce_many(parts, comm=dc, fusion_bytes=x.nbytes)
        assert np.array_equal(np.concatenate(fused), want) and dc.last_algorithm == "cma"
