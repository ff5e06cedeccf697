""""host": device buffers reduced by the host's algorithms, through pinned memory, piece by piece.

Where MPI cannot read GPU memory, the ring stages every chunk of every step
through pinned memory and runs over MPI's transport.  On one node the host
has faster algorithms than that ring (the shared-memory window, single-copy
``cma``), and across nodes ``hier``; this algorithm lends them to device
buffers: copy a piece to pinned memory, reduce it there with the host
Communicator's own tuned choice, copy it back.  The copies of the neighbouring
pieces run meanwhile, on two copy streams (the GPU copies both ways at once),
so a call costs about the host's allreduce plus one piece down and one up.
Those two are short: the pieces grow from an eighth of ``PIECE_BYTES`` (8 MiB),
doubling, and shrink back at the end (``piece_cuts``; 64 MiB of float32:
1, 2, 4, 7.1 x 7, 4, 2, 1 MiB).

Worked example, 4 MiB in pieces of 1, 2 and 1 MiB (A, B, C), 2 pinned slots (3 by default, ``SLOTS``)::

    D2H stream   waits for the caller's stream (the kernels that wrote src)
                 A -> slot 0, B -> slot 1 ........ wait up(A); C -> slot 0
    host                  sync down(A); allreduce slot 0 in place; queue up(A)
                                       sync down(B); allreduce slot 1; queue up(B)
                                                      sync down(C); allreduce slot 0; up(C)
    H2D stream            slot 0 -> dst[A] ..... slot 1 -> dst[B] ... slot 0 -> dst[C]
                 (each queued after the host saw a copy down end: after the caller's kernels)
    caller's stream waits for the last H2D copy: no host block at the end

reduce_scatter and allgather run the same pipeline on pieces that take
elements ``[a, b)`` of every rank's shard (the longest shard cut as above,
``PIECE_BYTES`` over the ranks): ``s = b - a`` elements of each shard, each
at its rank's shard of the piece for the inner Communicator, which
reduce_scatters (or allgathers) the piece.  2 ranks, shards [0, 5) and
[5, 9), cut at [0, 3) and [3, 5)::

    piece 0   x[0:3] | x[5:8]        -> rank 0 gets its [0:3], rank 1 its [5:8]
    piece 1   x[3:5] 0 | x[8:9] 0 0  -> rank 0 gets its [3:5], rank 1 its [8:9]

(reduce_scatter copies every rank's part of the piece down and its own
result up; allgather its own part down and every rank's up.)  A short shard
leaves padding, zeros, which no result is read from.

Every rank cuts the call alike and reduces its pieces in one order, so the
host collectives meet.  The host blocks only where it needs bytes: before
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
of "host" time what "host" will run; until "host" has run a call of that
shape once, ``Communicator.tuning`` says the call is still measuring.
"""

from __future__ import annotations

from ..safety.deadline import complete
from .base import Algorithm, Finished, call_key, pack_segments

__all__ = ["Host", "PIECE_BYTES", "RAMP", "SLOTS", "piece_cuts"]

#: bytes per piece: the host's allreduce runs near its large-message speed from a few MiB.
PIECE_BYTES = 8 << 20
#: the first and the last piece are PIECE_BYTES / RAMP: the first piece's copy down and the last one's copy up
#: overlap nothing.  With pieces of 8 MiB alike, the "ddlkernels staged" lines of
#: bench/results/device_allreduce_np{2,4}_h200.txt at 64 and 256 MiB, extrapolated to 0 bytes, leave 2.3 ms
#: (2 ranks) and 3.4 ms (4 ranks) a call beside 0.22 and 0.32 ms a MiB: about one piece down and up.
RAMP = 8
#: pinned slots: one being reduced, one being copied down, one being copied up.
SLOTS = 3


def piece_cuts(n: int, per: int, ramp: int = RAMP) -> list:
    """``[(a, b), ...]``: ``n`` elements cut into pieces of at most ``per``, which grow from ``per // ramp``,
    doubling, and shrink back the same way at the end, so that the copies that overlap nothing (the first
    piece down, the last up) are short.  A piece is at most twice the one before it (the copy of the next piece
    down has about the host's time for this one) and a ramp step is taken only where the middle keeps at least
    twice that step.  ``ramp=1``: pieces of ``per``, the last one short.

    >>> [b - a for a, b in piece_cuts(64, 8)]
    [1, 2, 4, 8, 7, 7, 7, 7, 7, 7, 4, 2, 1]
    >>> [b - a for a, b in piece_cuts(20, 8, ramp=1)]
    [8, 8, 4]
    """
    per = max(1, per)
    head, rest, s = [], n, max(1, per // max(1, ramp))
    while s < per and rest - 2 * s >= 2 * s:
        head.append(s)
        rest -= 2 * s
        s *= 2
    if not head:
        sizes = [per] * (n // per) + ([n % per] if n % per else [])
    else:
        most = min(per, 2 * head[-1])
        k = -(-rest // most)
        sizes = head + [rest // k + (i < rest % k) for i in range(k)] + head[::-1]
    cuts, a = [], 0
    for m in sizes:
        cuts.append((a, a + m))
        a += m
    return cuts


class _Copies:
    """Per device: the two copy streams, the pinned slots and, per slot, the event of its last copy out.

    The slots are the backend's pinned memory, not arrays of the node's shared memory (``empty``): in place at
    2-8 MiB the host's allreduce ran no faster on shared inputs (bench/results/host_slots_shared_np2.txt)."""

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
    """Device collectives through the host's algorithms (the module comment): a tuner candidate for device
    arrays, beside the ring (and "ipc" or "hier")."""

    name = "host"
    kinds = ("allreduce", "reduce_scatter", "allgather")
    device = True
    #: the cut of a call (tests make it small, so that slots are reused within a call)
    piece_bytes = PIECE_BYTES
    ramp = RAMP

    def __init__(self, comm, placement):
        super().__init__(comm, placement)
        self._inner = None
        self._finished = Finished()  # the piece shapes whose inner trials have finished
        self._copies: dict = {}  # (backend name, device) -> _Copies

    @classmethod
    def probe(cls, comm, placement):
        return comm.size > 1

    def serves(self, kind, w):
        return kind in self.kinds and w.be.device and w.dims is None

    def _host_comm(self, w):
        if self._inner is None:  # collective: every rank chose "host" for this same call
            c = self.comm
            complete(c.comm.Ibarrier(), w.deadline, "the host collective's setup (MPI_Ibarrier)")
            # The caller's call was validated and carries its deadline to each inner call.
            self._inner = c.derived(c.comm, ipc=False, validate=False, timeout=None)
        return self._inner

    def _copies_for(self, be, nbytes):
        key = (be.name, be.current_device())
        cp = self._copies.get(key)
        if cp is None or cp.slots[0].shape[0] < nbytes:
            if cp is not None:
                cp.drain()
            cp = self._copies[key] = _Copies(be, SLOTS, nbytes)
        return cp

    def _settle_inner(self, inner, cp, kind, op, piece, run):
        """``finish_trials`` of the inner Communicator's ``kind`` for pieces like ``piece`` (a host array in a
        slot), on that slot: ``run()`` makes one inner call."""
        def zeros():
            cp.drain()  # the slot may still be read by the last call's copies up
            piece[...] = 0
            return piece

        self._finished.finish((kind, op, piece.dtype, piece.shape[0]), lambda: inner.tuning(piece, op, collective=kind),
                              zeros, lambda _: run())

    def inner_trials(self, kind, w):
        return self._finished.pending(call_key(kind, w))

    def _pipeline(self, be, cp, count, down, host, up):
        """``count`` pieces through the slots (the module comment): ``down(k, slot, stream)`` queues piece k's
        copies into ``slot``, ``host(k, slot)`` runs the inner collective on it once they have run,
        ``up(k, slot, stream)`` queues its copies back."""
        nslots = len(cp.slots)
        compute = be.compute_stream()
        # The kernels that wrote src come first.  Those that still read or write dst too: every copy up is
        # queued after the host has seen a copy down, which came after them, complete.
        be.wait(cp.d2h, be.record(compute))
        landed = [None] * count

        def copy_down(k):
            s = k % nslots
            if cp.freed[s] is not None:
                be.wait(cp.d2h, cp.freed[s])  # the slot's last copy out has run
            down(k, cp.slots[s], cp.d2h)
            landed[k] = be.record(cp.d2h)

        for k in range(min(nslots, count)):
            copy_down(k)
        for k in range(count):
            s = k % nslots
            be.sync(landed[k])  # the host reads these bytes next
            host(k, cp.slots[s])
            up(k, cp.slots[s], cp.h2d)
            cp.freed[s] = be.record(cp.h2d)
            if k + nslots < count:
                copy_down(k + nslots)
        be.wait(compute, cp.freed[(count - 1) % nslots])  # the H2D stream's last copy: every piece is in

    @staticmethod
    def _timeout(w):
        return None if w.deadline is None else w.deadline.remaining()

    def allreduce(self, w):
        pack_segments(w)
        self._finished.ran(call_key("allreduce", w))  # before any return: the call's inner trials run below
        be, n = w.be, w.count
        if n == 0:
            return
        inner = self._host_comm(w)
        store = w.dst.dtype  # the storage type (bfloat16 as uint16 bits on a device backend)
        item = store.itemsize
        per = max(1, self.piece_bytes // item)
        cuts = piece_cuts(n, per, self.ramp)
        # Slots of a whole piece, not of this call's largest (the ramp's middle pieces vary with the size):
        # pinning is slow, and a call that grows the slots frees them first.
        cp = self._copies_for(be, min(per, n) * item)

        def view(slot, m):
            return slot[:m * item].view(store).view(w.dtype)

        for m in sorted({b - a for a, b in cuts}):
            piece = view(cp.slots[0], m)
            self._settle_inner(inner, cp, "allreduce", w.op, piece,
                               lambda: inner.allreduce(piece, w.op, out=piece, timeout=self._timeout(w)))

        def down(k, slot, stream):
            a, b = cuts[k]
            be.d2h(slot[:(b - a) * item], w.src[a:b], stream)

        def host(k, slot):
            piece = view(slot, cuts[k][1] - cuts[k][0])
            inner.allreduce(piece, w.op, out=piece, timeout=self._timeout(w))

        def up(k, slot, stream):
            a, b = cuts[k]
            be.h2d(w.dst[a:b], slot[:(b - a) * item], stream)

        self._pipeline(be, cp, len(cuts), down, host, up)

    def reduce_scatter(self, w):
        self._sharded(w)

    def allgather(self, w):
        self._sharded(w)

    def _sharded(self, w):
        """reduce_scatter and allgather, in pieces that take elements ``[a, b)`` of every rank's shard (the
        longest shard's ``piece_cuts``): piece k's ``s = b - a`` elements of each shard lie at that rank's shard
        of the piece's ``p * s`` for the inner Communicator (``at[s]``), and the inner collective runs on the
        piece.  A shard shorter than that leaves padding in the piece, which no result is read from (zeros
        where it is reduced).  A slot holds the piece, then this rank's ``s``."""
        be, p, me = w.be, self.comm.size, self.comm.rank
        self._finished.ran(call_key(w.kind, w))  # as in allreduce
        if w.count == 0:
            return
        inner = self._host_comm(w)
        gather = w.kind == "allgather"
        store = w.src.dtype  # the storage type, as in allreduce
        item = store.itemsize
        longest, per = max(hi - lo for lo, hi in w.bounds), max(1, self.piece_bytes // (item * p))
        cuts = piece_cuts(longest, per, self.ramp)
        at = {s: [inner.shard_range(p * s, rank=q)[0] for q in range(p)] for s in {b - a for a, b in cuts}}
        lengths = [[max(0, min(b, hi - lo) - a) for lo, hi in w.bounds] for a, b in cuts]
        cp = self._copies_for(be, (p + 1) * min(per, longest) * item)  # a whole piece, as in allreduce
        dst = be.flat(w.dst)

        def piece(slot, s):
            return slot[:p * s * item].view(store).view(w.dtype)

        def mine(slot, s):
            return slot[p * s * item:(p + 1) * s * item].view(store).view(w.dtype)

        def run(slot, s):
            if gather:
                inner.allgather(mine(slot, s), count=p * s, out=piece(slot, s), timeout=self._timeout(w))
            else:
                inner.reduce_scatter(piece(slot, s), w.op, out=mine(slot, s), timeout=self._timeout(w))

        for s in sorted(at):
            self._settle_inner(inner, cp, w.kind, "sum" if gather else w.op, piece(cp.slots[0], s),
                               lambda s=s: run(cp.slots[0], s))

        def ranges(k):
            """(rank, its first element of the whole buffer in piece k, how many) for the ranks with any."""
            return [(q, w.bounds[q][0] + cuts[k][0], m) for q, m in enumerate(lengths[k]) if m]

        def down(k, slot, stream):
            a, b = cuts[k]
            if gather:
                m = lengths[k][me]
                if m:
                    be.d2h(slot[p * (b - a) * item:(p * (b - a) + m) * item], w.src[a:a + m], stream)
                return
            for q, lo, m in ranges(k):
                o = at[b - a][q]
                be.d2h(slot[o * item:(o + m) * item], w.src[lo:lo + m], stream)

        def host(k, slot):
            s = cuts[k][1] - cuts[k][0]
            if not gather:
                x = piece(slot, s)
                for q, m in enumerate(lengths[k]):
                    x[at[s][q] + m:at[s][q] + s] = 0
            run(slot, s)

        def up(k, slot, stream):
            a, b = cuts[k]
            if gather:
                for q, lo, m in ranges(k):
                    o = at[b - a][q]
                    be.h2d(dst[lo:lo + m], slot[o * item:(o + m) * item], stream)
                return
            m = lengths[k][me]
            if m:
                be.h2d(dst[a:a + m], slot[p * (b - a) * item:(p * (b - a) + m) * item], stream)

        self._pipeline(be, cp, len(cuts), down, host, up)

    def free(self):
        for cp in self._copies.values():
            cp.drain()
        if self._inner is not None:
            self._inner.free()
        self._inner, self._copies, self._finished = None, {}, Finished()

    def held(self):
        return [x for x in (self._inner, *self._copies.values()) if x is not None]
