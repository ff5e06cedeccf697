"""Does the same allreduce run at one speed on this machine?  Blocks of calls, each block's fastest/median.

    mpirun -n 2 python bench/studies/two_speeds.py [--bytes 1M] [--blocks 12] [--calls 200]

Prints one "fastest/median" pair (microseconds, slowest rank) per block of
``--calls`` calls of ``ddlkernels.allreduce`` (flat ring, float32, out of
place into a reused output), with a 0.3 s pause between blocks.  On the
2-core machine the pairs sit on plateaus (e.g. 150 vs 220 us for 1 MiB at 2
ranks) that change every few seconds: bench/results/predict_vs_measured.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import ddlkernels
from ddlkernels.tools.bench import parse_size


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", default="1M")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    dc = ddlkernels.Communicator(comm)
    x = np.ones(parse_size(args.bytes) // 4, np.float32)
    y = np.empty_like(x)
    blocks = []
    for _ in range(args.blocks):
        ts = []
        for _ in range(args.calls):
            comm.Barrier()
            t0 = time.perf_counter()
            dc.allreduce(x, out=y, dims=(p,))
            ts.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        blocks.append(f"{min(ts) * 1e6:.0f}/{np.median(ts) * 1e6:.0f}")
        time.sleep(0.3)
    if comm.Get_rank() == 0:
        print(f"{p} ranks, {x.nbytes} B, fastest/median us per block of {args.calls} calls:")
        print(" ".join(blocks))
    dc.free()


if __name__ == "__main__":
    main()
