"""Pick the algorithm per message size, from measurement, the same on every rank.

Several algorithms compute the same result: MPI's own blocking call ("mpi")
and, for an allreduce, its nonblocking one ("nbc"), this library's ring
("ring"), and on one node the shared-memory window ("shm", "shm-nt") and the
single-copy reads ("cma"), across nodes the window inside each node
("hier").  Which of them serve a call (its size, dtype, op, placement) is
decided by ``ddlkernels.select.choice`` and each algorithm's ``serves()``;
the first of them is the incumbent.  Which one is fastest depends on the MPI
library, the machine and p, so a ``SizeTuner`` (one per collective)
measures it per power-of-two size bucket and candidate set.

Trials.  The first calls of a bucket go round the candidates in blocks of
consecutive calls, each call still computing a correct result: ``trials``
timed calls per candidate (``SMALL_TRIALS`` below ``MPI_BELOW``, else
``TRIALS``), in blocks of ``block`` calls, each block after one untimed call
that absorbs the skew the previous algorithm left between the ranks; in a
run of calls of one algorithm every rank's time per call tends to what a
loop of calls pays (bench/results/constants.md, block).  Then one small
``MPI_Allreduce(MAX)`` of every rank's median time per candidate fixes the
bucket's choice on every rank at once: the fastest challenger when it was at
least ``margin`` times faster than the incumbent (``SMALL_MARGIN`` below
``MPI_BELOW``, else ``MARGIN``), the incumbent otherwise.  The median, not
the minimum: a training loop pays the typical call.

The watch.  From ``WATCH_FROM`` bytes a settled choice is not final: the
machine can change under it.  Every rank keeps timing the calls of a watched
bucket, and about every ``CHECK_SECONDS`` of calls (``watch_interval``) one
8-byte ``MPI_Allreduce(MAX)`` of the ranks' median compares it with the
trials: the bucket is measured again when its calls now take longer than the
runner-up took (by ``MARGIN``) or ``DRIFT`` times as long as they took
themselves, and after ``EXPLORE_CHECKS`` quiet checks anyway (a runner-up
that became faster is never timed).  A re-measurement that keeps the winner
doubles the interval (up to ``WATCH_MAX_CALLS``); one that the winner's
slower calls started charges it what those calls took.

The recount.  Below ``WATCH_FROM`` calls are not timed (they are the latency
the fast paths exist for), but a settled bucket is measured again after
``RECOUNT_CALLS`` of its calls, then after twice as many each time the
winner stays: a job's first calls may have chosen in its start-up noise.

Every rank makes the same calls with the same sizes (a collective requires
it), so every rank reaches the deciding allreduce in the same call and the
choice is the same everywhere.  Nothing a rank may choose alone keys the
state (in place or not, a ``timeout=``, an input in shared memory or a
non-contiguous one).  The agreements are ``MPI_Iallreduce`` on every rank,
waited for under the call's deadline (``ddlkernels.safety.deadline.complete``).
Because the choice is measured, two runs may pick differently near a
crossover; a fixed ``small_bytes`` makes the path reproducible.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SizeTuner", "Settled", "Recount", "MPI_BELOW", "TRIALS", "SMALL_TRIALS", "MARGIN", "SMALL_MARGIN",
           "margin", "trials", "block", "tuning_calls", "WATCH_FROM", "WATCH_CALLS", "WATCH_MIN_CALLS", "WATCH_MAX_CALLS",
           "CHECK_SECONDS", "DRIFT", "EXPLORE_CHECKS", "RECOUNT_CALLS", "RECOUNT_MAX_CALLS", "watch_interval"]

#: Below this size MPI's own allreduce ("mpi", "nbc") is measured and the ring is not: the ring never beat MPI's
#: own call there (bench/results/constants.md, MPI_BELOW).
MPI_BELOW = 256 << 10
#: From MPI_BELOW: timed calls per candidate, in blocks of 3, so 4 blocks each: with 2 blocks one burst of other
#: work moved a median enough to settle on a slower algorithm (bench/results/constants.md, TRIALS).
TRIALS = 12
#: Below MPI_BELOW calls cost microseconds and their times are noisy (each
#: includes the wait for the last rank to arrive), so more trials are cheap
#: and needed.
SMALL_TRIALS = 16
#: A challenger must beat the incumbent by this factor to be chosen: with a few noisy trials a near-tie can fall
#: either way, and the incumbent (MPI's call) cannot lose badly (bench/results/constants.md, MARGIN).
MARGIN = 1.1
#: MARGIN below MPI_BELOW: there the ranks' medians of 16 calls in blocks agree within a few percent, so a 5 % lead
#: is a real one, and 10 % kept a slower incumbent (bench/results/constants.md, SMALL_MARGIN).
SMALL_MARGIN = 1.05


#: Settled buckets from this size are watched, as the machine can change under a choice (bench/results/constants.md,
#: WATCH_FROM); a call here costs 100 us or more, so timing it is noise, where below it the fast path is the product.
WATCH_FROM = 1 << 20
#: About this much time of calls between two checks of a watched bucket
#: (one 8-byte allreduce, ~5-50 us here: under 0.3 %) ...
CHECK_SECONDS = 0.02
#: ... but at least this many calls (a median of fewer is noise) ...
WATCH_MIN_CALLS = 4
#: ... and at most this many (1 MiB: ~130 us per call).
WATCH_CALLS = 64
#: The interval, doubled after each re-measurement that kept the algorithm, stops growing here.
WATCH_MAX_CALLS = 1024
#: How many times slower than its winning trials a watched bucket's calls
#: may run before it is measured again, whatever the runner-up took.
DRIFT = 1.5
#: After this many checks in a row that found nothing, a watched bucket is measured again anyway: the checks time
#: only the algorithm that runs, so a runner-up that became the faster one would otherwise never be seen.
EXPLORE_CHECKS = 64
#: A settled bucket below WATCH_FROM is measured again after this many of its calls (doubled each time the winner
#: stays, up to RECOUNT_MAX_CALLS): a job's first calls can choose in its start-up noise
#: (bench/results/constants.md, RECOUNT_CALLS).
RECOUNT_CALLS = 4096
RECOUNT_MAX_CALLS = 1 << 22


def _agree_max(comm, values, deadline):
    """``values`` = their maximum over the ranks, in place: ``MPI_Iallreduce`` on every rank, with or without
    a deadline, so that ranks with and without a ``timeout=`` meet in it."""
    from mpi4py import MPI

    from ..safety.deadline import complete

    complete(comm.Iallreduce(MPI.IN_PLACE, values, MPI.MAX), deadline, "the size tuner's agreement (MPI_Iallreduce)")


def watch_interval(won_in: float) -> int:
    """Calls between two checks of a bucket whose winner took ``won_in`` seconds per call in its trials."""
    return int(min(WATCH_CALLS, max(WATCH_MIN_CALLS, -(-CHECK_SECONDS // max(won_in, 1e-9)))))


class Settled:
    """A watched bucket's choice: the algorithm, its trial time, when to re-measure, the calls since the last
    check, and the checks since it was settled."""

    __slots__ = ("algorithm", "won_in", "limit", "every", "times", "checks", "seen")

    def __init__(self, algorithm, won_in, limit, every):
        # limit: the median call time past which the bucket is measured again
        self.algorithm, self.won_in, self.limit, self.every, self.times = algorithm, won_in, limit, every, []
        self.checks = 0
        self.seen = None  # the agreed median call time that crossed ``limit`` (``observe``), once it has


class Recount:
    """A settled bucket below WATCH_FROM: the algorithm, and its calls left until it is measured again.

    Shared by the full path (``SizeTuner.count``) and a fast path that holds
    it (``SizeTuner.recount``), so that every call is counted once.
    """

    __slots__ = ("algorithm", "left", "every", "key")

    def __init__(self, algorithm, every, key):
        self.algorithm, self.left, self.every, self.key = algorithm, every, every, key


def margin(nbytes: int) -> float:
    """How many times faster than the incumbent a challenger must be, for a message of ``nbytes``."""
    return SMALL_MARGIN if nbytes < MPI_BELOW else MARGIN


def trials(nbytes: int) -> int:
    """Timed calls per candidate for a message of ``nbytes``."""
    return SMALL_TRIALS if nbytes < MPI_BELOW else TRIALS


def block(nbytes: int) -> int:
    """Timed calls per block (each block follows one untimed call); divides ``trials``."""
    return 4 if nbytes < MPI_BELOW else 3


def tuning_calls(nbytes: int, ncands: int) -> int:
    """Calls a bucket with ``ncands`` candidates takes until its choice is fixed (0 for one candidate)."""
    if ncands < 2:
        return 0
    t, b = trials(nbytes), block(nbytes)
    return ncands * (t + t // b)


class SizeTuner:
    """Per-communicator record of trials and decisions, by size bucket and candidate set.

    In-place and out-of-place calls are measured together: ranks may differ
    in placement within one call, and a state kept per placement let them
    choose different algorithms for it (a hang).
    """

    def __init__(self, watch: bool = False):
        #: key -> None/dict while measuring, the algorithm (str) or a Settled once chosen
        self._state: dict[tuple, object] = {}
        self.watch = watch  # re-measure settled buckets (timed from WATCH_FROM bytes, counted below)
        self._reopened: dict[tuple, object] = {}  # key -> the Settled/Recount a re-measurement started from
        #: Re-measurements so far, by cause: "slower" (the calls crossed their limit), "quiet"
        #: (EXPLORE_CHECKS checks found nothing), "recount" (RECOUNT_CALLS calls of a bucket below
        #: WATCH_FROM).  For reports (bench/studies/tuner_watch.py).
        self.reopens = {"slower": 0, "quiet": 0, "recount": 0}

    @staticmethod
    def bucket(nbytes: int) -> int:
        return int(nbytes).bit_length()

    def _key(self, nbytes, cands):
        return (self.bucket(nbytes), cands)

    def choose(self, nbytes: int, cands: tuple[str, ...]) -> tuple[str, bool]:
        """``(algorithm, trial)``: one of ``cands``, and whether this call is one of the trials."""
        key = self._key(nbytes, cands)
        st = self._state.get(key)
        if isinstance(st, str):
            return st, False
        if isinstance(st, (Settled, Recount)):
            return st.algorithm, False
        if len(cands) == 1:
            return cands[0], False
        if st is None:
            st = self._state[key] = {"calls": 0, "times": {c: [] for c in cands}}
        # Blocks of 1 untimed + block(nbytes) timed calls, the candidates in turn.
        return cands[st["calls"] // (block(nbytes) + 1) % len(cands)], True

    def decided(self, nbytes: int, cands: tuple[str, ...]):
        """The settled choice for ``nbytes`` among ``cands``, or None while it is still measured."""
        st = self._state.get(self._key(nbytes, cands))
        if isinstance(st, str):
            return st
        if isinstance(st, (Settled, Recount)):
            return st.algorithm
        return cands[0] if len(cands) == 1 else None

    def state(self, nbytes: int, cands: tuple[str, ...]):
        """The record of this bucket: None (never called), a dict (measuring), the algorithm (``settle``), a
        ``Settled`` (watched) or a ``Recount`` (counted); for tools and tests."""
        return self._state.get(self._key(nbytes, cands))

    def watched(self, nbytes: int, cands: tuple[str, ...]) -> bool:
        """Whether calls of this settled bucket must be passed to ``observe``."""
        return isinstance(self._state.get(self._key(nbytes, cands)), Settled)

    def observe(self, comm, nbytes: int, cands: tuple[str, ...], seconds: float, deadline=None) -> bool:
        """Count one call of a watched bucket, lasting ``seconds`` here; True when the bucket was reopened.

        Collective every ``every``-th call (one small ``MPI_Iallreduce``, under
        ``deadline``): every rank must pass every call of the bucket, as every
        rank makes it.
        """
        key = self._key(nbytes, cands)
        st = self._state.get(key)
        if not isinstance(st, Settled):
            return False
        st.times.append(seconds)
        if len(st.times) < st.every:
            return False
        now = np.array([np.median(st.times)], dtype=np.float64)
        st.times.clear()
        _agree_max(comm, now, deadline)
        st.checks += 1  # counted alike on every rank: each check is the same collective call
        slower = now[0] > st.limit
        if not slower and st.checks < EXPLORE_CHECKS:
            return False
        self.reopens["slower" if slower else "quiet"] += 1
        if slower:
            st.seen = float(now[0])  # the agreed maximum: the same on every rank
        self._reopened[key] = st
        del self._state[key]  # measured again from the next call, on every rank
        return True

    def recount(self, nbytes: int, cands: tuple[str, ...]):
        """The ``Recount`` of this settled bucket below WATCH_FROM (for a fast path to count with), or None."""
        st = self._state.get(self._key(nbytes, cands))
        return st if isinstance(st, Recount) else None

    def count(self, nbytes: int, cands: tuple[str, ...]) -> bool:
        """Count one call of a settled bucket below WATCH_FROM; True when this call reopened it (every rank
        reopens at the same call, since every rank counts the same calls)."""
        st = self._state.get(self._key(nbytes, cands))
        return isinstance(st, Recount) and self.tick(st)

    def tick(self, st: "Recount") -> bool:
        """``count`` for a caller that holds the bucket's ``Recount`` (``recount``): no lookup."""
        st.left -= 1
        return st.left <= 0 and self.expire(st)

    def expire(self, st: "Recount") -> bool:
        """Reopen the bucket of ``st``, whose calls ran out (``tick``, or a fast path's inlined countdown)."""
        if self._state.get(st.key) is not st:
            return False
        self._reopened[st.key] = st
        del self._state[st.key]
        self.reopens["recount"] += 1
        return True

    def settle(self, nbytes: int, cands: tuple[str, ...], algorithm: str) -> None:
        """Fix the choice for ``nbytes`` without measuring (every rank must do the same)."""
        self._state[self._key(nbytes, cands)] = algorithm

    def record(self, comm, nbytes: int, cands: tuple[str, ...], algorithm: str, seconds: float,
               deadline=None) -> None:
        """Count one trial call (timed unless it opens a block); after the last, agree on the winner (one small
        ``MPI_Iallreduce``, under ``deadline``)."""
        key = self._key(nbytes, cands)
        st = self._state[key]
        if st["calls"] % (block(nbytes) + 1):
            st["times"][algorithm].append(seconds)
        st["calls"] += 1
        if st["calls"] >= tuning_calls(nbytes, len(cands)):
            best = np.array([np.median(st["times"][c]) for c in cands], dtype=np.float64)
            _agree_max(comm, best, deadline)
            before = self._reopened.pop(key, None)
            if isinstance(before, Settled) and before.seen is not None and before.algorithm in cands:
                # Measured again because the winner's calls ran slower than its trials allowed: it is charged what
                # its calls took, else trials that the loop's calls do not match would pick it again each time
                # (bench/results/constants.md, a slower winner's charge).  Agreed on every rank: seen and best are.
                i = cands.index(before.algorithm)
                best[i] = max(best[i], before.seen)
            challenger = 1 + int(np.argmin(best[1:]))
            win = challenger if best[challenger] * margin(nbytes) < best[0] else 0
            if self.watch and nbytes >= WATCH_FROM:
                won_in = float(best[win])
                rival = min(float(b) for i, b in enumerate(best) if i != win)
                every = watch_interval(won_in)
                if before is not None and before.algorithm == cands[win]:
                    # A re-measurement that kept its winner: only slower calls, so check less often.
                    every = min(WATCH_MAX_CALLS, 2 * before.every)
                # best[] is the agreed maximum over ranks: the same limit and interval on every rank.
                self._state[key] = Settled(cands[win], won_in, min(DRIFT * won_in, MARGIN * rival), every)
            elif self.watch:
                every = RECOUNT_CALLS
                if before is not None and before.algorithm == cands[win]:
                    every = min(RECOUNT_MAX_CALLS, 2 * before.every)
                self._state[key] = Recount(cands[win], every, key)
            else:
                self._state[key] = cands[win]

    def decisions(self) -> dict[str, str]:
        """Size range (candidates when several sets were used) -> algorithm, for reports."""
        out = {}
        sets = {c for _, c in self._state}
        for (key, cands), st in sorted(self._state.items()):
            lo, hi = (1 << (key - 1)) if key else 0, (1 << key)
            label = f"[{lo}, {hi}) B" + (f" of {'/'.join(cands)}" if len(sets) > 1 else "")
            out[label] = st if isinstance(st, str) else st.algorithm if isinstance(st, (Settled, Recount)) else "measuring"
        return out
