"""Why the size tuner times blocks of calls: per-rank medians of candidates timed one call in turn vs in blocks.

    mpirun -n 4 python -m mpi4py bench/studies/tuner_trials.py [--sizes 4K,16K,64K]

Three small-message candidates of ddlkernels' tuner -- MPI_Allreduce,
MPI_Iallreduce + Wait, the shared-memory allreduce -- are timed per call on
every rank, as the tuner does, in two orders: "turns" (one call of each in
turn, 17 rounds) and "blocks" (5 calls of each in turn, the first of each
block untimed, 4 rounds: ddlkernels.select.tuner's trials below 256 KiB).  Printed:
each candidate's median per rank.  Timed alone after a different algorithm,
a call's time on one rank depends on when its peers left that other call;
in a block, every rank's time per call tends to the same period.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from ddlkernels.tools.bench import format_size, parse_size
from ddlkernels.algorithms.shm import ShmAllreduce
from ddlkernels.backends import backend_for


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4K,16K,64K")
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    shm = ShmAllreduce(comm)
    reduce = backend_for(np.empty(0)).reduce
    if rank == 0:
        print(f"# {p} ranks: median us per call of each candidate, on each rank")
    for nb in (parse_size(s) for s in a.sizes.split(",")):
        x = np.arange(nb // 4, dtype=np.float32) + rank
        y = np.empty_like(x)
        cands = {"mpi": lambda: comm.Allreduce(x, y, MPI.SUM),
                 "nbc": lambda: comm.Iallreduce(x, y, MPI.SUM).Wait(),
                 "shm": lambda: shm.run(x, y, "sum", reduce)}
        for f in cands.values():
            f()
        comm.Barrier()
        for order, (rounds, block) in (("turns", (17, 1)), ("blocks", (4, 5))):
            times = {k: [] for k in cands}
            for _ in range(rounds):
                for k, f in cands.items():
                    for i in range(block):
                        t0 = time.perf_counter()
                        f()
                        dt = time.perf_counter() - t0
                        if block == 1 or i > 0:
                            times[k].append(dt * 1e6)
            med = {k: float(np.median(v)) for k, v in times.items()}
            rows = comm.gather(med)
            if rank == 0:
                cols = "  ".join(f"{k}: " + " ".join(f"{r[k]:5.1f}" for r in rows) for k in cands)
                print(f"{format_size(nb):>5} {order:6s}  {cols}", flush=True)
    shm.free()


if __name__ == "__main__":
    main()
