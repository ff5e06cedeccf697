"""A steady stream of ddlkernels allreduces for a profiler to sample (py-spy, one per rank).

    mpirun -n 2 bash bench/studies/profile_engine.sh 16M      # both ranks under py-spy; summary per rank

Runs ``--warmup`` untimed calls (schedules, slots and buffers cached), then
``--iters`` calls back to back with no barrier in between, so nearly every
sample lands inside ``Communicator.allreduce``.  Prints the mean time per call
and busbw on rank 0.  The result of the last call is checked.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import ddlkernels  # noqa: E402
from ddlkernels.tools.bench import expected, parse_size, pattern  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("size", nargs="?", default="16M", help="buffer bytes (default 16M)")
    ap.add_argument("-n", "--iters", type=int, default=50)
    ap.add_argument("-w", "--warmup", type=int, default=5)
    ap.add_argument("--chunk-bytes", default=None)
    ap.add_argument("--small-bytes", default="0",
                    help="Communicator(small_bytes=...): 0 (default) always runs the ring, the code under study; "
                         "'tuned': None, the size tuner's choice (the path is printed)")
    ap.add_argument("--inplace", action="store_true")
    ap.add_argument("--cma", action="store_true",
                    help="run the single-copy allreduce alone (ddlkernels.algorithms.cma, on the Communicator's window), "
                         "whatever the tuner would choose: for a profiler that sees the kernel's copies (perf)")
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    p, r = comm.Get_size(), comm.Get_rank()
    count = parse_size(a.size) // 4
    x = pattern(count, r, p, np.float32)
    out = np.empty_like(x)
    kw = {"small_bytes": None if a.small_bytes == "tuned" else parse_size(a.small_bytes)}
    if a.chunk_bytes is not None:
        kw["chunk_bytes"] = parse_size(a.chunk_bytes)
    dc = ddlkernels.Communicator(comm, **kw)
    dst = x if a.inplace else out
    if a.cma:
        if "cma" not in dc.algorithms:
            raise SystemExit("--cma: the ranks cannot read each other's memory here (ddlkernels.algorithms.cma.probe)")
        call = dc.algorithms["cma"].engine().fn(x.dtype, count, "sum")
        path = "cma (forced)"
    else:
        call = lambda x, out: dc.allreduce(x, "sum", out=out)  # noqa: E731
        path = None
    for _ in range(a.warmup):
        call(x, dst)
        if a.inplace:
            x[:] = pattern(count, r, p, np.float32)
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        call(x, dst)
    dt = (time.perf_counter() - t0) / a.iters
    dt = comm.allreduce(dt, op=MPI.MAX)
    if not a.inplace:
        assert np.array_equal(out, expected(count, p, np.float32, "sum")), "wrong result"
    if r == 0:
        busbw = count * 4 / dt * 2 * (p - 1) / p / 1e9
        print(f"# {p} ranks, {a.size}: {dt * 1e3:.2f} ms per allreduce, busbw {busbw:.2f} GB/s, "
              f"path {path or dc.last_algorithm}")
    dc.free()


if __name__ == "__main__":
    main()
