"""``abort_on_exception``: turn an exception on one rank into the end of the whole job.

Why: in an MPI job, a rank that raises and exits leaves its peers blocked in
the next collective -- for ever, or until the batch system's wall-clock
limit.  MPI's remedy is ``MPI_Abort``, which makes the launcher kill every
process of the job and exit non-zero.  Two ways to get it:

* scripts run as ``mpirun -n 4 python -m mpi4py script.py``: mpi4py calls
  ``MPI_Abort`` on any uncaught exception (nothing to do in the code);
* library users who cannot change the command line wrap their training loop::

      import ddlkernels

      with ddlkernels.abort_on_exception():
          for batch in loader:
              ...
              ddlkernels.allreduce(grads, "avg", out=grads)

  (it also works as a decorator: ``@ddlkernels.abort_on_exception()``).

On an exception the rank prints the traceback prefixed with its rank to
stderr, flushes, and calls ``Abort(errorcode)`` on ``comm`` (default
``MPI.COMM_WORLD``).  ``SystemExit(0)`` and a normal exit are left alone.
"""

from __future__ import annotations

import contextlib
import sys
import traceback

__all__ = ["abort_on_exception"]


class abort_on_exception(contextlib.ContextDecorator):
    """Context manager / decorator: on an exception inside, print it and ``MPI_Abort`` the job.

    ``comm``: an mpi4py communicator or ``ddlkernels.Communicator`` whose
    processes to abort (default ``MPI.COMM_WORLD``; Open MPI aborts the whole
    job in any case).  ``errorcode``: the job's exit status (default 1).
    """

    def __init__(self, comm=None, errorcode: int = 1):
        self.comm = comm
        self.errorcode = int(errorcode)

    def __enter__(self):
        return self

    def __exit__(self, etype, exc, tb):
        if exc is None:
            return False
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            return False
        from mpi4py import MPI

        comm = self.comm
        if comm is None:
            comm = MPI.COMM_WORLD
        comm = getattr(comm, "mpi_comm", comm)  # a ddlkernels.Communicator
        try:
            rank = MPI.COMM_WORLD.Get_rank()
            text = "".join(traceback.format_exception(etype, exc, tb))
            sys.stderr.write(f"[rank {rank}] aborting the MPI job after an exception:\n{text}")
            sys.stderr.flush()
        finally:
            comm.Abort(self.errorcode)
        return False  # not reached: Abort does not return
