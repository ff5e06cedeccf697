"""Device buffers over an MPI that cannot read GPU memory: stage every chunk through pinned host memory.

Worked example: one chunk k of a reduce-scatter step on one rank, with the
engine's window of receive slots (here 2) and this transport's two copy
streams, one per direction (a GPU copies both ways at once)::

    compute stream  ... reduce(k-2) ..ev1....... reduce(k-1) ............ reduce(k) ...
                                      |                                     ^ waits ev3
    H2D stream      ............... wait ev1 -> H2D(k) into slot k%2 -> ev3
                                                ^ slot k%2 was last read by reduce(k-2)
    D2H stream      wait ev0 -> D2H(send j) -> ev2
    host / MPI      Irecv(pinned k) ... Isend(pinned j) once ev2 has happened ... Wait(recv k)

* ``isend(buf)``: the D2H stream waits for an event recorded on the compute
  stream (the kernels that produced ``buf``), copies the chunk into a pinned
  slot and records an event; the host does not wait.  ``MPI_Isend`` starts
  from the slot once that event has happened: sends are posted in order,
  whenever the transport is called (every ``isend``/``irecv``, every
  ``Test``) and, before the host would block on a receive, by waiting for the
  oldest copy -- so a chunk's copy overlaps the host's work on the next ones
  and MPI never reads a slot the copy has yet to fill.
* ``irecv(buf)``: ``MPI_Irecv`` is posted at once into a pinned slot, so the
  data can arrive while the device works.  ``Wait()`` completes the MPI
  receive, makes the H2D stream wait for everything queued on the compute
  stream so far (the kernels that still read or write ``buf``: the engine
  reuses a receive slot for chunk k + window right after launching the
  reduction of chunk k, which reads it), queues the H2D copy, and makes the
  compute stream wait for that copy -- the host does not block, and the
  reduction the engine launches next is ordered after it.
* Slots are page-locked buffers of ``chunk_bytes`` allocated on first need
  and reused for the lifetime of the transport (page-locking is slow: a
  Communicator keeps one transport per backend).  A send slot returns to
  the pool when its MPI send completes, a receive slot when its H2D copy
  has.  The pool grows to what one ring phase keeps in flight -- the engine
  completes a phase's sends at its end, so that is up to the bytes this rank
  sends in one phase -- and no further; a bounded pool could deadlock, since
  a send only completes once the neighbour has posted its receive.

Every rule above is an ordering a GPU does not give for free: without it a
copy may overwrite a buffer that a queued kernel has yet to read, or MPI may
send a slot that the copy has yet to fill.  tests/mpi/test_stream_emulator.py
runs this transport on an emulated device whose queued copies and kernels
run late, in random orders that respect only streams and events, and checks
that removing any one of these waits gives wrong results.

Messages travel as bytes (``MPI_BYTE``): the device and host views share one
layout, and no MPI datatype exists for float16/bfloat16 anyway.

The backend provides the device primitives (``compute_stream``,
``new_stream``, ``pinned``, ``d2h``, ``h2d``, ``record``, ``wait``,
``sync``, ``query``; see ``ddlkernels/backends/_device.py``).  In the Numba
CUDA simulator they are synchronous, which exercises the same code paths.
"""

from __future__ import annotations

from .direct import Transport

__all__ = ["StagedTransport"]


class _StagedSend:
    """Request of a staged send: ``MPI_Isend`` from the pinned slot, posted once the slot's copy is done."""

    __slots__ = ("_t", "host", "ev", "peer", "tag", "req")

    def __init__(self, transport, host, ev, peer, tag):
        self._t, self.host, self.ev, self.peer, self.tag = transport, host, ev, peer, tag
        self.req = None  # the MPI request, once posted

    def Wait(self, status=None):
        while self.req is None:  # post it, and the sends before it, waiting for their copies
            self._t._post_oldest()
        return self.req.Wait(status)

    def Test(self, status=None):
        self._t._progress()
        return self.req is not None and self.req.Test(status)

    wait, test = Wait, Test


class _StagedRecv:
    """Request of a staged receive: ``Wait()`` (or a ``Test()`` that returns True) lands
    the chunk in device memory, stream-ordered; the engine's timeout polling uses ``Test``."""

    __slots__ = ("_t", "_req", "_slot", "_buf", "_nbytes", "_done")

    def __init__(self, transport, req, slot, buf, nbytes):
        self._t, self._req, self._slot, self._buf, self._nbytes = transport, req, slot, buf, nbytes
        self._done = False

    def Wait(self, status=None):
        t = self._t
        while not self._done:
            t._progress()
            if self._req.Test(status):
                break
            if t._pending:  # about to block: first start the sends our neighbour may be waiting for
                t._post_oldest()
            else:
                self._req.Wait(status)
                break
        if not self._done:
            t._land(self._slot, self._buf, self._nbytes)
            self._done = True
        return True

    def Test(self, status=None):
        """Non-blocking: True once the chunk has been received and its H2D copy queued."""
        if not self._done:
            self._t._progress()
            if self._req.Test(status):
                self._t._land(self._slot, self._buf, self._nbytes)
                self._done = True
        return self._done

    wait, test = Wait, Test


class StagedTransport(Transport):
    """Transport for device buffers when MPI is not CUDA-aware.

    ``comm``: the mpi4py communicator; ``backend``: a device backend (see the
    module docstring); ``chunk_bytes``: size of one pinned slot in bytes
    (the engine's chunk; a larger chunk grows the slots); ``window``: receive
    slots the engine keeps in flight, pre-allocated with as many send slots.
    """

    def __init__(self, comm, backend, chunk_bytes: int, window: int):
        if not getattr(backend, "device", False):
            raise TypeError(f"StagedTransport needs a device backend, got {getattr(backend, 'name', backend)!r}")
        self.comm = comm
        self.backend = backend
        self.slot_bytes = max(16, int(chunk_bytes))
        self.window = max(1, int(window))
        self._d2h = backend.new_stream()
        self._h2d = backend.new_stream()
        self._free: list = []
        self._pending: list = []  # sends whose copy may still run, oldest first (posted in this order)
        self._sending: list = []  # (slot, _StagedSend)
        self._landing: list = []  # (slot, event of its H2D copy)
        #: pinned bytes allocated so far (for reports; grows only on first use)
        self.pinned_bytes = 0
        for _ in range(2 * self.window):
            self._free.append(self._new_slot())

    # -- slots --------------------------------------------------------------------------
    def _new_slot(self):
        slot = self.backend.pinned(self.slot_bytes)
        self.pinned_bytes += self.slot_bytes
        return slot

    def _acquire(self, nbytes: int):
        if nbytes > self.slot_bytes:
            # A call with a larger chunk: new slots of that size from now on;
            # smaller ones in flight are dropped as they come back.
            self.slot_bytes = nbytes
            self._free = [s for s in self._free if s.shape[0] >= nbytes]
        if not self._free:
            self._reclaim()
        while self._free:
            slot = self._free.pop()
            if slot.shape[0] >= nbytes:
                return slot
        if self._landing:
            # The oldest H2D copy is the one most likely finished already.
            slot, ev = self._landing.pop(0)
            self.backend.sync(ev)
            if slot.shape[0] >= nbytes:
                return slot
        return self._new_slot()

    def _reclaim(self):
        still = []
        for slot, send in self._sending:
            if send.Test():
                self._put(slot)
            else:
                still.append((slot, send))
        self._sending = still

    def _put(self, slot):
        if slot.shape[0] >= self.slot_bytes:
            self._free.append(slot)

    # -- sends: posted in order once their copies are done ------------------------------
    def _progress(self):
        """Post the oldest sends whose device-to-host copies have happened (no host block)."""
        pending, be = self._pending, self.backend
        while pending and (pending[0].ev is None or be.query(pending[0].ev)):
            self._post(pending.pop(0))

    def _post_oldest(self):
        """Wait for the oldest pending send's copy, then post it (and whatever else is ready)."""
        s = self._pending.pop(0)
        if s.ev is not None:
            self.backend.sync(s.ev)
        self._post(s)
        self._progress()

    def _post(self, s):
        s.req = self.comm.Isend(s.host, s.peer, s.tag)

    # -- Transport ----------------------------------------------------------------------
    def isend(self, buf, peer, tag):
        be = self.backend
        nbytes = buf.shape[0] * buf.dtype.itemsize
        slot = self._acquire(nbytes)
        host = slot[:nbytes]
        ev = None
        if nbytes:
            # The copy waits for the kernels that produced buf; MPI waits for the copy (_progress).
            be.wait(self._d2h, be.record(be.compute_stream()))
            be.d2h(host, buf, self._d2h)
            ev = be.record(self._d2h)
        send = _StagedSend(self, host, ev, peer, tag)
        self._pending.append(send)
        self._sending.append((slot, send))
        self._progress()
        return send

    def irecv(self, buf, peer, tag):
        nbytes = buf.shape[0] * buf.dtype.itemsize
        slot = self._acquire(nbytes)
        req = self.comm.Irecv(slot[:nbytes], peer, tag)
        self._progress()
        return _StagedRecv(self, req, slot, buf, nbytes)

    def _land(self, slot, buf, nbytes):
        be = self.backend
        if nbytes:
            compute = be.compute_stream()
            be.wait(self._h2d, be.record(compute))  # kernels still reading or writing buf come first
            be.h2d(buf, slot[:nbytes], self._h2d)
            ev = be.record(self._h2d)
            be.wait(compute, ev)  # the next reduction sees the data
            self._landing.append((slot, ev))
        else:
            self._put(slot)

    def close(self):
        """Finish outstanding copies and sends, and release the pinned slots."""
        while self._pending:
            self._post_oldest()
        for _, send in self._sending:
            send.Wait()
        for _, ev in self._landing:
            self.backend.sync(ev)
        self._sending, self._landing, self._free = [], [], []
        self.pinned_bytes = 0
