"""The single-copy allreduce (ddlkernels.algorithms.cma): peers' buffers read with process_vm_readv (and, where it
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
from ddlkernels.algorithms.cma import CmaAllreduce, probe
from ddlkernels.algorithms.shm import ShmAllreduce
from helpers import assert_close, assert_same_on_all_ranks, rank_data

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
SIZES = sorted({0, 1, max(P - 1, 0), P + 1, 7, 13, 4097, 300_007})
# numpy's own ufunc dtypes (float16 and bfloat16 are not offered to this algorithm); uint8 wraps, and its sum alone
# shows that (each op compiles a loop per dtype: ~9 s a loop with two ranks compiling at once on the 2-core VM).
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.uint8]
NUMPY_OPS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def op_dtype_grid(dtypes):
    """A parametrize over every (op, dtype) of ``dtypes``, uint8 with sum only."""
    pairs = [(op, d) for op in NUMPY_OPS for d in dtypes if d is not np.uint8 or op == "sum"]
    return pytest.mark.parametrize("op,dtype", pairs, ids=lambda v: v if isinstance(v, str) else np.dtype(v).name)


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


@pytest.mark.sweep
@needs_cma
@PUSH
@pytest.mark.parametrize("piece_bytes", [8, 100, 4096, 1 << 20], ids=lambda b: f"pieces{b}B")
@op_dtype_grid(DTYPES)
def test_every_dtype_op_size_in_and_out_of_place(piece_bytes, dtype, op, push_from):
    """The rank-order fold, bit for bit and the same on every rank, for 0, 1, p - 1, p + 1, primes and a
    size of several default pieces, pieces smaller than p elements or not a multiple of the item; the input
    of an out-of-place call untouched; in place the same bits."""
    shm = ShmAllreduce(COMM, whole_below=0)
    cma = CmaAllreduce(shm, piece_bytes=piece_bytes, push_from=push_from)
    # Pieces of 8 or 100 B are already thousands of pieces at 4097 elements; 300_007 would be ~10^5 more.
    for n in (SIZES if piece_bytes >= 4096 else [n for n in SIZES if n < 300_007]):
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
@pytest.mark.parametrize("shared", ["none", "odd ranks"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["sum", "prod"])
def test_the_fold_is_in_rank_order_where_rounding_shows(shared, dtype, op, push_from):
    """Operands of many magnitudes, so that nearly every element rounds differently in another order: the
    rank-order fold bit for bit, through every run of operands the loop folds at once (4, then 3 at a time:
    5, 6 and 7 ranks end a run of 1, 2 and 3), peers' inputs read or shared.  The exact data of the other
    tests sum to the same bits in any order, and would not see two operands swapped."""
    shm = ShmAllreduce(COMM, whole_below=0)
    cma = CmaAllreduce(shm, piece_bytes=4096, push_from=push_from)
    n = 20_011
    rng = np.random.default_rng([RANK, n])
    if op == "sum":
        x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6, n)).astype(dtype)
    else:  # factors near 1: products neither overflow nor underflow, and round at every step
        x = (1 + rng.uniform(-0.5, 0.5, n)).astype(dtype)
    xs = COMM.allgather(x)
    want = _fold(xs, op)
    if P >= 3:  # the data can tell the orders apart: the last two operands swapped give other bits
        swapped = _fold(xs[:-2] + [xs[-1], xs[-2]], op)
        assert not np.array_equal(swapped.view(np.uint8), want.view(np.uint8))
    region = shm.empty(n * x.itemsize).view(dtype)  # collective
    src = region if shared == "odd ranks" and RANK % 2 == 1 else x.copy()
    src[...] = x
    out = np.full_like(x, 99)
    cma.run(src, out, op)
    what = f"{np.dtype(dtype).name} {op} shared: {shared}, push from {push_from}"
    assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), what
    cma.run(src, src, op)
    assert np.array_equal(src.view(np.uint8), want.view(np.uint8)), f"{what}: in place"
    shm.free()  # collective: on success only


@pytest.mark.sweep
@needs_cma
@PUSH
@pytest.mark.parametrize("shared", ["all", "odd ranks"])
@op_dtype_grid([np.float32, np.float64, np.int32, np.uint8])
def test_shared_inputs_are_folded_where_they_lie(shared, dtype, op, push_from):
    """An ``x`` in the window's shared memory (``empty``) is read by its peers with plain loads, not through
    the kernel: the same bits as private inputs, at any offset into the region, every rank's input shared or
    only some ranks', in and out of place, with a deadline on half the ranks (their Python twin reads by
    readv but publishes where its x lies, for the compiled peers)."""
    from ddlkernels.safety.deadline import Deadline

    shm = ShmAllreduce(COMM, whole_below=0)
    cma = CmaAllreduce(shm, piece_bytes=4096, push_from=push_from)
    item = np.dtype(dtype).itemsize
    # 20_011 elements: more than one 4 KiB piece in every rank's block at 4 ranks, 1-byte items too.
    for k, (n, skip) in enumerate(((1, 0), (P + 1, 3), (4099, 1), (20_011, 0))):
        region = shm.empty((n + skip) * item).view(dtype)  # collective: every rank, shared or not
        mine = shared == "all" or RANK % 2 == 1
        x = rank_data(n, RANK, P, dtype, salt=n % 97)
        want = _fold(COMM.allgather(x), op)
        src = region[skip:] if mine else x.copy()
        src[...] = x
        deadline = Deadline("allreduce", RANK, 60.0) if (RANK + k) % 2 else None
        out = np.full_like(x, 99)
        cma.run(src, out, op, deadline)
        what = f"n={n} at {skip} {np.dtype(dtype).name} {op} shared: {shared}, push from {push_from}"
        assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), what
        assert np.array_equal(src.view(np.uint8), x.view(np.uint8)), f"{what}: input modified"
        cma.run(src, src, op, deadline)
        assert np.array_equal(src.view(np.uint8), want.view(np.uint8)), f"{what}: in place"
    shm.free()  # collective: on success only


@needs_cma
def test_a_shared_input_goes_through_no_system_call():
    """Every peer's pid replaced by one that cannot exist: a read through the kernel fails and is counted.  With
    every x shared and the allgather pulling, only its reads (p - 1 a rank) fail; with private inputs the
    reduce-scatter's fail too.  So the shared reads are plain loads, and my own block is still folded right."""
    from ddlkernels.kernels import cma_loops
    from ddlkernels.kernels.layout import OPCODES

    shm = ShmAllreduce(COMM, whole_below=0)
    cma = CmaAllreduce(shm, piece_bytes=4096, push_from=1 << 62)
    cma._ready()
    n, step = 20_000, 1024
    nowhere = np.full(P, int(open("/proc/sys/kernel/pid_max").read()) + 1, np.int64)  # ESRCH for every read
    region = shm.empty(n * 4).view(np.float32)
    x = rank_data(n, RANK, P, np.float32)
    want = _fold(COMM.allgather(x), "sum")
    tmp, acc, iov = np.empty((4, step), np.float32), np.empty(step, np.float32), np.zeros(4, np.int64)
    failed = {}
    for where, src in (("shared", region), ("private", x.copy())):
        src[...] = x
        out = np.zeros_like(x)
        shm._publish(src)
        e = shm._epoch + 1
        shm._epoch += 3
        failed[where] = cma_loops.cma_allreduce[OPCODES["sum"]](src, out, RANK, shm._flags, e, shm.spin, step,
                                                                 nowhere, tmp, acc, iov, False, shm._bases)
        if where == "shared":
            blo, bhi = [(n // P) * s + min(s, n % P) for s in (RANK, RANK + 1)]  # my block (ddlkernels.algorithms.shm.cuts)
            assert np.array_equal(out[blo:bhi], want[blo:bhi]), "my block, folded from the peers' shared inputs"
    assert failed["shared"] == P * (P - 1), failed
    assert failed["private"] > P * (P - 1), failed
    shm.free()


@needs_cma
@PUSH
def test_ranks_with_and_without_a_deadline_meet_and_skewed_calls_read_only_their_own_data(push_from):
    """Half the ranks of each call poll their barriers from Python (a deadline), the others run the compiled
    loop: the same barriers and the same push rule.  One rank late by turns, each call's data new: without the
    barrier after a piece's reduce-scatter, or the last one, a fast rank would read a block not yet written or
    already overwritten by the next call (pushing: return before a peer's piece has landed)."""
    from ddlkernels.safety.deadline import Deadline

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
    from ddlkernels.safety.deadline import Deadline

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
    from ddlkernels.algorithms.cma import CMA_FROM
    from ddlkernels.select.tuner import tuning_calls

    with ddlkernels.Communicator(COMM) as dc:
        assert "cma" in dc.algorithms
        below = dc.candidates(np.zeros(CMA_FROM // 16, np.float64))
        half = dc.candidates(np.zeros(CMA_FROM * 2, np.float16))
        assert "cma" not in below and "cma" not in half
        x = rank_data(CMA_FROM // 4, RANK, P, np.float64)  # 2 x CMA_FROM bytes
        inputs = COMM.allgather(x)
        cands = dc.candidates(x)
        assert cands == ("mpi", "nbc", "shm", "cma"), cands
        n = tuning_calls(x.nbytes, len(cands))
        seen = [dc.allreduce(x) is not None and dc.last_algorithm for _ in range(n)]
        assert "cma" in seen, seen
        dc.settle(x, "cma")
        want = _fold(inputs, "sum")
        for call in range(3):
            y = np.empty_like(x)
            assert dc.allreduce(x, out=y) is y and dc.last_algorithm == "cma"
            assert np.array_equal(y, want), f"call {call}"
            z = x.copy()
            dc.allreduce(z, out=z)
            assert np.array_equal(z, want) and dc.last_algorithm == "cma"
        fast = dc.decisions()["allreduce"]["fast"]
        assert fast[("sum", x.dtype, x.nbytes)] == "cma", fast
        avg = dc.allreduce(x, "avg")
        assert dc.last_algorithm == "cma"
        assert_close(avg, inputs, "avg", np.float64, "avg through cma")
        # Fused tensors of one dtype: packed, then reduced in place by the settled algorithm.
        parts = [x[:1000].copy(), x[1000:].copy()]
        fused = ddlkernels.allreduce_many(parts, comm=dc, fusion_bytes=x.nbytes)
        assert np.array_equal(np.concatenate(fused), want) and dc.last_algorithm == "cma"


def _gather_case(n, dtype, salt):
    """Every rank's shard of ``n`` elements (uneven, Communicator's flat cut) and the gathered whole."""
    from ddlkernels.algorithms.shm import cuts

    c = cuts(n, P)
    bounds = [(c[s], c[s + 1]) for s in range(P)]
    full = np.concatenate([rank_data(b - a, s, P, dtype, salt=salt) for s, (a, b) in enumerate(bounds)])
    return bounds, full


@needs_cma
@pytest.mark.parametrize("dtype", DTYPES + [np.float16, "bfloat16", np.complex64, np.bool_],
                         ids=lambda d: np.dtype(d).name if d != "bfloat16" else d)
def test_allgather_every_dtype_and_size(dtype):
    """Every rank's shard lands in its place in every rank's output, bit for bit, for 0, 1, p - 1, p + 1,
    primes and a size of several MiB (uneven shards; ranks without elements when n < p), any dtype (bytes
    are copied: half floats, complex and bool too); the shard is left as it was."""
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dtype = ml_dtypes.bfloat16
    shm = ShmAllreduce(COMM)
    cma = CmaAllreduce(shm)
    for n in SIZES + [1 << 20]:
        bounds, full = _gather_case(n, dtype, salt=n % 89)
        lo, hi = bounds[RANK]
        shard = full[lo:hi].copy()
        out = np.zeros(n, full.dtype)
        cma.allgather(shard, out, bounds)
        what = f"n={n} {np.dtype(dtype).name}"
        assert np.array_equal(out.view(np.uint8), full.view(np.uint8)), what
        assert np.array_equal(shard.view(np.uint8), full[lo:hi].view(np.uint8)), f"{what}: shard modified"
    shm.free()


@needs_cma
def test_allgather_ranks_with_and_without_a_deadline_meet_and_skewed_calls_read_only_their_own_data():
    """Half the ranks of each call take the Python steps (a deadline), the others the compiled call; one rank
    late by turns and every call's shard new, rewritten right after the call returns: without the last
    barrier a fast rank would rewrite its shard while a peer still reads it, without the first a peer would
    read the previous call's address."""
    from ddlkernels.safety.deadline import Deadline

    shm = ShmAllreduce(COMM)
    cma = CmaAllreduce(shm)
    n = 100_003
    bounds, _ = _gather_case(n, np.int64, 0)
    lo, hi = bounds[RANK]
    for call in range(24):
        if (RANK + call) % P == 0:
            time.sleep(0.02)
        shard = (np.arange(lo, hi, dtype=np.int64) * 1000 + call) * P + RANK  # a new array each call
        want = np.concatenate([(np.arange(a, b, dtype=np.int64) * 1000 + call) * P + s
                               for s, (a, b) in enumerate(bounds)])
        out = np.zeros(n, np.int64)
        deadline = Deadline("allgather", RANK, 60.0) if (RANK + call) % 2 else None
        cma.allgather(shard, out, bounds, deadline=deadline)
        shard[:] = -1  # the caller reuses its shard at once
        assert np.array_equal(out, want), f"call {call}"
    shm.free()


@needs_cma
@pytest.mark.parametrize("python", [False, True], ids=["compiled", "python"])
def test_allgather_a_failed_read_raises_on_every_rank_and_the_next_call_works(python):
    """A read the kernel refuses (rank 0 told a wrong process id) fails the allgather on every rank, and the
    barriers stay in step for the next call."""
    from ddlkernels.safety.deadline import Deadline

    shm = ShmAllreduce(COMM)
    cma = CmaAllreduce(shm)
    bounds, full = _gather_case(5000, np.float64, 3)
    lo, hi = bounds[RANK]
    shard, out = full[lo:hi].copy(), np.zeros(5000)
    cma.allgather(shard, out, bounds)  # sets up the process ids
    good = cma._pids.copy()
    if RANK == 0:
        cma._pids[:] = 0x7FFFFFFF  # no such process
    deadline = Deadline("allgather", RANK, 60.0) if python else None
    with pytest.raises(RuntimeError, match="cma allgather: process_vm_readv or process_vm_writev failed"):
        cma.allgather(shard, out, bounds, deadline=deadline)
    cma._pids[:] = good
    out[:] = 0
    cma.allgather(shard, out, bounds)
    assert np.array_equal(out, full)
    shm.free()


@needs_cma
def test_the_allgather_tuner_weighs_it_and_a_size_settled_on_it_runs_on_both_paths():
    """From CMA_GATHER_FROM bytes an allgather measures "cma" too: the trials run it, every call gathers every
    shard, and a size settled on it runs it on the fast path (``count=``) and the full one (lengths
    exchanged) alike; below that size it is no candidate."""
    from ddlkernels.algorithms.cma import CMA_GATHER_FROM
    from ddlkernels.select.tuner import tuning_calls

    with ddlkernels.Communicator(COMM) as dc:
        below = dc.candidates(np.zeros(CMA_GATHER_FROM // 4 - 1, np.float32), collective="allgather")
        assert "cma" not in below, below
        rs = dc.candidates(np.zeros(CMA_GATHER_FROM, np.float32), collective="reduce_scatter")
        assert "cma" not in rs, rs
        count = CMA_GATHER_FROM // 4 + P + 1  # float32, uneven shards
        bounds = [dc.shard_range(count, rank=q) for q in range(P)]
        full = np.concatenate([rank_data(b - a, q, P, np.float32, salt=5) for q, (a, b) in enumerate(bounds)])
        lo, hi = bounds[RANK]
        shard = full[lo:hi].copy()
        cands = dc.candidates(full, collective="allgather")
        assert cands[-1] == "cma", cands
        n = tuning_calls(count * 4, len(cands))
        seen = []
        for k in range(n):
            y = dc.allgather(shard, count=count)
            assert np.array_equal(y, full), f"call {k} ({dc.last_algorithm})"
            seen.append(dc.last_algorithm)
        assert "cma" in seen, seen
        dc.settle(full, "cma", collective="allgather")  # alike on every rank
        out = np.empty(count, np.float32)
        for k in range(3):
            y = (dc.allgather(shard, count=count, out=out) if k == 0 else dc.allgather(shard, count=count)
                 if k == 1 else dc.allgather(shard))  # the last: lengths exchanged, the full path
            assert dc.last_algorithm == "cma", k
            assert np.array_equal(y, full), f"settled on cma, call {k}"
        fast = dc.decisions()["allgather"]["fast"]
        assert list(fast.values()) == ["cma"], fast
