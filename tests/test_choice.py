"""Which algorithms may run a call: the registry's ``serves`` and the fixed rules (``ddlkernels.select.choice``),
in one process, on a stand-in Communicator."""

import numpy as np
import pytest

from ddlkernels._dtypes import BFLOAT16
from ddlkernels.algorithms import Algorithms, Placement, Work
from ddlkernels.algorithms.cma import CMA_FROM, CMA_GATHER_FROM
from ddlkernels.algorithms.mpi import RING_FROM
from ddlkernels.algorithms.shm import GATHER_STREAM_FROM, SPILL_FROM
from ddlkernels.backends import get_backend
from ddlkernels.select.choice import Selector
from ddlkernels.select.tuner import MPI_BELOW


class Stub:
    """What the algorithms and the Selector ask of a Communicator of ``size`` ranks."""

    def __init__(self, size, small_bytes, ipc=None):
        self.size, self.small_bytes, self.comm, self.ipc = size, small_bytes, None, ipc

    def rank_ordered(self, count):
        return True


class Device:
    name = "device"  # what names a backend (the algorithms keep per-backend state by it)
    device = True
    ipc = False


class IpcDevice(Device):
    ipc = True


def candidates(nbytes, dtype=np.float64, op="sum", kind="allreduce", *, one_node=False, cma=False, hier=False,
               shm=None, size=2, small_bytes=None, device=False, dims=None, ipc=None):
    stub = Stub(size, small_bytes, ipc)
    where = Placement(shm, one_node, np.arange(size) if cma else None, object() if hier else None)
    algos = Algorithms(stub, where)
    dtype = np.dtype(dtype)
    be = {False: get_backend("numpy"), True: Device(), "ipc": IpcDevice()}[device]
    w = Work(kind, None, None, nbytes // dtype.itemsize, dtype, None if kind == "allgather" else op, be, None, dims)
    return Selector(stub, algos).candidates(kind, w)


@pytest.mark.parametrize(
    "nbytes,op,one_node,want",
    [
        (0, "sum", False, ("mpi", "nbc")),
        (MPI_BELOW - 8, "sum", True, ("mpi", "nbc", "shm")),
        (MPI_BELOW, "sum", False, ("mpi", "ring")),
        (SPILL_FROM - 8, "sum", True, ("mpi", "ring", "shm")),
        (SPILL_FROM, "sum", False, ("mpi", "ring")),
        (SPILL_FROM, "sum", True, ("mpi", "ring", "shm", "shm-nt")),  # the window with its results spilled too
        (RING_FROM - 8, "sum", True, ("mpi", "ring", "shm", "shm-nt")),
        (RING_FROM, "sum", False, ("ring",)),
        (RING_FROM, "sum", True, ("ring", "shm", "shm-nt")),
        (16, "max", False, ("ring",)),  # float max/min: MPI's drop a NaN, so MPI is no candidate
        (16, "max", True, ("ring", "shm")),
    ],
)
def test_allreduce_candidates_in_registry_order(nbytes, op, one_node, want):
    assert candidates(nbytes, op=op, one_node=one_node) == want


@pytest.mark.parametrize("nbytes,want", [
    (CMA_FROM - 8, ("mpi", "nbc", "shm")),
    (CMA_FROM, ("mpi", "nbc", "shm", "cma")),  # the single copy from CMA_FROM, after the window
    (MPI_BELOW, ("mpi", "ring", "shm", "cma")),
    (1 << 20, ("mpi", "ring", "shm", "cma")),
    (SPILL_FROM, ("mpi", "ring", "shm", "shm-nt", "cma")),
    (RING_FROM, ("ring", "shm", "shm-nt", "cma")),
])
def test_the_single_copy_where_the_probe_passed(nbytes, want):
    assert CMA_FROM < MPI_BELOW < SPILL_FROM
    assert candidates(nbytes, one_node=True, cma=True) == want
    assert "cma" not in candidates(nbytes, one_node=True)
    assert "cma" not in candidates(nbytes, np.float16, one_node=True, cma=True)  # numpy's own ufuncs only


def test_hier_across_nodes_of_one_size_but_not_for_half_precision_avg():
    assert candidates(1 << 20, hier=True) == ("mpi", "ring", "hier")
    assert candidates(1 << 20, np.float16, "avg", hier=True) == ("ring",)
    assert candidates(1 << 20, np.float16, "sum", hier=True) == ("ring", "hier")
    assert candidates(1 << 20, np.float32, "avg", hier=True) == ("mpi", "ring", "hier")


def test_fixed_rules():
    # Device arrays: the ring, and "host" (pieces reduced by the host's algorithms through pinned memory) ...
    assert candidates(4096, one_node=True, device=True) == ("ring", "host")
    assert candidates(4096, device=True) == ("ring", "host")
    assert candidates(4096, one_node=True, device=True, size=1) == ("ring",)  # ... from 2 ranks
    # A backend with CUDA IPC: "ipc" beside them for allreduce on one node, whatever the size and op ...
    assert candidates(4096, one_node=True, device="ipc", shm=True) == ("ring", "ipc", "host")
    assert candidates(4096, one_node=True, device="ipc", small_bytes=0) == ("ring",)  # a fixed path: measure nothing
    assert candidates(4096, one_node=True, device="ipc", small_bytes=0, ipc=True) == ("ipc",)
    assert candidates(64 << 20, op="max", one_node=True, device="ipc") == ("ring", "ipc", "host")
    assert candidates(4096, one_node=True, device="ipc", ipc=True) == ("ipc",)  # ... forced
    assert candidates(4096, one_node=True, device="ipc", ipc=False) == ("ring", "host")  # ... never
    assert candidates(4096, one_node=False, device="ipc", ipc=True) == ("ring", "host")  # ranks on several nodes
    assert candidates(4096, one_node=True, device="ipc", dims=(2,)) == ("ring",)
    for kind in ("reduce_scatter", "allgather"):  # ... and "ipc" and "host" beside the ring for these too
        assert candidates(4096, one_node=True, device="ipc", kind=kind) == ("ring", "ipc", "host")
        assert candidates(4096, one_node=True, device="ipc", kind=kind, ipc=False) == ("ring", "host")
        assert candidates(4096, one_node=True, device="ipc", kind=kind, ipc=True) == ("ipc",)
        assert candidates(4096, one_node=True, device=True, kind=kind) == ("ring", "host")
        assert candidates(4096, one_node=True, device=True, kind=kind, size=1) == ("ring",)
    # Across nodes of one size: the hierarchical allreduce (IPC inside each node) beside them ...
    assert candidates(4096, hier=True, device="ipc") == ("ring", "hier", "host")
    assert candidates(4096, hier=True, device=True) == ("ring", "host")  # ... where the backend has CUDA IPC
    assert candidates(4096, hier=True, device="ipc", ipc=False) == ("ring", "host")  # ... and IPC is not off
    assert candidates(4096, np.float16, op="avg", hier=True, device="ipc") == ("ring", "host")  # one rounding
    assert candidates(4096, one_node=True, dims=(2,)) == ("ring",)  # a box asked for
    assert candidates(4096, one_node=True, shm=True) == ("shm",)  # forced
    assert candidates(4096, one_node=True, shm=True, kind="allgather") == ("shm",)
    assert candidates(4096, one_node=True, shm=False) == ("mpi", "nbc")
    assert candidates(4096, small_bytes=8192) == ("mpi",)  # a fixed threshold: MPI's call below it ...
    assert candidates(8192, small_bytes=8192) == ("ring",)  # ... the ring from it
    assert candidates(64 << 20, small_bytes=1 << 40) == ("mpi",)  # whatever the size, where MPI computes it
    assert candidates(4096, op="max", small_bytes=8192) == ("ring",)
    assert candidates(4096, size=1) == ("ring",)  # one rank: nothing to choose


def test_reduce_scatter_and_allgather_candidates():
    rs = dict(kind="reduce_scatter", one_node=True, cma=True)
    assert candidates(GATHER_STREAM_FROM * 4, **rs) == ("mpi", "ring", "shm")  # no streaming, no single copy
    assert candidates(4096, np.float16, **rs) == ("ring", "shm")  # MPI has no float16 reduction
    ag = dict(kind="allgather", one_node=True, cma=True)
    assert candidates(4096, np.float16, **ag) == ("mpi", "ring", "shm")  # allgather moves bytes: any dtype
    assert candidates(CMA_GATHER_FROM - 8, **ag) == ("mpi", "ring", "shm")
    assert candidates(CMA_GATHER_FROM, **ag) == ("mpi", "ring", "shm", "cma")
    assert candidates(GATHER_STREAM_FROM, **ag) == ("mpi", "ring", "shm", "shm-nt", "cma")
    assert candidates(GATHER_STREAM_FROM, BFLOAT16, kind="allgather") == ("mpi", "ring")
