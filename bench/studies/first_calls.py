"""What a job's first allreduces of one size cost: the size tuner's trials, and Numba compiling what they run.

    python bench/studies/first_calls.py [--ranks 2] [--bytes 16M] [--calls 60] [--jobs 2]

Runs ``mpirun -n RANKS`` itself, ``--jobs`` times in turn, on one new, empty
``NUMBA_CACHE_DIR``: the first job compiles every compiled loop its calls
reach (the tuner tries the ring, the shared-memory window and the
single-copy allreduce at a large size, each compiled on first use) and
leaves them in the cache; the next jobs load them, as every job after the
first on a machine does.  Each job makes ``--calls`` float32 sum allreduces
of ``--bytes`` (out of place, on inputs unique per rank) and prints, from
rank 0, the seconds for all of them, the slowest three calls with the
algorithm each ran, the algorithm the tuner settled on, and whether the
last result is right (the job exits non-zero if not).  Times are the
slowest rank's.

Behind the one-function-per-op loops of ``ddlkernels.kernels.window_loops`` and ``cma_loops`` (its
comment above ``small_fold_sum``): a process compiles only the ops it
calls.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))


def _child(nbytes: int, calls: int) -> None:
    import numpy as np
    from mpi4py import MPI

    import ddlkernels
    from ddlkernels.tools.bench import expected, pattern

    comm = MPI.COMM_WORLD
    p, r = comm.Get_size(), comm.Get_rank()
    count = nbytes // 4
    x = pattern(count, r, p, np.float32)
    out = np.empty_like(x)
    dc = ddlkernels.Communicator(comm)
    times, paths = np.empty(calls), []
    comm.Barrier()
    t0 = time.perf_counter()
    for i in range(calls):
        t = time.perf_counter()
        dc.allreduce(x, "sum", out=out)
        times[i] = time.perf_counter() - t
        paths.append(dc.last_algorithm)
    total = np.array([time.perf_counter() - t0])
    comm.Allreduce(MPI.IN_PLACE, total, MPI.MAX)
    comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    right = comm.allreduce(int(np.array_equal(out, expected(count, p, np.float32, "sum"))), MPI.MIN)
    if r == 0:
        slow = sorted(range(calls), key=lambda i: -times[i])[:3]
        print(json.dumps({"total_s": float(total[0]), "slowest": [[i, float(times[i]), paths[i]] for i in slow],
                          "settled": paths[-1], "right": bool(right)}))
    dc.free()
    if not right:
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--bytes", default="16M")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from ddlkernels.tools.bench import parse_size
    from ddlkernels.tools.bench_cli import find_mpirun

    nbytes = parse_size(args.bytes)
    if args.child:
        return _child(nbytes, args.calls)
    if args.calls < 1 or args.ranks < 1 or args.jobs < 1:
        raise SystemExit("--ranks, --calls and --jobs must be >= 1")
    print(f"# {args.ranks} ranks, {args.calls} allreduces of {args.bytes} float32 per job; "
          f"slowest: (call, seconds, algorithm)")
    with tempfile.TemporaryDirectory(prefix="ddl-numba-cache-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for job in range(1, args.jobs + 1):
            cmd = [find_mpirun(), "-n", str(args.ranks), sys.executable, "-m", "mpi4py", os.path.abspath(__file__),
                   "--child", "--bytes", args.bytes, "--calls", str(args.calls)]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
            if res.returncode != 0 or not lines:
                raise SystemExit(f"job {job} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
            row = json.loads(lines[-1])
            slow = ", ".join(f"({i}, {t:.2f}, {a})" for i, t, a in row["slowest"])
            cold = "empty cache" if job == 1 else "cache of job 1"
            print(f"job {job} ({cold}): {row['total_s']:.1f} s for the {args.calls} calls; slowest {slow}; "
                  f"settled on {row['settled']}; result {'right' if row['right'] else 'WRONG'}", flush=True)


if __name__ == "__main__":
    main()
