"""torch's ``timeout=`` of a ``ddlkernels`` process group, kept as NCCL keeps it: a watchdog beside the work.

Worked example, 2 ranks, ``timeout=timedelta(seconds=60)``, rank 1 dies before an all_reduce::

    rank 0  w = dist.all_reduce(t, async_op=True)  # the progress thread starts it at time 0 (begin)
            ...                                     # and waits in MPI for rank 1
            watchdog, at 60 s: the unit still runs  # w's future fails with CollectiveTimeout
                                                    # ("all_reduce timed out after 60 s on rank 0"), so do
                                                    # the futures queued behind it; the group is broken
            w.wait()                                # raises it
            dist.all_reduce(u)                      # RuntimeError at once: the group is unusable

The collectives themselves run without a deadline: under one (ddlkernels'
``timeout=``) every wait polls in Python, and with more ranks than cores a
64 MiB allreduce on 4 ranks of a 2-core VM took 10.7x its time without
(bench/results/timeout_cost_tuned.txt).  The watchdog costs a call nothing:
it looks once a second (or a quarter of the timeout) at the unit the
progress thread is in.  A unit it gave up on may still complete (a late
rank); if it is still inside MPI when the process exits, the exit aborts the
job instead of finalizing MPI beside it (``deadline.stuck``).
"""

from __future__ import annotations

import _thread
import threading
import time

from ..safety.deadline import CollectiveTimeout, stuck

__all__ = ["Watchdog"]

#: How long the exit waits for a unit abandoned by a timeout to return before it aborts the job (seconds).
EXIT_WAIT = 10.0


class Watchdog:
    """The units of one group's progress thread, failed once one has run past ``timeout`` seconds (None: never).

    Every unit's future goes through it: ``add`` at the call, ``begin`` when
    the progress thread starts it, ``end`` with its completion.
    """

    def __init__(self, timeout, rank, backend):
        self.timeout, self.rank, self.backend = timeout, rank, backend
        self.broken = None  # why, once a unit timed out
        self._guard = threading.Lock()
        self._pending: dict = {}  # id(future) -> future: called, not completed
        self._current = None  # (when the running unit began, its name)
        self._stuck = None  # released when the unit given up on returns
        self._stop = threading.Event()
        self._thread = None
        if timeout is not None:
            self._thread = threading.Thread(target=self._watch, name="ddlkernels-watchdog", daemon=True)
            self._thread.start()

    def check(self) -> None:
        """``RuntimeError`` once a unit has timed out: every later call is refused before any message."""
        if self.broken is not None:
            raise RuntimeError(f"{self.backend}: this process group is unusable: {self.broken}; destroy it (or "
                               f"abort the job)")

    def add(self, fut) -> None:
        """A unit is called (``RuntimeError`` if the group has broken since ``check``)."""
        with self._guard:
            self.check()
            self._pending[id(fut)] = fut

    def begin(self, fut, what) -> bool:
        """The progress thread starts the unit of ``fut``; False where the group broke meanwhile (its future has
        failed: skip it)."""
        with self._guard:
            if self.broken is not None:
                return False
            self._current = (time.monotonic(), what)
            return True

    def end(self, fut, complete) -> None:
        """The unit of ``fut`` has run: ``complete()`` (its result or error) unless the watchdog failed it.

        Whoever takes a future out of ``_pending`` completes it, outside the lock: a future's callbacks run
        inside its completion and may call the group again."""
        with self._guard:
            self._current = None
            ours = self._pending.pop(id(fut), None) is not None
            if self._stuck is not None:
                self._stuck.release()
                self._stuck = None
        if ours:
            complete()

    def _watch(self):
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            with self._guard:
                if self._current is None or time.monotonic() - self._current[0] <= self.timeout:
                    continue
                _, what = self._current
                self.broken = (f"{what} timed out after {self.timeout:g} s on rank {self.rank}: a rank of the "
                               f"group has not joined it (torch's timeout= of the group)")
                exc = CollectiveTimeout(self.broken, collective=what, rank=self.rank, timeout=self.timeout)
                failed = list(self._pending.values())
                self._pending.clear()
                self._stuck = _thread.allocate_lock()
                self._stuck.acquire()
                stuck(self._stuck, EXIT_WAIT, what, self.rank)
            for fut in failed:
                fut.set_exception(exc)
            return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
