""""ipc": the ranks of one node reduce each other's device memory where it lies, over CUDA IPC.

Worked example, allreduce of 8 float32 on 2 ranks (one GPU or two), shards [0, 4) and [4, 8)::

    both    record "ready" on the caller's stream, then exchange where their x and out
            lie (IPC handle of the allocation, offset): one small allgather (barrier 1)
    rank 0  its stream waits for rank 1's "ready"; folds x0[0:4] op x1[0:4] into a
            shard buffer, reading x1 in rank 1's memory; copies the shard into
            out0[0:4] and into rank 1's out1[0:4]
    rank 1  the same for [4:8]
    both    record "done"; barrier 2; the stream waits for the peers' "done":
            out holds the whole result on every rank

Each rank folds its own shard in rank order (``x0 op x1 op x2 ...``, "avg"
scaling in the last step, the window's fold of ``ddlkernels.algorithms.shm``)
and writes it into every rank's output, so every rank gets the same bits.
The host never waits for the device: it records events, queues waits,
kernels and copies, and the two barriers order each rank's record of an IPC
event before any peer's wait on it (a wait waits for the latest record).
Each byte is read once by the reduce-scatter and written once per rank by
the allgather, device to device; no host memory, no MPI message but the
two small ones.

Buffers.  A peer's allocation is opened once and kept (``Mapped``, least
recently used closed past ``MAPPED``), as NCCL keeps registered buffers: a
training loop's gradients come from the same allocations every step.  An
array that CUDA IPC cannot export (memory of cudaMallocAsync, managed
memory) goes through an exportable stage of this rank: one more device copy.

It needs a device backend that offers CUDA IPC (``ipc``: the CuPy backend;
the stream emulator's under ``ipc=True``) and every rank on one node; the
tuner measures it beside the ring for device allreduce (``Communicator(ipc=)``).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..safety.deadline import complete
from .base import Algorithm
from .window_shards import cuts

__all__ = ["Ipc", "Mapped", "MAPPED", "KEY_BYTES"]

#: Peers' allocations kept open per rank; past it the least recently used is closed (a job whose buffers are new
#: every call would otherwise map without bound).
MAPPED = 256
#: Room for one IPC handle in the exchange (CUDA's are 64 bytes; the emulator's are file names).
KEY_BYTES = 240

# One rank's part of the exchange: where its input and output lie, and its two events.
_RECORD = np.dtype([("key", np.uint8, (4, KEY_BYTES)), ("len", np.int64, 4), ("off", np.int64, 2)])
_SRC, _DST, _READY, _DONE = range(4)


def _pack(recs, r, i, key):
    if len(key) > KEY_BYTES:
        raise ValueError(f"an IPC handle of {len(key)} bytes does not fit the exchange's {KEY_BYTES}")
    recs["key"][r, i, : len(key)] = np.frombuffer(key, np.uint8)
    recs["len"][r, i] = len(key)


def _unpack(recs, r, i) -> bytes:
    return recs["key"][r, i, : recs["len"][r, i]].tobytes()


class Mapped:
    """Peers' allocations opened in this process, by IPC handle, least recently used first; those taken out
    of use wait in ``closing`` until the work that used them has run (no host block)."""

    def __init__(self, be, limit=None):
        self.be, self.limit = be, MAPPED if limit is None else limit
        self.maps: OrderedDict = OrderedDict()
        self.closing: list = []  # (mappings, an event recorded after their last use)
        self.opened = 0  # how many opens this process made (a test sees the reuse)

    def get(self, key):
        m = self.maps.get(key)
        if m is None:
            m = self.maps[key] = self.be.ipc_open(key)
            self.opened += 1
        else:
            self.maps.move_to_end(key)
        return m

    def excess(self, keys) -> int:
        """How many must be closed before this call opens what it needs of ``keys``."""
        return len(self.maps) + len(keys.difference(self.maps)) - self.limit

    def retire(self, keys, stream) -> None:
        """Take the least recently used out of use until this call's ``keys`` fit under the limit (never one
        of them); they are closed once the work queued on ``stream`` so far has run (every earlier call's
        work: each device call waits for the last one)."""
        old = [self.maps.pop(k) for k in [k for k in self.maps if k not in keys][: max(0, self.excess(keys))]]
        if old:
            self.closing.append((old, self.be.record(stream)))

    def reap(self) -> None:
        """Close the retired mappings whose last use has run."""
        left = []
        for old, ev in self.closing:
            if self.be.query(ev):
                for m in old:
                    self.be.ipc_close(m)
            else:
                left.append((old, ev))
        self.closing = left

    def close(self) -> None:
        """Close every mapping (the caller has synchronized the work that used them)."""
        for m in [m for old, _ in self.closing for m in old] + list(self.maps.values()):
            self.be.ipc_close(m)
        self.maps.clear()
        self.closing = []


class _Device:
    """This rank's IPC state on one device: its two events, the opened peers' events and allocations, and
    its exportable stages."""

    def __init__(self, be):
        self.be = be
        (self.ready, self.ready_key), (self.done, self.done_key) = be.ipc_event(), be.ipc_event()
        self.events: dict = {}  # a peer's event handle -> the opened event
        self.mapped = Mapped(be)
        self.stages: dict = {}  # "src" / "dst" -> (uint8 device buffer, its IPC handle, offset)

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


class Ipc(Algorithm):
    name = "ipc"
    kinds = ("allreduce",)
    device = True

    def __init__(self, comm, placement):
        super().__init__(comm, placement)
        self._devices: dict = {}  # (backend name, device) -> _Device

    @classmethod
    def probe(cls, comm, placement):
        return placement.one_node and comm.ipc is not False

    def serves(self, kind, w):
        return kind == "allreduce" and w.be.device and getattr(w.be, "ipc", False) and w.dims is None

    def _device(self, be) -> _Device:
        key = (be.name, be.current_device())
        d = self._devices.get(key)
        if d is None:
            d = self._devices[key] = _Device(be)
        return d

    def _exported(self, be, d, buf, tag):
        """(array peers use, its handle, offset): ``buf`` itself where it can be exported, else the stage
        ``tag`` (the caller copies into or out of it)."""
        got = be.ipc_export(buf)
        if got is not None:
            return buf, got[0], got[1]
        stage, key, off = d.stage(tag, buf.nbytes)
        return stage[: buf.nbytes].view(buf.dtype), key, off

    def allreduce(self, w):
        be, c = w.be, self.comm
        p, me, n = c.size, c.rank, w.count
        if n == 0:
            return
        d = self._device(be)
        s = be.compute_stream()
        src, dst = w.src, w.dst
        inplace = src is dst
        dt, item = dst.dtype, dst.dtype.itemsize
        # Where peers read my input and write my result.
        mine_in, in_key, in_off = self._exported(be, d, src, "src")
        if mine_in is not src:
            be.copy(mine_in, src)
        if inplace:
            mine_out, out_key, out_off = mine_in, in_key, in_off
        else:
            mine_out, out_key, out_off = self._exported(be, d, dst, "dst")
        be.record_on(s, d.ready)
        rec = np.zeros(1, _RECORD)
        for i, k in ((_SRC, in_key), (_DST, out_key), (_READY, d.ready_key), (_DONE, d.done_key)):
            _pack(rec, 0, i, k)
        rec["off"][0] = (in_off, out_off)
        recs = np.empty(p, _RECORD)
        complete(c.comm.Iallgather(rec.view(np.uint8), recs.view(np.uint8)), w.deadline,
                 "the IPC allreduce's exchange of handles (MPI_Iallgather)")
        d.mapped.reap()
        d.mapped.retire({_unpack(recs, q, i) for q in range(p) if q != me for i in (_SRC, _DST)}, s)
        # Barrier 1 passed: every peer has recorded "ready" after the work that wrote its input.
        for q in range(p):
            if q != me:
                be.wait(s, d.event(_unpack(recs, q, _READY)))

        def peer(q, which, lo, hi):
            return be.ipc_view(d.mapped.get(_unpack(recs, q, which)),
                               int(recs["off"][q, which]) + lo * item, hi - lo, dt)

        c_ = cuts(n, p)
        lo, hi = c_[me], c_[me + 1]
        if hi > lo:
            xs = [mine_in[lo:hi] if q == me else peer(q, _SRC, lo, hi) for q in range(p)]
            acc = c.reusable_buffer("ipc-shard", be, dt, hi - lo)
            avg_p = p if w.avg else None
            be.reduce(w.redop, acc, xs[0], xs[1], avg_p=avg_p if p == 2 else None)
            for q in range(2, p):
                be.reduce(w.redop, acc, acc, xs[q], avg_p=avg_p if q == p - 1 else None)
            for k in range(1, p + 1):  # my own output last; the peers' in turn from the next rank on
                q = (me + k) % p
                be.copy(mine_out[lo:hi] if q == me else peer(q, _DST, lo, hi), acc)
        be.record_on(s, d.done)
        complete(c.comm.Ibarrier(), w.deadline, "the IPC allreduce's last barrier (MPI_Ibarrier)")
        # Barrier 2 passed: every peer has recorded "done" after its last read of my input and write of my output.
        for q in range(p):
            if q != me:
                be.wait(s, d.event(_unpack(recs, q, _DONE)))
        if mine_out is not dst:
            be.copy(dst, mine_out)

    def mapped(self) -> int:
        """How many peers' allocations this rank has opened so far, over its devices (for tests and reports)."""
        return sum(d.mapped.opened for d in self._devices.values())

    def free(self):
        for d in self._devices.values():
            d.be.synchronize()
            d.mapped.close()
        self._devices.clear()

    def held(self):
        return list(self._devices.values())
