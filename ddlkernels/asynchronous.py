"""Asynchronous reductions: start now, ``wait()`` later, so communication overlaps other work.

Worked example, the default ``progress="thread"``, two fusion buffers::

    calling thread                              progress thread (its own Communicator,
                                                a duplicate of the user's communicator)
    h = allreduce_many_async(grads)
      local checks; pack b0, b1 into pool
      buffers (the inputs may change after
      this returns); enqueue the job   ------>  digest check (16-byte allreduce)
    ... backward of the next layers ...         ring allreduce of b0, then of b1
    h.wait()  <------------- event set -------  done (or the exception, re-raised by wait)
      unpack b0, b1 into the outputs

Why a thread: the ring engine is ordinary blocking code (``ddlkernels.ring.engine``)
that must keep posting receives, reducing chunks and forwarding them; only a
thread of its own keeps it moving while the caller computes.  mpi4py
initialises MPI with ``MPI_THREAD_MULTIPLE`` (its default), which makes MPI
calls from two threads legal; the progress thread uses a communicator of its
own, so its messages never match the caller's.  The GIL is released inside
every blocking MPI call and inside numpy's reductions of large chunks, which is
when the other thread runs.

The alternative, ``progress="hooks"``, needs no thread: each fusion buffer is
handed to MPI's nonblocking ``MPI_Iallreduce`` and progressed by ``poll()``
calls (the torch optimizer polls from every gradient hook) and by ``wait()``.
It uses MPI's own algorithm, not the ring, and only the dtypes MPI can add
(float32, float64, int32, int64) on the host.  docs/fusion.md has the
measurements behind the default.

Device arrays keep the caller's stream order (``ddlkernels.backends._device``):
the start call packs on the caller's stream and records an event there; the
progress thread runs the reductions on a stream of its own, on the caller's
device, after that event; ``wait()`` makes the caller's current stream (or
``wait(stream=)``'s) wait for the reductions' last event before it unpacks
there -- no host block on the device's work anywhere.  A pool buffer carries
the event of its last unpack, so the next handle to take it writes it only
after that.

Handles are collective in order: every rank must start the same reductions in
the same order (each engine runs them first in, first out).  A rank that never
starts its part leaves the others' ``wait()`` blocked, as any collective would;
a ``Communicator`` with ``timeout=`` turns that into ``CollectiveTimeout``
raised by ``wait()`` (the progress thread's communicator inherits it).

Threads: a Communicator's engine is created by the first start on it, in the
calling thread, as a collective on that Communicator's own duplicate (never
on the user's communicator: two threads creating engines of two
Communicators at once must not pair one rank's with another's), under the
Communicator's ``timeout``.  Starts on one engine come from one thread at a
time (two at once raise ``RuntimeError``: their order could differ across
ranks).  Blocking calls on the Communicator itself may run meanwhile, on
the same thread or another: the engine's collectives are on its own
duplicate.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import weakref

import numpy as np

from ._dtypes import scale_inplace
from .communicator import Communicator, as_communicator
from ._dtypes import dtype_name, normalize_op
from .fusion import FusionJob, reduce_packed
from .safety.agreement import check_same_on_all_ranks
from .backends import backend_for
from .collectives.streams import runs_now

__all__ = ["Handle", "allreduce_async", "allreduce_many_async", "progress_engine", "PROGRESS_MODES"]

PROGRESS_MODES = ("thread", "hooks")
_MPI_ADDS = {"float32", "float64", "int32", "int64"}


class _Pool:
    """Reusable host/device buffers, by backend and dtype; a buffer is taken by one handle at a time.

    A device buffer comes back with the event of the last work that read it (its unpack, on some
    caller's stream); ``take`` makes the taker's compute stream wait for it before the buffer is
    written again.
    """

    def __init__(self):
        self._free: dict = {}
        self._lock = threading.Lock()

    def take(self, backend, dtype, count):
        key = (backend.name, np.dtype(dtype))
        with self._lock:
            free = self._free.setdefault(key, [])
            for i, (b, ev) in enumerate(free):
                if len(b) >= count:
                    del free[i]
                    if ev is not None:
                        backend.wait(backend.compute_stream(), ev)
                    return b
        return backend.empty(max(int(count), 1), dtype)

    def give(self, backend, dtype, buf):
        ev = backend.record(backend.compute_stream()) if backend.device else None
        with self._lock:
            self._free.setdefault((backend.name, np.dtype(dtype)), []).append((buf, ev))


class _Device:
    """Where a unit of device work runs: its backend and device, the event on the caller's stream that
    its inputs wait for, an array that tells the caller's stream at ``wait()`` (its library), and, once
    done, the event its results are ready at."""

    __slots__ = ("backend", "device", "ready", "like", "done")

    def __init__(self, backend, x, stream=None):
        self.backend, self.like = backend, x
        self.device = backend.device_id(x)
        self.ready = backend.record(backend.call_stream(x, stream))
        self.done = None

    def order_caller(self, stream=None):
        """Make ``stream``, else the calling thread's current stream (for ``like``'s library), wait for the
        results."""
        be = self.backend
        if self.done is not None:
            be.wait(be.call_stream(self.like, stream), self.done)


class _Work:
    """One unit of work for the progress thread: a function of the thread's Communicator."""

    __slots__ = ("fn", "event", "error", "device")

    def __init__(self, fn, device=None):
        self.fn = fn
        self.event = threading.Event()
        self.error = None
        self.device = device  # a _Device for device arrays, else None

    def done(self) -> bool:
        return self.event.is_set()

    def wait(self, stream=None):
        """Block until the work has run; for device work, order ``stream`` (default: the caller's current
        stream) after it."""
        self.event.wait()
        if self.error is not None:
            raise self.error
        if self.device is not None:
            self.device.order_caller(stream)


class ThreadEngine:
    """Runs reductions on a background thread over its own duplicate of the communicator.

    Creating one is collective over the communicator (it duplicates it).
    """

    kind = "thread"

    def __init__(self, comm=None, *, chunk_bytes=None):
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "progress='thread' needs MPI initialised with MPI_THREAD_MULTIPLE (mpi4py's default; set "
                "mpi4py.rc.thread_level = 'multiple' before importing mpi4py.MPI), or use progress='hooks'"
            )
        if isinstance(comm, Communicator):
            # The duplicate takes the caller's settings, so both make the same
            # algorithm choices (a fixed small_bytes pins MPI vs ring).  It duplicates
            # the Communicator's own communicator, whose collectives come from one
            # thread, not the user's.
            from .safety.deadline import Deadline

            setup = None if comm.timeout is None else Deadline("allreduce_async", comm.rank, comm.timeout)
            self.comm = comm.derived(comm.comm, chunk_bytes=chunk_bytes or comm.chunk_bytes, _deadline=setup)
        else:
            self.comm = Communicator(comm, chunk_bytes=chunk_bytes)
        self.size = self.comm.size
        self.pool = _Pool()
        self._streams: dict = {}  # (backend name, device) -> the progress thread's stream there
        self.starting = threading.Lock()  # held while a thread starts a reduction (``_start``)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ddlkernels-progress", daemon=True)
        self._thread.start()
        self.closed = False

    def _run(self):
        while True:
            work = self._queue.get()
            if work is None:
                return
            try:
                d = work.device
                if d is None:
                    work.fn(self.comm)
                else:
                    be = d.backend
                    s = self._stream(be, d.device)
                    with be.using(s, d.device):  # the calls inside run on s, on the caller's device
                        be.wait(s, d.ready)
                        work.fn(self.comm)
                        d.done = be.record(s)
            except BaseException as exc:  # re-raised in the caller's thread by wait()
                work.error = exc
            finally:
                work.event.set()

    def _stream(self, be, device):
        """The progress thread's stream on ``device``: its reductions never wait behind the caller's work."""
        key = (be.name, device)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = be.new_stream(device)
        return s

    def submit(self, fn, device=None) -> _Work:
        """Queue ``fn(communicator)``; ``device``: a ``_Device`` when it touches device arrays."""
        if self.closed:
            raise RuntimeError("this progress engine was closed")
        w = _Work(fn, device)
        self._queue.put(w)
        return w

    def reduce_async(self, buf, opname: str, backend, dtype, stream=None):
        """Start ``allreduce(buf, opname, out=buf)`` of a packed buffer holding ``dtype``; returns an object with
        ``wait()`` and ``done()``.

        A device ``buf`` is read after the work queued before this call on the caller's stream
        (``stream``, default its current one), and ``wait()`` orders the caller's stream after the result.
        """
        device = _Device(backend, buf, stream) if backend.device else None
        return self.submit(lambda c: reduce_packed(c, backend, buf, dtype, opname), device)

    def poll(self) -> None:
        """Nothing to do: the thread progresses on its own."""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._queue.put(None)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.comm.free()


class _MPIRequestWork:
    """A nonblocking ``MPI_Iallreduce`` of one host buffer, scaled for "avg" when it completes."""

    __slots__ = ("req", "buf", "avg_p", "engine", "finished")

    def __init__(self, req, buf, avg_p, engine):
        self.req, self.buf, self.avg_p, self.engine, self.finished = req, buf, avg_p, engine, False

    def done(self) -> bool:
        return self.finished or bool(self.req.Test())

    def wait(self, stream=None):  # host buffers only (check_buffer): no stream to order
        if not self.finished:
            self.req.Wait()
            if self.avg_p:
                scale_inplace(self.buf, self.avg_p)
            self.finished = True
            self.engine._forget(self)


class HooksEngine:
    """Reductions as ``MPI_Iallreduce`` on a duplicate communicator, progressed by ``poll()`` and ``wait()``."""

    kind = "hooks"

    def __init__(self, comm=None, *, chunk_bytes=None):
        from .communicator import duplicate
        from .safety.deadline import Deadline

        # As for ThreadEngine: the Communicator's own communicator, under its timeout.
        base = comm.comm if isinstance(comm, Communicator) else comm
        timeout = comm.timeout if isinstance(comm, Communicator) else None
        self.mpi = duplicate(base, None if timeout is None else Deadline("allreduce_async", base.Get_rank(), timeout))
        self.size = self.mpi.Get_size()
        self.pool = _Pool()
        self.starting = threading.Lock()
        self._inflight: list = []
        self.closed = False

    @staticmethod
    def check_buffer(backend, dtype) -> None:
        """``TypeError`` unless MPI_Iallreduce can reduce host buffers of ``dtype`` (a local check)."""
        if backend.device:
            raise TypeError("progress='hooks' reduces host buffers only; use progress='thread' for device arrays")
        name = dtype_name(dtype)
        if name not in _MPI_ADDS:
            raise TypeError(f"progress='hooks' uses MPI_Iallreduce, which cannot reduce {name}; use progress='thread'")

    def reduce_async(self, buf, opname: str, backend, dtype, stream=None):
        from mpi4py import MPI

        self.check_buffer(backend, dtype)
        avg = opname == "avg"
        mpi_op = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[opname]
        req = self.mpi.Iallreduce(MPI.IN_PLACE, buf, mpi_op)
        w = _MPIRequestWork(req, buf, self.size if avg and self.size > 1 else None, self)
        self._inflight.append(w)
        return w

    def _forget(self, w):
        try:
            self._inflight.remove(w)
        except ValueError:
            pass

    def poll(self) -> None:
        """Let MPI move every outstanding reduction forward (``MPI_Testall``)."""
        if self._inflight:
            from mpi4py import MPI

            MPI.Request.Testall([w.req for w in self._inflight if not w.finished])

    def check_same(self, signature, what):
        check_same_on_all_ranks(self.mpi, signature, what)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.mpi.Free()


_ENGINES: "weakref.WeakKeyDictionary[Communicator, dict]" = weakref.WeakKeyDictionary()
_ENGINES_LOCK = threading.Lock()  # around _ENGINES only, never held while waiting on other ranks


def progress_engine(comm=None, progress: str = "thread"):
    """The progress engine of kind ``progress`` for ``comm``, created on first use (collective then).

    ``comm``: mpi4py ``Intracomm`` or ``Communicator`` (default COMM_WORLD).
    """
    if progress not in PROGRESS_MODES:
        raise ValueError(f"progress must be one of {', '.join(PROGRESS_MODES)}, got {progress!r}")
    c = as_communicator(comm)
    with _ENGINES_LOCK:
        eng = _ENGINES.setdefault(c, {}).get(progress)
    if eng is None or eng.closed:
        # Collective on c's own communicator: c to this thread meanwhile (RuntimeError if another is in it).
        with c._exclusive("allreduce_async"):
            c._usable()
            eng = (ThreadEngine if progress == "thread" else HooksEngine)(c)
            # Closed by c.free(): _ENGINES holds c weakly, so once c is collected nothing else would reach it.
            c._closers.append(eng.close)
        with _ENGINES_LOCK:
            _ENGINES[c][progress] = eng
    return eng


@atexit.register
def _close_engines():  # Python's exit handlers run before mpi4py's MPI_Finalize (a Py_AtExit hook, C-level)
    with _ENGINES_LOCK:
        every = list(_ENGINES.values())
    for engines in every:
        for eng in engines.values():
            eng.close()


class Handle:
    """A reduction in flight.  ``wait()`` blocks until it is done and returns the result(s).

    ``done()`` tells without blocking.  Until ``wait()`` returns, the outputs
    hold no defined value; the inputs may be reused as soon as the start call
    returns, except a tensor larger than ``fusion_bytes``, which is reduced
    straight from its memory and must stay untouched until ``wait()``.
    """

    def __init__(self, engine, job: FusionJob, single: bool):
        self._engine = engine
        self._job = job
        self._single = single
        self._bufs: list = []
        self._works: list = []
        self._result = None
        self._error = None
        self._ready = None  # device: the event after the first wait's unpack, for a later wait on another stream

    def done(self) -> bool:
        if self._result is not None:
            return True
        self._engine.poll()
        return all(w.done() for w in self._works)

    def wait(self, stream=None):
        """Block until every bucket is reduced; unpack; return the output (list for ``allreduce_many_async``).

        Device arrays: the host does not wait for the device.  ``stream`` (a
        CuPy, torch or Numba stream or a ``cudaStream_t``; default the caller's
        current stream, as torch's ``Work.wait()``) is ordered after the
        reductions and the unpack runs on it: the outputs are ready there.  A
        later ``wait`` orders its own stream too.  Host arrays take no ``stream``.
        """
        if self._error is not None:
            raise self._error
        job = self._job
        caller = _on_caller_stream(job, stream)  # stream= with host arrays: ValueError, before any wait
        if self._result is None:
            eng = self._engine
            try:
                for w in self._works:
                    w.wait(stream)
            except BaseException as exc:
                self._error = exc
                raise
            finally:
                # After an error another bucket's transfer may still be using
                # its buffer: those buffers are dropped, not returned to the pool.
                if self._error is None:
                    with caller:  # where w.wait() ordered the results
                        for b, buf, base in self._bufs:
                            if base is not None:  # a pool buffer (not the outputs' own): copy back, return it
                                job.unpack(b, buf)
                                eng.pool.give(job.backend, b.dtype, base)
                        if job.backend is not None and job.backend.device:
                            self._ready = job.backend.record(job.backend.compute_stream())
            self._result = job.outs[0] if self._single else job.outs
        elif self._ready is not None:  # the outputs are ready where the first wait unpacked: order this stream too
            be = job.backend
            be.wait(be.call_stream(job.tensors[0], stream), self._ready)
        return self._result


def allreduce_many_async(tensors, op="sum", *, comm=None, out=None, fusion_bytes=None, progress="thread",
                         stream=None) -> Handle:
    """Start ``allreduce_many(tensors, op, ...)``; ``handle.wait()`` returns the list of outputs.

    Arguments as for ``ddlkernels.allreduce_many``; ``progress`` is "thread"
    (default: a background thread runs the ring) or "hooks" (MPI's
    nonblocking allreduce, moved on by ``Handle.done()``/``wait()`` and by the
    engine's ``poll()``).  Local errors are raised here, before any
    communication; a mismatch between ranks is raised by ``wait()`` on every rank.
    Device tensors: the start reads them after the work queued on ``stream``
    (default: the caller's current stream), and ``wait()`` orders the
    caller's current stream (``wait(stream=)``: that one) after the results,
    without blocking the host on the device.
    """
    job = FusionJob(tensors, op, out=out, fusion_bytes=fusion_bytes, what="allreduce_many_async")
    return _start(job, comm, progress, single=False, stream=stream)


def allreduce_async(x, op="sum", *, comm=None, out=None, progress="thread", stream=None) -> Handle:
    """Start ``allreduce(x, op, out=out)``; ``handle.wait()`` returns the reduced array (``stream``: as for
    ``allreduce_many_async``)."""
    backend_for(x)  # a clear TypeError for a non-array, before anything else
    job = FusionJob([x], op, out=None if out is None else [out], fusion_bytes=None, what="allreduce_async")
    return _start(job, comm, progress, single=True, stream=stream)


def _on_caller_stream(job: FusionJob, stream):
    """For a device job, the caller's stream (``stream``, else its current one) as this thread's compute
    stream (not one capturing a CUDA graph); a no-op for host jobs."""
    be = job.backend
    if be is None or not be.device:
        if stream is not None:
            raise ValueError("stream= orders device work; the arrays of this call are host arrays")
        return contextlib.nullcontext()
    x0 = job.tensors[0]
    return be.using(runs_now(be, be.call_stream(x0, stream)), be.device_id(x0))


def _start(job: FusionJob, comm, progress, single, stream=None) -> Handle:
    normalize_op(job.opname)
    caller = _on_caller_stream(job, stream)  # checks stream= before anything starts
    eng = progress_engine(comm, progress)
    if not eng.starting.acquire(blocking=False):
        raise RuntimeError(
            f"ddlkernels.{job.what}: another thread is starting a reduction on the same Communicator; starts "
            "must come in the same order on every rank, so from one thread at a time (docs/reliability.md, "
            "\"Threads\")")
    try:
        return _start_on(eng, job, single, caller)
    finally:
        eng.starting.release()


def _start_on(eng, job: FusionJob, single, caller) -> Handle:
    h = Handle(eng, job, single)
    sig = job.signature()
    if eng.kind == "hooks":
        for b in job.buckets:  # every local check before the first message
            eng.check_buffer(job.backend, b.dtype)
        eng.check_same(sig, job.what)
        for b in job.buckets:
            b.direct = False  # MPI_Iallreduce works in the packed buffer
            if b.home is not None:  # the outputs' own buffer: nothing to copy back
                base, buf = None, b.home
            else:
                base = eng.pool.take(job.backend, b.dtype, b.count)
                buf = base[: b.count]
            job.pack(b, buf)
            h._bufs.append((b, buf, base))
            h._works.append(eng.reduce_async(buf, job.opname, job.backend, b.dtype))
        return h
    # Thread: pack now, in the caller's thread (a snapshot of the inputs),
    # then the whole job (agreement check + every bucket) is one unit of work.
    device = None
    with caller:  # device: the packs run on the caller's stream, and the work waits for them
        job.make_outputs()
        for b in job.buckets:
            buf = base = None
            # Only a tensor too large for a fusion buffer is reduced from its own
            # memory; everything else is snapshotted, so inputs are free again now.
            b.direct = b.direct and b.count * b.dtype.itemsize > job.fusion_bytes
            if b.home is not None:
                buf = b.home
                job.pack(b, buf)
            elif not b.direct:
                base = eng.pool.take(job.backend, b.dtype, b.count)
                buf = base[: b.count]
                job.pack(b, buf)
            h._bufs.append((b, buf, base))
        if job.backend is not None and job.backend.device:
            device = _Device(job.backend, job.tensors[0])
    bufs = list(h._bufs)

    def run(c):
        check_same_on_all_ranks(c, sig, job.what)
        for b, buf, _ in bufs:
            if b.direct:
                e = b.entries[0]
                c.allreduce(job.tensors[e.index], job.opname, out=job.outs[e.index], backend=job.backend.name)
            else:
                reduce_packed(c, job.backend, buf, b.dtype, job.opname)

    h._works.append(eng.submit(run, device))
    return h
