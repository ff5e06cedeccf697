"""allreduce / Allreduce / reduce_scatter / allgather against numpy, under any rank count.

Every case checks: the reference (exact for integers and max/min, within the
bound of tests/helpers.py for float sums and products), identical bits on
every rank, and an untouched input for out-of-place calls.
"""

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels
from helpers import ALL_DTYPES, DTYPE_IDS, OPS, assert_close, assert_same_on_all_ranks, dims_cases, rank_data

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
SIZES = [0, 1, 3, 5, 4097, 1_000_003]


DIMS = dims_cases(P)


def gather_inputs(x):
    return COMM.allgather(np.asarray(x))


def strided(a):
    """A copy of 1-D ``a`` as a non-contiguous view (every other element of a buffer twice as long):
    what the collectives take through their full path, where a contiguous array may take a fast path."""
    wide = np.zeros(2 * a.shape[0], a.dtype)
    wide[::2] = a
    return wide[::2]


def last_algorithm():
    return ddlkernels.as_communicator(COMM).last_algorithm


def assert_same_result(z, y, inputs, op, dtype, algos, what):
    """In place against out of place: the same bits from the same algorithm.

    While the tuner measures a size (ddlkernels.select.tuner), consecutive calls
    may run different algorithms, which add in different orders: then both
    results must be correct, and each the same on every rank.
    """
    if algos[0] == algos[1]:
        assert np.array_equal(z.view(np.uint8), y.view(np.uint8)), f"{what}: in place differs from out of place"
    else:
        assert_close(z, inputs, op, dtype, f"{what} (in place, {algos[1]} after {algos[0]})")
        assert_same_on_all_ranks(COMM, z, what)


@pytest.mark.sweep("dtype", "op")
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", OPS)
def test_allreduce_every_dims_and_mode(n, dtype, op):
    # Chunks of 64 KiB so that 1,000,003 elements pipeline through many chunks
    # per step; small sizes below the default threshold take MPI's own
    # allreduce when dims is None, the ring otherwise.
    x = rank_data(n, RANK, P, dtype)
    inputs = gather_inputs(x)
    for dims in DIMS:
        what = f"n={n} {dtype} {op} dims={dims}"
        keep = x.copy()
        y = ddlkernels.allreduce(x, op, dims=dims, chunk_bytes=64 << 10)
        first = last_algorithm()
        assert np.array_equal(x.view(np.uint8), keep.view(np.uint8)), f"{what}: input modified"
        assert y.dtype == x.dtype and y.shape == x.shape
        assert_close(y, inputs, op, dtype, what)
        assert_same_on_all_ranks(COMM, y, what)
        z = x.copy()
        r = ddlkernels.allreduce(z, op, out=z, dims=dims, chunk_bytes=64 << 10)
        assert r is z
        assert_same_result(z, y, inputs, op, dtype, (first, last_algorithm()), what)


@pytest.mark.sweep("dtype", "mpi_op")
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mpi_op", ["SUM", "MAX", "MIN", "PROD"])
def test_Allreduce_mpi4py_shape(n, dtype, mpi_op):
    op = getattr(MPI, mpi_op)
    x = rank_data(n, RANK, P, dtype, salt=1)
    inputs = gather_inputs(x)
    recv = np.empty_like(x)
    ddlkernels.Allreduce(x, recv, op)
    first = last_algorithm()
    assert_close(recv, inputs, mpi_op.lower(), dtype, f"Allreduce n={n}")
    assert_same_on_all_ranks(COMM, recv)
    buf = x.copy()
    ddlkernels.Allreduce(MPI.IN_PLACE, buf, op)
    assert_same_result(buf, recv, inputs, mpi_op.lower(), dtype, (first, last_algorithm()), f"Allreduce n={n}")


def test_Allreduce_is_a_drop_in_for_comm_Allreduce():
    """Same call shape as mpi4py, same answer (integers: exact)."""
    x = rank_data(1001, RANK, P, np.int64)
    a, b = np.empty_like(x), np.empty_like(x)
    COMM.Allreduce(x, a, MPI.SUM)
    ddlkernels.Allreduce(x, b, MPI.SUM)
    assert np.array_equal(a, b)
    # Shapes may differ when sizes agree, as in mpi4py.
    c = np.empty((7, 11, 13), dtype=np.int64)
    ddlkernels.Allreduce(x, c, MPI.SUM)
    assert np.array_equal(c.reshape(-1), a)


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("n", [0, 1, max(P - 1, 0), P + 1, 4099, 65537])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_reduce_scatter_allgather_roundtrip(dims, n, op):
    x = rank_data(n, RANK, P, np.float64, salt=2)
    keep = x.copy()
    inputs = gather_inputs(x)
    shard = ddlkernels.reduce_scatter(x, op, dims=dims, chunk_bytes=8 << 10)
    assert np.array_equal(x, keep)
    lo, hi = ddlkernels.shard_range(n, dims=dims)
    assert shard.shape == (hi - lo,)
    full_ref = ddlkernels.allreduce(x, op, dims=dims, chunk_bytes=8 << 10)
    assert np.array_equal(shard, full_ref[lo:hi])
    ranges = COMM.allgather((lo, hi))
    assert sorted(ranges)[0][0] == 0 and sorted(ranges)[-1][1] == n
    full = ddlkernels.allgather(shard, dims=dims, chunk_bytes=8 << 10)
    assert np.array_equal(full, full_ref)
    assert_close(full, inputs, op, np.float64)


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", OPS)
def test_reduce_scatter_and_allgather_through_mpis_own_calls(dtype, op):
    """small_bytes above every size: MPI_Reduce_scatter / MPI_Allgatherv wherever they compute the call.

    reduce_scatter goes to MPI for MPI's types and ops (float max/min and
    bfloat16/float16 keep the ring); allgather moves bytes, so MPI takes
    every dtype.  Results match the ring's: allgather bit for bit, the
    reduction as the rank-order fold allows (MPI may add in another order).
    """
    from ddlkernels.algorithms.mpi import MPI_NATIVE

    native = np.dtype(dtype) in MPI_NATIVE
    redop = "sum" if op == "avg" else op
    mpi_rs = P > 1 and native and (redop in ("sum", "prod") or np.dtype(dtype).kind in "iu")
    with ddlkernels.Communicator(COMM, small_bytes=1 << 40) as mpi, \
            ddlkernels.Communicator(COMM, small_bytes=0, shm=False) as ring:
        for n in (0, 1, max(P - 1, 0), P + 1, 4 * P, 97, 4099, 1024 * P):  # unequal and equal shards
            x = rank_data(n, RANK, P, dtype, salt=5)
            keep = x.copy()
            inputs = gather_inputs(x)
            lo, hi = mpi.shard_range(n)
            for _ in range(2):  # the full path, then the settled fast path
                shard = mpi.reduce_scatter(x, op)
                assert mpi.last_algorithm == ("mpi" if mpi_rs else "ring"), (n, mpi.last_algorithm)
                assert shard.dtype == x.dtype and shard.shape == (hi - lo,)
                assert np.array_equal(x.view(np.uint8), keep.view(np.uint8)), "input modified"
                assert_close(shard, [a[lo:hi] for a in inputs], op, dtype, f"reduce_scatter n={n}")
                assert_same_on_all_ranks(COMM, mpi.allgather(shard), f"allgather n={n}")
                assert mpi.last_algorithm == ("mpi" if P > 1 else "ring")
                want = ring.allgather(shard)
                for count in (None, n):
                    got = mpi.allgather(shard, count=count)
                    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"allgather n={n} count={count}"
        if P > 1 and mpi_rs:
            assert "mpi" in mpi.decisions()["reduce_scatter"]["fast"].values(), "reduce_scatter fast path not taken"
        if P > 1:
            assert "mpi" in mpi.decisions()["allgather"]["fast"].values(), "allgather fast path not taken"


def test_allgather_count_is_checked_before_communicating():
    x = rank_data(10 * P + 3, RANK, P, np.float32)
    with ddlkernels.Communicator(COMM) as dc:
        shard = dc.reduce_scatter(x)
        assert np.array_equal(dc.allgather(shard, count=x.size), dc.allgather(shard))
        with pytest.raises(TypeError, match="count must be an integer"):
            dc.allgather(shard, count=1.5)
        with pytest.raises(ValueError, match="count must be >= 0"):
            dc.allgather(shard, count=-1)
        # Too many elements: at least rank 0's shard is too short; with validate every rank hears of it.
        with pytest.raises(ValueError, match="shard"):
            dc.allgather(shard, count=x.size + 1, validate=True)
        with pytest.raises(ValueError, match="shard"):  # the same count everywhere: every rank knows locally
            dc.allgather(shard, count=x.size + P)
        assert np.array_equal(dc.allgather(shard, count=np.int64(x.size)), dc.allgather(shard))


@pytest.mark.parametrize("small_bytes", [None, 0, 1 << 40], ids=["tuned", "ring", "mpi"])
def test_reduce_scatter_and_allgather_write_into_out(small_bytes):
    """out=: the result lands there (fast and full paths alike), nothing else is written, and a bad out
    raises on every rank before any communication."""
    n = 50 * P + 3
    x = rank_data(n, RANK, P, np.int64, salt=9)
    inputs = gather_inputs(x)
    with ddlkernels.Communicator(COMM, small_bytes=small_bytes) as dc:
        lo, hi = dc.shard_range(n)
        want = sum(a[lo:hi] for a in inputs)
        for validate in (False, True, False, False):  # full path (trials, checks), then settled fast paths
            buf = np.full(hi - lo + 2, -7, np.int64)
            out = buf[1:-1]
            assert dc.reduce_scatter(x, out=out, validate=validate) is out
            assert np.array_equal(out, want) and buf[0] == buf[-1] == -7
            whole = np.full(n, -7, np.int64)
            assert dc.allgather(out, out=whole, validate=validate) is whole
            assert np.array_equal(whole, sum(inputs))
            again = np.empty(n, np.int64)
            assert dc.allgather(out, count=n, out=again) is again and np.array_equal(again, whole)
        shard = want.copy()
        bad = [
            (np.empty(hi - lo, np.int32), TypeError, "dtype"),
            (np.empty(hi - lo + 1, np.int64), ValueError, "shape"),
            (np.empty((hi - lo, 1), np.int64), ValueError, "shape"),
            (np.empty(2 * (hi - lo), np.int64)[::2], ValueError, "contiguous"),
        ]
        for o, exc, msg in bad:
            with pytest.raises(exc, match=msg):
                dc.reduce_scatter(x, out=o)
        with pytest.raises(ValueError, match="overlaps"):
            dc.reduce_scatter(x, out=x[: hi - lo])
        with pytest.raises(TypeError, match="dtype"):
            dc.allgather(shard, out=np.empty(n, np.float64))
        with pytest.raises(ValueError, match="shape"):
            dc.allgather(shard, count=n, out=np.empty(n + 1, np.int64))
        whole = np.empty(n, np.int64)
        with pytest.raises(ValueError, match="overlaps"):
            dc.allgather(whole[lo:hi], out=whole)
        assert np.array_equal(dc.allgather(shard, out=np.empty(n, np.int64)), sum(inputs))  # still usable


def test_flat_ring_shards_are_rank_ordered():
    n = 10 * P + 3
    bounds = [ddlkernels.shard_range(n, dims=(P,), rank=r) for r in range(P)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_multidimensional_array_and_noncontiguous_input():
    base = rank_data(6 * 50 * 4, RANK, P, np.float32).reshape(6, 50, 4)
    view = base[:, ::2, :]  # not contiguous
    keep = base.copy()
    inputs = gather_inputs(np.ascontiguousarray(view))
    y = ddlkernels.allreduce(view, "sum", chunk_bytes=256)
    assert y.shape == view.shape and y.flags.c_contiguous
    assert_close(y.reshape(-1), [a.reshape(-1) for a in inputs], "sum", np.float32)
    assert np.array_equal(base, keep)
    # In place on a non-contiguous view writes through to the base array.
    ddlkernels.allreduce(view, "sum", out=view, chunk_bytes=256)
    assert np.array_equal(view, y)
    assert np.array_equal(base[:, 1::2, :], keep[:, 1::2, :])


def test_communicator_object_and_mpi_comm_argument():
    sub = COMM.Split(RANK % 2, RANK)
    try:
        with ddlkernels.Communicator(sub, chunk_bytes=1024, small_bytes=0) as dc:
            x = rank_data(3001, sub.Get_rank(), sub.Get_size(), np.int32)
            inputs = sub.allgather(x)
            for y in (dc.allreduce(x), ddlkernels.allreduce(x, comm=dc), ddlkernels.allreduce(x, comm=sub)):
                assert_close(y, inputs, "sum", np.int32)
    finally:
        sub.Free()


def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch", reason="torch not installed (pip install -e .[torch])")
    x = torch.from_numpy(rank_data(1234, RANK, P, np.float32))
    inputs = gather_inputs(x.numpy())
    y = ddlkernels.allreduce(x, "avg")
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    assert_close(y.numpy(), inputs, "avg", np.float32)
    ddlkernels.allreduce(x, "avg", out=x)
    assert torch.equal(x, y)


def test_small_message_path_and_ring_agree():
    """Below small_bytes MPI's own allreduce runs; integers must match the ring exactly."""
    x = rank_data(100, RANK, P, np.int64)
    with ddlkernels.Communicator(COMM, small_bytes=1 << 20) as small, ddlkernels.Communicator(COMM, small_bytes=0) as ring:
        a = small.allreduce(x, "avg")
        assert small.last_algorithm == ("mpi" if P > 1 else "ring")
        b = ring.allreduce(x, "avg")
        assert ring.last_algorithm == "ring"
    assert np.array_equal(a, b)


@pytest.mark.parametrize("nbytes", [24, 4096, 65536])
def test_small_sizes_measure_mpi_blocking_against_nonblocking_and_agree(nbytes):
    """Below MPI_BELOW the candidates are MPI_Allreduce, MPI_Iallreduce and (one node) shm, and from CMA_FROM
    the single copy where permitted: all tried, one kept."""
    from ddlkernels.algorithms.cma import CMA_FROM
    from ddlkernels.select.tuner import tuning_calls

    with ddlkernels.Communicator(COMM) as dc:
        cands = set(dc.candidates(np.zeros(nbytes // 8)))
        assert cands == ({"mpi", "nbc"} | ({"shm"} & set(dc.algorithms.names))
                         | ({"cma"} if "cma" in dc.algorithms and nbytes >= CMA_FROM else set())) or P == 1
    n = tuning_calls(nbytes, len(cands))  # calls until the choice is made
    x = rank_data(nbytes // 8, RANK, P, np.float64)
    inputs = gather_inputs(x)
    out = np.empty_like(x)
    with ddlkernels.Communicator(COMM) as dc:
        seen = []
        for k in range(n + 4):
            # Alternate the entry points: the fast path and the full one share the decision.
            y = dc.allreduce(x, "sum", out=out) if k % 2 else dc.allreduce(x, "sum")
            assert_close(y, inputs, "sum", np.float64)
            assert_same_on_all_ranks(COMM, y, f"{nbytes} B call {k}")
            seen.append(dc.last_algorithm)
        if P > 1:
            assert set(seen[:n]) == cands, seen
            assert len(set(seen[n:])) == 1, seen
            assert not dc.tuning(x)
            # In place shares the decision (ranks may differ in placement): settled already, correct.
            placed = []
            for k in range(4):
                z = x.copy()
                dc.allreduce(z, "sum", out=z)
                assert_close(z, inputs, "sum", np.float64)
                assert_same_on_all_ranks(COMM, z, f"{nbytes} B in place, call {k}")
                placed.append(dc.last_algorithm)
            assert set(placed) == set(seen[n:]), (placed, seen)
            seen += placed
        else:
            assert set(seen) == {"ring"}, seen
        decided = COMM.allgather(seen)
        assert all(d == decided[0] for d in decided), "every rank ran the same algorithm in every call"
    assert np.array_equal(x, rank_data(nbytes // 8, RANK, P, np.float64)), "input modified"


def test_a_watched_size_is_measured_again_on_every_rank_at_once():
    """From WATCH_FROM bytes a settled size is re-checked at intervals of calls; a slowdown reopens it.

    Even ranks take the fast path (a contiguous input and out=), odd ranks the
    full one (a strided input, reduced through a copy): both must count every
    call, or the ranks would check -- a collective -- at different calls.
    """
    from ddlkernels.select.tuner import WATCH_FROM, Settled, tuning_calls

    count = WATCH_FROM // 8
    x = rank_data(count, RANK, P, np.float64)
    inputs = gather_inputs(x)
    strided_x = strided(x)
    out = np.empty_like(x)
    with ddlkernels.Communicator(COMM) as dc:
        if P == 1:
            pytest.skip("one rank: nothing to choose between")
        cands = set(dc.candidates(x))  # mpi, ring, (one node) shm, cma
        n = tuning_calls(x.nbytes, len(cands))

        def calls(k):
            seen = []
            for i in range(k):
                y = dc.allreduce(strided_x, "sum") if RANK % 2 else dc.allreduce(x, "sum", out=out)
                assert_close(y, inputs, "sum", np.float64, f"call {i}")
                seen.append(dc.last_algorithm)
            return seen

        seen = calls(n)
        assert set(seen) == cands and not dc.tuning(x), seen
        settled = [dc.selector.tuners["allreduce"].state(x.nbytes, dc.candidates(x))]
        assert isinstance(settled[0], Settled), settled
        # As if the machine had slowed down since the trials: the next check finds the calls too slow.
        # (Set alike on every rank, as the agreed trial time is.)
        settled[0].limit = 1e-9
        after = calls(settled[0].every)
        assert len(set(after)) == 1, after  # the settled algorithm until the check, which reopens
        assert dc.tuning(x) and dc.tuning(strided_x)
        again = calls(n + 2)
        assert set(again[:n]) == cands and len(set(again[n:])) == 1, again
        assert not dc.tuning(x)
        seen += after + again
        every = COMM.allgather(seen)
        assert all(s == every[0] for s in every), "every rank ran the same algorithm in every call"
    assert np.array_equal(strided_x, x) and np.array_equal(x, rank_data(count, RANK, P, np.float64)), "input modified"


@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter", "allgather"])
def test_a_small_settled_size_is_measured_again_after_its_calls(kind, monkeypatch):
    """Below WATCH_FROM nothing is timed, but after RECOUNT_CALLS calls the size is measured again.

    Every rank alternates the fast path and the full path call by call, and
    starts on a different one: both must count every call, or the ranks
    would reopen at different calls and run different algorithms.
    """
    from ddlkernels.select import tuner as _tuner

    monkeypatch.setattr(_tuner, "RECOUNT_CALLS", 7)
    count = 4096 // 8
    x = rank_data(count, RANK, P, np.float64)
    inputs = gather_inputs(x)
    expect = np.sum(np.stack(inputs), axis=0)
    strided_x = strided(x)  # not contiguous: the full path
    with ddlkernels.Communicator(COMM) as dc:
        if P == 1:
            pytest.skip("one rank: nothing to choose between")
        lo, hi = dc.shard_range(count)
        shard = expect[lo:hi].copy()
        strided_shard = strided(shard)
        out = np.empty(count) if kind != "reduce_scatter" else np.empty(hi - lo)
        tuner = dc.selector.tuners[kind]
        seen = []
        for i in range(300):
            full_path = (RANK + i) % 2
            y = _call_by_path(dc, kind, full_path, x, strided_x, shard, strided_shard, out, count)
            if kind == "allreduce":
                assert_close(y, inputs, "sum", np.float64, f"call {i}")
            else:
                want = expect[lo:hi] if kind == "reduce_scatter" else expect
                assert np.allclose(y, want, rtol=1e-12, atol=0), f"call {i}"
            seen.append(dc.last_algorithm)
        assert tuner.reopens["recount"] >= 2, tuner.reopens  # 7, then 14, ... calls after each settling
        every = COMM.allgather(seen)
        assert all(s == every[0] for s in every), "every rank ran the same algorithm in every call"
    assert np.array_equal(x, rank_data(count, RANK, P, np.float64)), "input modified"


def _call_by_path(dc, kind, full_path, x, strided_x, shard, strided_shard, out, count):
    """One sum of ``kind``: on the full path (a strided input, which the fast paths leave to it) or on the
    fast one (contiguous, into a reused ``out``)."""
    if kind == "allreduce":
        return dc.allreduce(strided_x, "sum") if full_path else dc.allreduce(x, "sum", out=out)
    if kind == "reduce_scatter":
        return dc.reduce_scatter(strided_x, "sum") if full_path else dc.reduce_scatter(x, "sum", out=out)
    return dc.allgather(strided_shard, count=count) if full_path else dc.allgather(shard, count=count, out=out)


@pytest.mark.parametrize("mixed", [False, True], ids=["path-per-rank", "path-per-call"])
@pytest.mark.parametrize("kind", ["reduce_scatter", "allgather"])
def test_watched_reduce_scatter_and_allgather_are_measured_again_together(kind, mixed):
    """The same watch for the shard collectives: even ranks on the fast path, odd ranks on the full one.

    ``mixed``: each rank alternates the two paths call by call, so that on
    some rank the call that reopens the size takes the full path while its
    fast path still holds the settled choice (which it must then forget).
    """
    from ddlkernels.select.tuner import WATCH_FROM, Settled

    count = WATCH_FROM // 8
    x = rank_data(count, RANK, P, np.float64)
    inputs = gather_inputs(x)
    expect = np.sum(np.stack(inputs), axis=0)
    strided_x = strided(x)
    with ddlkernels.Communicator(COMM) as dc:
        if P == 1:
            pytest.skip("one rank: nothing to choose between")
        lo, hi = dc.shard_range(count)
        shard = x[lo:hi].copy()
        strided_shard = strided(shard)  # not contiguous: the full path
        full = np.empty(count)
        for r in range(P):
            full[slice(*dc.shard_range(count, rank=r))] = inputs[r][slice(*dc.shard_range(count, rank=r))]
        out = np.empty(hi - lo) if kind == "reduce_scatter" else np.empty(count)
        tuner = dc.selector.tuners[kind]
        made = [0]

        def calls(k):
            seen = []
            for i in range(k):
                full_path = (RANK + made[0]) % 2 if mixed else RANK % 2
                made[0] += 1
                y = _call_by_path(dc, kind, full_path, x, strided_x, shard, strided_shard, out, count)
                if kind == "reduce_scatter":
                    assert np.allclose(y, expect[lo:hi], rtol=1e-12, atol=0), f"call {i}"
                else:
                    assert np.array_equal(y, full), f"call {i}"
                seen.append(dc.last_algorithm)
            return seen

        seen = []
        while dc.tuning(x, collective=kind):
            seen += calls(1)
        n = len(seen)
        assert n and n == COMM.bcast(n)
        settled = [tuner.state(x.nbytes, dc.candidates(x, collective=kind))]
        assert isinstance(settled[0], Settled), settled
        settled[0].limit = 1e-9  # as if the machine had slowed down (alike on every rank)
        after = calls(settled[0].every - 1)
        # The watched size is served by the fast path, which times it -- unless the ring won (alike on every
        # rank): the fast paths serve MPI's call and the window only.
        if not mixed and RANK % 2 == 0 and settled[0].algorithm != "ring":
            plans = dc.selector.plans[kind]
            assert any(p and p.watch is not None for p in plans.values()), plans
        after += calls(1)  # the check: reopened on every rank
        assert len(set(after)) == 1, after
        assert dc.tuning(x, collective=kind)
        again = calls(n + 2)
        assert not dc.tuning(x, collective=kind) and len(set(again[:n])) > 1, again
        every = COMM.allgather(seen + after + again)
        assert all(s == every[0] for s in every), "every rank ran the same algorithm in every call"


def test_measured_choice_is_the_same_on_every_rank_and_always_correct():
    """small_bytes=None: trials go round MPI, the ring and (one node) shm and cma, then one agreed choice per size
    bucket."""
    from ddlkernels.select.tuner import MPI_BELOW, tuning_calls

    x = rank_data(MPI_BELOW // 8 * 4, RANK, P, np.float64)  # 4 x MPI_BELOW bytes: a tuned bucket
    inputs = gather_inputs(x)
    with ddlkernels.Communicator(COMM) as dc:
        assert dc.small_bytes is None
        cands = {"mpi", "ring"} | ({"shm", "cma"} & set(dc.algorithms.names))
        if P > 1:
            assert cands == set(dc.candidates(x))
        seen = []
        n = tuning_calls(x.nbytes, len(cands))  # calls until the choice is made
        for k in range(n + 3):
            assert dc.tuning(x) == (P > 1 and k < n), k
            y = dc.allreduce(x, "sum")
            assert_close(y, inputs, "sum", np.float64)
            seen.append(dc.last_algorithm)
        if P > 1:
            assert set(seen[:n]) == cands, seen
            assert len(set(seen[n:])) == 1, seen
        decided = COMM.allgather(seen)
        assert all(d == decided[0] for d in decided), "every rank ran the same algorithm in every call"
        tiny = dc.allreduce(rank_data(3, RANK, P, np.float64), "sum")
        assert dc.last_algorithm in (("mpi", "nbc", "shm") if P > 1 else ("ring",))
        assert tiny.shape == (3,)


@pytest.mark.parametrize("spec", ["type", "count", "count_displ", "count_displ4", "count_only", "typechar"])
def test_Allreduce_takes_mpi4py_buffer_specifications(spec):
    """``[buf, MPI.FLOAT]`` and its relatives reduce the elements they name, and only those."""
    n = 2 * P + 3
    x = rank_data(n, RANK, P, np.float32, salt=2)
    keep = x.copy()
    inputs = gather_inputs(x)
    want = np.sum(np.stack(inputs).astype(np.float64), axis=0)  # exact: multiples of 1/16
    recv = np.full(n, -1.0, np.float32)
    lo, cnt = {"count_displ": (2, P + 1), "count_displ4": (1, n - 1)}.get(spec, (0, n if spec != "count" else P + 1))
    send_spec, recv_spec = {
        "type": ([x, MPI.FLOAT], [recv, MPI.FLOAT]),
        "count": ([x, cnt, MPI.FLOAT], [recv, cnt, MPI.FLOAT]),
        "count_displ": ([x, (cnt, lo), MPI.FLOAT], [recv, (cnt, lo), MPI.FLOAT]),
        "count_displ4": ([x, cnt, lo, MPI.FLOAT], [recv, cnt, lo, MPI.FLOAT]),
        "count_only": ([x, cnt], [recv, cnt]),
        "typechar": ((x, "f"), (recv, "f")),
    }[spec]
    ddlkernels.Allreduce(send_spec, recv_spec, MPI.SUM)
    assert np.array_equal(x, keep), "input modified"
    assert np.array_equal(recv[lo:lo + cnt], want[lo:lo + cnt].astype(np.float32))
    assert np.all(recv[:lo] == -1) and np.all(recv[lo + cnt:] == -1), "elements outside the specification written"
    # In place, on a specification too.
    buf = x.copy()
    ddlkernels.Allreduce(MPI.IN_PLACE, [buf, (cnt, lo), MPI.FLOAT] if spec != "typechar" else [buf, "f"], MPI.SUM)
    lo2, cnt2 = (0, n) if spec == "typechar" else (lo, cnt)
    assert np.array_equal(buf[lo2:lo2 + cnt2], want[lo2:lo2 + cnt2].astype(np.float32))
    assert np.array_equal(buf[:lo2], keep[:lo2]) and np.array_equal(buf[lo2 + cnt2:], keep[lo2 + cnt2:])


def test_Allreduce_refuses_a_buffer_specification_that_does_not_match_before_any_message():
    """Every one of these is found by the rank alone, so each raises on every rank without communicating
    (a rank that went on would hang here)."""
    x = np.arange(6, dtype=np.float32)
    out = np.empty_like(x)
    with pytest.raises(TypeError, match=r"names datatype MPI_DOUBLE \(float64\) but the array holds float32"):
        ddlkernels.Allreduce([x, MPI.DOUBLE], [out, MPI.DOUBLE])
    with pytest.raises(TypeError, match=r"recvbuf: .*MPI_INT .*holds float32"):
        ddlkernels.Allreduce(x, [out, MPI.INT])
    with pytest.raises(TypeError, match="no 16-bit float datatype"):
        ddlkernels.Allreduce([np.zeros(6, np.float16), MPI.SHORT], [np.zeros(6, np.float16), MPI.SHORT])
    with pytest.raises(ValueError, match=r"elements \[4, 10\) asked for, but the buffer holds 6"):
        ddlkernels.Allreduce([x, (6, 4), MPI.FLOAT], out)
    with pytest.raises(ValueError, match="recvbuf holds 3 elements but sendbuf holds 6"):
        ddlkernels.Allreduce([x, MPI.FLOAT], [out, 3, MPI.FLOAT])
    with pytest.raises(TypeError, match="count of a buffer specification must be an int >= 0"):
        ddlkernels.Allreduce([x, -1, MPI.FLOAT], out)
    with pytest.raises(TypeError, match="2 to 4 items"):
        ddlkernels.Allreduce([x], out)
    with pytest.raises(ValueError, match="needs a C-contiguous buffer"):
        ddlkernels.Allreduce([x[::2], 2, MPI.FLOAT], out[:2])
    COMM.Barrier()
