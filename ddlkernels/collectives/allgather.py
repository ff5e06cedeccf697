"""``allgather``: arguments (and, without ``count``, the shard lengths), then the fast path, else choose and run.

Worked example, 3 ranks, ``comm.allgather(shard, count=10)``::

    shards      shard_range(10) on ranks 0, 1, 2: [0, 4), [4, 7), [7, 10): this rank's
                shard must have that length (checked here, before any communication)
    fast path   a settled numpy call: its FastPlan gathers into a new array of 10
    full path   the checks, the cross-rank argument check (validate=True), then the
                chosen algorithm's ``allgather`` on a ``Work`` whose ``bounds`` place
                every rank's shard
    no count    the ranks first exchange their shard lengths (one MPI_Iallgather of
                one int each), derive count and check every length against it

Each function takes the ``Communicator`` first: they are its methods.
"""

from __future__ import annotations

import operator
from time import perf_counter

import numpy as np

from .._dtypes import check_dtype
from ..algorithms.base import Work
from ..backends import get_backend
from ..safety.deadline import complete
from .arguments import check_shard_out, flat_input, in_use, plain_out, prepare, size

__all__ = ["allgather"]


def allgather(self, shard, *, count=None, out=None, dims=None, chunk_bytes=None, backend=None, validate=None,
              timeout=None, stream=None):
    """Concatenate every rank's shard into the whole buffer (a new 1-D array of the shard's type, or ``out``).

    Rank r's shard goes to ``shard_range(count, dims, r)``; the lengths
    must be the ones that ``reduce_scatter`` produces.  ``count``: the
    elements of the whole buffer, the same on every rank (``validate``
    checks that); given, each rank checks its own shard's length locally
    and no lengths are exchanged; None: the ranks first allgather their
    shard lengths, derive ``count`` and check every length.  ``out``: a
    contiguous 1-D array of ``count`` elements of the shard's dtype,
    backend and device, not overlapping it, to gather into (a loop of
    calls then allocates nothing); it also gives ``count`` when that is
    None.  ``validate`` (dtype, dims, chunk and ``count``),
    ``timeout`` and ``stream`` as for ``allreduce``.
    """
    if not self._busy.acquire(False):
        raise in_use("allgather")
    try:
        if count is None and out is not None:
            count = out.size if out.__class__ is np.ndarray else size(out)
        if count is not None and type(shard) is np.ndarray and self._plain_call(dims, chunk_bytes, backend,
                                                                                  validate, timeout):
            done = fast(self, shard, count, out)
            if done is not None:
                return done
        call = self._call("allgather", validate, timeout)
        if call is None:
            return full(self, shard, count, out, dims, chunk_bytes, backend, None, stream)
        with call:
            return full(self, shard, count, out, dims, chunk_bytes, backend, call, stream)
    finally:
        self._busy.release()


def fast(self, shard, count, out):
    """A settled host numpy call with ``count`` given: its ``FastPlan`` straight away, or None."""
    if not shard.flags.c_contiguous or count.__class__ is not int:
        return None
    key = (shard.dtype, shard.size, count)  # a native dtype never equals a byte-swapped one: checked in _plan
    plan = self.selector.plans["allgather"].get(key)
    if not plan:
        if plan is False:
            return None
        plan = _plan(self, shard, count, key)
        if not plan:
            return None
    if out is None:
        out = np.empty(count, shard.dtype)
    elif not plain_out(out, shard, plan.shape):
        return None  # the full path says what is wrong with out
    watch = plan.watch
    if watch is not None:
        t0 = perf_counter()
    plan.run(shard if shard.ndim == 1 else shard.reshape(-1), out)
    self.last_algorithm = plan.algorithm
    recount = plan.recount
    if recount is not None:
        recount.left -= 1
        if recount.left <= 0:
            plan.expire()
    elif watch is not None:
        plan.observe(perf_counter() - t0)
    return out


def _plan(self, shard, count, key):
    if not shard.dtype.isnative or count < 0:
        return None
    try:
        dtype = check_dtype(shard.dtype)
    except (TypeError, ValueError):
        return None  # the full path raises the error
    bounds = self._all_shards(count, None)
    if bounds[self.rank][1] - bounds[self.rank][0] != shard.size:
        return None  # the full path raises the error
    w = Work("allgather", None, None, count, dtype, None, get_backend("numpy"), None, bounds=bounds)
    return self.selector.fast_plan("allgather", key, w, (count,))


def full(self, shard, count, out, dims, chunk_bytes, backend, call, stream=None):
    _, be, dtype, chunk = prepare(self, shard, "sum", chunk_bytes, dims, backend)
    with self._device_call(be, shard, stream):
        src, _ = flat_input(be, shard)
        deadline = None if call is None else call.deadline
        if count is None:
            lengths = np.empty(self.size, dtype=np.int64)
            if call is not None:
                call.agree(count=None, dtype=dtype, op=None, dims=dims, chunk=chunk, path="ring")
            # Nonblocking with or without a deadline, so that ranks with and without one meet in it.
            complete(self.comm.Iallgather(np.array([src.shape[0]], dtype=np.int64), lengths), deadline,
                     "the exchange of shard lengths (MPI_Iallgather)")
            count = int(lengths.sum())
            bounds = self._all_shards(count, dims)
            bad = [r for r in range(self.size) if bounds[r][1] - bounds[r][0] != lengths[r]]
            if bad:
                detail = ", ".join(f"rank {r}: {lengths[r]} (expected {bounds[r][1] - bounds[r][0]})"
                                   for r in bad[:8])
                raise ValueError(f"allgather: shard lengths do not match shard_range of {count} elements: {detail}")
        else:
            try:
                count = operator.index(count)
            except TypeError:
                raise TypeError(f"allgather: count must be an integer, not {type(count).__name__}") from None
            if count < 0:
                raise ValueError(f"allgather: count must be >= 0, got {count}")
            bounds = self._all_shards(count, dims)
            lo, hi = bounds[self.rank]
            if src.shape[0] != hi - lo:  # known here, before any communication
                raise ValueError(f"allgather: this rank's shard has {src.shape[0]} elements but shard_range of "
                                 f"{count} elements gives it {hi - lo}")
            if out is not None:
                out_flat = check_shard_out(be, out, shard, src, dtype, count, "allgather")
        # Allocated before the argument check where count is known: a rank that fails here fails locally.
        dst = be.empty(count, dtype) if out is None else out_flat
        if call is not None and not call.agreed:
            # The path is not compared: which algorithm runs follows from what is compared.
            call.agree(count=count, dtype=dtype, op=None, dims=dims, chunk=chunk, path="ring")
        w = Work("allgather", src, dst, count, dtype, None, be, chunk, dims, bounds, call)
        whole = self.selector.run("allgather", w, lambda algorithm: _run(self, algorithm, w))
        return out if out is not None else be.like(whole, shard, (count,))  # of the shard's type


def _run(self, algorithm, w):
    w.prepared = algorithm.prepare(w)
    self.last_algorithm = algorithm.name
    algorithm.allgather(w)
    return w.dst
