"""The reduce and pack kernels of both device backends on a real GPU, bit for bit against numpy.

Every reduce kernel (CuPy: kernels/reduce.cu compiled by NVRTC with our own
options; Numba: ddlkernels.kernels.numba_cuda) x dtype x op x pointer alignment
(all aligned, all at the same odd offset, three different offsets) x sizes
from 0 to past the kernel's grid cap (where the grid-stride loops wrap; the CuPy
reduce's, on a grid made small), and ``reduce_many``'s folds of 2 to 17 operands,
against ddlkernels' numpy backend (tests/_kernel_ref.py: the first elements
hold every pair of special values -- NaN, +-0, +-inf, the subnormal 1e-40 --
which is where CuPy's forced flush-to-zero showed).  Then pack/unpack of
many, large and odd-sized tensors at any byte offset, the staging transport
on the device, and torch tensors viewed without a copy.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest

import gpu_env as G

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _kernel_ref as K  # noqa: E402

pytestmark = G.needs_device
cp = G.cp

BACKENDS = ["cupy", "numba"]
#: (dst, a, b) element offsets: all aligned; the same odd offset (the 128-bit path after a scalar head);
#: three different offsets (the CuPy kernel's realigned path: operand words cut from the aligned words they straddle).
ALIGNMENTS = {"aligned": (0, 0, 0), "same-offset": (1, 1, 1), "mixed": (0, 1, 2)}
SMALL = (0, 1, 7, 9, 67, 1031, 100003)


def grid_cap(backend: str, dtype) -> int:
    """Elements one launch covers before its grid-stride loop wraps (see each backend's launch).  The CuPy reduce
    launches one 128-bit word a thread and never wraps: this is its fold's cap (``_cupy._launch_fold``: 4096
    blocks); ``test_cupy_kernels_on_a_small_grid`` makes its reduce wrap."""
    if backend == "cupy":
        return 4096 * 256 * (16 // np.dtype(dtype).itemsize)
    return 1024 * 256  # ddlkernels.kernels.numba_cuda.launch_config: <= 1024 blocks of 256 threads, an element each


@functools.lru_cache(maxsize=64)
def pair(dtype, n, op):
    return K.make_pair(dtype, n, seed=n % 97, op=op)


def storage(x):
    return x.view(np.uint16) if x.dtype == K.BFLOAT16 else x


def to_dev(backend, host, offset):
    """A device copy of ``host`` starting ``offset`` elements into a fresh allocation (misaligned on purpose)."""
    s = storage(host)
    if backend == "cupy":
        buf = cp.empty(s.size + offset + 1, s.dtype)
        view = buf[offset : offset + s.size]
        view.set(s)
        return view
    cuda = G.numba_cuda()
    buf = cuda.device_array(s.size + offset + 1, s.dtype)
    view = buf[offset : offset + s.size]
    view.copy_to_device(s)
    return view


def to_host(backend, d, dtype):
    h = cp.asnumpy(d) if backend == "cupy" else d.copy_to_host()
    return h.view(dtype)


@pytest.fixture(scope="module", params=BACKENDS)
def be(request):
    from ddlkernels.backends import get_backend

    if request.param == "numba":
        G.numba_cuda()
    return get_backend(request.param)


@pytest.mark.parametrize("align", sorted(ALIGNMENTS))
@pytest.mark.parametrize("op", K.OPS)
@pytest.mark.parametrize("dtype", K.DTYPES, ids=lambda d: K.SUFFIX[d])
def test_reduce_matches_numpy(be, dtype, op, align):
    od, oa, ob = ALIGNMENTS[align]
    red, avg_p = ("sum", 5) if op == "avg" else (op, None)
    for n in SMALL + (grid_cap(be.name, dtype) + 37,):
        a0, b0 = pair(dtype, n, op)
        ref = K.reference(op, a0, b0, 5)
        da, db = to_dev(be.name, a0, oa), to_dev(be.name, b0, ob)
        out = to_dev(be.name, np.zeros_like(a0), od)
        be.reduce(red, out, da, db, avg_p=avg_p)
        ok, _, bad = K.compare(to_host(be.name, out, dtype), ref, op)
        assert ok, f"{be.name} n={n} {align}: first mismatch at {bad}"
        # the 2-operand form, in place: dst = op(dst, b)
        be.reduce(red, da, db, avg_p=avg_p)
        ok, _, bad = K.compare(to_host(be.name, da, dtype), ref, op)
        assert ok, f"{be.name} in place n={n} {align}: first mismatch at {bad}"
        assert np.array_equal(to_host(be.name, db, dtype).view(np.uint8), b0.view(np.uint8)), "b was modified"


@pytest.mark.parametrize("dtype", K.DTYPES, ids=lambda d: K.SUFFIX[d])
def test_cupy_kernels_on_a_small_grid(monkeypatch, dtype):
    """The CuPy launches give each thread about one 128-bit word; on a grid of 8 blocks every thread runs the
    reduce's grid-stride rounds, the realigned loop's wrap and the fold's, at every alignment, bit for bit."""
    from ddlkernels.backends import _cupy, get_backend

    be = get_backend("cupy")
    real = _cupy._blocks
    monkeypatch.setattr(_cupy, "_blocks", lambda n, itemsize: min(real(n, itemsize), 8))
    v, threads = 16 // dtype.itemsize, 8 * 256
    for align, (od, oa, ob) in sorted(ALIGNMENTS.items()):
        for op in K.OPS:
            red, avg_p = ("sum", 5) if op == "avg" else (op, None)
            for n in (4 * threads * v + 3 * threads * v + v - 1, 13 * threads * v + 5):
                a0, b0 = pair(dtype, n, op)
                da, db = to_dev("cupy", a0, oa), to_dev("cupy", b0, ob)
                out = to_dev("cupy", np.zeros_like(a0), od)
                be.reduce(red, out, da, db, avg_p=avg_p)
                ok, _, bad = K.compare(to_host("cupy", out, dtype), K.reference(op, a0, b0, 5), op)
                assert ok, f"reduce n={n} {align}: first mismatch at {bad}"
            n = 3 * threads * v + 5
            ops = [pair(dtype, n, op)[j % 2] for j in range(3)]
            devs = [to_dev("cupy", x, (oa, ob, od)[j]) for j, x in enumerate(ops)]
            outs = [to_dev("cupy", np.zeros_like(ops[0]), od) for _ in range(2)]
            be.reduce_many(red, outs[0], devs, avg_p=3 if op == "avg" else None, also=outs[1:])
            ref = K.chain(op, ops)
            for o in outs:
                ok, _, bad = K.compare(to_host("cupy", o, dtype), ref, op)
                assert ok, f"fold n={n} {align}: first mismatch at {bad}"


@pytest.mark.parametrize("op", K.OPS)
@pytest.mark.parametrize("dtype", K.DTYPES, ids=lambda d: K.SUFFIX[d])
def test_reduce_many_matches_the_chain(be, dtype, op):
    """``reduce_many`` (the IPC allreduce's fold): 2 to 17 operands (launches of up to 8 on the CuPy backend,
    the partial result carried on), 0 to 8 more destinations (7 written by the kernel, the rest copied),
    operands at three offsets, past the fold's grid cap; and in place, the output one of the operands and the
    others the extra destinations (past the first 8 operands: through a scratch buffer)."""
    red, avg_p = ("sum", True) if op == "avg" else (op, None)
    for k, m, n in ((2, 0, 67), (3, 1, grid_cap(be.name, dtype) + 37), (8, 7, 1031), (9, 8, 4099), (17, 3, 100003)):
        ops = [pair(dtype, n, op)[j % 2] for j in range(k)]
        ref = K.chain(op, ops)
        devs = [to_dev(be.name, x, j % 3) for j, x in enumerate(ops)]
        outs = [to_dev(be.name, np.zeros_like(ops[0]), 0) for _ in range(m + 1)]
        be.reduce_many(red, outs[0], devs, avg_p=k if avg_p else None, also=outs[1:])
        for i, o in enumerate(outs):
            ok, _, bad = K.compare(to_host(be.name, o, dtype), ref, op)
            assert ok, f"{be.name} k={k} m={m} n={n} output {i}: first mismatch at {bad}"
        for x, d in zip(ops, devs):
            assert np.array_equal(to_host(be.name, d, dtype).view(np.uint8), x.view(np.uint8)), "an operand changed"
    for k, me in ((3, 1), (11, 4), (11, 9)):
        n = 4099
        ops = [pair(dtype, n, op)[j % 2] for j in range(k)]
        devs = [to_dev(be.name, x, 1) for x in ops]
        be.reduce_many(red, devs[me], devs, avg_p=k if avg_p else None,
                       also=[d for j, d in enumerate(devs) if j != me])
        ref = K.chain(op, ops)
        for j, d in enumerate(devs):
            ok, _, bad = K.compare(to_host(be.name, d, dtype), ref, op)
            assert ok, f"{be.name} in place k={k} dst={me}: buffer {j} first mismatch at {bad}"


def test_subnormals_survive(be):
    """The case the H100 showed: float32 1e-40 + 0 must stay 1e-40 (CuPy's -ftz=true gave 0)."""
    for dtype in (np.dtype(np.float32), K.BFLOAT16):
        a = np.array([1e-40, -1e-40, 1e-40, 0.0], dtype=np.float64).astype(dtype)
        b = np.array([0.0, 0.0, 1e-40, 1e-40], dtype=np.float64).astype(dtype)
        for op in ("sum", "max", "min"):
            out = to_dev(be.name, np.zeros_like(a), 0)
            be.reduce(op, out, to_dev(be.name, a, 0), to_dev(be.name, b, 0))
            ok, _, bad = K.compare(to_host(be.name, out, dtype), K.reference(op, a, b, 1), op)
            assert ok, f"{be.name} {K.SUFFIX[dtype]} {op}: subnormal lost at {bad}"


@pytest.mark.parametrize("dtype", K.DTYPES, ids=lambda d: K.SUFFIX[d])
def test_full_and_scale_on_a_stream_of_its_own(be, dtype):
    """``full`` (hier's trials across nodes reduce its zeros, "avg" scales with its -0) on a compute stream that
    is not the default: the value's exact bits in the storage type, 0 and -0 alike, over a block the pool may
    hand out again after a fill; ``scale`` with the numpy backend's bits."""
    from ddlkernels._dtypes import scale_inplace
    from ddlkernels.backends._device import negative_zero

    store = storage(np.zeros(0, dtype)).dtype
    with be.using(be.new_stream()):
        for value in (0, negative_zero(store)):
            junk = to_dev(be.name, np.ones(4099, dtype), 0)
            del junk
            z = be.full(4099, dtype, value)
            be.synchronize()
            assert z.dtype == store and z.shape == (4099,)
            want = np.full(4099, value, store)
            assert np.array_equal(storage(to_host(be.name, z, dtype)).view(np.uint8), want.view(np.uint8)), value
        if np.dtype(dtype).itemsize > 2:  # float16 and bfloat16 "avg" scale before the rounding (not this step)
            x, _ = pair(dtype, 1031, "sum")
            d = to_dev(be.name, x, 1)
            be.scale(d, 3)
            be.synchronize()
            want = x.copy()
            scale_inplace(want, 3)
            assert np.array_equal(to_host(be.name, d, dtype).view(np.uint8), want.view(np.uint8))


def _tensors(seed):
    """Many tensors of many sizes and dtypes: odd byte lengths, several longer than one block's 64 KiB piece."""
    rng = np.random.default_rng(seed)
    sizes = [1, 3, 7, 16, 17, 255, 1001, 4099, 65537, (64 * 256 * 16) * 3 + 5] + list(rng.integers(1, 20000, 172))
    dts = [np.uint8, np.float16, np.float32, np.float64, np.int32, np.int64]
    out = []
    for i, nbytes in enumerate(sizes):
        dt = np.dtype(dts[i % len(dts)])
        n = max(1, int(nbytes) // dt.itemsize)
        out.append(rng.integers(-1000, 1000, n).astype(dt))
    return out


@pytest.mark.parametrize("offsets", ["aligned", "odd"])
def test_pack_unpack_many_large_and_odd(be, offsets):
    hosts = _tensors(3)
    devs = [be.flat(to_dev(be.name, h, i % 3 if offsets == "odd" else 0)) for i, h in enumerate(hosts)]
    if offsets == "aligned":
        offs = None
        total = sum(-(-h.nbytes // 16) * 16 for h in hosts)
    else:  # byte offsets on no common boundary: the 4-byte and byte paths of kernels/pack.cu
        offs, pos = [], 0
        for h in hosts:
            pos += 1 + (pos % 5)
            offs.append(pos)
            pos += h.nbytes
        total = pos
    buf = to_dev(be.name, np.zeros(total + 64, np.uint8), 0)
    offs = be.pack(devs, buf, offs)
    b = to_host(be.name, buf, np.uint8)
    for h, o in zip(hosts, offs):
        assert np.array_equal(b[o : o + h.nbytes], h.view(np.uint8))
    outs = [be.flat(to_dev(be.name, np.zeros_like(h), (i + 1) % 3 if offsets == "odd" else 0))
            for i, h in enumerate(hosts)]
    be.unpack(buf, outs, offs)
    for h, o in zip(hosts, outs):
        assert np.array_equal(to_host(be.name, o, np.uint8), h.view(np.uint8))


def test_cupy_pack_table_uploaded_once_per_stream():
    """Packing the same tensors again reuses the device table (it holds addresses, so new contents still
    pack); another stream, or other offsets, get a table of their own."""
    from ddlkernels.backends import get_backend

    be = get_backend("cupy")
    hosts = _tensors(11)
    devs = [be.flat(cp.asarray(h)) for h in hosts]
    buf = cp.zeros(sum(-(-h.nbytes // 16) * 16 for h in hosts) + 64, cp.uint8)
    be._tables.clear()
    offs = be.pack(devs, buf)
    for d in devs:
        d += 1
    be.pack(devs, buf)
    be.unpack(buf, devs, offs)
    assert len(be._tables) == 1
    b = cp.asnumpy(buf)
    for d, o in zip(devs, offs):
        assert np.array_equal(b[o:o + d.nbytes], cp.asnumpy(d).view(np.uint8))
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        out = cp.zeros_like(buf)
        be.pack(devs, out)
        s.synchronize()
    assert len(be._tables) == 2
    assert np.array_equal(cp.asnumpy(out), b)


def test_cupy_kernels_come_from_our_nvrtc_compile():
    """Not CuPy's RawModule, which appends -ftz=true: the loaded module is ours, one per device and compile unit
    (reduce.cu: one per kind of kernel)."""
    from ddlkernels.backends import get_backend
    from ddlkernels.kernels.sources import unit_of

    be = get_backend("cupy")
    a = cp.ones(8, cp.float32)
    be.reduce("sum", a, a)
    key = (cp.cuda.runtime.getDevice(), "reduce.cu", unit_of("reduce.cu", "ddl_reduce_sum_f32"))
    assert key in be._modules and isinstance(be._modules[key], cp.cuda.function.Module)


def test_staged_transport_loopback():
    from mpi4py import MPI

    from ddlkernels.transport.staged import StagedTransport
    from ddlkernels.backends import get_backend

    be = get_backend("cupy")
    t = StagedTransport(MPI.COMM_SELF, be, 64, 2)
    try:
        for n in (0, 3, 100, 4099):
            src = cp.arange(n, dtype=cp.float32) + 1
            dst = cp.zeros(n, dtype=cp.float32)
            rreq = t.irecv(dst, 0, 7)
            sreq = t.isend(src, 0, 7)
            rreq.Wait()
            sreq.Wait()
            assert cp.array_equal(dst, src)  # on the current stream, which the landing copy was ordered before
    finally:
        t.close()


def test_torch_cuda_tensor_zero_copy():
    torch = G.torch_cuda()
    from ddlkernels.backends import backend_for, get_backend

    be = get_backend("cupy")
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        t = torch.arange(10, dtype=dt, device="cuda")
        assert backend_for(t) is be
        f = be.flat(t)
        assert int(f.data.ptr) == t.data_ptr()
        back = be.like(f, t)
        assert isinstance(back, torch.Tensor) and back.data_ptr() == t.data_ptr() and back.dtype == dt


def test_torch_stream_is_the_compute_stream():
    """A torch tensor's call runs on torch's current stream, not on CuPy's."""
    torch = G.torch_cuda()
    from ddlkernels.backends import get_backend

    be = get_backend("cupy")
    t = torch.zeros(4, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        cs = be.stream_of(t)
        assert cs.ptr == s.cuda_stream
    assert be.stream_of(t).ptr == torch.cuda.current_stream().cuda_stream
