"""What the Communicator chose and measures, per call shape: for reports, benchmarks and tests.

Worked example, 2 ranks on one node::

    comm.candidates(np.zeros(1024, np.float32))        ("mpi", "nbc", "shm")
    comm.tuning(x)                                     True until the trials of 4 KiB are done
    comm.settle(x, "shm")                              (every rank alike) no trials: "shm" runs
    comm.decisions()["allreduce"]                      {"sizes": {"[4096, 8192) B": "shm"},
                                                        "fast": {("sum", float32, 4096): "shm"}}

Each function takes the ``Communicator`` first: they are its methods.
"""

from __future__ import annotations

from ..algorithms.base import Work
from ..select.choice import KINDS
from .arguments import prepare, size

__all__ = ["tuning", "candidates", "settle", "decisions"]


def _work(self, x, op, collective):
    """A ``Work`` without buffers for calls like ``collective(x, op)`` (for allgather ``x`` is the whole
    buffer, not a shard)."""
    if collective not in KINDS:
        raise ValueError(f"collective must be one of {KINDS}, got {collective!r}")
    opname, be, dtype, chunk = prepare(self, x, op, None, None, None)
    count = size(x)
    bounds = None if collective == "allreduce" else self._all_shards(count, None)
    return Work(collective, None, None, count, dtype, None if collective == "allgather" else opname, be, chunk,
                bounds=bounds)


def tuning(self, x, op="sum", *, collective="allreduce") -> bool:
    """Whether ``allreduce(x, op)`` on this communicator is still one of the tuner's timed trials.

    The same on every rank (in place or not: calls of both placements are
    measured together, since ranks may differ in it).  Benchmarks call until
    it is False, so that timed iterations run the settled algorithm
    (``ddlkernels.select.tuner``).  From ``WATCH_FROM`` bytes a settled size
    becomes a trial again if its calls slow down past what its trials allow
    (``SizeTuner.observe``).  ``collective="reduce_scatter"`` or
    ``"allgather"`` asks the same of those collectives for a whole buffer
    like ``x`` (for allgather: the gathered size, not the shard's).  A size
    settled on "hier" or "host" is still measuring until one call of the
    shape has run: that call first lets the Communicator they run steps on
    finish its own trials (``ddlkernels.algorithms.base.finish_trials``).
    """
    return self.selector.measuring(collective, _work(self, x, op, collective))


def candidates(self, x, op="sum", *, collective="allreduce") -> tuple:
    """The algorithms that may run ``collective(x, op)`` with default arguments, the incumbent first.

    One name when a rule fixes it (``dims=``: "ring"; ``shm=True``: "shm";
    ``ipc=True``: "ipc" for device arrays; a fixed ``small_bytes``); else
    the tuner measures them all (``ddlkernels.select.choice``).  Device
    arrays: "mpi" where MPI is CUDA-aware on every rank (and computes the
    call); "ring"; "ipc" where the ranks share a node and the backend offers
    CUDA IPC, "hier" where they span nodes of one size (2 or more ranks
    each); "host" from 2 ranks.  The same on every rank.
    """
    return self.selector.candidates(collective, _work(self, x, op, collective))


def settle(self, x, algorithm, op="sum", *, collective="allreduce") -> None:
    """Run ``algorithm`` (one of ``candidates(x, op)``) for calls of ``x``'s size bucket, without trials.

    Collective in effect: every rank must settle alike before the next such
    call (ranks that ran different algorithms would not meet).  For
    benchmarks and tests of one algorithm; the tuner may still measure the
    size again later, as it does any settled size.
    """
    self.selector.settle(collective, _work(self, x, op, collective), algorithm)


def decisions(self) -> dict:
    """Per collective: ``sizes``, each size bucket measured so far -> its algorithm (or "measuring"),
    ``device_sizes``, the same for device calls, and ``fast``, each call shape with a fast-path plan -> its
    algorithm."""
    return self.selector.decisions()
