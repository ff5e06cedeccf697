"""A GPU that runs late: device arrays in host memory, streams whose work runs in random legal orders.

What a real GPU taught us: its kernels and copies run whenever the streams and
events allow, so a missing event wait is a race that corrupts data now and
then (4 ranks on one H100: 28 of 1050 results wrong, 0 with
``CUDA_LAUNCH_BLOCKING=1``), while the Numba simulator runs everything the
moment it is queued and can never show one.  This module is a device backend
("emu") whose queued work runs *late*:

* an ``EmuArray`` is host memory (a numpy array) that only queued work may
  touch: numpy refuses it (``__array__`` raises), as it would a GPU pointer;
* every kernel and copy is queued on a stream and runs later, when the host
  waits for it (``sync``: an event or a stream) or, under the ``random``
  policy, at random moments of any later call into the emulator;
* whatever runs, runs in an order that respects only stream order and event
  waits: of the operations ready to run, a seeded random choice goes first.
  Under ``lazy`` nothing runs until a host wait needs it, which keeps queued
  work pending as long as the rules allow; under ``eager`` it runs at once
  (what ``CUDA_LAUNCH_BLOCKING=1`` does on a real device).

Memory in its "device" arrays is host memory, so MPI can be handed it as if
MPI were CUDA-aware (``Communicator(cuda_aware=True)``), and it then reads and
writes it at the moments MPI chooses, as a CUDA-aware MPI would on a GPU.

Kernels compute with ddlkernels' numpy backend, bit for bit what the real
kernels compute, so results compare bitwise with the host path.  New device
memory and pinned memory are filled with a marker byte, so reading memory
nothing has written yet shows as wrong values too.

Use (tests/mpi/test_stream_emulator.py)::

    with emulated_device(seed=3, policy="lazy") as be:
        x = be.to_device(host)                  # queued on the current stream
        y = ddlkernels.allreduce(x, comm=c)     # on the current stream
        got = be.to_host(y)                     # waits for the current stream, like cupy.asnumpy

``emulated_device(claim_torch=True)`` also routes CPU torch tensors to the
emulator, as if they were CUDA tensors, so the torch integration runs on it.
"""

from __future__ import annotations

import contextlib
import random
import threading

import numpy as np

from ddlkernels._dtypes import BFLOAT16
from ddlkernels.backends import _REGISTRY
from ddlkernels.backends._device import DeviceBackend, pack_offsets, storage_dtype

__all__ = ["Emulator", "EmuArray", "EmuBackend", "emulated_device", "POLICIES"]

POLICIES = ("lazy", "random", "eager")
#: The byte new "device" and pinned memory is filled with (as float32: -2.9e-16, no value tests use).
GARBAGE = 0xA5


class _Op:
    """One queued operation: ``fn()`` (None for a marker or a wait), after ``prev`` (its stream's previous
    operation) and ``deps`` (the operations of the events it waits for)."""

    __slots__ = ("fn", "stream", "prev", "deps", "done", "what")

    def __init__(self, fn, stream, prev, deps, what):
        self.fn, self.stream, self.prev, self.deps, self.what = fn, stream, prev, deps, what
        self.done = False


class Stream:
    """An emulated stream: a FIFO of operations."""

    __slots__ = ("queue", "name", "last")

    def __init__(self, name):
        self.queue: list = []  # pending operations, oldest first
        self.name = name
        self.last = None  # the last operation queued (pending or done)

    def __repr__(self):
        return f"<emulated stream {self.name}: {len(self.queue)} pending>"


class Event:
    """An emulated event: it has happened when the operation it was recorded after has run."""

    __slots__ = ("op",)

    def __init__(self, op):
        self.op = op

    @property
    def done(self):
        return self.op is None or self.op.done


class Emulator:
    """The device: its streams and the rule that decides when and in which order queued work runs."""

    def __init__(self, seed=0, policy="lazy"):
        self.lock = threading.RLock()  # the progress thread and the caller's thread both queue work
        self.configure(seed, policy)
        self._count = 0

    def configure(self, seed, policy):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        with self.lock:
            self.rng = random.Random(seed)
            self.policy = policy
            self.streams: list = []
            self.ran = 0

    def stream(self, name=None):
        with self.lock:
            self._count += 1
            s = Stream(name or f"s{self._count}")
            self.streams.append(s)
            return s

    # -- queueing ------------------------------------------------------------------------
    def enqueue(self, stream, fn, what, deps=()):
        with self.lock:
            if stream not in self.streams:  # a stream of an earlier configuration
                self.streams.append(stream)
            prev = stream.last if stream.last is not None and not stream.last.done else None
            op = _Op(fn, stream, prev, tuple(d for d in deps if d is not None and not d.done), what)
            stream.queue.append(op)
            stream.last = op
            self._progress()
            return op

    def record(self, stream) -> Event:
        with self.lock:
            if not stream.queue:
                return Event(None)  # nothing pending: it has happened
            return Event(self.enqueue(stream, None, "record"))

    def wait(self, stream, ev):
        if not ev.done:
            self.enqueue(stream, None, "wait", deps=(ev.op,))

    def sync(self, ev):
        with self.lock:
            if ev.op is not None:
                self._force(ev.op)

    def query(self, ev) -> bool:
        with self.lock:
            self._progress()
            return ev.done

    def sync_stream(self, stream):
        self.sync(self.record(stream))

    def drain(self):
        """Run everything that is queued (between tests)."""
        with self.lock:
            while True:
                ready = self._ready()
                if not ready:
                    break
                self._run(self.rng.choice(ready))
            left = [op for s in self.streams for op in s.queue]
            assert not left, f"operations that can never run: {[(op.stream.name, op.what) for op in left]}"

    # -- running -------------------------------------------------------------------------
    def _is_ready(self, op):
        q = op.stream.queue
        return bool(q) and q[0] is op and all(d.done for d in op.deps)

    def _ready(self):
        return [s.queue[0] for s in self.streams if s.queue and all(d.done for d in s.queue[0].deps)]

    def _run(self, op):
        q = op.stream.queue
        assert q[0] is op
        q.pop(0)
        if op.fn is not None:
            op.fn()
        op.done = True
        self.ran += 1

    def _progress(self):
        """At any call: under "eager" run all that can run; under "random" sometimes a few random ops."""
        if self.policy == "eager":
            while True:
                ready = self._ready()
                if not ready:
                    return
                self._run(self.rng.choice(ready))
        elif self.policy == "random":
            for _ in range(self.rng.choice((0, 0, 1, 1, 2, 3))):
                ready = self._ready()
                if not ready:
                    return
                self._run(self.rng.choice(ready))

    def _needed(self, target):
        """The pending operations ``target`` depends on, itself included."""
        need, todo = set(), [target]
        while todo:
            op = todo.pop()
            if op.done or id(op) in need:
                continue
            need.add(id(op))
            if op.prev is not None:
                todo.append(op.prev)
            todo.extend(op.deps)
        return need

    def _force(self, target):
        """Run operations until ``target`` has run: those it needs, in a random order that respects the
        streams and events (under "random", now and then any other ready one too)."""
        while not target.done:
            need = self._needed(target)
            ready = self._ready()
            mine = [op for op in ready if id(op) in need]
            assert mine, f"{target.what} on {target.stream.name} waits for work that can never run"
            if self.policy == "random" and self.rng.random() < 0.3:
                mine = ready
            self._run(self.rng.choice(mine))


class EmuArray:
    """A 1-D or n-D "device" array: a numpy array only queued work may read or write."""

    __slots__ = ("_a",)

    def __init__(self, a):
        self._a = a

    # What the engine and the backends read of an array.
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)

    def __len__(self):
        return len(self._a)

    def __getitem__(self, key):
        if not isinstance(key, slice):
            raise TypeError("an emulated device array is indexed by slices only (its elements are on the device)")
        return EmuArray(self._a[key])

    def view(self, dtype):
        return EmuArray(self._a.view(dtype))

    def reshape(self, *shape):
        return EmuArray(self._a.reshape(*shape))

    def __array__(self, *args, **kwargs):
        raise TypeError("emulated device memory: copy it to the host first (EmuBackend.to_host)")

    def __repr__(self):
        return f"EmuArray(shape={self.shape}, dtype={self.dtype})"


def _host(x) -> np.ndarray:
    """The memory behind an EmuArray (or a numpy view of it that the engine got from ``wire``)."""
    return x._a if isinstance(x, EmuArray) else x


def _bytes(x) -> np.ndarray:
    a = _host(x)
    return a.reshape(-1).view(np.uint8)


class EmuBackend(DeviceBackend):
    """ddlkernels' device backend interface over the emulator (registered as "emu")."""

    name = "emu"
    claim_torch = False

    def __init__(self):
        super().__init__()
        self.emu = Emulator()
        self._default = self.emu.stream("default")
        self._current = threading.local()  # the "library's current stream" of each thread (like CuPy's)
        from ddlkernels.backends import get_backend

        self._numpy = get_backend("numpy")

    def configure(self, seed, policy):
        self.emu.drain()
        self.emu.configure(seed, policy)
        self.emu.streams.append(self._default)

    # -- what tests use ------------------------------------------------------------------
    @contextlib.contextmanager
    def current(self, stream):
        """Make ``stream`` this thread's current stream (as ``with cupy_stream:`` does)."""
        prev = getattr(self._current, "s", None)
        self._current.s = stream
        try:
            yield stream
        finally:
            self._current.s = prev

    def current_stream(self):
        s = getattr(self._current, "s", None)
        return self._default if s is None else s

    def to_device(self, host, stream=None):
        """A new device array holding ``host`` (the copy queued on ``stream``, default the current one)."""
        host = np.ascontiguousarray(host)
        snap = host.copy()
        dev = np.empty(host.shape, storage_dtype(host.dtype))
        dev.view(np.uint8)[...] = GARBAGE

        def fn():
            dev[...] = snap.view(dev.dtype)

        self.emu.enqueue(stream or self.current_stream(), fn, "to_device")
        out = EmuArray(dev)
        return out.view(host.dtype) if host.dtype == BFLOAT16 else out

    def to_host(self, x, stream=None):
        """``x`` copied to a new host array, after the work queued on ``stream`` (default the current one)."""
        s = stream or self.current_stream()
        a = _host(x)
        out = np.empty(a.shape, a.dtype)
        self.emu.enqueue(s, lambda: out.__setitem__(Ellipsis, a), "to_host")
        self.emu.sync_stream(s)
        return out

    def write(self, x, host, stream=None):
        """Queue ``x[...] = host`` on ``stream`` (default the current one), as a kernel of the caller would."""
        a, snap = _host(x), np.ascontiguousarray(host).copy()
        self.emu.enqueue(stream or self.current_stream(), lambda: a.__setitem__(Ellipsis, snap.view(a.dtype)),
                         "write")

    # -- streams -------------------------------------------------------------------------
    def stream_of(self, x, stream=None):
        if stream is None:
            return self.current_stream()
        if not isinstance(stream, Stream):
            raise TypeError(f"stream must be an emulated stream, got {stream!r}")
        return stream

    def default_stream(self):
        return self.current_stream()

    def new_stream(self, device=None):
        return self.emu.stream()

    def record(self, stream):
        return self.emu.record(stream)

    def wait(self, stream, ev):
        self.emu.wait(stream, ev)

    def sync(self, ev):
        self.emu.sync(ev)

    def query(self, ev):
        return self.emu.query(ev)

    def pinned(self, nbytes):
        return np.full(int(nbytes), GARBAGE, np.uint8)

    def d2h(self, host, dev, stream):
        src, dst = _bytes(dev), _bytes(host)
        self.emu.enqueue(stream, lambda: dst.__setitem__(Ellipsis, src), "d2h")

    def h2d(self, dev, host, stream):
        src, dst = _bytes(host), _bytes(dev)
        self.emu.enqueue(stream, lambda: dst.__setitem__(Ellipsis, src), "h2d")

    # -- arrays --------------------------------------------------------------------------
    def _torch(self, x):
        return type(x).__module__.startswith("torch")

    def dtype(self, x):
        if self._torch(x):
            return self._numpy.dtype(x)
        return np.dtype(x.dtype)

    def flat(self, x):
        if self._torch(x):
            a = self._numpy._as_numpy(x)
            if not a.flags.c_contiguous:
                raise ValueError("device array is not C-contiguous")
            a = a.reshape(-1)
        else:
            a = x._a
            if not a.flags.c_contiguous:
                raise ValueError("device array is not C-contiguous")
            a = a.reshape(-1)
        if a.dtype == BFLOAT16:
            a = a.view(np.uint16)
        return EmuArray(a)

    def empty(self, n, dtype):
        a = np.empty(int(n), storage_dtype(dtype))
        a.view(np.uint8)[...] = GARBAGE
        return EmuArray(a)

    def like(self, flat, x):
        a = flat._a
        if self._torch(x):
            import torch

            if x.dtype == torch.bfloat16:
                return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).reshape(x.shape)
            return torch.from_numpy(a).reshape(x.shape)
        if np.dtype(x.dtype) == BFLOAT16:
            a = a.view(BFLOAT16)
        return EmuArray(a.reshape(x.shape))

    def wire(self, buf):
        # What MPI sees: the host memory itself (as a CUDA-aware MPI would see the device's).
        a = _host(buf)
        if a.dtype.itemsize == 2 and a.dtype.kind == "f" or a.dtype == BFLOAT16:
            return a.view(np.uint16)
        return a

    def device_id(self, x):
        return 0

    def _ptr(self, buf):
        return int(_host(buf).ctypes.data)

    # -- kernels -------------------------------------------------------------------------
    def copy(self, dst, src):
        if dst.shape[0] != src.shape[0]:
            raise ValueError(f"copy: lengths differ ({dst.shape[0]} vs {src.shape[0]})")
        if dst.shape[0]:
            d, s = _bytes(dst), _bytes(src)
            self.emu.enqueue(self.compute_stream(), lambda: d.__setitem__(Ellipsis, s), "copy")

    def _launch_reduce(self, name, dst, a, b, n, arg):
        _, op, suf = name.rsplit("_", 2)
        typed = (lambda v: _host(v).view(BFLOAT16)) if suf == "bf16" else _host
        d, x, y = typed(dst), typed(a), typed(b)
        if op == "avg":  # the kernel's argument: 1/p in the accumulation type for floats, p for integers
            p = int(arg) if suf.startswith("i") else int(round(1.0 / float(arg)))
            fn = lambda: self._numpy.reduce("sum", d, x, y, avg_p=p)  # noqa: E731
        else:
            fn = lambda: self._numpy.reduce(op, d, x, y)  # noqa: E731
        self.emu.enqueue(self.compute_stream(), fn, name)

    def pack(self, tensors, buf, offsets=None):
        return self._table_copy(True, tensors, buf, offsets)

    def unpack(self, buf, tensors, offsets):
        return self._table_copy(False, tensors, buf, offsets)

    def _table_copy(self, pack, tensors, buf, offsets):
        sizes = [t.shape[0] * t.dtype.itemsize for t in tensors]
        if offsets is None:
            offsets, _ = pack_offsets(sizes)
        whole = _bytes(buf)
        for n, o in zip(sizes, offsets):
            if o < 0 or o + n > whole.shape[0]:
                raise ValueError(f"tensor of {n} bytes at offset {o} does not fit a {whole.shape[0]}-byte buffer")
        pairs = [(_bytes(t), whole[o : o + n]) for t, n, o in zip(tensors, sizes, offsets)]

        def fn():
            for t, part in pairs:
                if pack:
                    part[...] = t
                else:
                    t[...] = part

        if pairs:
            self.emu.enqueue(self.compute_stream(), fn, "pack" if pack else "unpack")
        return list(offsets)


def _recognises(x) -> bool:
    if isinstance(x, EmuArray):
        return True
    if EmuBackend.claim_torch and type(x).__module__.startswith("torch"):
        return getattr(getattr(x, "device", None), "type", None) == "cpu"
    return False


@contextlib.contextmanager
def emulated_device(seed=0, policy="lazy", claim_torch=False):
    """Register the "emu" backend (first, so it may claim CPU torch tensors) for the block; yield it.

    Every rank must use the same ``seed`` and ``policy`` only if a test wants the same schedule everywhere;
    the schedules of different ranks are independent anyway (each rank is its own device).
    """
    saved = dict(_REGISTRY)
    _REGISTRY.clear()
    _REGISTRY["emu"] = ("stream_emulator:EmuBackend", _recognises)  # first: before numpy claims CPU tensors
    _REGISTRY.update(saved)
    from ddlkernels.backends import get_backend

    be = get_backend("emu")
    be.configure(seed, policy)
    EmuBackend.claim_torch = claim_torch
    try:
        yield be
    finally:
        EmuBackend.claim_torch = False
        try:
            be.emu.drain()
        finally:
            _REGISTRY.clear()
            _REGISTRY.update(saved)
