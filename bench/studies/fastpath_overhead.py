"""Python cost per call of ddlkernels' small-message fast path, with MPI taken out of the measurement.

    python bench/studies/fastpath_overhead.py [--bytes 4K] [--calls 100000]

One process.  The Communicator's MPI communicator is replaced by a stand-in
whose ``Allreduce``/``Iallreduce`` return at once, and the size tuner's
decision for this size is set to MPI's allreduce, so what is timed is exactly
the Python that ``Communicator.allreduce(x, "sum", out=y)`` and
``Communicator.Allreduce(x, y, MPI.SUM)`` run around the MPI call, and
likewise ``reduce_scatter`` and ``allgather`` (of x split 4 ways) settled on
``MPI_Reduce_scatter_block`` / ``MPI_Allgather``.  The same stand-in called
directly is the floor.  Fastest of 5 repeats, per call.

    mpirun -n 2 python -m mpi4py bench/fastpath_overhead.py --real [--bytes 1K]

With real MPI instead: ``Communicator.allreduce`` settled on MPI's allreduce
(a fixed ``small_bytes``), out of place and in place, beside mpi4py's own
``Allreduce`` of the same buffers (out of place, and with ``MPI.IN_PLACE``),
blocks of 3000 calls of each in turn, the median of 7 blocks, the slowest
rank's.  The difference is what the library adds to the MPI call.
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np
from mpi4py import MPI

import ddlkernels
from ddlkernels.tools.bench import parse_size


class _NoMPI:
    """Stands in for the communicator: every call returns at once."""

    def Allreduce(self, sendbuf, recvbuf, op):
        pass

    def Iallreduce(self, sendbuf, recvbuf, op):
        return self

    def Wait(self):
        pass

    def Reduce_scatter_block(self, sendbuf, recvbuf, op):
        pass

    def Allgather(self, sendbuf, recvbuf):
        pass


def real(nbytes):
    """``--real``: the fast path over real MPI, beside mpi4py's own call (see the module comment)."""
    import time

    comm = MPI.COMM_WORLD
    dc = ddlkernels.Communicator(comm, small_bytes=1 << 30)
    x = np.ones(nbytes // 4, np.float32)
    y = np.empty_like(x)
    cases = {"Communicator.allreduce(x, out=y)": lambda: dc.allreduce(x, out=y),
             "Communicator.allreduce(y, out=y)": lambda: dc.allreduce(y, out=y),
             "comm.Allreduce(x, y)": lambda: comm.Allreduce(x, y),
             "comm.Allreduce(MPI.IN_PLACE, y)": lambda: comm.Allreduce(MPI.IN_PLACE, y)}
    times = {name: [] for name in cases}
    for _ in range(7):
        for name, fn in cases.items():
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(3000):
                fn()
            times[name].append((time.perf_counter() - t) / 3000)
    med = {name: comm.allreduce(float(np.median(v)), op=MPI.MAX) for name, v in times.items()}
    if comm.Get_rank() == 0:
        print(f"p={comm.Get_size()}, {nbytes} B float32 sum, median of 7 blocks of 3000 calls, slowest rank")
        for name, t in med.items():
            print(f"{name:42s} {t * 1e6:7.2f} us per call")
        for mine, theirs in (("Communicator.allreduce(x, out=y)", "comm.Allreduce(x, y)"),
                             ("Communicator.allreduce(y, out=y)", "comm.Allreduce(MPI.IN_PLACE, y)")):
            print(f"{mine} - {theirs}: {(med[mine] - med[theirs]) * 1e6:.2f} us")
    dc.free()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", default="4K")
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--real", action="store_true", help="real MPI under mpirun (see the module comment)")
    args = ap.parse_args()
    if args.real:
        return real(parse_size(args.bytes))
    dc = ddlkernels.Communicator(MPI.COMM_WORLD)
    x = np.ones(parse_size(args.bytes) // 4, np.float32)
    y = np.empty_like(x)
    # As on a multi-rank communicator whose tuner settled this size on MPI_Allreduce.
    dc.comm, dc.size, dc._fast_ok = _NoMPI(), 4, True
    c = x.size // dc.size
    bounds = [(r * c, (r + 1) * c) for r in range(dc.size)]  # 4 equal shards
    dc._all_shards, dc.rank_ordered = (lambda count, dims: bounds), (lambda count: True)
    # reduce_scatter and allgather of the same buffer, settled on MPI's own calls the same way.
    for kind in ("allreduce", "reduce_scatter", "allgather"):
        dc.settle(x, "mpi", collective=kind)
    shard = np.empty(c, np.float32)
    stand_in = _NoMPI()
    cases = {
        "Communicator.allreduce(x, 'sum', out=y)": lambda: dc.allreduce(x, "sum", out=y),
        "Communicator.Allreduce(x, y, MPI.SUM)": lambda: dc.Allreduce(x, y, MPI.SUM),
        "stand-in Allreduce called directly": lambda: stand_in.Allreduce(x, y, MPI.SUM),
        "Communicator.reduce_scatter(x, out=s)": lambda: dc.reduce_scatter(x, out=shard),
        "stand-in Reduce_scatter_block directly": lambda: stand_in.Reduce_scatter_block(x, shard, MPI.SUM),
        "Communicator.allgather(s, count=n, out=y)": lambda: dc.allgather(shard, count=x.size, out=y),
        "stand-in Allgather directly": lambda: stand_in.Allgather(shard, y),
    }
    for name, fn in cases.items():
        fn()
        assert name.startswith("stand-in") or dc.last_algorithm == "mpi", f"{name}: the fast path did not run"
        best = min(timeit.repeat(fn, number=args.calls, repeat=5)) / args.calls
        print(f"{name:42s} {best * 1e6:7.3f} us per call")


if __name__ == "__main__":
    main()
