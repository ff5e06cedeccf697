"""Where the shared-memory allreduce's time goes at large sizes: the exchange between cores, or memory.

    mpirun -n 2 python -m mpi4py bench/studies/shm_costs.py                 # 16 and 64 MiB, float32
    mpirun -n 2 python -m mpi4py bench/studies/shm_costs.py --sizes 64M --rounds 21

Six lines, interleaved round by round in one run, each timed after a
barrier on the slowest rank (median over rounds, milliseconds per call):

* ``link``: every rank ``Sendrecv``'s N/p bytes to its neighbour, as the
  harness's "Sendrecv link" line (``ddlkernels.tools.bench``);
* ``memcpy``: every rank copies its N-byte input into its N-byte output, the
  memory traffic no out-of-place allreduce avoids;
* ``shm``: ``ddlkernels.algorithms.shm.ShmAllreduce.run``, the shared-memory allreduce;
* ``shm-nt``: the same with its result blocks written with non-temporal
  stores (``run(spill=True)``, the tuner's "shm-nt");
* ``ring``: this library's ring over MPI's transport (``ddlkernels.Communicator``
  with the window and the tuner off), the other algorithm the tuner weighs
  at these sizes;
* ``private``: the steps per piece of ``shm``, as numpy calls (stage the peers'
  blocks, fold p operands into a result, copy it to out, copy the p - 1
  other results to out), on buffers private to each rank and without
  barriers: the algorithm's memory traffic with nothing crossing between
  cores.  Its result is not an allreduce (no rank sees another's data).

Then ``shm``, ``shm-nt`` and ``ring`` as busbw / link (the harness's ratio:
2 (p - 1) / p x N / t against (N / p) / t_link), and ``shm`` - ``private``:
what exchanging data through the window costs over moving it privately.
(The table below was printed before shm-nt had a line, with ring / shm in
place of the ring's ratio to the link.)

The 2-core machine switches, minutes apart, between two states, which this
shows side by side.  Fourteen runs at 32 MiB, ``--sizes 32M --rounds 7``, 28 s
apart, 2 ranks (ms):

    runs   link        memcpy      shm         ring        private     shm busbw / link
    8      1.78-2.50   3.46-5.01   3.46-4.72   5.11-7.14   3.82-4.71   0.93-1.06
    6      1.36-1.59   2.74-3.19   5.66-6.08   5.11-5.84   3.39-3.66   0.46-0.56

In the second, memory is faster (memcpy, private, the link: a copy from
a peer's input that nobody writes) and everything a core just wrote and its
peer then reads is slower, as when the two cores sit on different
core complexes, each with its own L3: the window's exchange then costs 2.0-2.5
ms more than the same steps on private buffers, and the ring is hardly
faster.  Writing the result blocks with non-temporal stores, so that a peer
reads them from memory, is faster in that state and slower in the other
(``bench/studies/shm_pieces.py --spill``): the tuner measures it as "shm-nt"
(``ddlkernels.select.tuner.SPILL_FROM``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import ddlkernels
from ddlkernels.tools.bench import format_size, parse_size
from ddlkernels.algorithms.shm import ShmAllreduce
from ddlkernels.algorithms.window import PIECE_BYTES


def _private_steps(x, out, p, r, step):
    """The per-piece steps of ``ShmAllreduce._piece`` for rank r, on private buffers (see the module doc)."""
    stage = np.empty(step, x.dtype)
    peers = [np.ones(step, x.dtype) for _ in range(p - 1)]  # stand-ins for the peers' stages and results
    result = np.empty(-(-step // p), x.dtype)

    def run():
        for a in range(0, x.shape[0], step):
            n = min(step, x.shape[0] - a)
            q, m = divmod(n, p)
            bounds = [i * q + min(i, m) for i in range(p + 1)]
            lo, hi = bounds[r], bounds[r + 1]
            if lo:
                stage[:lo] = x[a : a + lo]
            if hi < n:
                stage[hi:n] = x[a + hi : a + n]
            res = result[: hi - lo]
            np.add(x[a + lo : a + hi], peers[0][lo:hi], out=res)
            for v in peers[1:]:
                np.add(res, v[lo:hi], out=res)
            out[a + lo : a + hi] = res
            for s, v in zip([s for s in range(p) if s != r], peers):
                out[a + bounds[s] : a + bounds[s + 1]] = v[: bounds[s + 1] - bounds[s]]

    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16M,64M", help="comma list of buffer sizes N (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    p, r = comm.Get_size(), comm.Get_rank()
    if p < 2:
        raise SystemExit("needs 2 or more ranks")
    shm = ShmAllreduce(comm, whole_below=0)
    ring = ddlkernels.Communicator(comm, shm=False, small_bytes=0)

    def timed(fn):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) * 1e3

    if r == 0:
        print(f"# {p} ranks, float32 sum, ms per call (median of {a.rounds} rounds, slowest rank); "
              f"pieces of {format_size(PIECE_BYTES)}")
    for nb in (parse_size(s) for s in a.sizes.split(",")):
        n = nb // 4
        x = (np.arange(n, dtype=np.float32) % 1000) * p + r
        out = np.empty_like(x)
        want = np.empty_like(x)
        comm.Allreduce(x, want, MPI.SUM)
        send = x[: n // p].view(np.uint8)
        recv = np.empty_like(send)
        fns = {
            "link": lambda: comm.Sendrecv(send, (r + 1) % p, 7, recv, (r - 1) % p, 7),
            "memcpy": lambda: np.copyto(out, x),
            "shm": lambda: shm.run(x, out, "sum", None),
            "shm-nt": lambda: shm.run(x, out, "sum", None, spill=True),
            "ring": lambda: ring.allreduce(x, "sum", out=out),
            "private": _private_steps(x, out, p, r, PIECE_BYTES // 4),
        }
        for name in ("shm", "shm-nt", "ring"):
            out[...] = 0
            fns[name]()
            if not np.array_equal(out, want):  # exact: small integers
                raise SystemExit(f"{name}: wrong result at {nb} B")
        for f in fns.values():
            f()
        res = {k: [] for k in fns}
        for _ in range(a.rounds):
            for k, f in fns.items():
                res[k].append(timed(f))
        if r == 0:
            med = {k: float(np.median(v)) for k, v in res.items()}
            def to_link(k):
                return (2 * (p - 1) / p * nb / med[k]) / ((nb // p) / med["link"])

            print(f"{format_size(nb):>5} " + "  ".join(f"{k} {v:7.2f}" for k, v in med.items())
                  + f"  | busbw / link: shm {to_link('shm'):.2f} shm-nt {to_link('shm-nt'):.2f} "
                  f"ring {to_link('ring'):.2f}; shm - private {med['shm'] - med['private']:.2f} ms", flush=True)
    shm.free()
    ring.free()


if __name__ == "__main__":
    main()
