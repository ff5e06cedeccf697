"""Cost of validate=True and of timeout= relative to the same allreduce without them, in one run.

    mpirun -n 4 python -m mpi4py bench/studies/validate_cost.py [--sizes 256,16K,256K,4M] [--reps 30]

For each message size (float32 elements) the three variants -- plain,
``validate=True``, ``timeout=60`` -- are run interleaved, ``reps`` times
each after a warm-up, every result checked; each repetition is timed as the
maximum over ranks (a collective is as slow as its slowest rank).  The table
gives the median (and minimum) time of each variant and the ratios to
plain: interleaving cancels slow drifts of a shared machine, and the minimum
is the least disturbed by other jobs.
Sizes below the small-message threshold (fixed at 64 KiB here) run MPI's own
allreduce, where the validation allgather is a visible fraction; above it
the ring runs and the fixed cost of one 128-byte allgather vanishes.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KM" else s) * mult


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256,4K,256K,1M,4M", help="float32 element counts")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--small-bytes", type=int, default=64 << 10,
                    help="fixed MPI/ring threshold (the default size tuner could pick differently per variant run)")
    ap.add_argument("--tuned", action="store_true",
                    help="no fixed threshold: each variant runs the algorithm the tuner picks for it, as a user's "
                         "call does (the path column names plain's / timeout's)")
    args = ap.parse_args(argv)
    from mpi4py import MPI

    import ddlkernels

    world = MPI.COMM_WORLD
    comm = ddlkernels.Communicator(world, **({} if args.tuned else {"small_bytes": args.small_bytes}))
    p, rank = comm.size, comm.rank
    variants = [("plain", {}), ("validate", {"validate": True}), ("timeout", {"timeout": 60.0})]
    rows = []
    wrong = 0
    for n in [parse_size(s) for s in args.sizes.split(",")]:
        x = ((np.arange(n) + rank) % 13).astype(np.float32)
        expect = sum(((np.arange(n) + r) % 13) for r in range(p)).astype(np.float32)
        out = np.empty_like(x)
        times = {name: [] for name, _ in variants}
        algos = {}
        for rep in range(args.reps + 3):
            for name, kw in variants:
                world.Barrier()
                t = time.perf_counter()
                comm.allreduce(x, "sum", out=out, **kw)
                dt = world.allreduce(time.perf_counter() - t, op=MPI.MAX)
                algos[name] = comm.last_algorithm
                if rep >= 3:
                    times[name].append(dt)
                if not np.array_equal(out, expect):
                    wrong += 1
        med = {k: float(np.median(v)) for k, v in times.items()}
        best = {k: float(np.min(v)) for k, v in times.items()}
        path = algos["timeout"] if algos["plain"] == algos["timeout"] else f"{algos['plain']}/{algos['timeout']}"
        rows.append((n, path, med, best))
    wrong = world.allreduce(wrong, op=MPI.SUM)
    if rank == 0:
        print(f"validate/timeout cost, p={p}, float32 sum, {args.reps} interleaved reps (max over ranks); "
              "median and (min)")
        print(f"{'elements':>10} {'bytes':>10} {'path':>9} {'plain us':>18} {'validate us':>18} {'ratio':>12} "
              f"{'timeout us':>18} {'ratio':>12}")

        def cell(m, b, k, scale=1e6):
            return f"{m[k] * scale:.1f} ({b[k] * scale:.1f})"

        for n, algo, med, best in rows:
            rv = f"{med['validate'] / med['plain']:.2f} ({best['validate'] / best['plain']:.2f})"
            rt = f"{med['timeout'] / med['plain']:.2f} ({best['timeout'] / best['plain']:.2f})"
            print(f"{n:>10} {n * 4:>10} {algo:>9} {cell(med, best, 'plain'):>18} {cell(med, best, 'validate'):>18} "
                  f"{rv:>12} {cell(med, best, 'timeout'):>18} {rt:>12}")
        print(f"wrong results: {wrong}")
    comm.free()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
