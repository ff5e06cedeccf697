"""The algorithms: each one a module with one ``Algorithm`` subclass, and the registry that enables them.

Worked example, a Communicator of 4 ranks on one node, ``shm=None``::

    place(comm, None, nodes,    do the ranks share one node (yes: ``nodes``, the node split
          aware)                of hier.node_split, holds all 4; one allgather of every
                                rank's node size and CUDA awareness), is MPI CUDA-aware on
                                every rank, may they read each other's memory (a
                                collective: yes, their pids)
    Algorithms(comm, placement) asks each class of REGISTRY whether it applies:
                                  mpi, nbc, ring       always
                                  shm, shm-nt, cma     one node (cma: the probe passed)
                                  ipc                  one node (device arrays)
                                  hier                 no: one node
                                  host                 2 ranks or more (device arrays)
    algos.each()                [mpi, nbc, ring, shm, shm-nt, cma, ipc, host], the order
                                the tuner's candidates keep (the first is the incumbent;
                                device calls ask only ring, ipc and host, and mpi
                                where MPI is CUDA-aware on every rank)

Adding an algorithm is a module here with its ``Algorithm`` subclass and its
place in ``REGISTRY``; ``ddlkernels.select.choice`` asks it ``serves`` and the
collectives run it.
"""

from __future__ import annotations

from .base import Algorithm, Work
from .cma import Cma, probe_pids
from .hier import Hier, uniform_nodes
from .host import Host
from .ipc import Ipc
from .mpi import Mpi, Nbc
from .ring import Ring
from .shm import Shm, ShmNT

__all__ = ["REGISTRY", "Algorithm", "Algorithms", "Placement", "Work", "place"]

#: Every algorithm, in the order of the tuner's candidates (the incumbent first).
REGISTRY = (Mpi, Nbc, Ring, Shm, ShmNT, Cma, Ipc, Hier, Host)


class Placement:
    """What a Communicator's creation learnt of where its ranks are, the same on every rank.

    ``shm``: the user's setting (None, True, False); ``one_node``: every rank shares one node (2 ranks or
    more); ``cma_pids``: every rank's pid where each pair may read the other's memory, else None;
    ``hier_node``: this rank's node communicator where the ranks span several nodes of one size (2 or more
    each) and ``shm`` is not False, else None; ``cuda_aware``: MPI takes device buffers on every rank.
    """

    __slots__ = ("shm", "one_node", "cma_pids", "hier_node", "cuda_aware")

    def __init__(self, shm, one_node=False, cma_pids=None, hier_node=None, cuda_aware=False):
        self.shm, self.one_node, self.cma_pids, self.hier_node = shm, one_node, cma_pids, hier_node
        self.cuda_aware = cuda_aware


def place(comm, shm, nodes, cuda_aware=False) -> Placement:
    """The placement of the mpi4py communicator ``comm`` whose node split is ``nodes`` (``node_split``;
    collective).  ``nodes`` becomes the placement's ``hier_node`` or is freed here.  ``cuda_aware``: this
    rank's MPI takes device buffers; the placement's is whether every rank's does (the device candidates
    depend on it, and every rank must have the same).

    The collectives made here depend on nothing a rank chose alone, so that ranks that differ in ``shm``
    still finish (``validate`` then names it): the pid probe and the node check run whatever ``shm`` is.
    """
    p = comm.Get_size()
    rows = comm.allgather((nodes.Get_size(), bool(cuda_aware)))  # every rank's node size and MPI
    on_one_node = p > 1 and nodes.Get_size() == p
    where = Placement(shm, on_one_node, cuda_aware=all(aware for _, aware in rows))
    if on_one_node:
        where.cma_pids = probe_pids(comm)
    if p > 1 and not on_one_node and uniform_nodes([k for k, _ in rows]) and shm is not False:
        where.hier_node = nodes
    else:
        nodes.Free()
    return where


class Algorithms:
    """The enabled algorithms of one Communicator, in ``REGISTRY`` order (``names``), by name too:
    ``comm.algorithms["shm"]`` is the ``Shm`` object, ``"cma" in comm.algorithms`` whether it is enabled."""

    def __init__(self, comm, placement):
        self.by_name: dict = {}
        for cls in REGISTRY:
            if cls.probe(comm, placement):
                # "shm-nt" and "cma" run on the window of "shm" (enabled wherever they are).
                extra = (self.by_name["shm"],) if cls in (ShmNT, Cma) else ()
                self.by_name[cls.name] = cls(comm, placement, *extra)
        self.order = tuple(self.by_name.values())
        shm = self.by_name.get("shm")
        #: the "shm" algorithm when ``shm=True`` forced it on every host call, else None
        self.forced = shm if shm is not None and shm.forced else None
        #: the window's owner, for ``Communicator.empty``: arrays every rank of the node can read
        self.shared_memory = shm

    def __getitem__(self, name) -> Algorithm:
        return self.by_name[name]

    def __contains__(self, name) -> bool:
        return name in self.by_name

    def __repr__(self):
        return f"Algorithms{self.names}"

    @property
    def names(self) -> tuple:
        return tuple(self.by_name)

    def free(self) -> None:
        """Free every algorithm (collective), the window's users before its owner."""
        for a in reversed(self.order):
            a.free()

    def held(self) -> list:
        return [x for a in self.order for x in a.held()]
