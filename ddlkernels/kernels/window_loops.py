"""The shared window's compiled calls (``ddlkernels.algorithms.shm``): small messages whole, large ones in pieces.

A latency-bound allreduce through the window is a copy, a barrier and an
addition of a few KiB; as numpy calls around a barrier each step cost a few
hundred nanoseconds of call overhead, compiled the whole call is one
(bench/results/constants.md, "the window's compiled loops").  The pieces
loops run a large message piece by piece, two barriers a piece, as
``ShmAllreduce`` documents; the flag barrier, the combines and the copies are
``node_primitives``'.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .node_primitives import (STRIDE, _add, _block, _copy, _fold_block, _max, _min, _mul, _operand,
                              _peer_inputs, _prod, _row, _store_release, _stream, _sum, _wait, barrier,
                              refresh_cache)

__all__ = ["small_fold", "small_allgather", "pieces_allreduce", "pieces_reduce_scatter", "pieces_allgather"]


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


# One compiled function per op, for each loop that folds (small_fold, pieces_allreduce, pieces_reduce_scatter,
# cma_allreduce): a tuple indexed by ``ddlkernels.kernels.layout.OPCODES`` (sum, prod, max, min), each member with
# its combine fixed, so that a process compiles only the ops it calls (bench/results/constants.md, one compiled
# function per op).
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
    them from memory: ``ddlkernels.select.tuner.SPILL_FROM``).
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


refresh_cache(globals())
