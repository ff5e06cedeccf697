"""Does the tuner's watch follow the machine?  A long loop of one size, beside both algorithms forced.

    mpirun -n 2 python -m mpi4py bench/studies/tuner_watch.py [--bytes 16M] [--seconds 60] [--calls 10]

Rounds of three blocks of ``--calls`` allreduces each, in turn: ddlkernels
as shipped (the size tuner measures the ring against the shared-memory
window, settles, and from 1 MiB keeps watching: ``ddlkernels.select.tuner``), the
ring forced (``shm=False, small_bytes=0``) and the window forced
(``shm=True``), all out of place into a reused output, float32 sum.  Each
block's time per call is the slowest rank's median.  One line per round:
seconds since the start, what the tuned Communicator ran, the three times,
and how many times the tuner re-measured the size so far.  The summary
counts the rounds where the tuned line was within 10 % of the faster forced
one (a round spent re-measuring counts as it ran), and why the tuner
re-measured: the watched calls slowed down, or ``EXPLORE_CHECKS`` checks in
a row found nothing.  Every result is checked
against the first.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import ddlkernels
from ddlkernels.tools.bench import parse_size


def _block(comm, dc, x, out, calls):
    ts = []
    algos = set()
    for _ in range(calls):
        comm.Barrier()
        t0 = time.perf_counter()
        dc.allreduce(x, "sum", out=out)
        ts.append(time.perf_counter() - t0)
        algos.add(dc.last_algorithm)
    return comm.allreduce(float(np.median(ts)), op=MPI.MAX), algos


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", default="16M")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--calls", type=int, default=10, help="calls per block")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    n = parse_size(args.bytes) // 4
    x = (np.arange(n, dtype=np.float32) % 1024) + rank
    expect = sum((np.arange(n, dtype=np.float32) % 1024) + r for r in range(comm.Get_size())).astype(np.float32)
    outs = [np.empty_like(x) for _ in range(3)]
    tuned = ddlkernels.Communicator(comm)
    ring = ddlkernels.Communicator(comm, shm=False, small_bytes=0)
    shm = ddlkernels.Communicator(comm, shm=True)
    if rank == 0:
        print(f"# {comm.Get_size()} ranks, {args.bytes} float32 sum, blocks of {args.calls} calls, "
              f"ms per call (median of a block, slowest rank)")
        print(f"# {'s':>6} {'tuned ran':>14} {'tuned':>8} {'ring':>8} {'shm':>8} {'re-measured':>12}")
    start = time.perf_counter()
    reopened, was_tuning, rounds, close, wrong = 0, True, 0, 0, 0
    while True:
        done = comm.bcast(time.perf_counter() - start > args.seconds if rank == 0 else None)
        if done:
            break
        t_tuned, algos = _block(comm, tuned, x, outs[0], args.calls)
        t_ring, _ = _block(comm, ring, x, outs[1], args.calls)
        t_shm, _ = _block(comm, shm, x, outs[2], args.calls)
        wrong += sum(int(np.count_nonzero(o != expect)) for o in outs)
        tuning = tuned.tuning(x)
        if tuning and not was_tuning:
            reopened += 1
        was_tuning = tuning
        rounds += 1
        close += t_tuned <= 1.1 * min(t_ring, t_shm)
        if rank == 0:
            print(f"  {time.perf_counter() - start:6.1f} {'/'.join(sorted(algos)):>14} {t_tuned * 1e3:8.3f} "
                  f"{t_ring * 1e3:8.3f} {t_shm * 1e3:8.3f} {reopened:12d}", flush=True)
    wrong = comm.allreduce(wrong, op=MPI.SUM)
    if rank == 0:
        why = tuned.selector.tuners["allreduce"].reopens
        print(f"# rounds {rounds}; tuned within 10 % of the faster forced line in {close}; "
              f"re-measured {reopened} times ({why['slower']} after its calls slowed down, {why['quiet']} after "
              f"quiet checks); #wrong {wrong}")
    for dc in (tuned, ring, shm):
        dc.free()
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
