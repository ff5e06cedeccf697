"""The check that every rank passed the same arguments to a call made of several arrays (collective).

Worked example, ``allreduce_many([a, b])`` with ``b`` float32 on rank 0 and float64 on rank 1::

    signature   ("allreduce_many", op, settings, (dtype, shape) of a, (dtype, shape) of b)
    digest      8 bytes of blake2b of it; one MPI_Iallreduce of (h, -h) with MIN
                tells every rank whether all digests are equal
    mismatch    only then the signatures are gathered, and every rank raises
                "tensor 1 is float32[...] on rank 0 but float64[...] on rank 1"

A single collective's own arguments are checked by ``ddlkernels.safety.validate``.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .deadline import CollectiveTimeout, Deadline, complete

__all__ = ["check_same_on_all_ranks"]


def check_same_on_all_ranks(comm, signature, what: str) -> None:
    """Raise ``ValueError`` on every rank unless every rank passed an equal ``signature`` (collective).

    One 16-byte ``MPI_Iallreduce`` of a digest; on a mismatch the signatures
    themselves are gathered so the error can say which rank passed what.
    ``comm`` is an mpi4py communicator, or a ``Communicator`` (then on its
    own communicator, waited for under its ``timeout``: a timeout leaves it
    unusable, as any collective's).  Nonblocking on every rank, with or
    without a deadline: the ranks meet in it either way.
    """
    from mpi4py import MPI

    ours = not isinstance(comm, MPI.Comm)  # a ddlkernels Communicator
    mpi = comm.comm if ours else comm
    if mpi.Get_size() == 1:
        return
    deadline = None
    if ours:
        comm._usable()
        if comm.timeout is not None:
            deadline = Deadline(what, comm.rank, comm.timeout)
    digest = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little", signed=True) >> 1  # -h must not overflow
    both = np.array([h, -h], dtype=np.int64)
    try:
        complete(mpi.Iallreduce(MPI.IN_PLACE, both, op=MPI.MIN), deadline, "the argument check (MPI_Iallreduce)")
    except CollectiveTimeout as exc:
        if ours:
            comm._break(str(exc))
        raise
    if both[0] == h and -both[1] == h:
        return
    sigs = mpi.allgather(signature)  # every rank is here: it passed the digest's reduction
    raise ValueError(f"{what}: ranks passed different arguments: {_describe_difference(sigs)}")


def _describe_difference(sigs) -> str:
    ref = sigs[0]
    for r, s in enumerate(sigs):
        if s == ref:
            continue
        if s[:3] != ref[:3]:
            return f"rank 0 passed op and settings {ref[1:3]}, rank {r} {s[1:3]}"
        if len(s) != len(ref):
            return f"rank 0 passed {len(ref) - 3} tensors, rank {r} {len(s) - 3}"
        i = next(k for k in range(3, len(s)) if s[k] != ref[k])
        return f"tensor {i - 3} is {_fmt(ref[i])} on rank 0 but {_fmt(s[i])} on rank {r}"
    return "signatures differ"  # pragma: no cover - the digests differed, so some signature does


def _fmt(item) -> str:
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
        return f"{item[0]}{list(item[1])}"
    return repr(item)
