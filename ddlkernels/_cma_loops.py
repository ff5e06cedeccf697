"""Compiled loop of the single-copy allreduce (``ddlkernels._cma``): a peer's memory read with ``process_vm_readv``.

Imported on first use, as ``ddlkernels._shm_loops`` (whose barrier, copies and
combines it shares): it compiles with Numba.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from ._shm import FLAG_STRIDE as STRIDE
from ._shm_loops import _accumulate, _accumulate_left, _add, _combine_into, _copy, _max, _min, _mul, barrier

#: Words of a rank's flag line (``ddlkernels._shm``: word 0 is its barrier count, 1-2 where its input lies in
#: a shared region) this call publishes: its input's and its output's address, and how many of its reads
#: failed.
X_WORD, OUT_WORD, BAD_WORD = 3, 4, 5


@intrinsic
def _readv(typingctx, pid, local, remote):
    """``process_vm_readv(pid, local, 1, remote, 1, 0)`` (int64 arguments, the iovecs' addresses), as a call
    of the C library's symbol: compiled code calling a ctypes function holds its address, which differs from
    one process to the next, so Numba will not cache it; a symbol is resolved when the cached code loads."""

    def codegen(context, builder, sig, args):
        i64, i32 = ir.IntType(64), ir.IntType(32)
        ptr = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(i64, [i32, ptr, i64, ptr, i64, i64])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "process_vm_readv")
        p, lo, re = args
        return builder.call(fn, [builder.trunc(p, i32), builder.inttoptr(lo, ptr), i64(1),
                                 builder.inttoptr(re, ptr), i64(1), i64(0)])

    return types.int64(types.int64, types.int64, types.int64), codegen


@njit(inline="always")
def _read(pid, dst, src_addr, iov):
    # dst[:] = the len(dst) elements at src_addr in process pid, by one process_vm_readv: the kernel copies
    # them straight from the peer's pages into mine.  iov: four int64, the local and the remote struct iovec.
    # True when every byte arrived.
    nbytes = dst.shape[0] * dst.itemsize
    if nbytes == 0:
        return True
    iov[0] = dst.ctypes.data
    iov[1] = nbytes
    iov[2] = src_addr
    iov[3] = nbytes
    return _readv(pid, iov.ctypes.data, iov.ctypes.data + 16) == nbytes


@njit(inline="always")
def _block(n, p, s):
    # Rank s's block [lo, hi) of n elements: the first n % p blocks one element longer (ShmAllreduce's cut).
    q, m = divmod(n, p)
    lo = s * q + min(s, m)
    return lo, lo + q + (1 if s < m else 0)


@njit(inline="always")
def _cma(x, out, me, flags, epoch, spin, step, pids, tmp, acc, iov, combine):
    p = pids.shape[0]
    item = x.itemsize
    n = x.shape[0]
    line = me * STRIDE
    flags[line + X_WORD] = x.ctypes.data
    flags[line + OUT_WORD] = out.ctypes.data
    barrier(flags, me, p, epoch, spin)  # every address is published (the barrier's release / acquire)
    xs = np.empty(p, np.int64)
    outs = np.empty(p, np.int64)
    for s in range(p):
        xs[s] = flags[s * STRIDE + X_WORD]
        outs[s] = flags[s * STRIDE + OUT_WORD]
    bad = 0
    inplace = x.ctypes.data == out.ctypes.data
    # Reduce-scatter: my block, step elements at a time, operands in rank order, each peer's read from its
    # input into tmp, the fold written to my out.
    lo, hi = _block(n, p, me)
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        own, dst, t = x[a:b], out[a:b], tmp[: b - a]
        if p == 2:
            if not _read(pids[1 - me], t, xs[1 - me] + a * item, iov):
                bad += 1
            # Read elementwise before written: in place (out is x) needs no copy aside, only the loop
            # that reads and writes one array (_accumulate's comment).
            if inplace:
                if me == 0:
                    _accumulate(dst, t, combine)
                else:
                    _accumulate_left(dst, t, combine)
            elif me == 0:
                _combine_into(dst, own, t, combine)
            else:
                _combine_into(dst, t, own, combine)
        else:
            r = acc[: b - a]
            if me == 0:
                _copy(r, own)
            elif not _read(pids[0], r, xs[0] + a * item, iov):
                bad += 1
            for s in range(1, p):
                if s == me:
                    _accumulate(r, own, combine)
                else:
                    if not _read(pids[s], t, xs[s] + a * item, iov):
                        bad += 1
                    _accumulate(r, t, combine)
            _copy(dst, r)
    barrier(flags, me, p, epoch + 1, spin)  # every block is in its owner's out
    # Allgather: every other block from its owner's out, into mine, one read each.
    for s in range(p):
        if s != me:
            slo, shi = _block(n, p, s)
            if not _read(pids[s], out[slo:shi], outs[s] + slo * item, iov):
                bad += 1
    flags[line + BAD_WORD] = bad
    # Nobody returns (and lets its caller touch x or out) while a peer may still read them.
    barrier(flags, me, p, epoch + 2, spin)
    total = 0
    for s in range(p):
        total += flags[s * STRIDE + BAD_WORD]
    return total


@njit(cache=True, nogil=True)
def cma_allreduce(x, out, me, flags, epoch, op, spin, step, pids, tmp, acc, iov):
    """``out = ((x0 op x1) op x2) ...`` over the ranks, each rank reading its peers' memory directly.

    Purpose: ``CmaAllreduce``'s call (its module comment) in one compiled
    loop: publish addresses, barrier, the reduce-scatter of my block
    ``step`` elements at a time, barrier, the allgather of the others'
    blocks from their owners' ``out``, a last barrier.
    Preconditions: 1-D C-contiguous ``x`` and ``out`` (``out`` may be ``x``,
    never partly overlapping it) of one numpy dtype, the same length on
    every rank; ``flags`` the window's flag lines (``ddlkernels._shm``) and
    the barriers ``epoch`` .. ``epoch + 2`` every rank's next; ``pids``
    every rank's process id, each readable by ``process_vm_readv`` from here
    (``ddlkernels._cma.probe``); ``tmp``, ``acc``: ``step`` elements of the
    dtype, private; ``iov``: four int64.  ``op``: ``ddlkernels._shm.OPCODES``.
    Use: ``CmaAllreduce.run``.  Returns the number of reads that failed on
    any rank (then ``out`` is garbage on every rank, and the caller raises):
    the same on every rank.  Bits as ``pieces_allreduce``'s.
    """
    if op == 0:
        return _cma(x, out, me, flags, epoch, spin, step, pids, tmp, acc, iov, _add)
    if op == 1:
        return _cma(x, out, me, flags, epoch, spin, step, pids, tmp, acc, iov, _mul)
    if op == 2:
        return _cma(x, out, me, flags, epoch, spin, step, pids, tmp, acc, iov, _max)
    return _cma(x, out, me, flags, epoch, spin, step, pids, tmp, acc, iov, _min)
