"""MPI's own collectives: "mpi" (the blocking calls) and "nbc" (``MPI_Iallreduce`` + ``Wait``).

Worked example, allreduce of 4 KiB of float32, out of place, on 2 ranks::

    rank 0:  dst[...] = x;  MPI_Allreduce(MPI_IN_PLACE, dst, SUM)
    rank 1:  MPI_Allreduce(MPI_IN_PLACE, x, SUM)          (in place: out=x)

Every rank passes ``MPI_IN_PLACE``, whichever placement it chose: MPI requires
it of all ranks or of none, and ranks may differ in placement (the copy is
the one MPI makes itself out of place).  With a deadline a rank makes the same
blocking call as its peers without one, waited for on a helper thread
(``Communicator._blocking``): a blocking and a nonblocking collective never
match.  Latency-bound messages are where MPI's recursive doubling wins
(log2 p rounds where a ring needs 2(p - 1)); below ``MPI_BELOW`` bytes Open
MPI's nonblocking schedule (libnbc) is a candidate of its own.  MPI's MAX/MIN
on floats drop a NaN depending on the operands' order, numpy's propagate it,
so MPI computes float sums and products and every integer op only.

Device arrays, where MPI is CUDA-aware on every rank (``Placement.cuda_aware``):
"mpi" is a candidate of the device tuner at every size, since a GPU-aware MPI
(UCX with UCC, MVAPICH2-GDR, ...) runs collectives of its own on device
memory that may beat the ring; the tuner measures it.  MPI works outside any
stream, so the call first blocks until the work queued on its stream has run
(the input is written, earlier readers of the output are done); the result
is in place when MPI returns, and "avg" is then scaled on the stream
(``scale``: the bits of the host's ``scale_inplace``).  Only the blocking
calls, whose device support GPU-aware MPIs document ("nbc" stays on the
host); under a deadline the helper thread that makes the call makes the
caller's device current first.
"""

from __future__ import annotations

import numpy as np

from .._dtypes import scale_inplace
from ..ring.segments import Segments
from ..select.tuner import MPI_BELOW
from .base import Algorithm

__all__ = ["Mpi", "Nbc", "RING_FROM", "MPI_NATIVE", "mpi_op", "computes", "pack_into_dst"]

#: MPI's own allreduce is a candidate below this size: it never came close to the ring from there
#: (bench/results/constants.md, RING_FROM).
RING_FROM = 32 << 20
#: The dtypes MPI's own reductions compute here.
MPI_NATIVE = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))
_OPS: dict = {}


def mpi_op(name):
    """The ``MPI.Op`` of a reduction ("sum", "prod", "max", "min"), or ``MPI.IN_PLACE`` / ``MPI.BYTE`` by name."""
    if not _OPS:
        from mpi4py import MPI

        _OPS.update(sum=MPI.SUM, max=MPI.MAX, min=MPI.MIN, prod=MPI.PROD, IN_PLACE=MPI.IN_PLACE, BYTE=MPI.BYTE)
    return _OPS[name]


def computes(dtype, redop) -> bool:
    """Whether MPI's own reduction computes ``redop`` on ``dtype`` with numpy's bits (float max/min do not)."""
    return dtype in MPI_NATIVE and (redop in ("sum", "prod") or dtype.kind in "iu")


def _on_caller_device(be, fn):
    """``fn`` for ``Communicator._blocking``'s helper thread, which makes the caller's current device its own
    first: a CUDA-aware MPI reaches device memory through the calling thread's context."""
    device = be.current_device()

    def call(*args):
        with be.using(None, device):
            fn(*args)

    return call


class Mpi(Algorithm):
    """MPI_Allreduce, MPI_Reduce_scatter(_block), MPI_Allgather(v); on device arrays too where MPI is
    CUDA-aware (the module comment)."""

    name = "mpi"
    kinds = ("allreduce", "reduce_scatter", "allgather")
    device = True

    def __init__(self, comm, placement):
        super().__init__(comm, placement)
        self.cuda_aware = placement.cuda_aware  # the same on every rank

    def computes(self, kind, w) -> bool:
        """Whether MPI's own collective computes this call with numpy's bits, whatever its size (the rule of
        a fixed ``small_bytes``)."""
        c = self.comm
        if c.size < 2 or (w.be.device and not self.cuda_aware):
            return False
        if kind == "allreduce":
            return computes(w.dtype, w.redop)
        if kind == "reduce_scatter":
            return computes(w.dtype, w.redop) and w.count < 2**31 and c.rank_ordered(w.count)
        return w.nbytes < 2**31 and c.rank_ordered(w.count)  # allgather moves bytes: any dtype

    def serves(self, kind, w):
        # RING_FROM was measured on host memory; a GPU-aware MPI is measured at every size.
        return self.computes(kind, w) and (kind != "allreduce" or w.nbytes < RING_FROM or w.be.device)

    def _blocking(self, w, what, fn, *args):
        """The blocking MPI call ``fn(*args)`` of ``w``, under its deadline if any; on device buffers after
        the work queued on the call's stream has run (the module comment)."""
        be = w.be
        if be.device:
            be.sync_stream(be.compute_stream())
        if w.deadline is None:
            fn(*args)
        else:  # the same blocking call as the peers without a deadline make
            self.comm._blocking(w.deadline, what, _on_caller_device(be, fn) if be.device else fn, *args)

    # -- allreduce -------------------------------------------------------------------------
    def allreduce(self, w):
        pack_into_dst(w)
        if w.be.device:
            self._blocking(w, "MPI_Allreduce", self.comm.comm.Allreduce, mpi_op("IN_PLACE"), w.be.wire(w.dst),
                           mpi_op(w.redop))
        else:
            self._reduce(w.dst, mpi_op(w.redop), w.deadline)
        if w.avg:
            w.be.scale(w.dst, self.comm.size)

    def _reduce(self, dst, op, deadline):
        comm = self.comm
        in_place = mpi_op("IN_PLACE")
        if deadline is None:
            comm.comm.Allreduce(in_place, dst, op)
        else:
            comm._blocking(deadline, "MPI_Allreduce", comm.comm.Allreduce, in_place, dst, op)

    def fast(self, kind, w):
        dtype, bounds, redop = w.dtype, w.bounds, w.redop
        comm, p = self.comm.comm, self.comm.size
        if kind == "allreduce":
            mop, in_place, avg, reduce = mpi_op(redop), mpi_op("IN_PLACE"), w.avg, self._fast_reduce()

            def run(x, dst):
                if dst is not x:
                    dst[...] = x  # numpy's cheapest call for the copy
                reduce(in_place, dst, mop)
                if avg:
                    scale_inplace(dst, p)

            return run
        if kind == "reduce_scatter":
            counts = [hi - lo for lo, hi in bounds]
            mop, avg = mpi_op(redop), w.avg
            if len(set(counts)) == 1:  # equal shards: the block variant, which Open MPI runs differently
                def run(x, shard):
                    comm.Reduce_scatter_block(x, shard, mop)
                    if avg:
                        scale_inplace(shard, p)
            else:
                def run(x, shard):
                    comm.Reduce_scatter(x, shard, counts, mop)
                    if avg:
                        scale_inplace(shard, p)
            return run
        item = dtype.itemsize
        sizes = [(hi - lo) * item for lo, hi in bounds]
        displs = [lo * item for lo, _ in bounds]
        as_bytes = dtype not in MPI_NATIVE  # MPI has no float16/bfloat16: those go as bytes
        byte = mpi_op("BYTE")
        if len(set(sizes)) == 1:  # equal shards: MPI_Allgather, which Open MPI runs faster than Allgatherv
            def run(shard, out):
                if as_bytes:
                    comm.Allgather(shard.view(np.uint8), out.view(np.uint8))
                else:
                    comm.Allgather(shard, out)
        else:
            def run(shard, out):
                comm.Allgatherv(shard.view(np.uint8), [out.view(np.uint8), sizes, displs, byte])
        return run

    def _fast_reduce(self):
        return self.comm.comm.Allreduce

    # -- reduce_scatter, allgather ---------------------------------------------------------------
    def reduce_scatter(self, w):
        c, be, shard = self.comm, w.be, w.dst
        src, out = be.wire(w.src), be.wire(shard)
        counts = [b - a for a, b in w.bounds]
        mop = mpi_op(w.redop)
        # The same blocking call with or without a deadline (``Communicator._blocking``).
        if len(set(counts)) == 1:  # equal shards: the block variant, which Open MPI runs differently
            self._blocking(w, "MPI_Reduce_scatter_block", c.comm.Reduce_scatter_block, src, out, mop)
        else:
            self._blocking(w, "MPI_Reduce_scatter", c.comm.Reduce_scatter, src, out, counts, mop)
        if w.avg:
            be.scale(shard, c.size)

    def allgather(self, w):
        c, item = self.comm, w.dtype.itemsize
        sizes = [(b - a) * item for a, b in w.bounds]
        send, dst = w.be.wire(w.src).view(np.uint8), w.be.wire(w.dst).view(np.uint8)
        if len(set(sizes)) == 1:  # equal shards: MPI_Allgather, which Open MPI runs faster than Allgatherv
            self._blocking(w, "MPI_Allgather", c.comm.Allgather, send, dst)
        else:
            recv = [dst, sizes, [a * item for a, _ in w.bounds], mpi_op("BYTE")]
            self._blocking(w, "MPI_Allgatherv", c.comm.Allgatherv, send, recv)


class Nbc(Mpi):
    """MPI_Iallreduce + Wait: Open MPI runs it with another schedule (libnbc) than the blocking call."""

    name = "nbc"
    kinds = ("allreduce",)

    def serves(self, kind, w):
        # Host arrays only: GPU-aware MPIs document their blocking collectives on device memory.
        return kind == "allreduce" and not w.be.device and w.nbytes < MPI_BELOW and super().serves(kind, w)

    def _reduce(self, dst, op, deadline):
        from ..safety.deadline import complete

        complete(self.comm.comm.Iallreduce(mpi_op("IN_PLACE"), dst, op), deadline, "MPI_Iallreduce")

    def _fast_reduce(self):
        iallreduce = self.comm.comm.Iallreduce
        return lambda in_place, dst, op: iallreduce(in_place, dst, op).Wait()


def pack_into_dst(w):
    """Make ``w.dst`` hold this rank's operand, for an algorithm that reduces one buffer in place: a
    ``Segments`` packed, else ``src`` copied (nothing when the call is in place)."""
    if w.src is not w.dst:
        if w.src.__class__ is Segments:
            w.src.copy_to(w.dst, 0, w.count)
        else:
            w.be.copy(w.dst, w.src)
        w.src = w.dst
