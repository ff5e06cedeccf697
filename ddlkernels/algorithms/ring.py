""""ring": the multi-dimensional ring of PowerAI DDL, pipelined in chunks, for every array type.

Worked example, allreduce on a 2 x 2 box (4 ranks, a buffer of blocks A B C D)::

    reduce-scatter, dimension 1 (pairs 0-1, 2-3)   each rank ends with half the buffer summed over its pair
    reduce-scatter, dimension 2 (pairs 0-2, 1-3)   ... a quarter summed over all four: its shard
    allgather, dimension 2                          ... back to the half
    allgather, dimension 1                          every rank holds the whole sum

The box and the rank order come from the planner (``Communicator.plan``), the
per-rank steps from ``ddlkernels.ring.schedule`` (plain data), and
``ddlkernels.ring.engine`` runs them over a transport: MPI on the buffers
themselves, or staged through pinned memory for device buffers when MPI is
not CUDA-aware (``Communicator._transport``).  It is the algorithm of every
call with ``dims=``, the incumbent of device calls (beside "ipc" on one
node), and a host tuner candidate from ``MPI_BELOW`` bytes (below it MPI's
own calls win where they compute the call).
"""

from __future__ import annotations

from ..ring.engine import execute
from ..select.tuner import MPI_BELOW
from .base import Algorithm
from .mpi import computes

__all__ = ["Ring"]


class Ring(Algorithm):
    name = "ring"
    kinds = ("allreduce", "reduce_scatter", "allgather")
    chunked = True
    device = True

    def serves(self, kind, w):
        if kind != "allreduce":
            return True
        # Below MPI_BELOW, where MPI computes the call, no ring of 2 or more ranks came close: not measured there.
        return not (w.nbytes < MPI_BELOW and self.comm.size > 1 and not w.be.device and computes(w.dtype, w.redop))

    def prepare(self, w):
        """The receive slots (allgather receives in place: none) and, for reduce_scatter, the whole buffer's scratch."""
        c = self.comm
        slots = c._slots(w.be, w.dtype, w.chunk) if w.kind != "allgather" else []
        return slots, (c._scratch(w.be, w.dtype, w.count) if w.kind == "reduce_scatter" else None)

    def _run(self, w, sched, src, out):
        c = self.comm
        execute(sched, src, out, w.redop, backend=w.be, transport=c._transport(w.be), chunk=w.chunk,
                slots=w.prepared[0], avg_p=c.size if w.avg else None, deadline=w.deadline)

    def allreduce(self, w):
        c = self.comm
        sched = c._schedule(w.count, c.plan(w.nbytes, w.dims), "ar")
        self._run(w, sched, w.src, w.dst)

    def reduce_scatter(self, w):
        c = self.comm
        sched = c._schedule(w.count, c._shard_plan(w.dims), "rs")
        work = w.prepared[1]
        self._run(w, sched, w.src, work)
        lo, hi = sched.shard
        w.be.copy(w.dst, work[lo:hi])

    def allgather(self, w):
        c = self.comm
        sched = c._schedule(w.count, c._shard_plan(w.dims), "ag")
        lo, hi = sched.shard
        w.be.copy(w.dst[lo:hi], w.src)
        self._run(w, sched, w.dst, w.dst)
