"""Compiled parts of the shared-memory collectives (``ddlkernels._shm``): a flag barrier, the small-message calls
and the large calls' piece loops (allreduce, reduce_scatter, allgather); and the single-copy allreduce's loop
(``ddlkernels._cma``), which reads a peer's memory with ``process_vm_readv``.

Why compiled: a latency-bound allreduce through the window is a copy, a
barrier and an addition of a few KiB.  Done as numpy calls around
``MPI_Barrier`` (with ``MPI_Win_sync`` on each side to order the stores),
each of the five steps cost a few hundred nanoseconds of call overhead, and
the whole was no faster than MPI's own allreduce at 4 KiB with 2 ranks.
``bench/studies/shm_pieces.py --small`` (float32 sum, the "whole" line against
MPI_Allreduce in the same run), the commit before and this one, minutes
apart: 2 ranks 2.7 vs 2.6 us before, 1.78 vs 2.58 us now; 4 ranks (on 2
cores) 25.2 vs 43.4 us before, 9.4 vs 26.6 us now.  reduce_scatter and
allgather got the same treatment (``--small --shards``).

The barrier.  Every rank owns one 64-byte line of ``flags`` (int64 index
``rank * STRIDE``, with ``STRIDE = ddlkernels._shm.FLAG_STRIDE``, so no
two ranks write the same line) and a count of the barriers it has entered,
the *epoch*, the same on every rank because every rank makes the same
calls.  Worked example, 2 ranks, third barrier::

    rank 0: flags[0] = 3  (release)      rank 1: ...still copying its stage
            wait flags[0], flags[8] >= 3 (acquire)
                                         rank 1: flags[8] = 3 (release)
            sees 3: every store rank 1 made before its release is visible
                                         rank 1: sees flags[0] = 3, goes on

The release store orders every load and store the rank made before it (the
stage it filled, the stage it read in the previous call) before the flag;
the acquire load orders every later access after it.  That is the
``MPI_Win_sync`` + barrier + ``MPI_Win_sync`` it replaces, as the MPI-3
shared-memory model allows (flag synchronization through a shared window);
the atomics are LLVM's, so the ordering also holds on weaker memory models
than x86's.

A waiting rank polls; after ``spin`` polls it calls ``sched_yield`` between
polls, so that with more ranks than cores (4 ranks on 2 here) the rank it
waits for gets the core: without it a 4 KiB allreduce of 4 ranks on 2
cores takes a scheduler time slice, 4.2 ms instead of 8 us.  The spin
count, ``ddlkernels._shm.SPIN``, is measured.

No deadline here: a call with ``timeout=`` arrives with ``arrive`` and polls
``arrived`` from Python (``ShmAllreduce._barrier``), so every rank takes the
same barrier whether or not it has a timeout.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic, overload
from numba.np.arrayobj import make_array

from .._shm import FLAG_STRIDE as STRIDE


def _element_pointer(context, builder, arrty, arr, idx):
    ary = make_array(arrty)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [idx], wraparound=False)


@intrinsic
def _load_acquire(typingctx, arr, idx):
    """``arr[idx]`` (int64) as an atomic acquire load."""

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(arr, idx), codegen


@intrinsic
def _store_release(typingctx, arr, idx, value):
    """``arr[idx] = value`` (int64) as an atomic release store."""

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
        builder.store_atomic(args[2], ptr, "release", 8)
        return context.get_dummy_value()

    return types.void(arr, idx, value), codegen


@intrinsic
def _sched_yield(typingctx):
    """libc's ``sched_yield()``, by symbol name (resolved in the process, so Numba's disk cache keeps it)."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        return builder.call(fn, [])

    return types.int32(), codegen


@njit(cache=True, nogil=True)
def arrive(flags, me, epoch):
    """Enter barrier ``epoch``: publish it in my line, after every access I made before."""
    _store_release(flags, me * STRIDE, epoch)


@njit(cache=True, nogil=True)
def arrived(flags, p, epoch):
    """Whether all ``p`` ranks have entered barrier ``epoch`` (one poll of each line)."""
    for s in range(p):
        if _load_acquire(flags, s * STRIDE) < epoch:
            return False
    return True


@njit(cache=True, nogil=True)
def _wait(flags, p, epoch, spin):
    for s in range(p):
        polls = 0
        while _load_acquire(flags, s * STRIDE) < epoch:
            polls += 1
            if polls > spin:
                _sched_yield()


@njit(cache=True, nogil=True)
def barrier(flags, me, p, epoch, spin):
    """Barrier ``epoch`` of the ``p`` ranks whose flags are ``flags``: arrive, then wait for all."""
    _store_release(flags, me * STRIDE, epoch)
    _wait(flags, p, epoch, spin)


# The combines.  When both operands of a float sum or product are NaNs,
# IEEE 754 leaves open which one comes out, and so does numpy: its add
# returned the first operand's NaN in a vector body and the second's in the
# loop's tail, for the same two values (found by the test of this call at 4
# ranks).  Here the choice is fixed, whatever order LLVM gives the
# instruction or wherever the element lies: a's NaN if a is one, else b's,
# quieted by adding it to itself.  Every other result is numpy's.  max/min
# select as numpy's loops do: a NaN in a wins, then one in b, and on a tie
# (0.0 and -0.0) b.  For integers the NaN tests are constant False and
# vanish.
@njit(inline="always")
def _sum(u, v):
    return u + u if u != u else (v + v if v != v else u + v)


@njit(inline="always")
def _prod(u, v):
    return u + u if u != u else (v + v if v != v else u * v)


@njit(inline="always")
def _max(u, v):
    return u if (u > v or u != u) else v


@njit(inline="always")
def _min(u, v):
    return u if (u < v or u != u) else v


@njit(inline="always")
def _fold(stage, lo, hi, out, combine):
    # out[:hi - lo] = ((row 0 op row 1) op row 2) ... over columns [lo, hi): the
    # rank order numpy's pairwise calls use.  Rows are sliced first, so the
    # loops index from 0: an index like lo + i, which Numba cannot prove
    # non-negative, gets a wraparound check that keeps LLVM from vectorizing.
    a, b = stage[0][lo:hi], stage[1][lo:hi]
    for i in range(hi - lo):
        out[i] = combine(a[i], b[i])
    for s in range(2, stage.shape[0]):
        c = stage[s][lo:hi]
        for i in range(hi - lo):
            out[i] = combine(out[i], c[i])


@njit(inline="always")
def _stage_and_meet(x, stage, me, flags, epoch, spin):
    # x into my row of the stage set, then barrier ``epoch``: every row is then full.
    mine = stage[me]
    for i in range(x.shape[0]):
        mine[i] = x[i]
    _store_release(flags, me * STRIDE, epoch)
    _wait(flags, stage.shape[0], epoch, spin)


# One compiled function per op, for each loop that folds (small_fold, pieces_allreduce,
# pieces_reduce_scatter, cma_allreduce): a tuple indexed by ``ddlkernels._shm.OPCODES``
# (sum, prod, max, min), each member with its combine fixed.  A process compiles only the ops it calls, once
# per dtype, where one function with the op as an argument compiled all four folds for every dtype before its
# first call.  ``python bench/studies/first_calls.py`` (a job's first 60 float32 sum allreduces of 16 MiB, on an empty
# Numba cache; the tuner's trials compile the window's and cma's loops): 30.2 s before, 8.0 s after with 2
# ranks; 67.2 s and 17.7 s with 4 (on 2 cores).  A job whose cache is warm: 0.6-0.7 s either way.
@njit(cache=True, nogil=True)
def small_fold_sum(x, stage, me, out, flags, epoch, spin, lo, hi):
    """``out = (((x0 + x1) + x2) ...)[lo:hi]`` over the ranks, through one small-message stage set
    (``small_fold[op]``: ``_prod``, ``_max``, ``_min`` the same with their op).

    Purpose: the whole of a latency-bound allreduce ([lo, hi) all of x) or
    reduce_scatter (my shard) in one call: stage, barrier, fold.
    Preconditions: ``stage`` is a (p, m) array in the window, p >= 2,
    m >= len(x), row s rank s's stage, not read by any rank since barrier
    ``epoch - 1`` (the caller alternates two sets); ``x`` holds len(x)
    elements of ``stage``'s dtype, [lo, hi) within it, ``out`` hi - lo of
    them (``out`` may be ``x`` when [lo, hi) is all of it: x is staged
    before ``out`` is written); every rank calls with the same ``epoch``
    and op.
    Use: ``ShmAllreduce._small_fn`` and ``ShmAllreduce.shard_fn``.  The
    result has numpy's bits but for which of two NaNs a sum or product
    returns (see the combines above), and the same bits on every rank.
    """
    _stage_and_meet(x, stage, me, flags, epoch, spin)
    _fold(stage, lo, hi, out, _sum)


@njit(cache=True, nogil=True)
def small_fold_prod(x, stage, me, out, flags, epoch, spin, lo, hi):
    _stage_and_meet(x, stage, me, flags, epoch, spin)
    _fold(stage, lo, hi, out, _prod)


@njit(cache=True, nogil=True)
def small_fold_max(x, stage, me, out, flags, epoch, spin, lo, hi):
    _stage_and_meet(x, stage, me, flags, epoch, spin)
    _fold(stage, lo, hi, out, _max)


@njit(cache=True, nogil=True)
def small_fold_min(x, stage, me, out, flags, epoch, spin, lo, hi):
    _stage_and_meet(x, stage, me, flags, epoch, spin)
    _fold(stage, lo, hi, out, _min)


small_fold = (small_fold_sum, small_fold_prod, small_fold_max, small_fold_min)


@njit(cache=True, nogil=True)
def small_allgather(shard, stage, me, out, flags, epoch, spin, los, his):
    """``out[los[s]:his[s]] = shard of rank s`` for every s, through one stage set.

    Purpose: a latency-bound allgather in one call.
    Preconditions: ``stage`` as for ``small_fold_sum``, with m >= every
    shard's length; ``los``/``his`` (int64, p each) place the shards in
    ``out``, mine holding ``len(shard)`` elements; ``out`` does not overlap
    ``shard``.
    Use: ``ShmAllreduce.allgather`` (small messages).
    """
    k = shard.shape[0]
    mine, own = stage[me], out[los[me] : los[me] + k]
    for i in range(k):
        mine[i] = shard[i]
        own[i] = shard[i]
    p = stage.shape[0]
    _store_release(flags, me * STRIDE, epoch)
    _wait(flags, p, epoch, spin)
    for s in range(p):
        if s != me:
            dst, src = out[los[s] : his[s]], stage[s]
            for i in range(his[s] - los[s]):
                dst[i] = src[i]


def _copy_signature(dst, src, codegen):
    """The intrinsics' ``(signature, codegen)`` for ``dst[:len(src)] = src`` on two C-contiguous 1-D arrays of
    one dtype; None (no match: Numba reports a typing error) for anything else."""
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and dst.ndim == src.ndim == 1
            and dst.layout == src.layout == "C" and dst.dtype == src.dtype):
        return None
    return types.void(dst, src), codegen


@intrinsic
def _memcpy(typingctx, dst, src):
    """``dst[:len(src)] = src`` for two C-contiguous 1-D arrays of one dtype, as LLVM's memcpy (libc's for
    long runs: as fast as numpy's own copies, where a loop was not when the source came from memory)."""

    def codegen(context, builder, sig, args):
        darr = make_array(sig.args[0])(context, builder, args[0])
        sarr = make_array(sig.args[1])(context, builder, args[1])
        count = builder.extract_value(sarr.shape, 0)
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(sig.args[1].dtype)))
        cgutils.raw_memcpy(builder, darr.data, sarr.data, count, itemsize)
        return context.get_dummy_value()

    return _copy_signature(dst, src, codegen)


def _copy(dst, src):
    """``dst[:len(src)] = src`` (1-D arrays of one dtype, ``dst`` at least as long, not overlapping)."""


@overload(_copy, inline="always")
def _copy_impl(dst, src):
    if dst.layout == src.layout == "C":
        return lambda dst, src: _memcpy(dst, src)

    def loop(dst, src):
        for i in range(src.shape[0]):
            dst[i] = src[i]

    return loop


@intrinsic
def _stream_memcpy(typingctx, dst, src):
    """``dst[:len(src)] = src`` for two C-contiguous 1-D arrays of one dtype, the destination's aligned
    64-byte lines written with non-temporal stores, then a full fence (see ``_stream``)."""

    def codegen(context, builder, sig, args):
        darr = make_array(sig.args[0])(context, builder, args[0])
        sarr = make_array(sig.args[1])(context, builder, args[1])
        i64 = ir.IntType(64)
        itemsize = context.get_abi_sizeof(context.get_data_type(sig.args[1].dtype))
        nbytes = builder.mul(builder.extract_value(sarr.shape, 0), i64(itemsize))
        dst_addr = builder.ptrtoint(darr.data, i64)
        src_addr = builder.ptrtoint(sarr.data, i64)
        # Bytes before the destination's first 64-byte boundary (or all of them, if fewer), then whole lines,
        # then the rest: only whole aligned lines can be streamed.
        head = builder.and_(builder.neg(dst_addr), i64(63))
        head = builder.select(builder.icmp_unsigned("<", nbytes, head), nbytes, head)
        lines = builder.lshr(builder.sub(nbytes, head), i64(6))
        body = builder.shl(lines, i64(6))
        byte_ptr = ir.IntType(8).as_pointer()

        def copy(offset, count):
            cgutils.raw_memcpy(builder, builder.inttoptr(builder.add(dst_addr, offset), byte_ptr),
                               builder.inttoptr(builder.add(src_addr, offset), byte_ptr), count, i64(1))

        copy(i64(0), head)
        line = ir.VectorType(i64, 8).as_pointer()
        nontemporal = builder.module.add_metadata([ir.IntType(32)(1)])
        with cgutils.for_range(builder, lines) as loop:
            offset = builder.add(head, builder.shl(loop.index, i64(6)))
            value = builder.load(builder.inttoptr(builder.add(src_addr, offset), line), align=1)
            store = builder.store(value, builder.inttoptr(builder.add(dst_addr, offset), line), align=64)
            store.set_metadata("nontemporal", nontemporal)
        copy(builder.add(head, body), builder.sub(builder.sub(nbytes, head), body))
        # Non-temporal stores are weakly ordered, even on x86: without the fence a later release store (a
        # barrier's) could become visible before them.
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return _copy_signature(dst, src, codegen)


def _stream(dst, src, stream):
    """``_copy(dst, src)``; if ``stream``, with non-temporal stores where both are C-contiguous.

    Non-temporal stores go to memory without first reading the line into the
    cache, as a normal store must (a third of a large copy's memory traffic),
    and without evicting what the cache holds.  For a destination nobody
    reads soon: a large message's ``out``, as libc's memcpy does for copies
    larger than the cache.
    """


@overload(_stream, inline="always")
def _stream_impl(dst, src, stream):
    if dst.layout == src.layout == "C":
        def fast(dst, src, stream):
            if stream:
                _stream_memcpy(dst, src)
            else:
                _memcpy(dst, src)

        return fast
    return lambda dst, src, stream: _copy(dst, src)


# The pieces' sum and product: plain IEEE arithmetic.  Unlike the small call,
# where every rank folds every element and so must pick the same of two NaNs
# wherever its loop puts the element (_sum), each block of a piece is folded
# by one rank and copied by the others: the bits agree everywhere as they
# are.  LLVM may swap the operands, so which of two NaNs comes out is open,
# as it is in numpy; everything else is numpy's bits.
@njit(inline="always")
def _add(u, v):
    return u + v


@njit(inline="always")
def _mul(u, v):
    return u * v


@njit(inline="always")
def _combine_into(res, a, b, combine):
    # res = a op b, three arrays that do not overlap (for res that is a or b, _accumulate or _accumulate_left).
    for i in range(res.shape[0]):
        res[i] = combine(a[i], b[i])


# An accumulator (res = res op b) gets loops of its own.  LLVM vectorizes a loop over arrays it cannot prove
# disjoint only behind a run-time overlap check, which res == a fails: _combine_into(r, r, b) ran scalar.  A
# loop that reads and writes res through one array has nothing to check.  It was the cma allreduce in place
# (its fold into x's own block): ``mpirun -n 2 python -m mpi4py bench/studies/shm_pieces.py --cma --inplace --pages
# huge --pieces 512K --sizes 256K,1M,4M,16M``, before / after, alternated twice: 19.7-24.5 / 15.6-16.7 us at
# 256 KiB, 58.6-58.8 / 35.1-38.4 at 1 MiB, 240-243 / 145-157 at 4 MiB, 1657-1706 / 1506-1581 at 16 MiB.
# (With 3 ranks, where the window and cma fold into an accumulator, no change beyond the noise.)
@njit(inline="always")
def _accumulate(res, b, combine):
    # res = res op b
    for i in range(res.shape[0]):
        res[i] = combine(res[i], b[i])


@njit(inline="always")
def _accumulate_left(res, a, combine):
    # res = a op res: a lower rank's operand folded into a higher rank's in-place block, in rank order.
    for i in range(res.shape[0]):
        res[i] = combine(a[i], res[i])


@intrinsic
def _pointer(typingctx, addr, like):
    """The address ``addr`` (int64) as a pointer to ``like``'s dtype, for ``numba.carray``."""

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return types.CPointer(like.dtype)(addr, like), codegen


@njit(inline="always")
def _row(addrs, s, lo, n, like):
    # ``n`` elements of ``like``'s dtype from element ``lo`` of the memory at ``addrs[s]`` (rank s's stage,
    # result or shared input): every rank's as one int64 array of addresses, so that one compiled function serves
    # every number of ranks (a tuple of p arrays would be a type, and a compilation, per p).
    return carray(_pointer(addrs[s] + lo * like.itemsize, like), n)


@njit(inline="always")
def _peer_inputs(flags, bases, addr):
    # After a large call's first barrier: where each rank published its input (ShmAllreduce._publish: region
    # index + 1 and byte offset in words 1 and 2 of its flag line), as an address in this process, or 0
    # where it staged.  bases[k, s]: rank s's region k, mapped here.
    for s in range(addr.shape[0]):
        region = flags[s * STRIDE + 1]
        addr[s] = bases[region - 1, s] + flags[s * STRIDE + 2] if region > 0 else 0


@njit(inline="always")
def _operand(stages, addr, s, lo, hi, at, like):
    # Rank s's operand: its input from element ``at`` where it lies in a shared region, else its stage[lo:hi].
    if addr[s] != 0:
        return _row(addr, s, at, hi - lo, like)
    return _row(stages, s, lo, hi - lo, like)


@njit(inline="always")
def _fold_first(r, k, a0, a1, a2, a3, combine):
    # r = ((o0 op o1) op o2) op o3 (k == 4) or (o0 op o1) op o2 (k == 3): o0 .. o3 the len(r) elements of r's
    # dtype at addresses a0 .. a3, none overlapping r (LLVM's run-time overlap check then passes, and the loop
    # runs vectorized).  One pass reads every operand and writes r once, where folding one operand at a time
    # reads and writes r once per operand.  Addresses, not arrays: a caller's own operand (a slice of its x,
    # perhaps read-only) and a peer's (a row of scratch, a shared mapping) are then one type.
    m = r.shape[0]
    o0, o1, o2 = carray(_pointer(a0, r), m), carray(_pointer(a1, r), m), carray(_pointer(a2, r), m)
    if k == 4:
        o3 = carray(_pointer(a3, r), m)
        for i in range(m):
            r[i] = combine(combine(combine(o0[i], o1[i]), o2[i]), o3[i])
    else:
        for i in range(m):
            r[i] = combine(combine(o0[i], o1[i]), o2[i])


@njit(inline="always")
def _fold_next(r, k, a0, a1, a2, combine):
    # r = ((r op o0) op o1) op o2 over the k (1-3) operands at a0 .. a2: a fold's later operands, r read and
    # written through one array (_accumulate's comment).
    m = r.shape[0]
    o0 = carray(_pointer(a0, r), m)
    if k == 1:
        for i in range(m):
            r[i] = combine(r[i], o0[i])
        return
    o1 = carray(_pointer(a1, r), m)
    if k == 2:
        for i in range(m):
            r[i] = combine(combine(r[i], o0[i]), o1[i])
        return
    o2 = carray(_pointer(a2, r), m)
    for i in range(m):
        r[i] = combine(combine(combine(r[i], o0[i]), o1[i]), o2[i])


@njit(inline="always")
def _fold_run(r, j, k, ops, combine):
    # Fold the run of k operands j .. j + k - 1 (addresses ops[:k]) into r: the first run of a fold (j == 0,
    # three or four operands) makes r, the later ones (one to three) fold into it.
    if j == 0:
        _fold_first(r, k, ops[0], ops[1], ops[2], ops[3], combine)
    else:
        _fold_next(r, k, ops[0], ops[1], ops[2], combine)


@njit(inline="always")
def _run_length(p, j):
    # Operands in the fold's run from operand j of p: four in the first, then three at a time.  What four
    # operands and the fold take of a core's cache bounds it (``ddlkernels._cma.PIECE_BYTES_WIDE``).
    return min(p - j, 4 if j == 0 else 3)


@njit(inline="always")
def _fold_block(res, own, stages, addr, me, lo, hi, at, ops, combine):
    # res = ((operand 0 op operand 1) op operand 2) ..., operand s being my own block ``own`` for s == me
    # and rank s's (_operand) otherwise: the rank order of _fold.  With 2 ranks one pass of two operands (each
    # its own call, so that ``own``, a slice of the caller's x, perhaps read-only, and the peer's block keep
    # their types); from 3 in runs of up to four operands, a pass each (_fold_first), their addresses in
    # ``ops`` (four int64, the caller's scratch).
    p = stages.shape[0]
    if p == 2:
        if me == 0:
            _combine_into(res, own, _operand(stages, addr, 1, lo, hi, at, res), combine)
        else:
            _combine_into(res, _operand(stages, addr, 0, lo, hi, at, res), own, combine)
        return
    item = res.itemsize
    j = 0
    while j < p:
        k = _run_length(p, j)
        for s in range(j, j + k):
            if s == me:
                ops[s - j] = own.ctypes.data
            elif addr[s] != 0:
                ops[s - j] = addr[s] + at * item
            else:
                ops[s - j] = stages[s] + lo * item
        _fold_run(res, j, k, ops, combine)
        j += k


@njit(inline="always")
def _block(n, p, s):
    # Rank s's block [lo, hi) of n elements: the first n % p blocks one element longer (``ddlkernels._shm.cuts``,
    # compiled: the piece loops' and the cma loop's cut).
    q, m = divmod(n, p)
    lo = s * q + min(s, m)
    return lo, lo + q + (1 if s < m else 0)


@njit(inline="always")
def _pieces(x, stages, results, me, out, flags, epoch, spin, step, stream, spill, staged, bases, combine):
    p = stages.shape[0]
    addr = np.zeros(p, np.int64)
    ops = np.empty(4, np.int64)  # a fold run's operand addresses (_fold_block)
    e = epoch
    for a in range(0, x.shape[0], step):
        b = min(x.shape[0], a + step)
        xs, os = x[a:b], out[a:b]
        lo, hi = _block(b - a, p, me)
        # Stage what my peers need of this piece (all but my own block), then barrier: every stage is full.
        if staged:
            _copy(_row(stages, me, 0, lo, x), xs[:lo])
            _copy(_row(stages, me, hi, b - a - hi, x), xs[hi:])
        barrier(flags, me, p, e, spin)
        if a == 0 and bases.shape[0] > 0:
            _peer_inputs(flags, bases, addr)
        # My block, summed in rank order into my published result, then copied to out (out is only written).
        k = hi - lo
        res, dst = _row(results, me, 0, k, x), os[lo:hi]
        # Spilled: summed into my stage's slot for my own block, which nobody reads, then written to the result
        # with non-temporal stores: the peers read it from memory, not from this core's cache.  One call of the
        # fold for both: it is inlined, and each call site is compiled again (with 4 ranks' runs, five loops).
        mine = _row(stages, me, lo, k, x) if spill else res
        _fold_block(mine, xs[lo:hi], stages, addr, me, lo, hi, a + lo, ops, combine)
        if spill:
            _stream(res, mine, True)
            _stream(dst, mine, stream)
        else:
            _stream(dst, res, stream)
        barrier(flags, me, p, e + 1, spin)
        # Every other block from its owner's result.
        for s in range(p):
            if s != me:
                slo, shi = _block(b - a, p, s)
                _stream(os[slo:shi], _row(results, s, 0, shi - slo, x), stream)
        e += 2


@njit(cache=True, nogil=True)
def pieces_allreduce_sum(x, stages, results, me, out, flags, epoch, spin, step, stream, spill, staged, bases):
    """``out = ((x0 + x1) + x2) ...`` over the ranks, piece by piece through the large window
    (``pieces_allreduce[op]``: ``_prod``, ``_max``, ``_min`` the same with their op).

    Purpose: ``ShmAllreduce``'s piece loop (its module comment) as one call
    -- stage, barrier, fold my block, barrier, gather, per piece of ``step``
    elements -- instead of a dozen numpy calls per piece: at 64-256 KiB the
    calls, not the memory, were most of the time.
    Preconditions: ``stages[s]`` / ``results[s]`` (int64) are the addresses
    of rank s's stage (at least ``step`` elements) and result (at least
    ceil(step / p)) in the window, for ``x``'s dtype; ``out`` holds len(x)
    elements (it may be ``x``); the pieces' barriers are ``epoch``, ``epoch + 1``, ... (two per
    piece), and every rank calls with the same length, ``step``, ``epoch``
    and op; a peer may run the same pieces
    from Python (``ShmAllreduce._piece``): the steps and barriers are the
    same.  ``bases`` (int64, regions x p): every rank's shared region
    (``ShmAllreduce.empty``) at its address here, none (0 rows) when there
    are none; each rank has published in its flag line where its input lies
    (``ShmAllreduce._publish``), and ``staged`` is False when mine lies in
    one: peers then read it there, and I stage nothing.  ``stream``: write
    ``out`` with non-temporal stores (``_stream``; for messages larger than
    the cache); ``spill``: write my result blocks so (the peers then read
    them from memory: ``ddlkernels._tuner.SPILL_FROM``).
    Use: ``ShmAllreduce._compiled``.  The bits are numpy's but for which of
    two NaNs a sum or product returns (see the combines above), and the same
    on every rank.
    """
    _pieces(x, stages, results, me, out, flags, epoch, spin, step, stream, spill, staged, bases, _add)


@njit(cache=True, nogil=True)
def pieces_allreduce_prod(x, stages, results, me, out, flags, epoch, spin, step, stream, spill, staged, bases):
    _pieces(x, stages, results, me, out, flags, epoch, spin, step, stream, spill, staged, bases, _mul)


@njit(cache=True, nogil=True)
def pieces_allreduce_max(x, stages, results, me, out, flags, epoch, spin, step, stream, spill, staged, bases):
    _pieces(x, stages, results, me, out, flags, epoch, spin, step, stream, spill, staged, bases, _max)


@njit(cache=True, nogil=True)
def pieces_allreduce_min(x, stages, results, me, out, flags, epoch, spin, step, stream, spill, staged, bases):
    _pieces(x, stages, results, me, out, flags, epoch, spin, step, stream, spill, staged, bases, _min)


pieces_allreduce = (pieces_allreduce_sum, pieces_allreduce_prod, pieces_allreduce_max, pieces_allreduce_min)


@njit(inline="always")
def _rs_pieces(x, stages, me, out, flags, epoch, spin, c, los, his, staged, bases, combine):
    p = stages.shape[0]
    addr = np.zeros(p, np.int64)
    ops = np.empty(4, np.int64)  # a fold run's operand addresses (_fold_block)
    lo, hi = los[me], his[me]
    e = epoch
    for k in range(0, (his - los).max(), c):
        # Sub-chunk k of every peer's shard into my slot for that peer, then barrier: every slot is full.
        if staged:
            for s in range(p):
                a = los[s] + k
                b = min(his[s], a + c)
                if s != me and b > a:
                    _copy(_row(stages, me, s * c, b - a, x), x[a:b])
        barrier(flags, me, p, e, spin)
        if k == 0 and bases.shape[0] > 0:
            _peer_inputs(flags, bases, addr)
        # Sub-chunk k of my shard: the peers' slots for me (or their inputs) and my own x, in rank order,
        # straight into out.
        a = lo + k
        b = min(hi, a + c)
        if b > a:
            _fold_block(out[k : k + b - a], x[a:b], stages, addr, me, me * c, me * c + b - a, a, ops, combine)
        barrier(flags, me, p, e + 1, spin)  # every peer is done with my slots before I refill them
        e += 2


@njit(cache=True, nogil=True)
def pieces_reduce_scatter_sum(x, stages, me, out, flags, epoch, spin, c, los, his, staged, bases):
    """``out = (((x0 + x1) + x2) ...)[los[me]:his[me]]``, sub-chunk by sub-chunk through the large window
    (``pieces_reduce_scatter[op]``: ``_prod``, ``_max``, ``_min`` the same with their op).

    Purpose: ``ShmAllreduce.reduce_scatter``'s loop (its docstring) as one
    call: per step k, stage sub-chunk k of every peer's shard in my slot
    for it, barrier, fold sub-chunk k of my shard, barrier.
    Preconditions: ``stages[s]`` (int64) is the address of rank s's stage in
    the window, at least p * c elements of ``x``'s dtype, slot q at
    [q * c, (q + 1) * c); ``los``/``his`` (int64, p each) the shards, in
    ``x``; ``out`` holds
    my shard and does not overlap ``x``; barriers ``epoch``, ``epoch + 1``,
    ... (two per step, ceil(longest shard / c) steps), the same on every
    rank, as are ``c``, the shards and op; a peer may run the same steps
    from Python.  ``staged`` and ``bases``: as for ``pieces_allreduce_sum``.
    Use: ``ShmAllreduce._compiled_shards``.  Plain IEEE sum and product, as
    in ``pieces_allreduce_sum`` (each sub-chunk is folded by one rank).
    """
    _rs_pieces(x, stages, me, out, flags, epoch, spin, c, los, his, staged, bases, _add)


@njit(cache=True, nogil=True)
def pieces_reduce_scatter_prod(x, stages, me, out, flags, epoch, spin, c, los, his, staged, bases):
    _rs_pieces(x, stages, me, out, flags, epoch, spin, c, los, his, staged, bases, _mul)


@njit(cache=True, nogil=True)
def pieces_reduce_scatter_max(x, stages, me, out, flags, epoch, spin, c, los, his, staged, bases):
    _rs_pieces(x, stages, me, out, flags, epoch, spin, c, los, his, staged, bases, _max)


@njit(cache=True, nogil=True)
def pieces_reduce_scatter_min(x, stages, me, out, flags, epoch, spin, c, los, his, staged, bases):
    _rs_pieces(x, stages, me, out, flags, epoch, spin, c, los, his, staged, bases, _min)


pieces_reduce_scatter = (pieces_reduce_scatter_sum, pieces_reduce_scatter_prod, pieces_reduce_scatter_max,
                         pieces_reduce_scatter_min)


@njit(cache=True, nogil=True)
def pieces_allgather(shard, stages, me, out, flags, epoch, spin, c, los, his, stream, staged, bases):
    """``out[los[s]:his[s]] = shard of rank s`` for every s, chunk by chunk through the large window.

    Purpose: ``ShmAllreduce.allgather``'s loop as one call: per step k,
    publish chunk k of my shard in my stage (and copy it to my part of out
    from there, in cache), barrier, copy chunk k of every peer's shard,
    barrier.
    Preconditions: ``stages[s]`` (int64) is the address of rank s's stage in
    the window, at least ``c`` elements of the shard's dtype;
    ``los``/``his`` (int64, p each) place the shards in ``out``, mine holding ``len(shard)`` elements;
    ``out`` does not overlap ``shard``; barriers ``epoch``, ``epoch + 1``,
    ... (two per step, ceil(longest shard / c) steps), the same on every
    rank, as are ``c`` and the shards; a peer may run the same steps from
    Python.  ``staged`` and ``bases``: as for ``pieces_allreduce`` (a shard
    in a shared region is copied from where it lies); ``stream`` as well.
    Use: ``ShmAllreduce._compiled_shards``.
    """
    p = stages.shape[0]
    addr = np.zeros(p, np.int64)
    lo, hi = los[me], his[me]
    e = epoch
    for k in range(0, (his - los).max(), c):
        m = max(0, min(hi - lo - k, c))
        if staged:
            mine = _row(stages, me, 0, m, shard)
            _copy(mine, shard[k : k + m])
            _stream(out[lo + k : lo + k + m], mine, stream)
        else:
            _stream(out[lo + k : lo + k + m], shard[k : k + m], stream)
        barrier(flags, me, p, e, spin)
        if k == 0 and bases.shape[0] > 0:
            _peer_inputs(flags, bases, addr)
        for s in range(p):
            a = los[s] + k
            b = min(his[s], a + c)
            if s != me and b > a:
                _stream(out[a:b], _operand(stages, addr, s, 0, b - a, k, out), stream)
        barrier(flags, me, p, e + 1, spin)
        e += 2


# The single-copy allreduce's loop (``ddlkernels._cma``): here, not in a module of its own, because Numba's
# disk cache notices a change only in the file that defines a cached function, and this loop inlines the
# barrier and the combines above: in a module of its own it went on running the old ones after they changed.

#: Words of a rank's flag line (``ddlkernels._shm``: word 0 is its barrier count, 1-2 where its input lies in
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
    # (``ddlkernels._cma._vm`` is the same from Python).
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
    # r; with 4 ranks this makes one.  ``mpirun -n 4`` on the 2-core Xeon VM, 16 MiB float32 sums, this loop
    # against the one-at-a-time fold in a throwaway script (not kept), six alternated rounds of 30 calls in
    # each of four runs: medians 6.83-7.10 ms against 7.12-7.42 with pieces of 256 KiB, and 2-4 % apart with
    # 64 and 128 KiB pieces.  Returns the number of reads that failed.
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
    # ranks, out of place, the peer's operand is read straight into out and mine folded into it there: 6-13 %
    # faster at 1-4 MiB than reading into tmp and folding from it into out (``_cma.PIECE_BYTES``' comment); in
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
    every rank; ``flags`` the window's flag lines (``ddlkernels._shm``) and
    the barriers ``epoch`` .. ``epoch + 2`` every rank's next; ``pids``
    every rank's process id, each readable by ``process_vm_readv`` from here
    (``ddlkernels._cma.probe``, which tries both directions); ``tmp``: four
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
