"""How chunks travel between ranks: the seam between the engine and MPI.

The engine asks a transport to start sending or receiving one chunk, a
contiguous slice of a backend buffer, and gets back a request with a
``Wait()`` method.  When ``Wait()`` returns on a receive, the data is in the
destination slice and the backend may read it; when it returns on a send,
the source slice may be overwritten.

* ``HostTransport`` hands the buffers straight to MPI: host memory, or device
  memory when MPI is CUDA-aware.  For host buffers its requests are mpi4py's
  own, so the host path pays nothing for the abstraction.
* Device buffers without a CUDA-aware MPI use the staging transport
  (``ddlkernels.transport.staged``), which copies each chunk through pinned host
  memory and overlaps those copies with the MPI transfers.
"""

from __future__ import annotations

import abc

__all__ = ["Transport", "HostTransport"]


class Transport(abc.ABC):
    """Start the transfer of one chunk; the returned request has ``Wait()``."""

    @abc.abstractmethod
    def isend(self, buf, peer: int, tag: int):
        """Start sending ``buf`` to ``peer``; ``buf`` must stay untouched until the request completes."""

    @abc.abstractmethod
    def irecv(self, buf, peer: int, tag: int):
        """Start receiving into ``buf`` from ``peer``."""

    def close(self) -> None:
        """Release resources (pinned buffers, streams)."""


class HostTransport(Transport):
    """MPI on the buffers themselves."""

    def __init__(self, comm, backend=None):
        self.comm = comm
        if backend is not None and backend.device:
            # CUDA-aware MPI reads and writes device memory directly, outside the streams: the
            # kernels that produced a chunk must have finished before it is sent, and those that
            # still read or write a buffer (a receive slot the engine reposts right after launching
            # the reduction that reads it) before MPI may write it.
            def isend(buf, peer, tag, _sync=backend.synchronize, _isend=comm.Isend):
                _sync()
                return _isend(buf, peer, tag)

            def irecv(buf, peer, tag, _sync=backend.synchronize, _irecv=comm.Irecv):
                _sync()
                return _irecv(buf, peer, tag)

            self.isend, self.irecv = isend, irecv
        else:
            self.isend, self.irecv = comm.Isend, comm.Irecv

    # The bound methods set in __init__ shadow these; they exist so that the
    # class satisfies the interface.
    def isend(self, buf, peer, tag):  # noqa: F811
        return self.comm.Isend(buf, peer, tag)

    def irecv(self, buf, peer, tag):  # noqa: F811
        return self.comm.Irecv(buf, peer, tag)
