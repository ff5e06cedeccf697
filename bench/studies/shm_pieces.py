"""The shared-memory allreduce's two knobs, measured beside MPI_Allreduce in one run.

    mpirun -n 2 python -m mpi4py bench/studies/shm_pieces.py               # piece sizes at 4, 16, 64 MiB
    mpirun -n 4 python -m mpi4py bench/studies/shm_pieces.py --small       # whole message vs pieces, 4-256 KiB
    mpirun -n 2 python -m mpi4py bench/studies/shm_pieces.py --small --spins 0,100,1000 --sizes 4K
                                                   # barrier polls before yielding (SPIN)
    mpirun -n 2 python -m mpi4py bench/studies/shm_pieces.py --small --shards --sizes 4K,16K
                                                   # reduce_scatter and allgather, whole and in pieces
    mpirun -n 2 python -m mpi4py bench/studies/shm_pieces.py --loop   # the compiled piece loop vs the Python one,
                                                   # 64K..16M
    mpirun -n 2 python -m mpi4py bench/studies/shm_pieces.py --loop --shards   # the same for reduce_scatter and
                                                   # allgather
    mpirun -n 2 python -m mpi4py bench/studies/shm_pieces.py --stream  # out written with non-temporal stores or
                                                   # normal ones, 1-64 MiB (--shards: allgather's)
    mpirun -n 2 python -m mpi4py bench/studies/shm_pieces.py --spill   # the result blocks too (the tuner's
                                                   # "shm-nt"), 4-64 MiB
    mpirun -n 2 python -m mpi4py bench/studies/shm_pieces.py --stream --shards --only llgather
                                                   # allgathers only: no other line's calls between
                                                   # theirs (the allgather tuner's "shm-nt")
    mpirun -n 2 python -m mpi4py bench/studies/shm_pieces.py --cma --pages huge
                                                   # the single copy (ddlkernels.algorithms.cma) by piece size,
                                                   # beside the window, 64K..64M: its PIECE_BYTES, CMA_FROM
    mpirun -n 2 python -m mpi4py bench/studies/shm_pieces.py --cma --inplace --pages huge
                                                   # the same in place (MPI_IN_PLACE for MPI's)
    mpirun -n 2 python -m mpi4py bench/studies/shm_pieces.py --cma --push --pages huge --pieces 512K
                                                   # pulling vs pushing the allgather: its PUSH_FROM

Each line is ``ddlkernels.algorithms.shm.ShmAllreduce.run`` with one setting, called
directly (no tuner, no argument checks), interleaved round by round with the
other settings and MPI's own allreduce; a round times back-to-back calls
lasting about 2 ms (one call for large messages) after a barrier, on the
slowest rank.  Prints the median over rounds, in microseconds per call.
Where PIECE_BYTES, WHOLE_BELOW, SPIN and STREAM_FROM (ddlkernels/algorithms/shm.py), SPILL_FROM and CMA_FROM
(ddlkernels/select/tuner.py) and ddlkernels/algorithms/cma.py's PIECE_BYTES and PUSH_FROM come from.  ``--pages small|huge`` places
the input and the outputs as the harness does (``ddlkernels.tools.bench``: every buffer in a private mapping
of its own, on 4 KiB or on 2 MiB pages); by default they are plain numpy arrays.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from ddlkernels.tools import bench as _bench
from ddlkernels.tools.bench import format_size, parse_size
from ddlkernels.algorithms.cma import CmaAllreduce
from ddlkernels.algorithms.shm import ShmAllreduce
from ddlkernels.backends import backend_for


def _shard_lines(comm, x, want, shm, python=False, cma=None):
    """reduce_scatter and allgather lines, the window's and MPI's, on equal shards of ``x`` (checked once);
    ``python``: also the window's Python loops (``ShmAllreduce._rs_loop`` / ``_ag_loop``); ``cma``: a
    ``CmaAllreduce`` whose single-copy allgather gets a line too ("allgather cma")."""
    p, r = comm.Get_size(), comm.Get_rank()
    n = x.shape[0] // p * p
    x = x[:n]
    c = n // p
    bounds = [(s * c, (s + 1) * c) for s in range(p)]
    shard, whole = np.empty(c, x.dtype), np.empty(n, x.dtype)
    shm.reduce_scatter(x, shard, bounds, "sum", None)
    shm.allgather(shard, whole, bounds)
    if not (np.array_equal(shard, want[r * c : (r + 1) * c]) and np.array_equal(whole, want[:n])):
        raise SystemExit("the window's reduce_scatter or allgather: wrong result")
    lines = {
        "MPI_Reduce_scatter_block": lambda: comm.Reduce_scatter_block(x, shard, MPI.SUM),
        "reduce_scatter": lambda: shm.reduce_scatter(x, shard, bounds, "sum", None),
        "MPI_Allgather": lambda: comm.Allgather(shard, whole),
        "allgather": lambda: shm.allgather(shard, whole, bounds),
    }
    if cma is not None:
        gathered = np.zeros(n, x.dtype)
        cma.allgather(shard, gathered, bounds)
        if not np.array_equal(gathered, want[:n]):
            raise SystemExit("the single-copy allgather: wrong result")
        lines["allgather cma"] = lambda: cma.allgather(shard, gathered, bounds)
    if python:
        lines["reduce_scatter python"] = lambda: shm._rs_loop(x, shard, bounds, "sum", np.add, None, None, None)
        lines["allgather python"] = lambda: shm._ag_loop(shard, whole, bounds, None)
        shard[:], whole[:] = 0, 0
        lines["reduce_scatter python"]()
        lines["allgather python"]()
        if not (np.array_equal(shard, want[r * c : (r + 1) * c]) and np.array_equal(whole, want[:n])):
            raise SystemExit("the window's Python reduce_scatter or allgather loop: wrong result")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="compare whole-message and pieced reduction at 4-256 KiB")
    ap.add_argument("--sizes", default=None, help="comma list of message sizes (default: 4M,16M,64M or 4K..256K)")
    ap.add_argument("--pieces", default="256K,512K,1M,2M", help="piece sizes to compare (default %(default)s)")
    ap.add_argument("--spins", default=None,
                    help="with --small: compare whole-message calls with these barrier spin counts instead")
    ap.add_argument("--shards", action="store_true",
                    help="with --small, --loop or --stream: time the window's reduce_scatter and allgather (equal "
                         "shards; whole message, or both loops, or both stores) beside MPI_Reduce_scatter_block "
                         "and MPI_Allgather instead; with --cma: the single-copy allgather beside them, 4 KiB-64 "
                         "MiB (where ddlkernels.select.tuner.CMA_GATHER_FROM comes from)")
    ap.add_argument("--loop", action="store_true",
                    help="compare the compiled piece loop (ddlkernels.kernels.window_loops.pieces_allreduce, what run takes) "
                         "with the Python one (ShmAllreduce._pieces, what a timeout=, \"avg\" or float16 takes)")
    ap.add_argument("--stream", action="store_true",
                    help="compare the compiled piece loop writing out with non-temporal stores (\"streamed\") "
                         "and with normal ones (\"cached\"), 1-64 MiB: where STREAM_FROM comes from")
    ap.add_argument("--spill", action="store_true",
                    help="compare run(spill=True) (\"spilled\": each rank's result blocks written with non-temporal "
                         "stores) with run() (\"kept\"), 4-64 MiB: what SPILL_FROM and the tuner's \"shm-nt\" weigh")
    ap.add_argument("--only", default=None,
                    help="time only the lines whose name contains this (e.g. llgather): what lies in the cache "
                         "when a call starts depends on the calls between, as in the caller's loop")
    ap.add_argument("--cma", action="store_true",
                    help="time the single-copy allreduce (ddlkernels.algorithms.cma) with each of --pieces, beside the "
                         "window's (\"shm\"), 64 KiB-64 MiB")
    ap.add_argument("--push", action="store_true",
                    help="with --cma: each piece size pulling (the allgather reads the owners' blocks) and pushing "
                         "(each folded piece written into the peers' out): where ddlkernels.algorithms.cma.PUSH_FROM comes from")
    ap.add_argument("--pages", choices=_bench.PAGES, default=None,
                    help="place the buffers as the harness does (default: plain numpy arrays)")
    ap.add_argument("--inplace", action="store_true",
                    help="every line in place, MPI_Allreduce with MPI_IN_PLACE (the default lines and --cma): "
                         "each line's own copy of the input, reduced again and again")
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    if a.push and not a.cma:
        ap.error("--push goes with --cma")
    if a.push and a.shards:
        ap.error("--push goes with the single-copy allreduce, not --shards")
    if a.inplace and (a.small or a.shards or a.spill or a.stream or a.loop):
        ap.error("--inplace goes with the default lines or --cma")
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
    elif a.cma and a.shards:
        sizes = a.sizes or "4K,16K,64K,256K,1M,4M,16M,64M"
        variants = {"window": ShmAllreduce(comm)}  # the Communicator's: whole messages below its whole_below
    elif a.cma:
        sizes = a.sizes or "64K,256K,1M,4M,16M,64M"
        window = ShmAllreduce(comm, whole_below=0)
        variants = {"shm": window}
        for s in a.pieces.split(","):
            if a.push:  # each piece size twice: never pushing, always pushing
                variants[f"cma {format_size(parse_size(s))} pull"] = CmaAllreduce(window, parse_size(s), 1 << 62)
                variants[f"cma {format_size(parse_size(s))} push"] = CmaAllreduce(window, parse_size(s), 0)
            else:
                variants[f"cma {format_size(parse_size(s))}"] = CmaAllreduce(window, piece_bytes=parse_size(s))
    elif a.spill:
        sizes = a.sizes or "4M,8M,16M,32M,64M"
        variants = {"kept": ShmAllreduce(comm, whole_below=0), "spilled": ShmAllreduce(comm, whole_below=0)}
    elif a.stream:
        sizes = a.sizes or "1M,4M,16M,64M"
        variants = {"cached": ShmAllreduce(comm, whole_below=0, stream_from=1 << 62),
                    "streamed": ShmAllreduce(comm, whole_below=0, stream_from=0)}
    elif a.loop:
        sizes = a.sizes or "64K,256K,1M,4M,16M"
        variants = {"compiled": ShmAllreduce(comm, whole_below=0), "python": ShmAllreduce(comm, whole_below=0)}
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
        if a.pages:
            _bench._placement["pages"] = a.pages
            x = _bench._placed(x)
        want = np.empty_like(x)
        comm.Allreduce(x, want, MPI.SUM)
        outs = {k: (_bench._placed(x) if a.pages else np.empty_like(x)) for k in variants}
        # MPI's output is placed as ours are: its single copy reads and writes it, and on 4 KiB pages it ran
        # 2x slower than on huge ones at 1-4 MiB.
        outs["MPI_Allreduce"] = mpi_out = _bench._placed(x) if a.pages else np.empty_like(x)
        fns = {"MPI_Allreduce": lambda: comm.Allreduce(x, mpi_out, MPI.SUM)}
        if a.inplace:  # every line on a copy of x of its own, its output (MPI's: a copy too, checked like ours)
            for o in outs.values():
                o[...] = x
            outs["MPI_Allreduce"] = mine = _bench._placed(x) if a.pages else x.copy()
            fns = {"MPI_Allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, mine, MPI.SUM)}
        if a.shards and a.stream:
            for k, v in variants.items():
                fns.update({(f if f.startswith("MPI") else f"{f} {k}"): g
                            for f, g in _shard_lines(comm, x, want, v).items()})
        elif a.shards and a.cma:
            fns.update(_shard_lines(comm, x, want, variants["window"], cma=CmaAllreduce(variants["window"])))
        elif a.shards:
            fns.update(_shard_lines(comm, x, want, variants["whole" if a.small else "compiled"], python=a.loop))
            if "pieces" in variants:  # --small: the same calls in pieces, where the crossover is
                fns.update({k + " pieces": f for k, f in _shard_lines(comm, x, want, variants["pieces"]).items()
                            if not k.startswith("MPI")})
        elif a.cma:
            fns.update({k: (lambda v=v, o=outs[k], i=(outs[k] if a.inplace else x): v.run(i, o, "sum", reduce))
                        if k == "shm" else
                        (lambda v=v, o=outs[k], i=(outs[k] if a.inplace else x): v.run(i, o, "sum"))
                        for k, v in variants.items()})
        else:
            fns.update({k: (lambda v=v, o=outs[k], i=(outs[k] if a.inplace else x), s=k == "spilled":
                            v.run(i, o, "sum", reduce, spill=s))
                        for k, v in variants.items()})
        if a.loop and not a.shards:
            py, o = variants["python"], outs["python"]
            py.run(x[:1], o[:1], "sum", reduce)  # allocates its window (collective), which _pieces expects
            fns["python"] = lambda: py._pieces(x, o, "sum", np.add, reduce, None, None)
        for f in fns.values():
            f()
            if not a.inplace:  # in place, the second call reduces the first's result
                f()
        for k, o in outs.items():  # every setting computes MPI's answer (exact: small integers)
            if k in fns and not np.array_equal(o, want):
                raise SystemExit(f"{k}: wrong result at {nb} B")
        batch = max(1, int(2e-3 / (timed(fns["MPI_Allreduce"], 1) * 1e-6)))
        if a.only:
            fns = {k: f for k, f in fns.items() if a.only in k}
        res = {k: [] for k in fns}
        for _ in range(a.rounds):
            for k, f in fns.items():
                res[k].append(timed(f, batch))
        if rank == 0:
            med = {k: float(np.median(v)) for k, v in res.items()}
            pairs = []  # (label, numerator line, denominator line)
            if a.loop and a.shards:
                pairs = [(f"{k} python/compiled", f"{k} python", k) for k in ("reduce_scatter", "allgather")]
            elif a.loop:
                pairs = [("python/compiled", "python", "compiled")]
            elif a.stream and a.shards:
                pairs = [(f"{k} cached/streamed", f"{k} cached", f"{k} streamed") for k in ("reduce_scatter", "allgather")]
            elif a.stream:
                pairs = [("cached/streamed", "cached", "streamed")]
            elif a.spill:
                pairs = [("kept/spilled", "kept", "spilled")]
            elif a.cma and a.shards:
                pairs = [("allgather/cma", "allgather", "allgather cma"), ("MPI/cma", "MPI_Allgather", "allgather cma")]
            elif a.cma:
                pairs = [(f"shm/{k}", "shm", k) for k in med if k.startswith("cma")]
            # --only may have left a pair's lines out.
            ratio = "".join(f"  {name} {med[u] / med[v]:.2f}" for name, u, v in pairs if u in med and v in med)
            print(f"{format_size(nb):>6} " + "  ".join(f"{k} {v:8.2f}" for k, v in med.items()) + ratio, flush=True)
    for v in variants.values():
        if isinstance(v, ShmAllreduce):  # a CmaAllreduce's window is one of these
            v.free()


if __name__ == "__main__":
    main()
