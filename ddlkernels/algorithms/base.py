"""One algorithm: asked whether it serves a call, then run; every algorithm of ddlkernels has this shape.

Worked example: ``allreduce`` of 1 MiB of float32 on 2 ranks of one node,
whose kernel lets them read each other's memory::

    collectives.allreduce   local checks, then a Work: kind, count, dtype, op, src, dst, ...
    select.choice           asks every algorithm of the Communicator, in registry order:
                              mpi.serves(...)  -> True   (MPI's types, under 32 MiB)
                              nbc.serves(...)  -> False  (only below 256 KiB)
                              ring.serves(...) -> True
                              shm.serves(...)  -> True   (one node)
                              cma.serves(...)  -> True   (one node, from 32 KiB)
                            candidates (mpi, ring, shm, cma): the tuner times each in
                            turn, then keeps the fastest, the same on every rank
    Cma.allreduce(work)     runs it (a settled small size may go straight to
                            Cma.fast(...)'s prepared call instead)

The first candidate is the incumbent the others must beat (the registry's
order, ``ddlkernels.algorithms.REGISTRY``), as Horovod's operation manager
asks each op ``Enabled()`` and runs the first; here the tuner measures them.
An algorithm holds what it allocates (a window, a node communicator) and
frees it with the Communicator.
"""

from __future__ import annotations

from ..ring.segments import Segments

__all__ = ["Algorithm", "Finished", "Work", "call_key", "finish_trials", "pack_segments", "run_instead"]


def pack_segments(w) -> None:
    """For an algorithm that reads one buffer: a fusion bucket (``Segments``, arrays never packed) packed into
    ``w.dst``, which then is the call's input (reduced in place)."""
    if w.src.__class__ is Segments:
        w.src.copy_to(w.dst, 0, w.count)
        w.src = w.dst


def finish_trials(measuring, zeros, run) -> None:
    """Let a Communicator an algorithm runs part of its call on ("host"'s pieces, "hier"'s step across nodes)
    finish its tuner's trials for a size first, on zeros: else the outer tuner's trials of the algorithm would
    time the inner tuner's slower candidates, not what the algorithm will run.

    ``measuring()``: whether the inner call would be a trial (the same on every rank of the inner
    Communicator, so its ranks make the same calls); ``zeros()``: the buffer the trials reduce, zeroed
    (zeros stay zeros under every op); ``run(buf)``: one inner call on it.  Once the size is settled, only
    the asking.
    """
    if measuring():
        buf = zeros()
        while measuring():
            run(buf)


def call_key(kind, w) -> tuple:
    """What names a whole call for ``Finished.ran`` and ``pending``: the same for a ``Work`` of the call and for
    the buffer-less ``Work`` that ``Communicator.tuning`` makes of it."""
    return kind, w.be.name, w.dtype, w.op, w.count


class Finished:
    """The call shapes whose inner trials ``finish_trials`` has let finish, so that it is asked once per
    shape: asking a tuner costs a few microseconds a call, and a training loop repeats its shapes.  A shape
    its inner tuner later measures again (its watch) is measured within the calls, as any tuner's is.  The
    same on every rank of the inner Communicator, which makes the same calls.

    The shapes are the inner calls' (a rank's shard, a piece), which differ between ranks; ``ran`` and
    ``pending`` keep the whole calls (``call_key``) that got that far, the same on every rank of the outer
    Communicator, for its ``tuning``."""

    def __init__(self):
        self.shapes: set = set()
        self.calls: set = set()

    def ran(self, call) -> None:
        """A whole call ``call`` has begun, whose ``finish`` steps (if any) finish its inner shapes: noted at its
        start, before any return, so that a ``while tuning(x)`` loop ends whatever path the call takes."""
        if len(self.calls) >= 256:  # bounded as the shapes are
            self.calls.clear()
        self.calls.add(call)

    def pending(self, call) -> bool:
        """Whether a call like ``call`` would first run inner trials: it has not run since these were made
        (whether its inner shapes are in fact settled, from other calls, is a rank's own knowledge)."""
        return call not in self.calls

    def finish(self, shape, measuring, zeros, run) -> None:
        """``finish_trials(measuring, zeros, run)`` unless ``shape`` was finished before."""
        if shape not in self.shapes:
            finish_trials(measuring, zeros, run)
            if len(self.shapes) >= 256:  # a job with ever new sizes must not grow this without bound
                self.shapes.clear()
            self.shapes.add(shape)


class Work:
    """One collective call, as the algorithms see it (made by ``ddlkernels.collectives`` after its local checks).

    ``kind``: "allreduce", "reduce_scatter" or "allgather"; ``src``/``dst``:
    1-D buffers of the backend ``be`` (allreduce: ``src`` may be ``dst``, or a
    ``ddlkernels.ring.segments.Segments``; reduce_scatter: ``dst`` is this
    rank's shard; allgather: ``src`` is this rank's shard, ``dst`` the whole);
    ``count``: elements of the whole buffer; ``op``: the user's op ("avg"
    included), ``redop`` what is reduced ("sum" for "avg"), ``avg``: scale by
    the rank count; ``chunk``: the pipeline chunk in elements; ``dims``: the
    box asked for or None; ``bounds``: every rank's shard of ``count``
    (reduce_scatter, allgather); ``call``: the ``ddlkernels.safety.validate.Call``
    or None; ``deadline``: its deadline or None.
    """

    __slots__ = ("kind", "src", "dst", "count", "dtype", "op", "redop", "avg", "be", "chunk", "dims", "bounds",
                 "call", "deadline", "prepared")

    def __init__(self, kind, src, dst, count, dtype, op, be, chunk, dims=None, bounds=None, call=None):
        self.kind, self.src, self.dst, self.count, self.dtype = kind, src, dst, count, dtype
        self.op = op
        self.avg = op == "avg"
        self.redop = "sum" if self.avg else op
        self.be, self.chunk, self.dims, self.bounds, self.call = be, chunk, dims, bounds, call
        self.deadline = None if call is None else call.deadline
        self.prepared = None  # what the algorithm's ``prepare`` allocated for this call

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


def run_instead(comm, kind, w, name="ring"):
    """Run the call ``w`` (of ``kind``) with the Communicator ``comm``'s algorithm ``name`` instead of the one
    chosen, which found it cannot (every rank alike): the ring by default, which computes every call."""
    algorithm = comm.algorithms.by_name[name]
    w.prepared = algorithm.prepare(w)
    comm.last_algorithm = algorithm.name
    getattr(algorithm, kind)(w)


class Algorithm:
    """One way to compute collectives (subclasses: one module each in ``ddlkernels.algorithms``).

    ``name``: its name for the tuner, ``Communicator.last_algorithm`` and the
    argument check; ``kinds``: the collectives it computes; ``chunked``: the
    call's pipeline chunk matters to it (the argument check compares chunks
    only then); ``device``: it computes calls on device arrays (only such
    algorithms are asked about them).  ``comm``: the ``Communicator`` it
    serves, whose state (the MPI communicator, buffers, transports, plans) it uses.
    """

    name = ""
    kinds = ("allreduce",)
    chunked = False
    device = False

    def __init__(self, comm, placement):
        self.comm = comm

    @classmethod
    def probe(cls, comm, placement) -> bool:
        """Whether ``comm`` (a Communicator being created) may use this algorithm at all: decided locally,
        the same on every rank, from ``placement`` (``ddlkernels.algorithms.Placement``: what the creation's
        collectives learnt of where the ranks are) and the Communicator's settings."""
        return True

    def serves(self, kind, w) -> bool:
        """Whether this call (a ``Work`` of ``kind``, not yet holding buffers) is one this algorithm computes
        and is worth measuring for.  The same answer on every rank for the same call."""
        return kind in self.kinds

    def inner_trials(self, kind, w) -> bool:
        """Whether a call like ``w`` (of ``kind``, without buffers), run by this algorithm, would first let a
        Communicator it runs steps on finish its tuner's trials (``finish_trials``): the same on every rank,
        for ``Communicator.tuning``."""
        return False

    def prepare(self, w):
        """Allocate what the call needs before the cross-rank argument check (a rank that fails here fails
        locally, which ``validate`` announces to the others); kept in ``w.prepared``."""

    def allreduce(self, w) -> None:
        raise NotImplementedError(f"{self.name} does not compute allreduce")

    def reduce_scatter(self, w) -> None:
        raise NotImplementedError(f"{self.name} does not compute reduce_scatter")

    def allgather(self, w) -> None:
        raise NotImplementedError(f"{self.name} does not compute allgather")

    def fast(self, kind, w):
        """For the fast paths of host numpy calls settled on this algorithm (``w``: a ``Work`` without
        buffers): ``f(src, dst)``, a prepared call that does the whole collective (``src`` and ``dst`` 1-D;
        allreduce: ``dst`` may be ``src``); ``None`` when it cannot be prepared yet (the full path sets up
        what it needs, collectively: ask again after one); ``False`` when the full path must serve every
        such call."""
        return False

    def close_peer_memory(self) -> None:
        """Close what it holds open of peers' device memory (CUDA IPC); the device work that used it has run."""

    def free(self) -> None:
        """Release what this algorithm allocated (collective, with the Communicator's ``free``)."""

    def held(self) -> list:
        """What it allocated, for ``ddlkernels.safety.deadline.abandon`` after a timeout (never freed then:
        a late peer may still use it)."""
        return []
