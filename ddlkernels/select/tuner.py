"""Pick the allreduce algorithm per message size, from measurement, the same on every rank.

Seven algorithms compute the same result (host arrays):

* ``"mpi"``  -- MPI's own blocking ``MPI_Allreduce``;
* ``"nbc"``  -- MPI's own nonblocking ``MPI_Iallreduce`` + ``Wait``.  Open MPI
  runs it with a different schedule (libnbc) from the blocking call (coll
  tuned).  Here it won at 8-32 KiB with 4 ranks (1.11-1.57x the blocking
  call in bench/results/allreduce_np4_float32*.txt of a set before the
  shared-memory window, which now wins those sizes) and at 16-64 KiB with 3
  (1.31-1.96x in two runs of ``mpirun -n 3 python -m mpi4py -m ddlkernels
  job -e 256K``); with 2 ranks it never won its trials;
* ``"ring"`` -- this library's multi-dimensional ring;
* ``"shm"``  -- the shared-memory window allreduce (``ddlkernels._shm``),
  a candidate only when every rank shares one node;
* ``"shm-nt"`` -- the same window allreduce with each rank's result blocks
  written with non-temporal stores (``ShmAllreduce.run(spill=True)``): a
  candidate wherever "shm" is, from ``SPILL_FROM`` bytes.  On this VM it
  mostly wins in the state where the two cores exchange data slowly and mostly
  loses in the other (``bench/shm_pieces.py --spill``), so the tuner, whose watch follows
  the machine, decides;
* ``"cma"`` -- the single-copy allreduce (``ddlkernels._cma``): every rank
  reads its peers' buffers where they lie with ``process_vm_readv`` and
  writes its results into theirs with ``process_vm_writev``; a candidate
  where "shm" is, from ``CMA_FROM`` bytes, for numpy's own dtypes and ops,
  when every pair of ranks may read and write each other's memory
  (``ddlkernels._cma.probe``);
* ``"hier"`` -- the window inside each node and an allreduce of one shard
  across nodes (``ddlkernels._hier``), a candidate when the ranks span
  several nodes that all hold the same number (2 or more) of them.

"mpi" and "nbc" are candidates only for MPI's own types and ops whose NaN
handling matches numpy's (see ``Communicator._choices``).  Small
messages are latency-bound: MPI's recursive-doubling allreduce needs
log2(p) message rounds where a ring needs 2(p - 1), so below some size MPI's
own calls win; above it the ring's bandwidth-optimal data movement does.
Which call wins where depends on the MPI library, the network and p, so it
is measured instead of guessed, per power-of-two size bucket (``SizeTuner``):

* below ``MPI_BELOW`` bytes: "mpi", "nbc" (no ring of two or more ranks
  can win there), "shm";
* from ``MPI_BELOW`` to ``RING_FROM``: "mpi", "ring", "shm";
* at ``RING_FROM`` bytes and above: "ring", "shm" (MPI's own call never came
  close there);

each followed by "shm-nt" from ``SPILL_FROM``, "cma" from ``CMA_FROM`` and by
"hier" where they apply.

The first candidate is the incumbent; the first calls of a bucket go round
the candidates in blocks of consecutive calls (each call still computes a
correct result): ``trials`` timed calls per candidate (``SMALL_TRIALS``
below ``MPI_BELOW``, where calls are cheap and their times noisy, else
``TRIALS``), in blocks of ``block`` calls, each block after one untimed call.
That call absorbs the skew the previous algorithm left between the ranks:
timed alone after a different algorithm, a call's time on one rank depends
on when its peers left that other call, while in a run of calls of one
algorithm every rank's time per call tends to the period of the run, which
is what a loop of calls pays.  ``bench/tuner_trials.py`` shows it (4 ranks
on 2 cores, 4 KiB): the shared-memory allreduce's median was 14.9, 16.3,
41.5 and 23.1 us on the four ranks when candidates took turns call by call,
21.1-22.5 us on all four in blocks.  Then one small
``MPI_Allreduce(MAX)`` of every rank's median time per candidate fixes the
choice for the bucket on every rank at once: the fastest challenger when it
was at least ``margin`` times faster than the incumbent, the incumbent
otherwise.  (The median, not the minimum: what a training loop pays is the
typical call, and on shared or oversubscribed cores the best call is rarely
typical.)

A settled choice is not final from ``WATCH_FROM`` bytes: the machine it
was measured on can change under it.  On the 2-core machine the two cores
switch, minutes apart, between a state where the shared-memory allreduce is
the fastest and one where the ring over MPI's transport is: in the MPICH
sweep of bench/results at b793e64 the tuner had settled 64 MiB on the
window, which then ran 11.2 ms while the ring took 7.2 ms in the same run.
So every rank keeps timing the calls of a watched bucket, and at intervals
one 8-byte ``MPI_Allreduce(MAX)`` of the ranks' median time compares it with
the trials: the bucket is measured again (all ranks at once, since they all
see the same maximum) when its calls now take longer than the runner-up
took in the trials (by ``MARGIN``), or ``DRIFT`` times as long as they took
themselves.  The interval is about ``CHECK_SECONDS`` of calls at the time
that won, between ``WATCH_MIN_CALLS`` and ``WATCH_CALLS`` calls -- from the
agreed trial time, so the same count on every rank.  The checks time only
the algorithm that runs, so a runner-up that became faster while the
winner did not slow down would go unseen: after ``EXPLORE_CHECKS`` quiet
checks the bucket is measured again anyway.  A re-measurement that keeps
the same algorithm doubles the interval (up to ``WATCH_MAX_CALLS``), so a
loop whose calls are merely slower now (more load, not another winner), or
whose winner stays the winner, pays for trials ever more rarely.  A
re-measurement that the winner's slower calls started charges it the time
those calls took where its new trials say less: trials (a few calls in a
row) can favour an algorithm that the caller's loop runs slowly, and would
otherwise pick it again each time.

Below ``WATCH_FROM`` calls are not timed (they are the latency the fast
paths exist for), but a settled bucket is measured again after
``RECOUNT_CALLS`` of its calls, counted alike on every rank, and then after
twice as many each time the winner stays: a choice made in a job's first
calls may have been made in its start-up noise.

``reduce_scatter`` and ``allgather`` have tuners of their own
(``Communicator._shard_tuners``) with the candidates MPI's own call (where
it computes the call), "ring" and, on one node, "shm" -- and for an
allgather from ``ddlkernels._shm.GATHER_STREAM_FROM`` bytes "shm-nt", the
window writing its output with non-temporal stores, and from
``CMA_GATHER_FROM`` "cma", every rank reading its peers' shards where they
lie -- measured and watched the same way, on their fast paths as on their
full paths.

Every rank makes the same sequence of calls with the same sizes (a
collective requires it), so every rank reaches the deciding allreduce in the
same call and the choice is identical everywhere.  Nothing a rank may choose
alone keys the state: in place or not, a ``timeout=``, an input in shared
memory or a non-contiguous one all fall in the same bucket, so that two
ranks that differ in them still run the same algorithm.  The agreements are
``MPI_Iallreduce`` on every rank, waited for under the call's deadline when
it has one (``ddlkernels._wait.complete``).  Because the choice is
measured, two runs may pick differently near a crossover; a fixed
``small_bytes`` makes the path (and so the rounding) reproducible.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SizeTuner", "MPI_BELOW", "RING_FROM", "SPILL_FROM", "CMA_FROM", "CMA_GATHER_FROM", "TRIALS", "SMALL_TRIALS", "MARGIN", "SMALL_MARGIN",
           "margin", "candidates",
           "trials", "block", "tuning_calls", "WATCH_FROM", "WATCH_CALLS", "WATCH_MIN_CALLS", "WATCH_MAX_CALLS",
           "CHECK_SECONDS", "DRIFT", "EXPLORE_CHECKS", "RECOUNT_CALLS", "RECOUNT_MAX_CALLS", "watch_interval"]

# Measured on the 2-core machine (bench/results, the main job): the ring never
# beat MPI's own allreduce below 1 MiB at 2 or 4 ranks, and MPI's allreduce
# never came close to the ring at 32 MiB and above.
MPI_BELOW = 256 << 10
RING_FROM = 32 << 20
#: "shm-nt" is a candidate from this size (see the module comment).
#: ``bench/shm_pieces.py --spill``, six runs seconds apart, each after
#: ``bench/shm_costs.py --sizes 32M`` to tell the machine's state; time of
#: "shm" / time of "shm-nt" at 4 / 8 / 16 / 32 / 64 MiB, 2 ranks: in the three
#: runs where the ring beat the window (the exchange-slow state) 0.74-1.27 /
#: 0.84-1.56 / 0.83-1.49 / 1.21-1.32 / 1.34-1.37, in the three others
#: 0.67-0.73 / 0.86-1.38 / 0.77-1.24 / 0.74-1.29 / 0.76-1.37.  At 4 MiB it
#: lost in four of the six.
SPILL_FROM = 8 << 20
#: "cma" is a candidate from this size (``ddlkernels._cma``; see the module comment).
#: ``mpirun -n 2 python -m mpi4py bench/shm_pieces.py --cma --pages huge --pieces 256K,512K,1M --sizes
#: 64K,256K,512K,1M,4M,16M,64M`` (time of the window's "shm" / time of "cma", its default 512 KiB reads),
#: two runs: 0.67 at 64 KiB, 0.75-0.76 at 256 KiB, 0.72-0.84 at 512 KiB, 0.75-1.07 at 1 MiB, 1.18-1.19 at
#: 4 MiB, 1.60-1.67 at 16 MiB, 1.75-1.80 at 64 MiB.  Below 1 MiB its system calls and barriers then cost
#: more than the stage they save.  (From 512 KiB, in a run of bench/run_results.sh at c3b0369, not kept,
#: the tuner's trials chose it at 512 KiB, where it then ran at 0.86x MPI_Allreduce.)  Pushing its
#: allgather (``ddlkernels._cma.PUSH_FROM``) changed that: ``bench/shm_pieces.py --cma --push --pages huge
#: --pieces 512K`` with 256 KiB and 512 KiB among its sizes, five runs of the code of c5a9534: MPI_Allreduce / shm /
#: cma pushing took 25.0-27.9 / 11.3-28.9 / 9.7-17.1 us at 256 KiB (cma the fastest in four), and
#: 27.8-48.0 / 21.9-55.4 / 16.9-30.2 at 512 KiB (seven runs; cma within 4 % of MPI's call or faster in
#: every one).  On an Intel Xeon VM (2 cores, 2 MiB L2 each), the same command with ``--sizes
#: 4K,16K,32K,64K,128K,256K``, MPI_Allreduce / shm / cma pushing: 2 ranks 4.1 / 3.0 / 3.8 us at 4 KiB,
#: 9.0 / 5.6 / 4.2 at 16 KiB, 12.2 / 7.6 / 4.7 at 32 KiB, 18.1 / 13.1 / 6.1 at 64 KiB, 38.7 / 28.9 / 15.2
#: at 256 KiB (two more runs from 64 KiB within 10 %); 4 ranks (oversubscribed) 43.4 / 18.3 / 24.3 at
#: 32 KiB, 56.5 / 25.7 / 28.4 at 64 KiB, 83.5 / 38.8 / 38.5 at 128 KiB.  So from 32 KiB: below it the
#: window won everywhere; from there the trials (the incumbent ahead by SMALL_MARGIN or MARGIN) decide.
CMA_FROM = 32 << 10
#: An allgather's "cma" (``ddlkernels._cma.CmaAllreduce.allgather``: every rank reads its peers' shards
#: straight into its output, one copy, two barriers) is a candidate from this size.  ``mpirun -n 2|4 python
#: -m mpi4py bench/shm_pieces.py --cma --shards --pages huge``, MPI_Allgather / the window's allgather / cma,
#: us per call: 2 ranks 2.05 / 2.11 / 3.64 at 4 KiB, 2.86 / 3.80 / 4.10 at 16 KiB, 4.16 / 7.62 / 5.32 at 64
#: KiB, 9.88 / 17.76 / 10.92 at 256 KiB, 57.7 / 85.5 / 58.3 at 1 MiB, 643 / 528 / 372 at 4 MiB, 2426 / 1961 /
#: 2419 at 16 MiB; 4 ranks 8.81 / 6.55 / 18.22 at 4 KiB, 17.2 / 8.95 / 19.6 at 16 KiB, 25.2 / 16.5 / 23.2
#: at 64 KiB, 53.6 / 39.3 / 44.6 at 256 KiB, 1706 / 1183 / 1317 at 4 MiB.  Below 64 KiB its system calls lose
#: to both; from there it beats the window with 2 ranks (to 4 MiB) and MPI's call with 4; the trials decide.
CMA_GATHER_FROM = 64 << 10
#: From MPI_BELOW: timed calls per candidate, in blocks of 3, so 4 blocks each.
#: With 6 (2 blocks), one block hit by a burst of other work (4 ranks on 2
#: cores, a kernel thread taking a core) moved the median enough to settle
#: 8 MiB at 4 ranks on MPI_Allreduce, which then ran 5.77 ms; the shared-memory
#: allreduce took 3.05 ms at 8 MiB in the run just before (bench/results at
#: 202f01d, allreduce_np4_float32{_repeat,}).
#: The cost is paid once per size bucket: 48 calls with three candidates.
TRIALS = 12
#: Below MPI_BELOW calls cost microseconds and their times are noisy (each
#: includes the wait for the last rank to arrive), so more trials are cheap
#: and needed.
SMALL_TRIALS = 16
#: A challenger must beat the incumbent (MPI's blocking allreduce, or the ring
#: where MPI is no candidate) by this factor to be chosen: with a few noisy
#: trials a near-tie can fall either way, and MPI's call is the one that
#: cannot lose badly at small sizes (bench/results: a tie
#: decided for the ring at 512 KiB, 4 ranks, ran at 0.45x of MPI).
MARGIN = 1.1
#: Below MPI_BELOW: 16 timed calls per candidate in blocks, whose per-rank
#: medians mostly agree within a few percent (bench/tuner_trials.py, 4 ranks
#: at 4-64 KiB), and the deciding statistic, the slowest rank's median, leans
#: to the incumbent when one rank is off; there a 5 % lead is a real one.
#: With 10 %, trials at 4 KiB and 4 ranks kept MPI's call although the
#: shared-memory allreduce ran 1.4x faster once chosen (bench/results).
SMALL_MARGIN = 1.05


#: Settled buckets from this size are watched (see the module comment).  A
#: call here costs 100 us or more, so timing it and one small allreduce per
#: check are noise; below, calls are latency-bound and the fast path's few
#: microseconds are the product.
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
#: After this many checks in a row that found nothing, a watched bucket is
#: measured again anyway: the checks time only the algorithm that runs, so
#: a runner-up that became the faster one would otherwise never be seen.
#: At the first interval (~CHECK_SECONDS of calls) that is about 1.3 s of
#: calls; a re-measurement that keeps the winner doubles the interval, as
#: after any other, so a stable job pays for these trials ever more rarely.
EXPLORE_CHECKS = 64
#: Below WATCH_FROM a settled bucket is not timed (its calls are the latency
#: the fast path exists for), but it is measured again after this many of
#: its calls, counted alike on every rank: a choice made in the first
#: calls of a job can be made in the job's own start-up noise (4 ranks,
#: ``bench/allreduce.py -b 4K -e 8K`` right after a 64 MiB job, three times:
#: once MPI_Allreduce kept at 4 KiB, 31 us per call, once MPI_Iallreduce at
#: 8 KiB, 37 us, where the shared-memory allreduce took 13-21 us in the
#: others).  A re-measurement that keeps the winner doubles the count, up to
#: RECOUNT_MAX_CALLS.
RECOUNT_CALLS = 4096
RECOUNT_MAX_CALLS = 1 << 22


def _agree_max(comm, values, deadline):
    """``values`` = their maximum over the ranks, in place: ``MPI_Iallreduce`` on every rank, with or without
    a deadline, so that ranks with and without a ``timeout=`` meet in it."""
    from mpi4py import MPI

    from ._wait import complete

    complete(comm.Iallreduce(MPI.IN_PLACE, values, MPI.MAX), deadline, "the size tuner's agreement (MPI_Iallreduce)")


def watch_interval(won_in: float) -> int:
    """Calls between two checks of a bucket whose winner took ``won_in`` seconds per call in its trials."""
    return int(min(WATCH_CALLS, max(WATCH_MIN_CALLS, -(-CHECK_SECONDS // max(won_in, 1e-9)))))


class _Settled:
    """A watched bucket's choice: the algorithm, its trial time, when to re-measure, the calls since the last
    check, and the checks since it was settled."""

    __slots__ = ("algorithm", "won_in", "limit", "every", "times", "checks", "seen")

    def __init__(self, algorithm, won_in, limit, every):
        # limit: the median call time past which the bucket is measured again
        self.algorithm, self.won_in, self.limit, self.every, self.times = algorithm, won_in, limit, every, []
        self.checks = 0
        self.seen = None  # the agreed median call time that crossed ``limit`` (``observe``), once it has


class _Recount:
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


def candidates(nbytes: int, *, mpi: bool = True, shm: bool = False, hier: bool = False,
               cma: bool = False) -> tuple[str, ...]:
    """The algorithms measured for a message of ``nbytes``, the incumbent first.

    ``mpi``: MPI's own calls can compute this reduction; ``shm``: the
    shared-memory allreduce is available (all ranks on one node); ``hier``:
    the hierarchical one is (several nodes of equal size, ``ddlkernels._hier``);
    ``cma``: the single-copy one is (``ddlkernels._cma``; from ``CMA_FROM``).
    """
    extra = (("shm",) * bool(shm) + ("shm-nt",) * bool(shm and nbytes >= SPILL_FROM)
             + ("cma",) * bool(cma and nbytes >= CMA_FROM) + ("hier",) * bool(hier))
    if not mpi or nbytes >= RING_FROM:
        return ("ring",) + extra
    if nbytes < MPI_BELOW:
        return ("mpi", "nbc") + extra
    return ("mpi", "ring") + extra


class SizeTuner:
    """Per-communicator record of trials and decisions, by size bucket and candidate set.

    In-place and out-of-place calls are measured together: ranks may differ
    in placement within one call, and a state kept per placement let them
    choose different algorithms for it (a hang).
    """

    def __init__(self, watch: bool = False):
        #: key -> None/dict while measuring, the algorithm (str) or a _Settled once chosen
        self._state: dict[tuple, object] = {}
        self.watch = watch  # re-measure settled buckets (timed from WATCH_FROM bytes, counted below)
        self._reopened: dict[tuple, object] = {}  # key -> the _Settled/_Recount a re-measurement started from
        #: Re-measurements so far, by cause: "slower" (the calls crossed their limit), "quiet"
        #: (EXPLORE_CHECKS checks found nothing), "recount" (RECOUNT_CALLS calls of a bucket below
        #: WATCH_FROM).  For reports (bench/tuner_watch.py).
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
        if isinstance(st, (_Settled, _Recount)):
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
        if isinstance(st, (_Settled, _Recount)):
            return st.algorithm
        return cands[0] if len(cands) == 1 else None

    def watched(self, nbytes: int, cands: tuple[str, ...]) -> bool:
        """Whether calls of this settled bucket must be passed to ``observe``."""
        return isinstance(self._state.get(self._key(nbytes, cands)), _Settled)

    def observe(self, comm, nbytes: int, cands: tuple[str, ...], seconds: float, deadline=None) -> bool:
        """Count one call of a watched bucket, lasting ``seconds`` here; True when the bucket was reopened.

        Collective every ``every``-th call (one small ``MPI_Iallreduce``, under
        ``deadline``): every rank must pass every call of the bucket, as every
        rank makes it.
        """
        key = self._key(nbytes, cands)
        st = self._state.get(key)
        if not isinstance(st, _Settled):
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
        """The ``_Recount`` of this settled bucket below WATCH_FROM (for a fast path to count with), or None."""
        st = self._state.get(self._key(nbytes, cands))
        return st if isinstance(st, _Recount) else None

    def count(self, nbytes: int, cands: tuple[str, ...]) -> bool:
        """Count one call of a settled bucket below WATCH_FROM; True when this call reopened it (every rank
        reopens at the same call, since every rank counts the same calls)."""
        st = self._state.get(self._key(nbytes, cands))
        return isinstance(st, _Recount) and self.tick(st)

    def tick(self, st: "_Recount") -> bool:
        """``count`` for a caller that holds the bucket's ``_Recount`` (``recount``): no lookup."""
        st.left -= 1
        return st.left <= 0 and self.expire(st)

    def expire(self, st: "_Recount") -> bool:
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
            if isinstance(before, _Settled) and before.seen is not None and before.algorithm in cands:
                # Measured again because the winner's calls ran slower than its trials allowed: it is
                # charged what its calls took, where its new trials say less.  Trials that keep
                # finding it fast while the loop's calls of it run slow measure something the
                # loop does not do (``bench/allgather.py -b 4K -e 64M -f 4 -n 30 -w 14``, 2 ranks, two
                # runs before this: at 4 MiB the ring was chosen, chosen again at both re-measurements
                # its slow calls started, and ran 369-384 us a call against MPI_Allgather's 188-199 in
                # the same iterations).  Agreed on every rank: ``seen`` and ``best`` are.
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
                self._state[key] = _Settled(cands[win], won_in, min(DRIFT * won_in, MARGIN * rival), every)
            elif self.watch:
                every = RECOUNT_CALLS
                if before is not None and before.algorithm == cands[win]:
                    every = min(RECOUNT_MAX_CALLS, 2 * before.every)
                self._state[key] = _Recount(cands[win], every, key)
            else:
                self._state[key] = cands[win]

    def decisions(self) -> dict[str, str]:
        """Size range (candidates when several sets were used) -> algorithm, for reports."""
        out = {}
        sets = {c for _, c in self._state}
        for (key, cands), st in sorted(self._state.items()):
            lo, hi = (1 << (key - 1)) if key else 0, (1 << key)
            label = f"[{lo}, {hi}) B" + (f" of {'/'.join(cands)}" if len(sets) > 1 else "")
            out[label] = st if isinstance(st, str) else st.algorithm if isinstance(st, (_Settled, _Recount)) else "measuring"
        return out
