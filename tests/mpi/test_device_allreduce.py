"""The device path end to end: allreduce of Numba device arrays, staged through pinned host memory.

Without a GPU this runs in the Numba CUDA simulator: tests/mpi/conftest.py
sets ``NUMBA_ENABLE_CUDASIM=1`` before numba is first imported where the
machine has no NVIDIA device.  With a GPU it runs on the device unchanged
(tests/gpu/ holds the suite written for real devices).  Every result must equal, bit for bit, the host
(numpy) result of the same Communicator -- same ring, same chunks, so the
same operations in the same order -- and be the same on every rank.

MPI here is not CUDA-aware (PyPI's Open MPI), and the Communicator is told so
explicitly: every chunk goes device -> pinned host -> MPI -> pinned host ->
device through ``ddlkernels.transport.staged.StagedTransport``.
"""

import numpy as np
import pytest
from mpi4py import MPI
from numba import config as _nb_config
from numba import cuda

import ddlkernels
from ddlkernels._dtypes import BFLOAT16, SUPPORTED_DTYPES, dtype_name
from ddlkernels.transport.staged import StagedTransport
from ddlkernels.backends import backend_for, get_backend
from ddlkernels.backends._device import pack_offsets

SIMULATED = bool(getattr(_nb_config, "ENABLE_CUDASIM", 0))
if not SIMULATED and not cuda.is_available():
    raise RuntimeError(
        "numba was imported before this module could enable the CUDA simulator, and there is no GPU: "
        "run tests/mpi/test_device_allreduce.py in a session that has not imported numba"
    )

COMM = MPI.COMM_WORLD
P = COMM.Get_size()
R = COMM.Get_rank()
# 16-byte chunks: several chunks per block even for tiny arrays, so the
# window of slots wraps and staging runs many times per phase.
CHUNK = 16


def data(n, dtype, salt=0):
    """Unique per rank and element; small integers-over-16 so every float type holds them exactly."""
    dt = np.dtype(dtype)
    i = np.arange(n, dtype=np.int64)
    key = i * P + R + 7919 * salt
    if dt.kind == "i":
        return (key * 2654435761 % 100003 - 50001).astype(dt)
    return (((key * 37) % 251 - 125) / 16.0).astype(dt)


def exact_sums(n, dtype, salt=0):
    """``data``, but with every partial sum of up to 16 ranks' elements exact in ``dtype``, so that any order of
    the sum gives the same bits: bfloat16 (8 significant bits) takes multiples of 1/16 up to 15/16 (``data``'s
    own, up to 125/16, overflow 8 bits from 3 ranks on); float16's 11 bits hold ``data``'s sums to 16 ranks."""
    if np.dtype(dtype) != BFLOAT16:
        return data(n, dtype, salt)
    key = np.arange(n, dtype=np.int64) * P + R + 7919 * salt
    return (((key * 37) % 31 - 15) / 16.0).astype(BFLOAT16)


def to_device(x):
    # numba-cuda cannot copy an ml_dtypes array (on a GPU, to_device raises "cannot include dtype 'E' in a
    # buffer"): a user copies the bits and views them, and the backend reduces those uint16 bits.
    if x.dtype == BFLOAT16:
        return cuda.to_device(x.view(np.uint16)).view(BFLOAT16)
    return cuda.to_device(x)


def to_host(d):
    if d.dtype == BFLOAT16:
        return d.view(np.uint16).copy_to_host().view(BFLOAT16)
    return d.copy_to_host()


@pytest.fixture(scope="module")
def dcomm():
    c = ddlkernels.Communicator(COMM, chunk_bytes=CHUNK, small_bytes=0, window=2, cuda_aware=False)
    yield c
    c.free()


def same_everywhere(bits: np.ndarray):
    allb = COMM.allgather(bits.tobytes())
    return all(b == allb[0] for b in allb)


SIZES = sorted({0, 1, max(P - 1, 0), P + 1, 13, 37})


@pytest.mark.sweep
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod"])
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=[dtype_name(d) for d in SUPPORTED_DTYPES])
# The Numba simulator multiplies integers as numpy scalars, which warn where the product wraps, as it is meant to.
@pytest.mark.filterwarnings("ignore:overflow encountered in scalar multiply:RuntimeWarning")
def test_device_equals_host_bitwise(dcomm, dtype, op):
    for n in SIZES:
        x = data(n, dtype, salt=n)
        if op == "prod" and np.dtype(dtype).kind == "f":
            x = (1.0 + np.abs(x.astype(np.float64)) / 64.0).astype(dtype)  # stay finite
        d = to_device(x)
        got = dcomm.allreduce(d, op)
        host = dcomm.allreduce(x, op)
        assert type(got) is type(d), "the result must be of the input's array type"
        g = to_host(got)
        assert g.dtype == host.dtype and g.shape == (n,)
        gb, hb = g.view(np.uint8), host.view(np.uint8)
        assert np.array_equal(gb, hb), f"n={n}: device result differs from host at {np.flatnonzero(g != host)[:5]}"
        assert same_everywhere(gb)
        assert np.array_equal(to_host(d).view(np.uint8), x.view(np.uint8)), "input modified"


def test_the_device_path_is_staged(dcomm):
    be = backend_for(to_device(np.zeros(1, np.float32)))
    assert be.name == "numba" and be.device
    assert isinstance(dcomm._transport(be), StagedTransport)


@pytest.mark.parametrize("shape", [(5, 7), (3, 1, 4)])
def test_in_place_and_out_multidim(dcomm, shape):
    n = int(np.prod(shape))
    x = data(n, np.float32).reshape(shape)
    host = dcomm.allreduce(x, "sum")
    d = to_device(x)
    r = dcomm.allreduce(d, "sum", out=d)
    assert r is d
    assert np.array_equal(d.copy_to_host(), host)
    o = cuda.device_array(shape, np.float32)
    d2 = to_device(x)
    r = dcomm.allreduce(d2, "avg", out=o)
    assert r is o
    assert np.array_equal(o.copy_to_host(), dcomm.allreduce(x, "avg"))
    assert np.array_equal(d2.copy_to_host(), x)


def test_multi_dimensional_box(dcomm):
    if P % 2:
        dims = (P,)
    else:
        dims = (2, P // 2)
    x = data(29, np.float64)
    got = dcomm.allreduce(to_device(x), "sum", dims=dims)
    assert np.array_equal(got.copy_to_host(), dcomm.allreduce(x, "sum", dims=dims))


def test_pinned_slots_are_reused(dcomm):
    x = to_device(data(41, np.float32))
    dcomm.allreduce(x, "sum")
    t = dcomm._transport(backend_for(x))
    before = t.pinned_bytes
    for _ in range(3):
        dcomm.allreduce(x, "sum")
    assert t.pinned_bytes == before, "the staging transport allocated pinned memory again"


def test_cuda_aware_override_is_used(dcomm):
    assert dcomm.cuda_aware() == (False, "set explicitly")


# -- bad input on the device path: a clear error on every rank, before any communication --


def test_non_contiguous_device_array(dcomm):
    d = to_device(data(20, np.float32))
    with pytest.raises(ValueError, match="C-contiguous device array"):
        dcomm.allreduce(d[::2], "sum")
    COMM.Barrier()


def test_unsupported_dtype_on_device(dcomm):
    for dt in (np.complex64, np.uint16, np.int8):
        with pytest.raises(TypeError, match="unsupported dtype"):
            dcomm.allreduce(cuda.to_device(np.zeros(4, dt)), "sum")
    COMM.Barrier()


def test_mixed_host_and_device(dcomm):
    d = to_device(data(6, np.float32))
    with pytest.raises(TypeError, match="out is a numpy array but the input is a numba array"):
        dcomm.allreduce(d, "sum", out=np.empty(6, np.float32))
    with pytest.raises(TypeError, match="out is a numba array but the input is a numpy array"):
        dcomm.allreduce(data(6, np.float32), "sum", out=cuda.device_array(6, np.float32))
    COMM.Barrier()


def test_out_dtype_and_shape_on_device(dcomm):
    d = to_device(data(6, np.float32))
    with pytest.raises(TypeError, match="out has dtype float64"):
        dcomm.allreduce(d, "sum", out=cuda.device_array(6, np.float64))
    with pytest.raises(ValueError, match="out has shape"):
        dcomm.allreduce(d, "sum", out=cuda.device_array(7, np.float32))
    COMM.Barrier()


# -- the backend's own kernels outside the engine (local, no communication) --


def _pack_case(layout):
    """Tensors for the Numba pack: 69 of them, empty ones among them, at the default offsets: "wide" of 8-byte
    elements and one longer than a 64 KiB piece (the 8-byte words), "mixed" with float16 of odd lengths
    (2-byte words); "odd" puts every tensor and the buffer on odd bytes (single bytes).  Bytes unique per
    rank and element.  Returns (arrays, offsets or None, buffer skew, the word the backend must choose)."""
    lengths = [0, 1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 33]
    dtypes = [np.float64, np.int64] if layout == "wide" else [np.float32, np.float64, np.float16, np.int64, np.int32]
    specs = [(lengths[k % len(lengths)], dtypes[k % len(dtypes)]) for k in range(69)]
    if layout == "wide":
        specs[35] = ((1 << 16) // 8 + 3, np.float64)
    hosts = []
    for k, (n, dt) in enumerate(specs):
        nbytes = n * np.dtype(dt).itemsize
        raw = ((np.arange(nbytes, dtype=np.int64) * 131 + k * 7919 + R * 104729) % 251).astype(np.uint8)
        hosts.append(raw.view(dt))
    if layout != "odd":
        return hosts, None, 0, 8 if layout == "wide" else 2
    offsets, pos = [], 1
    for h in hosts:
        offsets.append(pos)
        pos += h.nbytes + 2
    return hosts, offsets, 1, 1


@pytest.mark.one_rank  # one process's pack and unpack, the slowest test of tests/mpi in the simulator
@pytest.mark.parametrize("layout", ["wide", "mixed", "odd"])
def test_numba_pack_unpack_many_tensors(layout):
    be = get_backend("numba")
    hosts, offsets, skew, word = _pack_case(layout)
    devs = [be.flat(cuda.to_device(h)) for h in hosts]
    end = pack_offsets([h.nbytes for h in hosts])[1] if offsets is None else offsets[-1] + hosts[-1].nbytes
    sentinel = np.full(end + 24 + skew, 0xA5, np.uint8)
    buf = cuda.to_device(sentinel)[skew:]
    tables = len(be._tables)
    offs = be.pack(devs, buf, offsets)
    assert len(be._tables) == tables + 1 and next(reversed(be._tables))[2] == word
    got = buf.copy_to_host()
    expect = sentinel[skew:].copy()
    for h, o in zip(hosts, offs):
        expect[o:o + h.nbytes] = h.view(np.uint8)
    assert np.array_equal(got, expect)  # every byte in place, none written outside a tensor
    for h, d in zip(hosts, devs):  # the inputs are untouched
        assert np.array_equal(d.copy_to_host().view(np.uint8), h.view(np.uint8))
    for d in devs:  # a fusion bucket: reduced in the buffer, unpacked into the tensors it came from
        d.copy_to_device(np.full(d.shape[0] * d.dtype.itemsize, 0x5A, np.uint8).view(d.dtype))
    be.unpack(buf, devs, offs)
    assert len(be._tables) == tables + 1  # the pack's table serves the unpack of the same tensors
    for h, d in zip(hosts, devs):
        assert np.array_equal(d.copy_to_host().view(np.uint8), h.view(np.uint8))
    with pytest.raises(ValueError, match="not fit a 8-byte buffer"):  # before any launch
        be.pack(devs, buf[:8], offsets)


def test_numba_backend_rejects_bad_reduce_arguments():
    be = get_backend("numba")
    a = cuda.to_device(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="lengths differ"):
        be.reduce("sum", a, cuda.to_device(np.ones(3, np.float32)))
    with pytest.raises(TypeError, match="dtypes differ"):
        be.reduce("sum", a, cuda.to_device(np.ones(4, np.float64)))
    with pytest.raises(ValueError, match="reduce op"):
        be.reduce("avg", a, a)
    with pytest.raises(ValueError, match="only defined for the sum"):
        be.reduce("max", a, cuda.to_device(np.ones(4, np.float32)), avg_p=2)


@pytest.mark.parametrize("dst, a, b", [((0, 8), (0, 8), (2, 10)), ((2, 10), (2, 10), (0, 8)),
                                       ((0, 8), (1, 9), (12, 20)), ((4, 12), (0, 8), (12, 20)),
                                       ((0, 8), (8, 16), (16, 24)), ((8, 16), (0, 8), (16, 24))])
def test_numba_backend_handles_overlapping_operands(dst, a, b):
    """An operand overlapping dst, from either side, breaks a kernel precondition (a may be dst itself): the
    backend copies it first, and the result is numpy's; buffers that only touch end to start are apart."""
    be = get_backend("numba")
    x = np.arange(24, dtype=np.float32) * 3 + R
    d = cuda.to_device(x)
    be.reduce("sum", d[slice(*dst)], d[slice(*a)], d[slice(*b)])
    ref = x.copy()
    ref[slice(*dst)] = x[slice(*a)] + x[slice(*b)]
    assert np.array_equal(d.copy_to_host(), ref)


def test_numba_backend_full_on_its_compute_stream():
    """``full``: ``n`` copies of a value's exact bits in the storage type (bfloat16's uint16 bits), -0 and 0
    alike, made on the compute stream; ``scale`` is "avg"'s last step with the numpy backend's bits."""
    from ddlkernels._dtypes import scale_inplace
    from ddlkernels.backends._device import negative_zero

    be = get_backend("numba")
    s = cuda.stream()
    with be.using(s):
        for dtype, store in ((np.float32, np.float32), (np.int64, np.int64), (BFLOAT16, np.uint16)):
            for value in (0, negative_zero(np.dtype(store)), 7):
                z = be.full(13, dtype, value)
                assert z.dtype == store and z.shape == (13,)
                want = np.full(13, value, store)
                assert np.array_equal(z.copy_to_host(stream=s).view(np.uint8), want.view(np.uint8)), (dtype, value)
        assert be.full(0, np.float64, 0).shape == (0,)
        for dtype in (np.float32, np.float64, np.int32):
            x = np.array([-0.0, 0.0, 5.0, -7.0, 1e-40, np.nan, np.inf, 3.0], np.float64).astype(dtype) \
                if np.dtype(dtype).kind == "f" else np.array([0, 5, -7, 9, -1, 3], dtype)
            d = cuda.to_device(x, stream=s)
            be.scale(d, 3)
            want = x.copy()
            scale_inplace(want, 3)
            assert np.array_equal(d.copy_to_host(stream=s).view(np.uint8), want.view(np.uint8)), dtype


def test_staged_transport_loopback_grows_and_reuses():
    """Self-messages over COMM_SELF: chunks larger than a slot, an empty chunk, and slot reuse."""
    be = get_backend("numba")
    t = StagedTransport(MPI.COMM_SELF, be, 16, 2)
    try:
        assert t.pinned_bytes == 4 * 16  # 2 x window slots, allocated up front
        for n in (0, 3, 40, 40):
            src = cuda.to_device(np.arange(n, dtype=np.float64) + R)
            dst = cuda.device_array(n, np.float64)
            rr = t.irecv(dst, 0, 5)
            sr = t.isend(src, 0, 5)
            assert rr.Wait() and (rr.Test() is True)
            sr.Wait()
            be.synchronize()
            assert np.array_equal(dst.copy_to_host(), np.arange(n, dtype=np.float64) + R)
        assert t.slot_bytes == 40 * 8
        grown = t.pinned_bytes
        src = cuda.to_device(np.ones(40))
        dst = cuda.device_array(40, np.float64)
        rr, sr = t.irecv(dst, 0, 6), t.isend(src, 0, 6)
        rr.Wait()
        sr.Wait()
        assert t.pinned_bytes == grown, "a slot was allocated although freed ones fit"
    finally:
        t.close()
    with pytest.raises(TypeError, match="device backend"):
        StagedTransport(MPI.COMM_SELF, get_backend("numpy"), 16, 2)


def test_reduce_scatter_and_allgather_on_device(dcomm):
    x = data(31, np.float32, salt=3)
    shard = dcomm.reduce_scatter(to_device(x), "sum")
    host_shard = dcomm.reduce_scatter(x, "sum")
    assert np.array_equal(shard.copy_to_host(), host_shard)
    whole = dcomm.allgather(shard)
    assert np.array_equal(whole.copy_to_host(), dcomm.allgather(host_shard))
    assert np.array_equal(whole.copy_to_host(), dcomm.allreduce(x, "sum"))


def test_timeout_polling_path_on_device(dcomm):
    """With timeout= the engine polls requests with Test(): staged receives must land on Test too."""
    x = data(37, np.float64, salt=5)
    got = dcomm.allreduce(to_device(x), "sum", timeout=60)
    assert np.array_equal(got.copy_to_host(), dcomm.allreduce(x, "sum"))


def test_allreduce_many_on_device_uses_the_pack_kernels(dcomm, monkeypatch):
    """Fusion of several device tensors (pack kernel -> one allreduce per bucket -> unpack kernel).

    Integer and max data: the result does not depend on the buffer layout, so
    it must equal per-tensor host allreduces bit for bit.
    """
    shapes = [(3,), (2, 5), (1,), (7,), (0,), (4, 3)]
    hosts = [data(int(np.prod(s)), np.int32, salt=k).reshape(s) for k, s in enumerate(shapes)]
    hosts += [data(9, np.float32, salt=9), data(5, np.float32, salt=10)]
    devs = [to_device(h) for h in hosts]
    be = get_backend("numba")
    calls = {"pack": 0, "unpack": 0}
    for name in calls:
        orig = getattr(be, name)

        def counted(*args, _orig=orig, _name=name, **kw):
            calls[_name] += 1
            return _orig(*args, **kw)

        monkeypatch.setattr(be, name, counted)
    for op in ("sum", "max"):
        outs = ddlkernels.allreduce_many(devs, op, comm=dcomm, fusion_bytes=96)
        assert len(outs) == len(hosts)
        for h, o, d in zip(hosts, outs, devs):
            assert type(o) is type(d) and o.shape == h.shape
            ref = dcomm.allreduce(h, op) if h.size else h
            if h.dtype.kind == "f" and op == "sum":
                continue  # float sums may round differently with the layout (see _fusion); checked below
            assert np.array_equal(o.copy_to_host(), ref), f"{op} {h.dtype} {h.shape}"
            assert np.array_equal(d.copy_to_host(), h), "input modified"
    assert calls["pack"] > 0 and calls["unpack"] == calls["pack"], calls
    # floats whose partial sums are all exact: bitwise too
    fl = [(np.arange(n, dtype=np.float32) + R) for n in (3, 6, 2)]
    outs = ddlkernels.allreduce_many([to_device(f) for f in fl], "sum", comm=dcomm, fusion_bytes=64)
    for f, o in zip(fl, outs):
        assert np.array_equal(o.copy_to_host(), dcomm.allreduce(f, "sum"))


@pytest.mark.skipif(P < 2, reason="one rank has nothing to reduce")
def test_numba_arrays_through_the_host_algorithm():
    """"host" (ddlkernels.algorithms.host) on the Numba backend: pieces of 64 bytes down to pinned memory,
    reduced by the host's allreduce, back up; the sums are exact in every dtype, so any order's bits."""
    c = ddlkernels.Communicator(COMM, shm=False, cuda_aware=False)
    c.algorithms["host"].piece_bytes = 64
    for dt in SUPPORTED_DTYPES:
        for n in (1, P + 1, 100, 1001):
            x = exact_sums(n, dt, salt=n)
            d = to_device(x)
            c.settle(d, "host")
            got = c.allreduce(d, "sum")
            assert c.last_algorithm == "host"
            want = c.allreduce(x, "sum")
            assert np.array_equal(to_host(got).view(np.uint8), want.view(np.uint8)), f"{dtype_name(dt)} n={n}"
            assert np.array_equal(to_host(d).view(np.uint8), x.view(np.uint8)), "input modified"
    c.free()
