"""Pick the allreduce algorithm per message size, from measurement, the same on every rank.

Three algorithms compute the same sum (host arrays of MPI's types):

* ``"mpi"``  -- MPI's own blocking ``MPI_Allreduce``;
* ``"nbc"``  -- MPI's own nonblocking ``MPI_Iallreduce`` + ``Wait``.  Open MPI
  runs it with a different schedule (libnbc) from the blocking call (coll
  tuned).  Here it won at 8-32 KiB with 4 ranks (1.11-1.57x the blocking
  call in bench/results/allreduce_np4_float32*.txt) and at 16-64 KiB with 3
  (1.31-1.96x in two runs of ``mpirun -n 3 python -m mpi4py -m ddlkernels
  job -e 256K``); with 2 ranks it never won its trials;
* ``"ring"`` -- this library's multi-dimensional ring.

Small messages are latency-bound: MPI's recursive-doubling allreduce needs
log2(p) message rounds where a ring needs 2(p - 1), so below some size MPI's
own calls win; above it the ring's bandwidth-optimal data movement does.
Which call wins where depends on the MPI library, the network and p, so it
is measured instead of guessed, per power-of-two size bucket:

* below ``MPI_BELOW`` bytes: "mpi" or "nbc" (no ring of two or more ranks
  can win there);
* from ``MPI_BELOW`` to ``RING_FROM``: "mpi" or "ring";
* at ``RING_FROM`` bytes and above: the ring, always.

The first calls of a bucket alternate between its two candidates (each call
still computes a correct result): one warm-up call each, left out, then
``TRIALS`` timed calls each (``SMALL_TRIALS`` below ``MPI_BELOW``, where calls
are cheap and their times noisy).  Then one small
``MPI_Allreduce(MAX)`` of every rank's median time per candidate fixes the
choice for the bucket on every rank at once: the challenger ("nbc" or
"ring") when it was at least ``MARGIN`` times faster, "mpi" otherwise.  (The
median, not the minimum: what a training loop pays is the typical call, and
on shared or oversubscribed cores the best call is rarely typical.)

Every rank makes the same sequence of calls with the same sizes (a
collective requires it), so every rank reaches the deciding allreduce in the
same call and the choice is identical everywhere.  Because the choice is
measured, two runs may pick differently near a crossover; a fixed
``small_bytes`` makes the path (and so the rounding) reproducible.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SizeTuner", "MPI_BELOW", "RING_FROM", "TRIALS", "SMALL_TRIALS", "MARGIN", "candidates", "trials"]

# Measured on the 2-core machine (bench/results, the main job): the ring never
# beat MPI's own allreduce below 1 MiB at 2 or 4 ranks, and MPI's allreduce
# never came close to the ring at 32 MiB and above.
MPI_BELOW = 256 << 10
RING_FROM = 32 << 20
TRIALS = 6
#: Below MPI_BELOW calls cost microseconds and their times are noisy (each
#: includes the wait for the last rank to arrive), so more trials are cheap
#: and needed.
SMALL_TRIALS = 16
#: The challenger must beat MPI's blocking allreduce by this factor to be
#: chosen: with a few noisy trials a near-tie can fall either way, and MPI's
#: call is the one that cannot lose badly at small sizes (bench/results: a tie
#: decided for the ring at 512 KiB, 4 ranks, ran at 0.45x of MPI).
MARGIN = 1.1


def trials(nbytes: int) -> int:
    """Timed calls per candidate for a message of ``nbytes``, after one untimed warm-up call each."""
    return SMALL_TRIALS if nbytes < MPI_BELOW else TRIALS


def candidates(nbytes: int) -> tuple[str, ...]:
    """The algorithms measured for a message of ``nbytes``: "mpi" first, then its challenger."""
    if nbytes < MPI_BELOW:
        return ("mpi", "nbc")
    if nbytes >= RING_FROM:
        return ("ring",)
    return ("mpi", "ring")


class SizeTuner:
    """Per-communicator record of trials and decisions, by size bucket."""

    def __init__(self):
        self._state: dict[int, object] = {}

    @staticmethod
    def bucket(nbytes: int) -> int:
        return int(nbytes).bit_length()

    def choose(self, nbytes: int) -> tuple[str, bool]:
        """``(algorithm, trial)``: "mpi", "nbc" or "ring", and whether this call is a timed trial."""
        key = self.bucket(nbytes)
        st = self._state.get(key)
        if isinstance(st, str):
            return st, False
        cands = candidates(nbytes)
        if len(cands) == 1:
            return cands[0], False
        if st is None:
            st = self._state[key] = {c: [] for c in cands}
        mpi, other = cands
        return (mpi if len(st[mpi]) <= len(st[other]) else other), True

    def decided(self, nbytes: int):
        """The settled choice for ``nbytes``, or None while it is still measured."""
        st = self._state.get(self.bucket(nbytes))
        if isinstance(st, str):
            return st
        cands = candidates(nbytes)
        return cands[0] if len(cands) == 1 else None

    def record(self, comm, nbytes: int, algorithm: str, seconds: float) -> None:
        """Add one trial; after the last one, agree on the winner with one small allreduce."""
        key = self.bucket(nbytes)
        st = self._state[key]
        st[algorithm].append(seconds)
        mpi, other = candidates(nbytes)
        n = trials(nbytes) + 1
        if len(st[mpi]) >= n and len(st[other]) >= n:
            from mpi4py import MPI

            # The first call of each is a warm-up (MPI builds the nonblocking
            # schedule, pages of a new size are touched): left out.
            best = np.array([np.median(st[mpi][1:]), np.median(st[other][1:])], dtype=np.float64)
            comm.Allreduce(MPI.IN_PLACE, best, MPI.MAX)
            self._state[key] = other if best[1] * MARGIN < best[0] else mpi

    def decisions(self) -> dict[str, str]:
        """Size range -> algorithm, for reports (``python -m ddlkernels info``, benchmarks)."""
        out = {}
        for key, st in sorted(self._state.items()):
            lo, hi = (1 << (key - 1)) if key else 0, (1 << key)
            out[f"[{lo}, {hi}) B"] = st if isinstance(st, str) else "measuring"
        return out
