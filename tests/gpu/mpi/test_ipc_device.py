"""The CUDA IPC allreduce (ddlkernels.algorithms.ipc) on real device memory, every rank on the one GPU.

Every rank's CuPy arrays, CUDA torch tensors and Numba device arrays are read and written by its
peers through CUDA IPC handles; the result must be the rank-order fold
(``((x0 op x1) op x2) ...``, "avg" scaling in the last step) computed on the
host by the numpy backend, bit for bit, and the same on every rank.  Edge
sizes, every op and dtype, in and out of place, misaligned views, memory of
CuPy's asynchronous pool and torch's expandable segments (which legacy IPC
cannot export: the algorithm stages them), torch's caching allocator, the
tuner's choice among the ring, IPC and "host", "host" itself (pieces through
pinned memory), and nodes made up by node labels ("hier": IPC inside each,
the ring across).  Never the simulator (tests/gpu/gpu_env.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import gpu_env as G
from helpers import node_size, rank_order_fold
import ddlkernels
from ddlkernels._dtypes import BFLOAT16, SUPPORTED_DTYPES, dtype_name
from ddlkernels.algorithms.host import piece_cuts

pytestmark = [G.needs_device, pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="IPC needs 2 ranks or more")]
cp = G.cp
COMM = MPI.COMM_WORLD
P, R = COMM.Get_size(), COMM.Get_rank()
OPS = ("sum", "avg", "max", "min", "prod")
SIZES = sorted({1, 3, max(P - 1, 1), P + 1, 4097, 1000003})
CUPY_DTYPES = [d for d in SUPPORTED_DTYPES if d != BFLOAT16]
CALLS = G.CALLS


def data(n, dtype, salt=0):
    """Unique per rank and element, with rounding in every op (the fold's order shows in the bits)."""
    rng = np.random.default_rng([R, n, salt])
    dt = np.dtype(dtype)
    if dt.kind == "i":
        return rng.integers(-1000, 1000, n).astype(dt)
    return (1 + rng.uniform(-0.5, 0.5, n)).astype(dt)  # products neither overflow nor underflow


def check(got: np.ndarray, want: np.ndarray, what: str, same_everywhere=True):
    gb, wb = got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)
    assert np.array_equal(gb, wb), f"{what}: differs from what it should hold"
    if same_everywhere:
        assert len(set(COMM.allgather(gb.tobytes()))) == 1, f"{what}: ranks hold different bits"


@pytest.fixture(scope="module")
def comm():
    c = ddlkernels.Communicator(COMM, shm=False, cuda_aware=False, ipc=True)
    yield c
    c.free()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", CUPY_DTYPES, ids=[dtype_name(d) for d in CUPY_DTYPES])
def test_cupy_every_op_size_in_and_out_of_place(comm, dtype, op):
    """CuPy's default pool, aligned views and misaligned ones at an offset into their allocation: each exported
    where it lies, none staged (a stage costs a device copy in and out of every call)."""
    staged = comm.algorithms["ipc"].staged()
    for n in SIZES:
        x = data(n, dtype, salt=1)
        want = rank_order_fold(COMM.allgather(x), op)
        d = cp.asarray(x)
        got = comm.allreduce(d, op)
        assert comm.last_algorithm == "ipc"
        check(cp.asnumpy(got), want, f"n={n}")
        check(cp.asnumpy(d), x, f"n={n}: the input", same_everywhere=False)
        whole = cp.empty(n + 1, d.dtype)
        m = whole[1:]  # not on a 16-byte boundary, at an offset into its allocation
        m.set(x)
        comm.allreduce(m, op, out=m)
        check(cp.asnumpy(m), want, f"n={n} in place, misaligned")
        CALLS[0] += 2
    assert comm.algorithms["ipc"].staged() == staged, "CuPy's default pool memory went through a stage"


@pytest.mark.parametrize("op", OPS)
def test_reduce_scatter_and_allgather(comm, op):
    """reduce_scatter: this rank's shard of every rank's input folded in rank order; allgather: every rank's
    shard in place in every rank's output; CuPy arrays of every dtype, the edge sizes, with out= too."""
    for dtype in CUPY_DTYPES:
        for n in SIZES:
            x = data(n, dtype, salt=5)
            lo, hi = comm.shard_range(n)
            xs = COMM.allgather(x)
            want = rank_order_fold([v[lo:hi] for v in xs], op)
            d = cp.asarray(x)
            got = comm.reduce_scatter(d, op)
            assert comm.last_algorithm == "ipc"
            check(cp.asnumpy(got), want, f"reduce_scatter {dtype_name(dtype)} n={n}", same_everywhere=False)
            out = cp.empty(hi - lo, d.dtype)
            comm.reduce_scatter(d, op, out=out)
            check(cp.asnumpy(out), want, f"reduce_scatter out= n={n}", same_everywhere=False)
            check(cp.asnumpy(d), x, f"n={n}: the input", same_everywhere=False)
            whole = np.empty_like(x)  # every rank's shard where shard_range places it
            for q in range(P):
                a, b = comm.shard_range(n, rank=q)
                whole[a:b] = xs[q][a:b]
            got = comm.allgather(cp.asarray(x[lo:hi]), count=n)
            assert comm.last_algorithm == "ipc"
            check(cp.asnumpy(got), whole, f"allgather {dtype_name(dtype)} n={n}")
            CALLS[0] += 3


def test_memory_ipc_cannot_export_is_staged(comm):
    """Arrays from CuPy's stream-ordered pool (cudaMallocAsync: no legacy IPC handle) give the same bits."""
    x = data(300007, np.float32, salt=2)
    want = rank_order_fold(COMM.allgather(x), "sum")
    pool = cp.cuda.MemoryAsyncPool()
    with cp.cuda.using_allocator(pool.malloc):
        d = cp.asarray(x)
        out = cp.empty_like(d)
    staged = comm.algorithms["ipc"].staged()
    comm.allreduce(d, "sum", out=out)
    check(cp.asnumpy(out), want, "async-pool input and output")
    comm.allreduce(d, "sum", out=d)
    check(cp.asnumpy(d), want, "async-pool in place")
    CALLS[0] += 2
    # input and output, then the one buffer in place
    assert comm.algorithms["ipc"].staged() - staged == 3, "async-pool memory was not staged as counted"


@pytest.mark.parametrize("tdtype", ["float16", "bfloat16", "float32"])
def test_torch_tensors_on_a_stream_of_their_own(comm, tdtype):
    torch = G.torch_cuda()
    npdt = BFLOAT16 if tdtype == "bfloat16" else np.dtype(tdtype)
    s = torch.cuda.Stream()
    staged = comm.algorithms["ipc"].staged()
    for n in (P + 1, 1000003):
        x = data(n, npdt, salt=3)
        want = rank_order_fold(COMM.allgather(x), "avg")
        cpu = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if tdtype == "bfloat16" else torch.from_numpy(x)
        with torch.cuda.stream(s):
            t = cpu.to("cuda") * 1  # a kernel on s produces the input
            got = comm.allreduce(t, "avg")
            g = got.cpu()
        bits = (lambda v: v.view(torch.int16).numpy()) if tdtype == "bfloat16" else (lambda v: v.numpy())
        check(bits(g), want.view(np.int16) if tdtype == "bfloat16" else want, f"torch {tdtype} n={n}")
        CALLS[0] += 1
    assert comm.algorithms["ipc"].staged() == staged, "torch's caching allocator's memory went through a stage"


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=["float32", "bfloat16"])
def test_numba_arrays_through_cuda_ipc(comm, dtype):
    """Numba device arrays go to the CuPy backend and so over CUDA IPC, their memory through the algorithm's
    exportable stage (Numba gives an array's memory back to the driver soon after the array dies, which CUDA
    leaves undefined while a peer has it mapped); the result a Numba array; in place, one element into an
    allocation, and on a Numba stream of their own (an input a copy queued there writes, the result read
    there, no host synchronization between)."""
    cuda = G.numba_cuda()
    staged = comm.algorithms["ipc"].staged()
    for n in (P + 1, 1000003):
        x = data(n, dtype, salt=4)
        bits = x.view(np.uint16) if dtype == BFLOAT16 else x
        want = rank_order_fold(COMM.allgather(x), "sum")
        d = cuda.to_device(bits)
        d = d.view(BFLOAT16) if dtype == BFLOAT16 else d
        got = comm.allreduce(d, "sum")
        assert comm.last_algorithm == "ipc" and type(got) is type(d) and got.dtype == np.dtype(dtype)
        host = lambda v: (v.view(np.uint16) if dtype == BFLOAT16 else v).copy_to_host()  # noqa: E731
        check(host(got), want.view(bits.dtype), f"numba {dtype_name(dtype)} n={n}")
        comm.allreduce(d, "sum", out=d)
        check(host(d), want.view(bits.dtype), f"numba {dtype_name(dtype)} n={n} in place")
        whole = cuda.to_device(np.concatenate([bits[:1], bits]))
        m = whole[1:]  # one element into its allocation: not on a 16-byte boundary
        m = m.view(BFLOAT16) if dtype == BFLOAT16 else m
        comm.allreduce(m, "sum", out=m)
        check(host(m), want.view(bits.dtype), f"numba {dtype_name(dtype)} n={n} in place, misaligned")
        if dtype == np.float32:
            s = cuda.stream()
            src = cuda.to_device(x + x)
            e = cuda.device_array_like(src, stream=s)
            e.copy_to_device(src, stream=s)  # a device-to-device copy queued on s produces the input
            got = comm.allreduce(e, "sum", stream=s)
            h = got.copy_to_host(stream=s)
            s.synchronize()
            check(h, rank_order_fold(COMM.allgather(x + x), "sum"), f"numba on its stream n={n}")
        CALLS[0] += 4
    # Each call's Numba input (in place: its one buffer) through the stage; the new outputs are CuPy's.
    calls = 2 * (4 if dtype == np.float32 else 3)
    assert comm.algorithms["ipc"].staged() - staged == calls, "Numba's memory was exported, not staged"


def test_torch_expandable_segments_are_staged(comm):
    """torch's expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, common in training
    jobs) map memory with the driver's virtual memory API, which legacy CUDA IPC cannot export: each such
    tensor goes through the algorithm's stage, with the same bits."""
    torch = G.torch_cuda()
    settings = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if settings is None:
        pytest.skip(f"torch {torch.__version__} cannot switch to expandable segments at run time")
    x = data(300007, np.float32, salt=5)
    want = rank_order_fold(COMM.allgather(x), "sum")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no cached block of an ordinary segment left to serve the tensor below
    settings("expandable_segments:True")
    try:
        t = torch.from_numpy(x).to("cuda")
    finally:
        settings("expandable_segments:False")
    try:
        staged = comm.algorithms["ipc"].staged()
        got = comm.allreduce(t, "sum")  # the output comes from CuPy's pool: only the input is staged
        check(got.cpu().numpy(), want, "expandable-segment input")
        comm.allreduce(t, "sum", out=t)
        check(t.cpu().numpy(), want, "expandable-segment tensor in place")
        CALLS[0] += 2
        assert comm.last_algorithm == "ipc"
        assert comm.algorithms["ipc"].staged() - staged == 2, "expandable-segment memory was not staged as counted"
    finally:
        del t
        torch.cuda.empty_cache()  # the later tests' tensors come from ordinary segments again


def test_the_tuner_chooses_between_ring_ipc_and_host():
    """Integers: every candidate's order gives the fold's bits, so every trial is checked against it."""
    c = ddlkernels.Communicator(COMM, shm=False, cuda_aware=False)
    x = data(1 << 20, np.int32, salt=4)
    want = rank_order_fold(COMM.allgather(x), "sum")
    d = cp.asarray(x)
    assert c.candidates(d) == ("ring", "ipc", "host")
    seen = set()
    while c.tuning(d):
        check(cp.asnumpy(c.allreduce(d, "sum")), want, "during the trials")
        seen.add(c.last_algorithm)
        CALLS[0] += 1
    assert seen == {"ring", "ipc", "host"}
    sizes = c.decisions()["allreduce"]["device_sizes"]
    if R == 0:
        print(f"\ntuner, {P} ranks, 4 MiB int32 on the device: {sizes}")
    c.free()


@pytest.mark.parametrize("op", OPS)
def test_host_algorithm_piece_by_piece(op):
    """"host" (ddlkernels.algorithms.host) on device memory: pieces of up to 1 MiB (from 128 KiB at either
    end: ``piece_cuts``) through 3 pinned slots, each reduced by an inner Communicator fixed to the ring; its
    bits are the ring's on each piece of the host copy, on every rank, in and out of place, the input of an
    out-of-place call kept."""
    c = ddlkernels.Communicator(COMM, shm=False, cuda_aware=False, ipc=False)
    algo = c.algorithms["host"]
    algo.piece_bytes = 1 << 20
    ring = algo._inner = ddlkernels.Communicator(COMM, shm=False, small_bytes=0)
    for dtype in CUPY_DTYPES:
        per = algo.piece_bytes // np.dtype(dtype).itemsize
        for n in SIZES:
            x = data(n, dtype, salt=7)
            want = np.concatenate([ring.allreduce(x[a:b], op) for a, b in piece_cuts(n, per)])
            for inplace in (False, True):
                d = cp.asarray(x)
                c.settle(d, "host", op)
                got = c.allreduce(d, op, out=d if inplace else None)
                assert c.last_algorithm == "host"
                check(cp.asnumpy(got), want, f"host {dtype_name(dtype)} {op} n={n} inplace={inplace}")
                if not inplace:
                    check(cp.asnumpy(d), x, f"host {dtype_name(dtype)} {op} n={n}: the input", same_everywhere=False)
                CALLS[0] += 1
    c.free()


def test_host_algorithm_reduce_scatter_and_allgather():
    """"host" reduce_scatter and allgather on device memory: pieces of 1 MiB over the ranks through the
    pinned slots; integer sums and float max (the same bits in any order) equal the host's, each rank's
    shard in place; allgather bit for bit, into a new array and into a torch tensor's out=."""
    c = ddlkernels.Communicator(COMM, shm=False, cuda_aware=False, ipc=False)
    c.algorithms["host"].piece_bytes = 1 << 20
    for dtype, op in ((np.int32, "sum"), (np.int64, "sum"), (np.float32, "max"), (np.float16, "max")):
        for n in SIZES:
            x = data(n, dtype, salt=11)
            d = cp.asarray(x)
            lo, hi = c.shard_range(n)
            want = (sum(COMM.allgather(x.astype(np.int64))).astype(dtype) if op == "sum"
                    else np.maximum.reduce(COMM.allgather(x)))
            c.settle(d, "host", op, collective="reduce_scatter")
            got = c.reduce_scatter(d, op)
            assert c.last_algorithm == "host"
            check(cp.asnumpy(got), want[lo:hi], f"host reduce_scatter {dtype_name(dtype)} n={n}",
                  same_everywhere=False)
            check(cp.asnumpy(d), x, f"host reduce_scatter {dtype_name(dtype)} n={n}: the input",
                  same_everywhere=False)
            c.settle(d, "host", collective="allgather")
            whole = c.allgather(cp.asarray(want[lo:hi]), count=n)
            assert c.last_algorithm == "host"
            check(cp.asnumpy(whole), want, f"host allgather {dtype_name(dtype)} n={n}")
            CALLS[0] += 2
    torch = G.torch_cuda()
    n = 1000003
    lo, hi = c.shard_range(n)
    x = data(n, np.float32, salt=12)
    out = torch.full((n,), -1.0, device="cuda")
    c.settle(cp.asarray(x), "host", collective="allgather")
    c.allgather(torch.from_numpy(x[lo:hi]).cuda(), count=n, out=out)
    whole = np.concatenate([xq[slice(*c.shard_range(n, rank=q))] for q, xq in enumerate(COMM.allgather(x))])
    check(out.cpu().numpy(), whole, "host allgather into a torch tensor")
    CALLS[0] += 1
    c.free()


def test_close_peer_memory_then_the_pool_frees_its_blocks():
    """Every rank closes what it maps of its peers, then hands CuPy's pool back to the driver (cudaFree of
    memory no peer has open any more); new allocations are mapped afresh and reduce right."""
    c = ddlkernels.Communicator(COMM, shm=False, cuda_aware=False, ipc=True)
    gpus = COMM.allgather(cp.cuda.Device().pci_bus_id)
    # Who maps its peers' memory: every rank, or where GPUs serve several ranks, the lowest rank on each (it
    # folds its part for all of them, at any rank count: ddlkernels.algorithms.ipc).
    readers = range(P) if len(set(gpus)) == P else [gpus.index(g) for g in set(gpus)]
    for k in range(2):
        x = data(300007, np.float32, salt=20 + k)
        want = rank_order_fold(COMM.allgather(x), "sum")
        d = cp.asarray(x)
        check(cp.asnumpy(c.allreduce(d, "sum")), want, f"round {k}")
        assert (c.algorithms["ipc"].mapped(now=True) > 0) == (R in readers)
        c.close_peer_memory()
        assert c.algorithms["ipc"].mapped(now=True) == 0
        del d
        cp.get_default_memory_pool().free_all_blocks()
        CALLS[0] += 1
    c.free()


def test_ranks_sharing_the_gpu_leave_no_event_between_calls(comm):
    """Where ranks share a GPU, each IPC call ends with its stream run (cudaStreamQuery says so): no rank keeps
    an event for its next call to wait on, so the ranks that only wait queue nothing on the GPU."""
    if len(set(COMM.allgather(cp.cuda.Device().pci_bus_id))) == P:
        pytest.skip("every rank drives a GPU of its own: the two-shot schedule leaves its events to the next call")
    x = data(100003, np.float32, salt=40)
    want = rank_order_fold(COMM.allgather(x), "sum")
    for collective in ("allreduce", "reduce_scatter", "allgather"):
        d = cp.asarray(x)
        cp.cuda.get_current_stream().synchronize()  # the copy in has run: the call starts on an idle stream
        if collective == "allreduce":
            got, wanted = comm.allreduce(d, "sum"), want
        elif collective == "reduce_scatter":
            got, wanted = comm.reduce_scatter(d, "sum"), want[slice(*comm.shard_range(x.size))]
        else:
            got, wanted = comm.allgather(d[slice(*comm.shard_range(x.size))], count=x.size), \
                np.concatenate([xq[slice(*comm.shard_range(x.size, rank=q))] for q, xq in enumerate(COMM.allgather(x))])
        assert comm.last_algorithm == "ipc" and not comm._tails, (collective, comm._tails)
        check(cp.asnumpy(got), wanted, collective, same_everywhere=collective != "reduce_scatter")
    CALLS[0] += 1


#: ranks per made-up node: a divisor 2 <= k < P (4 ranks: 2 nodes of 2), else None (each rank a node)
K = node_size(P)


@pytest.mark.parametrize("op", ("sum", "avg", "max"))
def test_made_up_nodes_keep_cuda_ipc_inside_each(op):
    """Node labels on the one GPU: nodes of K ranks where P has such a divisor ("hier": CUDA IPC inside each
    node, the staged ring across), else a node per rank (the ring: IPC never crosses a label).  Every
    dtype CuPy holds, edge sizes, in and out of place; results against the numpy reference (hier's order
    is its own), the same bits on every rank, the input untouched."""
    from helpers import assert_close

    label = f"node {R // K}" if K else f"rank {R}"
    c = ddlkernels.Communicator(COMM, node=label, cuda_aware=False)
    for dtype in CUPY_DTYPES:
        if op == "avg" and np.dtype(dtype).itemsize == 2 and np.dtype(dtype).kind == "f":
            continue  # float16 avg scales before its one rounding: not a hierarchical candidate
        for n in SIZES:
            x = data(n, dtype, salt=30)
            inputs = COMM.allgather(x)
            d = cp.asarray(x)
            cands = c.candidates(d, op)
            assert "ipc" not in cands and ("hier" in cands) == bool(K), cands
            algo = "hier" if K else "ring"
            c.settle(d, algo, op)
            got = c.allreduce(d, op)
            assert c.last_algorithm == algo
            what = f"{algo} {dtype_name(dtype)} {op} n={n}"
            y = cp.asnumpy(got)
            assert_close(y, inputs, op, dtype, what)
            assert len(set(COMM.allgather(y.tobytes()))) == 1, f"{what}: ranks hold different bits"
            check(cp.asnumpy(d), x, f"{what}: the input", same_everywhere=False)
            c.allreduce(d, op, out=d)
            check(cp.asnumpy(d), y, f"{what}: in place")
            CALLS[0] += 2
    c.free()
