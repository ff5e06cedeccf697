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
    """What "host" promises: every piece reduced on its own by the inner Communicator."""
    per = max(1, PIECE // x.dtype.itemsize)
    return np.concatenate([ring.allreduce(x[a:a + per], op) for a in range(0, x.size, per)]) if x.size else x.copy()


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


def test_slots_are_reused_across_calls_and_grow():
    """Back-to-back calls on one stream, results read only at the end: a call's first pieces go down into
    slots whose last copies up belong to the previous call; a larger piece later gets larger slots."""
    bad = 0
    with emulated_device(seed=5 + R, policy="random") as be:
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
        got = c.allreduce(d, "sum")
        assert same_bits(be.to_host(got), sum(COMM.allgather(x)))
        assert all(len(algo._inner.candidates(np.zeros(k, np.int64))) > 1 for k in (6, 2))
        assert not any(algo._inner.tuning(np.zeros(k, np.int64)) for k in (6, 2))
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
