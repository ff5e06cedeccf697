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
"""

from __future__ import annotations

import time

__all__ = ["CollectiveTimeout", "Deadline"]

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

    __slots__ = ("collective", "rank", "timeout", "expires")

    def __init__(self, collective: str, rank: int, timeout: float):
        self.collective = collective
        self.rank = rank
        self.timeout = timeout
        self.expires = time.monotonic() + timeout

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
                from .ring.schedule import chunk_ranges

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
            raise self.expired(what=f"complete {what} (a rank has not joined)")


# Tracebacks print the public name users catch: ddlkernels.CollectiveTimeout.
CollectiveTimeout.__module__ = "ddlkernels"
