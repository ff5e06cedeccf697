"""What the CuPy and Numba backends share: kernel selection, argument checks, staging primitives.

A device backend stores bfloat16 as its uint16 bits (neither CuPy nor Numba
has a bfloat16 type); uint16 is not a dtype ddlkernels reduces, so inside a
device backend a uint16 buffer always means bfloat16.  ``dtype(x)`` reports
the user's logical dtype; ``flat``/``empty`` hand out storage buffers and
``like`` turns them back into the user's type.

Streams are part of the contract: every call runs on the *caller's* stream
(torch's current stream for torch tensors, CuPy's current stream for CuPy
arrays, Numba's default stream for Numba arrays, or the ``stream=`` the
caller passed), so that it is ordered after the work that produced its
input and before the work that reads its result.  ``Communicator`` makes
that stream this thread's compute stream for the call (``using``); the
kernels, and the transports' events, use ``compute_stream()``.

Besides the ``Backend`` interface, device backends offer what the staging
transport (``ddlkernels.transport.staged``) and the progress thread need, in the
array library's own terms:

=========================  ====================================================
``stream_of(x, stream)``   the stream a call on ``x`` runs on (see above)
``using(stream, device)``  context: ``stream`` on ``device`` is this thread's
                           compute stream (and the library's current stream)
``compute_stream()``       this thread's compute stream (the caller's)
``new_stream(device)``     a stream for copies (does not serialize with compute)
``full(n, dtype, value)``  a new buffer of ``n`` copies of ``value`` (its exact bits,
                           -0 included), written on the compute stream
``scale(dst, p)``          "avg"'s last step on a sum in ``dst``, on the compute stream
``pinned(nbytes)``         page-locked host memory, as a numpy uint8 array
``d2h(host, dev, s)``      async copy device -> host (same byte length) on stream s
``h2d(dev, host, s)``      async copy host -> device on stream s
``record(s)``              an event recorded on stream s
``wait(s, ev)``            make stream s wait for event ev (no host block)
``sync(ev)``               block the host until ev has happened
``sync_stream(s)``         block the host until the work queued on s has run
``query(ev)``              whether ev has happened (no block)
``idle(s)``                whether the work queued on s has all run (no block,
                           nothing queued; False where the backend cannot tell)
``graph_capture(s)``       why work queued on s would be recorded into a CUDA
                           graph rather than run (s captures), or None
=========================  ====================================================

A backend whose ``ipc`` is True also offers CUDA IPC between the processes
of a node (``ddlkernels.algorithms.ipc``):

=============================  ================================================
``ipc_export(buf)``            (handle, byte offset) of the allocation holding
                               ``buf``, or None where CUDA IPC cannot export it
``ipc_open(handle)``           a peer's allocation mapped here (open once each)
``ipc_view(m, off, n, dtype)`` a device array of ``n`` elements at ``off`` in it
``ipc_close(m)``               unmap it
``ipc_alloc(nbytes)``          a uint8 device buffer ``ipc_export`` accepts
``ipc_event()``                (event, handle): an interprocess event
``ipc_open_event(handle)``     a peer's event, for ``wait``
``record_on(s, ev)``           record the existing event ``ev`` on stream s
``gpu_ident()``                bytes naming the current device's GPU, alike in
                               every process that drives it (its PCI bus id)
=============================  ================================================

and ``pack(tensors, buf, offsets)`` / ``unpack(buf, tensors, offsets)``:
copy a list of flat device buffers into one fusion buffer and back, in one
kernel launch (offsets in bytes; ``pack_offsets`` computes 16-byte aligned
ones so every tensor takes the 128-bit path of kernels/pack.cu).  Both
backends hand their kernel the table of ``pack_pieces``: every tensor cut into
pieces of at most 64 KiB, one block each, by device address, so a long tensor
spreads over the whole GPU instead of the few blocks a launch per tensor would
give it (the Numba kernels read it in words of the widest size that fits).
"""

from __future__ import annotations

import abc
import bisect
import collections
import contextlib
import functools
import threading

import numpy as np

from .._dtypes import BFLOAT16
from ..kernels.numba_cuda import ARG_TYPES, suffix_of
from . import Backend

__all__ = ["DeviceBackend", "negative_zero", "storage_dtype", "pack_offsets", "pack_layout", "pack_pieces",
           "PIECE_BYTES"]

#: ``graph_capture``'s answer by CUDA's capture status of a stream (cudaStreamCaptureStatus: 0 none, 1 active,
#: 2 invalidated), and where the query itself fails
CAPTURE_STATUS = {1: "the stream is capturing a CUDA graph", 2: "the stream's CUDA graph capture was invalidated"}
CAPTURE_ELSEWHERE = "the stream cannot be used while another stream captures a CUDA graph ({})"

_REDUCE_OPS = ("sum", "prod", "max", "min")
_TABLES = 64  # pack tables kept per backend, one per (stream, tensors, offsets)


def storage_dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    return np.dtype(np.uint16) if BFLOAT16 is not None and dt == BFLOAT16 else dt


def negative_zero(dtype):
    """-0 of a device backend's storage ``dtype`` (uint16 there holds bfloat16's bits), 0 for integers."""
    dt = np.dtype(dtype)
    if dt == np.uint16:
        return np.uint16(0x8000)
    return dt.type(-0.0) if dt.kind == "f" else dt.type(0)


def _fold_kind(ptr, at, srcs, outs) -> str:
    """The fold kernel for operands ``srcs`` into the output at address ``at`` and ``outs`` (``ptr``: an array's
    address): "fold_realign" where some operand lies at another offset modulo 16 than every output (a view one
    element in, folded into fresh outputs: its words cut from aligned loads), else "fold" (128-bit words where
    every pointer shares the offset, one element at a time where not)."""
    o = at & 15
    if all(ptr(x) & 15 == o for x in srcs) or any(ptr(e) & 15 != o for e in outs):
        return "fold"
    return "fold_realign"


def _disjoint(spans) -> bool:
    """Whether the byte ranges ``[lo, hi)`` of ``spans`` (sorted, none empty) overlap nowhere."""
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def _against(outs, spans):
    """For each of ``spans``: (whether it starts where one of ``outs`` does, whether it overlaps any of them);
    ``outs`` sorted and disjoint (so their ends are sorted too), no range empty: where any of them overlaps
    ``[lo, hi)``, the last to start before ``hi`` does."""
    starts = [lo for lo, _ in outs]
    begun = set(starts)
    exact, touch = [], []
    for lo, hi in spans:
        k = bisect.bisect_left(starts, hi) - 1
        exact.append(lo in begun)
        touch.append(k >= 0 and outs[k][1] > lo)
    return exact, touch


def pack_offsets(nbytes, align: int = 16) -> tuple[list[int], int]:
    """Byte offsets of tensors of ``nbytes`` bytes packed at ``align``-byte boundaries, and the total.

    Each offset is the sum of the sizes before it, each rounded up to ``align``: e.g. 5, 20 and 3 bytes at 16
    give offsets 0, 16 and 48, total 51."""
    n = np.asarray(nbytes, dtype=np.int64).reshape(-1)
    if not n.shape[0]:
        return [], 0
    offs = np.zeros_like(n)
    np.cumsum(-(-n[:-1] // align) * align, out=offs[1:])
    return offs.tolist(), int(offs[-1] + n[-1])


@functools.lru_cache(maxsize=64)
def _packed(sizes: tuple) -> tuple[tuple, int]:
    """``pack_offsets(sizes)``, remembered: a training loop packs buckets of the same sizes every step."""
    offs, total = pack_offsets(sizes)
    return tuple(offs), total


def pack_layout(tensors, buf, offsets):
    """(byte sizes, byte offsets), tuples, of a pack or unpack of flat ``tensors`` in ``buf`` (``offsets``
    None: ``pack_offsets``'); ``ValueError`` where a tensor does not fit ``buf``."""
    sizes = tuple([t.nbytes for t in tensors])
    nbuf = buf.nbytes
    if offsets is None:
        offsets, total = _packed(sizes)
        if total > nbuf:  # the offsets grow with the sizes: the last tensor ends last
            raise ValueError(f"tensors of {total} bytes packed do not fit a {nbuf}-byte buffer")
        return sizes, offsets
    if len(offsets) != len(sizes):
        raise ValueError(f"{len(offsets)} offsets for {len(sizes)} tensors")
    for n, o in zip(sizes, offsets):
        if o < 0 or o + n > nbuf:
            raise ValueError(f"tensor of {n} bytes at offset {o} does not fit a {nbuf}-byte buffer")
    return sizes, tuple(offsets)


#: the most bytes one entry of a pack table (one block of kernels/pack.cu) copies: 256 threads
#: move it in 16 steps of 128-bit words; 64 MiB of tensors make 1024 entries.
PIECE_BYTES = 1 << 16


def pack_pieces(ptrs, nbytes, offsets, piece: int = PIECE_BYTES) -> np.ndarray:
    """The table of kernels/pack.cu (rows of address, length, byte offset in the buffer; uint64) for tensors
    at device addresses ``ptrs`` of ``nbytes`` bytes at ``offsets`` of the buffer, each cut into pieces of
    at most ``piece`` bytes.  ``piece`` is a multiple of 16, so a piece keeps its tensor's address and
    offset modulo 16 (the kernel's 128-bit path); empty tensors have no row.

    Example, piece 64 KiB: a 100 KiB tensor at 0x7f00_0000 packed at offset 4096 gives rows
    (0x7f00_0000, 65536, 4096) and (0x7f01_0000, 36864, 69632)."""
    if piece <= 0 or piece % 16:
        raise ValueError(f"piece must be a positive multiple of 16, got {piece}")
    ptrs, n, off = (np.asarray(v, dtype=np.int64).reshape(-1) for v in (ptrs, nbytes, offsets))
    counts = -(-n // piece)  # 0 for an empty tensor
    which = np.repeat(np.arange(n.shape[0]), counts)
    start = (np.arange(which.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)) * piece
    table = np.empty((which.shape[0], 3), dtype=np.int64)
    table[:, 0] = ptrs[which] + start
    table[:, 1] = np.minimum(n[which] - start, piece)
    table[:, 2] = off[which] + start
    return table.view(np.uint64)


_NO_ARG = {suf: argt(0) for suf, argt in ARG_TYPES.items()}  # what the kernels that do not scale are passed


def _kernel_op(op, suf, avg_p):
    """(the kernel's op name, its last argument) for ``op`` on storage suffix ``suf``; with ``avg_p`` "avg"
    and 1/p in the accumulation type (ARG_TYPES: the numpy backend's acc_dtype(dtype).type(1.0 / p), bit for
    bit), p itself for integers."""
    if avg_p is None:
        return op, _NO_ARG[suf]
    argt = ARG_TYPES[suf]
    p = int(avg_p)
    if p < 1:
        raise ValueError(f"avg_p must be >= 1, got {avg_p!r}")
    return "avg", argt(p) if suf.startswith("i") else argt(1.0 / p)


class DeviceBackend(Backend):
    device = True
    ipc = False  # the CUDA IPC methods of the module comment

    def __init__(self):
        # The compute stream is per thread: the progress thread of ddlkernels.asynchronous runs calls on a
        # stream of its own while the caller's thread runs others on the caller's stream.
        self._tls = threading.local()
        self._tables = collections.OrderedDict()  # pack tables, least recently used first (_pack_table)

    # -- streams ----------------------------------------------------------------------
    @abc.abstractmethod
    def stream_of(self, x, stream=None):
        """The stream a call on array ``x`` runs on: ``stream`` (this library's stream, a torch
        ``cuda.Stream``, or a raw ``cudaStream_t`` as int) when given, else the caller's current stream
        for ``x``'s library (see the module docstring)."""

    def call_stream(self, x, stream=None):
        """The stream of a call on ``x``: ``stream`` when given; inside a ``using`` block (a call made by
        another call of this library, or the progress thread's) that block's stream; else ``stream_of(x)``."""
        if stream is None:
            s = getattr(self._tls, "stream", None)
            if s is not None:
                return s
        return self.stream_of(x, stream)

    @abc.abstractmethod
    def default_stream(self):
        """The compute stream of a thread outside any ``using`` block."""

    @contextlib.contextmanager
    def using(self, stream, device=None):
        """Within the block, ``stream`` (on ``device``, an ordinal or None for the current one) is this
        thread's compute stream."""
        prev = getattr(self._tls, "stream", None)
        self._tls.stream = stream
        try:
            with self._on_device(device, stream):
                yield stream
        finally:
            self._tls.stream = prev

    def graph_capture(self, stream) -> str | None:
        """Why work queued on ``stream`` now would be recorded into a CUDA graph instead of running (the stream
        captures one, or would break another stream's capture), or None: it runs."""
        return None

    def sync_stream(self, stream) -> None:
        """Block until the work queued on ``stream`` so far has run (a backend may do it without an event)."""
        self.sync(self.record(stream))

    def idle(self, stream) -> bool:
        """Whether every operation queued on ``stream`` so far has run, asked without queueing anything (False
        where this backend cannot tell without an event)."""
        return False

    def compute_stream(self):
        s = getattr(self._tls, "stream", None)
        return self.default_stream() if s is None else s

    def current_device(self) -> int:
        """This thread's current device ordinal (``using`` makes the call's array's device current)."""
        return 0

    @abc.abstractmethod
    def new_stream(self, device=None):
        """A new stream on ``device`` (default: the current one) that does not serialize with others."""

    @abc.abstractmethod
    def full(self, n, dtype, value):
        """A new 1-D buffer of ``n`` copies of ``value`` in ``dtype``'s storage type (bfloat16: its uint16
        bits), bit for bit (-0 stays -0), written on the compute stream."""

    def _on_device(self, device, stream):
        """Context of ``device`` (and of ``stream``, where the library has a current stream of its own)."""
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        """Block until the work queued on this thread's compute stream has finished."""
        self.sync_stream(self.compute_stream())

    def _pack_table(self, stream, ptrs, sizes, offsets, word=1):
        """(``pack_pieces``' table on the device, its longest row), lengths and offsets in ``word``-byte units
        past the address column; int64 (the same bits kernels/pack.cu reads as unsigned: Numba would type
        a sum of uint64 and int64 as a float).  Kept per stream and layout (``_TABLES`` of them): a
        training loop packs the same tensors every step, and pack and unpack of a bucket share one.  Per
        stream because a table uploaded on one stream is ordered before that stream's launches only (and
        CuPy's pool hands an evicted table's memory to the next allocation on that stream only)."""
        key = (self._stream_id(stream), self.current_device(), word, tuple(ptrs), tuple(sizes), tuple(offsets))
        hit = self._tables.get(key)
        if hit is not None:
            self._tables.move_to_end(key)
            return hit[0], hit[1]
        host = pack_pieces(ptrs, sizes, offsets).view(np.int64)
        if word > 1:
            host[:, 1:] //= word
        # From pageable memory the copy takes the bytes before it returns; the cache holds them as well.
        table = self._upload(host, stream)
        longest = int(host[:, 1].max())
        self._tables[key] = (table, longest, host)
        if len(self._tables) > _TABLES:
            self._tables.popitem(last=False)
        return table, longest

    # -- subclass hooks ---------------------------------------------------------
    def _stream_id(self, stream) -> int:
        """What names ``stream`` across the library's objects wrapping it (its ``cudaStream_t``)."""
        return int(stream.ptr)

    def _upload(self, host, stream):
        """A device copy of the numpy array ``host``, queued on ``stream`` (for the pack tables)."""
        raise NotImplementedError(f"the {self.name} backend has no pack tables")

    @abc.abstractmethod
    def _ptr(self, buf) -> int:
        """Device address of ``buf``'s first element."""

    @abc.abstractmethod
    def _launch_reduce(self, name: str, dst, a, b, n: int, arg) -> None:
        """Launch reduce kernel ``name`` over ``n`` elements (the CuPy or Numba kernel)."""

    # -- Backend ------------------------------------------------------------------
    def wire(self, buf):
        # MPI has no 16-bit float types: float16 travels as its bits.
        if buf.dtype.itemsize == 2 and buf.dtype != np.uint16 and buf.dtype.kind == "f":
            return buf.view(np.uint16)
        return buf

    def _span(self, buf):
        p = self._ptr(buf)
        return p, p + buf.shape[0] * buf.dtype.itemsize

    def overlaps(self, x, y) -> bool:
        x0, x1 = self._span(x)
        y0, y1 = self._span(y)
        return x0 < y1 and y0 < x1

    def reduce(self, op, dst, a, b=None, *, avg_p=None):
        if b is None:
            a, b = dst, a
        if op not in _REDUCE_OPS:
            raise ValueError(f"reduce op must be one of {_REDUCE_OPS}, got {op!r}")
        if avg_p is not None and op != "sum":
            raise ValueError("avg_p is only defined for the sum")
        n = dst.shape[0]
        if a.shape[0] != n or b.shape[0] != n:
            raise ValueError(f"reduce: lengths differ (dst {n}, a {a.shape[0]}, b {b.shape[0]})")
        if not (dst.dtype == a.dtype == b.dtype):
            raise TypeError(f"reduce: dtypes differ (dst {dst.dtype}, a {a.dtype}, b {b.dtype})")
        suf = suffix_of(dst.dtype)
        if n == 0:
            return
        kop, arg = _kernel_op(op, suf, avg_p)
        # Kernel preconditions: b never overlaps dst; a is dst or disjoint.
        # The engine never breaks them; a caller that does gets a copy.
        # (Each address asked once: three buffers of one byte length.)
        at, pa, pb, size = self._ptr(dst), self._ptr(a), self._ptr(b), n * dst.dtype.itemsize
        if pb < at + size and at < pb + size:
            b = self._dup(b)
            pb = self._ptr(b)
        if pa != at and pa < at + size and at < pa + size:
            a = self._dup(a)
            pa = self._ptr(a)
        # An operand at another offset modulo 16 than dst (a view one element in) goes to the kernel that cuts
        # its 128-bit words from aligned loads: in the other kernel that path cost every call registers.
        kind = "reduce" if (pa - at) & 15 == 0 and (pb - at) & 15 == 0 else "realign"
        self._launch_reduce(f"ddl_{kind}_{kop}_{suf}", dst, a, b, n, arg)

    def scale(self, dst, p) -> None:
        """``dst``, a sum over ``p`` ranks, scaled for "avg" with the bits of the numpy backend's
        ``scale_inplace``: the "avg" kernel's sum with -0 (``x + -0`` is ``x``, -0 included)."""
        self.reduce("sum", dst, dst, self.full(dst.shape[0], dst.dtype, negative_zero(dst.dtype)), avg_p=p)

    def reduce_many(self, op, dst, srcs, *, avg_p=None, also=()):
        """``dst = ((srcs[0] op srcs[1]) op srcs[2]) ...`` ("avg": ``op`` "sum" and ``avg_p``, scaling in the
        last step): the bits of that chain of ``reduce`` calls; each buffer of ``also`` gets the result too.

        An operand may be exactly ``dst`` or exactly a buffer of ``also`` (the in-place IPC allreduce folds
        into the buffers it reads); ``dst`` and ``also``'s buffers do not overlap.  A backend with fold kernels
        (``_launch_fold``: kernels/reduce.cu's ddl_fold, or ddl_fold_realign for operands at other offsets
        modulo 16 than the outputs) reads each operand once and writes ``dst`` and up to 7 of ``also`` once,
        in one launch for up to 8 operands (in groups of 8 onto the partial result beyond), where the chain
        reads and writes the partial result at every step.  Where that cannot
        serve an operand that is (or overlaps) an output (no fold kernels, ``dst`` itself past the first 8
        operands, which the first launch overwrites before a later one reads it, a partial overlap), the
        result is made in a scratch buffer and copied."""
        if len(srcs) < 2:
            raise ValueError(f"reduce_many needs 2 operands or more, got {len(srcs)}")
        if op not in _REDUCE_OPS or (avg_p is not None and op != "sum"):
            raise ValueError(f"reduce_many: op {op!r} with avg_p={avg_p!r}")
        n = dst.shape[0]
        outs = [dst, *also]
        if any(s.shape[0] != n or s.dtype != dst.dtype for s in [*srcs, *also]):
            raise ValueError("reduce_many: every operand and every buffer of also= needs dst's length and dtype")
        if n == 0:
            return
        # Each address asked once and the outputs sorted: O(p log p) host time for p ranks' shards, where
        # comparing every pair took 49-66 us a call at 8 ranks (bench/results/host_costs.txt).  "exact": an
        # operand that starts where an output does is that output (every length is n, checked above).
        outs_at = sorted(map(self._span, outs))
        if not _disjoint(outs_at):
            raise ValueError("reduce_many: dst and the buffers of also= overlap")
        spans = [self._span(x) for x in srcs]
        exact, touch = _against(outs_at, spans)
        launch = getattr(self, "_launch_fold", None)
        # Launches after the first read dst's partial result, so an operand there that is dst would be read
        # overwritten; one that is a buffer of also= is safe (those are written by the last launch and after).
        at = self._ptr(dst)
        direct = launch is not None and exact == touch and not any(lo == at for lo, _ in spans[8:])
        if not direct and any(touch):  # fold into a scratch buffer apart from every operand, then copy
            tmp = self.empty(n, dst.dtype)
            self.reduce_many(op, tmp, srcs, avg_p=avg_p)
            for o in outs:
                self.copy(o, tmp)
            return
        if launch is None:  # the chain itself, then copies
            last = len(srcs) - 1
            self.reduce(op, dst, srcs[0], srcs[1], avg_p=avg_p if last == 1 else None)
            for j in range(2, len(srcs)):
                self.reduce(op, dst, dst, srcs[j], avg_p=avg_p if j == last else None)
            for e in also:
                self.copy(e, dst)
            return
        suf = suffix_of(dst.dtype)
        also = list(also)
        rest = list(srcs)
        group = [rest.pop(0)]
        while rest:
            group += [rest.pop(0) for _ in range(min(8 - len(group), len(rest)))]
            kop, arg = _kernel_op(op, suf, None if rest else avg_p)  # "avg" scales in the last launch only
            extra = [] if rest else also[:7]
            launch(f"ddl_{_fold_kind(self._ptr, at, group, extra)}_{kop}_{suf}", dst, group, n, arg, extra)
            group = [dst]  # the next 7 operands fold onto the partial result
        for e in also[7:]:
            self.copy(e, dst)

    def _dup(self, x):
        y = self.empty(x.shape[0], x.dtype)
        self.copy(y, x)
        return y
