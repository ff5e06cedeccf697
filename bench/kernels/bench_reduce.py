"""The host reduce kernel against numpy.add and a STREAM-like copy, in GB/s of bytes moved.

What the ring's inner loop does per chunk is ``dst = a + b`` (the owner's
block plus the received slot), through ``backend.reduce``.  It is memory
bound: its ceiling is the machine's streaming bandwidth, measured here in the
same session as a plain copy (``np.copyto``, STREAM "copy").  Bytes are
counted as STREAM counts them: reduce and add read 2 arrays and write 1
(3 x size), copy reads 1 and writes 1 (2 x size).  The summary at the end
prints each kernel's GB/s as a fraction of the copy's at the same size; the
project's target is reduce >= 80 % of copy.

Sizes: 256 KiB and 1 MiB (one pipeline chunk: what the engine hands the
kernel), 16 MiB and 64 MiB (beyond the caches).  Sizes are per array.
"""

import numpy as np
import pytest

from ddlkernels.tools.bench import parse_dtype
from ddlkernels.backends import get_backend

SIZES = ["256K", "1M", "16M", "64M"]
CASES = [(s, "float32") for s in SIZES] + [("16M", "float16"), ("16M", "bfloat16"), ("16M", "float64")]


def _arrays(size, dtype, n):
    from ddlkernels.tools.bench import parse_size

    dt = parse_dtype(dtype)
    count = parse_size(size) // dt.itemsize
    rng = np.random.default_rng(1)
    # Small integers: exact in every dtype, and the result is checked once below.
    return [rng.integers(-8, 9, count).astype(dt) for _ in range(n)], count * dt.itemsize


@pytest.mark.parametrize("size,dtype", CASES)
def bench_backend_reduce(benchmark, run, size, dtype):
    """``NumpyBackend.reduce("sum", dst, a, b)``: the kernel the engine calls per chunk."""
    (a, b, dst), nb = _arrays(size, dtype, 3)
    reduce = get_backend("numpy").reduce
    benchmark.group = f"reduce {size}"
    run(benchmark, reduce, "sum", dst, a, b, nbytes=3 * nb, key=("reduce", size, dtype))
    assert np.array_equal(dst.astype(np.float64), a.astype(np.float64) + b.astype(np.float64))


@pytest.mark.parametrize("size,dtype", CASES)
def bench_backend_reduce_inplace(benchmark, run, size, dtype):
    """``reduce("sum", a, a, b)``: the in-place form (a += b); same STREAM bytes (read a, b; write a)."""
    (a, b), nb = _arrays(size, dtype, 2)
    b[:] = 0  # a stays unchanged, so every round sees the same values
    reduce = get_backend("numpy").reduce
    benchmark.group = f"reduce {size}"
    run(benchmark, reduce, "sum", a, a, b, nbytes=3 * nb, key=("reduce_inplace", size, dtype))


@pytest.mark.parametrize("size,dtype", [c for c in CASES if c[1] in ("float32", "float64", "float16")])
def bench_numpy_add(benchmark, run, size, dtype):
    """``np.add(a, b, out=dst)``: the same arithmetic with no backend in between."""
    (a, b, dst), nb = _arrays(size, dtype, 3)
    benchmark.group = f"reduce {size}"
    run(benchmark, np.add, a, b, dst, nbytes=3 * nb, key=("numpy.add", size, dtype))


@pytest.mark.parametrize("size,dtype", CASES)
def bench_stream_copy(benchmark, run, size, dtype):
    """``np.copyto(dst, a)``: STREAM copy, the memory system's streaming ceiling (2 x size bytes)."""
    (a, dst), nb = _arrays(size, dtype, 2)
    benchmark.group = f"reduce {size}"
    run(benchmark, np.copyto, dst, a, nbytes=2 * nb, key=("copy", size, dtype))
    assert np.array_equal(dst.view(np.uint8), a.view(np.uint8))


@pytest.mark.parametrize("size", SIZES)
def bench_reduce_vs_copy_interleaved(benchmark, run, size):
    """One round = one STREAM copy then one ``backend.reduce``, each timed: the ratio under the same load.

    Separate benchmarks measure copy and reduce seconds or minutes apart, and
    on a shared machine the load in between moves the ratio by tens of
    percent; alternating them round by round makes both medians see the same
    conditions.  ``extra_info`` holds both medians in GB/s and their ratio.
    """
    import time

    (a, b, dst, cdst), nb = _arrays(size, "float32", 4)
    reduce = get_backend("numpy").reduce
    t_copy, t_red = [], []

    def pair():
        t0 = time.perf_counter()
        np.copyto(cdst, a)
        t1 = time.perf_counter()
        reduce("sum", dst, a, b)
        t_copy.append(t1 - t0)
        t_red.append(time.perf_counter() - t1)

    benchmark.group = f"reduce {size}"
    run(benchmark, pair)
    n_warm = len(t_copy) - benchmark.stats.stats.rounds  # pedantic's warmup rounds come first
    copy_gbps = 2 * nb / float(np.median(t_copy[n_warm:])) / 1e9
    red_gbps = 3 * nb / float(np.median(t_red[n_warm:])) / 1e9
    benchmark.extra_info.update(copy_GBps_median=copy_gbps, reduce_GBps_median=red_gbps,
                                reduce_over_copy=red_gbps / copy_gbps)
    from conftest import _RESULTS

    _RESULTS[("copy (interleaved)", size, "float32")] = copy_gbps
    _RESULTS[("reduce (interleaved)", size, "float32")] = red_gbps
    assert np.array_equal(dst, a + b)
