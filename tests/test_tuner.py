"""The size tuner's decisions, in one process (a stand-in for the deciding allreduce)."""

import numpy as np

from ddlkernels.select.tuner import MARGIN, MPI_BELOW, SMALL_MARGIN, SizeTuner, block, margin, trials, tuning_calls


class _Done:
    """A request that has completed."""

    def Wait(self):
        pass

    def Test(self):
        return True


class OneRank:
    """The deciding ``Iallreduce(IN_PLACE, times, MAX)`` of a one-rank job: leaves the times as they are."""

    def Iallreduce(self, sendbuf, recvbuf, op):
        return _Done()


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


def test_blocks_in_turn_then_the_fastest_challenger_by_margin():
    cands = ("mpi", "ring", "shm")
    n, order, choice = run_trials(cands, {"mpi": 1.0, "ring": 0.5, "shm": 0.4})
    b = block(1 << 20)
    assert n == tuning_calls(1 << 20, 3) == 3 * (trials(1 << 20) + trials(1 << 20) // b)
    assert order[: 3 * (b + 1)] == ["mpi"] * (b + 1) + ["ring"] * (b + 1) + ["shm"] * (b + 1)
    assert choice == "shm"
    # Near ties keep the incumbent.
    assert run_trials(cands, {"mpi": 1.0, "ring": 1.0 / MARGIN * 1.01, "shm": 2.0})[2] == "mpi"
    # Below MPI_BELOW a smaller lead decides.
    assert margin(4096) == SMALL_MARGIN < MARGIN == margin(MPI_BELOW)
    small = ("mpi", "nbc", "shm")
    assert run_trials(small, {"mpi": 1.0, "nbc": 2.0, "shm": 1.0 / SMALL_MARGIN * 0.99}, nbytes=4096)[2] == "shm"
    assert run_trials(small, {"mpi": 1.0, "nbc": 2.0, "shm": 1.0 / SMALL_MARGIN * 1.01}, nbytes=4096)[2] == "mpi"
    assert run_trials(("ring", "shm"), {"ring": 1.0, "shm": 0.5})[2] == "shm"


def test_the_call_opening_each_block_is_left_out_and_sets_are_separate():
    t = SizeTuner()
    nb = 4096
    a, b = ("mpi", "nbc"), ("mpi", "nbc", "shm")
    k = 0
    while True:
        algo, trial = t.choose(nb, b)
        if not trial:
            break
        opens_block = k % (block(nb) + 1) == 0
        # shm is fast, except the first call of each of its blocks (the skew left by the call before).
        seconds = {"mpi": 1.0, "nbc": 1.0, "shm": 50.0 if opens_block else 0.1}[algo]
        t.record(OneRank(), nb, b, algo, seconds)
        k += 1
    assert k == tuning_calls(nb, 3)
    assert t.decided(nb, b) == "shm"
    assert t.decided(nb, a) is None  # another candidate set: its own trials
    t.settle(nb, a, "nbc")
    assert t.choose(nb, a) == ("nbc", False)
    assert set(t.decisions().values()) == {"shm", "nbc"}


def test_medians_are_what_counts():
    # One timed call in six of shm is very slow: its median still wins.
    cands = ("mpi", "shm")
    t = SizeTuner()
    k = {"mpi": 0, "shm": 0}
    while True:
        algo, trial = t.choose(1 << 20, cands)
        if not trial:
            break
        k[algo] += 1
        t.record(OneRank(), 1 << 20, cands, algo, 1.0 if algo == "mpi" else (9.0 if k[algo] == 3 else 0.5))
    assert t.decided(1 << 20, cands) == "shm"


def test_the_state_has_no_key_a_rank_chooses_alone():
    """In place or not, a timeout, a shared or strided input: ranks may differ in them within one call, so
    nothing of the kind may key the tuner's state (a state per placement let ranks that differed in it pick
    different algorithms: a hang)."""
    import inspect

    for name in ("choose", "decided", "watched", "observe", "recount", "count", "settle", "record"):
        params = inspect.signature(getattr(SizeTuner, name)).parameters
        assert set(params) <= {"self", "comm", "nbytes", "cands", "seconds", "algorithm", "deadline"}, (name, params)
    cands = ("mpi", "ring", "shm")
    t = SizeTuner()
    assert t.decided(1 << 20, cands) is None
    while True:
        algo, trial = t.choose(1 << 20, cands)
        if not trial:
            break
        t.record(OneRank(), 1 << 20, cands, algo, {"mpi": 3.0, "ring": 2.0, "shm": 1.0}[algo])
    assert t.decisions() == {"[1048576, 2097152) B": "shm"}


class MaxOf:
    """A deciding/checking ``Iallreduce(IN_PLACE, x, MAX)`` that also sees another rank's value ``other``."""

    def __init__(self, other):
        self.other = other
        self.calls = 0

    def Iallreduce(self, sendbuf, recvbuf, op):
        self.calls += 1
        buf = recvbuf if hasattr(recvbuf, "shape") else sendbuf
        np.maximum(buf, self.other, out=buf)
        return _Done()


def settle_watched(t, cands, seconds, nbytes):
    while True:
        algo, trial = t.choose(nbytes, cands)
        if not trial:
            return algo
        t.record(OneRank(), nbytes, cands, algo, seconds[algo])


def _checks(t, comm, nb, cands, seconds, calls):
    return [t.observe(comm, nb, cands, seconds) for _ in range(calls)]


def test_watched_bucket_is_measured_again_when_its_calls_slow_down():
    from ddlkernels.select.tuner import DRIFT, WATCH_FROM, watch_interval

    cands, nb = ("ring", "shm"), WATCH_FROM
    t = SizeTuner(watch=True)
    assert settle_watched(t, cands, {"ring": 1.0, "shm": 0.5}, nb) == "shm"
    assert t.watched(nb, cands) and t.decided(nb, cands) == "shm"
    every = watch_interval(0.5)
    # As fast as it won: one check per interval, nothing reopens.
    comm = MaxOf(0.0)
    assert not any(_checks(t, comm, nb, cands, 0.5, 3 * every))
    assert comm.calls == 3 and t.decided(nb, cands) == "shm"
    # Slower, but within DRIFT (and the runner-up took twice as long): still settled.
    assert not any(_checks(t, comm, nb, cands, 0.5 * DRIFT * 0.99, every))
    # Another rank's calls slowed down (the check takes the maximum): every rank reopens at the same call.
    comm = MaxOf(0.5 * DRIFT * 1.01)
    assert _checks(t, comm, nb, cands, 0.5, every) == [False] * (every - 1) + [True]
    assert t.decided(nb, cands) is None and t.choose(nb, cands)[1]  # trials again
    assert t.reopens == {"slower": 1, "quiet": 0, "recount": 0}
    # The machine changed its mind: the ring wins now, watched at its own interval.
    assert settle_watched(t, cands, {"ring": 0.6, "shm": 1.2}, nb) == "ring"
    comm = MaxOf(0.0)
    _checks(t, comm, nb, cands, 0.6, watch_interval(0.6) - 1)
    assert comm.calls == 0 and not t.observe(comm, nb, cands, 0.6) and comm.calls == 1


def test_slower_than_the_runner_up_was_reopens_before_drift():
    from ddlkernels.select.tuner import DRIFT, MARGIN, WATCH_FROM, watch_interval

    cands, nb = ("ring", "shm"), WATCH_FROM
    t = SizeTuner(watch=True)
    settle_watched(t, cands, {"ring": 0.6, "shm": 0.5}, nb)  # shm won by 1.2x
    now = 0.6 * MARGIN * 1.01  # past the ring's trial time (with margin), below DRIFT x shm's
    assert now < DRIFT * 0.5
    assert _checks(t, MaxOf(0.0), nb, cands, now, watch_interval(0.5))[-1]


def test_a_winner_whose_calls_ran_slower_than_its_trials_is_charged_what_they_took():
    """Trials that keep finding an algorithm fast while the loop's calls of it run slow: the re-measurement
    its slow calls started charges it their (agreed) time, so the runner-up wins; an exploration after
    quiet checks charges nothing."""
    from ddlkernels.select.tuner import DRIFT, EXPLORE_CHECKS, WATCH_FROM, watch_interval

    cands, nb = ("ring", "shm"), WATCH_FROM
    t = SizeTuner(watch=True)
    trials = {"ring": 0.8, "shm": 0.5}
    assert settle_watched(t, cands, trials, nb) == "shm"
    # Its calls take 1.0 on the slowest rank (the check's maximum): reopened, with that time kept.
    assert _checks(t, MaxOf(1.0), nb, cands, 0.5, watch_interval(0.5))[-1]
    # The same trials again would pick shm again; charged 1.0, it loses to the ring's 0.8.
    assert settle_watched(t, cands, trials, nb) == "ring"
    key = t._key(nb, cands)
    assert t._state[key].won_in == 0.8 and t._state[key].limit == min(DRIFT * 0.8, MARGIN * 1.0)
    # The ring runs as its trials said; after EXPLORE_CHECKS quiet checks the bucket is measured again,
    # and nothing is charged: shm's trials win again (the caller's loop may have changed).
    every = t._state[key].every
    assert _checks(t, MaxOf(0.0), nb, cands, 0.8, every * EXPLORE_CHECKS)[-1]
    assert settle_watched(t, cands, trials, nb) == "shm"
    # Charged but still the fastest by the margin: kept, watched from the time its calls took.
    assert _checks(t, MaxOf(0.8), nb, cands, 0.5, watch_interval(0.5))[-1]  # past min(DRIFT x 0.5, MARGIN x 0.8)
    assert settle_watched(t, cands, {"ring": 2.0, "shm": 0.5}, nb) == "shm"
    assert t._state[key].won_in == 0.8
    assert t.reopens == {"slower": 2, "quiet": 1, "recount": 0}


def test_the_interval_is_about_check_seconds_of_calls_and_backs_off():
    from ddlkernels.select.tuner import CHECK_SECONDS, WATCH_CALLS, WATCH_FROM, WATCH_MAX_CALLS, WATCH_MIN_CALLS, watch_interval

    assert watch_interval(CHECK_SECONDS / 10) == 10
    assert watch_interval(1e-6) == WATCH_CALLS and watch_interval(10.0) == WATCH_MIN_CALLS
    cands, nb = ("ring", "shm"), 4 * WATCH_FROM
    t = SizeTuner(watch=True)
    w = 0.5
    settle_watched(t, cands, {"ring": 2 * w, "shm": w}, nb)
    key = t._key(nb, cands)
    intervals = []
    for _ in range(12):  # 3x slower every time, the same winner every time: the interval doubles up to its cap
        intervals.append(t._state[key].every)
        comm = MaxOf(0.0)
        calls = 1
        while not t.observe(comm, nb, cands, 3 * w):
            calls += 1
        assert calls == intervals[-1] and comm.calls == 1  # reopened at the first check
        w *= 3
        assert settle_watched(t, cands, {"ring": 2 * w, "shm": w}, nb) == "shm"
    first = watch_interval(0.5)
    assert intervals == [min(WATCH_MAX_CALLS, first * 2**i) for i in range(12)]
    assert intervals[-1] == WATCH_MAX_CALLS


def test_quiet_checks_reopen_anyway_and_find_a_runner_up_that_became_faster():
    """The checks time only the winner: after EXPLORE_CHECKS quiet ones the bucket is measured again."""
    from ddlkernels.select.tuner import EXPLORE_CHECKS, WATCH_FROM, watch_interval

    cands, nb = ("ring", "shm"), 2 * WATCH_FROM
    t = SizeTuner(watch=True)
    assert settle_watched(t, cands, {"ring": 1.0, "shm": 0.5}, nb) == "shm"
    every = watch_interval(0.5)
    comm = MaxOf(0.0)
    # shm keeps its trial speed: nothing to see at any check but the last of EXPLORE_CHECKS.
    got = _checks(t, comm, nb, cands, 0.5, every * EXPLORE_CHECKS)
    assert comm.calls == EXPLORE_CHECKS and got == [False] * (every * EXPLORE_CHECKS - 1) + [True]
    assert t.reopens == {"slower": 0, "quiet": 1, "recount": 0}
    assert t.decided(nb, cands) is None and t.choose(nb, cands)[1]  # trials again
    # Meanwhile the ring became the faster: the re-measurement finds it.
    assert settle_watched(t, cands, {"ring": 0.3, "shm": 0.5}, nb) == "ring"
    assert t._state[t._key(nb, cands)].every == watch_interval(0.3)  # a new winner: no back-off


def test_an_exploration_that_keeps_the_winner_backs_off():
    from ddlkernels.select.tuner import EXPLORE_CHECKS, WATCH_FROM, WATCH_MAX_CALLS, watch_interval

    cands, nb = ("ring", "shm"), 2 * WATCH_FROM
    t = SizeTuner(watch=True)
    settle_watched(t, cands, {"ring": 1.0, "shm": 0.5}, nb)
    key = t._key(nb, cands)
    calls_between = []
    for _ in range(4):
        every = t._state[key].every
        comm = MaxOf(0.0)
        n = next((k for k in range(1, 2 * EXPLORE_CHECKS * every + 1) if t.observe(comm, nb, cands, 0.5)), None)
        assert n is not None, "no re-measurement after twice EXPLORE_CHECKS quiet checks"
        calls_between.append(n)
        assert comm.calls == EXPLORE_CHECKS
        assert settle_watched(t, cands, {"ring": 1.0, "shm": 0.5}, nb) == "shm"
        assert t._state[key].every == min(WATCH_MAX_CALLS, 2 * every)
    first = watch_interval(0.5)
    assert calls_between == [EXPLORE_CHECKS * min(WATCH_MAX_CALLS, first * 2**i) for i in range(4)]


def test_below_watch_from_a_bucket_is_measured_again_after_its_calls_are_counted():
    """No timing below WATCH_FROM, but RECOUNT_CALLS calls (counted alike on every rank) reopen the bucket."""
    from ddlkernels.select.tuner import RECOUNT_CALLS, RECOUNT_MAX_CALLS, WATCH_FROM

    cands, nb = ("mpi", "nbc", "shm"), 4096
    assert nb < WATCH_FROM
    t = SizeTuner(watch=True)
    # Start-up noise: MPI's call wins the first trials.
    assert settle_watched(t, cands, {"mpi": 1.0, "nbc": 1.0, "shm": 1.0}, nb) == "mpi"
    assert not t.watched(nb, cands)
    rc = t.recount(nb, cands)
    assert rc is not None and rc.left == RECOUNT_CALLS
    assert not any(t.count(nb, cands) for _ in range(RECOUNT_CALLS - 1))
    assert t.count(nb, cands) and t.decided(nb, cands) is None and t.choose(nb, cands)[1]
    assert t.reopens == {"slower": 0, "quiet": 0, "recount": 1}
    # Measured again in a quiet moment: the shared-memory allreduce wins now, counted from scratch.
    assert settle_watched(t, cands, {"mpi": 1.0, "nbc": 1.0, "shm": 0.5}, nb) == "shm"
    assert t.recount(nb, cands).left == RECOUNT_CALLS
    # A re-measurement that keeps the winner doubles the count (a fast path counting down works alike).
    every = []
    for _ in range(3):
        rc = t.recount(nb, cands)
        every.append(rc.every)
        rc.left = 1
        assert t.count(nb, cands)
        assert settle_watched(t, cands, {"mpi": 1.0, "nbc": 1.0, "shm": 0.5}, nb) == "shm"
    assert every == [min(RECOUNT_MAX_CALLS, RECOUNT_CALLS * 2**i) for i in range(3)]
    # A stale countdown (its bucket already reopened) reopens nothing.
    assert not t.expire(rc)
    # Without the watch (settle / watch=False) nothing is counted.
    off = SizeTuner(watch=False)
    settle_watched(off, cands, {"mpi": 1.0, "nbc": 1.0, "shm": 0.5}, nb)
    assert off.recount(nb, cands) is None and not off.count(nb, cands)


def test_not_watched_below_watch_from_when_fixed_or_when_off():
    from ddlkernels.select.tuner import WATCH_FROM

    cands = ("ring", "shm")
    t = SizeTuner(watch=True)
    settle_watched(t, cands, {"ring": 1.0, "shm": 0.5}, WATCH_FROM - 1)
    assert not t.watched(WATCH_FROM - 1, cands)
    assert not t.observe(MaxOf(9.0), WATCH_FROM - 1, cands, 9.0)
    t.settle(WATCH_FROM, cands, "ring")  # fixed by the caller, not measured: never reopened
    assert not t.watched(WATCH_FROM, cands)
    off = SizeTuner()
    settle_watched(off, cands, {"ring": 1.0, "shm": 0.5}, WATCH_FROM)
    assert not off.watched(WATCH_FROM, cands) and off.decided(WATCH_FROM, cands) == "shm"
    w = SizeTuner(watch=True)
    settle_watched(w, cands, {"ring": 1.0, "shm": 0.5}, WATCH_FROM)
    assert list(w.decisions().values()) == ["shm"]  # reports name a watched bucket's algorithm
