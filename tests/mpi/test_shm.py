"""The shared-memory allreduce (ddlkernels.algorithms.shm): every dtype, op and edge size, pieces, skewed ranks.

All ranks of an ``mpirun`` on this machine share one node, so the algorithm
applies whenever P > 1; the tests skip at P = 1, where there is nothing to
share.
"""

import time

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels
from ddlkernels.algorithms.shm import ShmAllreduce
from ddlkernels.algorithms.hier import node_split
from ddlkernels.backends import backend_for
from helpers import ALL_DTYPES, DTYPE_IDS, OPS, assert_close, assert_same_on_all_ranks, parts_with_gaps, rank_data

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
# 0, 1, p - 1, p + 1, primes, and one size of several default (1 MiB) pieces.
SIZES = sorted({0, 1, max(P - 1, 0), P + 1, 7, 13, 4097, 300_007})

needs_peers = pytest.mark.skipif(P == 1, reason="the shared-memory allreduce needs 2 or more ranks")


@pytest.fixture(scope="module")
def forced():
    with ddlkernels.Communicator(COMM, shm=True) as dc:
        yield dc


@needs_peers
def test_this_job_is_on_one_node():
    node, where = node_split(COMM)
    assert node.Get_size() == P and where == [(0, where[0][1])] * P
    node.Free()
    x = np.zeros(1000)
    with ddlkernels.Communicator(COMM) as dc:
        assert "shm" in dc.algorithms and "shm" in dc.candidates(x)  # a tuner candidate
    with ddlkernels.Communicator(COMM, shm=False) as dc:
        assert "shm" not in dc.algorithms and "shm" not in dc.candidates(x)
    with ddlkernels.Communicator(COMM, shm=True) as dc:
        assert dc.candidates(x) == ("shm",)  # forced


@pytest.mark.sweep("dtype", "op")
@needs_peers
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", OPS)
def test_forced_shm_every_dtype_op_size_in_and_out_of_place(forced, n, dtype, op):
    x = rank_data(n, RANK, P, dtype)
    keep = x.copy()
    inputs = COMM.allgather(x)
    what = f"shm n={n} {dtype} {op}"
    y = forced.allreduce(x, op)
    assert forced.last_algorithm == "shm"
    assert np.array_equal(x.view(np.uint8), keep.view(np.uint8)), f"{what}: input modified"
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, inputs, op, dtype, what)
    assert_same_on_all_ranks(COMM, y, what)
    z = x.copy()
    assert forced.allreduce(z, op, out=z) is z
    assert np.array_equal(z.view(np.uint8), y.view(np.uint8)), f"{what}: in place differs from out of place"
    # mpi4py's shape, MPI.IN_PLACE included, takes the same path.
    w = x.copy()
    ddlkernels.Allreduce(MPI.IN_PLACE, w, {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD,
                                           "avg": MPI.SUM}[op], comm=forced)
    if op != "avg":
        assert np.array_equal(w.view(np.uint8), y.view(np.uint8)), f"{what}: Allreduce differs"


@pytest.mark.sweep
@needs_peers
@pytest.mark.parametrize("piece_bytes", [1, 8, 24, 100, 4096])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16], ids=["float32", "int64", "float16"])
def test_pieces_of_any_length_cover_the_buffer(piece_bytes, dtype):
    """Pieces smaller than p elements, not a multiple of the item size, and many of them."""
    shm = ShmAllreduce(COMM, piece_bytes=piece_bytes, whole_below=0)
    reduce = backend_for(np.empty(0)).reduce
    for n in (0, 1, P + 1, 61, 1031):
        x = rank_data(n, RANK, P, dtype, salt=3)
        inputs = COMM.allgather(x)
        out = np.full_like(x, 99)
        shm.run(x, out, "sum", reduce)
        assert_close(out, inputs, "sum", dtype, f"piece {piece_bytes} B, n={n}")
        assert_same_on_all_ranks(COMM, out)
        avg = np.empty_like(x)
        shm.run(x, avg, "sum", reduce, avg_p=P)
        assert_close(avg, inputs, "avg", dtype, f"avg, piece {piece_bytes} B, n={n}")
    shm.free()  # collective: on success only; a failing rank aborts the job


@needs_peers
@pytest.mark.parametrize("whole_below", [0, 1 << 20], ids=["pieces", "whole"])
def test_skewed_ranks_never_read_a_stale_or_early_buffer(whole_below):
    """Ranks arrive late by turns, call after call: each result is the one for its inputs.

    Pieces of 64 B: without the second barrier a fast rank would gather a
    peer's result before it is written; without the first, reduce a stage
    still being filled.  Whole small messages: with one stage instead of two
    alternating, a fast rank would refill it while a peer still reads it.
    Each call's data is new, so a value from another call shows.
    """
    shm = ShmAllreduce(COMM, piece_bytes=64, whole_below=whole_below)
    reduce = backend_for(np.empty(0)).reduce
    rng = np.random.default_rng(RANK)
    for call in range(40):
        x = (np.arange(203, dtype=np.int64) * 1000 + call) * P + RANK
        want = sum((np.arange(203, dtype=np.int64) * 1000 + call) * P + q for q in range(P))
        if rng.random() < 0.5:
            time.sleep(rng.random() * 2e-3)
        out = np.empty_like(x)
        shm.run(x, out, "sum", reduce)
        assert np.array_equal(out, want), f"call {call}: {np.flatnonzero(out != want)[:5]}"
    shm.free()  # collective: on success only; a failing rank aborts the job


@needs_peers
@pytest.mark.parametrize("n", [1, 5, 31])
def test_small_and_large_calls_interleave(n):
    """Whole-message calls and pieced calls share one window without stepping on each other."""
    shm = ShmAllreduce(COMM, piece_bytes=256, whole_below=256)
    reduce = backend_for(np.empty(0)).reduce
    for call in range(12):
        m = n if call % 3 else 100 + n  # int64: below 256 B (whole), then above (pieces of 256 B)
        x = (np.arange(m, dtype=np.int64) + 7 * call) * P + RANK
        out = np.empty_like(x)
        shm.run(x, out, "sum", reduce)
        assert np.array_equal(out, sum((np.arange(m, dtype=np.int64) + 7 * call) * P + q for q in range(P)))
    shm.free()  # collective: on success only; a failing rank aborts the job


@needs_peers
def test_free_then_use_again_allocates_a_new_window():
    x = rank_data(1000, RANK, P, np.float64)
    shm, reduce = ShmAllreduce(COMM), backend_for(x).reduce
    a, b = np.empty_like(x), np.empty_like(x)
    shm.run(x, a, "sum", reduce)
    shm.free()
    assert not shm.allocated
    shm.run(x, b, "sum", reduce)
    assert shm.allocated and np.array_equal(a, b)
    shm.free()


@pytest.mark.sweep
@needs_peers
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "avg"])
def test_fast_path_of_a_size_settled_on_shm(dtype, op):
    """Sizes settled on shm: the fast path's plan (the window's prepared small-message call, or its ``run``
    for "avg" and the types numpy cannot add directly), every placement and shape; every call must be the
    rank-order fold, bit for bit, and agree with a forced-shm communicator."""
    shapes = [(1,), (P + 1,), (7, 13), (1000,)]  # up to 8 KiB: below whole_below
    dt = np.dtype(dtype)
    with ddlkernels.Communicator(COMM) as dc, ddlkernels.Communicator(COMM, shm=True) as ref:
        for shape in shapes:
            count = int(np.prod(shape))
            nbytes = count * dt.itemsize
            dc.settle(np.zeros(shape, dt), "shm", op)
            for call in range(3):
                x = rank_data(count, RANK, P, dtype, salt=call).reshape(shape)
                want = ref.allreduce(x, op)
                what = f"{dt.name} {op} {shape} call {call}"
                for how in ("new", "out", "inplace"):
                    if how == "new":
                        y = dc.allreduce(x, op)
                    elif how == "out":
                        y = np.empty_like(x)
                        assert dc.allreduce(x, op, out=y) is y
                    else:
                        y = x.copy()
                        assert dc.allreduce(y, op, out=y) is y
                    assert dc.last_algorithm == "shm", what
                    assert np.array_equal(y.view(np.uint8), want.view(np.uint8)), f"{what} {how}"
            fast = [a for k, a in dc.decisions()["allreduce"]["fast"].items() if k[1] == dt and k[2] == nbytes]
            assert fast == ["shm"], (shape, fast)  # the fast path's plan ran, any placement


@pytest.mark.sweep  # at one rank count of 2 or more: the candidates and trials do not depend on it (~12 s each)
@needs_peers
def test_the_tuner_weighs_the_window_with_spilled_results_and_either_runs_on_both_paths():
    """From SPILL_FROM bytes "shm-nt" (``run(spill=True)``) is a candidate beside "shm": every candidate
    runs in the trials, each computes the allreduce, ranks agree on it under ``validate=True``, and a size
    settled on "shm-nt" runs it on the fast path (``out=``) and the full one alike."""
    from ddlkernels.algorithms.shm import SPILL_FROM
    from ddlkernels.select.tuner import tuning_calls

    x = rank_data(SPILL_FROM // 8, RANK, P, np.float64)
    inputs = COMM.allgather(x)
    out = np.empty_like(x)
    with ddlkernels.Communicator(COMM) as dc:
        cands = dc.candidates(x)
        # The single-copy allreduce (ddlkernels.algorithms.cma) too where this machine lets ranks read each other.
        assert cands == ("mpi", "ring", "shm", "shm-nt") + ("cma",) * ("cma" in dc.algorithms)
        assert dc.candidates(x[: x.size // 2]) == ("mpi", "ring", "shm") + ("cma",) * ("cma" in dc.algorithms)
        n = tuning_calls(x.nbytes, len(cands))
        seen = []
        for k in range(n + 2):
            y = dc.allreduce(x, "sum", out=out if k % 2 else None, validate=k % 3 == 0)
            assert_close(y, inputs, "sum", np.float64, f"call {k}")
            seen.append(dc.last_algorithm)
        assert set(seen[:n]) == set(cands), seen
        dc.settle(x, "shm-nt")  # alike on every rank
        for k in range(4):
            y = dc.allreduce(x, "sum", out=out if k % 2 else None)
            assert dc.last_algorithm == "shm-nt"
            assert_close(y, inputs, "sum", np.float64, f"settled, call {k}")
            assert_same_on_all_ranks(COMM, y, f"settled, call {k}")
        assert np.array_equal(x, rank_data(SPILL_FROM // 8, RANK, P, np.float64)), "input modified"


@needs_peers
@pytest.mark.parametrize("stream", ["on", "off", "by-rank"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32-compiled", "float16-python"])
def test_allgather_stream_argument_overrides_the_size_rule(stream, dtype):
    """``allgather(stream=)`` writes its output with non-temporal stores or without, whatever
    ``gather_stream_from`` says (the tuner's "shm" / "shm-nt"), and ranks may differ: every element lands
    where it belongs either way, compiled (float32) or in Python (float16), with and without a deadline."""
    from ddlkernels.safety.deadline import Deadline

    want = {"on": True, "off": False, "by-rank": RANK % 2 == 0}[stream]
    # The size rule says the opposite of what is asked, so a call that ignored stream= would differ.
    shm = ShmAllreduce(COMM, piece_bytes=1000, whole_below=0, stream_from=(1 << 62) if want else 0)
    for n in (0, 1, P + 1, 211, 4099):
        bounds = _bounds(n)
        lo, hi = bounds[RANK]
        full = np.concatenate([rank_data(b - a, q, P, dtype, salt=n) for q, (a, b) in enumerate(bounds)])
        shard = full[lo:hi].copy()
        for deadline in (None, Deadline("allgather", RANK, 60.0)):
            out = np.full(n, 3, dtype)
            shm.allgather(shard, out, bounds, deadline=deadline, stream=want)
            assert np.array_equal(out.view(np.uint8), full.view(np.uint8)), f"n={n} deadline={deadline}"
            assert np.array_equal(shard, full[lo:hi]), "shard modified"
    if dtype == np.float32:  # the compiled loop was built for the asked store kind, not the size rule's
        assert {k[-1] for k in shm._small if k[0] == "allgather"} == {want}
    shm.free()  # collective: on success only


@needs_peers
def test_the_allgather_tuner_weighs_streamed_output_and_either_runs_on_both_paths():
    """From GATHER_STREAM_FROM bytes an allgather measures "shm-nt" (its output written with non-temporal
    stores) beside "shm": every candidate runs in the trials, each gathers every shard, and a size settled
    on either runs it on the fast path (``count=``, ``out=``) and the full one (no ``count``) alike."""
    from ddlkernels.algorithms.shm import GATHER_STREAM_FROM
    from ddlkernels.select.tuner import tuning_calls

    count = GATHER_STREAM_FROM // 4 + P + 1  # float32: a bucket that measures "shm-nt", uneven shards
    with ddlkernels.Communicator(COMM) as dc:
        bounds = [dc.shard_range(count, rank=q) for q in range(P)]
        full = np.concatenate([rank_data(b - a, q, P, np.float32, salt=9) for q, (a, b) in enumerate(bounds)])
        lo, hi = bounds[RANK]
        shard = full[lo:hi].copy()
        cma = ("cma",) * ("cma" in dc.algorithms)
        cands = dc.candidates(full, collective="allgather")
        assert cands == ("mpi", "ring", "shm", "shm-nt") + cma, cands
        rs_cands = dc.candidates(full, collective="reduce_scatter")
        assert rs_cands == ("mpi", "ring", "shm"), rs_cands  # reduce_scatter never streams
        below = dc.candidates(np.zeros(GATHER_STREAM_FROM // 4 - 1, np.float32), collective="allgather")
        assert below == ("mpi", "ring", "shm") + cma, below
        n = tuning_calls(count * 4, len(cands))
        out = np.empty(count, np.float32)
        seen = []
        for k in range(n + 2):
            y = dc.allgather(shard, count=count, out=out) if k % 2 else dc.allgather(shard, count=count)
            assert np.array_equal(y, full), f"call {k} ({dc.last_algorithm})"
            seen.append(dc.last_algorithm)
        assert set(seen[:n]) == set(cands), seen
        for algo in ("shm-nt", "shm"):
            dc.settle(full, algo, collective="allgather")  # alike on every rank
            for k in range(3):
                y = (dc.allgather(shard, count=count, out=out) if k == 0 else dc.allgather(shard, count=count)
                     if k == 1 else dc.allgather(shard))  # the last: lengths exchanged, the full path
                assert dc.last_algorithm == algo, (algo, k)
                assert np.array_equal(y, full), f"settled on {algo}, call {k}"
            hits = list(dc.decisions()["allgather"]["fast"].values())
            assert hits == [algo], hits
        assert np.array_equal(shard, full[lo:hi]), "shard modified"


def test_shm_option_is_checked():
    with pytest.raises(ValueError, match="shm must be None, True or False"):
        ddlkernels.Communicator(COMM, shm="yes")


@needs_peers
def test_explicit_dims_keep_the_ring_and_timeouts_poll(forced):
    x = rank_data(5000, RANK, P, np.float32)
    forced.allreduce(x, dims=(P,))
    assert forced.last_algorithm == "ring"
    y = forced.allreduce(x, timeout=30)
    assert forced.last_algorithm == "shm"
    assert_close(y, COMM.allgather(x), "sum", np.float32)


@pytest.mark.sweep
@needs_peers
@pytest.mark.parametrize("op", ["sum", "avg", "max", "prod"])
@pytest.mark.parametrize("piece_bytes,whole_below", [(16, 0), (100, 0), (1 << 20, 0), (1 << 20, 1 << 20)],
                         ids=["pieces16B", "pieces100B", "one-piece", "whole"])
def test_fusion_bucket_read_in_place_equals_the_packed_buffer(op, piece_bytes, whole_below):
    """A ``Segments`` (parts with gaps, empty parts) staged straight from its arrays: the packed buffer's bits."""
    from ddlkernels.ring.segments import Segments

    parts, packed = parts_with_gaps(lambda n, k: rank_data(n, RANK, P, np.float32, salt=k))
    count = packed.size
    keep = [a.copy() for _, a in parts]
    shm = ShmAllreduce(COMM, piece_bytes=piece_bytes, whole_below=whole_below)
    reduce = backend_for(packed).reduce
    redop, avg_p = ("sum", P) if op == "avg" else (op, None)
    want = np.empty_like(packed)
    shm.run(packed, want, redop, reduce, avg_p=avg_p)
    got = np.full(count, np.nan, np.float32)
    shm.run(Segments(count, np.float32, parts), got, redop, reduce, avg_p=avg_p)
    for off, a in parts:
        assert np.array_equal(got[off : off + a.size].view(np.uint8), want[off : off + a.size].view(np.uint8)), off
    assert all(np.array_equal(a, k) for (_, a), k in zip(parts, keep)), "input modified"
    assert_same_on_all_ranks(COMM, got, f"segments {op}")
    shm.free()  # collective: on success only


@needs_peers
def test_allreduce_many_through_shm_equals_separate_calls():
    xs = [rank_data(n, RANK, P, np.float32, salt=n) for n in (1, 3, 300, 70_000, 5, 400_000)]
    with ddlkernels.Communicator(COMM, shm=True) as dc:
        got = ddlkernels.allreduce_many(xs, "sum", comm=dc, fusion_bytes=1 << 20)
        assert dc.last_algorithm == "shm"
        want = [dc.allreduce(x, "sum") for x in xs]
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


def _rank_order_fold(xs, op, be):
    """((x0 op x1) op x2) ...: what every form of the window's allreduce computes, bit for bit."""
    redop, avg_p = ("sum", P) if op == "avg" else (op, None)
    want = np.empty_like(xs[0])
    be.reduce(redop, want, xs[0], xs[1], avg_p=avg_p if P == 2 else None)
    for i in range(2, P):
        be.reduce(redop, want, want, xs[i], avg_p=avg_p if i == P - 1 else None)
    return want


@pytest.mark.sweep
@needs_peers
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("piece_bytes,whole_below,stream_from,spill",
                         [(24, 0, None, False), (1000, 0, None, False), (1000, 0, 0, False), (1000, 0, 0, True),
                          (24, 0, None, True), (1 << 20, 0, None, False), (1 << 20, 1 << 20, None, False)],
                         ids=["pieces24B", "pieces1000B", "pieces1000B-streamed", "pieces1000B-streamed-spilled",
                              "pieces24B-spilled", "one-piece", "whole"])
def test_every_element_is_the_rank_order_fold_bitwise(dtype, op, piece_bytes, whole_below, stream_from, spill):
    """((x0 op x1) op x2) ...: the same bits whatever the piece size or form, in place or not, and whether
    the output (``stream_from``) and the result blocks (``spill``) are written with non-temporal stores."""
    n = 997
    x = rank_data(n, RANK, P, dtype, salt=11)
    xs = COMM.allgather(x)
    be = backend_for(x)
    redop, avg_p = ("sum", P) if op == "avg" else (op, None)
    want = _rank_order_fold(xs, op, be)
    shm = ShmAllreduce(COMM, piece_bytes=piece_bytes, whole_below=whole_below, stream_from=stream_from)
    got = np.empty_like(x)
    shm.run(x, got, redop, be.reduce, avg_p=avg_p, spill=spill)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{op} {dtype}: not the rank-order fold"
    z = x.copy()
    shm.run(z, z, redop, be.reduce, avg_p=avg_p, spill=spill)
    assert np.array_equal(z.view(np.uint8), want.view(np.uint8)), f"{op} {dtype}: in place differs"
    shm.free()  # collective: on success only


def _bounds(n):
    """Uneven shards (rank r gets a share growing with r) that still partition [0, n)."""
    w = np.arange(1, P + 1)
    cuts = np.concatenate([[0], np.cumsum(w)]) * n // w.sum()
    return [(int(cuts[s]), int(cuts[s + 1])) for s in range(P)]


def _varied(n, dtype, op):
    """Operands of many magnitudes (sum) or factors near 1 (prod), unique per rank and element: nearly every
    element rounds differently when two operands trade places, which the exact data of ``rank_data`` do not
    (they sum to the same bits in any order)."""
    rng = np.random.default_rng([RANK, n])
    if op == "sum":
        return (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6, n)).astype(dtype)
    return (1 + rng.uniform(-0.5, 0.5, n)).astype(dtype)


@needs_peers
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "prod"])
@pytest.mark.parametrize("form", ["pieces", "spilled", "shared"])
def test_the_fold_is_in_rank_order_where_rounding_shows(dtype, op, form):
    """The window's fold runs its operands four, then three, at a time (``ddlkernels.kernels.node_primitives._fold_block``): with
    data whose bits show the order, every element of the allreduce (staged, spilled, or read from inputs in
    shared memory) and of the reduce-scatter is still ((x0 op x1) op x2) ..., at every rank count (5, 6 and 7
    ranks end on a run of 1, 2 and 3)."""
    n = 4099
    x = _varied(n, dtype, op)
    xs = COMM.allgather(x)
    be = backend_for(x)
    want = _rank_order_fold(xs, op, be)
    if P >= 3:  # the data tell the orders apart
        assert not np.array_equal(_rank_order_fold(xs[:-2] + [xs[-1], xs[-2]], op, be).view(np.uint8),
                                  want.view(np.uint8))
    shm = ShmAllreduce(COMM, piece_bytes=1000, whole_below=0)
    src = x.copy()
    if form == "shared":
        src = shm.empty(x.nbytes).view(dtype)  # collective
        src[...] = x
    got = np.empty_like(x)
    shm.run(src, got, op, be.reduce, spill=form == "spilled")
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{op} {form}: not the rank-order fold"
    bounds = _bounds(n)
    lo, hi = bounds[RANK]
    shard = np.empty(hi - lo, dtype)
    shm.reduce_scatter(src, shard, bounds, op, be.reduce)
    assert np.array_equal(shard.view(np.uint8), want[lo:hi].view(np.uint8)), f"{op} {form}: reduce-scatter"
    assert np.array_equal(src.view(np.uint8), x.view(np.uint8)), f"{op} {form}: input modified"
    shm.run(src, src, op, be.reduce, spill=form == "spilled")
    assert np.array_equal(src.view(np.uint8), want.view(np.uint8)), f"{op} {form}: in place"
    shm.free()  # collective: on success only


@pytest.mark.sweep
@needs_peers
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("piece_bytes,whole_below,stream_from",
                         [(24, 0, None), (1000, 0, None), (1000, 0, 0), (1 << 20, 1 << 20, None)],
                         ids=["pieces24B", "pieces1000B", "pieces1000B-streamed", "whole"])
def test_reduce_scatter_and_allgather_through_the_window(dtype, op, piece_bytes, whole_below, stream_from):
    """Each shard is the rank-order fold of its range (the allreduce's bits); allgather puts every shard back,
    with or without non-temporal stores."""
    shm = ShmAllreduce(COMM, piece_bytes=piece_bytes, whole_below=whole_below, stream_from=stream_from)
    be = backend_for(np.empty(0))
    redop, avg_p = ("sum", P) if op == "avg" else (op, None)
    for n in (0, 1, P + 1, 211):
        x = rank_data(n, RANK, P, dtype, salt=5)
        keep = x.copy()
        full = np.empty_like(x)
        shm.run(x, full, redop, be.reduce, avg_p=avg_p)
        _assert_shards_rebuild(shm, x, keep, full, _bounds(n), redop, be.reduce, avg_p, f"n={n}")
    shm.free()  # collective: on success only


def _assert_shards_rebuild(shm, x, keep, full, bounds, op, reduce, avg_p=None, what=""):
    """``shm.reduce_scatter`` of ``x`` is my shard of ``full`` (the allreduce's bits) without touching ``x``
    (still ``keep``), and ``shm.allgather`` of the shards is ``full`` again."""
    lo, hi = bounds[RANK]
    shard = np.full(hi - lo, 7, dtype=x.dtype)
    with np.errstate(all="ignore"):
        shm.reduce_scatter(x, shard, bounds, op, reduce, avg_p=avg_p)
    assert np.array_equal(shard.view(np.uint8), full[lo:hi].view(np.uint8)), f"reduce_scatter {what}"
    assert np.array_equal(x.view(np.uint8), keep.view(np.uint8)), f"input modified {what}"
    whole = np.empty_like(x)
    shm.allgather(shard, whole, bounds)
    assert np.array_equal(whole.view(np.uint8), full.view(np.uint8)), f"allgather {what}"


@needs_peers
@pytest.mark.parametrize("whole_below", [0, 1 << 20], ids=["pieces", "whole"])
def test_reduce_scatter_and_allgather_with_skewed_ranks(whole_below):
    """Ranks late by turns, new data every call, pieces of 40 B: a stale or early slot shows as a wrong value."""
    shm = ShmAllreduce(COMM, piece_bytes=40, whole_below=whole_below)
    reduce = backend_for(np.empty(0)).reduce
    rng = np.random.default_rng(RANK + 7)
    bounds = _bounds(301)
    lo, hi = bounds[RANK]
    for call in range(30):
        x = (np.arange(301, dtype=np.int64) * 1000 + call) * P + RANK
        want = sum((np.arange(301, dtype=np.int64) * 1000 + call) * P + q for q in range(P))
        if rng.random() < 0.5:
            time.sleep(rng.random() * 2e-3)
        shard = np.empty(hi - lo, np.int64)
        shm.reduce_scatter(x, shard, bounds, "sum", reduce)
        assert np.array_equal(shard, want[lo:hi]), f"reduce_scatter call {call}"
        if rng.random() < 0.5:
            time.sleep(rng.random() * 2e-3)
        out = np.empty(301, np.int64)
        shm.allgather(shard, out, bounds)
        assert np.array_equal(out, want), f"allgather call {call}"
    shm.free()  # collective: on success only


@needs_peers
def test_communicator_reduce_scatter_and_allgather_take_the_window(forced):
    x = rank_data(10_007, RANK, P, np.float32)
    shard = forced.reduce_scatter(x, "avg")
    assert forced.last_algorithm == "shm"
    assert forced.decisions()["reduce_scatter"]["fast"], "the settled fast path was not taken"
    full_path = forced.reduce_scatter(x, "avg", validate=False)  # any explicit check option: the full path
    assert np.array_equal(full_path, shard)
    # The fast path leaves unusual inputs to the full path: errors raise there, strided arrays are copied.
    with pytest.raises((TypeError, ValueError), match="dtype"):
        forced.reduce_scatter(x.astype(np.complex64), "sum")
    assert np.array_equal(forced.reduce_scatter(x[::2], "sum"), forced.reduce_scatter(x[::2].copy(), "sum"))
    lo, hi = forced.shard_range(x.size)
    full = forced.allreduce(x, "avg")
    assert np.array_equal(shard, full[lo:hi])
    back = forced.allgather(shard)
    assert forced.last_algorithm == "shm" and np.array_equal(back, full)
    with ddlkernels.Communicator(COMM, shm=False, small_bytes=0) as ring:
        assert_close(ring.reduce_scatter(x, "avg"), [a[lo:hi] for a in COMM.allgather(x)], "avg", np.float32)
        assert ring.last_algorithm == "ring"


# Values where a compiled loop could part from numpy's bits: NaNs of both
# signs and two payloads, both zeros, both infinities, and ordinary numbers.
_SPECIAL = [0x7FC00001, 0xFFC00002, 0x7FC00000, 0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x3FC00000,
            0xC0100000]


def _special(dtype, n, rank):
    """Rank ``rank``'s values: element i holds digit ``rank`` of i in base len(_SPECIAL), so that the first
    min(P, 3) ranks meet in every combination."""
    k = len(_SPECIAL)
    digits = (np.arange(n) // k**rank) % k
    # float64: the same values, widened (NaN payloads move to the top of the fraction, as they should).
    return np.array(_SPECIAL, dtype=np.uint32)[digits].view(np.float32).astype(dtype)


@pytest.mark.sweep
@needs_peers
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
@pytest.mark.parametrize("form", ["whole", "pieces"])
def test_compiled_calls_keep_numpys_bits_for_nan_zero_and_inf(dtype, op, form):
    """The compiled small-message call and the compiled pieces (ddlkernels.kernels.window_loops) are numpy's ufunc fold bit
    for bit, signed zeros, infinities and NaNs included, in and out of place -- but for which NaN a sum or product
    of two NaNs returns, which numpy itself does not fix (it varies with the element's place in the array): there
    the result is a NaN of one of the inputs, quieted, and the same on every rank."""
    n = len(_SPECIAL) ** min(P, 3)
    x = _special(dtype, n, RANK)
    keep = x.copy()
    xs = COMM.allgather(x)
    ufunc = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    # pieces: 64-byte pieces, so that the message is many pieces and a shorter last one.
    shm = ShmAllreduce(COMM, whole_below=1 << 20) if form == "whole" else ShmAllreduce(COMM, piece_bytes=64,
                                                                                        whole_below=0)
    reduce = backend_for(x).reduce
    with np.errstate(all="ignore"):
        want = ufunc(xs[0], xs[1])
        for v in xs[2:]:
            want = ufunc(want, v)
        got = np.empty_like(x)
        shm.run(x, got, op, reduce)
        z = x.copy()
        shm.run(z, z, op, reduce)
    assert (np.dtype(dtype), n, op) in shm._small  # the compiled call ran
    assert np.array_equal(x.view(np.uint8), keep.view(np.uint8)), "input modified"
    assert np.array_equal(z.view(np.uint8), got.view(np.uint8)), f"{op}: in place differs"
    assert_same_on_all_ranks(COMM, got, f"{op} {dtype}")
    uint = np.uint32 if x.itemsize == 4 else np.uint64
    free = np.isnan(want) if op in ("sum", "prod") else np.zeros(n, bool)  # the NaN numpy leaves open
    bad = np.flatnonzero((got.view(uint) != want.view(uint)) & ~free)
    assert bad.size == 0, f"{op}: first differing elements {bad[:5]}"
    assert np.isnan(got[free]).all()
    quiet = uint(1) << uint(22 if x.itemsize == 4 else 51)
    nans = {int(b) | int(quiet) for v in xs for b in v.view(uint)[np.isnan(v)]}
    with np.errstate(invalid="ignore"):  # inf - inf and 0 * inf make the default NaN instead
        inf = np.array([np.inf], dtype)
        nans |= {int((inf - inf).view(uint)[0]), int((inf * 0).view(uint)[0])}
    assert {int(b) for b in got.view(uint)[free]} <= nans
    # reduce_scatter's compiled call folds the same way: my shard of the allreduce, bit for bit; and
    # allgather's puts the shards back together.
    _assert_shards_rebuild(shm, x, keep, got, _bounds(n), op, reduce, what=op)
    shm.free()  # collective: on success only


@needs_peers
@pytest.mark.parametrize("whole_below", [0, 1 << 20], ids=["pieces", "whole"])
def test_ranks_with_and_without_a_timeout_meet_in_the_same_barrier(whole_below):
    """``timeout=`` is per call and per rank: a rank in the Python loop, polling its barrier from Python, and a
    rank in the compiled loop (and barrier) still meet, call after call -- allreduce, reduce_scatter and
    allgather alike."""
    from ddlkernels.safety.deadline import Deadline

    shm = ShmAllreduce(COMM, piece_bytes=64, whole_below=whole_below)
    reduce = backend_for(np.empty(0)).reduce
    bounds = _bounds(37)
    lo, hi = bounds[RANK]
    for call in range(8):
        x = (np.arange(37, dtype=np.int64) * 100 + call) * P + RANK
        want = sum((np.arange(37, dtype=np.int64) * 100 + call) * P + q for q in range(P))
        deadline = Deadline("allreduce", RANK, 60.0) if (RANK + call) % 2 else None
        out = np.empty_like(x)
        shm.run(x, out, "sum", reduce, deadline=deadline)
        assert np.array_equal(out, want), f"call {call}"
        shard = np.empty(hi - lo, x.dtype)
        shm.reduce_scatter(x, shard, bounds, "sum", reduce, deadline=deadline)
        assert np.array_equal(shard, want[lo:hi]), f"reduce_scatter, call {call}"
        whole = np.empty_like(x)
        shm.allgather(shard, whole, bounds, deadline=deadline)
        assert np.array_equal(whole, want), f"allgather, call {call}"
    shm.free()  # collective: on success only


@needs_peers
@pytest.mark.parametrize("count", [50 * P + 3, 20000 * P + 3], ids=["whole", "pieces"])
def test_shard_fast_paths_hold_the_windows_compiled_calls_and_free_drops_them(count):
    """A reduce_scatter/allgather on the window, small (one compiled call) or large (the compiled loop): after
    the first call (the full path, which allocates the window) the fast paths keep a plan of the window's
    prepared call; free() forgets them with the window."""
    with ddlkernels.Communicator(COMM, shm=True) as dc:
        x = rank_data(count, RANK, P, np.float64)
        want = dc.allreduce(x)
        lo, hi = dc.shard_range(count)
        for _ in range(3):
            shard = dc.reduce_scatter(x)
            assert np.array_equal(shard, want[lo:hi]) and dc.last_algorithm == "shm"
            whole = dc.allgather(shard, count=count)
            assert np.array_equal(whole, want) and dc.last_algorithm == "shm"
        window = dc.algorithms["shm"].window()
        bounds = [dc.shard_range(count, rank=q) for q in range(P)]
        assert window.shard_fn("reduce_scatter", x.dtype, count, "sum", bounds) is not None  # compiled
        assert window.shard_fn("allgather", x.dtype, count, None, bounds, None) is not None
        decided = dc.decisions()
        assert list(decided["reduce_scatter"]["fast"].values()) == ["shm"], decided
        assert list(decided["allgather"]["fast"].values()) == ["shm"], decided
        dc.free()
        decided = dc.decisions()
        assert not decided["reduce_scatter"]["fast"] and not decided["allgather"]["fast"]


@pytest.mark.sweep
@needs_peers
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shared", ["all", "odd ranks"])
@pytest.mark.parametrize("piece_bytes,stream_from", [(100, None), (1 << 20, None), (4096, 0)],
                         ids=["pieces100B", "pieces1M", "pieces4K-streamed"])
def test_shared_inputs_are_read_where_they_lie(dtype, op, shared, piece_bytes, stream_from):
    """An input in ``empty``'s shared memory is read by peers in place, not staged: the same bits as a staged
    call, in place and out of place, at any offset into the region, with every rank's input shared or only
    some ranks'; the shared ranks' published (region, offset) says the peers really read it there.  The same
    for reduce_scatter, and for allgather's shards."""
    shm = ShmAllreduce(COMM, piece_bytes=piece_bytes, whole_below=0, stream_from=stream_from)
    be = backend_for(np.empty(0, dtype))
    item = np.dtype(dtype).itemsize
    # A last size of several pieces: pieces of 100 B are ~100 at 4099 elements already; of 4 KiB, 20_011 gives
    # every rank's block more than one (2-byte items at 4 ranks); of 1 MiB, 300_007 gives 1.2-2.4 MB in all.
    cases = ((1, 0), (P + 1, 3), (4099, 1)) + {100: (), 4096: ((20_011, 0),), 1 << 20: ((300_007, 0),)}[piece_bytes]
    for n, skip in cases:
        region = shm.empty((n + skip) * item).view(dtype)  # collective: every rank, shared or not
        mine = shared == "all" or RANK % 2 == 1
        x = rank_data(n, RANK, P, dtype, salt=n)
        want = _rank_order_fold(COMM.allgather(x), op, be)
        src = region[skip:] if mine else x.copy()
        src[...] = x
        redop, avg_p = ("sum", P) if op == "avg" else (op, None)
        out = np.full_like(x, 99)
        shm.run(src, out, redop, be.reduce, avg_p=avg_p)
        what = f"n={n} at {skip} {op} {dtype.__name__} shared: {shared}"
        assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), what
        assert np.array_equal(src.view(np.uint8), x.view(np.uint8)), f"{what}: input modified"
        published = shm._flags.reshape(P, -1)[:, 1:3]
        for s in range(P):
            if shared == "all" or s % 2 == 1:
                assert published[s][0] > 0 and published[s][1] == skip * item, f"{what}: rank {s} {published[s]}"
            else:
                assert published[s][0] == 0, f"{what}: rank {s} staged but published {published[s]}"
        # reduce_scatter reads a shared input in place too (uneven shards): the allreduce's bits.
        bounds = _bounds(n)
        _assert_shards_rebuild(shm, src, x, want, bounds, redop, be.reduce, avg_p, what)
        # allgather copies a shared shard from where it lies (a prefix of an equal region on every rank).
        lo, hi = bounds[RANK]
        longest = max(b - a for a, b in bounds)
        shards = shm.empty((longest + skip) * item).view(dtype)  # collective
        shard = shards[skip : skip + hi - lo] if mine else np.empty(hi - lo, dtype)
        shard[...] = want[lo:hi]
        whole = np.full_like(x, 99)
        shm.allgather(shard, whole, bounds)
        assert np.array_equal(whole.view(np.uint8), want.view(np.uint8)), f"{what}: allgather of shared shards"
        assert np.array_equal(shard.view(np.uint8), want[lo:hi].view(np.uint8)), f"{what}: shard modified"
        shm.run(src, src, redop, be.reduce, avg_p=avg_p)
        assert np.array_equal(src.view(np.uint8), want.view(np.uint8)), f"{what}: in place"
    shm.free()  # collective: on success only


@needs_peers
@pytest.mark.parametrize("whole_below", [0, 1 << 20], ids=["pieces", "whole"])
def test_skewed_ranks_never_read_a_shared_input_too_early_or_too_late(whole_below):
    """Ranks that refill their shared input right after a call returns, while a peer is late: every result is
    still the sum of that call's inputs (a peer reads my input only between the barriers of the call).  Half
    the ranks of each call wait with a timeout (polled barriers), the others without: the same barriers."""
    from ddlkernels.safety.deadline import Deadline

    shm = ShmAllreduce(COMM, piece_bytes=4096, whole_below=whole_below)
    reduce = backend_for(np.empty(0)).reduce
    n = 5000
    region = shm.empty(n * 8).view(np.int64)
    for call in range(6):
        if (RANK + call) % P == 0:
            time.sleep(0.05)  # one rank late, a different one each call
        region[:] = (np.arange(n, dtype=np.int64) * 1000 + call) * P + RANK
        want = sum((np.arange(n, dtype=np.int64) * 1000 + call) * P + q for q in range(P))
        out = np.empty(n, np.int64)
        deadline = Deadline("allreduce", RANK, 60.0) if (RANK + call) % 2 else None
        shm.run(region, out, "sum", reduce, deadline=deadline)
        assert np.array_equal(out, want), f"call {call}"
    shm.free()  # collective: on success only


@needs_peers
def test_communicator_empty_gives_shared_memory_and_the_allreduce_reads_it():
    with ddlkernels.Communicator(COMM, shm=True) as dc:
        a = dc.empty((3, 50_000), np.float32)
        assert a.shape == (3, 50_000) and a.dtype == np.float32 and a.flags.c_contiguous
        a[...] = rank_data(a.size, RANK, P, np.float32).reshape(a.shape)
        keep = a.copy()
        want = dc.allreduce(keep)
        got = dc.allreduce(a)
        assert np.array_equal(got, want) and np.array_equal(a, keep)
        assert dc.algorithms["shm"].window().read_in_place()  # read in place, not staged
        dc.allreduce(a, out=a)
        assert np.array_equal(a, want)
        # The fast path of a settled size serves it too, with the same bits.
        with ddlkernels.Communicator(COMM) as tuned:
            b = tuned.empty(200_000, np.float64)
            b[...] = rank_data(b.size, RANK, P, np.float64)
            ref = tuned.allreduce(b.copy())
            for _ in range(80):
                assert np.array_equal(tuned.allreduce(b), ref)


def _mapped(address):
    """Whether ``address`` lies in a mapping of this process (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


@needs_peers
def test_free_keeps_the_memory_of_arrays_still_in_use_and_releases_the_rest():
    """``free`` unmaps an ``empty`` region only where no rank holds an array of it: an array kept past ``free``
    (a view of it, or only on rank 0) stays readable and writable with its data; a region dropped on every
    rank, or held only by a dead reference cycle, has its window freed."""
    import gc

    from ddlkernels.algorithms import window as _window

    gc.collect()
    kept_before = len(_window._KEPT)
    n = 3000
    with ddlkernels.Communicator(COMM, shm=True) as dc:
        view = dc.empty(n + 5, np.int64)[5:]  # only a view outlives the call's own array
        dropped = dc.empty(n, np.int64)
        cycle = [dc.empty(n, np.int64)]
        cycle.append(cycle)
        on_rank0 = dc.empty(n, np.int64)
        for a in (view, dropped, cycle[0], on_rank0):
            a[...] = rank_data(n, RANK, P, np.int64)
        want = dc.allreduce(view.copy())
        assert np.array_equal(dc.allreduce(view), want)  # read in place (published), as before
        del dropped, cycle
        if RANK != 0:
            del on_rank0
    # After free: two windows kept (the view's on every rank, and rank 0's on every rank alike), two freed.
    assert len(_window._KEPT) - kept_before == 2, f"kept {len(_window._KEPT) - kept_before} windows"
    assert _mapped(view.ctypes.data) and _mapped(view.ctypes.data + view.nbytes - 1)
    assert np.array_equal(view, rank_data(n, RANK, P, np.int64)), "a kept array lost its data"
    view[...] = want  # and is writable
    assert np.array_equal(view, want)
    if RANK == 0:
        assert np.array_equal(on_rank0, rank_data(n, RANK, P, np.int64))


@pytest.mark.parametrize("shm", [None, False])
def test_communicator_empty_checks_its_arguments_on_every_rank(shm):
    with ddlkernels.Communicator(COMM, shm=shm) as dc:
        if P > 1:  # one rank has nothing to disagree with
            with pytest.raises(ValueError, match="same shape and dtype"):
                dc.empty(10 + RANK, np.float32)
            with pytest.raises(ValueError, match="same shape and dtype"):
                dc.empty(10, np.float32 if RANK == 0 else np.float64)
        with pytest.raises(ValueError, match="negative"):
            dc.empty((2, -1))
        with pytest.raises(TypeError):
            dc.empty(10, "not a dtype")
        z = dc.empty(0, np.int32)
        assert z.shape == (0,) and np.array_equal(dc.allreduce(z), z)
        if shm is False or P == 1:  # no window: an ordinary array, and the allreduce as usual
            x = dc.empty(7)
            x[...] = rank_data(7, RANK, P, np.float32)
            assert_close(dc.allreduce(x), COMM.allgather(x.copy()), "sum", np.float32, "plain empty")


@needs_peers
def test_module_level_empty_is_read_in_place_by_the_module_functions():
    """``ddlkernels.empty`` allocates in the communicator the module functions use, which then reads it where
    it lies (whatever the tuner chose, the result is the same: exact data)."""
    a = ddlkernels.empty(300_000, np.float64)
    a[...] = rank_data(a.size, RANK, P, np.float64)
    keep = a.copy()
    want = ddlkernels.allreduce(keep)
    dc = ddlkernels.as_communicator()
    for _ in range(60):  # through the tuner's trials to its choice
        assert np.array_equal(ddlkernels.allreduce(a), want) and np.array_equal(a, keep)
    if dc.last_algorithm == "shm":
        window = dc.algorithms["shm"].window()
        assert window.shared_at(a.reshape(-1))[0] > 0 and window.read_in_place()


@needs_peers
def test_compiling_ahead_covers_every_signature_the_window_compiles():
    """``python -m ddlkernels compile`` (``ddlkernels.kernels.precompile``) compiles the argument types the
    window's calls use: after whole and pieced calls of every op, reduce-scatter and allgather included, no window
    loop holds a signature of those dtypes outside its table (else the first calls would still compile)."""
    from ddlkernels.kernels import precompile, window_loops

    want = precompile.signatures()
    shm = ShmAllreduce(COMM, piece_bytes=64, whole_below=256)
    be = backend_for(np.empty(0))
    for dtype in precompile.DTYPES:
        for op in ("sum", "prod", "max", "min"):
            for n in (5, 301):  # under whole_below, and many pieces
                x = rank_data(n, RANK, P, dtype)
                full = np.empty_like(x)
                shm.run(x, full, op, be.reduce)
                lo, hi = _bounds(n)[RANK]
                shard = np.empty(hi - lo, x.dtype)
                shm.reduce_scatter(x, shard, _bounds(n), op, be.reduce)
                shm.allgather(shard, full, _bounds(n))
    shm.free()  # collective: on success only
    loops = [fn for fn in want if fn.py_func.__module__ == window_loops.__name__]
    assert len(loops) == 14, loops
    for fn in loops:
        held = [s for s in fn.signatures if s[0].dtype.name in precompile.DTYPES]
        assert held, f"{fn.__name__}: not called, so this test shows nothing of it"
        assert set(held) <= want[fn], f"{fn.__name__}: compiled {set(held) - want[fn]}, not in the table"
