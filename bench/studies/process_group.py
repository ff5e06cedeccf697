"""The ``ddlkernels`` torch process group beside gloo on CPU tensors, in one job, call by call.

    mpirun -n 2 python -m mpi4py bench/studies/process_group.py [--sizes 4K,256K,4M,64M] [--repeat 10]

What a user who swaps ``init_process_group("gloo")`` for ``"ddlkernels"``
gets on host tensors: each line is one ``torch.distributed`` call on float32
CPU tensors of the size shown (all_reduce's tensor, all_gather's output,
reduce_scatter's input, broadcast's tensor, one send's message), made
blocking (``async_op=False``) over the ddlkernels group (the default group)
and over a gloo group of the same ranks, the two alternated.  A time is the
slowest rank's (each call starts after an MPI barrier); the table shows the
median of ``--repeat`` and gloo / ddlkernels (above 1: ddlkernels is
faster).  send/recv is a ping-pong between ranks 0 and 1 (half a round
trip).  Every result is compared bit for bit with gloo's (integer-valued
data: every sum is exact in any order); "wrong" counts the calls that differ.
"""

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import ddlkernels.torch as ddt
from ddlkernels.tools.bench.sizes import format_size, parse_size

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names warn): the new where present
GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()


def data(n, salt):
    """``n`` float32 integers unique per rank and element (mod 4093), so that every sum is exact."""
    return ((torch.arange(n, dtype=torch.int64) * P + RANK + 7919 * salt) % 4093).to(torch.float32)


def calls(nbytes):
    """(name, make(), run(state, group), result(state)) of each call at ``nbytes``."""
    n = max(nbytes // 4 // P * P, P)  # elements, a multiple of the rank count

    def all_reduce():
        return {"x": data(n, 1)}

    def gather():
        return {"x": data(n // P, 2), "y": torch.empty(n)}

    def scatter():
        return {"x": data(n, 3), "y": torch.empty(n // P)}

    def broadcast():
        return {"x": data(n, 4)}

    def ping():
        return {"x": data(n, 5)}

    def pong(s, g):
        if RANK == 0:
            dist.send(s["x"], 1, group=g)
            dist.recv(s["x"], 1, group=g)
        elif RANK == 1:
            dist.recv(s["x"], 0, group=g)
            dist.send(s["x"], 0, group=g)

    return [("all_reduce", all_reduce, lambda s, g: dist.all_reduce(s["x"], group=g), "x"),
            (GATHER.__name__, gather, lambda s, g: GATHER(s["y"], s["x"], group=g), "y"),
            (SCATTER.__name__, scatter, lambda s, g: SCATTER(s["y"], s["x"], group=g), "y"),
            ("broadcast", broadcast, lambda s, g: dist.broadcast(s["x"], 0, group=g), "x"),
            *([("send/recv", ping, pong, "x")] if P > 1 else [])]


def timed(run, state, group):
    """The slowest rank's seconds for ``run(state, group)``, every rank starting together."""
    COMM.Barrier()
    t0 = time.perf_counter()
    run(state, group)
    return COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4K,256K,4M,64M", help="comma list of sizes (bytes, K, M)")
    ap.add_argument("--repeat", type=int, default=10, help="timed calls of each kind (median shown)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls first (the tuner's trials among them)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ddt.init_process_group("ddlkernels")
    gloo = dist.new_group(backend="gloo")
    ours = dist.group.WORLD
    if RANK == 0:
        print(f"# command: mpirun -n {P} python -m mpi4py bench/studies/process_group.py --sizes {args.sizes} "
              f"--repeat {args.repeat} --warmup {args.warmup}")
        print(f"# date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}; cpus: {os.cpu_count()}; "
              f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        mpi = MPI.Get_library_version().splitlines()[0].rstrip("\0")
        print(f"# torch {torch.__version__}; {mpi}; {P} ranks, float32 CPU tensors; median of {args.repeat}, "
              f"slowest rank")
        print(f"{'call':24s}{'size':>10s}{'ddlkernels ms':>15s}{'gloo ms':>10s}{'gloo/ddl':>10s}{'wrong':>7s}")
    wrong_all = 0
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        for name, make, run, out in calls(nbytes):
            times = {"ddlkernels": [], "gloo": []}
            wrong = 0
            for i in range(args.warmup + args.repeat):
                results = {}
                for label, group in (("ddlkernels", ours), ("gloo", gloo))[:: 1 if i % 2 else -1]:
                    state = make()
                    t = timed(run, state, group)
                    if i >= args.warmup:
                        times[label].append(t)
                    results[label] = state[out]
                wrong += not torch.equal(results["ddlkernels"], results["gloo"])
            wrong = COMM.allreduce(wrong, op=MPI.SUM)
            wrong_all += wrong
            a, b = (statistics.median(times[k]) for k in ("ddlkernels", "gloo"))
            if name == "send/recv":
                a, b = a / 2, b / 2
            if RANK == 0:
                print(f"{name:24s}{format_size(nbytes):>10s}{a * 1e3:15.3f}{b * 1e3:10.3f}{b / a:10.2f}{wrong:7d}",
                      flush=True)
    if RANK == 0:
        print(f"\nwrong results in all: {wrong_all}")
    COMM.Barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
