"""The window's reduce_scatter and allgather, and what every call on the window shares with its allreduce.

Worked example, reduce_scatter on 3 ranks, shards S0, S1, S2 cut into
sub-chunks of ``c`` elements, piece k seen by rank 1::

    stage    my x[S0 chunk k] -> my slot 0, x[S2 chunk k] -> my slot 2
    barrier
    reduce   out[chunk k] = slot1 of rank 0 + x[S1 chunk k] + slot1 of rank 2
    barrier  (peers are done reading my slots before I refill them)

and allgather: each rank publishes a sub-chunk of its shard in its own
segment, a barrier, every rank copies the others', a barrier before the next
sub-chunk overwrites them.  A message under ``whole_below`` bytes is staged
whole, one barrier.  For numpy's own types and ops without a deadline each is
one compiled call (``ddlkernels.kernels.window_loops``), prepared once per
call shape (``shard_fn``).  ``ShmAllreduce`` (``ddlkernels.algorithms.shm``)
adds the allreduce to this class; the memory and barriers are
``ddlkernels.algorithms.window.ShmWindow``'s.
"""

from __future__ import annotations

import numpy as np

from .._dtypes import is_half
from ..kernels.layout import OPCODES
from .window import ShmWindow

__all__ = ["WindowShards", "cuts"]


_UFUNC = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def _ufunc(dtype, op):
    """numpy's own ufunc for ``op`` where it is the fastest kernel for ``dtype``, else None (use ``reduce``).

    float16 has a numpy loop but a slow one (``ddlkernels.kernels.half``), bfloat16
    none: both go through the backend's ``reduce``.
    """
    return _UFUNC.get(op) if dtype.kind in "fiu" and not is_half(dtype) else None


def cuts(n: int, p: int) -> list[int]:
    """Where the p ranks' blocks of ``n`` elements start, and ``n``: block s is ``[cuts[s], cuts[s + 1])``, the
    first ``n % p`` blocks one element longer (``ddlkernels.kernels.node_primitives._block`` is the same, compiled)."""
    q, m = divmod(n, p)
    return [s * q + min(s, m) for s in range(p + 1)]


def _fold(out, operands, op, ufunc, reduce, avg_p):
    """``out = ((operands[0] op operands[1]) op operands[2]) ...``; "avg" scales in the last step."""
    if ufunc is np.add or ufunc is np.multiply:  # out positionally: cheaper (backends/_numpy.py's _DIRECT)
        ufunc(operands[0], operands[1], out)
        for v in operands[2:]:
            ufunc(out, v, out)
        return
    if ufunc is not None:  # max/min: numpy 2 deprecates their positional out
        ufunc(operands[0], operands[1], out=out)
        for v in operands[2:]:
            ufunc(out, v, out=out)
        return
    last = len(operands) - 1
    reduce(op, out, operands[0], operands[1], avg_p=avg_p if last == 1 else None)
    for i in range(2, len(operands)):
        reduce(op, out, out, operands[i], avg_p=avg_p if i == last else None)


class WindowShards(ShmWindow):
    """reduce_scatter and allgather on the window, and the prepared compiled calls every call on it shares
    (subclass: ``ShmAllreduce``, which sets ``gather_stream_from``)."""

    @staticmethod
    def _window_loops():
        from ..kernels import window_loops  # imports Numba: only jobs that use the window pay for it

        return window_loops

    def _loop_fn(self, call, barriers, head, tail):
        """``f(x, out)``: ``call(x, *head, out, flags, epoch, *tail, staged, bases)``, a compiled loop of
        ``barriers`` barriers from the next epoch on, after publishing where ``x`` lies when shared regions
        exist (``_publish``; ``staged``: it lies in none)."""
        flags, me = self._flags, self

        def fn(x, out):
            region = me._publish(x)[0] if me._regions else 0
            e = me._epoch + 1
            me._epoch += barriers
            call(x, *head, out, flags, e, *tail, region == 0, me._bases)

        return fn

    def _prepared(self, call, dtype, *tail):
        """``f(a, out)``: ``call(a, stage set, rank, out, flags, epoch, *tail)`` on the next of the two
        small-message stage sets and the next barrier epoch -- the bookkeeping every compiled small call shares
        with ``_whole`` -- with every view looked up once."""
        sets = [self._stage_set(dtype, k) for k in range(2)]
        flags, rank, me = self._flags, self.rank, self

        def fn(a, out):
            k = me._whole_set
            me._whole_set = k ^ 1
            e = me._epoch + 1
            me._epoch = e
            call(a, sets[k], rank, out, flags, e, *tail)

        return fn

    def _remember(self, key, fn):
        """``fn``, kept in the small-call cache under ``key``."""
        if len(self._small) >= 64:  # a job with ever new sizes must not grow this without bound
            self._small.clear()
        self._small[key] = fn
        return fn

    def shard_fn(self, kind, dtype, n, op, bounds, stream=None):
        """``f(x, out)``: ``reduce_scatter`` or ``allgather`` as one compiled call, or None.

        ``kind``: "reduce_scatter" (``x``: the n elements, ``out``: my shard)
        or "allgather" (``x``: my shard, ``out``: the n elements); ``op``: the
        reduce_scatter's op (not "avg"); ``bounds``: every rank's (lo, hi);
        ``stream``: as for ``allgather`` (ignored by reduce_scatter).
        Below ``whole_below`` bytes the small-message call, from there the
        compiled sub-chunk loop (``_compiled_shards``).  None unless the window
        is allocated, n > 0 and Numba can compute it (numpy's own types and
        ops for reduce_scatter; no float16 or bfloat16).  Cached, so that a
        caller that has settled on this path (``Communicator``'s fast paths)
        pays for no lookups; ``_whole``'s stage alternation and the barrier
        epochs are shared with every other call.
        """
        dtype = np.dtype(dtype)
        if not self.allocated or n <= 0 or is_half(dtype):
            return None
        rs = kind == "reduce_scatter"
        if rs and _ufunc(dtype, op) is None:
            return None
        stream = False if rs else self._gather_streams(n * dtype.itemsize, stream)
        # reduce_scatter needs only my shard's bounds; allgather everyone's.
        key = (kind, dtype, n, op, tuple(bounds[self.rank]) if rs else tuple(tuple(b) for b in bounds), stream)
        fn = self._small.get(key)
        if fn is not None:
            return fn
        if n * dtype.itemsize >= self.whole_below:
            return self._remember(key, self._compiled_shards(kind, dtype, op, bounds, stream))
        if rs:
            lo, hi = bounds[self.rank]
            fn = self._prepared(self._window_loops().small_fold[OPCODES[op]], dtype, self.spin, lo, hi)
        else:
            los = np.array([b[0] for b in bounds], dtype=np.int64)
            his = np.array([b[1] for b in bounds], dtype=np.int64)
            fn = self._prepared(self._window_loops().small_allgather, dtype, self.spin, los, his)
        return self._remember(key, fn)

    def _gather_streams(self, nbytes, stream):
        """Whether an allgather of ``nbytes`` writes its output with non-temporal stores: ``stream`` where the
        caller says, else from ``gather_stream_from`` bytes."""
        return nbytes >= self.gather_stream_from if stream is None else bool(stream)

    def _compiled_shards(self, kind, dtype, op, bounds, stream=False):
        """``f(x, out)``: the sub-chunk loop of ``reduce_scatter`` or ``allgather`` as one compiled call
        (``ddlkernels.kernels.window_loops.pieces_reduce_scatter`` / ``pieces_allgather``), every address looked up once.
        ``stream``: the allgather writes its output with non-temporal stores.

        Shared inputs (``empty``) are published and read where they lie, as in ``_compiled``.
        """
        item, p, rs = dtype.itemsize, self.p, kind == "reduce_scatter"
        c = max(1, self.piece_bytes // item // p) if rs else max(1, self.piece_bytes // item)
        los = np.array([b[0] for b in bounds], dtype=np.int64)
        his = np.array([b[1] for b in bounds], dtype=np.int64)
        barriers = 2 * -(-int((his - los).max()) // c)
        head = (self._seg_addrs, self.rank)
        if rs:
            return self._loop_fn(self._window_loops().pieces_reduce_scatter[OPCODES[op]], barriers, head,
                                 (self.spin, c, los, his))
        return self._loop_fn(self._window_loops().pieces_allgather, barriers, head, (self.spin, c, los, his, bool(stream)))

    def _last_shard_fn(self, kind, dtype, n, op, bounds, stream=None):
        """``shard_fn``, remembering the last answer per kind: a loop of calls with equal arguments
        then compares them instead of building the cache key."""
        last = self._last_shard.get(kind)
        if (last is not None and last[1] == n and last[2] is dtype and last[3] == op and last[5] is stream
                and last[0] == bounds):
            return last[4]
        fn = self.shard_fn(kind, dtype, n, op, bounds, stream)
        self._last_shard[kind] = (list(bounds), n, dtype, op, fn, stream)
        return fn

    def _ready(self, src, op, avg_p, deadline=None):
        """Allocate the window on first use; ``(dtype, ufunc)``, the ufunc None where ``reduce`` must do it."""
        if self._win is None:
            self._allocate(deadline)
        dtype = src.dtype
        ufunc = _ufunc(dtype, op) if avg_p is None else None
        return dtype, ufunc

    def reduce_scatter(self, src, out, bounds, op, reduce, avg_p=None, deadline=None) -> None:
        """``out = (op over ranks of src)[bounds[rank]]``: this rank's shard, the rank-order fold.

        ``src``: 1-D host array of n elements, the same n on every rank;
        ``bounds``: ``(lo, hi)`` per rank, a partition of ``[0, n)`` into
        ranges (``Communicator.shard_range``); ``out``: ``hi - lo`` elements,
        not overlapping ``src``.  Worked example, 3 ranks, shards S0, S1, S2
        cut into sub-chunks of ``c`` elements, piece k seen by rank 1::

            stage    my x[S0 chunk k] -> my slot 0, x[S2 chunk k] -> my slot 2
            barrier
            reduce   out[chunk k] = slot1 of rank 0 + x[S1 chunk k] + slot1 of rank 2
            barrier  (peers are done reading my slots before I refill them)

        A message under ``whole_below`` bytes is staged whole, one barrier.
        An input in a shared region (``empty``) is not staged: peers read
        its sub-chunks where it lies, as ``run``'s pieces do.
        """
        dtype, ufunc = self._ready(src, op, avg_p, deadline)
        r, n = self.rank, src.shape[0]
        lo, hi = bounds[r]
        if deadline is None and avg_p is None:
            fn = self._last_shard_fn("reduce_scatter", dtype, n, op, bounds)
            if fn is not None:
                fn(src, out)
                return
        if 0 < n * dtype.itemsize < self.whole_below:
            stage = self._whole_stage(dtype, n)
            stage[r][...] = src
            self._barrier(deadline)
            _fold(out, [v[lo:hi] for v in stage], op, ufunc, reduce, avg_p)
            return
        self._rs_loop(src, out, bounds, op, ufunc, reduce, avg_p, deadline)

    def _rs_loop(self, src, out, bounds, op, ufunc, reduce, avg_p, deadline):
        """``reduce_scatter``'s sub-chunk loop in Python: any dtype and op, a deadline, shared inputs."""
        dtype, p, r, n = src.dtype, self.p, self.rank, src.shape[0]
        lo, hi = bounds[r]
        c = max(1, self.piece_bytes // dtype.itemsize // p)
        stage = [seg[: p * c * dtype.itemsize].view(dtype) for seg in self._segs]
        longest = max(b - a for a, b in bounds)
        region, peers = self._publish(src)  # an input in a shared region is read there, as run() does
        for k in range(0, longest, c):
            if not region:
                for s in range(p):
                    a = bounds[s][0] + k
                    b = min(bounds[s][1], a + c)
                    if s != r and b > a:
                        stage[r][s * c : s * c + b - a] = src[a:b]
            self._barrier(deadline)
            if peers is None:
                peers = self._peer_inputs(dtype, n)
            a, b = lo + k, min(hi, lo + k + c)
            if b > a:
                ops = [src[a:b] if q == r else peers[q][a:b] if peers and peers[q] is not None
                       else stage[q][r * c : r * c + b - a] for q in range(p)]
                _fold(out[k : k + b - a], ops, op, ufunc, reduce, avg_p)
            self._barrier(deadline)

    def allgather(self, shard, out, bounds, deadline=None, stream=None) -> None:
        """``out[bounds[s]] = shard of rank s`` for every s; ``out`` has ``bounds[-1][1]`` elements.

        Each rank publishes its shard piece by piece in its own segment, one
        barrier, every rank copies the others', a barrier before the next
        piece overwrites them; a whole message under ``whole_below`` bytes
        goes through the small-message stages with one barrier.  A shard in
        a shared region (``empty``) is not published: peers copy it from
        where it lies.  ``stream``: the compiled loop writes ``out`` with
        non-temporal stores (True), with ordinary ones (False), or from
        ``gather_stream_from`` bytes (None); ranks may differ.
        """
        if self._win is None:
            self._allocate(deadline)
        p, r, dtype = self.p, self.rank, shard.dtype
        n = out.shape[0]
        lo, hi = bounds[r]
        if deadline is None:
            fn = self._last_shard_fn("allgather", dtype, n, None, bounds, stream)
            if fn is not None:
                fn(shard, out)
                return
        if 0 < n * dtype.itemsize < self.whole_below:
            out[lo:hi] = shard
            stage = self._whole_stage(dtype, n)
            stage[r][: hi - lo] = shard
            self._barrier(deadline)
            for s in range(p):
                if s != r:
                    a, b = bounds[s]
                    out[a:b] = stage[s][: b - a]
            return
        self._ag_loop(shard, out, bounds, deadline)

    def _ag_loop(self, shard, out, bounds, deadline):
        """``allgather``'s chunk loop in Python: any dtype, a deadline, a shard in a shared region."""
        p, r, dtype = self.p, self.rank, shard.dtype
        lo, hi = bounds[r]
        c = max(1, self.piece_bytes // dtype.itemsize)
        slot = [seg[: c * dtype.itemsize].view(dtype) for seg in self._segs]
        longest = max(b - a for a, b in bounds)
        region, peers = self._publish(shard)  # a shard in a shared region is copied from there, not published
        for k in range(0, longest, c):
            m = max(0, min(hi - lo - k, c))
            if region:
                out[lo + k : lo + k + m] = shard[k : k + m]
            else:
                slot[r][:m] = shard[k : k + m]
                # My own part of out from the slot just written (in cache), not from the shard again: the shard
                # is then read from memory once (bench/results/constants.md, the window's allgather).
                out[lo + k : lo + k + m] = slot[r][:m]
            self._barrier(deadline)
            if peers is None:
                peers = self._peer_inputs(dtype, tuple(b - a for a, b in bounds))
            for s in range(p):
                a = bounds[s][0] + k
                b = min(bounds[s][1], a + c)
                if s != r and b > a:
                    out[a:b] = peers[s][k : k + b - a] if peers and peers[s] is not None else slot[s][: b - a]
            self._barrier(deadline)
