"""Where allreduce_many's time goes on the host: the numbers quoted in docs/fusion.md and ddlkernels/fusion.py.

    python bench/studies/fusion_costs.py                      # one process: the Python-side costs
    mpirun -n 2 python -m mpi4py bench/studies/fusion_costs.py   # also pack vs ring vs allreduce_many, all ranks at once

The tensors are bench_fusion.py's: 200 float32, 8 B .. 4 MB (63.7 MB), and
the 8 B .. 64 KB set (1.5 MB).  One process, fastest of 5 repeats:

* bucket layout: ``plan_buckets`` on first sight of a tensor list vs cached;
* packing the 200 small tensors: the previous ``pack_into`` (a slice
  assignment per tensor, gaps zeroed) vs the current one (one
  ``np.concatenate`` of the tensors and zero pads).

Under mpirun (median of 11 calls, slowest rank, every rank at once): packing
the 63.7 MB bucket into a warm buffer, the ring on the packed buffer in
place, the two back to back (the old path), and ``allreduce_many`` (the ring
reading large tensors where they lie).
"""

from __future__ import annotations

import os
import sys
import time
import timeit

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fusion import exact, sizes_10B_to_4MB  # noqa: E402

import ddlkernels  # noqa: E402
from ddlkernels import fusion as _fusion  # noqa: E402
from ddlkernels.fusion import FusionJob, plan_buckets  # noqa: E402


def best(fn, number):
    return min(timeit.repeat(fn, number=number, repeat=5)) / number


def python_costs(rank):
    small = [exact(n, rank, k) for k, n in enumerate(sizes_10B_to_4MB(200, max_bytes=65536))]
    shapes = [(x.shape, x.dtype) for x in small]
    cold = best(lambda: (_fusion._layout.cache_clear(), plan_buckets(shapes, 64 << 20)), 200)
    warm = best(lambda: plan_buckets(shapes, 64 << 20), 200)
    job = FusionJob(small, "sum")
    b = job.buckets[0]
    buf = np.empty(b.count, np.float32)

    def slices():  # pack_into before this session, host branch
        end = 0
        for e in b.entries:
            o = e.offset
            if o > end:
                buf[end:o] = 0
            t = small[e.index]
            if type(t) is np.ndarray and t.flags.c_contiguous:
                buf[o : o + e.count] = t.ravel()
            else:
                np.copyto(buf[o : o + e.count].reshape(e.shape), t)
            end = o + e.count

    print(f"bucket layout of 200 tensors: {cold * 1e6:.0f} us first time, {warm * 1e6:.0f} us cached")
    print(f"packing 200 small tensors ({b.count * 4 / 1e6:.1f} MB): a slice assignment each {best(slices, 200) * 1e6:.0f} us, "
          f"np.concatenate (pack_into now) {best(lambda: job.pack(b, buf), 200) * 1e6:.0f} us")


def mpi_costs():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    xs = [exact(n, rank, k) for k, n in enumerate(sizes_10B_to_4MB(200))]
    job = FusionJob(xs, "sum")
    (b,) = job.buckets
    buf = np.empty(b.count, np.float32)
    dc = ddlkernels.Communicator(comm, shm=False)  # the ring: what this script measures (64 MB: no tuner choice)

    def timed(fn, n=11):
        ts = []
        for _ in range(n):
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        return float(np.median(ts)) * 1e3

    for _ in range(3):
        job.pack(b, buf)
        dc.allreduce(buf, out=buf)
        ddlkernels.allreduce_many(xs, comm=dc)
    res = {
        "pack": timed(lambda: job.pack(b, buf)),
        "ring in place": timed(lambda: dc.allreduce(buf, out=buf)),
        "pack + ring (the old path)": timed(lambda: (job.pack(b, buf), dc.allreduce(buf, out=buf))),
        "allreduce_many": timed(lambda: ddlkernels.allreduce_many(xs, comm=dc)),
    }
    if rank == 0:
        print(f"{comm.Get_size()} ranks, {b.count * 4 / 1e6:.1f} MB in one bucket, median of 11, slowest rank:")
        for k, v in res.items():
            print(f"  {k:28s} {v:7.2f} ms")
    dc.free()


def main():
    under_mpi = any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))
    if under_mpi:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 0:
            python_costs(0)
        MPI.COMM_WORLD.Barrier()
        mpi_costs()
    else:
        python_costs(0)


if __name__ == "__main__":
    main()
