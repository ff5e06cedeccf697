"""Execute a ring schedule over MPI, chunk by chunk, with transfers and reductions overlapped.

Worked example: one reduce-scatter phase of a 3-rank ring, as seen by the rank
at ring position q = 0, the buffer cut into blocks B0, B1, B2 and each block
into chunks of ``chunk`` elements (here two chunks, .a and .b)::

    step 0   isend B2.a, B2.b to next          (all at once: they are ready)
             irecv B1.a -> slot0, B1.b -> slot1 from prev
             wait B1.a; out[B1.a] = x[B1.a] + slot0;  isend out[B1.a] to next
             wait B1.b; out[B1.b] = x[B1.b] + slot1;  isend out[B1.b] to next
    step 1   irecv B0.a -> slot0, ...
             wait B0.a; out[B0.a] = x[B0.a] + slot0    (last step: B0 is ours,
             ...                                        fused 1/p scale for avg)

The block received in step s is the block sent in step s + 1, so each chunk is
forwarded the moment it is reduced, without waiting for the rest of its step:
while this rank reduces chunk k, its neighbours are already moving chunk k - 1
of the next step and chunk k + 1 of this one.  ``window`` receive slots are in
flight at once (2 is classic double buffering); a slot is reposted for chunk
k + window as soon as chunk k has been reduced out of it.

An allgather phase needs no slots: every chunk is received straight into its
final place in ``out``, so all of a phase's receives are posted up front and
each chunk is forwarded as soon as it lands.

Sends are completed at the end of each phase, before a later phase may
overwrite the blocks they read.  Messages carry the phase number as their tag,
so no message of one phase can match a receive of another.

``src`` may also be a ``Segments``: many host arrays at fixed offsets of one
virtual buffer (a fusion bucket that was never packed).  The first
reduce-scatter reads each element of ``src`` exactly once: the block it sends
first, and each block it reduces.  The reductions read the arrays in place;
only the first block is copied, into ``out``'s own copy of that block, which
this phase never writes and the allgather overwrites only after those sends
have completed.  Packing costs 1/d1 of a copy of the buffer instead of all of
it.
"""

from __future__ import annotations

import numpy as np

from .schedule import Schedule, chunk_ranges, rings
from .segments import Segments

__all__ = ["execute", "ALIGN_PAD"]

#: Spare elements every receive slot needs beyond the chunk (see _reduce_scatter).
ALIGN_PAD = 16


def _wait_all(reqs):
    for r in reqs:
        r.Wait()


def _reduce_scatter(ring, src, out, op, backend, transport, chunk, slots, avg_p, deadline=None):
    tag = ring[0].phase
    nxt, prv = ring[0].send_peer, ring[0].recv_peer
    isend, irecv, reduce = transport.isend, transport.irecv, backend.reduce
    # MPI sees the "wire" views (same memory, an MPI-friendly type), the
    # reduction kernels the typed ones.
    segmented = src.__class__ is Segments
    w_out, w_slots = backend.wire(out), [backend.wire(s) for s in slots]
    w_src = None if segmented else backend.wire(src)
    window = len(slots)
    # A chunk is received at the same offset modulo 16 bytes as the place it
    # is reduced into, so that a GPU kernel sees three equally aligned
    # pointers and takes its 128-bit vector path (slots have ALIGN_PAD spare
    # elements for this).
    align = max(1, 16 // src.dtype.itemsize)
    if segmented:
        # MPI needs contiguous chunks: copy the block sent first into out's
        # copy of it, which this phase never writes (module docstring).
        sends = []
        for a, b in chunk_ranges(*ring[0].send, chunk):
            src.copy_to(out, a, b)
            sends.append(isend(w_out[a:b], nxt, tag))
    else:
        sends = [isend(w_src[a:b], nxt, tag) for a, b in chunk_ranges(*ring[0].send, chunk)]
    last_step = len(ring) - 1
    for s, st in enumerate(ring):
        last = s == last_step
        scale = avg_p if last else None
        pieces = chunk_ranges(*st.recv, chunk)
        reqs = [irecv(w_slots[k][a % align : a % align + b - a], prv, tag) for k, (a, b) in enumerate(pieces[:window])]
        for k, (a, b) in enumerate(pieces):
            if deadline is None:
                reqs[k].Wait()
            else:  # timeout= set: poll, and name this step and chunk on expiry (ddlkernels.safety.deadline)
                deadline.wait_recv(reqs[k], st, k, len(pieces), a, b)
            o = a % align
            if segmented:
                src.reduce_into(reduce, op, out, a, b, slots[k % window][o : o + b - a], avg_p=scale)
            else:
                reduce(op, out[a:b], src[a:b], slots[k % window][o : o + b - a], avg_p=scale)
            if k + window < len(pieces):
                a2, b2 = pieces[k + window]
                o2 = a2 % align
                reqs.append(irecv(w_slots[k % window][o2 : o2 + b2 - a2], prv, tag))
            if not last:
                sends.append(isend(w_out[a:b], nxt, tag))
    if deadline is None:
        _wait_all(sends)
    else:
        deadline.wait_sends(sends, ring, chunk)


def _allgather(ring, out, transport, chunk, deadline=None):
    tag = ring[0].phase  # out is the wire view here: nothing is computed
    nxt, prv = ring[0].send_peer, ring[0].recv_peer
    isend, irecv = transport.isend, transport.irecv
    sends = [isend(out[a:b], nxt, tag) for a, b in chunk_ranges(*ring[0].send, chunk)]
    # Every receive lands in its final place, so all of them can be posted
    # now; MPI matches messages from one peer and tag in posting order.
    posted = [[(a, b, irecv(out[a:b], prv, tag)) for a, b in chunk_ranges(*st.recv, chunk)] for st in ring]
    last_step = len(ring) - 1
    for s, pieces in enumerate(posted):
        for k, (a, b, req) in enumerate(pieces):
            if deadline is None:
                req.Wait()
            else:
                deadline.wait_recv(req, ring[s], k, len(pieces), a, b)
            if s != last_step:
                sends.append(isend(out[a:b], nxt, tag))
    if deadline is None:
        _wait_all(sends)
    else:
        deadline.wait_sends(sends, ring, chunk)


def execute(sched: Schedule, src, out, op: str, *, backend, transport, chunk: int, slots, avg_p=None, deadline=None) -> None:
    """Run ``sched`` on flat buffers: ``out`` receives the result, ``src`` is only read.

    ``src`` may be ``out`` (in place).  ``op`` is "sum", "max", "min" or
    "prod"; ``avg_p`` fuses the scale of "avg" into the owner's last
    reduction.  ``chunk`` is the pipeline chunk in elements and ``slots`` the
    receive buffers of at least ``chunk`` elements each.  For an
    allgather-only schedule ``src`` is unused and ``out`` must already hold
    this rank's shard.  ``deadline`` (a ``ddlkernels.safety.deadline.Deadline``, set
    when the call has a ``timeout=``) replaces every ``Wait()`` by polling.
    """
    if deadline is not None:
        transport = _Kept(transport, deadline.pending)
    with np.errstate(all="ignore"):  # NaN/Inf/overflow propagate as in numpy, silently as in MPI
        _execute(sched, src, out, op, backend, transport, chunk, slots, avg_p, deadline)


class _Kept:
    """``transport`` whose requests are also listed in ``pending`` (a ``Deadline``'s): if the call times out,
    every send and receive it left in flight, and so its buffers, stays alive (``ddlkernels.safety.deadline.abandon``)."""

    __slots__ = ("isend", "irecv")

    def __init__(self, transport, pending):
        def isend(buf, peer, tag, _isend=transport.isend, _keep=pending.append):
            req = _isend(buf, peer, tag)
            _keep(req)
            return req

        def irecv(buf, peer, tag, _irecv=transport.irecv, _keep=pending.append):
            req = _irecv(buf, peer, tag)
            _keep(req)
            return req

        self.isend, self.irecv = isend, irecv


def _execute(sched, src, out, op, backend, transport, chunk, slots, avg_p, deadline):
    phases = rings(sched.steps)
    if not phases and src is not out:  # a single rank: nothing to reduce
        if src.__class__ is Segments:
            src.copy_to(out, 0, src.count)
        else:
            backend.copy(out, src)
    reduce_rings = [r for r in phases if r[0].reduce]
    last_rs = reduce_rings[-1][0].phase if reduce_rings else None
    first = True
    for ring in phases:
        if ring[0].reduce:
            _reduce_scatter(
                ring,
                src if first else out,
                out,
                op,
                backend,
                transport,
                chunk,
                slots,
                avg_p if ring[0].phase == last_rs else None,
                deadline,
            )
            first = False
        else:
            _allgather(ring, backend.wire(out), transport, chunk, deadline)
