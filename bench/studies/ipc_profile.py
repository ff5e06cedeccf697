"""Where the time of the CUDA IPC allreduce goes, rank by rank: torch's profiler (CUPTI) around the library's
calls lists every CUDA runtime and driver call a call makes and every kernel it runs, with their times.

    mpirun -n 2 python bench/studies/ipc_profile.py --sizes 1M,256M -n 20 [--trace-dir DIR]

The device sweep timed ``Communicator(ipc=True).allreduce`` at 2 ranks sharing an H200 at 1.23-1.31 ms for
256 MiB, where the ipc_schedules study's own schedules took 0.85 (bench/results/device_allreduce_np2_h200.txt,
ipc_schedules_np2_h200.txt); this tells the host's part (launches, synchronizations, IPC handles, Python
between them) from the device's (kernels, and the gaps between them).

Each rank calls the library on CuPy arrays of the pool (as the sweep's lines), ``-n`` times per size after
``-w`` untimed calls, each call after a barrier and inside a profiler ``record_function`` that ends once the
device has synchronized: its row is the call's whole span.  A device copy of the same bytes is profiled the
same way beside it (the sweep's floor line).  Printed per size, rank by rank: the profiler's table of events
by total CPU time (with calls counted: divide by ``-n``), then whether every result was right (small
integers: exact sums).  ``--trace-dir`` writes each rank's Chrome trace there (``rank<r>_<size>.json``, for
chrome://tracing or Perfetto).  Needs CuPy, torch with CUDA and a device on every rank; exits 2 without.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from ddlkernels.tools.bench import parse_size  # noqa: E402
from ddlkernels.tools.bench.device import gpu_everywhere  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,256M")
    ap.add_argument("-n", "--iters", type=int, default=20)
    ap.add_argument("-w", "--warmup", type=int, default=5)
    ap.add_argument("--rows", type=int, default=18, help="rows of each table")
    ap.add_argument("--trace-dir", default=None, help="write each rank's Chrome trace here")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    p, me = comm.Get_size(), comm.Get_rank()
    cp, why = gpu_everywhere(comm)  # collective; each rank on its local_device
    if cp is not None:
        try:
            import torch

            if not torch.cuda.is_available():
                why = "torch sees no CUDA device"
        except ImportError as exc:
            why = f"ImportError: {exc}"
        whys = [w for w in comm.allgather(why) if w]
        why = whys[0] if whys else None
    if why is not None:
        if me == 0:
            print(f"ipc_profile: no GPU to measure on ({why}); nothing was timed")
        return 2
    from torch.profiler import ProfilerActivity, profile, record_function

    import ddlkernels

    torch.cuda.set_device(cp.cuda.runtime.getDevice())
    lib = ddlkernels.Communicator(comm, shm=False, ipc=True)
    if args.trace_dir and me == 0:
        os.makedirs(args.trace_dir, exist_ok=True)
    comm.Barrier()
    wrong = 0
    for nbytes in [parse_size(s) for s in args.sizes.split(",")]:
        n, tag = nbytes // 4, f"{nbytes >> 20}M" if nbytes >= 1 << 20 else f"{nbytes >> 10}K"
        base = np.arange(n, dtype=np.int64) % 251
        x = cp.asarray((base + me).astype(np.float32))
        out, copy_dst = cp.empty_like(x), cp.empty_like(x)
        want = cp.asarray((p * base + p * (p - 1) // 2).astype(np.float32))
        for _ in range(args.warmup):  # mappings opened, kernels compiled, the pool's blocks in place
            lib.allreduce(x, "sum", out=out)
        cp.cuda.Device().synchronize()
        comm.Barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                comm.Barrier()
                with record_function(f"allreduce {tag} (the call, device synchronized)"):
                    lib.allreduce(x, "sum", out=out)
                    cp.cuda.Device().synchronize()
                wrong += int(cp.count_nonzero(out != want))
                out.fill(-1)  # poisoned: the next call must write it all again
                cp.cuda.Device().synchronize()
                comm.Barrier()
                with record_function(f"device copy {tag} (device synchronized)"):
                    cp.copyto(copy_dst, x)
                    cp.cuda.Device().synchronize()
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows)
        if args.trace_dir:
            prof.export_chrome_trace(os.path.join(args.trace_dir, f"rank{me}_{tag}.json"))
        tables = comm.gather(table, root=0)
        if me == 0:
            for r, t in enumerate(tables):
                print(f"\n## {tag} float32, {p} ranks, rank {r}: {args.iters} calls (divide the totals by them)\n{t}",
                      flush=True)
        del x, out, copy_dst, want
        comm.Barrier()
        lib.close_peer_memory()
    lib.free()
    wrong = comm.allreduce(wrong)
    if me == 0:
        print(f"\nwrong elements in all: {wrong}", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
