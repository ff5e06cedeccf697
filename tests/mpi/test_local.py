"""Local rank and device pinning: MPI's COMM_TYPE_SHARED split, and the GPU each local rank gets."""

import os

import pytest
from mpi4py import MPI

import ddlkernels

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()


def test_local_rank_is_the_rank_among_the_ranks_of_its_node():
    hosts = COMM.allgather(MPI.Get_processor_name())
    mine = [r for r, h in enumerate(hosts) if h == hosts[RANK]]
    assert ddlkernels.local_size() == len(mine)
    assert ddlkernels.local_rank() == mine.index(RANK)
    # Open MPI's launcher counts the same ranks per node (its own local ranks follow its mapping, not
    # always the world order: under --map-by :oversubscribe world ranks 1, 2 had local ranks 2, 1 here).
    if "OMPI_COMM_WORLD_LOCAL_SIZE" in os.environ:
        assert ddlkernels.local_size() == int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"])


def test_local_rank_of_a_subcommunicator_counts_its_own_ranks():
    """Odd and even ranks apart: each half's local ranks are 0.. within the half (all on this node)."""
    half = COMM.Split(RANK % 2, key=-RANK)  # reversed order inside each half
    try:
        assert ddlkernels.local_size(half) == half.Get_size()
        assert ddlkernels.local_rank(half) == half.Get_rank()
        assert ddlkernels.local_rank(ddlkernels.as_communicator(half)) == half.Get_rank()
    finally:
        half.Free()


@pytest.mark.parametrize("devices,size,want", [
    (1, 4, [0, 0, 0, 0]),          # one GPU: every rank shares it
    (4, 4, [0, 1, 2, 3]),          # one GPU per local rank
    (8, 3, [0, 1, 2]),             # more GPUs than ranks
    (2, 5, [0, 1, 0, 1, 0]),       # fewer (more than one): round robin
    (1, 1, [0]),
])
def test_device_index(devices, size, want):
    assert [ddlkernels.device_index(devices, r, size) for r in range(size)] == want


def test_device_index_refuses_what_it_cannot_pick():
    with pytest.raises(ValueError, match="sees no GPU"):
        ddlkernels.device_index(0, 0, 1)
    with pytest.raises(ValueError, match=r"local_rank 2 is not in \[0, 2\)"):
        ddlkernels.device_index(2, 2, 2)
    with pytest.raises(TypeError, match="devices must be an int"):
        ddlkernels.device_index(1.0, 0, 1)
    with pytest.raises(TypeError, match="Intracomm"):
        ddlkernels.local_rank("world")


def test_local_device_on_this_node():
    assert ddlkernels.local_device(1) == 0
    assert ddlkernels.local_device(P) == ddlkernels.local_rank()
