"""``allreduce``: arguments, then the fast path, else choose and run.

Worked example, ``comm.allreduce(x, "sum", out=y)`` with ``x`` 4 KiB of float32::

    fast path   a numpy array, no per-call option: the plan of ("sum", float32, 4096)
                settled earlier -- say MPI's call -- runs at once (``FastPlan.run``),
                after a check that y is a writeable contiguous float32 array apart from x
    full path   otherwise: ``prepare`` (op, backend, dtype, dims, chunk), the inputs
                flattened, ``out`` checked, then the Communicator's ``Selector``
                runs the algorithm it chooses on a ``Work`` of the call:
                ``algorithm.prepare`` (buffers), the cross-rank argument check
                (``validate=True``), ``algorithm.allreduce``

Each function takes the ``Communicator`` first: they are its methods.
"""

from __future__ import annotations

from time import perf_counter

import numpy as np

from .._dtypes import check_dtype, dtype_name, normalize_op
from ..algorithms.base import Work
from ..algorithms.mpi import mpi_op
from ..backends import backend_for, get_backend
from .arguments import (apart, backend_input_numpy, buffer_spec, check_out, flat_input, host_overlap, in_use,
                        prepare, size)

__all__ = ["allreduce", "Allreduce", "allreduce_segments", "allreduce_buffer", "tuning_buffer"]


def allreduce(self, x, op="sum", *, out=None, dims=None, chunk_bytes=None, backend=None, validate=None,
              timeout=None, stream=None):
    """Reduce ``x`` over all ranks; every rank gets the same bits.

    ``op``: "sum", "avg", "max", "min", "prod" or ``MPI.SUM``/``MAX``/``MIN``/``PROD``.
    ``out``: where to put the result (same shape and dtype as ``x``,
    writeable, sharing no memory with ``x``); ``out=x`` (the same
    object) reduces in place.  ``dims``: the box, e.g. ``(4, 16)``, whose
    product is the communicator size; ``None`` lets the library choose.
    ``chunk_bytes``: pipeline chunk for this call.  ``backend``: force an
    array backend by name ("numpy", "cupy", "numba").  ``validate``: check
    that every rank passed the same arguments first (default: the
    Communicator's).  ``timeout``: seconds before ``CollectiveTimeout``
    (default: the Communicator's).  ``stream`` (device arrays): the
    stream the call is ordered on -- a CuPy, torch or Numba stream or a
    raw ``cudaStream_t``; default the caller's current stream for the
    array's library (torch's current stream, CuPy's current stream,
    Numba's default stream).  The call reads ``x`` after the work queued
    there before it, and work queued there after it sees the result.
    Returns ``out``, or a new array of ``x``'s type, shape and device.
    """
    if not self._busy.acquire(False):  # Communicator._exclusive, inlined: this path exists for microseconds
        raise in_use("allreduce")
    try:
        if type(x) is np.ndarray and self._plain_call(dims, chunk_bytes, backend, validate, timeout):
            done = fast(self, x, op, out)
            if done is not None:
                return done
        call = self._call("allreduce", validate, timeout)
        if call is None:
            return full(self, x, op, out, dims, chunk_bytes, backend, None, stream)
        with call:
            return full(self, x, op, out, dims, chunk_bytes, backend, call, stream)
    finally:
        self._busy.release()


def fast(self, x, op, out):
    """A host numpy call of a settled shape: its ``FastPlan`` straight away, or ``None`` for the full path.

    Latency-bound calls are where microseconds of Python show (MPI's own
    allreduce of 4 KiB takes ~3 us at 2 ranks here).  The plan is the full
    path's own decision, made once per (op, dtype, size); the checks here
    decide the common cases cheaply, and anything unusual (or a size still
    being measured) falls through to the full path, which raises the errors.
    """
    plans = self.selector.plans["allreduce"]
    plan = plans.get((op, x.dtype, x.nbytes)) if op.__class__ is str else None
    if not plan:
        if plan is False:  # settled on an algorithm without a prepared call: the full path
            return None
        plan = _plan(self, x, op)
        if not plan:
            return None
    xflags = x.flags
    if not xflags.c_contiguous:
        return None
    if out is None:
        dst = np.empty_like(x)
    elif out is x:
        if not xflags.writeable:
            return None  # the full path raises
        dst = x
    elif (out.__class__ is np.ndarray and out.dtype == x.dtype and out.shape == x.shape
          and (oflags := out.flags).c_contiguous and oflags.writeable and apart(out, oflags, x, xflags)):
        dst = out
    else:
        return None  # the full path says what is wrong with out
    watch = plan.watch
    if watch is not None:  # a watched size (ddlkernels.select.tuner.WATCH_FROM): the tuner times every call
        t0 = perf_counter()
    plan.run(x if x.ndim == 1 else x.reshape(-1), dst if dst.ndim == 1 else dst.reshape(-1))
    self.last_algorithm = plan.algorithm
    recount = plan.recount
    if recount is not None:  # SizeTuner.tick inlined: counted here or on the full path, once per call
        recount.left -= 1
        if recount.left <= 0:
            plan.expire()
    elif watch is not None:
        plan.observe(perf_counter() - t0)
    return dst


def _plan(self, x, op):
    """The fast path's plan for calls like this one (``Selector.fast_plan``), or None."""
    dt = x.dtype
    if op.__class__ is not str or not dt.isnative:
        return None
    try:
        opname, dtype = normalize_op(op), check_dtype(dt)
    except (TypeError, ValueError):
        return None  # the full path raises the error
    w = Work("allreduce", None, None, x.size, dtype, opname, get_backend("numpy"), None)
    return self.selector.fast_plan("allreduce", (op, dt, x.nbytes), w)


def full(self, x, op, out, dims, chunk_bytes, backend, call, stream=None):
    """The full path: every argument checked, then the chosen algorithm (on the caller's stream)."""
    opname, be, dtype, chunk = prepare(self, x, op, chunk_bytes, dims, backend)
    with self._device_call(be, x, stream):
        src, src_copied = flat_input(be, x)
        count = src.shape[0]
        inplace = out is x
        if out is not None and not inplace:
            check_out(be, out, x, dtype)
        if out is not None and not be.device and not backend_input_numpy(out).flags.writeable:
            raise ValueError("allreduce: " + ("x is read-only, and out=x reduces in place" if inplace
                                              else "out is read-only"))
        if inplace:
            dst, dst_copied = (src, src_copied)
        elif out is not None:
            dst, dst_copied = flat_input(be, out)
            # Any byte of x under out: writing out would change the input, and a peer reading my x (cma, the
            # window's shared inputs) or MPI itself could read the result instead.
            if be.overlaps(src, dst) if not (src_copied or dst_copied) else host_overlap(x, out):
                raise ValueError("allreduce: out overlaps the input; pass out=x itself to reduce in place")
            if dst_copied:
                dst = np.empty_like(dst)
        else:
            dst, dst_copied = be.empty(count, dtype), False
        run(self, Work("allreduce", src if not inplace else dst, dst, count, dtype, opname, be, chunk, dims,
                       call=call))
        if dst_copied:
            target = out if out is not None else x
            np.copyto(backend_input_numpy(target), dst.reshape(np.shape(target)))
            return target
        return out if out is not None else be.like(dst, x)


def run(self, w):
    """Choose (or measure) and run the algorithm of ``w``, a ``Work`` with its buffers."""
    self.selector.run("allreduce", w, lambda algorithm: _run(self, algorithm, w))


def _run(self, algorithm, w):
    # Allocated before the argument check: a rank that fails there fails locally (validate announces it).
    w.prepared = algorithm.prepare(w)
    if w.call is not None:
        w.call.agree(count=w.count, dtype=w.dtype, op=w.op, dims=w.dims,
                     chunk=w.chunk if algorithm.chunked else None, path=algorithm.name)
    self.last_algorithm = algorithm.name
    algorithm.allreduce(w)


def allreduce_segments(self, segments, out, op="sum", *, dims=None, chunk_bytes=None):
    """Reduce the virtual buffer ``segments`` (``ddlkernels.ring.segments.Segments``) into the host array ``out``.

    For ``allreduce_many``: a fusion bucket without packing it first, the
    algorithm reading each array where it lies (or packing it, where it reads
    one buffer).  ``out`` is 1-D, C-contiguous, of ``segments.count``
    elements and the same dtype, and shares no memory with the arrays.
    ``dims`` and ``chunk_bytes`` as for ``allreduce``; validation and timeout
    as the Communicator's.
    """
    opname, be, dtype, chunk = prepare(self, out, op, chunk_bytes, dims, "numpy")
    if dtype != segments.dtype or out.shape != segments.shape or not out.flags.c_contiguous:
        raise ValueError(
            f"allreduce_many: out must be a contiguous {dtype_name(segments.dtype)}[{segments.count}], "
            f"got {dtype_name(dtype)}{list(out.shape)}"
        )
    with self._exclusive("allreduce_many"):
        call = self._call("allreduce", None, None)
        w = Work("allreduce", segments, out, segments.count, dtype, opname, be, chunk, dims, call=call)
        if call is None:
            run(self, w)
        else:
            with call:
                run(self, w)
    return out


def allreduce_buffer(self, be, buf, dtype, op, deadline=None, chunk_bytes=None):
    """Reduce ``buf`` in place: a flat buffer of the backend ``be`` holding ``dtype`` (a device backend's
    bfloat16 as its uint16 bits, which ``allreduce`` would refuse), on the caller's compute stream.

    For an algorithm that runs part of its call on another Communicator (``hier``'s step across nodes),
    with what is left of its ``deadline`` as the timeout, and for the packed buffers of allreduce_many, the
    progress engine and the torch optimizer; validation as this Communicator's.
    """
    opname = normalize_op(op)
    with self._exclusive("allreduce"):
        call = self._call("allreduce", None, None if deadline is None else deadline.remaining())
        w = _buffer_work(self, be, buf, dtype, opname, chunk_bytes, call)
        with self._device_call(be, buf, None):  # the calling algorithm's stream (``call_stream``)
            if call is None:
                run(self, w)
            else:
                with call:
                    run(self, w)


def _buffer_work(self, be, buf, dtype, opname, chunk_bytes, call=None):
    chunk_bytes = self.chunk_bytes if chunk_bytes is None else chunk_bytes
    return Work("allreduce", buf, buf, buf.shape[0], dtype, opname, be, max(1, chunk_bytes // dtype.itemsize),
                call=call)


def tuning_buffer(self, be, buf, dtype, op, chunk_bytes=None) -> bool:
    """``tuning`` for ``allreduce_buffer``: whether its call with these arguments would be one of the tuner's
    trials (the same on every rank), for an algorithm that settles its inner Communicator first
    (``ddlkernels.algorithms.base.finish_trials``)."""
    return self.selector.measuring("allreduce", _buffer_work(self, be, buf, dtype, normalize_op(op), chunk_bytes))


def Allreduce(self, sendbuf, recvbuf, op=None, *, validate=None, timeout=None):
    """mpi4py's ``comm.Allreduce(sendbuf, recvbuf, op)``, ``MPI.IN_PLACE`` included.

    As in mpi4py, the buffers need equal element counts, not equal
    shapes; ``recvbuf`` is overwritten and nothing is returned.  Either
    buffer may be an mpi4py buffer specification: ``[buf, MPI.FLOAT]``,
    ``[buf, count, MPI.FLOAT]``, ``[buf, (count, displ), MPI.FLOAT]``,
    ``[buf, count]``; the datatype must be the one of ``buf``'s elements
    (MPI has none for float16 and bfloat16: pass such arrays alone).
    ``op``: an ``MPI.Op``, a name, or a ``torch.distributed.ReduceOp``.
    ``validate`` and ``timeout`` as for ``allreduce``.
    """
    if not self._busy.acquire(False):
        raise in_use("Allreduce")
    try:
        if validate is None and timeout is None and self._fast_ok and type(recvbuf) is np.ndarray:
            # The fast path of ``allreduce``, for numpy buffers of one shape; MPI's names through ``mpi_op``'s
            # table, not an import statement (~0.4 us a call).
            name = "sum" if op is None or op is mpi_op("sum") else normalize_op(op)
            if sendbuf is mpi_op("IN_PLACE"):
                if fast(self, recvbuf, name, recvbuf) is not None:
                    return None
            elif type(sendbuf) is np.ndarray and sendbuf.shape == recvbuf.shape:
                if fast(self, sendbuf, name, recvbuf) is not None:
                    return None
        call = self._call("allreduce", validate, timeout)
        if call is None:
            return _Allreduce(self, sendbuf, recvbuf, op, None)
        with call:
            return _Allreduce(self, sendbuf, recvbuf, op, call)
    finally:
        self._busy.release()


def _Allreduce(self, sendbuf, recvbuf, op, call):
    from mpi4py import MPI

    op = MPI.SUM if op is None else op
    recvbuf = buffer_spec(recvbuf, "recvbuf")
    if sendbuf is MPI.IN_PLACE:
        full(self, recvbuf, op, recvbuf, None, None, None, call)
        return
    sendbuf = buffer_spec(sendbuf, "sendbuf")
    if tuple(sendbuf.shape) != tuple(recvbuf.shape):
        if size(sendbuf) != size(recvbuf):
            raise ValueError(f"recvbuf holds {size(recvbuf)} elements but sendbuf holds {size(sendbuf)}")
        be = backend_for(recvbuf)
        try:
            flat_out = be.flat(recvbuf)
        except ValueError:
            raise ValueError("recvbuf must be C-contiguous when its shape differs from sendbuf's") from None
        full(self, sendbuf.reshape(-1), op, flat_out, None, None, None, call)
        return
    full(self, sendbuf, op, recvbuf, None, None, None, call)
