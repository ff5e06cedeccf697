"""CuPy backend on a real GPU: kernels/*.cu through RawModule, against numpy, bit for bit.

Skipped, with the reason printed (``pytest -rs``), where CuPy is not
installed or no CUDA device is visible -- which is every machine of this
project: there the same .cu files are executed by the host harness
(test_cu_host.py) and compiled for sm_70/80/90 (test_compile.py).  Never
fakes a device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _kernel_ref as K  # noqa: E402

cp = pytest.importorskip("cupy", reason="CuPy is not installed (pip install cupy-cuda12x): CuPy runtime tests need it")
try:
    _NDEV = cp.cuda.runtime.getDeviceCount()
except Exception as exc:  # no driver / no device
    pytest.skip(f"no CUDA device for the CuPy runtime tests ({type(exc).__name__}: {exc})".splitlines()[0],
                allow_module_level=True)
if _NDEV == 0:
    pytest.skip("no CUDA device for the CuPy runtime tests (getDeviceCount() == 0)", allow_module_level=True)

from ddlkernels.backends import backend_for, get_backend  # noqa: E402


def storage(x):
    return x.view(np.uint16) if x.dtype == K.BFLOAT16 else x


@pytest.fixture(scope="module")
def be():
    return get_backend("cupy")


def test_cupy_arrays_route_to_cupy(be):
    assert backend_for(cp.zeros(3, cp.float32)) is be


@pytest.mark.parametrize("op", K.OPS)
@pytest.mark.parametrize("dtype", K.DTYPES, ids=lambda d: K.SUFFIX[d])
def test_reduce_matches_numpy(be, dtype, op):
    for n in (0, 1, 7, 9, 67, 1031, 100003):
        for off in (0, 1):
            a0, b0 = K.make_pair(dtype, n + off, seed=n, op=op)
            a0, b0 = a0[off:], b0[off:]
            ref = K.reference(op, a0, b0, 5)
            da, db = cp.asarray(storage(a0)), cp.asarray(storage(b0))
            out = cp.empty_like(da)
            if op == "avg":
                be.reduce("sum", out, da, db, avg_p=5)
            else:
                be.reduce(op, out, da, db)
            got = cp.asnumpy(out).view(dtype)
            ok, _, bad = K.compare(got, ref, op)
            assert ok, f"n={n} off={off}: first mismatch at {bad}"
            # 2-operand, in place
            ref2 = a0.copy()
            with np.errstate(all="ignore"):
                K.NumpyBackend().reduce("sum" if op == "avg" else op, ref2, b0, avg_p=5 if op == "avg" else None)
            be.reduce("sum" if op == "avg" else op, da, db, avg_p=5 if op == "avg" else None)
            ok, _, bad = K.compare(cp.asnumpy(da).view(dtype), ref2, op)
            assert ok, f"in place n={n} off={off}: first mismatch at {bad}"


def test_pack_unpack(be):
    rng = np.random.default_rng(0)
    hosts = [rng.standard_normal(n).astype(dt) for n, dt in ((3, np.float32), (0, np.float64), (1001, np.float16), (5, np.int64))]
    devs = [cp.asarray(h) for h in hosts]
    buf = cp.zeros(sum(h.nbytes for h in hosts) + 64, cp.uint8)
    offs = be.pack(devs, buf)
    b = cp.asnumpy(buf)
    for h, o in zip(hosts, offs):
        assert np.array_equal(b[o:o + h.nbytes], h.view(np.uint8))
    outs = [cp.empty_like(d) for d in devs]
    be.unpack(buf, outs, offs)
    for h, o in zip(hosts, outs):
        assert np.array_equal(cp.asnumpy(o).view(np.uint8), h.view(np.uint8))


def test_staged_transport_loopback(be):
    from mpi4py import MPI

    from ddlkernels._staged import StagedTransport

    t = StagedTransport(MPI.COMM_SELF, be, 64, 2)
    try:
        src = cp.arange(100, dtype=cp.float32)
        dst = cp.zeros(100, dtype=cp.float32)
        rreq = t.irecv(dst, 0, 7)
        sreq = t.isend(src, 0, 7)
        rreq.Wait()
        sreq.Wait()
        be.synchronize()
        assert cp.array_equal(dst, src)
    finally:
        t.close()


def test_torch_cuda_tensor_zero_copy(be):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device (CPU-only build)")
    t = torch.arange(10, dtype=torch.float32, device="cuda")
    assert backend_for(t) is be
    f = be.flat(t)
    assert int(f.data.ptr) == t.data_ptr()
    back = be.like(f, t)
    assert isinstance(back, torch.Tensor) and back.data_ptr() == t.data_ptr()
