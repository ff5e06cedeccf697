"""``reduce_scatter``: arguments, then the fast path, else choose and run.

Worked example, 3 ranks, ``comm.reduce_scatter(x)`` with ``x`` of 10 elements::

    shards      shard_range(10) on ranks 0, 1, 2: [0, 4), [4, 7), [7, 10)
                (the planner's box for large buffers, cut by ring.schedule.shard_bounds)
    fast path   a settled numpy call: its FastPlan writes this rank's 3 or 4 summed
                elements into a new array (or ``out``)
    full path   the checks of ``allreduce`` plus ``out``'s length, then the
                chosen algorithm's ``reduce_scatter`` on a ``Work`` whose
                ``bounds`` are every rank's shard

Each function takes the ``Communicator`` first: they are its methods.
"""

from __future__ import annotations

from time import perf_counter

import numpy as np

from .._dtypes import check_dtype, normalize_op
from ..algorithms.base import Work
from ..backends import get_backend
from .arguments import check_shard_out, flat_input, in_use, plain_out, prepare

__all__ = ["reduce_scatter"]


def reduce_scatter(self, x, op="sum", *, out=None, dims=None, chunk_bytes=None, backend=None, validate=None,
                   timeout=None, stream=None):
    """Reduce ``x`` over all ranks and return this rank's shard (a new 1-D array of ``x``'s type, or ``out``).

    The shard is ``x.reshape(-1)[start:stop]`` of the reduced buffer with
    ``(start, stop) = shard_range(x.size, dims)``.  ``x`` is not modified.
    ``out``: a contiguous 1-D array of ``stop - start`` elements of
    ``x``'s dtype, backend and device, not overlapping ``x``, to write
    the shard into (a loop of calls then allocates nothing).
    ``validate``, ``timeout`` and ``stream`` as for ``allreduce``.
    """
    if not self._busy.acquire(False):
        raise in_use("reduce_scatter")
    try:
        if type(x) is np.ndarray and self._plain_call(dims, chunk_bytes, backend, validate, timeout):
            done = fast(self, x, op, out)
            if done is not None:
                return done
        call = self._call("reduce_scatter", validate, timeout)
        if call is None:
            return full(self, x, op, out, dims, chunk_bytes, backend, None, stream)
        with call:
            return full(self, x, op, out, dims, chunk_bytes, backend, call, stream)
    finally:
        self._busy.release()


def fast(self, x, op, out):
    """A settled host numpy call: its ``FastPlan`` straight away, or None (as ``allreduce``'s fast path)."""
    if op.__class__ is not str or not x.flags.c_contiguous:
        return None
    key = (op, x.dtype, x.size)  # a native dtype never equals a byte-swapped one: checked once, in _plan
    plan = self.selector.plans["reduce_scatter"].get(key)
    if not plan:
        if plan is False:
            return None
        plan = _plan(self, x, op, key)
        if not plan:
            return None
    if out is None:
        shard = np.empty(plan.shape, x.dtype)
    elif plain_out(out, x, plan.shape):
        shard = out
    else:
        return None  # the full path says what is wrong with out
    watch = plan.watch
    if watch is not None:
        t0 = perf_counter()
    plan.run(x if x.ndim == 1 else x.reshape(-1), shard)
    self.last_algorithm = plan.algorithm
    recount = plan.recount
    if recount is not None:
        recount.left -= 1
        if recount.left <= 0:
            plan.expire()
    elif watch is not None:
        plan.observe(perf_counter() - t0)
    return shard


def _plan(self, x, op, key):
    if not x.dtype.isnative:
        return None
    try:
        opname, dtype = normalize_op(op), check_dtype(x.dtype)
    except (TypeError, ValueError):
        return None  # the full path raises the error
    bounds = self._all_shards(x.size, None)
    lo, hi = bounds[self.rank]
    w = Work("reduce_scatter", None, None, x.size, dtype, opname, get_backend("numpy"), None, bounds=bounds)
    return self.selector.fast_plan("reduce_scatter", key, w, (hi - lo,))


def full(self, x, op, out, dims, chunk_bytes, backend, call, stream=None):
    opname, be, dtype, chunk = prepare(self, x, op, chunk_bytes, dims, backend)
    with self._device_call(be, x, stream):
        src, _ = flat_input(be, x)
        count = src.shape[0]
        bounds = self._all_shards(count, dims)
        lo, hi = bounds[self.rank]
        dst = None if out is None else check_shard_out(be, out, x, src, dtype, hi - lo, "reduce_scatter")
        w = Work("reduce_scatter", src, dst, count, dtype, opname, be, chunk, dims, bounds, call)
        shard = self.selector.run("reduce_scatter", w, lambda algorithm: _run(self, algorithm, w))
        # A new shard of x's type: a torch tensor stays one, bfloat16 is not left as its uint16 storage.
        return out if out is not None else be.like(shard, x, (hi - lo,))


def _run(self, algorithm, w):
    # Everything allocated first: a rank that fails here fails locally (validate announces it).
    if w.dst is None:
        lo, hi = w.bounds[self.rank]
        w.dst = w.be.empty(hi - lo, w.dtype)
    w.prepared = algorithm.prepare(w)
    if w.call is not None:
        w.call.agree(count=w.count, dtype=w.dtype, op=w.op, dims=w.dims, chunk=w.chunk, path=algorithm.name)
    self.last_algorithm = algorithm.name
    algorithm.reduce_scatter(w)
    return w.dst
