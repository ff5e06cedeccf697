"""allreduce_many and the asynchronous handles, under any rank count.

Bitwise equality with per-tensor ``allreduce`` holds whenever every partial
sum is exact, whatever the reduction order (see ddlkernels/fusion.py); the
data here are small multiples of 1/4, exact in every float type for up to 8
ranks, and differ per rank and per element so a misplaced slice fails.
"""

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels
from ddlkernels import fusion
from ddlkernels.collectives.allreduce import allreduce_segments
from ddlkernels.fusion import plan_buckets
from ddlkernels.backends import get_backend
from ddlkernels.ring.segments import Segments
from helpers import ALL_DTYPES, assert_close, assert_same_on_all_ranks, dims_cases, parts_with_gaps

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
EDGE = [0, 1, max(P - 1, 1), P + 1, 7, 13, 4099]


def exact_data(n, rank, dtype, salt=0):
    """Multiples of 1/4 in [-4, 4] (integers: distinct per element and rank); sums of <= 8 ranks are exact."""
    dt = np.dtype(dtype)
    i = np.arange(n, dtype=np.int64)
    key = (i * 8 + rank) * 37 + salt * 101
    if dt.kind in "iu":
        return (key % 1999 - 999).astype(dt)
    return ((key % 33) - 16).astype(np.float64).__truediv__(4).astype(dt)


def sizes_10B_to_4MB(count=200, itemsize=4):
    """``count`` sizes in elements, log-spaced from 10 bytes to 4 MB, in a fixed shuffled order."""
    nbytes = np.geomspace(10, 4e6, count)
    order = np.random.default_rng(7).permutation(count)
    return [max(1, int(b) // itemsize) for b in nbytes[order]]


def per_tensor(tensors, op):
    return [ddlkernels.allreduce(t, op) for t in tensors]


def raw(a):
    """The bytes of ``a`` (any shape, 0-d included)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def assert_bitwise(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: tensor {i} {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        assert np.array_equal(raw(g), raw(w)), f"{what}: tensor {i} differs from allreduce"


def test_200_tensors_10B_to_4MB_equal_per_tensor_allreduce(op="sum"):
    sizes = sizes_10B_to_4MB()
    xs = [exact_data(n, RANK, np.float32, salt=k) for k, n in enumerate(sizes)]
    keep = [x.copy() for x in xs]
    got = ddlkernels.allreduce_many(xs, op, fusion_bytes=8 << 20)
    for x, k in zip(xs, keep):
        assert np.array_equal(x, k), "input modified"
    assert_bitwise(got, per_tensor(xs, op), f"200 tensors {op}")
    assert_same_on_all_ranks(COMM, np.concatenate(got), "200 tensors")
    # Spot-check against the exact reference (the per-tensor path is tested elsewhere).
    for k in (0, int(np.argmax(sizes))):
        assert_close(got[k], COMM.allgather(xs[k]), op, np.float32, f"tensor {k}")


@pytest.mark.sweep
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod"])
@pytest.mark.parametrize("fusion_bytes", [16, 100, 4096, 1 << 26])
def test_mixed_dtypes_and_shapes_every_op(op, fusion_bytes):
    dtypes = [d for d in ALL_DTYPES if op != "prod" or d.itemsize >= 4]  # half-type products round
    xs = []
    for k, n in enumerate(EDGE * 2):
        dt = dtypes[k % len(dtypes)]
        x = exact_data(n, RANK, dt, salt=k)
        xs.append(x.reshape(1, n, 1) if k % 3 == 0 else x)
    xs.append(exact_data(6, RANK, np.float64, salt=99).reshape(2, 3)[:, ::2])  # non-contiguous
    xs.append(np.array(exact_data(1, RANK, np.float32)[0]))  # 0-d
    keep = [x.copy() for x in xs]
    got = ddlkernels.allreduce_many(xs, op, fusion_bytes=fusion_bytes)
    want = per_tensor([x.copy() for x in xs], op)
    assert_bitwise(got, want, f"{op} fusion_bytes={fusion_bytes}")
    for x, k, g in zip(xs, keep, got):
        assert np.array_equal(raw(x), raw(k)), "input modified"
        assert_close(g, COMM.allgather(x), op, x.dtype, f"{op} {x.dtype}{x.shape}")
    # In place gives the same bits, into the very same arrays.
    inplace = [x.copy() for x in xs]
    res = ddlkernels.allreduce_many(inplace, op, out=inplace, fusion_bytes=fusion_bytes)
    assert all(r is x for r, x in zip(res, inplace))
    assert_bitwise(inplace, want, f"{op} in place")
    assert_same_on_all_ranks(COMM, np.concatenate([raw(g) for g in got]), op)


@pytest.mark.parametrize("dims", dims_cases(P), ids=str)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "prod"])
@pytest.mark.parametrize("chunk_bytes", [12, 40, 1 << 20])
def test_segments_ring_equals_ring_of_the_packed_buffer(dims, op, chunk_bytes):
    # Parts with gaps and empty ones, chunks that start and end inside parts
    # and gaps: the ring reading the parts in place must give the packed
    # buffer's bits, on every box (the first reduce-scatter is the one that reads them).
    parts, packed = parts_with_gaps(lambda n, k: exact_data(n, RANK, np.float32, salt=k))
    count = packed.size
    keep = [a.copy() for _, a in parts]
    c = ddlkernels.Communicator(COMM, small_bytes=0)  # the ring, never MPI's allreduce
    want = c.allreduce(packed, op, dims=dims, chunk_bytes=chunk_bytes)
    got = np.full(count, np.nan, np.float32)
    allreduce_segments(c, Segments(count, np.float32, parts), got, op, dims=dims, chunk_bytes=chunk_bytes)
    # Padding positions are never read back; every part's elements must match.
    for off, a in parts:
        assert np.array_equal(raw(got[off : off + a.size]), raw(want[off : off + a.size])), (dims, op, off)
    assert all(np.array_equal(a, k) for (_, a), k in zip(parts, keep)), "input modified"
    assert_same_on_all_ranks(COMM, got, f"segments {op}")
    c.free()


def test_torch_cpu_tensors_including_bfloat16():
    torch = pytest.importorskip("torch", reason="torch not installed (pip install -e .[torch])")
    ts = [torch.from_numpy(exact_data(n, RANK, np.float32, salt=n)) for n in (1, 5, 300)]
    ts.append(torch.from_numpy(exact_data(33, RANK, np.float32)).to(torch.bfloat16))
    ts.append(torch.from_numpy(exact_data(17, RANK, np.int64)))
    got = ddlkernels.allreduce_many(ts, "sum", fusion_bytes=64)
    want = [ddlkernels.allreduce(t, "sum") for t in ts]
    for g, w in zip(got, want):
        assert isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)
    ddlkernels.allreduce_many(ts, "sum", out=ts)
    assert all(torch.equal(t, w) for t, w in zip(ts, want))


def test_one_collective_per_bucket_and_pack_buffer_reused(monkeypatch):
    c = ddlkernels.Communicator(COMM, small_bytes=0)  # every bucket through the ring
    xs = [exact_data(n, RANK, np.float32, salt=n) for n in (3, 5, 20, 2, 9)]
    buckets = plan_buckets([(x.shape, x.dtype) for x in xs], 64)
    assert [[e.index for e in b.entries] for b in buckets] == [[0, 1], [2], [3, 4]]
    assert [b.direct for b in buckets] == [False, False, False]  # set by FusionJob, not the planner
    calls = []
    orig, orig_seg = c.allreduce, fusion.allreduce_segments

    def counting(x, *a, **k):
        calls.append(x)
        return orig(x, *a, **k)

    def counting_segments(comm, segs, out, *a, **k):
        calls.append(out)
        return orig_seg(comm, segs, out, *a, **k)

    c.allreduce = counting
    monkeypatch.setattr(fusion, "allreduce_segments", counting_segments)
    got = ddlkernels.allreduce_many(xs, comm=c, fusion_bytes=64)
    # Buckets of 16 float32 at most: [x0 @0, pad, x1 @4] = 9, x2 alone (no copy), [x3 @0, pad, x4 @4] = 13.
    assert [a.shape[0] for a in calls] == [9, 20, 13]
    assert calls[1] is xs[2]
    # New outputs of a packed bucket are views of the buffer that was reduced: no copy back.
    assert np.shares_memory(got[0], calls[0]) and np.shares_memory(got[4], calls[2])
    # In place, the packing goes through the Communicator's reusable buffer, the same one every call.
    ys = [x.copy() for x in xs]
    calls.clear()
    ddlkernels.allreduce_many(ys, comm=c, out=ys, fusion_bytes=64)
    assert_bitwise(ys, got, "in place vs new outputs")
    kept = c.reusable_buffer("fusion", get_backend("numpy"), np.float32, 1)
    assert np.shares_memory(calls[0], kept) and np.shares_memory(calls[2], kept)
    calls.clear()
    ddlkernels.allreduce_many(ys, comm=c, out=ys, fusion_bytes=64)
    assert np.shares_memory(calls[0], kept), "the pack buffer was not reused"
    c.free()


def test_bad_input_raises_before_communicating():
    torch = pytest.importorskip("torch", reason="torch not installed (pip install -e .[torch])")
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"one device.*tensor 0 is on cpu and tensor 1 on meta"):
        ddlkernels.allreduce_many([a, torch.zeros(3, device="meta")])
    with pytest.raises(TypeError, match="tensor 1: unsupported dtype complex64"):
        ddlkernels.allreduce_many([a, np.zeros(2, np.complex64)])
    with pytest.raises(TypeError, match="tensor 0: ddlkernels cannot reduce an object of type builtins.list"):
        ddlkernels.allreduce_many([[1.0]])
    with pytest.raises(ValueError, match="out holds 1 arrays but tensors holds 2"):
        ddlkernels.allreduce_many([a, a], out=[a])
    with pytest.raises(ValueError, match=r"out\[0\] overlaps tensor 0"):
        ddlkernels.allreduce_many([a], out=[a[::-1]])
    with pytest.raises(ValueError, match="fusion_bytes must be a positive int"):
        ddlkernels.allreduce_many([a], fusion_bytes=0)
    with pytest.raises(ValueError, match="unknown op"):
        ddlkernels.allreduce_many([a], "mean")
    COMM.Barrier()


@pytest.mark.parametrize("kind", ["count", "shape", "dtype", "op"])
def test_different_lists_on_different_ranks_raise_on_every_rank(kind):
    if P == 1:
        pytest.skip("needs 2 or more ranks to disagree")
    xs = [np.zeros(5, np.float32), np.zeros(7, np.float32)]
    op = "sum"
    if RANK == P - 1:
        if kind == "count":
            xs.append(np.zeros(1, np.float32))
        elif kind == "shape":
            xs[1] = np.zeros(8, np.float32)
        elif kind == "dtype":
            xs[1] = np.zeros(7, np.float64)
        else:
            op = "max"
    with pytest.raises(ValueError, match="ranks passed different arguments"):
        ddlkernels.allreduce_many(xs, op)
    with pytest.raises(ValueError, match="ranks passed different arguments"):
        ddlkernels.allreduce_many_async(xs, op).wait()
    COMM.Barrier()


@pytest.mark.parametrize("progress", ["thread", "hooks"])
def test_async_equals_sync_and_overlaps_local_work(progress):
    dts = [np.float32, np.float64, np.int32, np.int64] if progress == "hooks" else ALL_DTYPES
    xs = [exact_data(n, RANK, dts[k % len(dts)], salt=k) for k, n in enumerate(EDGE + [70000])]
    want = ddlkernels.allreduce_many(xs, "avg", fusion_bytes=4096)
    snapshot = [x.copy() for x in xs]
    h1 = ddlkernels.allreduce_many_async(xs, "avg", fusion_bytes=4096, progress=progress)
    h2 = ddlkernels.allreduce_async(xs[-1], "max", progress=progress)
    for x in xs:
        if x.nbytes <= 4096:
            x += 1  # packed inputs may change once the call returned (larger ones are read in place)
    local = sum(float(np.sum(x)) for x in xs)  # work done while the reductions run
    got = h1.wait()
    assert h1.done() and h1.wait() is got
    assert_bitwise(got, want, f"async {progress}")
    assert np.array_equal(h2.wait(), ddlkernels.allreduce(snapshot[-1], "max"))
    assert np.isfinite(local)
    assert_same_on_all_ranks(COMM, np.concatenate([raw(g) for g in got]), progress)


def test_hooks_progress_refuses_half_types_locally():
    with pytest.raises(TypeError, match="MPI_Iallreduce, which cannot reduce float16"):
        ddlkernels.allreduce_many_async([np.zeros(3, np.float16)], progress="hooks")
    with pytest.raises(ValueError, match="progress must be one of thread, hooks"):
        ddlkernels.allreduce_many_async([np.zeros(3)], progress="poll")
    COMM.Barrier()


def test_handle_started_on_one_rank_only_times_out_instead_of_hanging():
    if P == 1:
        pytest.skip("needs 2 or more ranks to disagree")
    c = ddlkernels.Communicator(COMM, timeout=1.0)
    x = exact_data(1000, RANK, np.float32)
    ddlkernels.allreduce_async(x, comm=c).wait()  # every rank: creates the progress thread (collective)
    if RANK == 0:
        h = ddlkernels.allreduce_many_async([x, x[:10]], comm=c)
        with pytest.raises(ddlkernels.CollectiveTimeout):
            h.wait()
        with pytest.raises(ddlkernels.CollectiveTimeout):
            h.wait()  # the same error again, not a hang
    COMM.Barrier()


def test_new_outputs_are_never_overwritten_while_alive_and_their_memory_is_reused_after():
    # The pool of result buffers is per process: start it empty, so that free
    # buffers left by earlier tests (which ones depends on the rank count and
    # the test order) cannot be the one handed out below.
    from ddlkernels import fusion as _fusion

    _fusion._HOMES.clear()
    xs = [exact_data(n, RANK, np.float32, salt=n) for n in (3, 5, 20, 2, 9)]
    first = ddlkernels.allreduce_many(xs, fusion_bytes=64)
    keep = [f.copy() for f in first]
    ys = [x * 2 for x in xs]
    for _ in range(3):  # later calls with other data must not touch live results
        second = ddlkernels.allreduce_many(ys, fusion_bytes=64)
    assert_bitwise(first, keep, "results of an earlier call changed")
    assert not any(np.shares_memory(a, b) for a in first for b in second)
    address = first[0].__array_interface__["data"][0]  # an int: holds no reference to the buffer
    del first, keep
    third = ddlkernels.allreduce_many(ys, fusion_bytes=64)
    assert third[0].__array_interface__["data"][0] == address, "a free result buffer was not reused"
    assert_bitwise(third, second, "reused buffer")
