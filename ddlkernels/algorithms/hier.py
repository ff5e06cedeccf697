"""Hierarchical allreduce: shared memory inside each node, an allreduce of one shard across nodes.

PowerAI DDL's point is that the fastest links should carry the most data.
Across several nodes the fastest "link" is a node's own memory, and on one
node ``ddlkernels.algorithms.shm`` already beats a ring over MPI's shared-memory
transport.  This module uses it as the innermost dimension of a 2-D
allreduce, for jobs whose nodes all hold the same number of ranks k::

    reduce-scatter   inside each node, through the shared window: local rank j
                     ends with the node's partial sum of shard j (1/k of the data)
    allreduce        shard j across the nodes, among the ranks whose local rank
                     is j, by a Communicator of their own (MPI's call or the
                     ring, measured by its tuner): 1/k of the data crosses nodes
    allgather        inside each node, through the window

Worked example, 2 nodes x 2 ranks, 8 elements, global ranks 0,1 on node A
and 2,3 on node B::

    node A: shard 0 = x0[0:4] + x1[0:4]  (local rank 0, rank 0)
            shard 1 = x0[4:8] + x1[4:8]  (local rank 1, rank 1)
    node B: shard 0 = x2[0:4] + x3[0:4]  (rank 2),  shard 1 = ... (rank 3)
    across: ranks 0 and 2 allreduce shard 0; ranks 1 and 3 shard 1
    gather: every rank copies both shards of its node into its output

Device arrays take the same three steps with CUDA IPC inside the node
(``ddlkernels.algorithms.ipc.IpcNode``: the reduce-scatter reads the node's
peers' memory in place, the allgather writes into it) and the device ring
across nodes (CUDA-aware MPI or staged), where the backend offers CUDA IPC:
the box's first dimension is the node, as PowerAI DDL's.

The step across nodes is a Communicator of its own, whose tuner measures
its candidates per shard size.  The first call of a shard shape lets it
finish those trials first, on zeros (``base.finish_trials``; asked once
per shape, ``base.Finished``), so that the outer tuner's trials of "hier"
time what "hier" will run; until "hier" has run a call of that shape once,
``Communicator.tuning`` says the call is still measuring.

Each element is summed within a node in local-rank order, then across nodes
by one allreduce whose result is the same bits on every rank that computes
it; the allgather only copies, so every rank ends with the same bits.  The
order differs from the flat ring's, as the tuner's other choices do.
"avg" is the sum scaled once at the end (float16 and bfloat16 excepted:
their backend scales before the one rounding, so they take the other paths);
on the device the scale is the backend's ``scale`` (the reduce kernel's
"avg" with -0 as the other operand: x + -0 is x, bit for bit, -0 included).
"""

from __future__ import annotations

import socket

import numpy as np

from .._dtypes import is_half, scale_inplace
from ..ring.schedule import split
from ..safety.deadline import complete
from .base import Algorithm, Finished, call_key, pack_segments, run_instead
from .ipc import IpcNode, give_up
from .shm import ShmAllreduce

__all__ = ["Hier", "HierAllreduce", "check_node", "node_colors", "node_split", "uniform_nodes"]


def check_node(node):
    """``node`` as ``node_split`` takes it (None, a str or an int), or ``TypeError`` (before any communication)."""
    if node is None or isinstance(node, str):
        return node
    if isinstance(node, (int, np.integer)) and not isinstance(node, (bool, np.bool_)):
        return int(node)
    raise TypeError(f"node must be None, a str or an int (this rank's node label), got {node!r}")


def node_colors(rows) -> list | None:
    """The color of every rank's node from ``rows``, one ``(label, shared)`` per rank: the label it gave
    ``node_split`` and the lowest rank of its shared-memory node.  None where no rank gave a label (the
    shared-memory split stands); a ``ValueError`` where only some did, or where a label holds ranks of
    two shared-memory nodes (labels split MPI's nodes, never join them)."""
    labels = [label for label, _ in rows]
    if all(label is None for label in labels):
        return None
    if any(label is None for label in labels):
        none = [r for r, label in enumerate(labels) if label is None]
        raise ValueError(f"node=: rank(s) {none} gave no node label and the others did: every rank or none")
    first: dict = {}  # label -> (its first rank, that rank's shared-memory node)
    for r, (label, shared) in enumerate(rows):
        r0, s0 = first.setdefault(label, (r, shared))
        if s0 != shared:
            raise ValueError(f"node=: ranks {r0} and {r} gave the node label {label!r} but do not share memory "
                             "(a label may split MPI's nodes, never join them)")
    return [first[label][0] for label in labels]


def node_split(comm, node=None):
    """``(nodes, where)``: ``comm`` split into nodes (collective), and every rank's ``(node id, host name)``.

    Nodes are ranks that share memory (MPI's ``COMM_TYPE_SHARED``), or, where every rank gives a ``node``
    label, the ranks with equal labels (which must share memory).  A node's id is its lowest rank in
    ``comm``, the same on each of its ranks; ``where`` is what ``topology.detect`` builds the job's topology
    from, so that it asks nothing again.

    Labels are for ranks that MPI puts on one node but that should act as
    several: containers that cannot map each other's memory, or the
    algorithms across nodes run on one machine (the tests).
    """
    from mpi4py import MPI

    node = check_node(node)
    rank = comm.Get_rank()
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        lowest = shared.bcast(rank, root=0)  # the shared-memory node's lowest rank
        rows = comm.allgather((node, lowest, socket.gethostname()))
        colors = node_colors([(label, low) for label, low, _ in rows])  # the same answer, or error, everywhere
    except BaseException:
        shared.Free()
        raise
    where = [(low if colors is None else colors[r], host) for r, (_, low, host) in enumerate(rows)]
    if colors is None:
        return shared, where
    shared.Free()
    return comm.Split(color=colors[rank], key=rank), where


def uniform_nodes(sizes) -> bool:
    """Whether ``sizes`` (the size of every rank's node, in rank order) make more than one node, all of one
    size >= 2."""
    return min(sizes) == max(sizes) >= 2 and sizes[0] < len(sizes)


class HierAllreduce:
    """The hierarchical allreduce of ``comm`` whose node split is ``node`` (collective to create and free).

    ``node``: this rank's node communicator, a split of ``comm`` into groups
    of equal size whose ranks share memory (``node_split``; the caller checked
    ``uniform_nodes``).  ``make_cross``: makes the ``Communicator`` across
    nodes from an mpi4py communicator (collective).
    """

    def __init__(self, comm, node, make_cross):
        self.comm = comm
        self.node = node
        self.k = node.Get_size()
        self.local = node.Get_rank()
        self._shm = None  # the node's window (host arrays), made by the first host call (collective)
        self.ipc = IpcNode(node)  # the node's CUDA IPC (device arrays)
        # The ranks holding the same shard on every node, in global rank order.
        cross = comm.Split(color=self.local, key=comm.Get_rank())
        try:
            self.cross = make_cross(cross)
        finally:
            cross.Free()  # the Communicator works on its own duplicate
        self._bounds = {}
        self._shards = {}
        self.finished = Finished()  # the shard shapes whose trials across nodes have finished

    @property
    def shm(self) -> ShmAllreduce:
        if self._shm is None:
            self._shm = ShmAllreduce(self.node)
        return self._shm

    def free(self) -> None:
        """Release the window, the IPC state and the communicators (collective)."""
        if self._shm is not None:
            self._shm.free()
        self.ipc.free()
        self.cross.free()
        self.node.Free()
        self._shards.clear()

    def bounds(self, n: int):
        """The k node-local shards of ``n`` elements: ``[(lo, hi)]`` per local rank, in order."""
        b = self._bounds.get(n)
        if b is None:
            b = [split(0, n, self.k, j) for j in range(self.k)]
            if len(self._bounds) >= 64:  # a job with ever new sizes must not grow this without bound
                self._bounds.clear()
            self._bounds[n] = b
        return b

    def _shard(self, dtype, count, be=None):
        """This rank's shard buffer (host, or on ``be``'s current device), grown as needed and reused."""
        key = (dtype,) if be is None else (be.name, be.current_device(), dtype)
        buf = self._shards.get(key)
        if buf is None or buf.shape[0] < count:
            buf = self._shards[key] = np.empty(max(count, 1), dtype) if be is None else be.empty(max(count, 1), dtype)
        return buf[:count]

    def run_device(self, be, src, dst, dtype, op, avg_p=None, deadline=None) -> None:
        """``run`` for flat device buffers of the backend ``be`` (one with CUDA IPC) holding ``dtype``, on its
        compute stream."""
        n = src.shape[0]
        bounds = self.bounds(n)
        lo, hi = bounds[self.local]
        shard = self._shard(src.dtype, hi - lo, be)
        cross = self.cross
        self.finished.finish((be.name, dtype, op, hi - lo),
                             lambda: cross.tuning_buffer(be, shard, dtype, op), lambda: be.full(hi - lo, src.dtype, 0),
                             lambda zeros: cross.allreduce_buffer(be, zeros, dtype, op, deadline))
        # agree=: a node whose IPC step fails raises on every rank, not only its own (ipc.IpcNode._call).
        self.ipc.reduce_scatter(be, src, shard, bounds, op, deadline=deadline, agree=self.comm)
        self.cross.allreduce_buffer(be, shard, dtype, op, deadline)
        if avg_p is not None:
            be.scale(shard, avg_p)
        # Nobody reads src after the reduce-scatter's last barrier: an in-place call may now overwrite it.
        self.ipc.allgather(be, shard, dst, bounds, deadline=deadline, agree=self.comm)

    def run(self, src, dst, op, reduce, avg_p=None, deadline=None) -> None:
        """``dst = op over all ranks of src`` (1-D host arrays of one dtype; ``src is dst`` allowed).

        ``op``: "sum", "max", "min" or "prod"; ``avg_p``: divide the sum by it
        at the end ("avg"; not for float16/bfloat16).  ``reduce``: the host
        backend's ``reduce`` (used for the types numpy cannot add directly).
        ``deadline``: a ``ddlkernels.safety.deadline.Deadline`` for the whole call; the
        step across nodes gets what is left of it as its timeout.
        """
        n = src.shape[0]
        bounds = self.bounds(n)
        lo, hi = bounds[self.local]
        shard = self._shard(src.dtype, hi - lo)

        def across(x):
            self.cross.allreduce(x, op, out=x, timeout=None if deadline is None else deadline.remaining())

        def zeros():
            shard[...] = 0  # the last call's allgather has read it
            return shard

        self.finished.finish((src.dtype, op, hi - lo), lambda: self.cross.tuning(shard, op), zeros, across)
        self.shm.reduce_scatter(src, shard, bounds, op, reduce, deadline=deadline)
        across(shard)
        if avg_p is not None:
            scale_inplace(shard, avg_p)
        # Nobody reads src after the reduce-scatter's last barrier: an
        # in-place call may now overwrite it.
        self.shm.allgather(shard, dst, bounds, deadline=deadline)


class Hier(Algorithm):
    """"hier": a tuner candidate for host allreduces when the ranks span several nodes of one size (the node
    split is ``placement.hier_node``; "avg" of float16 and bfloat16 excepted, see the module comment)."""

    name = "hier"
    device = True

    def __init__(self, comm, placement):
        super().__init__(comm, placement)
        self.node = placement.hier_node
        self._hier = None
        self.broken: dict = {}  # backend name -> why CUDA IPC cannot serve its arrays inside the nodes

    @classmethod
    def probe(cls, comm, placement):
        return placement.hier_node is not None

    def serves(self, kind, w):
        device_ok = (getattr(w.be, "ipc", False) and w.dims is None and self.comm.ipc is not False
                     and w.be.name not in self.broken)
        return (kind == "allreduce" and (not w.be.device or device_ok)
                and not (w.avg and is_half(w.dtype)))

    def inner_trials(self, kind, w):
        # Before the first call there is no Communicator across nodes yet (its making is collective).
        return self._hier is None or self._hier.finished.pending(call_key(kind, w))

    def allreduce(self, w):
        pack_segments(w)  # its reduce-scatter reads one buffer
        if self._hier is None:  # collective: every rank chose "hier" for this same call
            c = self.comm
            # Every rank is here (a nonblocking barrier under the call's deadline) before the blocking
            # collectives that set it up.
            complete(c.comm.Ibarrier(), w.deadline, "the hierarchical allreduce's setup (MPI_Ibarrier)")
            # Across nodes: the Communicator's settings; its node label (if any) puts each rank on a node of its own.
            self._hier = HierAllreduce(c.comm, self.node,
                                       lambda cross: c.derived(cross, shm=False, validate=False, timeout=None))
        # Before any return: this call runs the inner trials of its shape, or another algorithm instead.
        self._hier.finished.ran(call_key("allreduce", w))
        avg_p = self.comm.size if w.avg else None
        if w.be.device:
            # CUDA IPC inside the nodes, or the ring for every rank (ddlkernels.algorithms.ipc's module comment).
            why = self._hier.ipc.check(w.be, w.deadline, agree=self.comm.comm)
            if why is not None:
                give_up(self, w.be, why)
                return run_instead(self.comm, "allreduce", w)
            self._hier.run_device(w.be, w.src, w.dst, w.dtype, w.redop, avg_p=avg_p, deadline=w.deadline)
        else:
            self._hier.run(w.src, w.dst, w.redop, w.be.reduce, avg_p=avg_p, deadline=w.deadline)

    def across(self):
        """The Communicator across nodes (what its tuner chose, what it ran last), once the first call made it."""
        return None if self._hier is None else self._hier.cross

    def close_peer_memory(self):
        if self._hier is not None:
            self._hier.ipc.close_mapped()

    def free(self):
        if self._hier is not None:
            self._hier.free()  # frees the node communicator too
        elif self.node is not None:
            self.node.Free()
        self._hier = self.node = None

    def held(self):
        return [x for x in (self._hier, self.node) if x is not None]
