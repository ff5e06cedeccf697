""""ipc": the ranks of one node reduce each other's device memory where it lies, over CUDA IPC.

Worked example, allreduce of 8 float32 on 2 ranks, a GPU each, shards [0, 4) and [4, 8)::

    both    record "ready" on the caller's stream, then exchange where their x and out
            lie (IPC handle of the allocation, offset): one small allgather (barrier 1)
    rank 0  its stream waits for rank 1's "ready"; folds x0[0:4] op x1[0:4] into
            out0[0:4], reading x1 in rank 1's memory and writing each result into
            rank 1's out1[0:4] too, in the same kernel (in place out is x: each
            element is read before it is overwritten, by the thread that writes it)
    rank 1  the same for [4:8]
    both    record "done"; barrier 2; the stream waits for the peers' "done":
            out holds the whole result on every rank

Each rank folds its own shard in rank order (``x0 op x1 op x2 ...``, "avg"
scaling in the last step, the window's fold of ``ddlkernels.algorithms.shm``)
and writes it into every rank's output as it computes it (TensorRT-LLM's
"two-shot" allreduce has this shape), so every rank gets the same bits.
The host never waits for the device: it records events, queues waits,
kernels and copies, and the two barriers order each rank's record of an IPC
event before any peer's wait on it (a wait waits for the latest record).
Each input byte is read once and each result written once per rank, device
to device, in one kernel over up to 8 ranks' shards (``reduce_many``:
kernels/reduce.cu's ddl_fold, with the bits of the pairwise chain and up to
7 more destinations), in place too: no host memory, no MPI message but the
two small ones.

Ranks that share a GPU.  Where a GPU serves several ranks (``IpcNode.check``
compares their ``gpu_ident``: every rank on a node's one GPU, or more ranks
than GPUs, which ``ddlkernels.local_device`` deals out round robin), the GPU
runs one process's work at a time, switching between their contexts; a
stream's wait for a peer's event then costs a switch.  On an H200, 2 ranks:
the two events and the two exchanges alone took 0.5-0.57 ms a call, 4 ranks
1.41 ms (bench/results/ipc_schedules_np{2,4}_h200.txt).  So allreduce there
takes another schedule, the same bits.  The lowest rank on each GPU leads it;
2 GPUs, ranks 0 and 2 on one, 1 and 3 on the other, leaders 0 and 1, 8
elements::

    all     block until their own stream's work so far has run (the input is
            written), then the exchange of where x and out lie (barrier 1)
    rank 0  folds x0 op x1 op x2 op x3 over [0, 4) into out0 and, in the same
            kernel, out1, out2 and out3, then blocks until that kernel has run
    rank 1  the same over [4, 8); ranks 2 and 3 queue nothing
    all     barrier 2: out holds the whole result on every rank

With one GPU, rank 0 alone folds the whole buffer.  Only the leaders'
contexts have work (each call ends with its stream run, so the Communicator
records no event after it either: ``ddlkernels.collectives.streams``), no
stream waits for another process's event, and the bytes moved are those of
the schedule above (past 8 ranks the fold runs in launches of 8 operands,
the last writing 7 outputs and copies the rest: ``reduce_many``).
reduce_scatter and allgather there go the same way: the ranks also
exchange where their shards lie, and each leader folds the shard of every
rank on its GPU into that rank's shard (reduce_scatter) or writes every
rank's shard into the outputs of the ranks on its GPU, one launch of the
pack kernel each (allgather).

Buffers.  A peer's allocation is opened once and kept (``Mapped``, least
recently used closed past ``MAPPED``), as NCCL keeps registered buffers: a
training loop's gradients come from the same allocations every step.  CUDA
leaves a cudaFree of memory a peer still has open undefined, so the user
closes them (``Communicator.close_peer_memory``) before handing device memory
back to the driver, and ``free`` closes them all before any rank returns.  An
array that CUDA IPC cannot export (memory of cudaMallocAsync, managed
memory) goes through an exportable stage of this rank: one more device copy.

It needs a device backend that offers CUDA IPC (``ipc``: the CuPy backend;
the stream emulator's under ``ipc=True``) and every rank on one node; the
tuner measures it beside the ring (and "host") for device allreduce, and
beside the ring for device reduce_scatter and allgather (the same steps
alone, on the Communicator's shard bounds) (``Communicator(ipc=)``).

Whether CUDA IPC works at all is a property of the machine that no rank can
see alone: ranks in containers of their own, or on GPUs without peer access,
cannot map each other's memory.  So the first call on a backend maps every
peer's small probe buffer and events first, before any user buffer is
touched (``IpcNode.check``), and every rank learns whether all succeeded; if
not, that call and every later one take the ring instead (``ipc=True``:
every rank raises the same error), where a failure halfway through a call
would have left the ranks waiting for each other.  A rank that fails inside
a later call all the same (a new buffer it cannot map, a stage it cannot
allocate) says so in the call's next exchange (the second "barrier" is an
allgather of such flags): every rank raises the same error, the output
undefined, and the next call starts afresh.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import numpy as np

from ..safety.deadline import complete
from .base import Algorithm, run_instead
from .window_shards import cuts

__all__ = ["Ipc", "IpcNode", "Mapped", "MAPPED", "KEY_BYTES", "IDENT_BYTES", "give_up"]

#: Peers' allocations kept open per rank; past it the least recently used is closed (a job whose buffers are new
#: every call would otherwise map without bound).
MAPPED = 256
#: Room for one IPC handle in the exchange (CUDA's are 64 bytes; the emulator's are file names).
KEY_BYTES = 240
#: Room for one ``gpu_ident`` in the check's exchange (a PCI bus id is 13 bytes).
IDENT_BYTES = 64
#: Views of one peer's allocation kept while it is mapped (a training loop uses a few, the same every step).
_VIEWS = 64

# One rank's part of the exchange: where its input and output lie, and its two events; ``failed``: it could
# not make its part (every rank then raises, see ``IpcNode._call``).
_RECORD = np.dtype([("key", np.uint8, (4, KEY_BYTES)), ("len", np.int64, 4), ("off", np.int64, 2),
                    ("failed", np.int64)])
_SRC, _DST, _READY, _DONE = range(4)


def _pack(recs, r, i, key):
    if len(key) > KEY_BYTES:
        raise ValueError(f"an IPC handle of {len(key)} bytes does not fit the exchange's {KEY_BYTES}")
    recs["key"][r, i, : len(key)] = np.frombuffer(key, np.uint8)
    recs["len"][r, i] = len(key)


def _decode(recs) -> list:
    """Every rank's part of an exchange as Python values: (its four handles, its two offsets, whether it
    failed), in rank order."""
    keys, lens, offs = recs["key"], recs["len"].tolist(), recs["off"].tolist()
    return [(tuple(keys[q, i, : lens[q][i]].tobytes() for i in range(4)), offs[q], f)
            for q, f in enumerate(recs["failed"].tolist())]


def give_up(algorithm, be, why) -> None:
    """``algorithm`` (``ipc``, or ``hier`` on device arrays) no longer serves ``be``'s arrays: CUDA IPC cannot
    work here (``IpcNode.check``'s ``why``), which the user is told once."""
    algorithm.broken[be.name] = why
    warnings.warn(f"ddlkernels: {why}; device calls take the other algorithms", RuntimeWarning, stacklevel=4)


class _Skipped(Exception):
    """A rank of the node failed before the exchange of handles (``IpcNode._call``)."""


class Mapped:
    """Peers' allocations opened in this process, by IPC handle, least recently used first; those taken out
    of use wait in ``closing`` until the work that used them has run (no host block)."""

    def __init__(self, be, limit=None):
        self.be, self.limit = be, MAPPED if limit is None else limit
        self.maps: OrderedDict = OrderedDict()
        self.closing: dict = {}  # handle -> (mapping, an event recorded after its last use)
        self.views: dict = {}  # handle -> {(offset, count, dtype): a view of that mapping}, while it is in use
        self.opened = 0  # how many opens this process made (a test sees the reuse)

    def get(self, key):
        m = self.maps.get(key)
        if m is not None:
            self.maps.move_to_end(key)
        elif key in self.closing:  # needed again before it was closed: a handle is opened once at a time
            m = self.maps[key] = self.closing.pop(key)[0]
        else:
            m = self.maps[key] = self.be.ipc_open(key)
            self.opened += 1
        return m

    def view(self, key, offset, count, dtype):
        """``count`` elements of ``dtype`` at byte ``offset`` of the allocation ``key``: made once while the
        mapping is in use, since a training loop asks for the same views every step (each costs a device
        array object of the library)."""
        m = self.get(key)
        made = self.views.setdefault(key, {})
        v = made.get((offset, count, dtype))
        if v is None:
            if len(made) >= _VIEWS:  # a job whose sizes keep changing must not grow this without bound
                made.clear()
            v = made[(offset, count, dtype)] = self.be.ipc_view(m, offset, count, dtype)
        return v

    def excess(self, keys) -> int:
        """How many must be closed before this call opens what it needs of ``keys``."""
        return len(self.maps) + len(keys.difference(self.maps)) - self.limit

    def retire(self, keys, stream) -> None:
        """Take the least recently used out of use until this call's ``keys`` fit under the limit (never one
        of them); they are closed once the work queued on ``stream`` so far has run (every earlier call's
        work: each device call waits for the last one)."""
        old = [k for k in self.maps if k not in keys][: max(0, self.excess(keys))]
        if old:
            ev = self.be.record(stream)
            for k in old:
                self.closing[k] = (self.maps.pop(k), ev)
                self.views.pop(k, None)  # a view must not outlive its mapping

    def reap(self) -> None:
        """Close the retired mappings whose last use has run."""
        for k, (m, ev) in list(self.closing.items()):
            if not self.be.query(ev):
                continue  # queued work may still read or write through it
            del self.closing[k]
            self.be.ipc_close(m)

    def close(self) -> None:
        """Close every mapping (the caller has synchronized the work that used them)."""
        for m in [m for m, _ in self.closing.values()] + list(self.maps.values()):
            self.be.ipc_close(m)
        self.maps.clear()
        self.closing.clear()
        self.views.clear()


class _Device:
    """This rank's IPC state on one device: its two events, the opened peers' events and allocations, and
    its exportable stages."""

    def __init__(self, be):
        self.be = be
        (self.ready, self.ready_key), (self.done, self.done_key) = be.ipc_event(), be.ipc_event()
        self.events: dict = {}  # a peer's event handle -> the opened event
        self.mapped = Mapped(be)
        self.stages: dict = {}  # "src" / "dst" -> (uint8 device buffer, its IPC handle, offset)
        # A training loop's calls repeat their exchanges: my last part (its fields, its bytes) and the last
        # exchange (its bytes, ``_decode`` of them) are kept, and made again only when they change.
        self.mine = (None, None)
        self.seen = (b"", [])

    def record(self, src_key, src_off, dst_key, dst_off, failed) -> np.ndarray:
        """My part of an exchange, as the bytes sent: my input's and output's handles and offsets (empty where
        none), my two events' handles, and whether I failed to make it."""
        fields = (src_key, src_off, dst_key, dst_off, failed)
        if fields != self.mine[0]:
            rec = np.zeros(1, _RECORD)
            for i, key in ((_SRC, src_key), (_DST, dst_key), (_READY, self.ready_key), (_DONE, self.done_key)):
                _pack(rec, 0, i, key)
            rec["off"][0] = (src_off, dst_off)
            rec["failed"] = int(failed)
            self.mine = (fields, rec.view(np.uint8))
        return self.mine[1]

    def parts(self, raw) -> list:
        """``_decode`` of every rank's part (``raw``: the exchange's bytes), decoded again only when they change."""
        got = raw.tobytes()
        if got != self.seen[0]:
            self.seen = (got, _decode(raw.view(_RECORD)))
        return self.seen[1]

    def event(self, key):
        ev = self.events.get(key)
        if ev is None:
            ev = self.events[key] = self.be.ipc_open_event(key)
        return ev

    def stage(self, tag, nbytes):
        """An exportable buffer of at least ``nbytes`` bytes kept under ``tag``: its uint8 array, handle, offset."""
        st = self.stages.get(tag)
        if st is None or st[0].shape[0] < nbytes:
            buf = self.be.ipc_alloc(max(int(nbytes), 1))
            key, off = self.be.ipc_export(buf)
            st = self.stages[tag] = (buf, key, off)
        return st


class IpcNode:
    """The CUDA IPC collectives of the ranks of one node: ``comm`` (mpi4py), every rank of which shares the
    node.  Every call is collective over ``comm`` and runs on the backend's compute stream.  ``bounds``:
    every rank's ``(lo, hi)`` of the whole buffer, in rank order.
    """

    def __init__(self, comm):
        self.comm = comm
        self.p, self.me = comm.Get_size(), comm.Get_rank()
        self._devices: dict = {}  # (backend name, device) -> _Device
        self._verdicts: dict = {}  # backend name -> None where CUDA IPC works, else why not (``check``)
        self._leader_of: dict = {}  # backend name -> per rank, the lowest rank driving its GPU (``check``)
        self._leaders: dict = {}  # backend name -> those lowest ranks, sorted (``check``)
        self.staged = 0  # buffers this rank passed through an exportable stage (CUDA IPC could not export them)

    def _device(self, be) -> _Device:
        key = (be.name, be.current_device())
        d = self._devices.get(key)
        if d is None:
            d = self._devices[key] = _Device(be)
        return d

    def check(self, be, deadline=None, agree=None):
        """None where every rank of the node can map every peer's memory and events on ``be``, else why not:
        the same answer on every rank (the module comment).  Tried once per backend, at its first call (every
        rank's same call): each rank exports a small buffer of its own, maps its peers' and their two
        events, closes the mappings, then the ranks agree over ``comm``, or over ``agree`` (a communicator
        of several nodes, which must decide alike)."""
        if be.name in self._verdicts:
            return self._verdicts[be.name]
        why, probe, d = None, None, None
        rec = np.zeros(_RECORD.itemsize, np.uint8)  # no handles: what a rank that failed offers
        try:
            d = self._device(be)
            probe = be.ipc_alloc(1)
            got = be.ipc_export(probe)
            if got is None:
                raise RuntimeError("a buffer of its own ipc_alloc cannot be exported")
            rec = d.record(got[0], got[1], b"", 0, False)
        except Exception as exc:  # noqa: BLE001 -- every failure is this rank's answer, told to the others
            why = f"{type(exc).__name__}: {exc}"
        recs = np.empty(self.p * _RECORD.itemsize, np.uint8)
        complete(self.comm.Iallgather(rec, recs), deadline, "the CUDA IPC check's exchange of handles (MPI_Iallgather)")
        for q, (keys, _, _) in enumerate(_decode(recs.view(_RECORD))):
            if why is None and q != self.me and keys[_SRC]:
                try:
                    be.ipc_close(be.ipc_open(keys[_SRC]))
                    d.event(keys[_READY])
                    d.event(keys[_DONE])
                except Exception as exc:  # noqa: BLE001 -- as above
                    why = f"{type(exc).__name__}: {exc} (mapping rank {q}'s memory)"
        over = self.comm if agree is None else agree
        failed = np.empty(over.Get_size(), np.uint8)
        complete(over.Iallgather(np.array([why is not None], np.uint8), failed), deadline,
                 "the CUDA IPC check's verdict (MPI_Iallgather)")
        verdict = None
        if failed.any():
            verdict = (f"CUDA IPC failed on rank(s) {np.flatnonzero(failed).tolist()} of {over.Get_size()}"
                       + (f"; here: {why}" if why else ""))
        else:  # which GPU each rank drives: a GPU several ranks share takes the schedule of the module comment
            ident = np.zeros(IDENT_BYTES, np.uint8)
            got = be.gpu_ident()[:IDENT_BYTES]
            ident[: len(got)] = np.frombuffer(got, np.uint8)
            idents = np.empty((self.p, IDENT_BYTES), np.uint8)
            complete(self.comm.Iallgather(ident, idents), deadline, "the CUDA IPC check's GPUs (MPI_Iallgather)")
            first = {}
            of = self._leader_of[be.name] = tuple(first.setdefault(row.tobytes(), q) for q, row in enumerate(idents))
            self._leaders[be.name] = tuple(sorted(set(of)))
        self._verdicts[be.name] = verdict
        return verdict

    def leaders(self, be) -> tuple:
        """The ranks that fold for their GPU where a GPU serves several ranks (the lowest rank on each GPU, in
        rank order), else every rank; known once ``check`` has passed on ``be``."""
        got = self._leaders.get(be.name)
        return tuple(range(self.p)) if got is None else got

    def shares_gpus(self, be) -> bool:
        """Whether some GPU serves several ranks (then the host-blocking schedule of the module comment)."""
        return len(self.leaders(be)) < self.p

    def _exported(self, be, d, buf, tag):
        """(array peers use, its handle, offset): ``buf`` itself where it can be exported, else the stage
        ``tag`` (the caller copies into or out of it).  Asked at every call, not cached: CUDA documents
        getting a handle as lightweight, and memory freed and allocated again at one address gets a new
        handle, so no call reaches memory freed since through a mapping a peer kept (by handle)."""
        got = be.ipc_export(buf)
        if got is not None:
            return buf, got[0], got[1]
        self.staged += 1
        stage, key, off = d.stage(tag, buf.nbytes)
        return stage[: buf.nbytes].view(buf.dtype), key, off

    def _call(self, be, src, dst, deadline, what, body, agree=None, host_sync=False):
        """One collective in which peers read ``src`` and write ``dst`` (None: they touch none):
        ``body(mine_in, mine_out, peer)`` queues its kernels and copies, ``peer(q, role, lo, hi, dtype)``
        being rank q's input (``_SRC``) or output (``_DST``) elements ``[lo, hi)``.

        A rank that fails before the exchange of handles (an exportable stage it cannot allocate: then no
        rank of the node queues anything) or after it (a peer's memory it cannot map, a launch that fails)
        says so in the last exchange, so that every rank raises the same error instead of waiting for it in
        a later collective (the output is then undefined).  ``agree``: a communicator of several nodes over
        which that last exchange runs instead (``hier``: the other nodes must raise too).  ``host_sync``: the
        shared GPUs' order (the module comment): each rank blocks until its stream has run, before the
        first exchange and before the last, instead of its stream waiting for the peers' events."""
        p, me = self.p, self.me
        d = self._device(be)
        s = be.compute_stream()
        mine = [b"", 0, b"", 0]  # where my input and output lie (handle, offset; empty where peers touch none)
        mine_in = mine_out = failure = None
        try:
            if src is not None:
                mine_in, mine[0], mine[1] = self._exported(be, d, src, "src")
                if mine_in is not src:
                    be.copy(mine_in, src)
            if dst is not None:
                if dst is src:  # in place: my output lies where my input does (or in its stage)
                    mine_out, mine[2], mine[3] = mine_in, mine[0], mine[1]
                else:
                    mine_out, mine[2], mine[3] = self._exported(be, d, dst, "dst")
            rec = d.record(*mine, False)
        except Exception as exc:  # noqa: BLE001 -- told to every rank, raised by every rank below
            failure = exc
            rec = d.record(b"", 0, b"", 0, True)
        if host_sync:
            be.sync_stream(s)
        else:
            be.record_on(s, d.ready)
        recs = np.empty(p * _RECORD.itemsize, np.uint8)
        complete(self.comm.Iallgather(rec, recs), deadline,
                 f"the IPC {what}'s exchange of handles (MPI_Iallgather)")
        parts = d.parts(recs)
        try:
            if any(f for _, _, f in parts):  # a rank of the node has no part to offer: nobody touches anything
                raise _Skipped()
            roles = [r for r, buf in ((_SRC, src), (_DST, dst)) if buf is not None]
            d.mapped.reap()
            d.mapped.retire({parts[q][0][r] for q in range(p) if q != me for r in roles}, s)
            # Barrier 1 passed: every peer has recorded "ready" after the work that wrote its input (or, with
            # host_sync, that work has run).
            for q in range(p):
                if q != me and not host_sync:
                    be.wait(s, d.event(parts[q][0][_READY]))

            def peer(q, role, lo, hi, dtype):
                dt = np.dtype(dtype)
                return d.mapped.view(parts[q][0][role], parts[q][1][role] + lo * dt.itemsize, hi - lo, dt)

            body(mine_in, mine_out, peer)
        except _Skipped:
            pass
        except Exception as exc:  # noqa: BLE001 -- as above
            failure = exc
        if host_sync:
            be.sync_stream(s)
        else:
            be.record_on(s, d.done)
        over = self.comm if agree is None else agree
        failed = np.empty(over.Get_size(), np.uint8)
        complete(over.Iallgather(np.array([failure is not None], np.uint8), failed), deadline,
                 f"the IPC {what}'s last exchange (MPI_Iallgather)")
        # Barrier 2 passed: every peer has recorded "done" after its last read of my input and write of my output
        # (with host_sync: those have run).
        for q in range(p):
            if q != me and not host_sync:
                be.wait(s, d.event(parts[q][0][_DONE]))
        if failed.any():
            here = f"; here: {type(failure).__name__}: {failure}" if failure is not None else ""
            raise RuntimeError(f"the CUDA IPC {what} failed on rank(s) {np.flatnonzero(failed).tolist()} of "
                               f"{over.Get_size()}{here}; its output is undefined") from failure
        if dst is not None and mine_out is not dst:
            be.copy(dst, mine_out)

    def _fold(self, be, mine_in, peer, lo, hi, redop, avg_p, into, also=()):
        """My shard ``[lo, hi)`` of every rank's input, folded in rank order into ``into`` and each buffer of
        ``also`` as it is written (each apart from every input, or exactly one of the shards read)."""
        p, me, dt = self.p, self.me, mine_in.dtype
        xs = [mine_in[lo:hi] if q == me else peer(q, _SRC, lo, hi, dt) for q in range(p)]
        if p == 1:
            be.copy(into, xs[0])
        else:
            be.reduce_many(redop, into, xs, avg_p=avg_p, also=also)

    def _push(self, be, shard, mine_out, peer, lo, hi):
        """``shard`` into every rank's output at ``[lo, hi)``: the peers' in turn from the next rank on, my own
        last."""
        p, me = self.p, self.me
        for k in range(1, p + 1):
            q = (me + k) % p
            be.copy(mine_out[lo:hi] if q == me else peer(q, _DST, lo, hi, shard.dtype), shard)

    def allreduce(self, be, src, dst, redop, avg_p=None, deadline=None) -> None:
        """``dst`` = every rank's ``src`` folded in rank order ("avg": ``redop`` "sum" and ``avg_p``, scaling in
        the last step); ``src is dst`` in place."""
        n = dst.shape[0]
        if n == 0:
            return
        if self.shares_gpus(be):
            leaders = self.leaders(be)
            c = cuts(n, len(leaders))
            i = leaders.index(self.me) if self.me in leaders else None

            def led(mine_in, mine_out, peer):  # a leader folds its GPU's part into every rank's output
                if i is not None and c[i + 1] > c[i]:
                    lo, hi = c[i], c[i + 1]
                    outs = [peer(q, _DST, lo, hi, mine_in.dtype) for q in range(self.p) if q != self.me]
                    self._fold(be, mine_in, peer, lo, hi, redop, avg_p, mine_out[lo:hi], also=outs)

            return self._call(be, src, dst, deadline, "allreduce", led, host_sync=True)
        c = cuts(n, self.p)
        lo, hi = c[self.me], c[self.me + 1]

        def body(mine_in, mine_out, peer):
            if hi > lo:
                # The fold lands in my output's shard and, as it computes it, in the peers' (no copies).  In
                # place each of those is the very input shard it reads, element by element before writing it
                # (reduce_many allows an operand that is exactly an output); no peer reads these shards.
                peers = [peer((self.me + k) % self.p, _DST, lo, hi, mine_in.dtype) for k in range(1, self.p)]
                self._fold(be, mine_in, peer, lo, hi, redop, avg_p, mine_out[lo:hi], also=peers)

        self._call(be, src, dst, deadline, "allreduce", body)

    def _led(self, be) -> list:
        """The ranks on the GPU this rank leads in the shared-GPU schedule, in rank order (none if it leads none)."""
        return [q for q, first in enumerate(self._leader_of[be.name]) if first == self.me]

    def reduce_scatter(self, be, src, shard, bounds, redop, avg_p=None, deadline=None, agree=None) -> None:
        """``shard`` (this rank's, a buffer apart from ``src``) = elements ``bounds[me]`` of every rank's
        ``src``, folded in rank order (``agree``: ``_call``'s)."""
        lo, hi = bounds[self.me]
        if not any(b > a for a, b in bounds):
            return
        if self.shares_gpus(be):
            def led(mine_in, mine_out, peer):  # a leader folds the shards of the ranks on its GPU into theirs
                for q in self._led(be):
                    a, b = bounds[q]
                    if b > a:
                        into = mine_out if q == self.me else peer(q, _DST, 0, b - a, mine_in.dtype)
                        self._fold(be, mine_in, peer, a, b, redop, avg_p, into)

            return self._call(be, src, shard if hi > lo else None, deadline, "reduce_scatter", led, agree,
                              host_sync=True)

        def body(mine_in, mine_out, peer):
            if hi > lo:
                self._fold(be, mine_in, peer, lo, hi, redop, avg_p, shard)

        self._call(be, src, None, deadline, "reduce_scatter", body, agree)

    def allgather(self, be, shard, dst, bounds, deadline=None, agree=None) -> None:
        """Every rank's ``shard`` into its ``bounds`` of every rank's ``dst`` (``shard`` apart from ``dst``;
        ``agree``: ``_call``'s)."""
        lo, hi = bounds[self.me]
        if not any(b > a for a, b in bounds):
            return
        if self.shares_gpus(be):
            def led(mine_in, mine_out, peer):  # a leader writes every shard into the outputs of the ranks on its GPU
                ranks, dt = self._led(be), dst.dtype
                if not ranks:
                    return  # not a leader: it maps nobody's memory
                shards = [(mine_in if r == self.me else peer(r, _SRC, 0, b - a, dt), a * dt.itemsize)
                          for r, (a, b) in enumerate(bounds) if b > a]
                for q in ranks:  # one launch of the pack kernel per output
                    out = mine_out if q == self.me else peer(q, _DST, 0, dst.shape[0], dt)
                    be.pack([t for t, _ in shards], out, [at for _, at in shards])

            return self._call(be, shard if hi > lo else None, dst, deadline, "allgather", led, agree,
                              host_sync=True)

        def body(mine_in, mine_out, peer):
            if hi > lo:
                self._push(be, shard, mine_out, peer, lo, hi)

        self._call(be, None, dst, deadline, "allgather", body, agree)

    def mapped(self, now=False) -> int:
        """How many peers' allocations this rank has opened so far, or with ``now`` holds open in use, over
        its devices (for tests and reports)."""
        return sum(len(d.mapped.maps) if now else d.mapped.opened for d in self._devices.values())

    def close_mapped(self) -> None:
        """Close every peer allocation this rank holds open (the caller has synchronized the work that used
        them); later calls open what they need again."""
        for d in self._devices.values():
            d.mapped.close()

    def free(self) -> None:
        """Close everything (collective): no rank returns while a peer still has its memory open, which
        CUDA leaves undefined once that memory is freed."""
        for d in self._devices.values():
            d.be.synchronize()
            d.mapped.close()
        self._devices.clear()
        self.comm.Barrier()

    def held(self) -> list:
        return list(self._devices.values())


class Ipc(Algorithm):
    """"ipc": allreduce, reduce_scatter and allgather of device arrays over CUDA IPC (``IpcNode``), a tuner
    candidate beside the ring where every rank shares a node and the backend offers CUDA IPC."""

    name = "ipc"
    kinds = ("allreduce", "reduce_scatter", "allgather")
    device = True

    def __init__(self, comm, placement):
        super().__init__(comm, placement)
        self._node = None
        self.broken: dict = {}  # backend name -> why CUDA IPC cannot serve its arrays here (IpcNode.check)

    @property
    def node(self) -> IpcNode:
        if self._node is None:
            self._node = IpcNode(self.comm.comm)
        return self._node

    @classmethod
    def probe(cls, comm, placement):
        return placement.one_node and comm.ipc is not False

    def serves(self, kind, w):
        return (kind in self.kinds and w.be.device and getattr(w.be, "ipc", False) and w.dims is None
                and w.be.name not in self.broken)

    def _works(self, w) -> bool:
        """Whether CUDA IPC works for ``w``'s backend (``IpcNode.check``, collective at its first call); where
        it does not, ``ipc=True`` raises (at every call: the verdict is kept), else a warning, and this
        algorithm no longer serves that backend."""
        why = self.node.check(w.be, w.deadline)
        if why is None:
            return True
        if self.comm.ipc is True:
            raise RuntimeError(f"ipc=True, but {why}; pass ipc=None to let device calls take the ring")
        give_up(self, w.be, why)
        return False

    def allreduce(self, w):
        if not self._works(w):
            return run_instead(self.comm, "allreduce", w)
        self.node.allreduce(w.be, w.src, w.dst, w.redop, self.comm.size if w.avg else None, w.deadline)

    # A caller's out= is reduced into as the backend's flat storage view (a torch tensor's CuPy view,
    # bfloat16 as its bits), as the inputs are.
    def reduce_scatter(self, w):
        if not self._works(w):
            return run_instead(self.comm, "reduce_scatter", w)
        self.node.reduce_scatter(w.be, w.src, w.be.flat(w.dst), w.bounds, w.redop,
                                 self.comm.size if w.avg else None, w.deadline)

    def allgather(self, w):
        if not self._works(w):
            return run_instead(self.comm, "allgather", w)
        self.node.allgather(w.be, w.src, w.be.flat(w.dst), w.bounds, w.deadline)

    def mapped(self, now=False) -> int:
        """``IpcNode.mapped``: peers' allocations opened so far, or with ``now`` open in use."""
        return 0 if self._node is None else self._node.mapped(now)

    def staged(self) -> int:
        """Buffers this rank passed through an exportable stage so far (one more device copy each)."""
        return 0 if self._node is None else self._node.staged

    def close_peer_memory(self):
        if self._node is not None:
            self._node.close_mapped()

    def free(self):
        if self._node is not None:
            self._node.free()

    def held(self):
        return [] if self._node is None else self._node.held()
