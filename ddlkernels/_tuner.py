"""Pick MPI's own allreduce or the ring per message size, from measurement, the same on every rank.

Small messages are latency-bound: MPI's recursive-doubling allreduce needs
log2(p) message rounds where a ring needs 2(p - 1), so below some size MPI's
own call wins; above it the ring's bandwidth-optimal data movement does.
Where that crossover lies depends on the MPI library, the network and p, so
it is measured instead of guessed:

* below ``MPI_BELOW`` bytes: MPI's allreduce, always (no ring of two or
  more ranks can win there);
* at ``RING_FROM`` bytes and above: the ring, always;
* in between, per power-of-two size bucket: the first ``2 * TRIALS`` calls
  alternate between the two (each call still computes a correct result),
  then one small ``MPI_Allreduce(MAX)`` of every rank's median time per
  algorithm fixes the choice for the bucket on every rank at once: the ring
  when it was at least ``RING_MARGIN`` times faster, MPI otherwise.  (The
  median, not the minimum: what a training loop pays is the typical call,
  and on shared or oversubscribed cores the best call is rarely typical.)

Every rank makes the same sequence of calls with the same sizes (a
collective requires it), so every rank reaches the deciding allreduce in the
same call and the choice is identical everywhere.  Because the choice is
measured, two runs may pick differently near the crossover; a fixed
``small_bytes`` makes the path (and so the rounding) reproducible.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SizeTuner", "MPI_BELOW", "RING_FROM", "TRIALS"]

# Measured on the 2-core machine (bench/results, the main job): the ring never
# beat MPI's own allreduce below 1 MiB at 2 or 4 ranks, and MPI's allreduce
# never came close to the ring at 32 MiB and above.
MPI_BELOW = 256 << 10
RING_FROM = 32 << 20
TRIALS = 4
#: The ring must beat MPI's allreduce by this factor to be chosen: with a few
#: noisy trials a near-tie can fall either way, and MPI's call is the one
#: that cannot lose badly at small sizes (bench/results: a tie decided for
#: the ring at 512 KiB, 4 ranks, ran at 0.45x of MPI).
RING_MARGIN = 1.1


class SizeTuner:
    """Per-communicator record of trials and decisions, by size bucket."""

    def __init__(self):
        self._state: dict[int, object] = {}

    @staticmethod
    def bucket(nbytes: int) -> int:
        return int(nbytes).bit_length()

    def choose(self, nbytes: int) -> tuple[str, bool]:
        """``(algorithm, trial)``: "mpi" or "ring", and whether this call is a timed trial."""
        if nbytes < MPI_BELOW:
            return "mpi", False
        if nbytes >= RING_FROM:
            return "ring", False
        st = self._state.get(self.bucket(nbytes))
        if isinstance(st, str):
            return st, False
        if st is None:
            st = self._state[self.bucket(nbytes)] = {"mpi": [], "ring": []}
        return ("mpi" if len(st["mpi"]) <= len(st["ring"]) else "ring"), True

    def decided(self, nbytes: int):
        """The settled choice for ``nbytes`` ("mpi" or "ring"), or None while it is still measured."""
        if nbytes < MPI_BELOW:
            return "mpi"
        if nbytes >= RING_FROM:
            return "ring"
        st = self._state.get(self.bucket(nbytes))
        return st if isinstance(st, str) else None

    def record(self, comm, nbytes: int, algorithm: str, seconds: float) -> None:
        """Add one trial; after the last one, agree on the winner with one small allreduce."""
        key = self.bucket(nbytes)
        st = self._state[key]
        st[algorithm].append(seconds)
        if len(st["mpi"]) >= TRIALS and len(st["ring"]) >= TRIALS:
            from mpi4py import MPI

            best = np.array([np.median(st["mpi"]), np.median(st["ring"])], dtype=np.float64)
            comm.Allreduce(MPI.IN_PLACE, best, MPI.MAX)
            self._state[key] = "ring" if best[1] * RING_MARGIN < best[0] else "mpi"

    def decisions(self) -> dict[str, str]:
        """Size range -> algorithm, for reports (``python -m ddlkernels info``, benchmarks)."""
        out = {}
        for key, st in sorted(self._state.items()):
            lo, hi = (1 << (key - 1)) if key else 0, (1 << key)
            out[f"[{lo}, {hi}) B"] = st if isinstance(st, str) else "measuring"
        return out
