"""ddlkernels: topology-aware multi-dimensional ring allreduce over MPI, after IBM PowerAI DDL.

    >>> import numpy as np, ddlkernels
    >>> g = np.random.rand(1 << 20).astype(np.float32)
    >>> ddlkernels.allreduce(g, "avg", out=g)        # in place, every rank gets the same bits

``import ddlkernels`` needs only numpy and mpi4py; GPU backends are imported
when an array of theirs is first seen.  MPI itself is initialised by mpi4py
on first use of a communicator.
"""

from __future__ import annotations

from .safety.abort import abort_on_exception
from .communicator import Communicator, as_communicator
from .safety.deadline import CollectiveTimeout
from ._dtypes import OPS, SUPPORTED_DTYPES
from .fusion import allreduce_many
from .asynchronous import Handle, allreduce_async, allreduce_many_async
from ._local import device_index, local_device, local_rank, local_size

__version__ = "0.1.0"

__all__ = [
    "Communicator",
    "allreduce",
    "Allreduce",
    "allreduce_many",
    "allreduce_async",
    "allreduce_many_async",
    "Handle",
    "reduce_scatter",
    "allgather",
    "shard_range",
    "empty",
    "CollectiveTimeout",
    "abort_on_exception",
    "local_rank",
    "local_size",
    "local_device",
    "device_index",
    "OPS",
    "SUPPORTED_DTYPES",
    "__version__",
]


def allreduce(x, op="sum", *, comm=None, out=None, dims=None, chunk_bytes=None, backend=None, validate=None,
              timeout=None, stream=None):
    """Reduce ``x`` over every rank of ``comm``; see ``Communicator.allreduce``.

    ``comm`` is an mpi4py ``Intracomm`` or a ``Communicator`` (default
    ``MPI.COMM_WORLD``).  Returns the reduced array, of ``x``'s type, shape and
    device (``out`` itself when given; ``out=x`` reduces in place).  Unlike
    ``torch.distributed.all_reduce(t)``, ``x`` itself is left alone unless
    ``out=x``; ``ddlkernels.torch.all_reduce(t)`` is the in-place spelling.
    ``validate=True`` checks first that every rank passed the same count,
    dtype, op and dims; ``timeout`` (seconds) raises ``CollectiveTimeout``
    instead of waiting longer (docs/reliability.md).  ``stream`` (device
    arrays): the stream the call is ordered on; default the caller's current
    stream for the array's library.
    """
    return as_communicator(comm, timeout).allreduce(
        x, op, out=out, dims=dims, chunk_bytes=chunk_bytes, backend=backend, validate=validate, timeout=timeout,
        stream=stream
    )


def Allreduce(sendbuf, recvbuf, op=None, comm=None, *, validate=None, timeout=None):
    """Drop-in for ``comm.Allreduce(sendbuf, recvbuf, op)``; ``MPI.IN_PLACE`` accepted."""
    as_communicator(comm, timeout).Allreduce(sendbuf, recvbuf, op, validate=validate, timeout=timeout)


def reduce_scatter(x, op="sum", *, out=None, comm=None, dims=None, chunk_bytes=None, backend=None, validate=None,
                   timeout=None, stream=None):
    """Reduce ``x`` over every rank and return this rank's shard: elements ``shard_range(x.size)`` (into ``out``)."""
    return as_communicator(comm, timeout).reduce_scatter(
        x, op, out=out, dims=dims, chunk_bytes=chunk_bytes, backend=backend, validate=validate, timeout=timeout,
        stream=stream
    )


def allgather(shard, *, count=None, out=None, comm=None, dims=None, chunk_bytes=None, backend=None, validate=None,
              timeout=None, stream=None):
    """Inverse of ``reduce_scatter``'s split: every rank's shard, concatenated, on every rank.

    ``count``: the whole buffer's element count, when the caller knows it
    (then no shard lengths are exchanged); ``out``: where to gather (see
    ``Communicator.allgather``).
    """
    return as_communicator(comm, timeout).allgather(
        shard, count=count, out=out, dims=dims, chunk_bytes=chunk_bytes, backend=backend, validate=validate,
        timeout=timeout, stream=stream
    )


def shard_range(count, *, comm=None, dims=None, rank=None):
    """``(start, stop)`` of the elements of a ``count``-element buffer that ``reduce_scatter`` leaves on ``rank``.

    The one definition of shard boundaries: the buffer is cut into ``d1``
    balanced blocks (the first ``count % d1`` one element longer), the block of
    the rank's first coordinate into ``d2``, and so on.  For the flat ring
    ``dims=(p,)`` rank r owns block r, as in ``MPI_Reduce_scatter_block``.
    """
    return as_communicator(comm).shard_range(count, dims, rank)


def empty(shape, dtype="float32", *, comm=None):
    """An array every rank of this node can read, so that collectives on it skip a staging copy (collective).

    ``Communicator.empty`` of the communicator the module functions use for
    ``comm`` (``as_communicator``): ``allreduce(a, ..., comm=comm)`` on it
    then reads peers' inputs where they lie.  It lives as long as that
    communicator (for ``comm=None``, until MPI is finalized).
    """
    return as_communicator(comm).empty(shape, dtype)
