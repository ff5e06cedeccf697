"""What one pipeline chunk costs the ring beyond its bytes: the slope of an allreduce's time over its chunks.

    mpirun -n 2 python -m mpi4py bench/studies/chunk_cost.py                      # host arrays, 4 MiB
    mpirun -n 2 python -m mpi4py bench/studies/chunk_cost.py --device cuda --json r.json

The same bytes reduced in smaller chunks move the same data in more messages.  Every chunk is, per
ring step, one send, one receive and one reduction; on GPU buffers staged through pinned memory also
one device-to-host copy, one host-to-device copy and their events.  So the time per call t grows with
the chunks a rank sends, m = 2 (p - 1) ceil(block / chunk) (the most any rank sends: its schedule), and
the least-squares slope of t over m is what one chunk costs the call: the host's work for it and the
latency the pipeline does not hide.  Lines, interleaved chunk by chunk in one run:

    host         numpy arrays, the flat ring (dims=(p,), small_bytes=0: no other algorithm)
    staged       CuPy arrays (--device cuda), the same ring through pinned host memory
                 (ipc=False, cuda_aware=False): the staging transport's cost per chunk
    cuda-aware   CuPy arrays handed to MPI as they are, where MPI is CUDA-aware

Time per call: median of --iters calls after --warmup, each after a barrier and (GPU lines) with the
device synchronized, slowest rank.  Every line's result is checked (exact integer-valued sums); a wrong
element exits 1.  --device cuda exits 2 where a rank has no GPU, having timed nothing.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import ddlkernels  # noqa: E402
from ddlkernels.ring.schedule import build_schedule, chunk_ranges  # noqa: E402
from ddlkernels.tools.bench import parse_size  # noqa: E402
from ddlkernels.tools.bench.buffers import expected, pattern  # noqa: E402
from ddlkernels.tools.bench.sizes import format_size  # noqa: E402


def chunks_per_call(comm, count, itemsize, chunk_bytes):
    """The most chunks a rank sends in the flat-ring allreduce of ``count`` elements: its schedule's steps cut
    as the engine cuts them (``ddlkernels.ring``), 2 (p - 1) steps of one block each."""
    p = comm.size
    sched = build_schedule(count, comm.plan(count * itemsize, dims=(p,)), comm.rank)
    per = max(1, chunk_bytes // itemsize)
    mine = sum(len(chunk_ranges(*st.send, per)) for st in sched.steps)
    return comm.comm.allreduce(mine, op=MPI.MAX)


def lines(comm, device, n, dt):
    """name -> (run(chunk_bytes), sync, result() -> host array); name -> why not; Communicators to free.
    ``device``: "host", "cuda", or the GPU lines' device (a ``CupyDevice``; the tests' emulated one)."""
    p, r = comm.Get_size(), comm.Get_rank()
    x = pattern(n, r, p, dt)
    out, missing, comms = {}, {}, []
    host = ddlkernels.Communicator(comm, shm=False, small_bytes=0)
    comms.append(host)
    h = np.empty_like(x)
    out["host"] = (lambda c: host.allreduce(x, "sum", out=h, dims=(p,), chunk_bytes=c), lambda: None, lambda: h)
    if device == "cuda":
        from ddlkernels.tools.bench.device import CupyDevice, gpu_everywhere

        cp, why = gpu_everywhere(comm)
        if cp is None:
            return None, why, comms
        device = CupyDevice(cp)
    if not isinstance(device, str):
        dx, dout = device.array(x), device.empty(n, dt)
        sync = device.synchronize

        def dev_line(**kw):
            c = ddlkernels.Communicator(comm, shm=False, ipc=False, small_bytes=0, **kw)
            comms.append(c)
            return (lambda ch: c.allreduce(dx, "sum", out=dout, dims=(p,), chunk_bytes=ch), sync,
                    lambda: device.to_host(dout))

        out["staged"] = dev_line(cuda_aware=False)
        aware, reason = host.cuda_aware()
        if aware:
            out["cuda-aware"] = dev_line(cuda_aware=True)
        else:
            missing["cuda-aware"] = f"MPI is not CUDA-aware ({reason})"
    return out, missing, comms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("host", "cuda"), default="host",
                    help="host: numpy arrays only; cuda: GPU lines beside the host line")
    ap.add_argument("--bytes", default="4M", help="bytes per allreduce (K/M/G)")
    ap.add_argument("--chunks", default="16K,32K,64K,256K,1M", help="chunk sizes in bytes, comma list")
    ap.add_argument("-d", "--dtype", default="float32")
    ap.add_argument("-n", "--iters", type=int, default=20)
    ap.add_argument("-w", "--warmup", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the table as JSON here (rank 0)")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    p, rank0 = comm.Get_size(), comm.Get_rank() == 0
    dt = np.dtype(args.dtype)
    n = parse_size(args.bytes) // dt.itemsize
    chunk_sizes = [parse_size(c) for c in args.chunks.split(",")]
    found, missing, comms = lines(comm, args.device, n, dt)
    try:
        if found is None:
            if rank0:
                print(f"chunk_cost: no GPU to measure on ({missing}); nothing was timed", flush=True)
            return 2
        want = expected(n, p, dt, "sum")
        times = {name: [] for name in found}
        wrong = {name: 0 for name in found}
        for c in chunk_sizes:
            for name, (run, sync, result) in found.items():
                for _ in range(args.warmup):
                    run(c)
                sync()
                t = []
                for _ in range(args.iters):
                    comm.Barrier()
                    t0 = time.perf_counter()
                    run(c)
                    sync()
                    t.append(time.perf_counter() - t0)
                times[name].append(comm.allreduce(float(np.median(t)), op=MPI.MAX))
                wrong[name] += comm.allreduce(int(np.count_nonzero(result() != want)))
        m = [chunks_per_call(comms[0], n, dt.itemsize, c) for c in chunk_sizes]
        fits = {name: np.polyfit(m, t, 1) if len(set(m)) > 1 else (float("nan"), float("nan"))
                for name, t in times.items()}
        if rank0:
            print(f"# {p} ranks, {format_size(n * dt.itemsize)} of {dt.name} per allreduce, flat ring, "
                  f"median of {args.iters} after {args.warmup} warmup, slowest rank; ms per call")
            for name, why in missing.items():
                print(f"# {name}: not run ({why})")
            names = list(found)
            print(f"{'chunk':>8} {'chunks/call':>12} " + " ".join(f"{k:>12}" for k in names))
            for i, c in enumerate(chunk_sizes):
                print(f"{format_size(c):>8} {m[i]:>12} " + " ".join(f"{times[k][i] * 1e3:>12.3f}" for k in names))
            print(f"{'us per chunk (slope)':>21} " + " ".join(f"{fits[k][0] * 1e6:>12.1f}" for k in names))
            print(f"{'ms at 0 chunks':>21} " + " ".join(f"{fits[k][1] * 1e3:>12.3f}" for k in names))
            print(f"wrong elements in all: {sum(wrong.values())}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"ranks": p, "bytes": n * dt.itemsize, "dtype": dt.name, "chunks": chunk_sizes,
                               "chunks_per_call": m, "ms": {k: [t * 1e3 for t in v] for k, v in times.items()},
                               "us_per_chunk": {k: float(fits[k][0] * 1e6) for k in names},
                               "wrong": wrong, "missing": missing}, f, indent=1)
        return 1 if any(wrong.values()) else 0
    finally:
        for c in comms:
            c.free()


if __name__ == "__main__":
    sys.exit(main())
