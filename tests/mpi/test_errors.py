"""Bad input: a clear exception on every rank before any communication.

Every rank passes the same bad argument here, so every rank must raise
locally; if any rank entered a collective instead, the others would raise
and it would hang, which MPIEXEC_TIMEOUT turns into a failed run.
"""

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels

COMM = MPI.COMM_WORLD
P = COMM.Get_size()


def good(n=10, dtype=np.float32):
    return np.zeros(n, dtype=dtype)


@pytest.mark.parametrize(
    "call,exc,msg",
    [
        (lambda: ddlkernels.allreduce(good(dtype=np.complex64)), TypeError, "unsupported dtype complex64"),
        (lambda: ddlkernels.allreduce(good(dtype=np.int16)), TypeError, "unsupported dtype int16"),
        (lambda: ddlkernels.allreduce(good(dtype=np.bool_)), TypeError, "unsupported dtype bool"),
        (lambda: ddlkernels.allreduce(good().astype(">f4")), TypeError, "little-endian"),
        (lambda: ddlkernels.allreduce(good(), "mean"), ValueError, "unknown op 'mean'"),
        (lambda: ddlkernels.allreduce(good(), MPI.LAND), ValueError, "unsupported op"),
        (lambda: ddlkernels.allreduce(good(), out=np.empty(11, np.float32)), ValueError, "out has shape"),
        (lambda: ddlkernels.allreduce(good(), out=np.empty(10, np.float64)), TypeError, "out has dtype float64"),
        (lambda: ddlkernels.allreduce(good(), dims=(P + 1,)), ValueError, f"describe {P + 1} ranks"),
        (lambda: ddlkernels.allreduce(good(), dims=(0,)), ValueError, "positive"),
        (lambda: ddlkernels.allreduce(good(), chunk_bytes=0), ValueError, "chunk_bytes must be a positive int"),
        (lambda: ddlkernels.allreduce([1.0, 2.0]), TypeError, "cannot reduce an object of type builtins.list"),
        (lambda: ddlkernels.allreduce(good(), comm="world"), TypeError, "comm must be"),
        (lambda: ddlkernels.Allreduce(good(), np.empty(3, np.float32)), ValueError, "recvbuf holds 3 elements"),
        (lambda: ddlkernels.Allreduce(good(), np.empty(10, np.int32)), TypeError, "out has dtype int32"),
        (lambda: ddlkernels.reduce_scatter(good(), "median"), ValueError, "unknown op"),
        (lambda: ddlkernels.reduce_scatter(good(dtype=np.uint8)), TypeError, "unsupported dtype uint8"),
        (lambda: ddlkernels.allgather(good(dtype=np.float128) if hasattr(np, "float128") else good(dtype=np.complex128)), TypeError, "unsupported dtype"),
        (lambda: ddlkernels.shard_range(10, dims=(P, 2)), ValueError, "ranks but the communicator"),
        (lambda: ddlkernels.Communicator(COMM, window=0), ValueError, "window must be a positive int"),
    ],
)
def test_bad_input_raises_locally(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()
    # Everyone raised and nobody is stuck in a collective: a barrier completes.
    COMM.Barrier()


def test_out_of_place_never_modifies_input_even_on_error():
    x = good(1000)
    keep = x.copy()
    with pytest.raises(ValueError):
        ddlkernels.allreduce(x, out=np.empty(5, np.float32))
    assert np.array_equal(x, keep)


def test_mismatched_shard_lengths_raise_on_every_rank():
    # Every rank learns every length in allgather, so all raise together.
    n = 5 if COMM.Get_rank() == 0 else 3
    if P == 1:
        pytest.skip("needs 2 or more ranks to disagree")
    with pytest.raises(ValueError, match="shard lengths do not match"):
        ddlkernels.allgather(np.zeros(n, np.float32))
    COMM.Barrier()


def test_a_with_block_frees_on_a_normal_exit_only():
    """Leaving ``with Communicator(...)`` by an exception does not free: the free is collective, and a rank
    whose block raised alone would wait in it for peers still making calls inside theirs."""
    with pytest.raises(RuntimeError, match="leaves the block"):
        with ddlkernels.Communicator(MPI.COMM_WORLD) as dc:
            raise RuntimeError("every rank leaves the block by an exception")
    assert dc.comm is not None  # not freed
    dc.free()  # collective: every rank is here
    with ddlkernels.Communicator(MPI.COMM_WORLD) as dc2:
        pass
    assert dc2.comm is None


def _overlapping(n, how):
    """``(x, out)`` that share memory in way ``how``; x holds rank-unique data."""
    buf = np.arange(2 * n + 2, dtype=np.float32) * P + COMM.Get_rank()
    return {"shifted": (buf[:n], buf[n // 2 : n // 2 + n]), "same memory, another view": (buf[:n], buf[:n].reshape(n)),
            "strided x under out": (buf[0 : 2 * n : 2], buf[n - 1 : 2 * n - 1])}[how]


@pytest.mark.parametrize("how", ["shifted", "same memory, another view", "strided x under out"])
@pytest.mark.parametrize("n", [1, 1000, 1 << 18], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("settled", [False, True], ids=["first call", "settled size"])
def test_out_overlapping_the_input_raises_before_communicating(how, n, settled):
    """Writing such an out changes the input, and peers that read my x where it lies (cma, shared inputs) or MPI
    itself would read results instead: every path once wrote garbage here.  ``settled``: the size's tuner has
    decided (its fast path, which must hand the call to the full path's check)."""
    dc = ddlkernels.Communicator(COMM)
    if settled:
        a, b = np.ones(n, np.float32), np.empty(n, np.float32)
        for _ in range(60):
            dc.allreduce(a, out=b)
    x, out = _overlapping(n, how)
    keep = x.copy()
    with pytest.raises(ValueError, match="out overlaps the input"):
        dc.allreduce(x, out=out)
    with pytest.raises(ValueError, match="out overlaps the input"):
        dc.Allreduce(x, out, MPI.SUM)
    assert np.array_equal(x, keep)
    COMM.Barrier()  # nobody entered a collective
    dc.free()


@pytest.mark.parametrize("n", [1, 1000, 1 << 18], ids=lambda n: f"n{n}")
def test_views_that_share_no_element_are_not_an_overlap(n):
    """x and out interleaved in one buffer: their spans overlap, their elements do not."""
    dc = ddlkernels.Communicator(COMM)
    for _ in range(40):  # through the trials and then the settled size
        # Unique per rank and element to 4099 apart, and small enough that every sum is exact in float32 at any
        # rank count (2^18 elements times P outgrew float32's 24 bits at 7 ranks).
        buf = (np.arange(2 * n) % 4099).astype(np.float32) * P + COMM.Get_rank()
        x, out = buf[0::2], buf[1::2]
        keep = x.copy()
        dc.allreduce(x, out=out)
        want = sum(keep - COMM.Get_rank() + r for r in range(P))
        assert np.array_equal(out, want), dc.last_algorithm
        assert np.array_equal(x, keep)
    dc.free()


@pytest.mark.parametrize("n", [1, 1000, 1 << 18], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("settled", [False, True], ids=["first call", "settled size"])
def test_read_only_out_raises_before_communicating(n, settled):
    dc = ddlkernels.Communicator(COMM)
    x = np.ones(n, np.float32)
    if settled:
        b = np.empty(n, np.float32)
        for _ in range(60):
            dc.allreduce(x, out=b)
            dc.allreduce(b, out=b)
    ro = np.zeros(n, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        dc.allreduce(x, out=ro)
    with pytest.raises(ValueError, match="x is read-only, and out=x reduces in place"):
        dc.allreduce(ro, out=ro)
    with pytest.raises(ValueError, match="read-only"):
        dc.Allreduce(MPI.IN_PLACE, ro, MPI.SUM)
    assert not ro.any()
    COMM.Barrier()
    dc.free()
