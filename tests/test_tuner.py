"""The size tuner's candidates and decisions, in one process (a stand-in for the deciding allreduce)."""

import numpy as np
import pytest

from ddlkernels._tuner import MARGIN, MPI_BELOW, RING_FROM, SizeTuner, candidates, trials


class OneRank:
    """The deciding ``Allreduce(IN_PLACE, times, MAX)`` of a one-rank job: leaves the times as they are."""

    def Allreduce(self, sendbuf, recvbuf, op):
        pass


@pytest.mark.parametrize(
    "nbytes,mpi,shm,want",
    [
        (0, True, False, ("mpi", "nbc")),
        (MPI_BELOW - 1, True, True, ("mpi", "nbc", "shm")),
        (MPI_BELOW, True, False, ("mpi", "ring")),
        (RING_FROM - 1, True, True, ("mpi", "ring", "shm")),
        (RING_FROM, True, False, ("ring",)),
        (RING_FROM, True, True, ("ring", "shm")),
        (16, False, False, ("ring",)),  # e.g. float max/min, bfloat16: MPI is no candidate
        (16, False, True, ("ring", "shm")),
    ],
)
def test_candidates(nbytes, mpi, shm, want):
    assert candidates(nbytes, mpi=mpi, shm=shm) == want


def run_trials(cands, seconds, nbytes=1 << 20):
    """Feed ``seconds[c]`` per call of candidate c until the tuner decides; return (calls, order, choice)."""
    t = SizeTuner()
    order = []
    while True:
        algo, trial = t.choose(nbytes, cands)
        if not trial:
            return len(order), order, algo
        order.append(algo)
        t.record(OneRank(), nbytes, cands, algo, seconds[algo])


def test_round_robin_then_the_fastest_challenger_by_margin():
    cands = ("mpi", "ring", "shm")
    n, order, choice = run_trials(cands, {"mpi": 1.0, "ring": 0.5, "shm": 0.4})
    assert n == 3 * (trials(1 << 20) + 1)
    assert order[:6] == ["mpi", "ring", "shm"] * 2
    assert choice == "shm"
    # Near ties keep the incumbent.
    assert run_trials(cands, {"mpi": 1.0, "ring": 1.0 / MARGIN * 1.01, "shm": 2.0})[2] == "mpi"
    assert run_trials(("ring", "shm"), {"ring": 1.0, "shm": 0.5})[2] == "shm"


def test_warmup_call_is_left_out_and_sets_are_separate():
    t = SizeTuner()
    nb = 4096
    a, b = ("mpi", "nbc"), ("mpi", "nbc", "shm")
    # A slow first (warm-up) call of shm must not count against it.
    times = iter([1.0, 1.0, 50.0] + [1.0, 1.0, 0.1] * (trials(nb) + 1))
    while True:
        algo, trial = t.choose(nb, b)
        if not trial:
            break
        t.record(OneRank(), nb, b, algo, next(times))
    assert t.decided(nb, b) == "shm"
    assert t.decided(nb, a) is None  # another candidate set: its own trials
    t.settle(nb, a, "nbc")
    assert t.choose(nb, a) == ("nbc", False)
    assert set(t.decisions().values()) == {"shm", "nbc"}


def test_medians_are_what_counts():
    # One call in seven of shm is very slow: its median still wins.
    cands = ("mpi", "shm")
    t = SizeTuner()
    k = {"mpi": 0, "shm": 0}
    while True:
        algo, trial = t.choose(1 << 20, cands)
        if not trial:
            break
        k[algo] += 1
        t.record(OneRank(), 1 << 20, cands, algo, 1.0 if algo == "mpi" else (9.0 if k[algo] == 4 else 0.5))
    assert t.decided(1 << 20, cands) == "shm"
