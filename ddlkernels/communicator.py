"""``Communicator``: an MPI communicator plus what repeated collectives reuse; its state and lifetime.

Worked example, ``Communicator(MPI.COMM_WORLD)`` on 4 ranks of one node::

    duplicate   MPI_Comm_idup: our messages never match the caller's
    topology    nodes from shared memory, or node= labels (ddlkernels.select.topology.detect)
    placement   one node? may ranks read each other's memory? (ddlkernels.algorithms.place)
    algorithms  the enabled ones: mpi, nbc, ring, shm, shm-nt, cma
    selector    their tuners and fast-path plans (ddlkernels.select.choice)

Each collective is a module of ``ddlkernels.collectives`` (arguments, fast
path, choose, run), whose functions are this class's methods.  The
Communicator holds what they share: plans and schedules of the ring,
receive slots and scratch buffers per backend and dtype, transports, the
per-device stream tail, and the lock that keeps one collective at a time.
Nothing else is global: the module-level functions use a ``Communicator``
cached on the mpi4py communicator itself through MPI attribute caching,
created lazily on first use (``as_communicator``).
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from . import _config
from .algorithms import Algorithms, place
from .algorithms.hier import check_node, node_split
from .algorithms.window import _gated
from .collectives import allgather as _allgather, allreduce as _allreduce, decisions as _decisions
from .collectives import empty as _empty, reduce_scatter as _reduce_scatter, streams as _streams
from .collectives.arguments import in_use, nonneg, positive, where
from .ring.engine import ALIGN_PAD
from .ring.schedule import Plan
from .safety.deadline import BlockingRunner, CollectiveTimeout, Deadline, _check_timeout, abandon, complete
from .safety.validate import Call, report_local_failure
from .select.choice import Selector
from .select.plans import Plans
from .transport.direct import HostTransport

__all__ = ["Communicator", "as_communicator", "duplicate"]


class Communicator:
    """Multi-dimensional ring collectives over an mpi4py intracommunicator.

    Parameters (each falls back to ``ddlkernels._config`` and then to the
    environment variables documented in the README):

    comm         mpi4py ``Intracomm``; default ``MPI.COMM_WORLD``.  It is
                 duplicated: collectives here never match the caller's messages.
    chunk_bytes  pipeline chunk size in bytes (default 1 MiB).
    small_bytes  messages of fewer bytes go to MPI's own collective when it
                 computes the call (0 = always the ring).  Default: the
                 algorithm is chosen per size by measurement, identically on
                 every rank (``ddlkernels.select``).
    window       receive slots in flight per ring step (default 4, >= 1).
    shm          the shared-memory algorithms (``ddlkernels.algorithms.shm``)
                 for host arrays when every rank shares one node: ``None``
                 (default) makes them measured candidates, ``True`` uses the
                 window for every such call (an error if the ranks span
                 nodes), ``False`` never.  Fallback ``DDLKERNELS_SHM``.
    ipc          the CUDA IPC allreduce (``ddlkernels.algorithms.ipc``) for
                 device arrays when every rank shares one node: ``None``
                 (default) makes it a measured candidate beside the ring
                 and "host", ``True`` runs it for every device allreduce it
                 serves, ``False`` never (nor "hier"'s IPC inside nodes).
                 Fallback ``DDLKERNELS_IPC``.
    node         this rank's node label (a str or an int): ranks with equal
                 labels form a node, as if on a machine of their own.  For
                 ranks MPI puts on one node that should act as several
                 (containers that cannot map each other's memory; the
                 algorithms across nodes, "hier" and the planner's box, tried
                 on one machine).  Labels split MPI's nodes, never join them
                 (``ValueError`` on every rank); every rank gives one or none.
                 Default: MPI's shared-memory split (``COMM_TYPE_SHARED``).
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
    the same ``chunk_bytes``, ``small_bytes``, ``shm`` and ``ipc`` (they choose
    the algorithm; ``validate`` checks them).

    Threads: a Communicator runs one collective at a time.  A call made while
    another thread is inside a collective on it raises ``RuntimeError`` at
    once, before any communication.  Use one Communicator per thread
    (docs/reliability.md, "Threads").

    For reports and tests: ``last_algorithm`` (what the last collective ran),
    ``algorithms`` (the enabled ones), ``candidates``, ``tuning``, ``settle``
    and ``decisions`` (``ddlkernels.collectives.decisions``).
    """

    # The collectives (ddlkernels.collectives), and what the tuner chose.
    allreduce = _allreduce.allreduce
    Allreduce = _allreduce.Allreduce
    allreduce_buffer = _allreduce.allreduce_buffer
    tuning_buffer = _allreduce.tuning_buffer
    reduce_scatter = _reduce_scatter.reduce_scatter
    allgather = _allgather.allgather
    tuning = _decisions.tuning
    candidates = _decisions.candidates
    settle = _decisions.settle
    decisions = _decisions.decisions
    empty = _empty.empty
    _device_call = _streams.device_call

    def __init__(self, comm=None, *, chunk_bytes=None, small_bytes=None, window=None, cuda_aware=None,
                 validate=None, timeout=None, topology=None, rack_map=None, shm=None, ipc=None, node=None,
                 _deadline=None):
        from mpi4py import MPI

        if comm is None:
            comm = MPI.COMM_WORLD
        if isinstance(comm, Communicator):
            comm = comm.mpi_comm
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"comm must be an mpi4py Intracomm, got {comm!r}")
        env = _config.defaults()
        self.chunk_bytes = positive("chunk_bytes", env.chunk_bytes if chunk_bytes is None else chunk_bytes)
        small = env.small_bytes if small_bytes is None else small_bytes
        self.small_bytes = None if small is None else nonneg("small_bytes", small)
        self.window = positive("window", env.window if window is None else window)
        self.cuda_aware_override = env.cuda_aware if cuda_aware is None else bool(cuda_aware)
        self.validate = env.validate if validate is None else bool(validate)
        self.timeout = _check_timeout(timeout)
        shm = env.shm if shm is None else shm
        if shm not in (None, True, False):
            raise ValueError(f"shm must be None, True or False, got {shm!r}")
        self.shm = shm
        ipc = env.ipc if ipc is None else ipc
        if ipc not in (None, True, False):
            raise ValueError(f"ipc must be None, True or False, got {ipc!r}")
        self.ipc = ipc
        node = check_node(node)
        #: the arguments as resolved, for the Communicators made from this one (``derived``)
        self._settings = dict(chunk_bytes=self.chunk_bytes, small_bytes=self.small_bytes, window=self.window,
                              cuda_aware=self.cuda_aware_override, validate=self.validate, timeout=self.timeout,
                              topology=topology, rack_map=rack_map, shm=shm, ipc=ipc, node=node)
        self._broken = None  # why, after a collective timed out: its messages are still in flight
        #: Held by the thread inside a collective (``_exclusive``); reentrant for allreduce_many's calls.
        self._busy = threading.RLock()
        self._runner = None  # BlockingRunner: MPI's blocking calls under a deadline (``_blocking``)
        self.mpi_comm = comm
        if _deadline is None and self.timeout is not None:
            _deadline = Deadline("Communicator creation", comm.Get_rank(), self.timeout)
        from .select.topology import detect
        from .transport.cuda_aware import cuda_aware as detect_cuda_aware

        params = env.topology if topology is None else topology

        def made():
            # Nonblocking, so that a rank that never comes is a timeout; once it completes every rank is here.
            dup, nodes = duplicate(comm, _deadline), None
            try:  # the errors here (a label joining MPI's nodes, a host missing from the rack map) are every rank's
                nodes, where = node_split(dup, node)
                # Nodes from shared memory or the labels, racks from the rack map, link parameters from a
                # calibrated topology file (``python -m ddlkernels calibrate``) or the documented defaults.
                topo = detect(where, rack_map=env.rack_map if rack_map is None else rack_map, params=params)
                aware = detect_cuda_aware(dup, self.cuda_aware_override)  # this rank's MPI; place() agrees
            except BaseException:
                if nodes is not None:
                    nodes.Free()
                dup.Free()
                raise
            return dup, topo, place(dup, shm, nodes, aware[0]), aware

        # One creation of communicators at a time in this process (``_gated``, as for windows): two threads
        # creating Communicators at once (two progress engines) deadlocked 1 run in 7 to 14 of
        # tests/mpi/test_threads.py, each rank's two threads in the first collectives of two new communicators
        # as if Open MPI had paired them crosswise.
        self.comm, self.topology, placement, aware = _gated(comm, made, _deadline, "MPI_Comm_idup's rendezvous")
        # Whether device buffers go straight to MPI: agreed at creation, for the ring's transport and "mpi".
        self._cuda_aware = (placement.cuda_aware, aware[1] if placement.cuda_aware or not aware[0]
                            else f"{aware[1]} here, but not on every rank")
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        if shm is True and self.size > 1 and not placement.one_node:  # after place(): ranks may differ in shm=
            if placement.hier_node is not None:
                placement.hier_node.Free()
            self.comm.Free()
            raise ValueError("shm=True: the ranks of this communicator do not all share one node")
        #: the enabled algorithms (``ddlkernels.algorithms.Algorithms``), in the order of the tuner's candidates
        self.algorithms = Algorithms(self, placement)
        #: the choice of algorithm: the tuners and fast-path plans per collective (``ddlkernels.select.choice``)
        self.selector = Selector(self, self.algorithms)
        # The fast paths apply when no per-communicator check (validation, timeout) runs around the call.
        self._fast_ok = self.size > 1 and not self.validate and self.timeout is None
        #: the ring's plans, schedules and shard bounds (``ddlkernels.select.plans``), cached
        self.ring_plans = Plans(self.size, self.rank, self.topology, self.topology.topology_order(), self.chunk_bytes)
        rp = self.ring_plans  # what the collectives and algorithms ask of it, as plain attributes
        self._shard_plan, self._all_shards, self._schedule = rp.shard_plan, rp.all_shards, rp.schedule
        self.rank_ordered = rp.rank_ordered
        self._buffers: dict = {}
        self._transports: dict = {}
        #: (backend name, device) -> event recorded at the end of the last device call, none where that call's
        #: stream had run all its work when it ended (collectives.streams)
        self._tails: dict = {}
        #: the algorithm the last allreduce, reduce_scatter or allgather ran ("mpi", "ring", "shm", ...)
        self.last_algorithm = None
        #: what ``free`` closes first: the progress engines of asynchronous calls on this Communicator, each a thread
        #: and a duplicate of its communicator (``ddlkernels.asynchronous.progress_engine`` adds them)
        self._closers: list = []

    # -- lifetime ------------------------------------------------------------
    def derived(self, comm, **changes) -> "Communicator":
        """A Communicator over the mpi4py communicator ``comm`` with this one's arguments, but for ``changes``
        (collective over ``comm``): the progress engine's, the "host" algorithm's and "hier"'s across nodes,
        so that what the user chose (chunk size, ``ipc=``, ``cuda_aware=``, node labels, ...) holds there too."""
        return type(self)(comm, **{**self._settings, **changes})

    def free(self) -> None:
        """Release the duplicated communicator, every cached buffer and the progress engines of this
        Communicator's asynchronous calls (collective).

        After a timeout it releases nothing: the abandoned collective may still
        complete into these buffers and windows (a late rank), and freeing them
        collectively would not match across ranks.  They are kept until the
        process ends (``ddlkernels.safety.deadline.abandon``).
        """
        if self._broken is None:
            closers, self._closers = self._closers, []
            for close in closers:  # the progress engines: their queued reductions finish first
                close()
        with self._exclusive("free"):
            if self._runner is not None:
                self._runner.close()
                self._runner = None
            if self._broken is not None:
                abandon(self.comm, self._buffers, self._transports, *self.algorithms.held())
            else:
                for t in self._transports.values():
                    t.close()
                self.selector.forget()  # the fast paths' prepared calls may hold memory freed here
                self.algorithms.free()
                if self.comm is not None:
                    self.comm.Free()
            self._transports, self._buffers, self.comm = {}, {}, None

    def close_peer_memory(self) -> None:
        """Close the peers' device memory this rank holds open for CUDA IPC (collective).

        The CUDA IPC paths (``ipc``, ``hier``) open a peer's allocation once and keep it, as NCCL keeps
        registered buffers, and CUDA leaves a ``cudaFree`` of memory a peer still has open undefined.  So
        before device memory that collectives of this Communicator read goes back to the driver
        (``torch.cuda.empty_cache()``, CuPy's ``free_all_blocks()``), call this on every rank: it waits
        for this Communicator's device work, closes what it holds and returns once every rank has (a
        barrier).  Later calls open what they need again.  ``free`` does the same.
        """
        from .backends import get_backend

        with self._exclusive("close_peer_memory"):
            for key, ev in self._tails.items():  # the last device call on each device: every one before it
                get_backend(key[0]).sync(ev)
            for a in self.algorithms.order:
                a.close_peer_memory()
            complete(self.comm.Ibarrier(), None, "close_peer_memory's barrier")

    @contextlib.contextmanager
    def _exclusive(self, what):
        """The body runs with this Communicator to itself; ``RuntimeError`` if another thread is in a collective
        on it (the fast paths inline the same test)."""
        if not self._busy.acquire(blocking=False):
            raise in_use(what)
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
        """Free (collective) on a normal exit only: after an exception this rank may be alone, and a
        collective free would wait for peers still inside the block.  The resources then go with the
        process, or the job's abort (``ddlkernels.abort_on_exception``)."""
        if exc_type is None:
            self.free()

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

    def _plain_call(self, dims, chunk_bytes, backend, validate, timeout):
        """No per-call option that the fast paths leave to the full path, and no per-communicator check."""
        return (dims is None and chunk_bytes is None and backend is None and validate is None and timeout is None
                and self._fast_ok)

    # -- the ring's plans (ddlkernels.select.plans) ---------------------------------
    def plan(self, nbytes: int = 0, dims=None) -> Plan:
        """The box and rank order a collective of ``nbytes`` bytes uses.

        ``dims=None`` lets the planner choose (``ddlkernels.select.planner``):
        every factorization of the communicator into a box is costed on
        ``self.topology`` for this size and the fastest is taken.  Explicit
        ``dims`` are used as given.  Either way the ring order follows the
        topology: ranks of one node are neighbours.
        """
        return self.ring_plans.plan(nbytes, dims)

    def shard_range(self, count: int, dims=None, rank: int | None = None) -> tuple[int, int]:
        """``(start, stop)``: the elements ``reduce_scatter`` leaves on ``rank`` (default: this rank).

        The nested balanced cut of ``ddlkernels.ring.schedule.shard_bounds``
        over the plan's box: ranges of different ranks differ by at most
        ``len(dims)`` elements and, for the flat ring, rank r owns block r.
        """
        return self.ring_plans.shard_range(count, dims, rank)

    # -- buffers, transports, streams ----------------------------------------------
    def _slots(self, backend, dtype, chunk):
        key = ("slots", where(backend), dtype, chunk, self.window)
        slots = self._buffers.get(key)
        if slots is None:
            slots = self._buffers[key] = [backend.empty(chunk + ALIGN_PAD, dtype) for _ in range(self.window)]
        return slots

    def _scratch(self, backend, dtype, count):
        return self.reusable_buffer("scratch", backend, dtype, count)

    def reusable_buffer(self, tag, backend, dtype, count: int):
        """A 1-D buffer of ``count`` elements kept under ``tag`` and reused by later calls.

        The buffer grows to the largest ``count`` asked for under ``(tag,
        backend, dtype)`` and a prefix view is returned, so steady-state calls
        allocate nothing (the fusion buffers of ``allreduce_many``).  Two views
        of one tag alias each other; use distinct tags for buffers alive at once.
        """
        key = ("reusable", tag, where(backend), np.dtype(dtype))
        buf = self._buffers.get(key)
        if buf is None or len(buf) < count:
            buf = self._buffers[key] = backend.empty(max(int(count), 1), dtype)
        return buf[:count]

    def _transport(self, backend):
        key = where(backend)
        t = self._transports.get(key)
        if t is None:
            if backend.device and not self.cuda_aware(backend)[0]:
                from .transport.staged import StagedTransport

                t = StagedTransport(self.comm, backend, self.chunk_bytes, self.window)
            else:
                t = HostTransport(self.comm, backend)
            self._transports[key] = t
        return t

    def cuda_aware(self, backend=None):
        """``(aware, reason)``: whether device buffers go straight to MPI (on every rank: else on none)."""
        return self._cuda_aware



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
