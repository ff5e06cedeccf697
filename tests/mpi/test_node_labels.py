"""Node labels (``Communicator(node=)``): ranks MPI puts on one node, made to act as several.

Every rank of an ``mpirun`` here shares one node.  The labels split it into
made-up nodes: consecutive ranks (0,1 | 2,3), round robin (0,2 | 1,3), a node
per rank, or one node for all.  Each must reach the topology (the planner's
box), the placement (shared memory only inside a node; "hier" where the nodes
are of one size, 2 or more ranks each) and the Communicators made from the
user's (the progress thread's, "hier"'s across nodes), and every call stays
right.  Bad labels raise on every rank, before any collective that could hang.
"""

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels
from ddlkernels.asynchronous import progress_engine
from helpers import assert_close, assert_same_on_all_ranks, node_size, rank_data

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
K = node_size(P)  # ranks per made-up node, or None

needs_peers = pytest.mark.skipif(P == 1, reason="one rank: a single node whatever its label")


def labels(scheme):
    """This rank's label under ``scheme``, and every rank's node as a list of node numbers."""
    if scheme == "one per rank":
        return f"r{RANK}", list(range(P))
    if scheme == "one for all":
        return "all", [0] * P
    k = K or 1
    if scheme == "block":
        return RANK // k, [r // k for r in range(P)]
    return RANK % (P // k), [r % (P // k) for r in range(P)]  # round robin


SCHEMES = ["one per rank", "one for all", "block", "round robin"]


@needs_peers
@pytest.mark.parametrize("scheme", SCHEMES)
def test_labels_make_the_nodes_of_topology_placement_and_calls(scheme):
    if scheme in ("block", "round robin") and K is None:
        pytest.skip(f"{P} ranks cannot be split into 2+ nodes of 2+ ranks each")
    label, node_of = labels(scheme)
    per_node = node_of.count(node_of[RANK])
    nodes = len(set(node_of))
    x = rank_data(4097, RANK, P, np.float64)
    inputs = COMM.allgather(x)
    with ddlkernels.Communicator(COMM, node=label) as dc:
        topo = dc.topology
        assert topo.levels[0].fanout == per_node, topo
        assert topo.depth == (1 if nodes == 1 else 2), topo
        if nodes > 1:
            assert topo.levels[1].fanout == nodes, topo
            # The box's node dimension holds the ranks of one node: round robin reorders the ring.
            order = topo.topology_order()
            assert [node_of[r] for r in order] == sorted(node_of), (order, node_of)
        # Shared memory only where every rank shares the node; "hier" where nodes of one size have 2+ ranks.
        assert ("shm" in dc.algorithms) == (nodes == 1)
        assert ("hier" in dc.algorithms) == (1 < nodes < P)
        for op in ("sum", "max"):
            for cand in dc.candidates(x, op):  # every candidate once, settled on every rank alike
                dc.settle(x, cand, op)
                y = dc.allreduce(x, op)
                assert dc.last_algorithm == cand
                what = f"{scheme}: {cand} {op}"
                assert_close(y, inputs, op, np.float64, what)
                assert_same_on_all_ranks(COMM, y, what)
        if "hier" in dc.algorithms:
            cross = dc.algorithms["hier"]._hier.cross
            # Across nodes: one rank per made-up node, each its own node (no shared memory, no CUDA IPC
            # between them), with the user's settings.
            assert cross.size == nodes and cross.topology.levels[0].fanout == 1
            assert not {"shm", "ipc", "hier"} & set(cross.algorithms.names), cross.algorithms
            assert cross.chunk_bytes == dc.chunk_bytes and cross._settings["node"] == label


@needs_peers
def test_the_made_communicators_keep_the_users_settings():
    """The progress thread's Communicator takes ipc=, cuda_aware=, the chunk and the node label."""
    label = RANK // K if K else RANK
    x = rank_data(1000, RANK, P, np.int64)
    with ddlkernels.Communicator(COMM, node=label, ipc=False, cuda_aware=False, chunk_bytes=4096,
                                 window=2) as dc:
        got = ddlkernels.allreduce_async(x, "sum", comm=dc).wait()
        assert_close(got, COMM.allgather(x), "sum", np.int64, "async")
        inner = progress_engine(dc).comm  # the engine allreduce_async made
        assert inner is not dc
        for key in ("ipc", "cuda_aware", "chunk_bytes", "window", "node"):
            assert inner._settings[key] == dc._settings[key], key


@needs_peers
def test_some_ranks_without_a_label_raise_on_every_rank_and_the_next_communicator_works():
    label = None if RANK == P - 1 else "n"
    with pytest.raises(ValueError, match=rf"rank\(s\) \[{P - 1}\] gave no node label"):
        ddlkernels.Communicator(COMM, node=label)
    with ddlkernels.Communicator(COMM, node="n") as dc:  # every rank goes on to the next Communicator
        y = dc.allreduce(np.full(5, RANK + 1.0), "sum")
        assert np.array_equal(y, np.full(5, P * (P + 1) / 2))


def test_a_label_of_another_type_raises_before_any_communication():
    # Only this rank checks: were there any communication, the ranks that skip it would hang the test.
    if RANK == 0:
        with pytest.raises(TypeError, match="node must be None, a str or an int"):
            ddlkernels.Communicator(COMM, node=2.5)
    COMM.Barrier()
