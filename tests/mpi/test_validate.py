"""validate=True: a mismatch across ranks raises the same ValueError on every rank, and nobody hangs.

One rank (the last) passes a different argument; every rank must raise, the
message must be byte-for-byte the same on every rank and must name the
ranks and what each passed; afterwards a barrier proves nobody is left
inside a collective and a correct call proves the communicator still works.
With one rank there is nobody to disagree with: the mismatch tests skip, the
agreement itself still runs.
"""

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels
from ddlkernels.safety.validate import check_agreement
from helpers import assert_close, rank_data

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
ODD = P - 1
others = "rank 0" if P == 2 else f"ranks 0-{P - 2}"

needs_two = pytest.mark.skipif(P < 2, reason="needs 2 or more ranks to disagree")


def raised_everywhere(call, exc=ValueError):
    """Run ``call`` on every rank; return the message, checked to be the same on every rank."""
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    msgs = COMM.allgather(msg)
    assert all(m == msgs[0] for m in msgs), f"messages differ across ranks: {msgs}"
    COMM.Barrier()
    # The communicator is still consistent: a correct validated call works.
    x = rank_data(7, RANK, P, np.int64)
    y = ddlkernels.allreduce(x, validate=True)
    assert_close(y, COMM.allgather(x), "sum", np.int64)
    return msg


def arg(normal, odd):
    return odd if RANK == ODD else normal


@needs_two
@pytest.mark.parametrize("n0", [0, 10, 100_000])
def test_count_mismatch(n0):
    msg = raised_everywhere(lambda: ddlkernels.allreduce(np.ones(arg(n0, n0 + 1), np.float32), validate=True))
    assert msg == (
        f"ddlkernels.allreduce: ranks called with different arguments (count differ): "
        f"{others} passed count={n0}; rank {ODD} passed count={n0 + 1}"
    )


@needs_two
def test_dtype_mismatch():
    msg = raised_everywhere(
        lambda: ddlkernels.allreduce(np.ones(10, arg(np.float32, np.int32)), validate=True, dims=(P,))
    )
    assert msg.startswith("ddlkernels.allreduce: ranks called with different arguments (dtype differ): ")
    assert f"{others} passed dtype=float32; rank {ODD} passed dtype=int32" in msg


@needs_two
def test_dtype_mismatch_changes_the_chunk_too():
    # Same chunk_bytes, wider type: fewer elements per chunk, a different cut of every block.
    msg = raised_everywhere(
        lambda: ddlkernels.allreduce(np.ones(10, arg(np.float32, np.float64)), dims=(P,), chunk_bytes=4096,
                                     validate=True)
    )
    assert "(dtype, chunk differ)" in msg
    assert f"{others} passed dtype=float32, chunk=1024 elements; rank {ODD} passed dtype=float64, chunk=512" in msg


@needs_two
@pytest.mark.parametrize("odd_op", ["max", "avg", MPI.PROD])
def test_op_mismatch(odd_op):
    # dims=(P,): the ring for every op (dims=None would also differ in path: float max/min never take MPI's).
    msg = raised_everywhere(lambda: ddlkernels.allreduce(np.ones(10), arg("sum", odd_op), dims=(P,), validate=True))
    name = odd_op if isinstance(odd_op, str) else "prod"
    assert msg.endswith(f"(op differ): {others} passed op=sum; rank {ODD} passed op={name}")


@needs_two
def test_dims_mismatch():
    msg = raised_everywhere(lambda: ddlkernels.allreduce(np.ones(10), dims=arg(None, (P,)), validate=True))
    # Only the argument is named: the path (MPI for small dims=None calls) and
    # whether a chunk applies follow from it.
    assert "(dims differ)" in msg
    assert f"{others} passed dims=None" in msg and f"rank {ODD} passed dims=({P},)" in msg


@needs_two
def test_dims_mismatch_between_boxes():
    if P % 2:
        pytest.skip("needs an even rank count for a 2-D box")
    msg = raised_everywhere(
        lambda: ddlkernels.reduce_scatter(np.ones(10), dims=arg((P,), (2, P // 2)), validate=True)
    )
    assert msg.startswith("ddlkernels.reduce_scatter: ranks called with different arguments (dims differ): ")
    assert f"rank {ODD} passed dims=(2, {P // 2})" in msg


@needs_two
def test_different_collectives():
    def call():
        if RANK == ODD:
            ddlkernels.reduce_scatter(np.ones(10), dims=(P,), validate=True)
        else:
            ddlkernels.allreduce(np.ones(10), dims=(P,), validate=True)

    with pytest.raises(ValueError) as info:
        call()
    assert "collective differ" in str(info.value)
    assert f"rank {ODD} passed collective=reduce_scatter" in str(info.value)
    COMM.Barrier()


@needs_two
def test_several_fields_and_groups():
    # Rank 0 differs in count, the last rank in dtype: three groups.
    if P < 3:
        pytest.skip("needs 3 ranks for three groups")
    n = 11 if RANK == 0 else 10
    dt = np.float64 if RANK == ODD else np.float32
    msg = raised_everywhere(lambda: ddlkernels.allreduce(np.ones(n, dt), dims=(P,), validate=True))
    assert "(count, dtype, chunk differ)" in msg
    assert "rank 0 passed count=11, dtype=float32" in msg
    assert f"rank {ODD} passed count=10, dtype=float64" in msg


@needs_two
def test_allgather_and_Allreduce_validate():
    lo, hi = ddlkernels.shard_range(20, dims=(P,))
    shard = np.ones(hi - lo, arg(np.float32, np.float64))
    msg = raised_everywhere(lambda: ddlkernels.allgather(shard, dims=(P,), validate=True))
    assert msg.startswith("ddlkernels.allgather: ranks called with different arguments (dtype, chunk differ)")
    x = np.ones(arg(12, 13), np.int32)
    msg = raised_everywhere(lambda: ddlkernels.Allreduce(x, np.empty_like(x), MPI.SUM, validate=True))
    assert "(count differ)" in msg


@needs_two
def test_local_failure_on_one_rank_raises_everywhere():
    """A rank whose own checks fail still tells the others, who raise instead of waiting."""
    x = np.ones(10, arg(np.float32, np.int16))
    with pytest.raises((ValueError, TypeError)) as info:
        ddlkernels.allreduce(x, validate=True)
    if RANK == ODD:
        assert info.type is TypeError and "unsupported dtype int16" in str(info.value)
    else:
        assert info.type is ValueError
        assert str(info.value) == (
            f"ddlkernels.allreduce: rank {ODD} failed the local argument checks, so no rank started the "
            f"collective: rank {ODD}: TypeError: unsupported dtype int16; supported: "
            + ", ".join(ddlkernels._dtypes.dtype_name(d) for d in ddlkernels.SUPPORTED_DTYPES)
        )
    COMM.Barrier()


@needs_two
def test_local_failure_in_Allreduce_shape_check():
    recv = np.empty(arg(10, 9), np.float32)
    with pytest.raises(ValueError) as info:
        ddlkernels.Allreduce(np.ones(10, np.float32), recv, validate=True)
    expect = "recvbuf holds 9 elements" if RANK == ODD else f"rank {ODD} failed the local argument checks"
    assert expect in str(info.value)
    COMM.Barrier()


def test_agreement_passes_when_ranks_agree():
    for dims in [None, (P,)]:
        for dt in ddlkernels.SUPPORTED_DTYPES:
            check_agreement(COMM, kind="allreduce", count=5, dtype=dt, op="avg", dims=dims, chunk=3, path="ring")
    x = rank_data(1001, RANK, P, np.float64)
    inputs = COMM.allgather(x)
    for c in [ddlkernels.Communicator(validate=True), ddlkernels.Communicator(validate=True, timeout=60)]:
        assert_close(c.allreduce(x, "avg"), inputs, "avg", np.float64)
        assert_close(c.allreduce(x, dims=(P,), chunk_bytes=800), inputs, "sum", np.float64)
        lo, hi = c.shard_range(x.size, (P,))
        shard = c.reduce_scatter(x, dims=(P,))
        assert_close(shard, [a[lo:hi] for a in inputs], "sum", np.float64)
        whole = c.allgather(shard, dims=(P,))
        assert_close(whole, inputs, "sum", np.float64)
        c.free()


def test_environment_fallback(monkeypatch):
    monkeypatch.setenv("DDLKERNELS_VALIDATE", "1")
    c = ddlkernels.Communicator()
    monkeypatch.delenv("DDLKERNELS_VALIDATE")
    assert c.validate is True and ddlkernels.Communicator(validate=False).validate is False
    if P > 1:
        with pytest.raises(ValueError, match="count differ"):
            c.allreduce(np.ones(arg(3, 4)))
    c.free()


def test_bad_timeout_is_a_local_error():
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        ddlkernels.allreduce(np.ones(3), timeout=0)
    with pytest.raises(ValueError, match="timeout must be"):
        ddlkernels.Communicator(timeout="soon")
    COMM.Barrier()


@needs_two
@pytest.mark.parametrize("setting,normal,odd", [("small_bytes", None, 1 << 20), ("shm", None, False)])
def test_communicator_settings_that_choose_the_algorithm_are_named(setting, normal, odd):
    """small_bytes and shm choose the algorithm: ranks that differ in them are told so in those words, not as an
    algorithm ("path") that differs."""
    dc = ddlkernels.Communicator(COMM, validate=True, **{setting: arg(normal, odd)})
    msg = raised_everywhere(lambda: dc.allreduce(np.ones(10)))
    assert msg == (f"ddlkernels.allreduce: ranks called with different arguments ({setting} differ): "
                   f"{others} passed {setting}={normal}; rank {ODD} passed {setting}={odd}")
    dc.free()


@needs_two
def test_an_invalid_timeout_on_one_rank_is_announced():
    with pytest.raises(ValueError) as info:
        ddlkernels.allreduce(np.ones(10), validate=True, timeout=arg(None, -1))
    if RANK == ODD:
        assert str(info.value) == "timeout must be a number of seconds > 0 or None, got -1"
    else:
        assert str(info.value).startswith(f"ddlkernels.allreduce: rank {ODD} failed the local argument checks, so no "
                                          f"rank started the collective: rank {ODD}: ValueError: timeout must be")
    COMM.Barrier()


@needs_two
def test_no_memory_for_the_reduce_scatter_result_on_one_rank_is_announced(monkeypatch):
    """The result is allocated before the argument check, so a rank that cannot allocate it fails locally and
    the others raise instead of waiting in the collective."""
    from ddlkernels.backends._numpy import NumpyBackend

    n = 1000 * P + 1
    lo, hi = ddlkernels.shard_range(n, rank=ODD)
    empty = NumpyBackend.empty

    def no_memory(self, count, dtype):
        if count == hi - lo:
            raise MemoryError(f"cannot allocate {count} elements")
        return empty(self, count, dtype)

    if RANK == ODD:
        monkeypatch.setattr(NumpyBackend, "empty", no_memory)
    with pytest.raises((MemoryError, ValueError)) as info:
        ddlkernels.reduce_scatter(rank_data(n, RANK, P, np.float64), validate=True)
    if RANK == ODD:
        assert info.type is MemoryError
    else:
        assert f"rank {ODD} failed the local argument checks" in str(info.value)
        assert f"rank {ODD}: MemoryError: cannot allocate {hi - lo} elements" in str(info.value)
    COMM.Barrier()
