"""Fuzz: hypothesis draws collectives and ddlkernels must match numpy on every rank, bitwise alike.

Rank 0 draws each case and every rank runs it (tests/fuzzing.py): every rank
checks what it can alone (no exception, input untouched out of place, its
shard equal to its slice of the gathered whole), rank 0 the result against
the numpy reference and every rank's bits against its own.

The space: the job's size p (run the file under mpirun -n 1..8), n in
0 .. 10^6 biased to the edges (0, 1, p - 1, p, p + 1, primes, chunk and
block boundaries), every dtype and op, dims = every ordered factorization
of p (with and without size-1 dimensions) or None, chunk sizes from 1 byte
to 1 MiB, in place or out of place, the collective (allreduce,
reduce_scatter + allgather, mpi4py-shaped Allreduce), the Communicator
(default; ring only with 1 and 2 receive slots; where p has a divisor
2 <= k < p, node labels making nodes of k ranks, consecutive or round robin:
the planner's box follows them and "hier" is a candidate), validate and
timeout on or off, and two kinds of data (a grid unique per rank and
element, random).

Short run by default (CI); the long run sets the number of examples:

    DDLKERNELS_FUZZ_EXAMPLES=1500 mpirun -n 5 python -m mpi4py tests/_mpi_pytest.py tests/mpi/test_fuzz.py

and the last line of rank 0's output counts cases run and wrong.
"""

import math
import os

import numpy as np
from hypothesis import strategies as st
from mpi4py import MPI

import ddlkernels
from fuzzing import (ALL_DTYPES, P, RANK, check_result, digest, dims_choices, drive, factorizations, gathered,
                     make_input)
from helpers import OPS, node_size

COMM = MPI.COMM_WORLD
EXAMPLES = int(os.environ.get("DDLKERNELS_FUZZ_EXAMPLES", "25"))
# Messages per call are capped so that a 1-byte chunk on a 10^6-element
# buffer stays a test of the chunk logic rather than of patience.
MAX_CHUNKS = 2048
#: ranks per made-up node (node labels): a divisor 2 <= k < P, or None
K = node_size(P)


def edge_sizes(p):
    primes = [2, 3, 5, 7, 13, 31, 127, 257, 4099, 65537, 999_983]
    edges = {0, 1, p - 1, p, p + 1, 2 * p - 1, 2 * p + 1, p * p + 1, 1 << 16, (1 << 16) + 1, 10**6}
    # Around the default chunk (1 MiB of float32) and the small-message threshold (64 KiB).
    edges |= {(1 << 18) - 1, (1 << 18) + 1, (1 << 14) - 1, (1 << 14) + 1}
    return sorted(e for e in edges | set(primes) if 0 <= e <= 10**6)


COLLECTIVES = ["allreduce", "rs+ag", "Allreduce"]
CHUNKS = [None, 1, 2, 6, 64, 1000, 4096, 65536, 1 << 20]

cases = st.fixed_dictionaries(
    {
        "n": st.one_of(
            st.sampled_from(edge_sizes(P)), st.integers(0, 64), st.integers(0, 5000), st.integers(0, 10**6)
        ),
        "dtype": st.sampled_from(range(len(ALL_DTYPES))),
        "op": st.sampled_from(OPS),
        "dims": st.sampled_from(dims_choices(P)),
        "chunk_bytes": st.sampled_from(CHUNKS),
        "inplace": st.booleans(),
        "collective": st.sampled_from(COLLECTIVES),
        "comm": st.sampled_from(range(5 if K else 3)),
        "data": st.sampled_from(["grid", "random"]),
        "seed": st.integers(0, 2**31 - 1),
        "validate": st.booleans(),
        "timeout": st.sampled_from([None, 300.0]),
    }
)

_COMMS = []


def communicators():
    if not _COMMS:
        _COMMS.append(ddlkernels.Communicator(COMM))
        _COMMS.append(ddlkernels.Communicator(COMM, small_bytes=0, window=1))
        _COMMS.append(ddlkernels.Communicator(COMM, small_bytes=0, window=2))
        if K:  # made-up nodes of K ranks: consecutive, then round robin
            _COMMS.append(ddlkernels.Communicator(COMM, node=RANK // K))
            _COMMS.append(ddlkernels.Communicator(COMM, node=RANK % (P // K)))
    return _COMMS


def normalize(case):
    """Clamp the chunk so that a call sends at most about MAX_CHUNKS messages."""
    dt = ALL_DTYPES[case["dtype"]]
    nbytes = case["n"] * np.dtype(dt).itemsize
    cb = case["chunk_bytes"]
    if cb is not None:
        case["chunk_bytes"] = max(cb, math.ceil(nbytes / MAX_CHUNKS))
    return case


def run_case(case):
    """Run ``case`` on this rank; return (complaints, result or None)."""
    x = make_input(case, RANK)
    keep = x.copy()
    comm = communicators()[case["comm"]]
    op, dims, cb = case["op"], case["dims"], case["chunk_bytes"]
    kw = dict(validate=case["validate"], timeout=case["timeout"])
    errs = []
    try:
        if case["collective"] == "allreduce":
            if case["inplace"]:
                y = x.copy()
                r = comm.allreduce(y, op, out=y, dims=dims, chunk_bytes=cb, **kw)
                if r is not y:
                    errs.append("in-place allreduce did not return out")
            else:
                y = comm.allreduce(x, op, dims=dims, chunk_bytes=cb, **kw)
        elif case["collective"] == "Allreduce":
            mpi_op = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}.get(op, op)
            # Allreduce has no dims/chunk arguments: the Communicator's defaults apply.
            if case["inplace"]:
                y = x.copy()
                comm.Allreduce(MPI.IN_PLACE, y, mpi_op, **kw)
            else:
                y = np.full_like(x, 3)
                comm.Allreduce(x, y, mpi_op, **kw)
        else:
            shard = comm.reduce_scatter(x, op, dims=dims, chunk_bytes=cb, **kw)
            y = comm.allgather(shard, dims=dims, chunk_bytes=cb, **kw)
            lo, hi = comm.shard_range(case["n"], dims)
            if shard.shape != (hi - lo,) or not np.array_equal(shard.view(np.uint8), y[lo:hi].view(np.uint8)):
                errs.append(f"rank {RANK}: shard differs from its slice [{lo}, {hi}) of the allgather")
    except Exception as e:  # reported, so that rank 0 fails the example instead of this rank alone
        return [f"rank {RANK}: {type(e).__name__}: {e}"], None
    if not np.array_equal(x.view(np.uint8), keep.view(np.uint8)):
        errs.append(f"rank {RANK}: input modified")
    return errs, y


def one_case(case):
    """Collective: every rank runs ``case``; returns the complaints (on rank 0, all of them)."""
    errs, y = run_case(case)
    flat = gathered(errs, [digest(y)])
    if RANK == 0 and y is not None:
        inputs = [make_input(case, r) for r in range(P)]
        flat += check_result(y, inputs, case["op"], ALL_DTYPES[case["dtype"]])
    return flat


def test_fuzz_collectives():
    communicators()  # collective: created by all ranks before rank 0 starts drawing
    drive(cases.map(lambda c: normalize(dict(c))), one_case, EXAMPLES, "fuzz")


def test_factorizations_are_complete():
    assert sorted(factorizations(12)) == sorted(
        [(12,), (2, 6), (6, 2), (3, 4), (4, 3), (2, 2, 3), (2, 3, 2), (3, 2, 2)]
    )
    assert factorizations(7) == [(7,)]
    for dims in dims_choices(P):
        assert dims is None or math.prod(dims) == P
