"""Tensor fusion: many tensors reduced with one collective per fusion buffer.

Worked example: four gradients, ``fusion_bytes=96``::

    input   a: float32[3]   b: float16[5]   c: float32[20]   d: float32[2]
    groups  float32: a, c, d      float16: b          (by dtype, in input order)
    offsets every tensor starts on a 16-byte boundary of its buffer (host: gaps zeroed)
    buckets float32 #0: a @0 [pad 1], c @4   24 elements = 96 B
                        (adding d would make 26 elements = 104 B > 96 B, so d starts
                        the next bucket; a tensor is never split)
            float32 #1: d @0                  2 elements   (alone: reduced in place, no copy)
            float16 #2: b @0                  5 elements   (alone)
    per bucket: pack (copy each tensor into the buffer), one allreduce of the
    buffer, unpack (copy each slice back to its output); results in input order.

A bucket holding one contiguous tensor skips the copies: the tensor is reduced
straight into its output, exactly as ``allreduce`` would.  The 16-byte
alignment keeps the GPU pack kernel (kernels/pack.cu) on its 128-bit path; the
host uses the same layout so that every rank computes the same buckets
whatever its device.

Equality with per-tensor ``allreduce``: integers, max and min give the same
bits whatever the buffer layout.  A float sum over 3 or more ranks may differ
in the last place, because the ring's order of additions for an element
depends on where the element lies in the buffer; every rank still gets the
same bits as every other rank.  When every partial sum is exact (the test
data of tests/mpi/test_fusion.py) the results are bitwise equal.

Every check that a rank can make alone (types, devices, ``out``) runs before
any communication; one 16-byte allreduce then compares a digest of the tensor
list across ranks, so different lists on different ranks raise on every rank
instead of mismatching collectives.
"""

from __future__ import annotations

import functools
import math
import sys

import numpy as np

from .collectives.allreduce import allreduce_segments
from .collectives.arguments import backend_input_numpy
from .communicator import as_communicator
from ._dtypes import check_dtype, dtype_name, normalize_op
from .ring.segments import Segments
from .backends import backend_for
from .safety.agreement import check_same_on_all_ranks

__all__ = ["allreduce_many", "FUSION_BYTES", "FusionJob"]

#: Default fusion buffer size in bytes: Horovod's default threshold (64 MiB).
#: Buckets are reduced one after the other, so this is also the staging memory
#: one ``allreduce_many`` call keeps per dtype.
FUSION_BYTES = 64 << 20
#: Byte alignment of every tensor inside a fusion buffer (see module docstring).
ALIGN_BYTES = 16
#: Host tensors of at least this many bytes are reduced where they lie, not
#: packed (FusionJob.segments); copying a smaller one costs less than the
#: extra numpy calls of reading it in place.
DIRECT_BYTES = 64 << 10


def device_label(x) -> str:
    """Where ``x`` lives, as a string that is equal for tensors on the same device ("cpu", "cuda:1", "meta")."""
    if isinstance(x, np.ndarray):
        return "cpu"
    if type(x).__module__.startswith("torch"):
        dev = x.device
        return "cpu" if dev.type == "cpu" else str(dev)
    be = backend_for(x)
    return "cpu" if not be.device else f"cuda:{be.device_id(x)}"


class Entry:
    """One tensor's place in a bucket: input index, element count, shape, element offset."""

    __slots__ = ("index", "count", "shape", "offset")

    def __init__(self, index, count, shape, offset):
        self.index, self.count, self.shape, self.offset = index, count, shape, offset


class Bucket:
    """Tensors of one dtype reduced together; ``count`` elements including alignment padding."""

    __slots__ = ("dtype", "entries", "count", "direct", "home")

    def __init__(self, dtype):
        self.dtype = dtype
        self.entries: tuple = ()
        self.count = 0
        #: True when the bucket is one contiguous tensor reduced without packing.
        self.direct = False
        #: For new outputs (``out=None``): the fresh buffer the outputs are views
        #: of, reduced in place, so nothing is copied back.
        self.home = None


def plan_buckets(shapes_dtypes, fusion_bytes: int) -> list[Bucket]:
    """Cut tensors ``[(shape, dtype), ...]`` into buckets of at most ``fusion_bytes`` (a larger tensor alone).

    Pure function of its arguments, so every rank that passes the same list
    gets the same buckets.  Tensors of one dtype keep their input order;
    dtype groups come in order of first appearance; empty tensors go nowhere.
    The layout is cached by the list (a training loop passes the same one
    every step); the returned buckets are new, so per-call state never leaks.
    """
    layout = _layout(tuple((tuple(shape), dt) for shape, dt in shapes_dtypes), int(fusion_bytes))
    buckets = []
    for dt, entries, count in layout:
        b = Bucket(dt)
        b.entries, b.count = entries, count
        buckets.append(b)
    return buckets


@functools.lru_cache(maxsize=64)
def _layout(shapes_dtypes: tuple, fusion_bytes: int) -> tuple:
    """``plan_buckets``' layout: ``((dtype, entries, count), ...)``; entries are shared, never modified."""
    groups: dict = {}
    for i, (shape, dt) in enumerate(shapes_dtypes):
        count = math.prod(shape)
        if count:
            groups.setdefault(dt, []).append((i, count, shape))
    layout = []
    for dt, items in groups.items():
        align = max(1, ALIGN_BYTES // dt.itemsize)
        cur = None
        for i, count, shape in items:
            padded = -(-count // align) * align
            if cur is None or (cur[2] + padded) * dt.itemsize > fusion_bytes:
                cur = [dt, [], 0]
                layout.append(cur)
            cur[1].append(Entry(i, count, shape, cur[2]))
            cur[2] += padded
    # No padding after the last tensor of a bucket.
    return tuple((dt, tuple(entries), entries[-1].offset + entries[-1].count) for dt, entries, _ in layout)


class FusionJob:
    """A checked ``allreduce_many`` call: tensors, outputs, buckets; pack and unpack.

    Built in the calling thread; everything here is local (no communication).
    ``allreduce_many`` and the asynchronous handles of ``ddlkernels.asynchronous``
    both run one.
    """

    def __init__(self, tensors, op="sum", *, out=None, fusion_bytes=None, what="allreduce_many"):
        if isinstance(tensors, (str, bytes)) or not hasattr(tensors, "__iter__"):
            raise TypeError(f"{what}: tensors must be a list of arrays, got {type(tensors).__name__}")
        tensors = list(tensors)
        self.what = what
        self.opname = normalize_op(op)
        self.fusion_bytes = FUSION_BYTES if fusion_bytes is None else _positive("fusion_bytes", fusion_bytes)
        self.tensors = tensors
        self.backend = None
        self.device = None
        shapes_dtypes = []
        checked: dict = {}  # dtype -> checked dtype: one check per dtype, not per tensor
        for i, t in enumerate(tensors):
            if type(t) is np.ndarray and self.device in (None, "cpu"):
                # The common case, without walking the backend registry.
                if self.backend is None:
                    self.device, self.backend = "cpu", backend_for(t)
                dt = checked.get(t.dtype)
                if dt is None:
                    try:
                        dt = checked[t.dtype] = check_dtype(t.dtype)
                    except TypeError as exc:
                        raise TypeError(f"{what}: tensor {i}: {exc}") from None
                shapes_dtypes.append((t.shape, dt))
                continue
            try:
                dev = device_label(t)
            except TypeError as exc:
                raise TypeError(f"{what}: tensor {i}: {exc}") from None
            if self.device is None:
                self.device = dev
            elif dev != self.device:
                first = next(j for j, u in enumerate(tensors) if device_label(u) == self.device)
                raise ValueError(
                    f"{what}: all tensors of one call must be on one device, but tensor {first} is on "
                    f"{self.device} and tensor {i} on {dev}; reduce each device's tensors in its own call"
                )
            try:
                be = backend_for(t)
                dt = check_dtype(be.dtype(t))
            except TypeError as exc:
                raise TypeError(f"{what}: tensor {i}: {exc}") from None
            if self.backend is None:
                self.backend = be
            elif be is not self.backend and (be.device or self.backend.device):
                raise TypeError(f"{what}: tensor {i} is a {be.name} array but tensor 0 a {self.backend.name} array")
            shapes_dtypes.append((tuple(int(s) for s in t.shape), dt))
        self.shapes_dtypes = shapes_dtypes
        self.buckets = plan_buckets(shapes_dtypes, self.fusion_bytes)
        #: the outputs; None until ``make_outputs`` where they are new device arrays
        self.outs = self._outputs(out)
        for b in self.buckets:
            if len(b.entries) == 1:
                e = b.entries[0]
                b.direct = self._flat_or_none(self.tensors[e.index]) is not None and (
                    self.outs is None or self._flat_or_none(self.outs[e.index]) is not None
                )

    def make_outputs(self) -> None:
        """New device outputs, made on the stream the call writes them on (the caller enters it first): a pool
        hands out memory per stream, so a block another stream's pending work still uses is never among them
        (made on the caller's current stream, a block freed there with work still queued was reused, and that
        late work overwrote the result written on ``stream=``)."""
        if self.outs is None:
            self.outs = self._new_outputs()

    # -- local checks ------------------------------------------------------------
    def _outputs(self, out):
        be = self.backend
        if out is None:
            return None if be is not None and be.device else self._new_outputs()
        if isinstance(out, (str, bytes)) or not hasattr(out, "__iter__"):
            raise TypeError(f"{self.what}: out must be a list of arrays like tensors")
        out = list(out)
        if len(out) != len(self.tensors):
            raise ValueError(f"{self.what}: out holds {len(out)} arrays but tensors holds {len(self.tensors)}")
        for i, (o, t, (shape, dt)) in enumerate(zip(out, self.tensors, self.shapes_dtypes)):
            if o is t:
                continue
            try:
                odev = device_label(o)
                odt = backend_for(o).dtype(o)
            except TypeError as exc:
                raise TypeError(f"{self.what}: out[{i}]: {exc}") from None
            if odev != self.device:
                raise ValueError(f"{self.what}: out[{i}] is on {odev} but the tensors on {self.device}")
            if np.dtype(odt) != dt:
                raise TypeError(f"{self.what}: out[{i}] has dtype {dtype_name(odt)} but tensor {i} has {dtype_name(dt)}")
            if tuple(int(s) for s in o.shape) != shape:
                raise ValueError(f"{self.what}: out[{i}] has shape {tuple(o.shape)} but tensor {i} has {shape}")
            if _shares_memory(o, t):
                raise ValueError(f"{self.what}: out[{i}] overlaps tensor {i}; pass the tensor itself for in place")
        return out

    def _new_outputs(self):
        be = self.backend
        # Tensors packed together get their results as views of one new
        # buffer per bucket: packing copies into it, the reduction runs in
        # place, and no copy back is needed.
        # (Host only for now: the device path keeps pack -> reduce ->
        # unpack kernels, which tests/mpi/test_device_allreduce.py checks.)
        outs = [None] * len(self.tensors)
        for b in self.buckets:
            if len(b.entries) > 1 and not be.device:
                b.home = _home_buffer(be, b.dtype, b.count)
                for e in b.entries:
                    t = self.tensors[e.index]
                    view = b.home[e.offset : e.offset + e.count]
                    outs[e.index] = view.reshape(e.shape) if type(t) is np.ndarray else be.like(view, t)
        return [
            o if o is not None else be.like(be.empty(_count(shape), dt), t)
            for o, t, (shape, dt) in zip(outs, self.tensors, self.shapes_dtypes)
        ]

    def _flat_or_none(self, x):
        try:
            return self.backend.flat(x)
        except ValueError:
            if self.backend.device:
                raise ValueError(
                    f"{self.what}: device tensors must be C-contiguous; call .contiguous() (CuPy: .copy()) first"
                ) from None
            return None

    # -- cross-rank agreement ------------------------------------------------------
    def signature(self) -> list:
        """What must be equal on every rank: the op, the fusion size and each tensor's dtype and shape."""
        names = {d: dtype_name(d) for d in {d for _, d in self.shapes_dtypes}}  # one lookup per dtype
        return [self.what, self.opname, self.fusion_bytes] + [(names[d], s) for s, d in self.shapes_dtypes]

    # -- data movement (the caller's thread or the progress thread) ----------------
    def pack(self, bucket: Bucket, buf) -> None:
        """Copy the bucket's tensors into ``buf`` (see ``pack_into``)."""
        pack_into(self.backend, bucket, buf, self.tensors)

    def unpack(self, bucket: Bucket, buf) -> None:
        """Copy each tensor's reduced slice of ``buf`` to its output (see ``unpack_from``)."""
        unpack_from(self.backend, bucket, buf, self.outs)

    def reduce_bucket(self, comm, bucket: Bucket, buf, chunk_bytes=None) -> None:
        """Reduce one bucket over ``comm`` (a Communicator): directly, or packed in ``buf``."""
        be = self.backend
        if bucket.direct:
            e = bucket.entries[0]
            comm.allreduce(self.tensors[e.index], self.opname, out=self.outs[e.index], chunk_bytes=chunk_bytes,
                           backend=be.name)
            return
        if bucket.home is not None:
            buf = bucket.home
        segs = None if be.device else self.segments(bucket, buf)
        if segs is None:
            self.pack(bucket, buf)
            reduce_packed(comm, be, buf, bucket.dtype, self.opname, chunk_bytes)
        else:
            # The ring reads large tensors where they lie instead of a packed
            # copy: of the pack's full copy only the first block sent remains
            # (ddlkernels.ring.engine, Segments).  The gain is small, as the
            # reduce-scatter's add then runs out of place (bench/results/constants.md,
            # the ring on segments).
            allreduce_segments(comm, segs, buf, self.opname, chunk_bytes=chunk_bytes)
        if bucket.home is None:
            self.unpack(bucket, buf)

    def segments(self, bucket: Bucket, buf):
        """The bucket as a ``Segments`` for ``allreduce_segments`` into ``buf``, or None (a dtype differs).

        Contiguous tensors of at least ``DIRECT_BYTES`` are parts as they lie.
        Runs of smaller or strided ones are packed into ``buf`` at their own
        offsets and the run is one part, a view of ``buf``: the ring then
        reduces that range in place, and a numpy call per small tensor (a
        microsecond or two each) is not paid twice per reduction step.
        """
        parts = []
        run = []  # (entry, array) of the small tensors now being collected for one packed run
        itemsize = bucket.dtype.itemsize
        for e in bucket.entries:
            t = self.tensors[e.index]
            a = t if type(t) is np.ndarray else backend_input_numpy(t)
            if a.dtype != bucket.dtype:
                return None
            if e.count * itemsize >= DIRECT_BYTES and a.flags.c_contiguous:
                if run:
                    parts.append(_pack_run(buf, run))
                    run = []
                parts.append((e.offset, a.reshape(-1)))
            else:
                run.append((e, a))
        if run:
            parts.append(_pack_run(buf, run))
        return Segments(bucket.count, bucket.dtype, parts)


_ZEROS = np.zeros(ALIGN_BYTES, np.uint8)


def _pack_run(buf, run):
    """Pack ``[(entry, host array), ...]`` into ``buf`` at their offsets, gaps zeroed; ``(start, view of buf)``.

    One ``np.concatenate`` of the arrays and zero pads, at least as fast as a
    slice assignment per tensor (bench/results/constants.md, _pack_run).  The
    entries are consecutive in their bucket, so every gap is alignment
    padding, shorter than ``ALIGN_BYTES``.
    """
    start = pos = run[0][0].offset
    seq = []
    itemsize = buf.dtype.itemsize
    for e, a in run:
        if e.offset > pos:
            seq.append(_ZEROS[: (e.offset - pos) * itemsize].view(buf.dtype))
        seq.append(a)
        pos = e.offset + e.count
    view = buf[start:pos]
    np.concatenate(seq, axis=None, out=view)
    return start, view


def pack_into(be, bucket: Bucket, buf, tensors) -> None:
    """Copy ``tensors[e.index]`` of each entry into ``buf`` (``bucket.count`` elements) at its offset.

    Host: any strides, gaps zeroed.  Device: contiguous tensors, one launch of
    the backend's pack kernel when it has one, else one copy per tensor.
    """
    if be.device:
        # The gaps are not zeroed on a device (the Backend interface has no
        # fill): they are reduced along with the data and never unpacked.
        flats = [be.flat(tensors[e.index]) for e in bucket.entries]
        pack = getattr(be, "pack", None)
        if callable(pack):  # one kernel launch for the whole bucket (kernels/pack.cu)
            pack(flats, buf, [e.offset * bucket.dtype.itemsize for e in bucket.entries])
        else:
            for f, e in zip(flats, bucket.entries):
                be.copy(buf[e.offset : e.offset + e.count], f)
        return
    # A bucket ends with its last tensor (plan_buckets), so the run covers it all.
    _pack_run(buf, [(e, backend_input_numpy(tensors[e.index])) for e in bucket.entries])


def unpack_from(be, bucket: Bucket, buf, outs) -> None:
    """Copy each entry's slice of ``buf`` into ``outs[e.index]`` (host: any strides; device: contiguous)."""
    if be.device:
        flats = [be.flat(outs[e.index]) for e in bucket.entries]
        unpack = getattr(be, "unpack", None)
        if callable(unpack):
            unpack(buf, flats, [e.offset * bucket.dtype.itemsize for e in bucket.entries])
        else:
            for f, e in zip(flats, bucket.entries):
                be.copy(f, buf[e.offset : e.offset + e.count])
        return
    for e in bucket.entries:
        o = outs[e.index]
        if type(o) is np.ndarray and o.flags.c_contiguous:
            o.ravel()[...] = buf[e.offset : e.offset + e.count]  # ravel of a contiguous array is a view
        else:
            np.copyto(backend_input_numpy(o), buf[e.offset : e.offset + e.count].reshape(e.shape))


def allreduce_many(tensors, op="sum", *, comm=None, out=None, fusion_bytes=None, chunk_bytes=None, stream=None):
    """Allreduce a list of arrays with one collective per fusion buffer; results in input order.

    tensors       numpy arrays, CPU torch tensors, or device arrays of one GPU
                  backend (CuPy, Numba, CUDA torch), all on one device; any mix
                  of dtypes (each dtype gets its own buffers) and shapes.
    op            "sum", "avg", "max", "min", "prod" or an ``MPI.Op``, as for ``allreduce``.
    comm          mpi4py ``Intracomm`` or ``ddlkernels.Communicator`` (default COMM_WORLD).
    out           list of outputs like ``tensors``; ``out=tensors`` reduces in place.
                  Default: new arrays of each input's type, shape and device (the
                  results of tensors packed together are views of one new buffer).
    fusion_bytes  largest fusion buffer in bytes (default ``FUSION_BYTES`` = 64 MiB);
                  a tensor larger than this is reduced on its own, without a copy.
    chunk_bytes   pipeline chunk of the ring, as for ``allreduce``.
    stream        device tensors: the stream the packs, reductions and unpacks are
                  ordered on, as for ``allreduce`` (default the caller's current one);
                  new outputs are allocated on it (CuPy's and torch's pools hand out memory per stream).

    Collective: every rank must pass the same number of tensors with the same
    dtypes and shapes, in the same order; a rank that does not makes every rank
    raise ``ValueError``.  With ``out`` given, the pack buffers are kept by the
    Communicator and reused by the next call.  Returns the list of outputs.
    """
    job = FusionJob(tensors, op, out=out, fusion_bytes=fusion_bytes)
    c = as_communicator(comm)
    if chunk_bytes is not None:
        _positive("chunk_bytes", chunk_bytes)
    if job.backend is None:  # no tensors: only the agreement
        if stream is not None:
            raise ValueError("stream= orders device work; this call has no arrays")
        with c._exclusive("allreduce_many"):
            check_same_on_all_ranks(c, job.signature(), "allreduce_many")  # through c: under its timeout
        return job.outs
    scope = c._device_call(job.backend, job.tensors[0], stream)  # checks stream= before any communication
    need: dict = {}  # largest packed bucket per dtype: the reusable buffer is sized once
    for b in job.buckets:
        if not b.direct and b.home is None:
            need[b.dtype] = max(need.get(b.dtype, 0), b.count)
    with c._exclusive("allreduce_many"):  # its collectives in a row, no other thread's between them
        # Device: the packs, reductions and unpacks on the caller's stream, after the last call of this
        # Communicator, whose fusion buffers these are (ddlkernels.collectives.streams).
        with scope:
            # Everything allocated first: a rank that cannot fails before the agreement, not alone inside a
            # reduction its peers have entered.
            job.make_outputs()
            bufs = {dt: c.reusable_buffer("fusion", job.backend, dt, n) for dt, n in need.items()}
            check_same_on_all_ranks(c, job.signature(), "allreduce_many")  # through c: under its timeout
            for b in job.buckets:
                buf = None if b.direct or b.home is not None else bufs[b.dtype][: b.count]
                job.reduce_bucket(c, b, buf, chunk_bytes)
    return job.outs


def reduce_packed(comm, be, buf, dtype, opname, chunk_bytes=None) -> None:
    """Allreduce a packed buffer of ``dtype`` in place over ``comm`` (a Communicator): a host buffer as any array
    (its fast path), a device one told its dtype -- a device backend keeps bfloat16 as its uint16 bits."""
    if be.device:
        comm.allreduce_buffer(be, buf, dtype, opname, chunk_bytes=chunk_bytes)
    else:
        comm.allreduce(buf, opname, out=buf, chunk_bytes=chunk_bytes, backend=be.name)


#: Host buffers whose views were returned as new outputs, by dtype (see _home_buffer).
_HOMES: dict = {}
#: Buffers kept per dtype: enough for a loop that holds one call's results
#: while making the next call.
_HOMES_KEPT = 2


def _home_buffer(be, dtype, count):
    """A host buffer for the new outputs of one bucket: a previous one whose outputs are all gone, else a new one.

    Reusing memory that was written before spares the first-touch page faults
    of fresh memory (about a third of the packing time of 64 MB here).  A
    buffer is free when nothing but this pool refers to it: every numpy view
    (and every torch tensor made from one) holds a reference to its base, so
    CPython's reference count says whether any output is still alive.
    """
    dtype = np.dtype(dtype)
    if be.device or sys.implementation.name != "cpython":
        return be.empty(count, dtype)
    pool = _HOMES.setdefault(dtype, [])
    for i in range(len(pool)):
        if sys.getrefcount(pool[i]) == 2 and len(pool[i]) >= count:  # 2: the list and the argument
            return pool[i][:count]
    buf = be.empty(count, dtype)
    if len(pool) >= _HOMES_KEPT:
        free = [i for i in range(len(pool)) if sys.getrefcount(pool[i]) == 2]
        if not free:
            return buf  # all kept buffers are in use: this one is not kept
        del pool[free[0]]
    pool.append(buf)
    return buf[:count]


def _count(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _shares_memory(a, b) -> bool:
    if isinstance(a, np.ndarray) or type(a).__module__.startswith("torch"):
        try:
            return bool(np.shares_memory(backend_input_numpy(a), backend_input_numpy(b)))
        except (TypeError, ValueError, RuntimeError):
            return False
    return False


def _positive(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)
