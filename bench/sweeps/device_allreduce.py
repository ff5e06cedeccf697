"""Allreduce of GPU buffers: ddlkernels beside what a GPU user would otherwise run, in one run, every result checked.

    mpirun -n 2 python bench/sweeps/device_allreduce.py --sizes 1M,64M,256M -n 10 --json r.json

Lines (each where it can run here; the header says which could not, and why):

    ddlkernels          CuPy buffers, the library's own choice (its tuner settled first)
    ddlkernels ipc      ipc=True: ranks of one node reduce each other's memory over CUDA IPC
    ddlkernels staged   ipc=False, cuda_aware=False: the ring through pinned host memory
    hand-rolled         cupy.asnumpy into pinned memory, MPI_Allreduce, copy back: the loop users write
    gloo                torch.distributed's gloo on CUDA tensors
    nccl                torch.distributed's NCCL, when every rank of the node has a GPU of its own
    ddlkernels host     the same bytes as numpy arrays (where the data would be without a GPU)
    device copy         every rank copies its buffer once on its GPU: a floor no allreduce beats

Timing: barrier, t0, one call, the device synchronized, t1; an iteration's time is the
slowest rank's; the table shows the median.  busbw = bytes / t x 2 (p - 1) / p (nccl-tests).
Inputs are small integers that move with rank and element, so every sum is exact and a
misplaced chunk shows: any wrong element makes the run exit 1.  Needs CuPy and a CUDA
device on every rank (``ddlkernels.local_device`` picks it); exits 2 without.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import ddlkernels  # noqa: E402
from ddlkernels.tools.bench import expected, parse_size, pattern  # noqa: E402

COMM = MPI.COMM_WORLD
P, R = COMM.Get_size(), COMM.Get_rank()


def say(*a):
    if R == 0:
        print(*a, flush=True)


def _cupy():
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            return None, "no CUDA device"
        return cp, None
    except Exception as exc:  # noqa: BLE001 -- no CuPy, no driver: the reason is the message
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0]


def _torch_dist(cp, own_gpu):
    """torch.distributed's process groups on this job's ranks (env rendezvous on rank 0's host), or a reason."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        return None, None, f"no torch ({exc})"
    if not torch.cuda.is_available():
        return None, None, "torch has no CUDA"
    port = COMM.bcast(_free_port() if R == 0 else None)
    host = COMM.bcast(socket.gethostname() if R == 0 else None)
    os.environ.setdefault("MASTER_ADDR", host)
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.cuda.set_device(cp.cuda.runtime.getDevice())
    dist.init_process_group("gloo", rank=R, world_size=P)
    nccl = dist.new_group(backend="nccl") if own_gpu and dist.is_nccl_available() else None
    return torch, nccl, None


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def lines(cp, args):
    """name -> (setup(n) -> state, run(state), result(state) -> host array); and why others are missing."""
    one_node = COMM.allreduce(ddlkernels.local_size()) == P * P
    gpus = COMM.allgather((socket.gethostname(), cp.cuda.Device().pci_bus_id))
    own_gpu = len(set(gpus)) == P  # no two ranks on one GPU
    out, missing = {}, {}
    tuned = ddlkernels.Communicator(COMM, shm=False)
    ipc = ddlkernels.Communicator(COMM, shm=False, ipc=True) if one_node else None
    staged = ddlkernels.Communicator(COMM, shm=False, ipc=False, cuda_aware=False)
    host = ddlkernels.Communicator(COMM)
    dt = np.dtype(args.dtype)

    def dev(n):
        return {"x": cp.asarray(pattern(n, R, P, dt)), "out": cp.empty(n, dt)}

    def ddl(c):
        return (dev, lambda s: c.allreduce(s["x"], "sum", out=s["out"]), lambda s: cp.asnumpy(s["out"]))

    out["ddlkernels"] = ddl(tuned)
    if ipc is not None and "ipc" in ipc.algorithms:
        out["ddlkernels ipc"] = ddl(ipc)
    else:
        missing["ddlkernels ipc"] = "the ranks span several nodes"
    out["ddlkernels staged"] = ddl(staged)

    def hand_setup(n):
        import cupyx

        s = dev(n)
        s["h"] = cupyx.empty_pinned((n,), dt)
        s["r"] = cupyx.empty_pinned((n,), dt)
        return s

    def hand_run(s):
        cp.asnumpy(s["x"], out=s["h"])
        COMM.Allreduce(s["h"], s["r"], MPI.SUM)
        s["out"].set(s["r"])

    out["hand-rolled"] = (hand_setup, hand_run, lambda s: cp.asnumpy(s["out"]))
    torch, nccl, why = _torch_dist(cp, own_gpu)
    if torch is None:
        missing["gloo"] = missing["nccl"] = why
    else:
        import torch.distributed as dist

        def t_setup(n):
            return {"t": torch.as_tensor(pattern(n, R, P, dt), device="cuda"), "n": n}

        def t_run(group):
            def run(s):
                s["y"] = s["t"].clone()
                dist.all_reduce(s["y"], group=group)
            return run

        out["gloo"] = (t_setup, t_run(None), lambda s: s["y"].cpu().numpy())
        if nccl is not None:
            out["nccl"] = (t_setup, t_run(nccl), lambda s: s["y"].cpu().numpy())
        else:
            missing["nccl"] = "the ranks of a node share a GPU (NCCL needs one each)"
    out["ddlkernels host"] = (lambda n: {"x": pattern(n, R, P, dt), "out": np.empty(n, dt)},
                              lambda s: host.allreduce(s["x"], "sum", out=s["out"]), lambda s: s["out"])
    out["device copy"] = (dev, lambda s: cp.copyto(s["out"], s["x"]), None)
    return out, missing, (tuned, ipc, staged, host)


def measure(cp, name, line, n, args):
    setup, run, result = line
    s = setup(n)
    want = expected(n, P, args.dtype, "sum")
    wrong = 0
    for _ in range(args.warmup):
        run(s)
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(args.iters):
        COMM.Barrier()
        t0 = time.perf_counter()
        run(s)
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
        if result is not None:
            got = result(s)
            wrong += int(np.count_nonzero(got != want))
    t = COMM.allreduce(float(np.median(times)), op=MPI.MAX)
    return t, COMM.allreduce(wrong)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,64M,256M", help="buffer sizes in bytes, comma list (K/M/G)")
    ap.add_argument("-d", "--dtype", default="float32")
    ap.add_argument("-n", "--iters", type=int, default=10)
    ap.add_argument("-w", "--warmup", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the rows as JSON here (rank 0)")
    args = ap.parse_args(argv)
    cp, why = _cupy()
    if COMM.allreduce(cp is None):
        say(f"device_allreduce: no GPU to measure on ({why or 'not on every rank'}); nothing was timed")
        return 2
    cp.cuda.Device(ddlkernels.local_device(cp.cuda.runtime.getDeviceCount())).use()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    table, missing, comms = lines(cp, args)
    say(f"# {P} ranks, {gpu} (device per rank: {COMM.allgather(cp.cuda.runtime.getDevice())}), {args.dtype}, "
        f"median of {args.iters} after {args.warmup} warmup, slowest rank; busbw = bytes/t x 2(p-1)/p")
    for name, reason in missing.items():
        say(f"# {name}: not run ({reason})")
    rows, bad = [], 0
    for size in [parse_size(x) for x in args.sizes.split(",")]:
        n = size // np.dtype(args.dtype).itemsize
        tuned = comms[0]
        x = cp.asarray(pattern(n, R, P, args.dtype))
        while tuned.tuning(x):  # the library's own line runs what its tuner settled on
            tuned.allreduce(x, "sum")
        row = {"bytes": size, "lines": {}}
        for name, line in table.items():
            t, wrong = measure(cp, name, line, n, args)
            bad += wrong
            row["lines"][name] = {"ms": t * 1e3, "busbw_GBps": size / t * 2 * (P - 1) / P / 1e9, "wrong": wrong}
        row["ddlkernels_ran"] = tuned.last_algorithm
        rows.append(row)
        hand = row["lines"]["hand-rolled"]["ms"]
        say(f"\n## {size >> 20} MiB" if size >= 1 << 20 else f"\n## {size >> 10} KiB")
        say(f"{'line':<20} {'ms':>10} {'busbw GB/s':>11} {'x hand-rolled':>14} {'wrong':>6}")
        for name, m in row["lines"].items():
            say(f"{name:<20} {m['ms']:>10.3f} {m['busbw_GBps']:>11.1f} {hand / m['ms']:>14.2f} {m['wrong']:>6}")
        say(f"(ddlkernels ran {row['ddlkernels_ran']})")
    say(f"\nwrong elements in all: {bad}")
    if R == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "ranks": P, "dtype": args.dtype, "missing": missing, "rows": rows}, f, indent=1)
    for c in comms:
        if c is not None:
            c.free()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
