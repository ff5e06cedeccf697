"""Two threads per rank making collectives at once, on several Communicators: no crash, no wrong result.

    mpirun -n 3 python -m mpi4py bench/reliability/thread_stress.py [--iters 250]
    python bench/reliability/thread_stress.py --launch [--ranks 2,3] [--runs 5] [--iters 250]

On every rank, thread "train" runs the Horovod pattern on Communicator A:
``allreduce_async`` of a gradient (its progress engine is a Communicator of
its own), then a blocking ``allreduce`` of a metric on A, then ``wait()``.
Thread "eval" at the same time makes allreduces in place and out of place,
reduce_scatters and allgathers on Communicator B, and every fourth
iteration an allreduce through the module function on a third communicator,
whose Communicator it creates lazily on the first such call.  The sizes
cross the tuner's buckets, so both threads create shared-memory windows,
run trials and settle at the same time.  Every value is a multiple of 1/16
unique per rank, element and iteration, so every sum is exact and checked
exactly.  An iteration is 2 collectives in "train" and 3, or 4 every fourth
iteration, in "eval"; ``--iters 250`` makes 1,313 collectives per rank.

``--launch`` runs the job ``--runs`` times per rank count and prints one
line per run: exit status, seconds, collectives per rank, wrong results
(summed over ranks).  A crash shows as a non-zero exit.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
GRADS = (257, 4096, 65536, 300_001)  # float32 elements: the mpi, shm and cma trials, the ring's bucket
EVAL = (1, 1000, 3001, 70_000, 300_000)  # float64 elements


def _values(n, rank, p, it, dtype):
    """Multiples of 1/16 in [-7.8, 7.8], unique per rank, element and iteration: sums over p <= 16 ranks exact."""
    key = np.arange(n, dtype=np.int64) * p + rank + it * 7919
    return (((key * 37) % 251 - 125) / 16.0).astype(dtype)


def _sum(n, p, it, dtype):
    return sum(_values(n, r, p, it, np.float64) for r in range(p)).astype(dtype)


def stress(comm, iters):
    """Run both threads for ``iters`` iterations on every rank of ``comm`` (collective); returns
    ``(collectives made here, wrong results here, errors raised here as text)``."""
    import ddlkernels
    from ddlkernels.asynchronous import progress_engine

    p, rank = comm.Get_size(), comm.Get_rank()
    a, b = ddlkernels.Communicator(comm), ddlkernels.Communicator(comm)
    lazy = comm.Dup()  # the module functions create its Communicator on first use, in thread "eval"
    counts = {"calls": 0, "wrong": 0}
    errors = []
    lock = threading.Lock()

    def tally(calls, wrong):
        with lock:
            counts["calls"] += calls
            counts["wrong"] += wrong

    def train():
        for it in range(iters):
            n = GRADS[it % len(GRADS)]
            g = _values(n, rank, p, it, np.float32)
            h = ddlkernels.allreduce_async(g, comm=a)
            metric = a.allreduce(np.array([float(rank + it)]))
            got = h.wait()
            tally(2, int(not np.array_equal(got, _sum(n, p, it, np.float32)))
                  + int(metric[0] != sum(r + it for r in range(p))))

    def evaluate():
        for it in range(iters):
            n = EVAL[it % len(EVAL)]
            x = _values(n, rank, p, it, np.float64)
            want = _sum(n, p, it, np.float64)
            if it % 2:
                y = b.allreduce(x)
            else:
                y = x.copy()
                b.allreduce(y, out=y)
            lo, hi = b.shard_range(n)
            shard = b.reduce_scatter(x)
            whole = b.allgather(shard, count=n)
            wrong = int(not np.array_equal(y, want)) + int(not np.array_equal(shard, want[lo:hi]))
            wrong += int(not np.array_equal(whole, want))
            calls = 3
            if it % 4 == 0:
                z = ddlkernels.allreduce(x, comm=lazy)
                wrong += int(not np.array_equal(z, want))
                calls += 1
            tally(calls, wrong)

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException:
                errors.append(traceback.format_exc())
        return run

    threads = [threading.Thread(target=guarded(f), name=f.__name__) for f in (train, evaluate)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not errors:
        progress_engine(a).close()
        a.free()
        b.free()
        lazy.Free()  # frees its cached Communicator too
    return counts["calls"], counts["wrong"], errors


def main_job(iters):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    t0 = time.perf_counter()
    calls, wrong, errors = stress(comm, iters)
    for e in errors:
        sys.stderr.write(f"rank {comm.Get_rank()}: {e}\n")
    if errors:
        sys.stderr.flush()
        comm.Abort(1)
    total = comm.allreduce(wrong)
    per_rank = comm.allreduce(calls, op=MPI.MAX)
    if comm.Get_rank() == 0:
        print(f"thread stress: p={comm.Get_size()} iters={iters} collectives per rank={per_rank} "
              f"wrong={total} seconds={time.perf_counter() - t0:.1f}", flush=True)


def launch(ranks, runs, iters):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests"))
    from run_suite import mpi_env, mpirun

    print(f"{'ranks':>5} {'run':>3} {'exit':>4} {'seconds':>8} {'collectives':>11} {'wrong':>5}")
    bad = 0
    for p in ranks:
        for k in range(1, runs + 1):
            t = time.monotonic()
            proc = subprocess.run([mpirun(), "-n", str(p), sys.executable, "-m", "mpi4py", __file__, "--iters",
                                   str(iters)], env=mpi_env(600), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            out = proc.stdout.decode(errors="replace")
            m = re.search(r"collectives per rank=(\d+) wrong=(\d+)", out)
            calls, wrong = (m.group(1), m.group(2)) if m else ("?", "?")
            bad += proc.returncode != 0 or wrong != "0"
            print(f"{p:>5} {k:>3} {proc.returncode:>4} {time.monotonic() - t:>8.1f} {calls:>11} {wrong:>5}",
                  flush=True)
            if proc.returncode:
                print(out[-3000:])
    print(f"thread stress: {len(ranks) * runs} runs, {bad} crashed or wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=250)
    ap.add_argument("--launch", action="store_true")
    ap.add_argument("--ranks", default="2,3")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if args.launch:
        sys.exit(launch([int(r) for r in args.ranks.split(",")], args.runs, args.iters))
    main_job(args.iters)
