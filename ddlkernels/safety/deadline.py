"""Waiting with a deadline: the optional ``timeout=`` of every collective.

Without a timeout the engine calls ``req.Wait()`` and this module is never
touched, so the default path costs nothing.  With one, every wait becomes a
loop of ``req.Test()`` calls against one deadline for the whole collective;
on expiry it raises ``CollectiveTimeout`` naming what the rank was waiting
for.  Worked example, 4 ranks, rank 2 never joins an allreduce of 8 Mi
floats (flat ring, timeout=5)::

    rank 3:  CollectiveTimeout: allreduce timed out after 5.0 s on rank 3:
             waiting to receive from rank 2 in reduce-scatter along dimension 1
             (phase 0), step 0, chunk 0 of 2 (elements [2097152, 2621440))
    rank 0:  ... waiting to receive from rank 3 ... step 1 ...

so the rank that did not join is the one its ring successor names, and the
others name a rank that was itself stuck -- the same reading as Horovod's
stall report.

Polling keeps MPI progressing (Open MPI progresses inside ``Test``) and backs
off from busy spinning to sleeps of at most ``_MAX_SLEEP`` seconds, so a
stalled rank does not burn a core that its peers need on an oversubscribed
node.  After a timeout the communicator's outstanding messages are in an
unknown state: ``Communicator`` refuses further collectives on it (make a
new one, or abort the job -- see ``ddlkernels.abort_on_exception``).

What an abandoned collective still uses is kept for the rest of the process
(``abandon``): MPI owns a pending request's buffers until it completes, which
it may do at any later progress call (a late rank arrives), and a request
freed while active would be an erroneous ``MPI_Request_free`` of a
collective.  Dropping them let MPI write a late peer's data into freed
memory (a segfault in the next ``MPI_Comm_dup`` or in ``MPI_Finalize``).

MPI's blocking and nonblocking collectives never match each other, so a
rank with a deadline must make the very call its peers without one make.
Where that call is a blocking one (MPI's own ``MPI_Allreduce`` that the
tuner chose as "mpi", ``MPI_Reduce_scatter``, ``MPI_Allgather``), the rank
makes it on a helper thread (``BlockingRunner``) and waits for it with the
deadline; everywhere else the library itself uses only nonblocking calls
(``complete``), waited for with ``Wait()`` or polled.

A blocking call abandoned so stays in MPI until the missing rank makes it.
MPI cannot finalize while a thread is inside a call (seen: a segfault in
``MPI_Finalize``), so at exit the process first waits for such calls, as
long as their timeout (a late rank arrives and completes them); one still
waiting then can never complete, and the job is aborted with a message
saying so instead of crashing (``_finish_abandoned_calls``).
"""

from __future__ import annotations

import _thread
import atexit
import queue
import sys
import threading
import time

__all__ = ["CollectiveTimeout", "Deadline", "BlockingRunner", "abandon", "complete", "stuck"]

#: What abandoned collectives still use (requests, their buffers, windows, Communicators, helper threads' calls):
#: never released while the process runs.  Bounded by the number of timeouts a process survives.
_ABANDONED: list = []


def abandon(*objs) -> None:
    """Keep ``objs`` alive until the process exits: an abandoned collective may still use them."""
    _ABANDONED.append(objs)


#: Blocking calls abandoned by a timeout, as (lock released when the call returns, its timeout, what it is, rank).
_STUCK: list = []


def stuck(done, seconds: float, what: str, rank: int) -> None:
    """A call abandoned by a timeout may still be inside MPI: at exit, wait up to ``seconds`` for ``done`` (a
    lock its thread releases when the call returns), else abort the job (``_finish_abandoned_calls``)."""
    _STUCK.append((done, seconds, what, rank))


@atexit.register
def _finish_abandoned_calls():
    """At exit, before MPI finalizes: wait for abandoned blocking calls (each up to its timeout, from now);
    abort the job, saying why, if one never returns (``MPI_Finalize`` beside it would crash)."""
    left = [job for job in _STUCK if not job[0].acquire(timeout=job[1])]
    if not left:
        return
    _, timeout, what, rank = left[0]
    sys.stderr.write(
        f"ddlkernels: rank {rank} is exiting while {what}, abandoned by a timeout, still waits for a rank that "
        f"never made the call (waited {timeout:g} s more at exit); MPI cannot finalize beside it: aborting the "
        "job\n")
    sys.stderr.flush()
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(1)

# Polling spins on Test() for up to _SPIN_SECONDS of one wait -- as MPI's
# own Wait() does -- because a message that is on its way arrives within
# that time and a sleep would add the scheduler's wake-up latency to every
# chunk (measured: sleeping after 200 spins made 1 MiB allreduces 25x slower
# on an oversubscribed node).  Only a wait that lasts longer, i.e. a peer
# that is late, backs off to sleeps of _MIN_SLEEP doubling to _MAX_SLEEP.
_SPIN_SECONDS = 0.05
_CHECK_EVERY = 64
_MIN_SLEEP = 50e-6
_MAX_SLEEP = 1e-3


class CollectiveTimeout(TimeoutError):
    """A collective did not complete within its ``timeout``.

    Attributes (``None`` where not applicable): ``collective`` ("allreduce",
    "reduce_scatter", "allgather"), ``phase`` (a description such as
    "reduce-scatter along dimension 1"), ``step`` (ring step within the
    phase), ``chunk`` (chunk index within the step), ``peer`` (the
    communicator rank this rank was waiting on), ``rank`` (this rank),
    ``timeout`` (seconds).
    """

    def __init__(self, message, *, collective=None, phase=None, step=None, chunk=None, peer=None, rank=None,
                 timeout=None):
        super().__init__(message)
        self.collective = collective
        self.phase = phase
        self.step = step
        self.chunk = chunk
        self.peer = peer
        self.rank = rank
        self.timeout = timeout


def _check_timeout(timeout):
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
    return float(timeout)


def _phase_name(ring_step) -> str:
    kind = "reduce-scatter" if ring_step.reduce else "allgather"
    return f"{kind} along dimension {ring_step.dim + 1} (phase {ring_step.phase})"


class Deadline:
    """One collective's deadline; ``wait*`` poll requests until it passes.

    ``collective`` names the call for the error message, ``rank`` is this
    rank, ``timeout`` is in seconds and counts from construction.
    """

    __slots__ = ("collective", "rank", "timeout", "expires", "pending")

    def __init__(self, collective: str, rank: int, timeout: float):
        self.collective = collective
        self.rank = rank
        self.timeout = timeout
        self.expires = time.monotonic() + timeout
        #: requests (and what else) the collective may leave in flight: kept if it times out (``abandon``)
        self.pending = []

    def remaining(self) -> float:
        """Seconds left, at least a microsecond (a timeout of its own for a nested collective)."""
        return max(1e-6, self.expires - time.monotonic())

    def poll(self, req) -> bool:
        """Test ``req`` until it completes (True) or the deadline passes (False)."""
        test = getattr(req, "Test", None)
        if test is None:
            raise TypeError(
                f"timeout= needs transport requests with Test(); {type(req).__name__} has none"
            )
        if test():
            return True
        spin_until = min(time.monotonic() + _SPIN_SECONDS, self.expires)
        while True:
            for _ in range(_CHECK_EVERY):
                if test():
                    return True
            if time.monotonic() >= spin_until:
                break
        sleep = _MIN_SLEEP
        while True:
            if test():
                return True
            now = time.monotonic()
            if now >= self.expires:
                return test()
            time.sleep(min(sleep, self.expires - now))
            sleep = min(sleep * 2, _MAX_SLEEP)

    def expired(self, *, what: str, peer=None, phase=None, step=None, chunk=None, detail: str = ""):
        """The ``CollectiveTimeout`` to raise: ``what`` is e.g. "receive from"."""
        where = []
        if phase is not None:
            where.append(phase)
        if step is not None:
            where.append(f"step {step}")
        if chunk is not None:
            where.append(f"chunk {chunk}")
        tail = (" in " + ", ".join(where)) if where else ""
        peer_txt = f" rank {peer}" if peer is not None else ""
        abandon(self.pending)  # whatever the collective left in flight stays valid (module comment)
        msg = (
            f"{self.collective} timed out after {self.timeout:g} s on rank {self.rank}: "
            f"waiting to {what}{peer_txt}{tail}{detail}"
        )
        return CollectiveTimeout(msg, collective=self.collective, phase=phase, step=step, chunk=chunk, peer=peer,
                                 rank=self.rank, timeout=self.timeout)

    # -- the engine's three kinds of wait --------------------------------
    def wait_recv(self, req, ring_step, chunk_index, nchunks, a, b):
        """Wait for the receive of chunk ``chunk_index`` (elements [a, b)) of ``ring_step``."""
        if not self.poll(req):
            self.pending.append(req)
            raise self.expired(
                what="receive from", peer=ring_step.recv_peer, phase=_phase_name(ring_step), step=ring_step.step,
                chunk=f"{chunk_index} of {nchunks}", detail=f" (elements [{a}, {b}))",
            )

    def wait_sends(self, sends, ring, chunk):
        """Wait for every send of one phase; on expiry name the first one still pending.

        The engine appends sends in a fixed order -- the chunks of step 0's
        send range, then each chunk forwarded in steps 1, 2, ... (the range
        received in step s is sent in step s + 1) -- which is rebuilt here
        only when a send has to be named, so the engine records nothing.
        """
        for i, req in enumerate(sends):
            if not self.poll(req):
                self.pending.append(sends)
                from ..ring.schedule import chunk_ranges

                labels = [(0, k, a, b) for k, (a, b) in enumerate(chunk_ranges(*ring[0].send, chunk))]
                for st in ring[:-1]:
                    labels += [(st.step + 1, k, a, b) for k, (a, b) in enumerate(chunk_ranges(*st.recv, chunk))]
                s, k, a, b = labels[i] if i < len(labels) else (None, i, None, None)
                raise self.expired(
                    what="send to", peer=ring[0].send_peer, phase=_phase_name(ring[0]), step=s, chunk=k,
                    detail=f" (elements [{a}, {b}))" if a is not None else "",
                )

    def wait_mpi(self, req, what: str):
        """Wait for a nonblocking MPI collective (``what`` names it, e.g. "MPI_Iallreduce")."""
        if not self.poll(req):
            self.pending.append(req)
            raise self.expired(what=f"complete {what} (a rank has not joined)")


def complete(req, deadline, what: str) -> None:
    """Wait for the nonblocking collective ``req``: ``Wait()`` without a deadline, else polled against it.

    Either way the same MPI call was made, so ranks with and without a ``timeout=`` meet in it.
    """
    if deadline is None:
        req.Wait()
    else:
        deadline.wait_mpi(req, what)


class BlockingRunner:
    """A thread that makes blocking MPI calls for a caller who waits for them until a deadline.

    For the calls a rank with a deadline must make blocking, because its
    peers may make them without one (see the module comment).  The caller
    blocks on an event, not spinning: the GIL stays free for the call's
    return.  If the deadline passes first, the call and its arguments are
    abandoned to this thread, which stays in MPI until the call completes
    (a late rank arrives) or the process ends; the owner is then broken and
    makes no more calls.  One per ``Communicator`` (whose calls come from
    one thread at a time), started on first use.  The hand-over is a C queue
    and a C lock each way (``threading.Event`` is Python code): it is paid on
    every such call.
    """

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="ddlkernels-blocking-call", daemon=True)
        self._thread.start()

    def _loop(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, done, failed = job
            try:
                fn(*args)
            except BaseException as exc:  # re-raised by the waiting caller
                failed.append(exc)
            done.release()

    def call(self, deadline, what: str, fn, *args) -> None:
        """``fn(*args)`` on this thread; ``CollectiveTimeout`` naming ``what`` if it has not returned by ``deadline``."""
        done, failed = _thread.allocate_lock(), []
        done.acquire()  # released by the thread when the call returns
        self._jobs.put((fn, args, done, failed))
        if not done.acquire(timeout=max(0.0, deadline.expires - time.monotonic())):
            deadline.pending.append((self, fn, args))
            stuck(done, deadline.timeout, what, deadline.rank)
            raise deadline.expired(what=f"complete {what} (a rank has not joined)")
        if failed:
            raise failed[0]

    def close(self) -> None:
        """Let the thread end once its current call (if any) returns."""
        self._jobs.put(None)


# Tracebacks print the public name users catch: ddlkernels.CollectiveTimeout.
CollectiveTimeout.__module__ = "ddlkernels"
