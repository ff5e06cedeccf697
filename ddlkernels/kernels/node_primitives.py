"""What the compiled collectives of ranks on one node share: a flag barrier, the combines, copies, folds.

The loops built from these are in ``window_loops.py`` (the shared window:
small calls, and the piece loops of large ones) and ``cma_loops.py`` (the
single-copy allreduce, which reads a peer's memory with
``process_vm_readv``).

Why compiled: a latency-bound allreduce through the window is a copy, a
barrier and an addition of a few KiB.  Done as numpy calls around
``MPI_Barrier`` (with ``MPI_Win_sync`` on each side to order the stores),
each of the five steps cost a few hundred nanoseconds of call overhead, and
the whole was no faster than MPI's own allreduce at 4 KiB with 2 ranks
(measured: bench/results/constants.md, "the window's compiled loops").

The barrier.  Every rank owns one 64-byte line of ``flags`` (int64 index
``rank * FLAG_STRIDE``, so no
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
count, ``ddlkernels.algorithms.shm.SPIN``, is measured.

No deadline here: a call with ``timeout=`` arrives with ``arrive`` and polls
``arrived`` from Python (``ShmAllreduce._barrier``), so every rank takes the
same barrier whether or not it has a timeout.

Numba's disk cache keys a compiled function to its own file only, and the
loops of ``window_loops.py`` and ``cma_loops.py`` inline what is defined
here: ``refresh_cache`` (called by both at import) drops their cache when
this file's text has changed since they were compiled.
"""

from __future__ import annotations

import hashlib
import os

from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic, overload
from numba.np.arrayobj import make_array

from .layout import FLAG_STRIDE, OPCODES

__all__ = ["FLAG_STRIDE", "OPCODES", "arrive", "arrived", "barrier", "refresh_cache"]

STRIDE = FLAG_STRIDE


def refresh_cache(namespace) -> None:
    """Drop the disk cache of the compiled functions in ``namespace`` (a loop module's globals) when this
    file has changed since it was written: they inline what is here, and Numba checks only their own file."""
    with open(__file__, "rb") as f:
        stamp = hashlib.sha256(f.read()).hexdigest()[:16]
    for obj in list(namespace.values()):
        cache = getattr(obj, "_cache", None)
        path = getattr(cache, "_cache_path", None)
        if path is None:
            continue
        mark = os.path.join(path, f"{namespace['__name__'].rsplit('.', 1)[-1]}.node_primitives-{stamp}.stamp")
        if os.path.exists(mark):
            return
        for other in list(namespace.values()):  # one flush per cached function of the module
            c = getattr(other, "_cache", None)
            if c is not None and hasattr(c, "flush"):
                c.flush()
        try:
            os.makedirs(path, exist_ok=True)
            open(mark, "w").close()
        except OSError:
            pass  # an unwritable cache is recompiled every time anyway
        return


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


# An accumulator (res = res op b) gets loops of its own: LLVM vectorizes a loop over arrays it cannot prove
# disjoint only behind a run-time overlap check, which res == a fails, so _combine_into(r, r, b) ran scalar; a loop
# that reads and writes res through one array has nothing to check (bench/results/constants.md, accumulator loops).
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
    # operands and the fold take of a core's cache bounds it (``ddlkernels.algorithms.cma.PIECE_BYTES_WIDE``).
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
    # Rank s's block [lo, hi) of n elements: the first n % p blocks one element longer (``ddlkernels.algorithms.shm.cuts``,
    # compiled: the piece loops' and the cma loop's cut).
    q, m = divmod(n, p)
    lo = s * q + min(s, m)
    return lo, lo + q + (1 if s < m else 0)
