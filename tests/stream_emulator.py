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

Memory comes from pools that behave as CuPy's (and torch's caching
allocator): once the last array over a block is gone, the next request of
its size may take it, whatever work is still queued on it.  The emulator
plays the next owner at once, writing the marker byte into the freed block:
for device memory on the stream the block was taken on (CuPy's device pool
keeps a free list per stream, whose later work runs after its earlier), so
work still queued on another stream for a dropped buffer meets it; for
pinned memory from the host at that moment (CuPy's pinned pool keeps no
order at all), so a queued copy of a dropped pinned buffer meets it.  Blocks
are never given back to the system: queued work that kept an address stays
within valid memory (``_live``).

Use (tests/mpi/test_stream_emulator.py)::

    with emulated_device(seed=3, policy="lazy") as be:
        x = be.to_device(host)                  # queued on the current stream
        y = ddlkernels.allreduce(x, comm=c)     # on the current stream
        got = be.to_host(y)                     # waits for the current stream, like cupy.asnumpy

``emulated_device(claim_torch=True)`` also routes CPU torch tensors to the
emulator, as if they were CUDA tensors, so the torch integration runs on it.

``emulated_device(ipc=True)`` emulates CUDA IPC between the ranks of a node
(``ddlkernels.algorithms.ipc``): "device" memory is then allocated in files
under /dev/shm, which a peer maps (``ipc_open``) from the file's name (the
handle) and reads and writes when *its* queued work runs; an IPC event is
counters in such a file (records made, run, and asked for by a peer), and a stream
that waits for a peer's event waits until the peer's process has run the
record that was the latest when the wait was queued, as a CUDA stream waits
for an IPC event.  A host wait that needs a peer's work spins, running its
own ready work meanwhile, and fails after ``SPIN_SECONDS``; and since a GPU
runs whatever its host does (blocked in MPI, say), each process's device
thread runs a record of its own as soon as a peer waits for it, with the
work queued before it, and nothing else.  A peer's allocation is mapped
until ``ipc_close``: queued work that reads or writes it through a mapping
closed before that work runs does nothing and counts a fault (``faults``; on
a GPU, an illegal address or garbage).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import random
import shutil
import tempfile
import threading
import time
import weakref

import numpy as np

from ddlkernels._dtypes import BFLOAT16
from ddlkernels.backends import _REGISTRY, torch_result
from ddlkernels.backends._device import CAPTURE_STATUS, DeviceBackend, pack_layout, storage_dtype

__all__ = ["Emulator", "EmuArray", "EmuBackend", "emulated_device", "POLICIES"]

POLICIES = ("lazy", "random", "eager")
#: The byte new "device" and pinned memory is filled with (as float32: -2.9e-16, no value tests use).
GARBAGE = 0xA5
#: How long a host wait may spin on a peer's work before it is called a hang.
SPIN_SECONDS = 60.0


#: CuPy's pools hand out memory in multiples of 512 bytes (its device pool and its pinned pool alike).
POOL_UNIT = 512


class _Pool:
    """Blocks as CuPy's memory pools hand them out (the module comment): ``take`` gives a uint8 array over a
    block of at least ``nbytes``, one freed under the same ``key`` (the allocation stream; None: any) if
    there is one.  A block is freed when the last array over it is gone (every array over it leads back to
    one ctypes object, whose finalizer frees it): ``scribble(key, block)`` plays its next owner's first
    write, then it goes on the free list."""

    def __init__(self, alloc, scribble):
        self.alloc, self.scribble = alloc, scribble  # alloc: nbytes -> a new uint8 array, GARBAGE-filled
        self.blocks: list = []  # every block, kept for good
        self.free = collections.defaultdict(list)  # (key, size) -> blocks freed
        self.freed = self.reused = 0  # blocks freed, requests served by a freed block (tests see the pool work)
        self.active = True  # False once the emulated_device block that made it has ended

    def take(self, nbytes, key=None):
        """A uint8 array of ``nbytes`` over a block of the pool."""
        size = max(-(-int(nbytes) // POOL_UNIT), 1) * POOL_UNIT
        free = self.free[(key, size)]
        if free:
            raw = free.pop()
            self.reused += 1
        else:
            raw = self.alloc(size)
            self.blocks.append(raw)
        owner = (ctypes.c_uint8 * size).from_address(raw.ctypes.data)
        owner.raw = raw  # an array that outlives the pool keeps its memory
        weakref.finalize(owner, self._release, key, size, raw).atexit = False
        return np.frombuffer(owner, np.uint8)[: int(nbytes)]

    def _release(self, key, size, raw):
        if self.active:
            self.freed += 1
            self.scribble(key, raw)
            self.free[(key, size)].append(raw)


def _live(a: np.ndarray) -> np.ndarray:
    """``a``, or where it lies in a pool block, an array over the same memory that does not keep the block
    taken: what queued work holds, so that dropping the last array of a buffer frees its block while work
    on it is still queued, as a CUDA pool frees it."""
    root = a
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    if not isinstance(root, ctypes.Array) or a.nbytes == 0:
        return a
    if not a.flags.c_contiguous:
        raise AssertionError("the emulator queues work on contiguous arrays only")
    mem = (ctypes.c_uint8 * a.nbytes).from_address(a.ctypes.data)
    return np.frombuffer(mem, np.uint8).view(a.dtype).reshape(a.shape)


class _Op:
    """One queued operation: ``fn()`` (None for a marker or a wait), after ``prev`` (its stream's previous
    operation), ``deps`` (the operations of the events it waits for) and ``ext`` (predicates that say whether
    a peer process has run what it waits for: IPC events)."""

    __slots__ = ("fn", "stream", "prev", "deps", "ext", "done", "what")

    def __init__(self, fn, stream, prev, deps, what, ext=()):
        self.fn, self.stream, self.prev, self.deps, self.what, self.ext = fn, stream, prev, deps, what, ext
        self.done = False

    def unblocked(self) -> bool:
        return all(d.done for d in self.deps) and all(e() for e in self.ext)


class Stream:
    """An emulated stream: a FIFO of operations."""

    __slots__ = ("queue", "name", "last", "capturing")

    def __init__(self, name):
        self.queue: list = []  # pending operations, oldest first
        self.name = name
        self.last = None  # the last operation queued (pending or done)
        self.capturing = False  # capturing a CUDA graph (``EmuBackend.capture``): nothing may be queued

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
        self.idle = threading.Condition(self.lock)  # a spinning wait lets the other threads in
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
    def enqueue(self, stream, fn, what, deps=(), ext=(), progress=True):
        """Queue ``fn`` on ``stream`` after ``deps``; then, by the policy, maybe run ready work -- not with
        ``progress=False`` (a pool's finalizer: it may run inside any emulator call, ``_ready``'s scan of the
        queues included, which must not see them change under it)."""
        with self.lock:
            if stream.capturing:  # CUDA would record it into the graph: run at a replay, not now
                raise AssertionError(f"{what} queued on {stream.name} while it captures a CUDA graph")
            if stream not in self.streams:  # a stream of an earlier configuration
                self.streams.append(stream)
            op = _Op(fn, stream, None, tuple(d for d in deps if d is not None and not d.done), what, tuple(ext))
            # Its predecessor is read once it is in line, with nothing allocated in between: a collection
            # while the operation is built may free a block whose next owner's write joins this stream first.
            q = stream.queue
            q.append(op)
            op.prev = q[-2] if len(q) > 1 else None
            stream.last = op
            if progress:
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
        """Whether ``ev`` has happened.  A device finishes queued work in finite time, so a host that keeps
        asking must see it happen: each query, by chance, also runs what ``ev`` needs that can run now (a
        poll loop such as a ``timeout=`` wait would otherwise spin forever under "lazy")."""
        with self.lock:
            self._progress()
            if not ev.done and ev.op is not None and self.rng.random() < 0.25:
                self._advance(ev.op)
            return ev.done

    def ran_all(self, stream) -> bool:
        """Whether ``stream`` has nothing pending (after running, by the policy, what may run now)."""
        with self.lock:
            self._progress()
            return not stream.queue

    def sync_stream(self, stream):
        """Block until ``stream``'s last operation has run, queueing nothing (as cudaStreamSynchronize)."""
        with self.lock:
            if stream.last is not None and not stream.last.done:
                self._force(stream.last)

    def drain(self):
        """Run everything that is queued (between tests), waiting for peers' IPC events as long as
        ``SPIN_SECONDS``."""
        with self.lock:
            t0 = time.monotonic()
            while True:
                ready = self._ready()
                if ready:
                    self._run(self.rng.choice(ready))
                    continue
                blocked = [op for s in self.streams for op in s.queue[:1] if op.ext]
                if blocked and time.monotonic() - t0 <= SPIN_SECONDS:
                    self.idle.wait(1e-4)  # a peer's record still to run
                    continue
                left = [op for s in self.streams for op in s.queue]
                # A collection inside this loop (any allocation) may free a pool block whose finalizer queues
                # its next owner's write after the scan above found nothing ready: that runs too.
                if not (left and self._ready()):
                    break
            assert not left, f"operations that can never run: {[(op.stream.name, op.what) for op in left]}"

    # -- running -------------------------------------------------------------------------
    def _is_ready(self, op):
        q = op.stream.queue
        return bool(q) and q[0] is op and op.unblocked()

    def _ready(self):
        return [s.queue[0] for s in self.streams if s.queue and s.queue[0].unblocked()]

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
        """The pending operations ``target`` depends on, itself included (id -> operation)."""
        need, todo = {}, [target]
        while todo:
            op = todo.pop()
            if op.done or id(op) in need:
                continue
            need[id(op)] = op
            if op.prev is not None:
                todo.append(op.prev)
            todo.extend(op.deps)
        return need

    def _stuck(self, need) -> str:
        """What ``_force`` waits for, where it sits: each pending operation's stream, whether that stream is
        one the emulator runs, and the operation at its queue's head."""
        rows = []
        for op in list(need.values())[:8]:
            q = op.stream.queue
            head = "empty queue" if not q else "itself" if q[0] is op else f"{q[0].what} (done {q[0].done})"
            rows.append(f"{op.what} on {op.stream.name} (listed {op.stream in self.streams}, head: {head})")
        return "; ".join(rows)

    def _advance(self, target):
        """Run, in a random legal order, what ``target`` needs that is ready, without waiting for peers."""
        while not target.done:
            need = self._needed(target)
            mine = [op for op in self._ready() if id(op) in need]
            if not mine:
                return
            self._run(self.rng.choice(mine))

    def _force(self, target):
        """Run operations until ``target`` has run: those it needs, in a random order that respects the
        streams and events (under "random", now and then any other ready one too).  While what it needs
        waits for a peer's IPC event, any ready operation runs, else the host spins."""
        t0 = None
        while not target.done:
            need = self._needed(target)
            ready = self._ready()
            mine = [op for op in ready if id(op) in need]
            if not mine:
                external = [op for s in self.streams for op in s.queue[:1] if op.ext and id(op) in need]
                assert external, (f"{target.what} on {target.stream.name} waits for work that can never run: "
                                  + self._stuck(need))
                t0 = time.monotonic() if t0 is None else t0
                assert time.monotonic() - t0 < SPIN_SECONDS, (
                    f"{target.what} on {target.stream.name} waited {SPIN_SECONDS:.0f} s for a peer's event "
                    f"({external[0].what})")
                if ready:
                    self._run(self.rng.choice(ready))  # the device runs what it can while the peer catches up
                else:
                    self.idle.wait(1e-4)  # the lock released: this process's other threads go on
                continue
            if self.policy == "random" and self.rng.random() < 0.3:
                mine = ready
            self._run(self.rng.choice(mine))


class EmuArray:
    """A 1-D or n-D "device" array: a numpy array only queued work may read or write; ``_m``: the peer's
    mapping it lies in (``EmuBackend.ipc_open``), else None."""

    __slots__ = ("_a", "_m")

    def __init__(self, a, m=None):
        self._a, self._m = a, m

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
        return EmuArray(self._a[key], self._m)

    def view(self, dtype):
        return EmuArray(self._a.view(dtype), self._m)

    def reshape(self, *shape):
        return EmuArray(self._a.reshape(*shape), self._m)

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


def _queued(x) -> np.ndarray:
    """The memory of ``x`` as queued work holds it (``_live``)."""
    return _live(_host(x))


class _Mapping:
    """A peer's allocation mapped in this process (``EmuBackend.ipc_open``) until ``ipc_close``."""

    __slots__ = ("array", "open")

    def __init__(self, array):
        self.array, self.open = array, True


class _SharedHeap:
    """This process's "device" memory where peers can map it: one file under /dev/shm per allocation, its
    name the IPC handle.  Allocations live until ``close`` (the end of the ``emulated_device`` block)."""

    def __init__(self):
        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.dir = tempfile.mkdtemp(prefix=f"ddl-emu-{os.getpid()}-", dir=root)
        self.allocs: list = []  # (base address, size, path, array)
        self.opened: dict = {}  # path -> a peer's allocation, mapped here
        self._events = None  # this process's IPC event counters (a file of int64 pairs)
        self._nevents = 0

    def alloc(self, nbytes) -> np.ndarray:
        path = os.path.join(self.dir, f"a{len(self.allocs)}")
        size = max(int(nbytes), 1)
        with open(path, "wb") as f:
            f.truncate(size)
        a = np.memmap(path, np.uint8, "r+", shape=(size,))
        a[...] = GARBAGE
        self.allocs.append((int(a.ctypes.data), size, path, a))
        return a[: int(nbytes)]

    def export(self, addr):
        for base, size, path, _ in self.allocs:
            if base <= addr < base + size:
                return path.encode(), addr - base
        return None

    def open(self, key) -> np.ndarray:
        path = key.decode()
        a = self.opened.get(path)
        if a is None:
            a = self.opened[path] = np.memmap(path, np.uint8, "r+")
        return a

    def event(self):
        """A new IPC event of this process: its counters and its handle."""
        if self._events is None:
            self._events = self.alloc(4096 * 24).view(np.int64).reshape(-1, 3)
            self._events[...] = 0
            self._events_path = self.allocs[-1][2]
        k = self._nevents
        self._nevents += 1
        return self._events[k], f"{self._events_path}#{k}".encode()

    def open_event(self, key):
        path, k = key.decode().rsplit("#", 1)
        return self.open(path.encode()).view(np.int64).reshape(-1, 3)[int(k)]

    def close(self):
        self.allocs.clear()
        self.opened.clear()
        shutil.rmtree(self.dir, ignore_errors=True)  # peers' mappings outlive the names


class IpcEvent:
    """An emulated IPC event: ``counters`` = [records made, latest record run, latest record a peer waits
    for], in memory every rank maps; the owner keeps its records' operations (``records``: record -> op)."""

    __slots__ = ("counters", "records")

    def __init__(self, counters):
        self.counters = counters
        self.records: dict = {}


class _DeviceThread(threading.Thread):
    """The owner's device, running on its own when a peer waits for one of its IPC events.

    A GPU runs queued work whatever its host does, so a peer may wait for
    a record while this process's host is blocked in MPI; the emulator's
    device otherwise runs only when its host calls in.  This thread runs
    (with what it needs) the record a peer asks for, and nothing else, so
    work nobody waits for still runs late.
    """

    def __init__(self, backend):
        super().__init__(name="emulated device", daemon=True)
        self.be, self.stop, self.error = backend, threading.Event(), None

    def run(self):
        emu = self.be.emu
        while not self.stop.wait(5e-4):
            try:
                with emu.lock:
                    for ev in self.be.ipc_events:
                        c = ev.counters
                        asked = [k for k in ev.records if k >= c[2] and c[2] > c[1]]
                        if asked:
                            emu._force(ev.records[min(asked)])
                        for k in [k for k in ev.records if k <= c[1]]:
                            del ev.records[k]
            except AssertionError as exc:  # a peer that never came: the host's own wait reports it too
                self.error = exc
                return


class EmuBackend(DeviceBackend):
    """ddlkernels' device backend interface over the emulator (registered as "emu")."""

    name = "emu"
    claim_torch = False
    ipc = False  # CUDA IPC between the ranks of a node (``emulated_device(ipc=True)``)
    gpu = None  # the name of this rank's GPU, which ranks of equal names share (``emulated_device(gpu=)``)

    def __init__(self):
        super().__init__()
        self.heap = None  # the _SharedHeap while ``ipc``
        self.faults = 0  # queued work that ran through a peer's mapping closed before it (``_mapped``)
        self.ipc_events: list = []  # this process's IPC events (``ipc_event``)
        self.emu = Emulator()
        self._default = self.emu.stream("default")
        self._current = threading.local()  # the "library's current stream" of each thread (like CuPy's)
        from ddlkernels.backends import get_backend

        self._numpy = get_backend("numpy")
        self.reset_pools()

    def reset_pools(self):
        """New pools (each ``emulated_device`` block: the shared heap's files go with the block)."""
        for pool in (getattr(self, n, None) for n in ("device_pool", "shared_pool", "pinned_pool")):
            if pool is not None:
                pool.active = False
        self.locked: dict = {}  # page-locked host memory (the pinned pool's blocks): address -> bytes
        self.device_pool = _Pool(self._fresh, self._scribble_device)
        self.shared_pool = _Pool(lambda nbytes: self.heap.alloc(nbytes), self._scribble_device)
        self.pinned_pool = _Pool(self._fresh_pinned, self._scribble_pinned)

    def _scribble_device(self, stream, raw):
        self.emu.enqueue(stream, lambda: raw.__setitem__(Ellipsis, GARBAGE), "next owner of a freed block",
                         progress=False)  # from a finalizer: whatever emulator call the collection interrupted

    @staticmethod
    def _scribble_pinned(_, raw):
        raw[...] = GARBAGE

    @staticmethod
    def _fresh(nbytes):
        return np.full(int(nbytes), GARBAGE, np.uint8)

    def _fresh_pinned(self, nbytes):
        a = self._fresh(nbytes)
        self.locked[a.ctypes.data] = a.nbytes  # the pool keeps its blocks page-locked
        return a

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

    @contextlib.contextmanager
    def capture(self, stream):
        """``stream`` captures a CUDA graph within the block (as ``cupy`` ``Stream.begin_capture`` .. ``end_capture``,
        ``torch.cuda.graph``): queueing anything there fails."""
        stream.capturing = True
        try:
            yield stream
        finally:
            stream.capturing = False

    def _new(self, shape, dtype, stream, shareable=True) -> np.ndarray:
        """"Device" memory from the pool of ``stream`` (the module comment), GARBAGE until written: in the
        shared heap while ``ipc`` (unless not ``shareable``: memory CUDA IPC cannot export, as from
        cudaMallocAsync, whose pool is stream-ordered too)."""
        dt = storage_dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64))
        pool = self.shared_pool if self.ipc and shareable else self.device_pool
        return pool.take(n * dt.itemsize, stream).view(dt).reshape(shape)

    def to_device(self, host, stream=None, shareable=True):
        """A new device array holding ``host`` (the copy queued on ``stream``, default the current one);
        ``shareable=False``: memory peers cannot map (with ``ipc``)."""
        host = np.ascontiguousarray(host)
        snap = host.copy()
        s = stream or self.current_stream()
        dev = self._new(host.shape, host.dtype, s, shareable)
        mem = _live(dev)

        def fn():
            mem[...] = snap.view(mem.dtype)

        self.emu.enqueue(s, fn, "to_device")
        out = EmuArray(dev)
        return out.view(host.dtype) if host.dtype == BFLOAT16 else out

    def to_host(self, x, stream=None):
        """``x`` copied to a new host array, after the work queued on ``stream`` (default the current one)."""
        s = stream or self.current_stream()
        a = _queued(x)
        out = np.empty(a.shape, a.dtype)
        self.emu.enqueue(s, lambda: out.__setitem__(Ellipsis, a), "to_host")
        self.emu.sync_stream(s)
        return out

    def write(self, x, host, stream=None):
        """Queue ``x[...] = host`` on ``stream`` (default the current one), as a kernel of the caller would."""
        a, snap = _queued(x), np.ascontiguousarray(host).copy()
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
        if isinstance(ev, IpcEvent):  # the latest record made when the wait is queued, as CUDA's
            c, k = ev.counters, int(ev.counters[0])

            def happened():
                if c[1] >= k:
                    return True
                if c[2] < k:
                    c[2] = k  # asks the owner's device thread for it
                return False

            if c[1] < k:
                self.emu.enqueue(stream, None, "wait ipc event", ext=(happened,))
            return
        self.emu.wait(stream, ev)

    def sync(self, ev):
        self.emu.sync(ev)

    def query(self, ev):
        return self.emu.query(ev)

    def idle(self, stream):
        return self.emu.ran_all(stream)

    def graph_capture(self, stream):
        return CAPTURE_STATUS[1] if stream.capturing else None

    def sync_stream(self, stream):
        self.emu.sync_stream(stream)  # as cudaStreamSynchronize: no event of the backend's

    def pinned(self, nbytes):
        return self.pinned_pool.take(nbytes)

    def _lock_of(self, lo, nbytes):
        """The page-locked range holding ``[lo, lo + nbytes)``, or None."""
        return next((b for b, m in self.locked.items() if b <= lo and lo + nbytes <= b + m), None)

    def _page_locked(self, host, what):
        """CUDA copies asynchronously only from page-locked memory: ``host`` must lie in some."""
        a = _bytes(host)
        if self._lock_of(a.ctypes.data, a.nbytes) is None:
            raise AssertionError(f"{what}: an asynchronous copy of host memory that is not page-locked")

    def d2h(self, host, dev, stream):
        self._page_locked(host, "d2h")
        src, dst = _live(_bytes(dev)), _live(_bytes(host))
        self.emu.enqueue(stream, lambda: dst.__setitem__(Ellipsis, src), "d2h")

    def h2d(self, dev, host, stream):
        self._page_locked(host, "h2d")
        src, dst = _live(_bytes(host)), _live(_bytes(dev))
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
        return EmuArray(self._new((int(n),), dtype, self.compute_stream()))

    def full(self, n, dtype, value):
        out = self.empty(n, dtype)
        self.write(out, np.full(int(n), value, out.dtype), self.compute_stream())
        return out

    def like(self, flat, x, shape=None):
        shape = x.shape if shape is None else shape
        a = flat._a
        if self._torch(x):
            import torch

            if x.dtype == torch.bfloat16:
                return torch_result(torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).reshape(shape))
            return torch_result(torch.from_numpy(a).reshape(shape))
        if np.dtype(x.dtype) == BFLOAT16:
            a = a.view(BFLOAT16)
        return EmuArray(a.reshape(shape))

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

    # -- CUDA IPC (``ddlkernels.algorithms.ipc``) ---------------------------------------------
    def ipc_export(self, buf):
        if not self.ipc or buf.nbytes == 0:
            return None
        return self.heap.export(self._ptr(buf))

    def _mapped(self, fn, *arrays):
        """``fn``, or where any of ``arrays`` lies in a peer's mapping: ``fn`` unless that mapping was closed
        by the time it runs (then nothing, and a fault)."""
        maps = [a._m for a in arrays if isinstance(a, EmuArray) and a._m is not None]
        if not maps:
            return fn

        def checked():
            if all(m.open for m in maps):
                fn()
            else:
                self.faults += 1

        return checked

    def ipc_open(self, key):
        return _Mapping(self.heap.open(key))

    def ipc_view(self, mapping, offset, count, dtype):
        dt = np.dtype(dtype)
        assert mapping.open, "a view of a closed mapping"
        return EmuArray(mapping.array[offset: offset + count * dt.itemsize].view(dt), mapping)

    def ipc_close(self, mapping):
        assert mapping.open, "a mapping closed twice"
        mapping.open = False  # the memory stays (the file's mapping goes with its last reference)

    def ipc_alloc(self, nbytes):
        return EmuArray(self.heap.alloc(nbytes))

    def gpu_ident(self):
        return f"emu-{os.getpid()}".encode() if self.gpu is None else f"emu {self.gpu}".encode()

    def ipc_event(self):
        counters, key = self.heap.event()
        ev = IpcEvent(counters)
        self.ipc_events.append(ev)
        return ev, key

    def ipc_open_event(self, key):
        return IpcEvent(self.heap.open_event(key))

    def record_on(self, stream, ev):
        c = ev.counters
        with self.emu.lock:
            k = int(c[0]) + 1
            c[0] = k

            def fn():
                if c[1] < k:
                    c[1] = k

            ev.records[k] = self.emu.enqueue(stream, fn, "record ipc event")

    # -- kernels -------------------------------------------------------------------------
    def copy(self, dst, src):
        if dst.shape[0] != src.shape[0]:
            raise ValueError(f"copy: lengths differ ({dst.shape[0]} vs {src.shape[0]})")
        if dst.shape[0]:
            d, s = _live(_bytes(dst)), _live(_bytes(src))
            self.emu.enqueue(self.compute_stream(), self._mapped(lambda: d.__setitem__(Ellipsis, s), dst, src), "copy")

    def _launch_reduce(self, name, dst, a, b, n, arg):
        _, op, suf = name.rsplit("_", 2)
        typed = (lambda v: _queued(v).view(BFLOAT16)) if suf == "bf16" else _queued
        d, x, y = typed(dst), typed(a), typed(b)
        if op == "avg":  # the kernel's argument: 1/p in the accumulation type for floats, p for integers
            p = int(arg) if suf.startswith("i") else int(round(1.0 / float(arg)))
            fn = lambda: self._numpy.reduce("sum", d, x, y, avg_p=p)  # noqa: E731
        else:
            fn = lambda: self._numpy.reduce(op, d, x, y)  # noqa: E731
        self.emu.enqueue(self.compute_stream(), self._mapped(fn, dst, a, b), name)

    def _launch_fold(self, name, dst, srcs, n, arg, also=()):
        """kernels/reduce.cu's ddl_fold (or ddl_fold_realign: the same bits), one queued operation: the chain of
        two-operand reductions over ``srcs`` ("avg" scaling in the last step) into ``dst`` and every buffer of
        ``also``."""
        op, suf = name.split("_")[-2:]
        typed = (lambda v: _queued(v).view(BFLOAT16)) if suf == "bf16" else _queued
        d, xs, es = typed(dst), [typed(x) for x in srcs], [typed(e) for e in also]
        p = (int(arg) if suf.startswith("i") else int(round(1.0 / float(arg)))) if op == "avg" else None
        last = len(xs) - 1

        def fn():
            acc = xs[0].copy()  # srcs[0] may be dst
            for j in range(1, len(xs)):
                if op == "avg":
                    self._numpy.reduce("sum", acc, acc, xs[j], avg_p=p if j == last else None)
                else:
                    self._numpy.reduce(op, acc, acc, xs[j])
            for out in [d] + es:
                out[...] = acc

        self.emu.enqueue(self.compute_stream(), self._mapped(fn, dst, *srcs, *also), name)

    def pack(self, tensors, buf, offsets=None):
        return self._table_copy(True, tensors, buf, offsets)

    def unpack(self, buf, tensors, offsets):
        return self._table_copy(False, tensors, buf, offsets)

    def _table_copy(self, pack, tensors, buf, offsets):
        sizes, offsets = pack_layout(tensors, buf, offsets)
        whole = _live(_bytes(buf))
        pairs = [(_live(_bytes(t)), whole[o : o + n]) for t, n, o in zip(tensors, sizes, offsets)]

        def fn():
            for t, part in pairs:
                if pack:
                    part[...] = t
                else:
                    t[...] = part

        if pairs:
            self.emu.enqueue(self.compute_stream(), self._mapped(fn, buf, *tensors), "pack" if pack else "unpack")
        return list(offsets)


def _recognises(x) -> bool:
    if isinstance(x, EmuArray):
        return True
    if EmuBackend.claim_torch and type(x).__module__.startswith("torch"):
        return getattr(getattr(x, "device", None), "type", None) == "cpu"
    return False


@contextlib.contextmanager
def emulated_device(seed=0, policy="lazy", claim_torch=False, ipc=False, gpu=None):
    """Register the "emu" backend (first, so it may claim CPU torch tensors) for the block; yield it.

    Every rank must use the same ``seed`` and ``policy`` only if a test wants the same schedule everywhere;
    the schedules of different ranks are independent anyway (each rank is its own device).  ``ipc``: the
    ranks may map each other's device memory (CUDA IPC); every rank passes the same, and a rank leaves the
    block only when its peers no longer use its memory (a collective after the last call, e.g. ``free``).
    ``gpu``: the name of this rank's GPU (``gpu_ident``): ranks that pass the same name share one GPU; None, a
    GPU of its own.
    """
    saved = dict(_REGISTRY)
    _REGISTRY.clear()
    _REGISTRY["emu"] = ("stream_emulator:EmuBackend", _recognises)  # first: before numpy claims CPU tensors
    _REGISTRY.update(saved)
    from ddlkernels.backends import get_backend

    be = get_backend("emu")
    be.configure(seed, policy)
    EmuBackend.claim_torch = claim_torch
    be.ipc, be.heap, be.ipc_events = ipc, (_SharedHeap() if ipc else None), []
    be.gpu = gpu
    be.reset_pools()
    be.faults = 0
    device = _DeviceThread(be) if ipc else None
    if device is not None:
        device.start()
    try:
        yield be
    finally:
        EmuBackend.claim_torch = False
        try:
            be.emu.drain()
        finally:
            if device is not None:
                device.stop.set()
                device.join()
            _REGISTRY.clear()
            _REGISTRY.update(saved)
            if be.heap is not None:
                be.heap.close()
            be.ipc, be.heap, be.ipc_events, be.gpu = False, None, [], None
