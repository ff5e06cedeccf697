"""The GPU kernels' throughput, in GB/s of the bytes each kernel must move.

    python -m pytest bench/kernels/bench_kernels.py -q [--bench-rounds N]

Without a GPU (this project's machines) the kernels of kernels/*.cu run on
the CPU through the host harness (tests/cuda_host, built here with g++ -O2):
one harness "thread" walks the whole grid-stride loop, so this measures the
kernel's loop body as the CPU executes it -- next to the numpy backend doing
the same reduction in the same session.  It says how the .cu code compiles
for a CPU, nothing about GPU speed.  With CuPy or numba-cuda and a device,
the same reductions run on the GPU (``backend.synchronize()`` inside the
timed function, so the time covers the kernel, not just its launch).

Bytes are counted as STREAM does: a reduce ``dst = op(a, b)`` reads 2 and
writes 1 array (3 x size); pack/unpack read and write every tensor once
(2 x total).  Sizes are per array: 1 MiB (the engine's default chunk) and
16 MiB.  The summary printed at the end (bench/conftest.py) shows GB/s next
to the STREAM-like copy when bench_reduce.py runs in the same session.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "cuda_host")]

import _kernel_ref as K  # noqa: E402
import harness as H  # noqa: E402

from ddlkernels._dtypes import BFLOAT16  # noqa: E402
from ddlkernels.backends import get_backend  # noqa: E402

SIZES = {"1M": 1 << 20, "16M": 16 << 20}
CASES = [("1M", "float32", "sum"), ("16M", "float32", "sum"), ("16M", "float32", "max"), ("16M", "float32", "avg"),
         ("16M", "float16", "sum"), ("16M", "bfloat16", "sum"), ("16M", "float64", "sum"), ("16M", "int32", "sum")]


def _dtype(name):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def _arrays(size, dtype):
    dt = _dtype(dtype)
    n = SIZES[size] // dt.itemsize
    rng = np.random.default_rng(3)
    a, b = (rng.integers(-8, 9, n).astype(dt) for _ in range(2))
    return a, b, np.empty_like(a), n


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if H.gxx() is None:
        pytest.skip("g++ is needed for the host harness")
    return H.build(tmp_path_factory.mktemp("bench_harness"), opt="-O2")


@pytest.mark.parametrize("size,dtype,op", CASES)
def bench_cu_reduce_host_harness(benchmark, run, harness, size, dtype, op):
    """kernels/reduce.cu on the CPU: one harness thread runs the whole grid-stride loop."""
    a, b, dst, n = _arrays(size, dtype)
    dt = _dtype(dtype)
    name = f"ddl_reduce_{op}_{K.SUFFIX[dt]}"
    arg = K.kernel_arg(dt, op, 4)
    benchmark.group = f"kernel reduce {size} {dtype} {op}"
    run(benchmark, harness.reduce, name, dst, a, b, arg, 1, 1, False, nbytes=3 * a.nbytes,
        key=(f"cu-harness {op}", size, dtype))
    ok, _, bad = K.compare(dst, K.reference(op, a, b, 4), op)
    assert ok, f"harness result differs from numpy at {bad}"


@pytest.mark.parametrize("size,dtype,op", CASES)
def bench_numpy_backend_reduce(benchmark, run, size, dtype, op):
    """The numpy backend's reduce on the same inputs: the host reference point."""
    a, b, dst, n = _arrays(size, dtype)
    be = get_backend("numpy")
    avg = 4 if op == "avg" else None
    rop = "sum" if op == "avg" else op
    benchmark.group = f"kernel reduce {size} {dtype} {op}"
    run(benchmark, lambda: be.reduce(rop, dst, a, b, avg_p=avg), nbytes=3 * a.nbytes,
        key=(f"numpy {op}", size, dtype))


def _pack_case():
    rng = np.random.default_rng(5)
    # 64 tensors from 1 KiB to 512 KiB (a layer's worth of gradients), 16-byte aligned offsets
    sizes = [int(s) for s in rng.integers(1 << 10, 1 << 19, 64)]
    tensors = [rng.integers(0, 255, s).astype(np.uint8) for s in sizes]
    offs, pos = [], 0
    for s in sizes:
        pos = -(-pos // 16) * 16
        offs.append(pos)
        pos += s
    buf = np.zeros(pos, np.uint8)
    table = np.array([[t.ctypes.data, t.size, o] for t, o in zip(tensors, offs)], dtype=np.uint64)
    return tensors, offs, buf, table, sum(sizes)


def bench_cu_pack_host_harness(benchmark, run, harness):
    """kernels/pack.cu: 64 tensors into one fusion buffer, one launch (grid 1 x 64, one thread per entry)."""
    tensors, offs, buf, table, total = _pack_case()
    benchmark.group = "kernel pack"
    run(benchmark, harness.pack, table, buf, (1, 64), 1, False, nbytes=2 * total, key=("cu-harness pack", "64 tensors", "bytes"))
    assert all((buf[o:o + t.size] == t).all() for t, o in zip(tensors, offs))


def bench_numpy_pack(benchmark, run):
    """The same packing as numpy slice copies, one per tensor: the host reference point."""
    tensors, offs, buf, _, total = _pack_case()

    def pack():
        for t, o in zip(tensors, offs):
            buf[o:o + t.size] = t

    benchmark.group = "kernel pack"
    run(benchmark, pack, nbytes=2 * total, key=("numpy pack", "64 tensors", "bytes"))


# -- on a GPU, when there is one ---------------------------------------------------------


def _gpu_backend(name):
    from ddlkernels.backends import BackendUnavailable

    try:
        be = get_backend(name)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    if name == "numba":
        from numba import cuda

        if getattr(be, "simulated", False) or not cuda.is_available():
            pytest.skip("no CUDA device for numba (the simulator is not benchmarked)")
    else:
        try:
            if be._cp.cuda.runtime.getDeviceCount() == 0:
                pytest.skip("no CUDA device for CuPy")
        except Exception as exc:
            pytest.skip(f"no CUDA device for CuPy ({type(exc).__name__})")
    return be


@pytest.mark.parametrize("backend", ["cupy", "numba"])
@pytest.mark.parametrize("size,dtype,op", CASES)
def bench_gpu_reduce(benchmark, run, backend, size, dtype, op):
    """The device kernels; synchronize inside the timed function."""
    be = _gpu_backend(backend)
    a, b, _, n = _arrays(size, dtype)
    da, db = be.flat(_to_device(be, a)), be.flat(_to_device(be, b))
    dd = be.empty(n, _dtype(dtype))
    avg = 4 if op == "avg" else None
    rop = "sum" if op == "avg" else op

    def step():
        be.reduce(rop, dd, da, db, avg_p=avg)
        be.synchronize()

    benchmark.group = f"kernel reduce {size} {dtype} {op}"
    run(benchmark, step, nbytes=3 * a.nbytes, key=(f"{backend} gpu {op}", size, dtype))


def _to_device(be, x):
    st = x.view(np.uint16) if x.dtype == BFLOAT16 else x
    if be.name == "cupy":
        return be._cp.asarray(st)
    from numba import cuda

    return cuda.to_device(st)
