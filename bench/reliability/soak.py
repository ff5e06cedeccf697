"""Soak: back-to-back allreduces of mixed sizes and dtypes, every result checked, resident memory tracked.

    mpirun -n 4 python -m mpi4py bench/reliability/soak.py [--steps 10000] [--checkpoints 1000,10000]

Every rank builds the same pseudo-random sequence of calls (size, dtype,
op, in place or not, chunk size, dims) from one seed, so no communication
is needed to agree on it.  Inputs are small integers, unique per rank and
element, x_r[i] = (i + step) % 7 + r, so every result is known exactly on
every rank without any reference reduction:

    sum  p ((i + step) % 7) + p (p - 1) / 2       (exact in every dtype, bfloat16 included, for p <= 8)
    max  (i + step) % 7 + p - 1                   min  (i + step) % 7
    avg  (integers) floor(sum / p)

Sizes mix a fixed set (0, 1, primes, 64 Ki, 1 Mi + 3 elements) with sizes
drawn uniformly up to 300,000, so the plan and schedule caches see
thousands of distinct sizes, as a framework bucketing gradients might.
Resident set size (``/proc/self/statm``) is read after ``gc.collect()`` at
each checkpoint, after the step's own arrays are released; the output gives the largest growth over ranks between
the first and the last checkpoint, and the number of wrong results.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np

FIXED_SIZES = [0, 1, 3, 7, 4097, 65536, 65537, 131071, (1 << 20) + 3]
CHUNKS = [None, None, 64 << 10, 256 << 10]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def expected(op, base, p, dt):
    """The exact result for inputs base + r, r = 0..p-1 (base: int64 array)."""
    if op == "sum":
        e = p * base + p * (p - 1) // 2
    elif op == "max":
        e = base + p - 1
    elif op == "min":
        e = base
    else:  # avg, integers only
        e = (p * base + p * (p - 1) // 2) // p
    return e.astype(dt)


def soak(comm, steps: int, checkpoints, seed: int = 2026, log=None, max_n: int = 300_000):
    """Run the soak on a ``ddlkernels.Communicator``; return a dict of results (collective).

    ``max_n`` caps the element count (the short test in tests/mpi uses a small one).
    """
    import ddlkernels

    p, rank = comm.size, comm.rank
    dtypes = list(ddlkernels.SUPPORTED_DTYPES)
    dims_choices = [None, (p,)]
    rng = np.random.default_rng(seed)  # same sequence on every rank
    wrong = 0
    first_bad = None
    rss = {}
    t0 = time.perf_counter()
    checkpoints = sorted(set(checkpoints))
    for step in range(1, steps + 1):
        n = int(FIXED_SIZES[rng.integers(len(FIXED_SIZES))]) if rng.random() < 0.5 else int(rng.integers(0, 300_000))
        if n > 200_000 and rng.random() < 0.7:
            n //= 16  # keep the mean size moderate: the point is the count of calls
        n = min(n, max_n)
        dt = dtypes[rng.integers(len(dtypes))]
        ops = ["sum", "max", "min"] + (["avg"] if dt.kind in "iu" else [])
        op = ops[rng.integers(len(ops))]
        inplace = bool(rng.integers(2))
        chunk = CHUNKS[rng.integers(len(CHUNKS))]
        dims = dims_choices[rng.integers(len(dims_choices))]
        base = (np.arange(n, dtype=np.int64) + step) % 7
        x = (base + rank).astype(dt)
        if inplace:
            y = comm.allreduce(x, op, out=x, dims=dims, chunk_bytes=chunk)
        else:
            y = comm.allreduce(x, op, dims=dims, chunk_bytes=chunk)
        if not np.array_equal(y, expected(op, base, p, dt)):
            wrong += 1
            if first_bad is None:
                first_bad = f"step {step}: n={n} {dt} {op} inplace={inplace} chunk={chunk} dims={dims}"
        # Measure what the library retains between calls, not this call's own
        # arrays (a 1 Mi-element float64 step would otherwise add 16 MiB).
        del x, y, base
        if step in checkpoints:
            gc.collect()
            rss[step] = rss_bytes()
            if log:
                log(f"step {step}: rss {rss[step] / 2**20:.1f} MiB, {time.perf_counter() - t0:.1f} s, "
                    f"plans and schedules {len(comm.ring_plans)}, buffers {len(comm._buffers)}")
    from mpi4py import MPI

    total_wrong = comm.mpi_comm.allreduce(wrong, op=MPI.SUM)
    a, b = checkpoints[0], checkpoints[-1]
    growth = (rss[b] - rss[a]) / rss[a]
    all_growth = comm.mpi_comm.allgather(growth)
    all_rss = comm.mpi_comm.allgather((rss[a], rss[b]))
    return {
        "steps": steps,
        "wrong": total_wrong,
        "first_bad": first_bad,
        "growth_max": max(all_growth),
        "rss": all_rss,
        "from": a,
        "to": b,
        "seconds": time.perf_counter() - t0,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--checkpoints", default="1000,10000")
    args = ap.parse_args(argv)
    import ddlkernels
    from mpi4py import MPI

    comm = ddlkernels.Communicator(MPI.COMM_WORLD)
    log = print if comm.rank == 0 else None
    res = soak(comm, args.steps, [int(c) for c in args.checkpoints.split(",")], log=log)
    if comm.rank == 0:
        for r, (a, b) in enumerate(res["rss"]):
            print(f"rank {r}: rss {a / 2**20:.1f} MiB at step {res['from']} -> {b / 2**20:.1f} MiB at step "
                  f"{res['to']} ({(b - a) / a:+.2%})")
        print(f"soak: p={comm.size} {res['steps']} allreduces, {res['wrong']} wrong, "
              f"rss growth {res['growth_max']:+.2%} (max over ranks, step {res['from']} -> {res['to']}), "
              f"{res['seconds']:.0f} s" + (f", first wrong: {res['first_bad']}" if res["first_bad"] else ""))
    comm.free()
    return 0 if res["wrong"] == 0 and res["growth_max"] < 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
