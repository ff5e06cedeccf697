"""The shared-memory allreduce's two knobs, measured beside MPI_Allreduce in one run.

    mpirun -n 2 python -m mpi4py bench/shm_pieces.py               # piece sizes at 4, 16, 64 MiB
    mpirun -n 4 python -m mpi4py bench/shm_pieces.py --small       # whole message vs pieces, 4-256 KiB
    mpirun -n 2 python -m mpi4py bench/shm_pieces.py --small --spins 0,100,1000 --sizes 4K
                                                   # barrier polls before yielding (SPIN)

Each line is ``ddlkernels._shm.ShmAllreduce.run`` with one setting, called
directly (no tuner, no argument checks), interleaved round by round with the
other settings and MPI's own allreduce; a round times back-to-back calls
lasting about 2 ms (one call for large messages) after a barrier, on the
slowest rank.  Prints the median over rounds, in microseconds per call.
Where PIECE_BYTES, WHOLE_BELOW and SPIN (ddlkernels/_shm.py) come from.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from ddlkernels._bench import format_size, parse_size
from ddlkernels._shm import ShmAllreduce
from ddlkernels.backends import backend_for


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="compare whole-message and pieced reduction at 4-256 KiB")
    ap.add_argument("--sizes", default=None, help="comma list of message sizes (default: 4M,16M,64M or 4K..256K)")
    ap.add_argument("--pieces", default="256K,512K,1M,2M", help="piece sizes to compare (default %(default)s)")
    ap.add_argument("--spins", default=None,
                    help="with --small: compare whole-message calls with these barrier spin counts instead")
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    reduce = backend_for(np.empty(0)).reduce
    if a.small:
        sizes = a.sizes or "4K,16K,64K,256K"
        whole = max(parse_size(s) for s in sizes.split(",")) + 1  # every size whole
        if a.spins:
            variants = {f"spin {int(s)}": ShmAllreduce(comm, whole_below=whole, spin=int(s)) for s in a.spins.split(",")}
        else:
            variants = {"whole": ShmAllreduce(comm, whole_below=whole), "pieces": ShmAllreduce(comm, whole_below=0)}
    else:
        sizes = a.sizes or "4M,16M,64M"
        variants = {f"piece {format_size(parse_size(s))}": ShmAllreduce(comm, piece_bytes=parse_size(s), whole_below=0)
                    for s in a.pieces.split(",")}

    def timed(fn, batch):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        return comm.allreduce((time.perf_counter() - t0) / batch, op=MPI.MAX) * 1e6

    if rank == 0:
        print(f"# {p} ranks, float32 sum, us per call (median of {a.rounds} rounds, slowest rank)")
    for nb in (parse_size(s) for s in sizes.split(",")):
        x = (np.arange(nb // 4, dtype=np.float32) % 1000) * p + rank
        want = np.empty_like(x)
        comm.Allreduce(x, want, MPI.SUM)
        outs = {k: np.empty_like(x) for k in variants}
        fns = {"MPI_Allreduce": lambda: comm.Allreduce(x, want, MPI.SUM)}
        fns.update({k: (lambda v=v, o=outs[k]: v.run(x, o, "sum", reduce)) for k, v in variants.items()})
        for f in fns.values():
            f()
            f()
        for k, o in outs.items():  # every setting computes MPI's answer (exact: small integers)
            if not np.array_equal(o, want):
                raise SystemExit(f"{k}: wrong result at {nb} B")
        batch = max(1, int(2e-3 / (timed(fns["MPI_Allreduce"], 1) * 1e-6)))
        res = {k: [] for k in fns}
        for _ in range(a.rounds):
            for k, f in fns.items():
                res[k].append(timed(f, batch))
        if rank == 0:
            med = {k: float(np.median(v)) for k, v in res.items()}
            print(f"{format_size(nb):>6} " + "  ".join(f"{k} {v:8.2f}" for k, v in med.items()), flush=True)
    for v in variants.values():
        v.free()


if __name__ == "__main__":
    main()
