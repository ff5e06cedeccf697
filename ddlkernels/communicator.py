"""``Communicator``: an MPI communicator plus what repeated collectives reuse.

It holds a private duplicate of the user's communicator (so our messages never
match the user's), the detected node layout, a cache of plans and schedules,
reusable receive slots and scratch buffers per backend and dtype, and the
transports.  Nothing else is global: the module-level functions use a
``Communicator`` cached on the mpi4py communicator itself through MPI
attribute caching, created lazily on first use.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from contextlib import contextmanager
from time import perf_counter

import numpy as np

from . import _config
from ._dtypes import acc_dtype, check_dtype, dtype_name, is_half, normalize_op
from ._engine import ALIGN_PAD, Segments, execute
from .ring.schedule import Plan, build_schedule, shard_bounds, validate_dims
from .transport.direct import HostTransport
from . import _hier
from ._cma import CmaAllreduce, probe_pids as cma_probe
from ._shm import GATHER_STREAM_FROM, ShmAllreduce, _ufunc, one_node
from ._tuner import CMA_GATHER_FROM, SizeTuner, candidates
from ._validate import Call, report_local_failure
from ._wait import BlockingRunner, CollectiveTimeout, Deadline, _check_timeout, abandon, complete
from .backends import backend_for

__all__ = ["Communicator", "as_communicator"]

# MPI datatypes MPI's own allreduce can take for the small-message path.
_MPI_NATIVE = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))
_MPI_OPS: dict = {}
_SHARD_PLAN_BYTES = 1 << 30
# (op name, dtype char) -> (MPI op, avg?): what _small_fast hands to MPI.  Float
# max/min are absent: MPI's drop NaNs (see _allreduce_flat).  Filled with _MPI_OPS.
_FAST_TABLE: dict = {}


def _mpi_op(name):
    if not _MPI_OPS:
        from mpi4py import MPI

        _MPI_OPS.update(sum=MPI.SUM, max=MPI.MAX, min=MPI.MIN, prod=MPI.PROD, IN_PLACE=MPI.IN_PLACE, BYTE=MPI.BYTE)
        for dt in _MPI_NATIVE:
            for name_, op_ in (("sum", MPI.SUM), ("avg", MPI.SUM), ("prod", MPI.PROD), ("max", MPI.MAX),
                               ("min", MPI.MIN)):
                if dt.kind == "f" and name_ in ("max", "min"):
                    continue
                _FAST_TABLE[(name_, dt.char)] = (op_, name_ == "avg")
    return _MPI_OPS[name]


class Communicator:
    """Multi-dimensional ring collectives over an mpi4py intracommunicator.

    Parameters (each falls back to ``ddlkernels._config`` and then to the
    environment variables documented in the README):

    comm         mpi4py ``Intracomm``; default ``MPI.COMM_WORLD``.  It is
                 duplicated: collectives here never match the caller's messages.
    chunk_bytes  pipeline chunk size in bytes (default 1 MiB).
    small_bytes  messages of fewer bytes go to MPI's own ``Allreduce`` when the
                 dtype is one MPI knows (0 = always the ring).  Default: chosen
                 per size by measurement, identically on every rank
                 (``ddlkernels._tuner``).
    window       receive slots in flight per ring step (default 4, >= 1).
    shm          the shared-memory allreduce (``ddlkernels._shm``) for host
                 arrays when every rank shares one node: ``None`` (default)
                 makes it a measured candidate of the tuner, ``True`` uses it
                 for every such call (an error if the ranks span nodes),
                 ``False`` never.  Fallback ``DDLKERNELS_SHM``.
    cuda_aware   ``True``/``False`` overrides detection of CUDA-aware MPI.
    validate     check before every collective that all ranks passed the same
                 count, dtype, op, dims and chunk, raising the same
                 ``ValueError`` on every rank if not (one small allgather per
                 call; default ``DDLKERNELS_VALIDATE``, else off).
    timeout      seconds a collective may take before it raises
                 ``ddlkernels.CollectiveTimeout`` naming the peer it waited
                 on (default: wait forever); creating the Communicator waits
                 for every rank under it too.  It need not agree across
                 ranks.  See docs/reliability.md.

    Creating a Communicator is collective over ``comm``.  Every rank must pass
    the same ``chunk_bytes``, ``small_bytes`` and ``shm`` (they choose the
    algorithm; ``validate`` checks them).

    Threads: a Communicator runs one collective at a time.  A call made while
    another thread is inside a collective on it raises ``RuntimeError`` at
    once, before any communication (two collectives on one communicator at
    once cannot be matched across ranks).  Use one Communicator per thread;
    each is a duplicate with its own windows and buffers, and the library
    keeps their setup from colliding (docs/reliability.md, "Threads").
    """

    def __init__(self, comm=None, *, chunk_bytes=None, small_bytes=None, window=None, cuda_aware=None,
                 validate=None, timeout=None, topology=None, rack_map=None, shm=None, _deadline=None):
        from mpi4py import MPI

        if comm is None:
            comm = MPI.COMM_WORLD
        if isinstance(comm, Communicator):
            comm = comm.mpi_comm
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"comm must be an mpi4py Intracomm, got {comm!r}")
        env = _config.defaults()
        self.chunk_bytes = _positive("chunk_bytes", env.chunk_bytes if chunk_bytes is None else chunk_bytes)
        small = env.small_bytes if small_bytes is None else small_bytes
        self.small_bytes = None if small is None else _nonneg("small_bytes", small)
        self._tuner = SizeTuner(watch=True)  # large settled sizes re-measured when their calls slow down
        #: reduce_scatter and allgather: the ring or (one node) shared memory, measured per size
        self._shard_tuners = {"reduce_scatter": SizeTuner(watch=True), "allgather": SizeTuner(watch=True)}
        self.window = _positive("window", env.window if window is None else window)
        self.cuda_aware_override = env.cuda_aware if cuda_aware is None else bool(cuda_aware)
        self.validate = env.validate if validate is None else bool(validate)
        self.timeout = _check_timeout(timeout)
        # Set when a collective timed out: its messages are still in flight.
        self._broken = None
        #: Held by the thread inside a collective on this Communicator (``_exclusive``); reentrant for the
        #: collectives that call others (allreduce_many).
        self._busy = threading.RLock()
        self._runner = None  # BlockingRunner: MPI's blocking calls under a deadline (``_blocking``)
        self.mpi_comm = comm
        if _deadline is None and self.timeout is not None:
            _deadline = Deadline("Communicator creation", comm.Get_rank(), self.timeout)
        # Nonblocking, so that a rank that never comes is a timeout; once it completes every rank is here,
        # and the rest of the setup's collectives (on the duplicate) complete.
        self.comm = duplicate(comm, _deadline)
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        from .topology import detect

        # The running job's topology: nodes from shared memory, racks from the
        # optional rack map, link parameters from a calibrated topology file
        # (``python -m ddlkernels calibrate``) or the documented defaults.
        params = env.topology if topology is None else topology
        self.topology = detect(self.comm, rack_map=env.rack_map if rack_map is None else rack_map, params=params)
        self._order = self.topology.topology_order()
        shm = env.shm if shm is None else shm
        if shm not in (None, True, False):
            raise ValueError(f"shm must be None, True or False, got {shm!r}")
        self.shm = shm
        # One more collective at creation: do all ranks share memory?  (The collectives made here depend on
        # nothing a rank chose alone, so that ranks that differ in shm= still finish creating; validate names it.)
        on_one_node = self.size > 1 and one_node(self.comm)
        #: None: no shared-memory allreduce; else whether it is forced (True) or a tuner candidate (False)
        self._shm_mode = None if (shm is False or not on_one_node) else bool(shm)
        self._shm = None  # ShmAllreduce, created on first use
        # The single-copy allreduce, beside the window among the tuner's candidates, where every pair of ranks may
        # read each other's memory (one more collective, only on one node).
        self._cma_pids = cma_probe(self.comm) if on_one_node else None
        self._cma_ok = self._shm_mode is False and self._cma_pids is not None
        self._cma = None  # CmaAllreduce, created on first use
        # Several nodes of equal size (one more collective, only then): the
        # hierarchical allreduce is a tuner candidate (ddlkernels._hier).
        self._hier_node = None
        if self.size > 1 and not on_one_node:
            node = _hier.node_split(self.comm)
            if _hier.uniform_nodes(self.comm, node) and shm is not False:
                self._hier_node = node
            else:
                node.Free()
        self._hier_ok = self._hier_node is not None
        if shm is True and self.size > 1 and not on_one_node:  # after the collectives: a rank may differ in shm=
            if self._hier_node is not None:
                self._hier_node.Free()
            self.comm.Free()
            raise ValueError("shm=True: the ranks of this communicator do not all share one node")
        self._hier = None  # HierAllreduce, created on first use
        # The small-message fast path applies when no per-communicator check
        # (validation, timeout) has to run around the call.
        self._fast_ok = self.size > 1 and not self.validate and self.timeout is None
        _mpi_op("sum")  # fills _MPI_OPS and _FAST_TABLE
        #: (op name, dtype, nbytes) -> (algorithm, MPI op or, for "shm", op name, avg?), or False
        #: for the full path: settled fast-path decisions
        self._fast: dict = {}
        self._plans: dict = {}
        self._shard_cache: dict = {}
        self._rs_fast_cache: dict = {}
        self._ag_fast_cache: dict = {}
        self._schedules: dict = {}
        self._buffers: dict = {}
        self._transports: dict = {}
        #: (backend name, device) -> event recorded at the end of the last device call (see _device_call)
        self._tails: dict = {}
        #: "ring", "mpi", "nbc", "shm", "shm-nt", "cma" or "hier": which algorithm the last allreduce, reduce_scatter or
        #: allgather ran
        #: (for reports; ddlkernels._tuner).
        self.last_algorithm = None

    # -- lifetime ------------------------------------------------------------
    def free(self) -> None:
        """Release the duplicated communicator and every cached buffer (collective).

        After a timeout it releases nothing: the abandoned collective may still
        complete into these buffers and windows (a late rank), and freeing them
        collectively would not match across ranks.  They are kept until the
        process ends (``ddlkernels._wait.abandon``).
        """
        with self._exclusive("free"):
            self._free()

    def _free(self):
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if self._broken is not None:
            abandon(self.comm, self._buffers, self._transports, self._shm, self._cma, self._hier, self._hier_node)
            self._transports, self._buffers = {}, {}
            self._shm = self._cma = self._hier = self._hier_node = self.comm = None
            return
        for t in self._transports.values():
            t.close()
        self._transports.clear()
        if self._shm is not None:
            # The fast paths' caches may hold functions of the window freed here.
            self._fast.clear()
            self._rs_fast_cache.clear()
            self._ag_fast_cache.clear()
            self._shm.free()
            self._shm = self._cma = None
        if self._hier is not None:
            self._hier.free()  # frees the node communicator too
            self._hier = self._hier_node = None
        elif self._hier_node is not None:
            self._hier_node.Free()
            self._hier_node = None
        self._buffers.clear()
        if self.comm is not None:
            self.comm.Free()
            self.comm = None

    @contextmanager
    def _exclusive(self, what):
        """The body runs with this Communicator to itself; ``RuntimeError`` if another thread is in a collective
        on it (the fast paths inline the same test)."""
        if not self._busy.acquire(blocking=False):
            raise _in_use(what)
        try:
            yield
        finally:
            self._busy.release()

    def _blocking(self, deadline, what, fn, *args):
        """``fn(*args)``, a blocking MPI collective, waited for until ``deadline`` (``BlockingRunner``): a
        rank with a deadline makes the same call as its peers without one."""
        if self._runner is None:
            self._runner = BlockingRunner()
        self._runner.call(deadline, what, fn, *args)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """Free (collective) on a normal exit only.  An exception may have left this rank alone: a
        collective free would then wait for peers still inside the block (seen as a test suite hung
        until its timeout when one rank failed an assertion).  The resources then go with the
        process, or the job's abort (``ddlkernels.abort_on_exception``)."""
        if exc_type is None:
            self.free()

    # -- planning ------------------------------------------------------------
    def plan(self, nbytes: int = 0, dims=None) -> Plan:
        """The box and rank order a collective of ``nbytes`` bytes uses.

        ``dims=None`` lets the planner choose (``ddlkernels.planner``): every
        factorization of the communicator into a box is costed on
        ``self.topology`` for this size and the fastest is taken, so small
        messages get shapes with few ring steps (latency) and large ones
        shapes whose deepest rings cross the fewest slow links (bandwidth).
        Explicit ``dims`` are used as given.  Either way the ring order
        follows the topology: ranks of one node are neighbours.
        """
        if dims is not None:
            key = tuple(dims)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plans[key] = Plan(validate_dims(dims, self.size), self._order)
            return plan
        from .planner import _bucket, choose_plan

        key = _bucket(nbytes)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = choose_plan(self.topology, self.size, nbytes, chunk_bytes=self.chunk_bytes)[0]
        return plan

    def _shard_plan(self, dims):
        """The box of reduce_scatter / allgather: fixed per communicator, so shards depend on ``count`` only.

        With ``dims=None`` it is the planner's choice for bandwidth-bound
        messages (1 GiB): the two halves are used on large buffers (sharded
        optimizers), and a box that changed with the dtype's size would make
        ``shard_range(count)`` ambiguous.
        """
        return self.plan(0, dims) if dims is not None else self.plan(_SHARD_PLAN_BYTES)

    def _all_shards(self, count: int, dims):
        """Every rank's ``shard_range(count, dims)``, cached: a small reduce_scatter or allgather pays for it once."""
        key = (count, None if dims is None else tuple(dims))
        hit = self._shard_cache.get(key)
        if hit is None:
            plan = self._shard_plan(dims)
            if len(self._shard_cache) >= 1024:  # a job with ever new sizes must not grow this without bound
                self._shard_cache.clear()
            hit = self._shard_cache[key] = [shard_bounds(count, plan.dims, plan.index_of(r)) for r in range(self.size)]
        return hit

    def shard_range(self, count: int, dims=None, rank: int | None = None) -> tuple[int, int]:
        """``(start, stop)``: the elements ``reduce_scatter`` leaves on ``rank`` (default: this rank).

        ``count`` is the element count of the whole buffer; the range is the
        nested balanced cut of ``ddlkernels.ring.schedule.shard_bounds`` over the
        plan's box, so ranges of different ranks differ by at most
        ``len(dims)`` elements and, for the flat ring, rank r owns block r.
        """
        plan = self._shard_plan(dims)
        r = self.rank if rank is None else rank
        return shard_bounds(count, plan.dims, plan.index_of(r))

    def _schedule(self, count, plan, kind):
        key = (count, plan, kind)
        s = self._schedules.get(key)
        if s is None:
            if len(self._schedules) > 256:
                self._schedules.clear()
            s = build_schedule(count, plan, self.rank, reduce_scatter=kind != "ag", allgather=kind != "rs")
            self._schedules[key] = s
        return s

    # -- buffers -------------------------------------------------------------
    def _slots(self, backend, dtype, chunk):
        key = ("slots", _where(backend), dtype, chunk, self.window)
        slots = self._buffers.get(key)
        if slots is None:
            slots = [backend.empty(chunk + ALIGN_PAD, dtype) for _ in range(self.window)]
            self._buffers[key] = slots
        return slots

    def _scratch(self, backend, dtype, count):
        key = ("scratch", _where(backend), dtype)
        buf = self._buffers.get(key)
        if buf is None or len(buf) < count:
            buf = backend.empty(max(count, 1), dtype)
            self._buffers[key] = buf
        return buf[:count]

    def reusable_buffer(self, tag, backend, dtype, count: int):
        """A 1-D buffer of ``count`` elements kept under ``tag`` and reused by later calls.

        For callers that pack data into staging memory on every call (the
        fusion buffers of ``allreduce_many``): the buffer grows to the largest
        ``count`` asked for under ``(tag, backend, dtype)`` and a prefix view
        is returned, so steady-state calls allocate nothing.  Two views of
        one tag alias each other; use distinct tags for buffers alive at once.
        """
        key = ("reusable", tag, _where(backend), np.dtype(dtype))
        buf = self._buffers.get(key)
        if buf is None or len(buf) < count:
            buf = backend.empty(max(int(count), 1), dtype)
            self._buffers[key] = buf
        return buf[:count]

    def empty(self, shape, dtype="float32") -> np.ndarray:
        """An uninitialized host array that every rank of this node can read: a collective's input for free.

        Collective: every rank calls with the same ``shape`` and ``dtype``
        (checked; a mismatch raises the same ``ValueError`` on every rank).
        When every rank shares one node and the shared-memory allreduce is
        not turned off (``shm``), the array lies in an MPI shared window, and
        a large allreduce or reduce_scatter through the window whose input
        lies in such an array (the whole array or any contiguous part of it),
        or an allgather whose shard does, skips the copy that otherwise
        stages it for its peers (``ddlkernels._shm``); a call where only
        some ranks' inputs do is still correct.  Otherwise it is an ordinary
        ``numpy.empty``.  Shards of unequal length: allocate the longest on
        every rank and use a prefix.

        ``free()`` (or the end of a ``with`` block) releases its memory, unless
        an array of it is still referenced on some rank: then the memory stays
        mapped on every rank until MPI finalizes, an ordinary array to the code
        holding it (``ddlkernels._shm.ShmAllreduce.free``).
        """
        dt = check_dtype(np.dtype(dtype))
        shape = (operator.index(shape),) if np.ndim(shape) == 0 else tuple(operator.index(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"empty: negative dimension in shape {shape}")
        from ._fusion import check_same_on_all_ranks

        with self._exclusive("empty"):
            # Its signature layout: (call, op, settings, then one (dtype, shape) per array).
            check_same_on_all_ranks(self.comm, ("empty", "-", (), (dt.str, shape)),
                                    "empty: every rank must ask for the same shape and dtype")
            count = int(np.prod(shape, dtype=np.int64))
            if self._shm_mode is None:
                return np.empty(shape, dt)
            return self._shm_collectives().empty(count * dt.itemsize).view(dt).reshape(shape)

    def _transport(self, backend):
        where = _where(backend)
        t = self._transports.get(where)
        if t is None:
            if backend.device and not self.cuda_aware(backend)[0]:
                from .transport.staged import StagedTransport

                t = StagedTransport(self.comm, backend, self.chunk_bytes, self.window)
            else:
                t = HostTransport(self.comm, backend)
            self._transports[where] = t
        return t

    def cuda_aware(self, backend=None):
        """``(aware, reason)``: whether device buffers go straight to MPI."""
        if self.cuda_aware_override is not None:
            return self.cuda_aware_override, "set explicitly"
        from .transport.cuda_aware import cuda_aware

        return cuda_aware(self.comm)

    # -- argument checks (local, before any communication) ------------------
    def _prepare(self, x, op, chunk_bytes, dims, backend_name=None):
        opname = normalize_op(op)
        backend = backend_for(x, backend_name)
        dtype = check_dtype(backend.dtype(x))
        if dims is not None:
            validate_dims(dims, self.size)
        chunk_bytes = self.chunk_bytes if chunk_bytes is None else _positive("chunk_bytes", chunk_bytes)
        chunk = max(1, chunk_bytes // dtype.itemsize)
        return opname, backend, dtype, chunk

    def _flat_input(self, backend, x):
        try:
            return backend.flat(x), False
        except ValueError:
            if backend.device:
                raise ValueError(
                    "ddlkernels needs a C-contiguous device array; call .copy() (CuPy/torch: .contiguous()) first"
                ) from None
            # Host: reduce a contiguous copy instead (never silently wrong).
            return np.ascontiguousarray(backend_input_numpy(x)).reshape(-1), True

    # -- collectives ---------------------------------------------------------
    def _break(self, reason):
        """Mark this Communicator unusable after a timeout, and keep everything it owns (``free``)."""
        self._broken = reason
        self._fast_ok = False  # the fast paths do not look at _broken
        abandon(self)  # its buffers, windows and requests may still be used by MPI and by late peers

    def _usable(self):
        """``RuntimeError`` if an earlier collective timed out (its messages are still in flight)."""
        if self._broken is not None:
            raise RuntimeError(
                "this Communicator is unusable: an earlier collective timed out with messages still in flight "
                f"({self._broken}); create a new Communicator or abort the job"
            )

    def _call(self, kind, validate, timeout):
        """The ``Call`` (validation and deadline) of one collective, or None when it needs neither."""
        self._usable()
        v = self.validate if validate is None else bool(validate)
        try:
            t = self.timeout if timeout is None else _check_timeout(timeout)
        except ValueError as exc:
            if v:  # the other ranks are in the argument check: they raise too, instead of waiting
                report_local_failure(self.comm, kind=kind, error=exc)
            raise
        if not v and t is None:
            return None
        return Call(self, kind, v, None if t is None else Deadline(kind, self.rank, t))

    def allreduce(self, x, op="sum", *, out=None, dims=None, chunk_bytes=None, backend=None, validate=None,
                  timeout=None, stream=None):
        """Reduce ``x`` over all ranks; every rank gets the same bits.

        ``op``: "sum", "avg", "max", "min", "prod" or ``MPI.SUM``/``MAX``/``MIN``/``PROD``.
        ``out``: where to put the result (same shape and dtype as ``x``,
        writeable, sharing no memory with ``x``); ``out=x`` (the same
        object) reduces in place.  ``dims``: the box, e.g. ``(4, 16)``, whose
        product is the communicator size; ``None`` lets the library choose.
        ``chunk_bytes``: pipeline chunk for this call.  ``backend``: force an
        array backend by name ("numpy", "cupy", "numba").  ``validate``: check
        that every rank passed the same arguments first (default: the
        Communicator's).  ``timeout``: seconds before ``CollectiveTimeout``
        (default: the Communicator's).  ``stream`` (device arrays): the
        stream the call is ordered on -- a CuPy, torch or Numba stream or a
        raw ``cudaStream_t``; default the caller's current stream for the
        array's library (torch's current stream, CuPy's current stream,
        Numba's default stream).  The call reads ``x`` after the work queued
        there before it, and work queued there after it sees the result.
        Returns ``out``, or a new array of ``x``'s type, shape and device.
        """
        if not self._busy.acquire(False):  # _exclusive, inlined: this path exists for microseconds
            raise _in_use("allreduce")
        try:
            if type(x) is np.ndarray and self._plain_call(dims, chunk_bytes, backend, validate, timeout):
                done = self._small_fast(x, op, out)
                if done is not None:
                    return done
            call = self._call("allreduce", validate, timeout)
            if call is None:
                return self._allreduce(x, op, out, dims, chunk_bytes, backend, None, stream)
            with call:
                return self._allreduce(x, op, out, dims, chunk_bytes, backend, call, stream)
        finally:
            self._busy.release()

    def _plain_call(self, dims, chunk_bytes, backend, validate, timeout):
        """No per-call option that the fast paths leave to the full path, and no per-communicator check."""
        return (dims is None and chunk_bytes is None and backend is None and validate is None and timeout is None
                and self._fast_ok)

    def _small_fast(self, x, op, out):
        """Small numpy arrays of MPI's types: straight to ``MPI_Allreduce``, or ``None`` for the full path.

        Latency-bound calls are where microseconds of Python show (MPI's own
        allreduce of 4 KiB takes ~3 us at 2 ranks here).  This path makes the
        same decisions as the full one -- sizes the tuner has settled on MPI's
        blocking or nonblocking call or the shared-memory allreduce, or below
        a fixed ``small_bytes`` -- and
        the same argument checks, in a handful of operations; anything unusual
        (or a size still being measured) falls through to the full path.
        """
        dt = x.dtype
        hit = self._fast.get((op, dt, x.nbytes)) if op.__class__ is str else None
        if not hit:
            if hit is False:  # settled on the ring (or shared memory for "avg"): the full path
                return None
            hit = self._fast_entry(op, dt, x.nbytes)
            if not hit:
                return None
        xflags = x.flags
        if not xflags.c_contiguous:
            return None
        if out is None:
            dst = np.empty_like(x)
        elif out is x:
            if not xflags.writeable:
                return None  # the full path raises
            dst = x
        elif (out.__class__ is np.ndarray and out.dtype == dt and out.shape == x.shape
              and (oflags := out.flags).c_contiguous and oflags.writeable and _apart(out, oflags, x, xflags)):
            dst = out
        else:
            return None  # the full path says what is wrong with out
        algo, how, avg, watch, recount = hit  # how: the MPI op, or for the window the op's name or a small_fn
        if watch is not None:  # a watched size (ddlkernels._tuner.WATCH_FROM): time the call for the tuner
            t0 = perf_counter()
        if algo == "shm" or algo == "shm-nt":
            if how.__class__ is str:
                self._shm.run(x.reshape(-1), dst.reshape(-1), how, None, spill=algo == "shm-nt")
            else:
                how(x if x.ndim == 1 else x.reshape(-1), dst if dst.ndim == 1 else dst.reshape(-1))
        elif algo == "cma":
            how(x if x.ndim == 1 else x.reshape(-1), dst if dst.ndim == 1 else dst.reshape(-1))
        else:
            # MPI_IN_PLACE on every rank, whichever placement each chose: MPI requires it of all ranks or none.
            # (The copy MPI makes itself out of place; ``[...] =`` is numpy's cheapest call for it.)
            if dst is not x:
                dst[...] = x
            if algo == "mpi":
                self.comm.Allreduce(_MPI_OPS["IN_PLACE"], dst, how)
            else:
                self.comm.Iallreduce(_MPI_OPS["IN_PLACE"], dst, how).Wait()
        if avg:
            _scale_inplace(dst, self.size)
        self.last_algorithm = algo
        if watch is not None and self._tuner.observe(self.comm, x.nbytes, watch, perf_counter() - t0):
            self._fast.clear()  # measured again: every rank reopened the size at once
        elif recount is not None:  # counted here or in _allreduce_flat, once per call, on every rank alike
            # SizeTuner.tick inlined: this path exists for the microseconds of small calls.
            recount.left -= 1
            if recount.left <= 0 and self._tuner.expire(recount):
                self._fast.clear()
        return dst

    def _fast_entry(self, op, dt, nbytes):
        """``(algorithm, how, avg?, watch, recount)`` of the fast path for this op, dtype and size; False
        (settled on the full path) or None (not settled, or not a fast-path case).  Settled answers are cached.
        ``watch``: the tuner's candidates when the size is watched (its calls go to ``SizeTuner.observe``),
        else None; ``recount``: the tuner's countdown of a settled size below WATCH_FROM, else None."""
        entry = _FAST_TABLE.get((op, dt.char)) if op.__class__ is str else None
        if entry is None or not dt.isnative or self._shm_mode:
            return None
        watch = recount = None
        if self.small_bytes is None:
            cands = candidates(nbytes, shm=self._shm_mode is not None, hier=self._hier_ok,
                               cma=self._cma_for(dt, "sum" if entry[1] else op))
            algo = self._tuner.decided(nbytes, cands)
            if algo is None:  # still measured
                return None
            if self._tuner.watched(nbytes, cands):
                watch = cands
            recount = self._tuner.recount(nbytes, cands)
        elif nbytes < self.small_bytes:
            algo = "mpi"
        else:
            return None
        if len(self._fast) >= 4096:  # a job with ever new sizes must not grow this without bound
            self._fast.clear()
        if algo in ("mpi", "nbc"):
            hit = (algo, entry[0], entry[1], watch, recount)
        elif (algo == "shm" or algo == "shm-nt") and not entry[1]:  # "avg" takes the full path
            if self._shm is None or not self._shm.allocated:
                return None  # the full path sets the window up (collectively); ask again after it
            fn = self._shm.small_fn(dt, nbytes // dt.itemsize, op, spill=algo == "shm-nt")
            hit = (algo, fn or op, False, watch, recount)
        elif algo == "cma":
            if self._cma is None or not self._shm.allocated or nbytes == 0:
                return None  # the full path sets it up (collectively); ask again after it
            hit = (algo, self._cma.fn(dt, nbytes // dt.itemsize, "sum" if entry[1] else op), entry[1], watch,
                   recount)
        else:
            hit = False
        self._fast[op, dt, nbytes] = hit
        return hit

    def _allreduce(self, x, op, out, dims, chunk_bytes, backend, call, stream=None):
        opname, be, dtype, chunk = self._prepare(x, op, chunk_bytes, dims, backend)
        with self._device_call(be, x, stream):
            return self._allreduce_on(be, x, opname, dtype, chunk, out, dims, call)

    def _device_call(self, be, x, stream):
        """The caller's stream as this thread's compute stream for one call on ``x`` (device arrays).

        The call waits, on that stream, for the last device call of this Communicator (on whatever
        stream it ran): its receive slots, scratch buffers and fusion buffers are reused by every
        call, and a call on another stream must not write them while an earlier one may still read
        them.  No host block: one event recorded and one waited per call.
        """
        if not be.device:
            if stream is not None:
                raise ValueError("stream= orders device work; the arrays of this call are host arrays")
            return contextlib.nullcontext()
        return self._on_stream(be, be.call_stream(x, stream), be.device_id(x))

    @contextlib.contextmanager
    def _on_stream(self, be, s, device):
        with be.using(s, device):
            tail = self._tails.get(_where(be))
            if tail is not None:
                be.wait(s, tail)
            try:
                yield s
            finally:
                self._tails[_where(be)] = be.record(s)

    def _allreduce_on(self, be, x, opname, dtype, chunk, out, dims, call):
        src, src_copied = self._flat_input(be, x)
        count = src.shape[0]
        inplace = out is x
        if out is not None and not inplace:
            _check_out(be, out, x, dtype)
        if out is not None and not be.device and not backend_input_numpy(out).flags.writeable:
            raise ValueError("allreduce: " + ("x is read-only, and out=x reduces in place" if inplace
                                              else "out is read-only"))
        if inplace:
            dst, dst_copied = (src, src_copied)
        elif out is not None:
            dst, dst_copied = self._flat_input(be, out)
            # Any byte of x under out: writing out would change the input, and a peer reading my x (cma, the
            # window's shared inputs) or MPI itself could read the result instead.
            if be.overlaps(src, dst) if not (src_copied or dst_copied) else _host_overlap(x, out):
                raise ValueError("allreduce: out overlaps the input; pass out=x itself to reduce in place")
            if dst_copied:
                dst = np.empty_like(dst)
        else:
            dst, dst_copied = be.empty(count, dtype), False
        self._allreduce_flat(src if not inplace else dst, dst, opname, be, dtype, chunk, dims, call)
        if dst_copied:
            target = out if out is not None else x
            np.copyto(backend_input_numpy(target), dst.reshape(np.shape(target)))
            return target
        if out is not None:
            return out
        return be.like(dst, x)

    def _choices(self, nbytes, device, dtype, redop, dims, avg=False):
        """``(algorithm, None)`` when the path is fixed, ``(None, candidates)`` when the tuner measures."""
        # MPI's MAX/MIN on floats drop a NaN depending on the order of operands
        # (Open MPI computes a > b ? a : b); numpy's maximum/minimum, and so the
        # ring, propagate it.  Sums and products propagate NaN/Inf either way.
        use_mpi = (
            self.size > 1
            and not device
            and dims is None
            and dtype in _MPI_NATIVE
            and (redop in ("sum", "prod") or dtype.kind in "iu")
        )
        # The shared-memory allreduce: host arrays, ranks on one node, no box asked for.
        use_shm = self._shm_mode is not None and not device and dims is None
        if use_shm and self._shm_mode:
            return "shm", None
        # Across nodes: the same, inside each node (not float16/bfloat16 "avg",
        # whose scale the backend fuses into the last sum before rounding).
        use_hier = (self._hier_ok and not device and dims is None
                    and not (avg and is_half(dtype)))
        if self.small_bytes is None:
            if use_mpi or use_shm or use_hier:
                return None, candidates(nbytes, mpi=use_mpi, shm=use_shm, hier=use_hier,
                                        cma=use_shm and self._cma_for(dtype, redop))
        elif use_mpi and nbytes < self.small_bytes:
            return "mpi", None
        return "ring", None

    def tuning(self, x, op="sum", *, collective="allreduce") -> bool:
        """Whether ``allreduce(x, op)`` on this communicator is still one of the tuner's timed trials.

        The same on every rank (in place or not: calls of both placements are
        measured together, since ranks may differ in it).  Benchmarks call until it is False, so that
        timed iterations run the settled algorithm (``ddlkernels._tuner``).
        From ``WATCH_FROM`` bytes a settled size becomes a trial again if its
        calls slow down past what its trials allow (``SizeTuner.observe``).
        ``collective="reduce_scatter"`` or ``"allgather"`` asks the same of
        those collectives for a whole buffer like ``x`` (for allgather: the
        gathered size, not the shard's).
        """
        opname, be, dtype, _ = self._prepare(x, op, None, None, None)
        nbytes = _size(x) * dtype.itemsize
        if collective != "allreduce":
            count = _size(x)
            mpi = (self._rs_mpi_ok(dtype, "sum" if opname == "avg" else opname, count) if collective == "reduce_scatter"
                   else self._ag_mpi_ok(count, nbytes))
            _, cands = self._shard_choices(nbytes, be.device, None, mpi, collective)
            return cands is not None and self._shard_tuners[collective].decided(nbytes, cands) is None
        redop = "sum" if opname == "avg" else opname
        _, cands = self._choices(nbytes, be.device, dtype, redop, None, opname == "avg")
        return cands is not None and self._tuner.decided(nbytes, cands) is None

    def _shard_choices(self, nbytes, device, dims, mpi=False, kind="reduce_scatter"):
        """reduce_scatter / allgather (``kind``): ``(algorithm, None)`` when fixed, ``(None, candidates)`` when
        measured.

        ``mpi``: whether MPI's own collective computes this call
        (``_rs_mpi_ok`` / ``_ag_mpi_ok``); it is then the incumbent, as
        ``MPI_Allreduce`` is for allreduce: the ring and the shared-memory
        window must beat it by the tuner's margin.  An allgather from
        ``GATHER_STREAM_FROM`` bytes also measures the window writing its
        output with non-temporal stores, "shm-nt" ("shm" then writes it
        normally); a window forced on (``shm=True``) streams from that size.
        An allgather from ``CMA_GATHER_FROM`` bytes also measures "cma", every
        rank reading its peers' shards where they lie (``ddlkernels._cma``),
        where the ranks may read each other's memory.
        """
        if device or dims is not None:
            return "ring", None
        if self._shm_mode:
            return "shm", None
        if self.small_bytes is not None:  # a fixed threshold: MPI's own call below it, where it applies, the ring from it
            return ("mpi" if mpi and nbytes < self.small_bytes else "ring"), None
        shm = self._shm_mode is not None
        gather = kind == "allgather"
        cands = (("mpi",) * bool(mpi) + ("ring",) + ("shm",) * shm
                 + ("shm-nt",) * (shm and gather and nbytes >= GATHER_STREAM_FROM)
                 + ("cma",) * (gather and self._cma_ok and nbytes >= CMA_GATHER_FROM))
        return (cands[0], None) if len(cands) == 1 else (None, cands)

    def _gather_stream(self, algo):
        """``ShmAllreduce.allgather``'s ``stream`` for the window's algorithm ``algo`` ("shm" or "shm-nt"):
        the window's own size rule (None) when it is forced on, else what the tuner chose.  Below
        ``GATHER_STREAM_FROM``, where the tuner weighs "shm" alone, that rule says False too."""
        return None if self._shm_mode else algo == "shm-nt"

    def _rank_ordered(self, count):
        """Whether the flat shards of ``count`` elements lie in rank order, as MPI's own collectives place blocks."""
        b = self._all_shards(count, None)
        return all(b[r][1] == b[r + 1][0] for r in range(self.size - 1))

    def _rs_mpi_ok(self, dtype, redop, count):
        """``MPI_Reduce_scatter`` computes this reduce_scatter: MPI's types and ops (float max/min excepted, as for
        allreduce), rank-ordered shards, counts that fit an int."""
        return (self.size > 1 and dtype in _MPI_NATIVE and (redop in ("sum", "prod") or dtype.kind in "iu")
                and count < 2**31 and self._rank_ordered(count))

    def _ag_mpi_ok(self, count, nbytes):
        """``MPI_Allgatherv`` (on bytes, so any dtype) computes this allgather: rank-ordered shards, int counts."""
        return self.size > 1 and nbytes < 2**31 and self._rank_ordered(count)

    def _shard_path(self, kind, nbytes, device, dims, run, mpi=False, deadline=None):
        """Choose (and time, while measuring) the algorithm of one reduce_scatter / allgather; ``run(algo)``.
        ``deadline``: the call's, for the tuner's agreements."""
        algo, cands = self._shard_choices(nbytes, device, dims, mpi, kind)
        if cands is None:
            return run(algo)
        tuner = self._shard_tuners[kind]
        algo, trial = tuner.choose(nbytes, cands)
        if not trial:
            if not tuner.watched(nbytes, cands):
                result = run(algo)
                if tuner.count(nbytes, cands):  # reopened on every rank at this call
                    (self._rs_fast_cache if kind == "reduce_scatter" else self._ag_fast_cache).clear()
                return result
            t0 = perf_counter()  # a watched size (ddlkernels._tuner.WATCH_FROM): every call counted
            result = run(algo)
            if tuner.observe(self.comm, nbytes, cands, perf_counter() - t0, deadline=deadline):
                # Reopened on every rank at this call: no fast path may serve the old choice.
                (self._rs_fast_cache if kind == "reduce_scatter" else self._ag_fast_cache).clear()
            return result
        t0 = perf_counter()
        result = run(algo)
        tuner.record(self.comm, nbytes, cands, algo, perf_counter() - t0, deadline=deadline)
        return result

    def _shm_collectives(self):
        if self._shm is None:
            self._shm = ShmAllreduce(self.comm)
        return self._shm

    def _cma_for(self, dtype, redop):
        """Whether the single-copy allreduce computes ``redop`` ("avg": "sum") on ``dtype`` here: its probe
        passed, and numpy's own ufunc does the op (``ddlkernels._cma``)."""
        return self._cma_ok and _ufunc(dtype, redop) is not None

    def _cma_collectives(self):
        if self._cma is None:
            self._cma = CmaAllreduce(self._shm_collectives(), pids=self._cma_pids)
        return self._cma

    def _allreduce_flat(self, src, dst, opname, be, dtype, chunk, dims, call=None):
        count = src.shape[0]
        nbytes = count * dtype.itemsize
        avg = opname == "avg"
        redop = "sum" if avg else opname
        trial = False
        algo, cands = self._choices(nbytes, be.device, dtype, redop, dims, avg)
        deadline = None if call is None else call.deadline
        if cands is not None:
            algo, trial = self._tuner.choose(nbytes, cands)
        if trial:
            t0 = perf_counter()
            self._allreduce_path(algo, src, dst, opname, redop, avg, be, dtype, chunk, dims, count, call)
            self._tuner.record(self.comm, nbytes, cands, algo, perf_counter() - t0, deadline=deadline)
        elif cands is not None and self._tuner.watched(nbytes, cands):
            # Every call of a watched size is counted, here or in _small_fast, on every rank alike.
            t0 = perf_counter()
            self._allreduce_path(algo, src, dst, opname, redop, avg, be, dtype, chunk, dims, count, call)
            if self._tuner.observe(self.comm, nbytes, cands, perf_counter() - t0, deadline=deadline):
                self._fast.clear()
        else:
            self._allreduce_path(algo, src, dst, opname, redop, avg, be, dtype, chunk, dims, count, call)
            if cands is not None and self._tuner.count(nbytes, cands):
                self._fast.clear()  # measured again from the next call, on every rank

    def _allreduce_path(self, algo, src, dst, opname, redop, avg, be, dtype, chunk, dims, count, call):
        """Run ``algo``: "mpi" (MPI_Allreduce), "nbc" (MPI_Iallreduce + Wait), "shm" / "shm-nt" (shared window,
        result blocks written normally / with non-temporal stores), "cma" (single copy), "hier" or "ring".

        What a call needs is allocated before the argument check (``call.agree``): a rank that fails there
        fails locally, which ``validate`` announces to the others."""
        deadline = None if call is None else call.deadline
        slots = self._slots(be, dtype, chunk) if algo == "ring" else None
        if call is not None:
            call.agree(count=count, dtype=dtype, op=opname, dims=dims, chunk=None if algo != "ring" else chunk,
                       path=algo)
        if algo == "shm" or algo == "shm-nt":
            self.last_algorithm = algo
            self._shm_collectives().run(src, dst, redop, be.reduce, avg_p=self.size if avg else None,
                                        deadline=deadline, spill=algo == "shm-nt")
            return
        if algo == "cma":
            self.last_algorithm = algo
            if src.__class__ is Segments:  # peers read one buffer: pack first, then reduce in place
                src.copy_to(dst, 0, count)
                src = dst
            try:
                self._cma_collectives().run(src, dst, redop, deadline=deadline)
            except CollectiveTimeout:
                abandon(src, dst)  # a late peer still reads x and writes out where they lie, in this process
                raise
            if avg:
                _scale_inplace(dst, self.size)
            return
        if algo == "hier":
            self.last_algorithm = algo
            if src.__class__ is Segments:  # its reduce-scatter reads one buffer: pack first
                src.copy_to(dst, 0, count)
                src = dst
            if self._hier is None:  # collective: every rank chose "hier" for this same call
                # Every rank is here (a nonblocking barrier under the call's deadline) before the blocking
                # collectives that set it up.
                complete(self.comm.Ibarrier(), deadline, "the hierarchical allreduce's setup (MPI_Ibarrier)")
                self._hier = _hier.HierAllreduce(self.comm, self._hier_node)
            self._hier.run(src, dst, redop, be.reduce, avg_p=self.size if avg else None, deadline=deadline)
            return
        if algo != "ring":
            self.last_algorithm = algo
            if src.__class__ is Segments:  # MPI needs one buffer: pack, then reduce in place
                src.copy_to(dst, 0, count)
            elif src is not dst:
                be.copy(dst, src)
            # MPI_IN_PLACE on every rank, whichever placement each chose: MPI requires it of all ranks or none.
            # The same call with or without a deadline: blocking and nonblocking collectives never match.
            mpi_op, in_place = _mpi_op(redop), _mpi_op("IN_PLACE")
            if algo == "nbc":
                complete(self.comm.Iallreduce(in_place, dst, mpi_op), deadline, "MPI_Iallreduce")
            elif deadline is None:
                self.comm.Allreduce(in_place, dst, mpi_op)
            else:
                self._blocking(deadline, "MPI_Allreduce", self.comm.Allreduce, in_place, dst, mpi_op)
            if avg:
                _scale_inplace(dst, self.size)
            return
        self.last_algorithm = "ring"
        plan = self.plan(count * dtype.itemsize, dims)
        self._run_ring(self._schedule(count, plan, "ar"), src, dst, opname, be, dtype, chunk, call, slots)

    def _allreduce_segments(self, segments, out, op="sum", *, dims=None, chunk_bytes=None):
        """Reduce the virtual buffer ``segments`` (``ddlkernels._engine.Segments``) into the host array ``out``.

        Internal, for ``allreduce_many``: what a fusion bucket costs without
        packing it first, the ring reading each array where it lies.  ``out``
        is 1-D, C-contiguous, of ``segments.count`` elements and the same
        dtype, and shares no memory with the arrays.  ``dims`` and
        ``chunk_bytes`` as for ``allreduce``;
        validation and timeout as the Communicator's.
        """
        opname, be, dtype, chunk = self._prepare(out, op, chunk_bytes, dims, "numpy")
        if dtype != segments.dtype or out.shape != segments.shape or not out.flags.c_contiguous:
            raise ValueError(
                f"_allreduce_segments: out must be a contiguous {dtype_name(segments.dtype)}[{segments.count}], "
                f"got {dtype_name(dtype)}{list(out.shape)}"
            )
        with self._exclusive("allreduce_many"):
            call = self._call("allreduce", None, None)
            if call is None:
                self._allreduce_flat(segments, out, opname, be, dtype, chunk, dims)
            else:
                with call:
                    self._allreduce_flat(segments, out, opname, be, dtype, chunk, dims, call)
        return out

    def _run_ring(self, sched, src, out, opname, be, dtype, chunk, call, slots):
        """Execute ``sched`` with this communicator's transport and ``slots``; "avg" is the sum with a fused
        scale."""
        avg = opname == "avg"
        execute(
            sched,
            src,
            out,
            "sum" if avg else opname,
            backend=be,
            transport=self._transport(be),
            chunk=chunk,
            slots=slots,
            avg_p=self.size if avg else None,
            deadline=None if call is None else call.deadline,
        )

    def Allreduce(self, sendbuf, recvbuf, op=None, *, validate=None, timeout=None):
        """mpi4py's ``comm.Allreduce(sendbuf, recvbuf, op)``, ``MPI.IN_PLACE`` included.

        As in mpi4py, the buffers need equal element counts, not equal
        shapes; ``recvbuf`` is overwritten and nothing is returned.  Either
        buffer may be an mpi4py buffer specification: ``[buf, MPI.FLOAT]``,
        ``[buf, count, MPI.FLOAT]``, ``[buf, (count, displ), MPI.FLOAT]``,
        ``[buf, count]``; the datatype must be the one of ``buf``'s elements
        (MPI has none for float16 and bfloat16: pass such arrays alone).
        ``op``: an ``MPI.Op``, a name, or a ``torch.distributed.ReduceOp``.
        ``validate`` and ``timeout`` as for ``allreduce``.
        """
        if not self._busy.acquire(False):
            raise _in_use("Allreduce")
        try:
            if validate is None and timeout is None and self._fast_ok and type(recvbuf) is np.ndarray:
                # The small-message fast path of ``allreduce``, for numpy buffers of one shape.
                name = "sum" if op is None or op is _MPI_OPS["sum"] else normalize_op(op)
                if sendbuf is _MPI_OPS["IN_PLACE"]:
                    if self._small_fast(recvbuf, name, recvbuf) is not None:
                        return None
                elif type(sendbuf) is np.ndarray and sendbuf.shape == recvbuf.shape:
                    if self._small_fast(sendbuf, name, recvbuf) is not None:
                        return None
            call = self._call("allreduce", validate, timeout)
            if call is None:
                return self._Allreduce(sendbuf, recvbuf, op, None)
            with call:
                return self._Allreduce(sendbuf, recvbuf, op, call)
        finally:
            self._busy.release()

    def _Allreduce(self, sendbuf, recvbuf, op, call):
        from mpi4py import MPI

        op = MPI.SUM if op is None else op
        recvbuf = _buffer_spec(recvbuf, "recvbuf")
        if sendbuf is MPI.IN_PLACE:
            self._allreduce(recvbuf, op, recvbuf, None, None, None, call)
            return
        sendbuf = _buffer_spec(sendbuf, "sendbuf")
        if tuple(sendbuf.shape) != tuple(recvbuf.shape):
            if _size(sendbuf) != _size(recvbuf):
                raise ValueError(f"recvbuf holds {_size(recvbuf)} elements but sendbuf holds {_size(sendbuf)}")
            be = backend_for(recvbuf)
            try:
                flat_out = be.flat(recvbuf)
            except ValueError:
                raise ValueError("recvbuf must be C-contiguous when its shape differs from sendbuf's") from None
            self._allreduce(sendbuf.reshape(-1), op, flat_out, None, None, None, call)
            return
        self._allreduce(sendbuf, op, recvbuf, None, None, None, call)

    def reduce_scatter(self, x, op="sum", *, out=None, dims=None, chunk_bytes=None, backend=None, validate=None,
                       timeout=None, stream=None):
        """Reduce ``x`` over all ranks and return this rank's shard (a new 1-D array, or ``out``).

        The shard is ``x.reshape(-1)[start:stop]`` of the reduced buffer with
        ``(start, stop) = shard_range(x.size, dims)``.  ``x`` is not modified.
        ``out``: a contiguous 1-D array of ``stop - start`` elements of
        ``x``'s dtype, backend and device, not overlapping ``x``, to write
        the shard into (a loop of calls then allocates nothing).
        ``validate``, ``timeout`` and ``stream`` as for ``allreduce``.
        """
        if not self._busy.acquire(False):
            raise _in_use("reduce_scatter")
        try:
            if type(x) is np.ndarray and self._plain_call(dims, chunk_bytes, backend, validate, timeout):
                done = self._rs_fast(x, op, out)
                if done is not None:
                    return done
            call = self._call("reduce_scatter", validate, timeout)
            if call is None:
                return self._reduce_scatter(x, op, out, dims, chunk_bytes, backend, None, stream)
            with call:
                return self._reduce_scatter(x, op, out, dims, chunk_bytes, backend, call, stream)
        finally:
            self._busy.release()

    def _shard_fast_algo(self, kind, nbytes, cands):
        """What a shard fast path may run for this settled size: ``(algorithm, watch)``, or ``(None, None)``
        while it is still measured.  ``watch``: None, or ``(tuner, nbytes, cands)`` for a watched size,
        whose every call the fast path must time and pass to ``tuner.observe``, or ``(tuner, recount)``
        for a size below WATCH_FROM, whose calls it must count down (``_shard_watch``)."""
        tuner = self._shard_tuners[kind]
        algo = tuner.decided(nbytes, cands)
        if algo is None:
            return None, None
        if tuner.watched(nbytes, cands):
            return algo, (tuner, nbytes, cands)
        recount = tuner.recount(nbytes, cands)
        return algo, (None if recount is None else (tuner, recount))

    def _shard_watch(self, watch, t0, cache):
        """Count one fast-path call (started at ``t0``, for a watched size) of a watched or counted shard size;
        when the tuner reopens it, forget the fast paths' decisions (``cache``), so that the next calls take
        the full path and its trials."""
        if len(watch) == 2:  # (tuner, its _Recount)
            reopened = watch[0].tick(watch[1])
        else:  # (tuner, nbytes, cands)
            reopened = watch[0].observe(self.comm, watch[1], watch[2], perf_counter() - t0)
        if reopened:
            cache.clear()

    def _rs_fast(self, x, op, out):
        """A reduce_scatter the tuner has settled on MPI or shared memory: straight to it, or None.

        Like ``_small_fast``: the same decision as the full path, cached per
        (op, dtype, count) once settled, with the argument checks done the
        first time; everything else takes the full path.
        """
        if op.__class__ is not str or not x.flags.c_contiguous:
            return None
        key = (op, x.dtype, x.size)  # a native dtype never equals a byte-swapped one: checked once, below
        hit = self._rs_fast_cache.get(key)
        if hit is None:
            if not x.dtype.isnative:
                return None
            try:
                opname, dtype = normalize_op(op), check_dtype(x.dtype)
            except (TypeError, ValueError):
                return None  # the full path raises the error
            nbytes = x.size * dtype.itemsize
            avg = opname == "avg"
            redop = "sum" if avg else opname
            algo, cands = self._shard_choices(nbytes, False, None, self._rs_mpi_ok(dtype, redop, x.size))
            watch = None
            if cands is not None:
                algo, watch = self._shard_fast_algo("reduce_scatter", nbytes, cands)
                if algo is None:  # still measured
                    return None
            bounds = self._all_shards(x.size, None)
            mine = (bounds[self.rank][1] - bounds[self.rank][0],)  # my shard's shape
            if algo == "shm":
                if self._shm is None or not self._shm.allocated:
                    return None  # the full path sets the window up (collectively); ask again after it
                # The window's prepared call where it has one (small messages), else its reduce_scatter.
                fn = None if avg else self._shm.shard_fn("reduce_scatter", dtype, x.size, redop, bounds)
                hit = ("shm", mine, bounds, redop, self.size if avg else None, backend_for(x).reduce, fn, watch)
            elif algo == "mpi":
                counts = [hi - lo for lo, hi in bounds]
                hit = ("mpi", mine, None if len(set(counts)) == 1 else counts, _mpi_op(redop), avg, watch)
            else:
                hit = False
            if len(self._rs_fast_cache) >= 4096:
                self._rs_fast_cache.clear()
            self._rs_fast_cache[key] = hit
        if hit is False:
            return None
        if out is None:
            shard = np.empty(hit[1], x.dtype)
        elif _plain_out(out, x, hit[1]):
            shard = out
        else:
            return None  # the full path says what is wrong with out
        src = x if x.ndim == 1 else x.reshape(-1)
        watch = hit[-1]
        t0 = perf_counter() if watch is not None and len(watch) == 3 else 0.0  # only a watched size is timed
        if hit[0] == "mpi":
            if hit[2] is None:  # equal shards: MPI_Reduce_scatter_block (Open MPI runs other algorithms for it)
                self.comm.Reduce_scatter_block(src, shard, hit[3])
            else:
                self.comm.Reduce_scatter(src, shard, hit[2], hit[3])
            if hit[4]:
                _scale_inplace(shard, self.size)
        elif hit[6] is not None:  # the window's prepared call (ShmAllreduce.shard_fn)
            hit[6](src, shard)
        else:
            self._shm_collectives().reduce_scatter(src, shard, hit[2], hit[3], hit[5], avg_p=hit[4])
        self.last_algorithm = hit[0]
        if watch is not None:
            self._shard_watch(watch, t0, self._rs_fast_cache)
        return shard

    def _reduce_scatter(self, x, op, out, dims, chunk_bytes, backend, call, stream=None):
        opname, be, dtype, chunk = self._prepare(x, op, chunk_bytes, dims, backend)
        with self._device_call(be, x, stream):
            return self._reduce_scatter_on(be, x, opname, dtype, chunk, out, dims, call)

    def _reduce_scatter_on(self, be, x, opname, dtype, chunk, out, dims, call):
        src, _ = self._flat_input(be, x)
        count = src.shape[0]
        plan = self._shard_plan(dims)
        if out is not None:
            lo, hi = self._all_shards(count, dims)[self.rank]
            _check_shard_out(be, out, x, dtype, hi - lo, "reduce_scatter")
        avg = opname == "avg"
        redop = "sum" if avg else opname
        deadline = None if call is None else call.deadline

        def run(algo):
            # Everything allocated first: a rank that fails here fails locally (announced by validate).
            bounds = self._all_shards(count, dims)
            lo, hi = bounds[self.rank]
            shard = be.empty(hi - lo, dtype) if out is None else out
            if algo == "ring":
                work, slots = self._scratch(be, dtype, count), self._slots(be, dtype, chunk)
            if call is not None:
                call.agree(count=count, dtype=dtype, op=opname, dims=dims, chunk=chunk, path=algo)
            self.last_algorithm = algo
            if algo == "shm":
                self._shm_collectives().reduce_scatter(src, shard, bounds, redop, be.reduce,
                                                       avg_p=self.size if avg else None, deadline=deadline)
                return shard
            if algo == "mpi":
                counts = [b - a for a, b in bounds]
                mop = _mpi_op(redop)
                # The same blocking call with or without a deadline (``_blocking``): a nonblocking one would
                # not match the peers'.
                if len(set(counts)) == 1:  # equal shards: the block variant, which Open MPI runs differently
                    what, fn, args = "MPI_Reduce_scatter_block", self.comm.Reduce_scatter_block, (src, shard, mop)
                else:
                    what, fn, args = "MPI_Reduce_scatter", self.comm.Reduce_scatter, (src, shard, counts, mop)
                if deadline is None:
                    fn(*args)
                else:
                    self._blocking(deadline, what, fn, *args)
                if avg:
                    _scale_inplace(shard, self.size)
                return shard
            sched = self._schedule(count, plan, "rs")
            self._run_ring(sched, src, work, opname, be, dtype, chunk, call, slots)
            a, b = sched.shard
            be.copy(shard, work[a:b])
            return shard

        mpi = not be.device and dims is None and self._rs_mpi_ok(dtype, redop, count)
        return self._shard_path("reduce_scatter", count * dtype.itemsize, be.device, dims, run, mpi, deadline)

    def allgather(self, shard, *, count=None, out=None, dims=None, chunk_bytes=None, backend=None, validate=None,
                  timeout=None, stream=None):
        """Concatenate every rank's shard into the whole buffer (a new 1-D array on every rank).

        Rank r's shard goes to ``shard_range(count, dims, r)``; the lengths
        must be the ones that ``reduce_scatter`` produces.  ``count``: the
        elements of the whole buffer, the same on every rank (``validate``
        checks that); given, each rank checks its own shard's length locally
        and no lengths are exchanged; None: the ranks first allgather their
        shard lengths, derive ``count`` and check every length.  ``out``: a
        contiguous 1-D array of ``count`` elements of the shard's dtype,
        backend and device, not overlapping it, to gather into (a loop of
        calls then allocates nothing); it also gives ``count`` when that is
        None.  ``validate`` (dtype, dims, chunk and ``count``),
        ``timeout`` and ``stream`` as for ``allreduce``.
        """
        if not self._busy.acquire(False):
            raise _in_use("allgather")
        try:
            if count is None and out is not None:
                count = out.size if out.__class__ is np.ndarray else _size(out)
            if count is not None and type(shard) is np.ndarray and self._plain_call(dims, chunk_bytes, backend,
                                                                                      validate, timeout):
                done = self._ag_fast(shard, count, out)
                if done is not None:
                    return done
            call = self._call("allgather", validate, timeout)
            if call is None:
                return self._allgather(shard, count, out, dims, chunk_bytes, backend, None, stream)
            with call:
                return self._allgather(shard, count, out, dims, chunk_bytes, backend, call, stream)
        finally:
            self._busy.release()

    def _ag_fast(self, shard, count, out):
        """An allgather with ``count`` given, settled on MPI or shared memory: straight to it, or None."""
        if not shard.flags.c_contiguous or count.__class__ is not int:
            return None
        key = (shard.dtype, shard.size, count)  # a native dtype never equals a byte-swapped one: checked once
        hit = self._ag_fast_cache.get(key)
        if hit is None:
            if not shard.dtype.isnative:
                return None
            try:
                dtype = check_dtype(shard.dtype)
            except (TypeError, ValueError):
                return None  # the full path raises the error
            bounds = self._all_shards(count, None) if count >= 0 else None
            if bounds is None or bounds[self.rank][1] - bounds[self.rank][0] != shard.size:
                return None  # the full path raises the error
            nbytes = count * dtype.itemsize
            algo, cands = self._shard_choices(nbytes, False, None, self._ag_mpi_ok(count, nbytes), "allgather")
            watch = None
            if cands is not None:
                algo, watch = self._shard_fast_algo("allgather", nbytes, cands)
                if algo is None:  # still measured
                    return None
            if algo == "shm" or algo == "shm-nt":
                if self._shm is None or not self._shm.allocated:
                    return None  # the full path sets the window up (collectively); ask again after it
                stream = self._gather_stream(algo)
                fn = self._shm.shard_fn("allgather", dtype, count, None, bounds, stream)
                hit = (algo, bounds, fn, stream, watch)
            elif algo == "cma":
                if self._cma is None or not self._shm.allocated or count == 0:
                    return None  # the full path sets it up (collectively); ask again after it
                hit = (algo, bounds, self._cma.gather_fn(dtype, count, bounds), None, watch)
            elif algo == "mpi":
                item = dtype.itemsize
                sizes = [(b - a) * item for a, b in bounds]
                # MPI's own types go as they are; others (bfloat16, float16) as bytes.
                hit = ("mpi", None if len(set(sizes)) == 1 else sizes, [a * item for a, _ in bounds],
                       dtype not in _MPI_NATIVE, watch)
            else:
                hit = False
            if len(self._ag_fast_cache) >= 4096:
                self._ag_fast_cache.clear()
            self._ag_fast_cache[key] = hit
        if hit is False:
            return None
        if out is None:
            out = np.empty(count, shard.dtype)
        elif not _plain_out(out, shard, (count,)):
            return None  # the full path says what is wrong with out
        src = shard if shard.ndim == 1 else shard.reshape(-1)
        watch = hit[-1]
        t0 = perf_counter() if watch is not None and len(watch) == 3 else 0.0  # only a watched size is timed
        if hit[0] == "mpi":
            send, recv = (src.view(np.uint8), out.view(np.uint8)) if hit[3] else (src, out)
            if hit[1] is None:  # equal shards: MPI_Allgather, which Open MPI runs faster than Allgatherv
                self.comm.Allgather(send, recv)
            else:
                self.comm.Allgatherv(send.view(np.uint8), [recv.view(np.uint8), hit[1], hit[2], _MPI_OPS["BYTE"]])
        elif hit[2] is not None:  # the window's prepared call (ShmAllreduce.shard_fn)
            hit[2](src, out)
        else:
            self._shm_collectives().allgather(src, out, hit[1], stream=hit[3])
        self.last_algorithm = hit[0]
        if watch is not None:
            self._shard_watch(watch, t0, self._ag_fast_cache)
        return out

    def _allgather(self, shard, count, out, dims, chunk_bytes, backend, call, stream=None):
        _, be, dtype, chunk = self._prepare(shard, "sum", chunk_bytes, dims, backend)
        with self._device_call(be, shard, stream):
            return self._allgather_on(be, shard, dtype, chunk, count, out, dims, call)

    def _allgather_on(self, be, shard, dtype, chunk, count, out, dims, call):
        src, _ = self._flat_input(be, shard)
        deadline = None if call is None else call.deadline
        if count is None:
            lengths = np.empty(self.size, dtype=np.int64)
            if call is not None:
                call.agree(count=None, dtype=dtype, op=None, dims=dims, chunk=chunk, path="ring")
            # Nonblocking with or without a deadline, so that ranks with and without one meet in it.
            complete(self.comm.Iallgather(np.array([src.shape[0]], dtype=np.int64), lengths), deadline,
                     "the exchange of shard lengths (MPI_Iallgather)")
            count = int(lengths.sum())
            expect = self._all_shards(count, dims)
            bad = [r for r in range(self.size) if expect[r][1] - expect[r][0] != lengths[r]]
            if bad:
                detail = ", ".join(f"rank {r}: {lengths[r]} (expected {expect[r][1] - expect[r][0]})" for r in bad[:8])
                raise ValueError(f"allgather: shard lengths do not match shard_range of {count} elements: {detail}")
        else:
            try:
                count = operator.index(count)
            except TypeError:
                raise TypeError(f"allgather: count must be an integer, not {type(count).__name__}") from None
            if count < 0:
                raise ValueError(f"allgather: count must be >= 0, got {count}")
            expect = self._all_shards(count, dims)
            lo, hi = expect[self.rank]
            if src.shape[0] != hi - lo:  # known here, before any communication
                raise ValueError(f"allgather: this rank's shard has {src.shape[0]} elements but shard_range of "
                                 f"{count} elements gives it {hi - lo}")
            if out is not None:
                _check_shard_out(be, out, shard, dtype, count, "allgather")
        # Allocated before the argument check where count is known: a rank that fails here fails locally.
        dst = be.empty(count, dtype) if out is None else out
        if call is not None and not call.agreed:
            call.agree(count=count, dtype=dtype, op=None, dims=dims, chunk=chunk, path="ring")
        plan = self._shard_plan(dims)

        def run(algo):
            self.last_algorithm = algo
            if algo == "cma":
                try:
                    self._cma_collectives().allgather(src, dst, expect, deadline=deadline)
                except CollectiveTimeout:
                    abandon(src, dst)  # a late peer still reads my shard where it lies, in this process
                    raise
                return dst
            if algo == "shm" or algo == "shm-nt":
                stream = self._gather_stream(algo)
                self._shm_collectives().allgather(src, dst, expect, deadline=deadline, stream=stream)
                return dst
            if algo == "mpi":
                item = dtype.itemsize
                sizes = [(b - a) * item for a, b in expect]
                send = src.view(np.uint8)
                if len(set(sizes)) == 1:  # equal shards: MPI_Allgather, which Open MPI runs faster than Allgatherv
                    recv, name, blocking = dst.view(np.uint8), "MPI_Allgather", self.comm.Allgather
                else:
                    recv = [dst.view(np.uint8), sizes, [a * item for a, _ in expect], _MPI_OPS["BYTE"]]
                    name, blocking = "MPI_Allgatherv", self.comm.Allgatherv
                if deadline is None:
                    blocking(send, recv)
                else:  # the same blocking call as the peers without a deadline make (``_blocking``)
                    self._blocking(deadline, name, blocking, send, recv)
                return dst
            sched = self._schedule(count, plan, "ag")
            lo, hi = sched.shard
            be.copy(dst[lo:hi], src)
            execute(sched, dst, dst, "sum", backend=be, transport=self._transport(be), chunk=chunk, slots=[],
                    avg_p=None, deadline=deadline)
            return dst

        nbytes = count * dtype.itemsize
        mpi = not be.device and dims is None and self._ag_mpi_ok(count, nbytes)
        return self._shard_path("allgather", nbytes, be.device, dims, run, mpi, deadline)


def _where(backend):
    """Key of a backend's buffers and transports: its name, and for a device backend the current device
    (a call makes its array's device current), so that no buffer of one GPU is used on another."""
    return (backend.name, backend.current_device()) if backend.device else backend.name


def backend_input_numpy(x):
    """A numpy view of a host array or CPU torch tensor (for the non-contiguous copy path)."""
    if isinstance(x, np.ndarray):
        return x
    from .backends import get_backend

    return get_backend("numpy")._as_numpy(x)


def _scale_inplace(dst, p):
    if dst.dtype.kind in "iu":
        np.floor_divide(dst, dst.dtype.type(p), out=dst)
    else:
        np.multiply(dst, acc_dtype(dst.dtype).type(1.0 / p), out=dst, casting="unsafe")


def _buffer_spec(spec, what):
    """The array an mpi4py buffer specification names (``[buf, MPI.FLOAT]``, ``[buf, count, MPI.FLOAT]``,
    ``[buf, (count, displ), MPI.FLOAT]``, ``[buf, count, displ, MPI.FLOAT]``, ``[buf, count]``): ``buf``
    itself, or a flat view of its elements ``[displ, displ + count)``.  Anything else is returned as it is.
    A datatype that is not the one of ``buf``'s elements is a ``TypeError``: MPI would reinterpret the bytes,
    and ddlkernels reduces by the array's own dtype, so the two cannot be made to agree silently."""
    if not isinstance(spec, (list, tuple)):
        return spec
    from mpi4py import MPI
    from mpi4py.util.dtlib import to_numpy_dtype

    if not 2 <= len(spec) <= 4:
        raise TypeError(f"{what}: an mpi4py buffer specification has 2 to 4 items ([buf, MPI.FLOAT], "
                        f"[buf, count, MPI.FLOAT], ...), got {len(spec)}")
    buf, rest = spec[0], list(spec[1:])
    datatype = rest.pop() if isinstance(rest[-1], (MPI.Datatype, str)) else None
    count = displ = None
    if len(rest) == 2:
        count, displ = rest
    elif len(rest) == 1:
        count = rest[0]
        if isinstance(count, (list, tuple)):
            if len(count) != 2:
                raise TypeError(f"{what}: expected (count, displ), got {count!r}")
            count, displ = count
    for name, v in (("count", count), ("displacement", displ)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
            raise TypeError(f"{what}: the {name} of a buffer specification must be an int >= 0, got {v!r}")
    be = backend_for(buf)
    dtype = be.dtype(buf)
    if datatype is not None:
        try:
            named = np.dtype(datatype) if isinstance(datatype, str) else to_numpy_dtype(datatype)
        except (TypeError, ValueError, KeyError):
            named = None
        if named is None or named != dtype:
            dname = datatype if isinstance(datatype, str) else (datatype.Get_name() or repr(datatype))
            raise TypeError(
                f"{what}: the buffer specification names datatype {dname} "
                f"({'no numpy type' if named is None else dtype_name(named)}) but the array holds "
                f"{dtype_name(dtype)}; ddlkernels reduces by the array's dtype"
                + ("; MPI has no 16-bit float datatype: pass the array alone" if dtype.itemsize == 2
                   and dtype.kind in "fV" else "")
            )
    if count is None and displ is None:
        return buf
    try:
        be.flat(buf)
    except ValueError:
        raise ValueError(f"{what}: a count or displacement needs a C-contiguous buffer") from None
    start = int(displ or 0)
    stop = _size(buf) if count is None else start + int(count)
    if stop > _size(buf):
        raise ValueError(f"{what}: elements [{start}, {stop}) asked for, but the buffer holds {_size(buf)}")
    return buf.reshape(-1)[start:stop]  # a view: the buffer is contiguous


def _size(x):
    n = 1
    for s in x.shape:
        n *= int(s)
    return n


def _check_out(be, out, x, dtype):
    if type(out) is np.ndarray and type(x) is np.ndarray:
        if out.dtype != dtype:
            raise TypeError(f"out has dtype {dtype_name(out.dtype)} but the input has {dtype_name(dtype)}")
        if out.shape != x.shape:
            raise ValueError(f"out has shape {out.shape} but the input has {x.shape}")
        return
    ob = backend_for(out)
    if ob is not be:
        raise TypeError(f"out is a {ob.name} array but the input is a {be.name} array")
    odt = ob.dtype(out)
    if odt != dtype:
        raise TypeError(f"out has dtype {dtype_name(odt)} but the input has {dtype_name(dtype)}")
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out has shape {tuple(out.shape)} but the input has {tuple(x.shape)}")
    if be.device_id(out) != be.device_id(x):
        raise ValueError(f"out is on device {be.device_id(out)} but the input on {be.device_id(x)}")


def _plain_out(out, x, shape):
    """Whether ``out`` is a numpy array of ``shape`` (a 1-tuple) the fast paths can write ``x``'s dtype into."""
    if type(out) is not np.ndarray or out.shape != shape or out.dtype != x.dtype:
        return False
    flags = out.flags
    return flags.c_contiguous and flags.writeable and _apart(out, flags, x, x.flags)


def _apart(out, oflags, x, xflags):
    """Whether numpy arrays ``out`` and ``x`` (``oflags``, ``xflags``: their flags) share no memory.  Two arrays
    that each own their data are two allocations: the common case, decided without ``np.may_share_memory``
    (0.2 us, a fifth of a fast-path call)."""
    return (oflags.owndata and xflags.owndata and out is not x) or not np.may_share_memory(out, x)


_TOO_HARD = getattr(np, "exceptions", np).TooHardError  # numpy.exceptions from numpy 1.25


def _host_overlap(x, out):
    """Whether two host arrays (numpy, or what ``backend_input_numpy`` makes of them), either of them not
    contiguous, share an element's bytes: exactly where numpy can tell cheaply, else by their spans."""
    a, b = backend_input_numpy(x), backend_input_numpy(out)
    try:
        return bool(np.shares_memory(a, b, max_work=1 << 16))
    except _TOO_HARD:
        return bool(np.may_share_memory(a, b))


def _check_shard_out(be, out, x, dtype, n, what):
    """``out`` of reduce_scatter / allgather: 1-D, ``n`` elements, ``x``'s dtype, backend and device, contiguous,
    writeable and apart from ``x``; raised before any communication (every rank checks its own)."""
    ob = backend_for(out)
    if ob is not be:
        raise TypeError(f"{what}: out is a {ob.name} array but the input is a {be.name} array")
    if ob.dtype(out) != dtype:
        raise TypeError(f"{what}: out has dtype {dtype_name(ob.dtype(out))} but the input has {dtype_name(dtype)}")
    if tuple(out.shape) != (n,):
        raise ValueError(f"{what}: out has shape {tuple(out.shape)} but this rank's result is ({n},)")
    if be.device_id(out) != be.device_id(x):
        raise ValueError(f"{what}: out is on device {be.device_id(out)} but the input on {be.device_id(x)}")
    if type(out) is np.ndarray:
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"{what}: out must be a contiguous, writeable array")
        if type(x) is np.ndarray and np.may_share_memory(out, x):
            raise ValueError(f"{what}: out overlaps the input")


def _positive(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _nonneg(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    return int(v)


def _in_use(what):
    return RuntimeError(
        f"ddlkernels: {what} called while another thread is inside a collective on the same Communicator; "
        "collectives on one communicator cannot overlap (the ranks could not match them): use one Communicator per "
        "thread, or ddlkernels.allreduce_async for work that overlaps (docs/reliability.md, \"Threads\")"
    )


def duplicate(comm, deadline=None):
    """A duplicate of the mpi4py intracommunicator ``comm`` (collective), waited for under ``deadline``.

    ``MPI_Comm_idup`` on every rank, with or without a deadline, so that ranks with and without one meet
    in it; once it completes every rank is in the same creation.  After a timeout the duplicate is
    abandoned, never freed: it completes if the missing rank arrives.
    """
    dup, req = comm.Idup()
    try:
        complete(req, deadline, "MPI_Comm_idup (a duplicate of the communicator)")
    except CollectiveTimeout:
        abandon(dup)
        raise
    return dup


_KEYVAL = None
_DEFAULT = None
#: Guards _KEYVAL and _CREATING; held for no wait on other ranks.
_GLOBAL = threading.Lock()
#: MPI handle of an mpi4py communicator -> the lock held while its cached Communicator is created (one at a time
#: per communicator, never across communicators: that could wait on another rank's other thread).
_CREATING: dict = {}


def as_communicator(comm=None, timeout=None) -> Communicator:
    """The ``Communicator`` for ``comm`` (an mpi4py comm, a Communicator, or None = COMM_WORLD).

    For an mpi4py communicator it is created on first use and cached on the
    communicator itself (MPI attribute caching), so repeated calls reuse its
    plans and buffers, and it is freed when the communicator is.  ``timeout``:
    the calling collective's; creating the Communicator (collective) waits for
    the other ranks under a deadline of that length (``CollectiveTimeout``),
    and the Communicator made has no timeout of its own.
    """
    global _KEYVAL, _DEFAULT
    if comm is None:
        # The lazily created default: the one piece of global state.
        default = _DEFAULT
        if default is not None and default.comm is not None:
            return default
        from mpi4py import MPI

        _DEFAULT = as_communicator(MPI.COMM_WORLD, timeout)
        return _DEFAULT
    if isinstance(comm, Communicator):
        return comm
    from mpi4py import MPI

    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py Intracomm or a ddlkernels.Communicator, got {comm!r}")
    if _KEYVAL is None:
        with _GLOBAL:
            if _KEYVAL is None:
                _KEYVAL = MPI.Comm.Create_keyval(delete_fn=lambda c, k, v: v.free())
    cached = comm.Get_attr(_KEYVAL)
    if cached is None:
        # Two threads making the first call on one communicator: one creates, the other waits for it (its
        # creation's MPI_Comm_idup is the same collective on every rank, whichever thread makes it).
        with _GLOBAL:
            lock = _CREATING.setdefault(comm.py2f(), threading.Lock())
        with lock:
            cached = comm.Get_attr(_KEYVAL)
            if cached is None:
                try:
                    t = _check_timeout(timeout)
                except ValueError:  # raised by the call itself, which validate=True announces to the others
                    t = None
                deadline = None if t is None else Deadline("Communicator creation", comm.Get_rank(), t)
                cached = Communicator(comm, _deadline=deadline)
                comm.Set_attr(_KEYVAL, cached)
    return cached
