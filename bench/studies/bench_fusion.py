"""Tensor fusion and asynchronous progress, each compared with its alternative in the same run.

    mpirun -n 4 python -m mpi4py bench/studies/bench_fusion.py [--rounds 7] [--json out.json]

Part 1, fusion: 200 float32 tensors, sizes log-spaced from 10 B to 4 MB in a
fixed shuffled order (about 62 MB in all, the test's set), reduced
(a) with one ``allreduce_many`` call and (b) with 200 ``allreduce`` calls.
The two alternate round by round (ABBA order, so drift in machine load hits
both alike); each round is timed between barriers on the slowest rank, and
the results of (a) and (b) are compared bitwise every round (the data are
exact, so any correct reduction gives the same bits).  Reported: median
seconds of each and the ratio (b)/(a).  ``--max-bytes 65536`` shrinks the set to
10 B .. 64 KB, where latency rather than bandwidth decides.

Part 2, progress: the gradients of the digits MLP of
``ddlkernels.examples.train`` (85,002 float32 in 3 buckets of <= 128 KiB)
reduced while the rank computes (numpy matmuls standing in for backward,
``--compute-ms`` long, BLAS on one thread), in three ways interleaved round by
round: "blocking" (compute, then ``allreduce_many``), "thread" (start with
``allreduce_many_async(progress="thread")``, compute, wait) and "hooks"
(``progress="hooks"``, compute with a ``poll()`` after every matmul, as the
optimizer's gradient hooks do, wait).  Exposed communication = time of the
round minus the same rank's compute-only time measured in that round.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # ranks share the cores
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import ddlkernels  # noqa: E402
from ddlkernels.asynchronous import progress_engine  # noqa: E402


def sizes_10B_to_4MB(count, itemsize=4, max_bytes=4e6):
    nbytes = np.geomspace(10, max_bytes, count)
    order = np.random.default_rng(7).permutation(count)
    return [max(1, int(b) // itemsize) for b in nbytes[order]]


def exact(n, rank, salt):
    i = np.arange(n, dtype=np.int64)
    return ((((i * 8 + rank) * 37 + salt * 101) % 33) - 16).astype(np.float32) / 4


def timed(comm, fn):
    comm.Barrier()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    return comm.allreduce(dt, op=MPI.MAX), out


def part_fusion(comm, args):
    rank = comm.Get_rank()
    sizes = sizes_10B_to_4MB(args.count, max_bytes=args.max_bytes)
    xs = [exact(n, rank, k) for k, n in enumerate(sizes)]
    fused = lambda: ddlkernels.allreduce_many(xs, "sum")  # noqa: E731
    separate = lambda: [ddlkernels.allreduce(x, "sum") for x in xs]  # noqa: E731
    # Warm up buffers and plans, and run the size tuner's trials to the end for
    # every bucket of both ways (ddlkernels.select.tuner), so the timed rounds compare
    # settled choices; the tuner's state is the same on every rank.
    tuner = ddlkernels.as_communicator(comm).selector.tuners["allreduce"]
    for _ in range(40):
        fused(), separate()
        if "measuring" not in tuner.decisions().values():
            break
    t = {"allreduce_many": [], "separate": []}
    for r in range(args.rounds):
        order = ("allreduce_many", "separate") if r % 2 == 0 else ("separate", "allreduce_many")
        outs = {}
        for name in order:
            dt, outs[name] = timed(comm, fused if name == "allreduce_many" else separate)
            t[name].append(dt)
        same = all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(outs["allreduce_many"], outs["separate"]))
        if not comm.allreduce(same, op=MPI.LAND):
            raise SystemExit("allreduce_many and per-tensor allreduce disagree")
    med = {k: float(np.median(v)) for k, v in t.items()}
    # Each round times both back to back, so the per-round ratio cancels most
    # of the drift in machine load between rounds.
    per_round = [s / f for s, f in zip(t["separate"], t["allreduce_many"])]
    return {
        "per_round_ratio": per_round,
        "tensors": len(xs),
        "bytes": int(sum(x.nbytes for x in xs)),
        "min_bytes": int(min(x.nbytes for x in xs)),
        "max_bytes": int(max(x.nbytes for x in xs)),
        "rounds": args.rounds,
        "median_s": med,
        "all_s": t,
        "ratio_separate_over_fused": med["separate"] / med["allreduce_many"],
    }


def part_progress(comm, args):
    rank = comm.Get_rank()
    hidden = 256
    shapes = [(10,), (10, hidden), (hidden,), (hidden, hidden), (hidden,), (hidden, 64)]  # backward order
    grads = [exact(int(np.prod(s)), rank, k).reshape(s) for k, s in enumerate(shapes)]
    fb = 128 << 10
    a = np.random.default_rng(rank).standard_normal((96, 96)).astype(np.float32)
    for _ in range(50):  # warm up BLAS before calibrating
        a @ a
    one = time.perf_counter()
    for _ in range(200):
        a @ a
    per_mm = (time.perf_counter() - one) / 200
    # The same amount of work on every rank: the calibration of the slowest.
    n_mm = comm.allreduce(max(1, int(args.compute_ms * 1e-3 / per_mm)), op=MPI.MIN)
    eng = {m: progress_engine(None, m) for m in ("thread", "hooks")}

    def compute(poll=None):
        for _ in range(n_mm):
            a @ a
            if poll is not None:
                poll()

    def blocking():
        compute()
        return ddlkernels.allreduce_many(grads, "avg", fusion_bytes=fb)

    def threaded():
        h = ddlkernels.allreduce_many_async(grads, "avg", fusion_bytes=fb, progress="thread")
        compute()
        return h.wait()

    def hooks():
        h = ddlkernels.allreduce_many_async(grads, "avg", fusion_bytes=fb, progress="hooks")
        compute(eng["hooks"].poll)
        return h.wait()

    modes = {"blocking": blocking, "thread": threaded, "hooks": hooks}
    for fn in modes.values():
        fn()
    res = {m: [] for m in modes}
    res["compute_only"] = []
    names = list(modes)
    for r in range(args.rounds * 3):
        comm.Barrier()
        t0 = time.perf_counter()
        compute()
        c = time.perf_counter() - t0
        res["compute_only"].append(comm.allreduce(c, op=MPI.MAX))
        rot = names[r % 3 :] + names[: r % 3]
        for m in rot:
            comm.Barrier()
            t0 = time.perf_counter()
            modes[m]()
            total = time.perf_counter() - t0
            res[m].append(comm.allreduce(total - c, op=MPI.MAX))  # exposed, on the slowest rank
    med = {k: float(np.median(v)) for k, v in res.items()}
    return {"compute_ms_target": args.compute_ms, "matmuls": n_mm, "gradient_bytes": int(sum(g.nbytes for g in grads)),
            "rounds": args.rounds * 3, "median_s": med, "all_s": res}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--max-bytes", type=float, default=4e6,
                    help="largest tensor of part 1 (default 4 MB; e.g. 65536 for a latency-bound set)")
    ap.add_argument("--compute-ms", type=float, default=5.0)
    ap.add_argument("--skip", choices=["fusion", "progress"])
    ap.add_argument("--json")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    out = {"ranks": p, "load_average_start": os.getloadavg(), "args": vars(args)}
    if args.skip != "fusion":
        f = part_fusion(comm, args)
        out["fusion"] = f
        if rank == 0:
            m = f["median_s"]
            print(f"fusion, {p} ranks: {f['tensors']} float32 tensors, {f['min_bytes']} B .. {f['max_bytes']} B, "
                  f"{f['bytes'] / 1e6:.1f} MB in all; median of {f['rounds']} rounds (slowest rank):")
            print(f"  allreduce_many (one call)      {1e3 * m['allreduce_many']:9.2f} ms")
            print(f"  {f['tensors']} separate allreduce calls  {1e3 * m['separate']:9.2f} ms")
            print(f"  ratio separate / fused         {f['ratio_separate_over_fused']:9.2f}x   (results bitwise equal every round)")
            pr = f["per_round_ratio"]
            print(f"  per round: median ratio {np.median(pr):.2f}x, fused faster in {sum(x > 1 for x in pr)} of "
                  f"{len(pr)} rounds (range {min(pr):.2f}x .. {max(pr):.2f}x)")
    if args.skip != "progress":
        g = part_progress(comm, args)
        out["progress"] = g
        if rank == 0:
            m = g["median_s"]
            print(f"progress, {p} ranks: {g['gradient_bytes']} B of MLP gradients (3 buckets) reduced around "
                  f"{1e3 * m['compute_only']:.2f} ms of compute ({g['matmuls']} matmuls); median exposed "
                  f"communication of {g['rounds']} rounds (slowest rank):")
            for k in ("blocking", "thread", "hooks"):
                print(f"  {k:9s} {1e3 * m[k]:9.3f} ms")
    out["load_average_end"] = os.getloadavg()
    if rank == 0:
        print(f"load average (1, 5, 15 min) at start {out['load_average_start']}, end {out['load_average_end']}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
