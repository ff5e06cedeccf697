"""The "host" device algorithm (ddlkernels.algorithms.host) on the stream emulator's device.

Device buffers go down to pinned memory piece by piece, the host's allreduce
reduces each piece there, and the pieces go back up; the emulator runs every
copy late, in random legal orders (tests/stream_emulator.py), so a piece read
before it is down, a slot overwritten before it is up, or a result read
before it is back shows as wrong bits.  The removal of each of these waits is
caught in tests/mpi/test_stream_emulator.py.  Nothing here is CUDA's:
tests/gpu/run_on_device.sh times the algorithm on a device.
"""

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels
from ddlkernels._dtypes import SUPPORTED_DTYPES, dtype_name
from ddlkernels.algorithms.host import piece_cuts
from ddlkernels.select.tuner import tuning_calls
from helpers import rank_data
from stream_emulator import emulated_device

COMM = MPI.COMM_WORLD
P, R = COMM.Get_size(), COMM.Get_rank()
pytestmark = pytest.mark.skipif(P < 2, reason="one rank has nothing to reduce")
SIZES = sorted({1, max(P - 1, 1), P + 1, 13, 4099})
OPS = ("sum", "avg", "prod", "max", "min")
PIECE = 48  # bytes: 3 to 24 elements a piece, so that a call reuses its 3 pinned slots


def same_bits(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def wrong_anywhere(bad: int) -> int:
    return COMM.allreduce(bad, op=MPI.SUM)


def host_on_ring(c):
    """``c``'s "host" algorithm with PIECE-byte pieces, its inner Communicator the ring alone (small_bytes=0),
    so that its bits are known: the ring's on each piece."""
    algo = c.algorithms["host"]
    algo.piece_bytes = PIECE
    algo._inner = ddlkernels.Communicator(COMM, shm=False, small_bytes=0)
    return algo._inner


def piecewise(ring, x, op):
    """What "host" promises: every piece (``piece_cuts``, tested in tests/test_piece_cuts.py) reduced on its own
    by the inner Communicator."""
    cuts = piece_cuts(x.size, PIECE // x.dtype.itemsize)
    return np.concatenate([ring.allreduce(x[a:b], op) for a, b in cuts]) if x.size else x.copy()


@pytest.mark.sweep
@pytest.mark.parametrize("policy", ["lazy", "random"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=dtype_name)
def test_every_dtype_op_size_bitwise_in_and_out_of_place(dtype, op, policy):
    """The inner allreduce's bits piece by piece, on every rank, for 1, p - 1, p + 1, a prime and many pieces,
    in and out of place, on a caller stream that is not the default; the output's old contents written on
    that stream just before the call, the input overwritten just after it; an out-of-place input kept."""
    bad = []
    with emulated_device(seed=17 * R + len(op), policy=policy) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=False)
        ring = host_on_ring(c)
        with be.current(be.new_stream()):
            for n in SIZES:
                x = rank_data(n, R, P, dtype, salt=n)
                want = piecewise(ring, x, op)
                for inplace in (False, True):
                    d = be.to_device(x)
                    out = d if inplace else be.to_device(np.zeros_like(x))
                    if not inplace:
                        be.write(out, x[::-1].copy())  # a late write the result must come after
                    c.settle(d, "host", op)
                    got = c.allreduce(d, op, out=out)
                    assert c.last_algorithm == "host"
                    if not inplace:
                        kept = be.to_host(d)
                        bad += [] if same_bits(kept, x) else [f"n={n}: input modified"]
                        be.write(d, np.zeros_like(x))
                    if not same_bits(be.to_host(got), want):
                        bad.append(f"n={n} {'in place' if inplace else 'out of place'}")
        c.free()
    assert wrong_anywhere(len(bad)) == 0, f"rank {R}: {bad}"


@pytest.mark.parametrize("policy", ["lazy", "random"])
def test_slots_are_reused_across_calls_and_grow(policy):
    """Back-to-back calls on one stream, results read only at the end: a call's first pieces go down into
    slots whose last copies up belong to the previous call; a larger piece later gets larger slots, while
    the last call's copies up from the old ones may still be queued (the emulator's pinned pool hands their
    memory to the next request at once, as CuPy's does)."""
    bad = 0
    with emulated_device(seed=5 + R, policy=policy) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=False)
        ring = host_on_ring(c)
        pending = []
        for k, n in enumerate((40, 7, 301, 40)):
            x = rank_data(n, R, P, np.float32, salt=k)
            d = be.to_device(x)
            c.settle(d, "host")
            pending.append((c.allreduce(d, "sum"), piecewise(ring, x, "sum")))
        c.algorithms["host"].piece_bytes = 4 * PIECE
        x = rank_data(500, R, P, np.float64, salt=9)
        d = be.to_device(x)
        c.settle(d, "host")
        got = c.allreduce(d, "max")
        bad += not same_bits(be.to_host(got), ring.allreduce(x, "max"))  # max: the same bits in any cut
        bad += sum(not same_bits(be.to_host(o), w) for o, w in pending)
        c.free()
    assert wrong_anywhere(bad) == 0


def test_calls_of_a_piece_or_more_keep_their_slots():
    """Pinning memory is slow: every call of a whole piece or more takes slots of a whole piece, whatever
    its ramp's middle pieces (here 4 elements at 13, 12 at 97), so no later call frees and pins them again."""
    with emulated_device(seed=3 + R, policy="lazy") as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=False)
        ring = host_on_ring(c)
        algo, held, bad = c.algorithms["host"], [], 0
        for k, n in enumerate((13, 25, 40, 97)):  # float32: pieces of at most 12
            x = rank_data(n, R, P, np.float32, salt=k)
            d = be.to_device(x)
            c.settle(d, "host")
            bad += not same_bits(be.to_host(c.allreduce(d, "sum")), piecewise(ring, x, "sum"))
            held.append(list(algo._copies.values()))
        c.free()
    assert wrong_anywhere(bad) == 0
    assert len(held[0]) == 1 and all(h == held[0] for h in held), held


def test_a_tuner_candidate_for_device_arrays():
    """``host`` is measured beside the ring (and "ipc" where the backend offers it) for device allreduce and
    never for host arrays; the trials compute right results and the size settles alike on every rank."""
    x = rank_data(3000, R, P, np.int64, salt=4)
    want = sum(COMM.allgather(x))
    with emulated_device(seed=R, policy="random", ipc=True) as be:
        c = ddlkernels.Communicator(COMM, shm=False)
        d = be.to_device(x)
        assert c.candidates(d) == ("ring", "ipc", "host")
        assert "host" not in c.candidates(x)
        assert ddlkernels.Communicator(COMM, shm=False, ipc=False).candidates(d) == ("ring", "host")
        assert ddlkernels.Communicator(COMM, shm=False, small_bytes=0).candidates(d) == ("ring",)
        seen = []
        for k in range(tuning_calls(x.nbytes, 3) + 2):
            assert np.array_equal(be.to_host(c.allreduce(d, "sum")), want), k
            seen.append(c.last_algorithm)
        assert "host" in seen and not c.tuning(d)
        sizes = c.decisions()["allreduce"]["device_sizes"]
        assert COMM.allgather(sizes) == [sizes] * P
        c.free()


def test_under_a_deadline_and_validation():
    """``timeout=`` and ``validate=True``: the inner allreduces get what is left of the call's deadline."""
    with emulated_device(seed=R, policy="lazy") as be:
        c = ddlkernels.Communicator(COMM, shm=False, validate=True, timeout=60)
        c.algorithms["host"].piece_bytes = PIECE
        x = rank_data(999, R, P, np.int32, salt=2)
        d = be.to_device(x)
        c.settle(d, "host", "max")
        got = c.allreduce(d, "max")
        assert c.last_algorithm == "host" and np.array_equal(be.to_host(got), np.maximum.reduce(COMM.allgather(x)))
        c.free()


def test_the_inner_tuner_settles_before_the_pieces_are_reduced():
    """The first call of a size lets the inner Communicator's tuner finish its trials for the piece sizes
    (here 6 and 2 float64, where it weighs MPI's blocking and nonblocking calls), so that the outer tuner's
    trials of "host" time settled inner calls."""
    with emulated_device(seed=2 + R, policy="random") as be:
        c = ddlkernels.Communicator(COMM, shm=False)
        algo = c.algorithms["host"]
        algo.piece_bytes = PIECE
        x = rank_data(20, R, P, np.int64, salt=6)
        d = be.to_device(x)
        c.settle(d, "host")
        assert c.tuning(d)  # settled, but its first call runs the inner tuner's trials
        got = c.allreduce(d, "sum")
        assert same_bits(be.to_host(got), sum(COMM.allgather(x)))
        assert all(len(algo._inner.candidates(np.zeros(k, np.int64))) > 1 for k in (6, 2))
        assert not any(algo._inner.tuning(np.zeros(k, np.int64)) for k in (6, 2))
        assert not c.tuning(d)
        c.free()


@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter", "allgather"])
def test_tuning_ends_after_one_call_of_a_settled_shape_empty_ones_too(kind):
    """``tuning`` stays True for a size settled on "host" until one call of the shape has run (its inner
    trials), then is False on every rank, for every collective, an empty call included (it returns before any
    inner call): a benchmark's ``while tuning(x)`` loop ends."""
    with emulated_device(seed=4 + R, policy="random") as be:
        c = ddlkernels.Communicator(COMM, shm=False)
        c.algorithms["host"].piece_bytes = PIECE
        for n in (0, 7, 2 * P + 9):  # three shapes, none seen before
            d = be.to_device(rank_data(n, R, P, np.float64, salt=n))
            c.settle(d, "host", collective=kind)
            calls = 0
            while c.tuning(d, collective=kind) and calls < 5:
                if kind == "allgather":
                    lo, hi = c.shard_range(n)
                    c.allgather(d[lo:hi], count=n)
                else:
                    getattr(c, kind)(d, "sum")
                assert c.last_algorithm == "host"
                calls += 1
            assert COMM.allgather(calls) == [1] * P, (kind, n)
        c.free()


@pytest.mark.parametrize("policy", ["lazy", "random"])
def test_empty_calls_odd_offsets_nan_and_subnormals(policy):
    """0 elements; views 1 and 3 elements into their allocations (pieces at odd addresses); NaN and
    subnormal values, whose bits the copies down and up must keep (max: the inner ring's bits)."""
    bad = []
    with emulated_device(seed=9 + R, policy=policy) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=False)
        ring = host_on_ring(c)
        e = be.to_device(np.zeros(0, np.float32))
        c.settle(be.to_device(np.zeros(1, np.float32)), "host")
        bad += [] if be.to_host(c.allreduce(e, "sum")).shape == (0,) else ["n=0"]
        for dtype in (np.float32, np.float64, np.float16):
            n = 101
            x = rank_data(n, R, P, dtype, salt=5)
            x[R::7] = np.nan
            x[(R + 3)::11] = np.finfo(dtype).smallest_subnormal * (R + 1)
            whole = be.to_device(np.zeros(n + 4, dtype))
            d = whole[1 + 2 * (R % 2): 1 + 2 * (R % 2) + n]
            be.write(d, x)
            out = be.to_device(np.zeros(n + 3, dtype))[3:]
            c.settle(d, "host", "max")
            c.allreduce(d, "max", out=out)
            if not same_bits(be.to_host(out), piecewise(ring, x, "max")):
                bad.append(f"{np.dtype(dtype).name} max")
        c.free()
    assert wrong_anywhere(len(bad)) == 0, f"rank {R}: {bad}"


# -- reduce_scatter and allgather: pieces of every rank's shard ------------------------------------------


def piecewise_reduce_scatter(ring, x, op):
    """This rank's shard as "host" reduces it, for a whole buffer ``x``: the longest shard cut (``piece_cuts``
    of PIECE bytes over the ranks); piece ``[a, b)`` takes those elements of every rank's shard, each at its
    rank's shard of the piece's ``P (b - a)`` for the inner ring (zeros where a shard is short), and is
    reduce_scattered on its own."""
    bounds = [ring.shard_range(x.size, rank=q) for q in range(P)]
    lo, hi = bounds[R]
    out = np.empty(hi - lo, x.dtype)
    for a, b in piece_cuts(max(last - first for first, last in bounds), PIECE // (x.dtype.itemsize * P)):
        s = b - a
        piece = np.zeros(P * s, x.dtype)
        for q, (first, last) in enumerate(bounds):
            m = max(0, min(b, last - first) - a)
            at = ring.shard_range(P * s, rank=q)[0]
            piece[at:at + m] = x[first + a:first + a + m]
        got = ring.reduce_scatter(piece, op)
        m = max(0, min(b, hi - lo) - a)
        out[a:a + m] = got[:m]
    return out


@pytest.mark.sweep
@pytest.mark.parametrize("policy", ["lazy", "random"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=dtype_name)
def test_reduce_scatter_every_dtype_op_size_bitwise(dtype, op, policy):
    """The inner reduce_scatter's bits piece by piece for 1, p - 1, p + 1, a prime and many pieces (shards of
    unequal lengths, some empty), into a new shard and into an out= whose old contents were written on the
    caller's stream just before; the input unchanged, then overwritten just after the call."""
    bad = []
    with emulated_device(seed=23 * R + len(op), policy=policy) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=False)
        ring = host_on_ring(c)
        with be.current(be.new_stream()):
            for n in sorted({1, max(P - 1, 1), P + 1, 13, 331}):
                x = rank_data(n, R, P, dtype, salt=n)
                want = piecewise_reduce_scatter(ring, x, op)
                for given in (False, True):
                    d = be.to_device(x)
                    c.settle(d, "host", op, collective="reduce_scatter")
                    out = None
                    if given:
                        out = be.to_device(np.zeros(want.size, x.dtype))
                        be.write(out, np.full(want.size, 3, x.dtype))
                    got = c.reduce_scatter(d, op, out=out)
                    assert c.last_algorithm == "host"
                    bad += [] if same_bits(be.to_host(d), x) else [f"n={n}: input modified"]
                    be.write(d, np.zeros_like(x))
                    if not same_bits(be.to_host(got), want):
                        bad.append(f"n={n}{' out=' if given else ''}")
        c.free()
    assert wrong_anywhere(len(bad)) == 0, f"rank {R}: {bad}"


@pytest.mark.sweep
@pytest.mark.parametrize("policy", ["lazy", "random"])
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=dtype_name)
def test_allgather_every_dtype_size_bitwise(dtype, policy):
    """Every rank's shard in its place, bit for bit (NaN and subnormals among them), for 1, p - 1, p + 1, a
    prime and many pieces, into a new buffer and into an out= written just before the call."""
    bad = []
    with emulated_device(seed=29 * R, policy=policy) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=False)
        ring = host_on_ring(c)
        with be.current(be.new_stream()):
            for n in sorted({1, max(P - 1, 1), P + 1, 13, 331}):
                lo, hi = ring.shard_range(n)
                mine = rank_data(hi - lo, R, P, dtype, salt=n)
                if mine.dtype.kind == "f" and mine.size > 2:  # numpy's floats (bfloat16 is ml_dtypes')
                    mine[1], mine[2] = np.nan, np.finfo(mine.dtype).smallest_subnormal
                want = np.concatenate(COMM.allgather(mine))
                for given in (False, True):
                    d = be.to_device(mine)
                    c.settle(be.to_device(np.zeros(n, mine.dtype)), "host", collective="allgather")
                    out = None
                    if given:
                        out = be.to_device(np.zeros(n, mine.dtype))
                        be.write(out, np.full(n, 5, mine.dtype))
                    got = c.allgather(d, count=n, out=out)
                    assert c.last_algorithm == "host"
                    be.write(d, np.zeros_like(mine))
                    if not same_bits(be.to_host(got), want):
                        bad.append(f"n={n}{' out=' if given else ''}")
        c.free()
    assert wrong_anywhere(len(bad)) == 0, f"rank {R}: {bad}"


def test_sharded_candidates_empty_calls_and_slots_shared_with_allreduce():
    """"host" is a tuner candidate for device reduce_scatter and allgather too, and its trials compute right
    results; 0 elements; back-to-back calls of the three kinds, read only at the end, share the slots."""
    with emulated_device(seed=31 + R, policy="random") as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=False)
        x = rank_data(600, R, P, np.int64, salt=8)
        d = be.to_device(x)
        for kind in ("reduce_scatter", "allgather"):
            assert c.candidates(d, collective=kind) == ("ring", "host")
        total = sum(COMM.allgather(x))
        lo, hi = c.shard_range(x.size)
        for k in range(tuning_calls(x.nbytes, 2) + 2):
            assert np.array_equal(be.to_host(c.reduce_scatter(d, "sum")), total[lo:hi]), k
        assert not c.tuning(d, collective="reduce_scatter")
        ring = host_on_ring(c)
        e = be.to_device(np.zeros(0, np.float32))
        c.settle(be.to_device(np.zeros(0, np.float32)), "host", collective="reduce_scatter")
        assert be.to_host(c.reduce_scatter(e, "sum")).shape == (0,)
        pending = []
        for k, n in enumerate((40, 7, 301)):
            y = rank_data(n, R, P, np.float32, salt=k)
            dy = be.to_device(y)
            for kind in ("allreduce", "reduce_scatter"):
                c.settle(dy, "host", collective=kind)
            pending.append((c.allreduce(dy, "sum"), piecewise(ring, y, "sum")))
            pending.append((c.reduce_scatter(dy, "max"), piecewise_reduce_scatter(ring, y, "max")))
            a, b = c.shard_range(n)
            c.settle(dy, "host", collective="allgather")
            pending.append((c.allgather(be.to_device(y[a:b]), count=n), np.concatenate(
                [yq[slice(*c.shard_range(n, rank=q))] for q, yq in enumerate(COMM.allgather(y))])))
        bad = sum(not same_bits(be.to_host(o), want) for o, want in pending)
        c.free()
    assert wrong_anywhere(bad) == 0
