"""Allreduce of GPU buffers: ddlkernels beside what a GPU user would otherwise run, in one run, every result checked.

    mpirun -n 2 python bench/sweeps/device_allreduce.py --sizes 1M,64M,256M -n 10 --json r.json

The lines and how they are timed: ``ddlkernels/tools/bench/device.py`` (the same as
``python -m ddlkernels job --device cuda``).  Needs CuPy and a CUDA device on every rank; exits 2
without, having timed nothing.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from mpi4py import MPI  # noqa: E402

from ddlkernels.tools.bench import parse_size  # noqa: E402
from ddlkernels.tools.bench.device import CupyDevice, gpu_name, gpu_or_say_why, sweep, table  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,64M,256M", help="buffer sizes in bytes, comma list (K/M/G)")
    ap.add_argument("-d", "--dtype", default="float32")
    ap.add_argument("-n", "--iters", type=int, default=10)
    ap.add_argument("-w", "--warmup", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the rows as JSON here (rank 0)")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank0 = comm.Get_rank() == 0
    cp = gpu_or_say_why(comm, "device_allreduce")  # collective; each rank on its local_device
    if cp is None:
        return 2
    gpu = gpu_name(cp)
    rows, missing = sweep(comm, CupyDevice(cp), [parse_size(s) for s in args.sizes.split(",")], args.dtype,
                          args.iters, args.warmup)
    wrong = sum(m["wrong"] for r in rows for m in r["lines"].values())
    if rank0:
        print(f"# {comm.Get_size()} ranks, {gpu}, {args.dtype}, median of {args.iters} after {args.warmup} warmup, "
              f"slowest rank; busbw = bytes/t x 2(p-1)/p")
        for name, reason in missing.items():
            print(f"# {name}: not run ({reason})")
        print(table(rows))
        print(f"\nwrong elements in all: {wrong}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": gpu, "ranks": comm.Get_size(), "dtype": args.dtype, "missing": missing,
                           "rows": rows}, f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
