""""host": device buffers reduced by the host's algorithms, through pinned memory, piece by piece.

Where MPI cannot read GPU memory, the ring stages every chunk of every step
through pinned memory and runs over MPI's transport.  On one node the host
has faster algorithms than that ring (the shared-memory window, single-copy
``cma``), and across nodes ``hier``; this algorithm lends them to device
buffers: copy a piece to pinned memory, reduce it there with the host
Communicator's own tuned choice, copy it back.  The copies of the neighbouring
pieces run meanwhile, on two copy streams (the GPU copies both ways at once),
so a call costs about the host's allreduce plus one piece down and one up.

Worked example, 20 MiB in pieces of 8 MiB (A, B, C), 2 pinned slots (3 by default, ``SLOTS``)::

    D2H stream   waits for the caller's stream (the kernels that wrote src)
                 A -> slot 0, B -> slot 1 ........ wait up(A); C -> slot 0
    host                  sync down(A); allreduce slot 0 in place; queue up(A)
                                       sync down(B); allreduce slot 1; queue up(B)
                                                      sync down(C); allreduce slot 0; up(C)
    H2D stream            slot 0 -> dst[A] ..... slot 1 -> dst[B] ... slot 0 -> dst[C]
                 (each queued after the host saw a copy down end: after the caller's kernels)
    caller's stream waits for the last H2D copy: no host block at the end

Every rank cuts the call alike and reduces its pieces in one order, so the
host allreduces meet.  The host blocks only where it needs bytes: before
reducing a piece it waits for that piece's copy.  A slot is copied into
again only after its last copy out (an event, waited on by the D2H stream);
that holds across calls too.  The result has the bits of the host algorithm
the inner Communicator runs for a piece's size (the same on every rank); the
order differs from the ring's, as the tuner's other choices do.

The inner Communicator (host arrays only: the same ``shm``, chunk, window
and ``small_bytes``) is created at the first call that runs this algorithm:
collective, which holds, since every rank chose "host" for that call.  Its
tuner measures the piece sizes; a call whose piece size it is still
measuring first lets it finish (on zeros), so that the outer tuner's trials
of "host" time what "host" will run.
"""

from __future__ import annotations

from ..safety.deadline import complete
from .base import Algorithm, pack_segments

__all__ = ["Host", "PIECE_BYTES", "SLOTS"]

#: bytes per piece: the host's allreduce runs near its large-message speed from a few MiB, and the copies
#: that do not overlap (the first piece down, the last up) stay a small part of a large call.
PIECE_BYTES = 8 << 20
#: pinned slots: one being reduced, one being copied down, one being copied up.
SLOTS = 3


class _Copies:
    """Per device: the two copy streams, the pinned slots and, per slot, the event of its last copy out."""

    __slots__ = ("be", "d2h", "h2d", "slots", "freed")

    def __init__(self, be, nslots, nbytes):
        self.be = be
        self.d2h, self.h2d = be.new_stream(), be.new_stream()
        self.slots = [be.pinned(nbytes) for _ in range(nslots)]
        self.freed = [None] * nslots

    def drain(self):
        """Wait for the slots' last copies out (every copy in came before them): the slots may be dropped."""
        for ev in self.freed:
            if ev is not None:
                self.be.sync(ev)


class Host(Algorithm):
    """Device allreduce through the host's algorithms (the module comment): a tuner candidate for device
    arrays, beside the ring (and "ipc" or "hier")."""

    name = "host"
    kinds = ("allreduce",)
    device = True
    #: the cut of a call (tests make it small, so that slots are reused within a call)
    piece_bytes = PIECE_BYTES

    def __init__(self, comm, placement):
        super().__init__(comm, placement)
        self._inner = None
        self._copies: dict = {}  # (backend name, device) -> _Copies

    @classmethod
    def probe(cls, comm, placement):
        return comm.size > 1

    def serves(self, kind, w):
        return kind == "allreduce" and w.be.device and w.dims is None

    def _host_comm(self, w):
        if self._inner is None:  # collective: every rank chose "host" for this same call
            c = self.comm
            complete(c.comm.Ibarrier(), w.deadline, "the host allreduce's setup (MPI_Ibarrier)")
            self._inner = type(c)(c.comm, chunk_bytes=c.chunk_bytes, small_bytes=c.small_bytes, window=c.window,
                                  shm=c.shm, ipc=False)
        return self._inner

    def _copies_for(self, be, nbytes):
        key = (be.name, be.current_device())
        cp = self._copies.get(key)
        if cp is None or cp.slots[0].shape[0] < nbytes:
            if cp is not None:
                cp.drain()
            cp = self._copies[key] = _Copies(be, SLOTS, nbytes)
        return cp

    def _settle_inner(self, inner, cp, counts, w):
        """Let the inner tuner finish its trials for these piece sizes first, on zeros in a slot: else the
        outer tuner's trials of "host" would time the inner one's slower candidates.  Every rank makes the
        same calls (``tuning`` is the same everywhere); once the sizes are settled, nothing but the asking."""
        item = w.dst.dtype.itemsize
        for count in sorted(counts):
            piece = cp.slots[0][:count * item].view(w.dst.dtype).view(w.dtype)
            if inner.tuning(piece, w.op):
                cp.drain()  # the slot may still be read by the last call's copies up
                piece[...] = 0
                while inner.tuning(piece, w.op):
                    inner.allreduce(piece, w.op, out=piece,
                                    timeout=None if w.deadline is None else w.deadline.remaining())

    def allreduce(self, w):
        pack_segments(w)
        be, n = w.be, w.count
        if n == 0:
            return
        inner = self._host_comm(w)
        item = w.dst.dtype.itemsize  # the storage type (bfloat16 as uint16 bits on a device backend)
        per = max(1, self.piece_bytes // item)
        cuts = [(a, min(a + per, n)) for a in range(0, n, per)]
        cp = self._copies_for(be, min(per, n) * item)
        self._settle_inner(inner, cp, {b - a for a, b in cuts}, w)
        nslots = len(cp.slots)
        compute = be.compute_stream()
        # The kernels that wrote src come first.  Those that still read or write dst too: every copy up is
        # queued after the host has seen a copy down, which came after them, complete.
        be.wait(cp.d2h, be.record(compute))
        down = [None] * len(cuts)

        def copy_down(k):
            s = k % nslots
            if cp.freed[s] is not None:
                be.wait(cp.d2h, cp.freed[s])  # the slot's last copy out has run
            a, b = cuts[k]
            be.d2h(cp.slots[s][:(b - a) * item], w.src[a:b], cp.d2h)
            down[k] = be.record(cp.d2h)

        for k in range(min(nslots, len(cuts))):
            copy_down(k)
        for k, (a, b) in enumerate(cuts):
            s = k % nslots
            be.sync(down[k])  # the host reduces these bytes next
            piece = cp.slots[s][:(b - a) * item].view(w.dst.dtype).view(w.dtype)
            inner.allreduce(piece, w.op, out=piece, timeout=None if w.deadline is None else w.deadline.remaining())
            be.h2d(w.dst[a:b], cp.slots[s][:(b - a) * item], cp.h2d)
            cp.freed[s] = be.record(cp.h2d)
            if k + nslots < len(cuts):
                copy_down(k + nslots)
        be.wait(compute, cp.freed[(len(cuts) - 1) % nslots])  # the H2D stream's last copy: every piece is in

    def free(self):
        for cp in self._copies.values():
            cp.drain()
        if self._inner is not None:
            self._inner.free()
        self._inner, self._copies = None, {}

    def held(self):
        return [x for x in (self._inner, *self._copies.values()) if x is not None]
