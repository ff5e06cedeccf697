"""The collectives on real device memory, under ``mpirun -n 2, 3, 4`` with every rank on the one GPU.

CuPy arrays, Numba arrays (routed to the CuPy backend, and on the Numba
kernels by ``backend="numba"``; bfloat16 made the way a numba-cuda user must) and
CUDA torch tensors (on torch's default stream and on a stream of their own)
are reduced by the staged transport (PyPI's MPI is not CUDA-aware) and must
equal, bit for bit, the host ring of the same Communicator -- the same ring,
the same chunks, so the same operations in the same order -- and be the same
on every rank.  Every op, edge sizes, every box, in and out of place,
misaligned buffers, two chunk sizes (one so small that every ring step
reuses its receive slots many times: the race an H100 showed at 4 ranks).

Never the simulator (tests/gpu/gpu_env.py): without a device every test skips.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from mpi4py import MPI

import gpu_env as G
import ddlkernels
from ddlkernels._dtypes import BFLOAT16, SUPPORTED_DTYPES, dtype_name
from ddlkernels.backends import backend_for
from ddlkernels.backends._detect import has_module

pytestmark = G.needs_device
cp = G.cp
COMM = MPI.COMM_WORLD
P, R = COMM.Get_size(), COMM.Get_rank()
OPS = ("sum", "avg", "max", "min", "prod")
SIZES = sorted({0, 1, 3, 5, max(P - 1, 0), P + 1, 4097, 1000003})
BOXES = [None, (P,)] + ([(2, P // 2)] if P % 2 == 0 and P > 2 else [])
CALLS = G.CALLS  # device collectives this rank made (tests/gpu/mpi/conftest.py prints the total)


def data(n, dtype, salt=0, op="sum"):
    """Unique per rank and element; multiples of 1/16 (exact in every float type), products kept finite."""
    dt = np.dtype(dtype)
    key = np.arange(n, dtype=np.int64) * P + R + 7919 * salt
    if dt.kind == "i":
        return (key * 2654435761 % 100003 - 50001).astype(dt)
    v = ((key * 37) % 251 - 125) / 16.0
    if op == "prod":
        v = np.sign(v) * (1.0 + np.abs(v) / 64.0)
    return v.astype(dt)


def same_everywhere(bits: np.ndarray) -> bool:
    crc = zlib.crc32(bits.tobytes())
    return len(set(COMM.allgather(crc))) == 1


def assert_bitwise(got: np.ndarray, ref: np.ndarray, what: str, same=True):
    """``got`` is ``ref`` bit for bit; with ``same`` (results every rank holds alike; not inputs or shards)
    every rank holds these bits (collective)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, f"{what}: {got.dtype}{got.shape} vs {ref.dtype}{ref.shape}"
    size = max(ref.dtype.itemsize, 1)
    gb, rb = got.reshape(-1).view(np.uint8), ref.reshape(-1).view(np.uint8)
    if not np.array_equal(gb, rb):
        bad = np.flatnonzero((gb != rb).reshape(-1, size).any(axis=1))
        pytest.fail(f"{what}: device result differs from the host ring at elements {bad[:5]} ({bad.size} in all)")
    if same:
        assert same_everywhere(gb), f"{what}: ranks hold different bits"


@pytest.fixture(scope="module", params=["chunk-1MiB", "chunk-64B"])
def comm(request):
    # ipc=False: the ring alone (test_ipc_device.py checks the CUDA IPC allreduce).
    if request.param == "chunk-64B":
        c = ddlkernels.Communicator(COMM, chunk_bytes=64, window=2, small_bytes=0, shm=False, cuda_aware=False,
                                    ipc=False)
    else:
        c = ddlkernels.Communicator(COMM, small_bytes=0, shm=False, cuda_aware=False, ipc=False)
    yield c
    c.free()


def sizes_for(comm):
    """Every edge size for 1 MiB chunks; with 64-byte chunks (a block of 37 elements is already several
    chunks, so every step reuses its two receive slots) the small ones."""
    return sorted({n for n in SIZES if n <= 37} | {37}) if comm.chunk_bytes < 4096 else SIZES


# -- CuPy arrays ----------------------------------------------------------------------------------------

def cupy_array(host, misaligned):
    """``host`` on the device; misaligned: one element into an allocation (not on a 16-byte boundary)."""
    s = host.view(np.uint16) if host.dtype == BFLOAT16 else host
    if misaligned:
        buf = cp.empty(s.size + 1, s.dtype)
        d = buf[1:]
        d.set(s)
        return d
    return cp.asarray(s)


def cupy_host(d, dtype):
    return cp.asnumpy(d).view(dtype)


#: CuPy has no bfloat16 arrays: bfloat16 device data is covered through torch and Numba.
CUPY_DTYPES = [d for d in SUPPORTED_DTYPES if d != BFLOAT16]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", CUPY_DTYPES, ids=[dtype_name(d) for d in CUPY_DTYPES])
def test_cupy_allreduce(comm, dtype, op):
    for n in sizes_for(comm):
        for dims in BOXES:
            x = data(n, dtype, salt=n, op=op)
            host = comm.allreduce(x, op, dims=dims)
            d = cupy_array(x, misaligned=False)
            got = comm.allreduce(d, op, dims=dims)
            assert_bitwise(cupy_host(got, dtype), host, f"cupy n={n} dims={dims}")
            assert_bitwise(cupy_host(d, dtype), x, f"cupy n={n} dims={dims}: the input", same=False)
            m = cupy_array(x, misaligned=True)
            comm.allreduce(m, op, out=m, dims=dims)  # in place, on a misaligned view
            assert_bitwise(cupy_host(m, dtype), host, f"cupy in place misaligned n={n} dims={dims}")
            o = cp.empty_like(d)
            comm.allreduce(d, op, out=o, dims=dims)
            assert_bitwise(cupy_host(o, dtype), host, f"cupy out= n={n} dims={dims}")
            CALLS[0] += 3


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", CUPY_DTYPES, ids=[dtype_name(d) for d in CUPY_DTYPES])
def test_cupy_reduce_scatter_and_allgather(comm, dtype, op):
    for n in sizes_for(comm):
        x = data(n, dtype, salt=3 * n, op=op)
        shard = comm.reduce_scatter(cupy_array(x, False), op)
        host_shard = comm.reduce_scatter(x, op)
        assert_bitwise(cupy_host(shard, dtype), host_shard, f"reduce_scatter n={n}", same=False)
        whole = comm.allgather(shard, count=n)
        assert_bitwise(cupy_host(whole, dtype), comm.allgather(host_shard, count=n), f"allgather n={n}")
        CALLS[0] += 2


def test_cupy_on_a_stream_of_its_own(comm):
    """Input produced on a non-default CuPy stream, the call inside its context, the result read there."""
    s = cp.cuda.Stream()  # a blocking stream: while it captures, the legacy stream may not be used
    for n in (P + 1, 4097):
        x = data(n, np.float32, salt=5)
        with s:
            d = cp.asarray(x) * 2  # a kernel on s produces the input
            got = comm.allreduce(d, "sum")
            h = cp.asnumpy(got)  # copies on s after the call's work
        assert_bitwise(h, comm.allreduce(x * 2, "sum"), f"stream n={n}")
        CALLS[0] += 1


# -- Numba arrays ----------------------------------------------------------------------------------------

def numba_array(host):
    cuda = G.numba_cuda()
    if host.dtype == BFLOAT16:  # numba-cuda cannot copy ml_dtypes arrays: copy the bits, view them
        return cuda.to_device(host.view(np.uint16)).view(BFLOAT16)
    return cuda.to_device(host)


def numba_host(d):
    if d.dtype == BFLOAT16:
        return d.view(np.uint16).copy_to_host().view(BFLOAT16)
    return d.copy_to_host()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=[dtype_name(d) for d in SUPPORTED_DTYPES])
@pytest.mark.parametrize("backend", [None, "numba"], ids=["routed", "numba-kernels"])
def test_numba_allreduce(comm, dtype, op, backend):
    """Numba arrays: where CuPy is installed they go to the CuPy backend (its kernels, CUDA IPC), and
    ``backend="numba"`` keeps them on the Numba kernels; the result a Numba array either way."""
    cuda = G.numba_cuda()
    routed = backend_for(numba_array(np.zeros(1, np.float32)), backend).name
    assert routed == (backend or ("cupy" if has_module("cupy") else "numba"))
    for n in [m for m in sizes_for(comm) if m <= 4097]:
        for dims in BOXES:
            x = data(n, dtype, salt=7 * n, op=op)
            host = comm.allreduce(x, op, dims=dims)
            d = numba_array(x)
            got = comm.allreduce(d, op, dims=dims, backend=backend)
            assert type(got) is type(d)
            assert_bitwise(numba_host(got), host, f"numba n={n} dims={dims} on {routed}")
            comm.allreduce(d, op, out=d, dims=dims, backend=backend)
            assert_bitwise(numba_host(d), host, f"numba in place n={n} dims={dims} on {routed}")
            s = cuda.stream()
            d2 = numba_array(x)
            got = comm.allreduce(d2, op, dims=dims, stream=s, backend=backend)
            s.synchronize()
            assert_bitwise(numba_host(got), host, f"numba stream= n={n} dims={dims} on {routed}")
            CALLS[0] += 3


# -- torch CUDA tensors ----------------------------------------------------------------------------------

TORCH_DTYPES = ("float16", "bfloat16", "float32")


@pytest.mark.parametrize("on", ["default-stream", "own-stream"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("tdtype", TORCH_DTYPES)
def test_torch_allreduce(comm, tdtype, op, on):
    torch = G.torch_cuda()
    tdt = getattr(torch, tdtype)
    npdt = BFLOAT16 if tdtype == "bfloat16" else np.dtype(tdtype)
    s = torch.cuda.Stream() if on == "own-stream" else torch.cuda.current_stream()
    for n in [m for m in sizes_for(comm) if m <= 100003]:
        x = data(n, npdt, salt=11 * n, op=op)
        cpu = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if tdtype == "bfloat16" else torch.from_numpy(x)
        host = comm.allreduce(cpu, op)
        with torch.cuda.stream(s):
            t = cpu.to("cuda", non_blocking=False) * 1  # a kernel on s produces the input
            got = comm.allreduce(t, op)
            comm.allreduce(t, op, out=t)
            g, ti = got.cpu(), t.cpu()  # copies on s, after the calls
        assert got.dtype == tdt and got.device.type == "cuda"
        hb = host.view(torch.int16).numpy() if tdtype == "bfloat16" else host.numpy()
        view = (lambda v: v.view(torch.int16).numpy()) if tdtype == "bfloat16" else (lambda v: v.numpy())
        assert_bitwise(view(g), hb, f"torch {tdtype} n={n} on {on}")
        assert_bitwise(view(ti), hb, f"torch {tdtype} in place n={n} on {on}")
        CALLS[0] += 2


def test_torch_allreduce_many_and_async(comm):
    torch = G.torch_cuda()
    shapes = [(3,), (2, 5), (1,), (700,), (4, 3)]
    hosts = [torch.from_numpy(data(int(np.prod(sh)), np.float32, salt=i)).reshape(sh) for i, sh in enumerate(shapes)]
    refs = [comm.allreduce(h, "avg") for h in hosts]
    outs = ddlkernels.allreduce_many([h.cuda() for h in hosts], "avg", comm=comm, fusion_bytes=256)
    h = ddlkernels.allreduce_many_async([h.cuda() for h in hosts], "avg", comm=comm, fusion_bytes=256)
    later = h.wait()
    for o, l, r in zip(outs, later, refs):
        # Fused buckets add elements in another order than the single allreduce (ddlkernels.fusion): the data
        # are exact multiples of 1/16, so the sums are exact and the bits equal anyway.
        assert torch.equal(o.cpu(), r) and torch.equal(l.cpu(), r)
    # Started on a stream of its own and waited for there (wait(stream=)): the current stream is not ordered,
    # the copies back run on that stream after the results.
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        ins = [h.cuda() * 1 for h in hosts]  # kernels on s produce the inputs
    on_s = ddlkernels.allreduce_many_async(ins, "avg", comm=comm, fusion_bytes=256, stream=s).wait(stream=s)
    with torch.cuda.stream(s):
        got = [o.cpu() for o in on_s]
    assert all(torch.equal(g, r) for g, r in zip(got, refs))
    CALLS[0] += 3 * len(shapes)


def test_distributed_optimizer_on_a_cuda_model(comm):
    """Every step: parameters bitwise equal on every rank, and close to SGD with the rank-averaged gradient."""
    torch = G.torch_cuda()
    import ddlkernels.torch as ddt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)).cuda()
    ref.load_state_dict(model.state_dict())
    opt = ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), comm=comm, fusion_bytes=512)
    for step in range(5):
        g = torch.Generator().manual_seed(100 * step + R)
        x, y = torch.randn(6, 8, generator=g).cuda(), torch.randint(0, 3, (6,), generator=g).cuda()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        ref.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        with torch.no_grad():  # the reference: each gradient averaged on the host, then plain SGD
            for p in ref.parameters():
                avg = comm.allreduce(p.grad.cpu(), "avg")
                p -= 0.05 * avg.cuda()
        bits = np.concatenate([p.detach().cpu().numpy().reshape(-1).view(np.uint8) for p in model.parameters()])
        assert same_everywhere(bits), f"step {step}: parameters differ between ranks"
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"step {step}: {float((p - q).abs().max())}"
        CALLS[0] += 3


def test_torch_bfloat16_through_packed_buffers_shards_and_the_optimizer(comm):
    """bfloat16 lives on the device as uint16 bits (CuPy has none): allreduce_many's and the progress thread's
    packed buffers, the DDP hook's allreduce_async and the optimizer's buckets must reduce it as bfloat16, and
    reduce_scatter / allgather hand back CUDA bfloat16 tensors.  The same bits as on host tensors (small
    integers: a sum over the ranks is exact in bfloat16 in any order, fused or not, sharded or not)."""
    torch = G.torch_cuda()
    import ddlkernels.torch as ddt

    def bf16(n, salt):
        key = np.arange(n, dtype=np.int64) * P + R + 7919 * salt
        return torch.from_numpy(((key * 37) % 7 - 3).astype(np.float32)).to(torch.bfloat16)

    hosts = [bf16(n, salt=i) for i, n in enumerate((3, 10, 1, 700, 2 * P + 1))]
    refs = [comm.allreduce(h, "sum") for h in hosts]
    outs = ddlkernels.allreduce_many([h.cuda() for h in hosts], "sum", comm=comm, fusion_bytes=256)
    later = ddlkernels.allreduce_many_async([h.cuda() for h in hosts], "sum", comm=comm, fusion_bytes=256).wait()
    hooked = [ddlkernels.allreduce_async(t, "sum", comm=comm, out=t).wait() for t in [h.cuda() for h in hosts]]
    for o, l, k, r in zip(outs, later, hooked, refs):
        for got in (o, l, k):
            assert got.dtype == torch.bfloat16 and got.is_cuda
            assert torch.equal(got.cpu().view(torch.int16), r.view(torch.int16))
    for h in hosts:
        shard = comm.reduce_scatter(h.cuda(), "sum")
        whole = comm.allgather(shard, count=h.numel())
        assert isinstance(shard, torch.Tensor) and shard.is_cuda and shard.dtype == torch.bfloat16
        assert isinstance(whole, torch.Tensor) and whole.is_cuda and whole.dtype == torch.bfloat16
        assert torch.equal(whole.cpu().view(torch.int16), comm.allreduce(h, "sum").view(torch.int16))
    for overlap in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)).cuda().bfloat16()
        plain = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)).cuda().bfloat16()
        plain.load_state_dict(model.state_dict())  # the same model without the optimizer's hooks: local gradients
        opt = ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(), comm=comm, fusion_bytes=512,
                                       overlap=overlap)
        g = torch.Generator().manual_seed(R + 10 * overlap)
        x = torch.randn(6, 8, generator=g).cuda().bfloat16()
        for m in (model, plain):
            m.zero_grad()
            m(x).float().square().sum().backward()
        opt.synchronize()
        for p, q in zip(model.parameters(), plain.parameters()):
            bits = p.grad.cpu().view(torch.int16).numpy().view(np.uint8)
            assert same_everywhere(bits), f"overlap={overlap}: reduced gradients differ between ranks"
            want = comm.allreduce(q.grad.cpu().float(), "avg")
            assert torch.allclose(p.grad.cpu().float(), want, rtol=2**-6, atol=2**-6), overlap
    CALLS[0] += 5 * len(hosts) + 4


def test_a_call_inside_a_cuda_graph_capture_is_refused(comm):
    """A stream capturing a CUDA graph would record the call's copies and kernels for replays that send no
    message: CuPy's capture, torch's, and Numba's default (legacy) stream while another stream captures are
    refused with RuntimeError before any message; the same calls after the capture give the host path's
    results (no rank was left with a message in flight)."""
    torch = G.torch_cuda()
    cuda = G.numba_cuda()
    x = data(4097, np.float32, salt=13)
    want = comm.allreduce(x, "sum")
    d, t, nd = cp.asarray(x), torch.from_numpy(x).cuda(), cuda.to_device(x)
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream()  # a blocking stream: while it captures, the legacy stream may not be used
    for name, call, match in (
            ("cupy", lambda: comm.allreduce(d, "sum"), "the stream is capturing a CUDA graph"),
            ("cupy async", lambda: ddlkernels.allreduce_async(d, "sum", comm=comm), "the stream is capturing"),
            ("numba, legacy stream", lambda: comm.allreduce(nd, "sum"), "while another stream captures")):
        with s:
            s.begin_capture()
            try:
                with pytest.raises(RuntimeError, match=match):
                    call()
            finally:
                s.end_capture()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="the stream is capturing a CUDA graph"):
        with torch.cuda.graph(g):
            comm.allreduce(t, "sum")
    COMM.Barrier()  # nobody entered a collective
    assert_bitwise(cp.asnumpy(comm.allreduce(d, "sum")), want, "cupy after the capture")
    assert_bitwise(comm.allreduce(t, "sum").cpu().numpy(), want, "torch after the capture")
    assert_bitwise(comm.allreduce(nd, "sum").copy_to_host(), want, "numba after the capture")
    CALLS[0] += 3
