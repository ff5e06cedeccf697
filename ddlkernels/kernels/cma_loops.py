"""The single-copy allreduce's compiled loops (``ddlkernels.algorithms.cma``): peers' memory read and written with
``process_vm_readv`` / ``process_vm_writev``, folded in one pass, pushed to the peers; the barrier, combines and
folds are ``node_primitives``'.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .node_primitives import (STRIDE, _accumulate, _accumulate_left, _add, _block, _combine_into, _copy, _fold_run,
                              _max, _min, _mul, _peer_inputs, _row, _run_length, barrier, refresh_cache)

__all__ = ["cma_allreduce", "cma_allgather", "X_WORD", "OUT_WORD", "BAD_WORD"]


#: Words of a rank's flag line (``ddlkernels.algorithms.shm``: word 0 is its barrier count, 1-2 where its input lies in
#: a shared region) this call publishes: its input's and its output's address, and how many of its reads
#: failed.
X_WORD, OUT_WORD, BAD_WORD = 3, 4, 5


def _vm_call(symbol):
    """Codegen of ``symbol(pid, local, 1, remote, 1, 0)`` (``process_vm_readv`` / ``process_vm_writev``; int64
    arguments, the iovecs' addresses), as a call of the C library's symbol: compiled code calling a ctypes
    function holds its address, which differs from one process to the next, so Numba will not cache it; a
    symbol is resolved when the cached code loads."""

    def codegen(context, builder, sig, args):
        i64, i32 = ir.IntType(64), ir.IntType(32)
        ptr = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(i64, [i32, ptr, i64, ptr, i64, i64])
        fn = cgutils.get_or_insert_function(builder.module, fnty, symbol)
        p, lo, re = args
        return builder.call(fn, [builder.trunc(p, i32), builder.inttoptr(lo, ptr), i64(1),
                                 builder.inttoptr(re, ptr), i64(1), i64(0)])

    return codegen


@intrinsic
def _readv(typingctx, pid, local, remote):
    """``process_vm_readv(pid, local, 1, remote, 1, 0)``: bytes read (``_vm_call``)."""
    return types.int64(types.int64, types.int64, types.int64), _vm_call("process_vm_readv")


@intrinsic
def _writev(typingctx, pid, local, remote):
    """``process_vm_writev(pid, local, 1, remote, 1, 0)``: bytes written (``_vm_call``)."""
    return types.int64(types.int64, types.int64, types.int64), _vm_call("process_vm_writev")


@njit(inline="always")
def _vm(pid, mine, remote, iov, write):
    # One process_vm_readv (write False: mine[:] = the len(mine) elements at remote in process pid) or
    # process_vm_writev (write True: those elements = mine[:]); the kernel copies straight between the two
    # processes' pages.  iov: four int64, the local and the remote struct iovec.  True when every byte arrived
    # (``ddlkernels.algorithms.cma._vm`` is the same from Python).
    nbytes = mine.shape[0] * mine.itemsize
    if nbytes == 0:
        return True
    iov[0] = mine.ctypes.data
    iov[1] = nbytes
    iov[2] = remote
    iov[3] = nbytes
    if write:
        return _writev(pid, iov.ctypes.data, iov.ctypes.data + 16) == nbytes
    return _readv(pid, iov.ctypes.data, iov.ctypes.data + 16) == nbytes


@njit(inline="always")
def _read(pid, dst, src_addr, iov):
    return _vm(pid, dst, src_addr, iov, False)


@njit(inline="always")
def _write(pid, src, dst_addr, iov):
    return _vm(pid, src, dst_addr, iov, True)


@njit(inline="always")
def _last_barrier(flags, me, p, epoch, spin, bad):
    # A single-copy call's last barrier, ``epoch``: my count of failed reads and writes published before it,
    # every rank's summed after it (the same total everywhere).  A peer rewrites its word only after the first
    # barrier of its next call, which I reach after summing.
    flags[me * STRIDE + BAD_WORD] = bad
    barrier(flags, me, p, epoch, spin)
    total = 0
    for s in range(p):
        total += flags[s * STRIDE + BAD_WORD]
    return total


@njit(inline="always")
def _fold_piece(r, x, a, me, pids, xs, shared, tmp, ops, iov, combine):
    # From 3 ranks: r = ((x0 op x1) op x2) ... over elements [a, a + len(r)) of every rank's x, in rank order.
    # The operands come in runs (the first of four, the later of three): each peer's of a run read into a row
    # of tmp (four rows, a piece each) -- or found where it lies, mine and a shared peer's -- and then the run
    # folded in one pass (_fold_first, _fold_next).  Folding each operand as it arrived made p - 1 passes over
    # r; with 4 ranks this makes one (bench/results/constants.md, the fold of a run of operands).  Returns the
    # number of reads that failed.
    p = pids.shape[0]
    item = x.itemsize
    m = r.shape[0]
    bad = 0
    j = 0
    while j < p:
        k = _run_length(p, j)
        row = 0
        for s in range(j, j + k):
            if s == me:
                ops[s - j] = x.ctypes.data + a * item
            elif shared[s] != 0:
                ops[s - j] = shared[s] + a * item
            else:
                t = tmp[row, :m]
                row += 1
                if not _read(pids[s], t, xs[s] + a * item, iov):
                    bad += 1
                ops[s - j] = t.ctypes.data
        _fold_run(r, j, k, ops, combine)
        j += k
    return bad


@njit(inline="always")
def _cma(x, out, me, flags, epoch, spin, step, pids, tmp, acc, iov, push, bases, combine):
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
    # A peer's x in a shared region (``ShmAllreduce.empty``), mapped here too: read where it lies, with plain
    # loads, instead of through the kernel (which pins its 4 KiB pages every call).  0: private, read by readv.
    shared = np.zeros(p, np.int64)
    if bases.shape[0] > 0:
        _peer_inputs(flags, bases, shared)
    bad = 0
    inplace = x.ctypes.data == out.ctypes.data
    ops = np.empty(4, np.int64)
    # Reduce-scatter: my block, step elements at a time, operands in rank order, folded in my out.  With 2
    # ranks, out of place, the peer's operand is read straight into out and mine folded into it there: faster
    # than reading into tmp and folding from it into out (bench/results/constants.md, PIECE_BYTES of cma.py); in
    # place, out is my own operand and the peer's goes through tmp.  From 3 ranks the peers' operands are read
    # into rows of tmp and folded a run at a time (_fold_piece) into out, or in place into acc, copied to out.
    lo, hi = _block(n, p, me)
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        own, dst, t = x[a:b], out[a:b], tmp[0, : b - a]
        if p == 2 and shared[1 - me] != 0:
            row = _row(shared, 1 - me, a, b - a, x)  # the peer's operand where it lies
            if inplace:
                if me == 0:
                    _accumulate(dst, row, combine)
                else:
                    _accumulate_left(dst, row, combine)
            elif me == 0:
                _combine_into(dst, own, row, combine)
            else:
                _combine_into(dst, row, own, combine)
        elif p == 2:
            peer = t if inplace else dst
            if not _read(pids[1 - me], peer, xs[1 - me] + a * item, iov):
                bad += 1
            # Read elementwise before written: folding into dst, which may be x, needs no copy aside, only
            # the loops that read and write one array (_accumulate's comment).
            if inplace:
                if me == 0:
                    _accumulate(dst, t, combine)
                else:
                    _accumulate_left(dst, t, combine)
            elif me == 0:
                _accumulate_left(dst, own, combine)
            else:
                _accumulate(dst, own, combine)
        else:
            r = acc[: b - a] if inplace else dst
            bad += _fold_piece(r, x, a, me, pids, xs, shared, tmp, ops, iov, combine)
            if inplace:
                _copy(dst, r)
        if push:
            # The piece, still in my cache, into every peer's out at once (its block of mine, which no peer
            # touches during the call; in place, x's piece that only I read, and have read).
            for s in range(p):
                if s != me and not _write(pids[s], dst, outs[s] + a * item, iov):
                    bad += 1
    barrier(flags, me, p, epoch + 1, spin)  # every block is in its owner's out (pushed: in every out)
    # Allgather, unless pushed: every other block from its owner's out, into mine, one read each.
    for s in range(p):
        if s != me and not push:
            slo, shi = _block(n, p, s)
            if not _read(pids[s], out[slo:shi], outs[s] + slo * item, iov):
                bad += 1
    # Nobody returns (and lets its caller touch x or out) while a peer may still read them.
    return _last_barrier(flags, me, p, epoch + 2, spin, bad)


@njit(cache=True, nogil=True)
def cma_allreduce_sum(x, out, me, flags, epoch, spin, step, pids, tmp, acc, iov, push, bases):
    """``out = ((x0 + x1) + x2) ...`` over the ranks, each rank reading its peers' memory directly
    (``cma_allreduce[op]``: ``_prod``, ``_max``, ``_min`` the same with their op).

    Purpose: ``CmaAllreduce``'s call (its module comment) in one compiled
    loop: publish addresses, barrier, the reduce-scatter of my block
    ``step`` elements at a time, barrier, the allgather of the others'
    blocks from their owners' ``out``, a last barrier.  ``push`` (the same
    on every rank): each folded piece is written into every peer's ``out``
    right away (``process_vm_writev``) and the allgather reads nothing.
    Preconditions: 1-D C-contiguous ``x`` and ``out`` (``out`` may be ``x``,
    never partly overlapping it) of one numpy dtype, the same length on
    every rank; ``flags`` the window's flag lines (``ddlkernels.algorithms.shm``) and
    the barriers ``epoch`` .. ``epoch + 2`` every rank's next; ``pids``
    every rank's process id, each readable by ``process_vm_readv`` from here
    (``ddlkernels.algorithms.cma.probe``, which tries both directions); ``tmp``: four
    rows of ``step`` elements of the dtype, ``acc``: ``step`` elements,
    both private and C-contiguous; ``iov``: four int64.
    ``bases``: the window's shared
    regions as mapped here (``ShmAllreduce._bases``, no rows when there are
    none); with rows, every rank has published where its ``x`` lies
    (``ShmAllreduce._publish``) before the first barrier, and a peer's ``x``
    in a region is read where it lies instead of by ``process_vm_readv``.
    Use: ``CmaAllreduce.run``.  Returns the number of reads or writes that failed on
    any rank (then ``out`` is garbage on every rank, and the caller raises):
    the same on every rank.  Bits as ``pieces_allreduce_sum``'s.
    """
    return _cma(x, out, me, flags, epoch, spin, step, pids, tmp, acc, iov, push, bases, _add)


@njit(cache=True, nogil=True)
def cma_allreduce_prod(x, out, me, flags, epoch, spin, step, pids, tmp, acc, iov, push, bases):
    return _cma(x, out, me, flags, epoch, spin, step, pids, tmp, acc, iov, push, bases, _mul)


@njit(cache=True, nogil=True)
def cma_allreduce_max(x, out, me, flags, epoch, spin, step, pids, tmp, acc, iov, push, bases):
    return _cma(x, out, me, flags, epoch, spin, step, pids, tmp, acc, iov, push, bases, _max)


@njit(cache=True, nogil=True)
def cma_allreduce_min(x, out, me, flags, epoch, spin, step, pids, tmp, acc, iov, push, bases):
    return _cma(x, out, me, flags, epoch, spin, step, pids, tmp, acc, iov, push, bases, _min)


cma_allreduce = (cma_allreduce_sum, cma_allreduce_prod, cma_allreduce_max, cma_allreduce_min)


@njit(cache=True, nogil=True)
def cma_allgather(shard, out, me, flags, epoch, spin, pids, los, his, iov):
    """``out[los[s]:his[s]] = shard of rank s`` for every s, each rank reading its peers' shards where they lie.

    Purpose: ``CmaAllreduce.allgather`` in one compiled call: publish my
    shard's address, barrier, copy my shard into my part of ``out``, read
    every peer's shard straight into its part of ``out`` (one
    ``process_vm_readv`` each, rank me + 1 first so that the ranks' reads
    of one moment go to different processes), barrier: nobody returns, and
    lets its caller touch its shard, while a peer may still read it.  One
    copy of every byte, two barriers whatever the size, where the window
    copies each chunk twice (into the stage, out of it) with two barriers
    per chunk.
    Preconditions: ``shard`` and ``out`` 1-D C-contiguous bytes (the
    caller's arrays viewed as uint8, so one compilation serves every
    dtype), not overlapping; ``los``/``his`` (int64, p each) every rank's
    byte range in ``out``, mine ``len(shard)`` long, the same on every
    rank; ``flags`` the window's flag lines and the barriers ``epoch``,
    ``epoch + 1`` every rank's next; ``pids`` as for ``cma_allreduce``;
    ``iov``: four int64.
    Use: ``CmaAllreduce.allgather`` / ``gather_fn``.  Returns the number of
    reads that failed on any rank (then ``out`` is garbage on every rank,
    and the caller raises): the same on every rank.
    """
    p = pids.shape[0]
    line = me * STRIDE
    flags[line + X_WORD] = shard.ctypes.data
    barrier(flags, me, p, epoch, spin)  # every shard's address is published
    _copy(out[los[me] : his[me]], shard)
    bad = 0
    for k in range(1, p):
        s = (me + k) % p
        # A peer's address is read here, before the last barrier: a peer rewrites it only in its next call,
        # which it enters after that barrier.
        if not _read(pids[s], out[los[s] : his[s]], flags[s * STRIDE + X_WORD], iov):  # none for an empty shard
            bad += 1
    return _last_barrier(flags, me, p, epoch + 1, spin, bad)


refresh_cache(globals())
