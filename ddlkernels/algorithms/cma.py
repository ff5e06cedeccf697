"""Single-copy allreduce: every rank reads and writes its peers' buffers where they lie (``process_vm_readv``,
``process_vm_writev``).

The shared-memory allreduce (``ddlkernels.algorithms.shm``) first copies what its peers
need into a window, because a peer can only read shared memory.  Linux lets a
process read another's private memory too, with one system call that copies
straight from the peer's pages into its own (``process_vm_readv``, "cross
memory attach"; Open MPI's shared-memory transport sends large messages so).
This module reduces that way: no stage, no window for the data, the caller's
own ``x`` and ``out`` read and written by the peers.  Worked example, 2
ranks, 8 elements cut into blocks B0 = [0, 4) and B1 = [4, 8), pieces of 2
elements, seen by rank 1::

    publish  the addresses of my x and out, in my flag line; barrier
    read     out[4:6] = rank 0's x[4:6]     (one process_vm_readv: the kernel copies
                                            from rank 0's pages into my out)
    reduce   out[4:6] = out[4:6] + x[4:6]   (rank order: x0 + x1, as numpy adds)
    write    rank 0's out[4:6] = out[4:6]   (one process_vm_writev: from my cache
                                            into rank 0's pages)
    the same for out[6:8]
    barrier                                 every block is in every out
    barrier                                 the last: nobody returns, and lets its
                                            caller touch x or out, while a peer
                                            may still read or write them

With p ranks, block r is folded by rank r alone, its operands in rank order,
and every rank gets the owner's bits: the result is bitwise the same
everywhere, and each element is ``((x0 op x1) op x2) ...``.  Out of place the
fold runs in ``out`` itself, a peer's piece read straight into it; in place
(``out`` is ``x``, my own operand) the peers' pieces go through a small
private buffer.  A folded piece is written into every peer's ``out`` while
it is still in the folding rank's cache: no one else touches a peer's block
of mine during the call (in place it is input that only I read, and I have
read it).  That is the push, from ``PUSH_FROM`` bytes, every size the tuner
offers this algorithm at; below it (``push_from=``) the ranks pull instead:
after the middle barrier each reads every other block from its owner's
``out``, one read per block.  A read of ``PIECE_BYTES`` (from 3 ranks
``PIECE_BYTES_WIDE``: ``piece_for``) keeps what a rank folds in its cache;
three barriers per call whatever its size.  The data crosses between
processes once per phase, from the memory it already lies in, where the
window moves it twice (into the stage, then out of it).

The same reads make an allgather (``CmaAllreduce.allgather``): each rank
publishes where its shard lies, one barrier, reads every peer's shard
straight into its own output (one ``process_vm_readv`` each), one barrier
before anyone returns -- one copy of every byte, where the window's
allgather copies each chunk into its stage and out again.  It is the
allgather tuner's "cma", from ``CMA_GATHER_FROM`` bytes.

It needs what ``process_vm_readv`` and ``process_vm_writev`` need: Linux,
every rank the same user, and ptrace permission between them (Yama's
``ptrace_scope`` 0, or a library such as Open MPI's that has allowed it).
``probe`` tries it between every pair of ranks once (a read and a write),
collectively; where it fails the algorithm is not offered.

Its cost is the kernel's: it pins the peer's pages for every call, so a buffer
on huge pages (numpy asks for them from 4 MiB) reads faster than one on 4 KiB
pages.  A peer's ``x`` in the window's shared memory (``ShmAllreduce.empty``,
on 4 KiB pages) is not read through the kernel: every rank publishes where
its ``x`` lies, as the window's own loops do, and the compiled loop folds a
shared operand straight from its mapping here.  It is a tuner candidate
("cma", ``CMA_FROM``), not a fixed choice.
"""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

from .._dtypes import scale_inplace
from ..kernels.layout import FLAG_STRIDE, OPCODES
from ..safety.deadline import CollectiveTimeout, abandon
from .base import Algorithm, pack_segments
from .shm import _ufunc, cuts

__all__ = ["Cma", "CmaAllreduce", "CMA_FROM", "CMA_GATHER_FROM", "PIECE_BYTES", "PIECE_BYTES_WIDE", "piece_for",
           "probe", "probe_pids"]

#: Bytes of my block folded per read of a peer's input with 2 ranks: what a rank reads and folds stays in its L2
#: (bench/results/constants.md, PIECE_BYTES).
PIECE_BYTES = 512 << 10

#: The piece from 3 ranks (``piece_for``): a piece then touches up to five arrays (the fold, up to three peers'
#: operands, my ``x``) where 2 ranks touch two, so the same cache holds a smaller one (bench/results/constants.md,
#: PIECE_BYTES_WIDE).
PIECE_BYTES_WIDE = 256 << 10


def piece_for(p: int) -> int:
    """Bytes per piece of a ``p``-rank call: ``PIECE_BYTES`` with 2 ranks, ``PIECE_BYTES_WIDE`` from 3."""
    return PIECE_BYTES if p <= 2 else PIECE_BYTES_WIDE


#: From this many bytes a call pushes: each rank writes every piece it has folded into its peers' ``out`` right
#: away (``process_vm_writev``, the piece still in its cache), and the allgather reads nothing.  Pushing was mostly
#: the faster from 32 KiB, where the tuner offers this algorithm at all (bench/results/constants.md, PUSH_FROM).
PUSH_FROM = 32 << 10


def _libc(name):
    """``ssize_t name(pid, local iovec *, n, remote iovec *, n, flags)`` (``process_vm_readv`` /
    ``process_vm_writev``: Linux 3.2, glibc 2.15), the pointers as int64 addresses, or None where the C
    library lacks it: for the probe and the Python loop (the compiled loop calls the same symbols itself,
    ``ddlkernels.kernels.cma_loops._readv`` / ``_writev``)."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint64]
    fn.restype = ctypes.c_int64
    return fn


readv, writev = _libc("process_vm_readv"), _libc("process_vm_writev")


#: What every rank of a call raises when a read or write failed on any (the compiled loop and the Python one
#: alike).
READ_FAILED = ("cma {}: process_vm_readv or process_vm_writev failed on some rank (a peer's buffer "
               "unmapped, or ptrace permission withdrawn); the output is garbage on every rank")


def _vm(fn, pid, local, remote, nbytes):
    if nbytes == 0:
        return True
    iov = (ctypes.c_int64 * 4)(local, nbytes, remote, nbytes)
    return fn(pid, ctypes.addressof(iov), 1, ctypes.addressof(iov) + 16, 1, 0) == nbytes


def read_into(pid: int, dst: np.ndarray, src_addr: int) -> bool:
    """``dst[:]`` = the ``dst.nbytes`` bytes at ``src_addr`` in process ``pid``; True when all arrived."""
    return _vm(readv, pid, dst.ctypes.data, src_addr, dst.nbytes)


def write_from(pid: int, src: np.ndarray, dst_addr: int) -> bool:
    """The ``src.nbytes`` bytes at ``dst_addr`` in process ``pid`` = ``src``; True when all arrived."""
    return _vm(writev, pid, src.ctypes.data, dst_addr, src.nbytes)


def probe(comm) -> bool:
    """Whether every rank of ``comm`` can read and write every other's memory with ``process_vm_readv`` and
    ``process_vm_writev`` (collective; ``probe_pids``)."""
    return probe_pids(comm) is not None


def probe_pids(comm):
    """Every rank's process id (an int64 array, by rank) when every rank of ``comm`` can read and write every
    other's memory with ``process_vm_readv`` and ``process_vm_writev``, else None (collective).

    Each rank publishes its process id, the address of a few words only it
    could have written and of an inbox; it reads every peer's words and
    checks them, and writes its own word into every peer's inbox, which each
    checks after a barrier; the ranks then agree (any failure anywhere:
    False everywhere).
    """
    from mpi4py import MPI

    me, p = comm.Get_rank(), comm.Get_size()
    mine = np.array([0x6464_6C6B_0000 + me, os.getpid(), p], dtype=np.int64)
    inbox = np.zeros(p, np.int64)  # word s: what rank s wrote here
    ok = readv is not None and writev is not None and sys.platform.startswith("linux")
    peers = comm.allgather((os.getpid(), mine.ctypes.data, inbox.ctypes.data) if ok else None)
    if ok and all(v is not None for v in peers):
        got = np.zeros(3, np.int64)
        word = np.array([0x6464_6C6B_0000 + me], np.int64)
        for s, (pid, addr, box) in enumerate(peers):
            got[:] = 0
            if s != me and not (read_into(pid, got, addr) and got.tolist() == [0x6464_6C6B_0000 + s, pid, p]
                                and write_from(pid, word, box + 8 * me)):
                ok = False
                break
    else:
        ok = False
    comm.Barrier()  # every write has landed (or failed) before anyone looks at its inbox
    if ok:
        ok = all(inbox[s] == 0x6464_6C6B_0000 + s for s in range(p) if s != me)
    # Nobody's words may go away (the arrays above) before every peer has read and written them: this is also
    # that barrier.
    if not comm.allreduce(int(ok), op=MPI.MIN):
        return None
    return np.array([v[0] for v in peers], dtype=np.int64)


class CmaAllreduce:
    """The allreduce of the module comment, on the flag lines and barriers of a ``ShmAllreduce``'s window.

    ``shm``: the window whose flags and barrier epochs it shares (it uses
    no other part of it), so that its calls and the window's interleave on
    one count of barriers.  The caller has checked ``probe`` on its
    communicator.  ``pids``: every rank's process id, as ``probe_pids``
    returned them; None gathers them here (collective then).
    """

    def __init__(self, shm, piece_bytes: int | None = None, push_from: int = PUSH_FROM, pids=None):
        self.shm = shm
        self.piece_bytes = piece_for(shm.p) if piece_bytes is None else int(piece_bytes)
        self.push_from = int(push_from)
        # Gathered now, not at the first call: a call makes no collective of its own beyond its barriers.
        self._pids = (np.array(shm.comm.allgather(os.getpid()), dtype=np.int64) if pids is None
                      else np.asarray(pids, dtype=np.int64))
        self._fns = {}  # (dtype, n, op) -> f(x, out); ("allgather", dtype, n, bounds) -> f(shard, out)
        self._scratch = {}  # dtype -> (tmp, acc)

    def run(self, src, dst, op, deadline=None) -> None:
        """``dst = op over the ranks of src`` (1-D C-contiguous numpy arrays of one dtype; ``dst`` is ``src``
        or does not overlap it).

        Every rank calls with the same count, dtype and op, where numpy's own
        ufunc computes ``op`` for the dtype (``ddlkernels.algorithms.shm._ufunc``: not
        float16 or bfloat16; "avg" is the caller's sum, then its scale).
        ``deadline``: a ``ddlkernels.safety.deadline.Deadline`` or None; a rank with one
        runs the same steps in Python, polling its barriers, and meets the
        ranks without.  Raises ``RuntimeError`` on every rank when a read or
        write failed on any.
        """
        n = src.shape[0]
        if n == 0:
            return
        if deadline is None:
            self.fn(src.dtype, n, op)(src, dst)
        else:
            self._python(src, dst, op, deadline)

    def fn(self, dtype, n, op):
        """``f(x, out)``: ``run`` without a deadline for ``n`` elements of ``dtype``, every lookup made once
        (cached; for ``Communicator``'s fast path).  Allocates the window's flags on first use (collective)."""
        key = (dtype, n, op)
        hit = self._fns.get(key)
        if hit is not None:
            return hit
        from ..kernels import cma_loops as _cma_loops

        shm = self._ready()
        step = max(1, self.piece_bytes // dtype.itemsize)
        barriers = 3
        tmp, acc = self._buffers(dtype, step)
        pids, me, iov = self._pids, shm.rank, np.zeros(4, np.int64)
        loop = _cma_loops.cma_allreduce[OPCODES[op]]  # compiled per op: only the ops a process uses
        push = n * dtype.itemsize >= self.push_from  # the same on every rank: the same n and dtype

        def f(x, out):
            if shm._flags is None:  # the window was freed since (collective: every rank's same call)
                self._ready()
            if shm._regions:  # where x lies, for peers that map the region (as every call's: no stale word)
                shm._publish(x)
            e = shm._epoch + 1
            shm._epoch += barriers
            if loop(x, out, me, shm._flags, e, shm.spin, step, pids, tmp, acc, iov, push, shm._bases):
                raise RuntimeError(READ_FAILED.format("allreduce"))

        return self._remember(key, f)

    def allgather(self, shard, out, bounds, deadline=None) -> None:
        """``out[bounds[s][0]:bounds[s][1]] = shard of rank s`` for every s (1-D C-contiguous host arrays of
        one dtype, not overlapping; ``bounds`` every rank's (lo, hi) in elements, the same on every rank).

        Each rank reads its peers' shards straight into ``out`` with
        ``process_vm_readv`` (``ddlkernels.kernels.cma_loops.cma_allgather``): one
        copy per byte and two barriers, on the window's flag lines, for any
        dtype (bytes are copied).  ``deadline`` as for ``run``.  Raises
        ``RuntimeError`` on every rank when a read failed on any.
        """
        if out.shape[0] == 0:
            return
        if deadline is None:
            self.gather_fn(out.dtype, out.shape[0], bounds)(shard, out)
        else:
            self._gather_python(shard, out, bounds, deadline)

    def gather_fn(self, dtype, n, bounds):
        """``f(shard, out)``: ``allgather`` without a deadline for ``n`` elements of ``dtype`` (n > 0) placed
        by ``bounds``, every lookup made once (cached; for ``Communicator``'s fast path).  Allocates the
        window's flags on first use (collective)."""
        key = ("allgather", np.dtype(dtype), n, tuple(tuple(b) for b in bounds))
        hit = self._fns.get(key)
        if hit is not None:
            return hit
        from ..kernels import cma_loops as _cma_loops

        shm = self._ready()
        item = np.dtype(dtype).itemsize
        los = np.array([b[0] * item for b in bounds], dtype=np.int64)
        his = np.array([b[1] * item for b in bounds], dtype=np.int64)
        pids, me, iov, loop = self._pids, shm.rank, np.zeros(4, np.int64), _cma_loops.cma_allgather

        def f(shard, out):
            if shm._flags is None:  # the window was freed since (collective: every rank's same call)
                self._ready()
            e = shm._epoch + 1
            shm._epoch += 2
            if loop(shard.view(np.uint8), out.view(np.uint8), me, shm._flags, e, shm.spin, pids, los, his, iov):
                raise RuntimeError(READ_FAILED.format("allgather"))

        return self._remember(key, f)

    def _gather_python(self, shard, out, bounds, deadline):
        """``allgather``'s steps in Python, each barrier polled against ``deadline``: the compiled loop's
        barriers, so that ranks with and without a deadline meet."""
        from ..kernels.cma_loops import X_WORD

        shm = self._ready(deadline)
        p, me = shm.p, shm.rank
        lines = shm._flags.reshape(p, FLAG_STRIDE)
        lines[me, X_WORD] = shard.ctypes.data
        shm._barrier(deadline)
        lo, hi = bounds[me]
        out[lo:hi] = shard
        bad = 0
        for k in range(1, p):
            s = (me + k) % p
            a, b = bounds[s]
            bad += not read_into(int(self._pids[s]), out[a:b], int(lines[s, X_WORD]))
        self._last_barrier(lines, bad, deadline, "allgather")

    def _remember(self, key, f):
        if len(self._fns) >= 256:  # a job with ever new sizes must not grow this without bound
            self._fns.clear()
        self._fns[key] = f
        return f

    def _last_barrier(self, lines, bad, deadline, kind):
        """The Python twin of ``ddlkernels.kernels.cma_loops._last_barrier``: my count of failed reads and writes published, the
        last barrier, and ``RuntimeError`` on every rank when any rank counted one."""
        from ..kernels.cma_loops import BAD_WORD

        lines[self.shm.rank, BAD_WORD] = bad
        self.shm._barrier(deadline)
        if lines[:, BAD_WORD].sum():
            raise RuntimeError(READ_FAILED.format(kind))

    def _ready(self, deadline=None):
        shm = self.shm
        if not shm.allocated:
            shm._allocate(deadline)  # collective: every rank's first call (under its deadline)
        return shm

    def _buffers(self, dtype, step):
        hit = self._scratch.get(dtype)
        if hit is None or hit[1].shape[0] < step:
            # tmp: a row per peer operand of one run of the fold (``ddlkernels.kernels.node_primitives._fold_first``: up to four)
            hit = self._scratch[dtype] = (np.empty((4, step), dtype), np.empty(step, dtype))
        return hit

    def _python(self, x, out, op, deadline):
        """``run``'s steps in Python, each barrier polled against ``deadline`` (``ShmAllreduce._barrier``):
        the same barriers as the compiled loop, so that ranks with and without a deadline meet."""
        from ..kernels.cma_loops import OUT_WORD, X_WORD

        shm = self._ready(deadline)
        p, me, ufunc = shm.p, shm.rank, _ufunc(x.dtype, op)
        step = max(1, self.piece_bytes // x.dtype.itemsize)
        tmp, acc = self._buffers(x.dtype, step)
        lines = shm._flags.reshape(p, FLAG_STRIDE)
        lines[me, X_WORD], lines[me, OUT_WORD] = x.ctypes.data, out.ctypes.data
        if shm._regions:  # for the compiled loops of peers without a deadline (they read shared x in place)
            shm._publish(x)
        shm._barrier(deadline)
        xs, outs = lines[:, X_WORD].tolist(), lines[:, OUT_WORD].tolist()
        item, n, bad = x.itemsize, x.shape[0], 0
        push = x.nbytes >= self.push_from  # as the compiled loop's
        cut = cuts(n, p)
        for a in range(cut[me], cut[me + 1], step):
            b = min(cut[me + 1], a + step)
            r, t = acc[: b - a], tmp[0, : b - a]
            for s in range(p):
                if s == me:
                    operand = x[a:b]
                else:
                    bad += not read_into(int(self._pids[s]), t, xs[s] + a * item)
                    operand = t
                if s == 0:
                    r[...] = operand
                else:
                    ufunc(r, operand, out=r)
            out[a:b] = r
            if push:
                for s in range(p):
                    if s != me:
                        bad += not write_from(int(self._pids[s]), out[a:b], outs[s] + a * item)
        shm._barrier(deadline)
        for s in range(p):
            if s != me and not push:
                bad += not read_into(int(self._pids[s]), out[cut[s] : cut[s + 1]], outs[s] + cut[s] * item)
        self._last_barrier(lines, bad, deadline, "allreduce")


#: "cma" is an allreduce candidate from this size, for numpy's own dtypes and ops: below it the window won
#: everywhere it was measured (bench/results/constants.md, CMA_FROM).
CMA_FROM = 32 << 10
#: An allgather's "cma" is a candidate from this size: below it its system calls lost to MPI's call and the
#: window's (bench/results/constants.md, CMA_GATHER_FROM).
CMA_GATHER_FROM = 64 << 10


class Cma(Algorithm):
    """"cma": the single-copy allreduce and allgather of this module, a tuner candidate where the probe passed
    (one node, the window a candidate too, every pair of ranks able to read each other's memory)."""

    name = "cma"
    kinds = ("allreduce", "allgather")

    def __init__(self, comm, placement, shm):
        super().__init__(comm, placement)
        self.shm = shm  # the "shm" algorithm, whose window's flag lines and barriers this one shares
        self.pids = placement.cma_pids
        self._cma = None

    @classmethod
    def probe(cls, comm, placement):
        return placement.one_node and placement.shm is None and placement.cma_pids is not None

    def serves(self, kind, w):
        if w.be.device:
            return False
        if kind == "allreduce":
            return w.nbytes >= CMA_FROM and _ufunc(w.dtype, w.redop) is not None
        return kind == "allgather" and w.nbytes >= CMA_GATHER_FROM

    def engine(self) -> CmaAllreduce:
        """The single-copy engine on the window of "shm" (created on first use; its calls are collective)."""
        if self._cma is None:
            self._cma = CmaAllreduce(self.shm.window(), pids=self.pids)
        return self._cma

    def allreduce(self, w):
        pack_segments(w)  # peers read one buffer
        try:
            self.engine().run(w.src, w.dst, w.redop, deadline=w.deadline)
        except CollectiveTimeout:
            abandon(w.src, w.dst)  # a late peer still reads x and writes out where they lie, in this process
            raise
        if w.avg:
            scale_inplace(w.dst, self.comm.size)

    def allgather(self, w):
        try:
            self.engine().allgather(w.src, w.dst, w.bounds, deadline=w.deadline)
        except CollectiveTimeout:
            abandon(w.src, w.dst)  # a late peer still reads my shard where it lies, in this process
            raise

    def fast(self, kind, w):
        if not self.shm.ready() or w.count == 0:
            return None
        if kind == "allgather":
            return self.engine().gather_fn(w.dtype, w.count, w.bounds)
        fn = self.engine().fn(w.dtype, w.count, w.redop)
        if not w.avg:
            return fn
        p = self.comm.size

        def run(x, dst):
            fn(x, dst)
            scale_inplace(dst, p)

        return run

    def free(self):
        self._cma = None  # its memory is the window's, freed with "shm"

    def held(self):
        return [] if self._cma is None else [self._cma]
