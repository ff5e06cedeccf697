"""The schedule, executed by a tiny in-process interpreter: every element reduced once per rank, gathered to all."""

import random

import numpy as np
import pytest

from ddlkernels.ring.schedule import Plan, build_schedule, chunk_ranges, coords, shard_bounds, split, validate_dims


def factorizations(p, max_k=3):
    """Every ordered factorization of p into 1..max_k factors > 1 (and (1,) for p == 1)."""
    if p == 1:
        return [(1,)]
    out = []

    def rec(rest, prefix):
        if rest == 1:
            if prefix:
                out.append(tuple(prefix))
            return
        if len(prefix) == max_k:
            return
        for d in range(2, rest + 1):
            if rest % d == 0:
                rec(rest // d, prefix + [d])

    rec(p, [])
    return out


def interpret(count, plan, kinds=("rs", "ag")):
    """Run every rank's schedule in lock step on symbolic data: sets of contributing ranks."""
    p = plan.size
    rs, ag = "rs" in kinds, "ag" in kinds
    scheds = [build_schedule(count, plan, r, reduce_scatter=rs, allgather=ag) for r in range(p)]
    nsteps = {len(s.steps) for s in scheds}
    assert len(nsteps) == 1, "every rank runs the same number of steps"
    # contrib[r][i]: the ranks whose element i rank r has summed in; reduced[r][i]: times reduced on r.
    contrib = [[{r} for _ in range(count)] for r in range(p)]
    reduced = np.zeros((p, count), dtype=int)
    if not rs:  # allgather only: each rank starts with its (complete) shard
        contrib = [[set(range(p)) if s.shard[0] <= i < s.shard[1] else set() for i in range(count)] for s in scheds]
    for k in range(nsteps.pop()):
        sent = {}
        for r, s in enumerate(scheds):
            st = s.steps[k]
            assert st.send_peer != r or p == 1
            key = (r, st.send_peer)
            assert key not in sent, "one message per pair and step"
            sent[key] = (st.send, [set(contrib[r][i]) for i in range(*st.send)], st.phase)
        for r, s in enumerate(scheds):
            st = s.steps[k]
            rng, payload, phase = sent.pop((st.recv_peer, r))
            assert rng == st.recv and phase == st.phase, "sender and receiver agree on range and tag"
            for off, i in enumerate(range(*rng)):
                if st.reduce:
                    assert not (contrib[r][i] & payload[off]), "an element is never reduced twice"
                    contrib[r][i] |= payload[off]
                    reduced[r, i] += 1
                else:
                    contrib[r][i] = payload[off]
        assert not sent, "every message was received"
    return scheds, contrib, reduced


@pytest.mark.parametrize("p", list(range(1, 17)))
def test_allreduce_schedule_every_p_and_box(p):
    everyone = set(range(p))
    plans = [Plan(d) for d in factorizations(p)]
    rnd = random.Random(p)
    order = list(range(p))
    rnd.shuffle(order)
    plans.append(Plan(plans[-1].dims, tuple(order)))
    for plan in plans:
        for count in sorted({0, 1, 2, p - 1, p, p + 1, 2 * p + 3, 13, 37}):
            if count < 0:
                continue
            scheds, contrib, reduced = interpret(count, plan)
            for r in range(p):
                assert all(c == everyone for c in contrib[r]), (plan, count, r)
            # Each element is fully reduced exactly once, on its owner (the sum of
            # reductions over ranks is p - 1 per element).
            assert (reduced.sum(axis=0) == p - 1).all()
            # Shards tile the buffer.
            shards = sorted(s.shard for s in scheds)
            assert shards[0][0] == 0 and shards[-1][1] == count
            assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))


@pytest.mark.parametrize("dims", [(2, 3), (3, 2), (2, 2, 2), (5,), (7,), (3, 5)])
def test_reduce_scatter_then_allgather_halves(dims):
    plan = Plan(dims)
    p = plan.size
    for count in (0, 1, p - 1, p + 1, 29):
        scheds, contrib, _ = interpret(count, plan, kinds=("rs",))
        for r, s in enumerate(scheds):
            for i in range(*s.shard):
                assert contrib[r][i] == set(range(p))
        _, contrib, _ = interpret(count, plan, kinds=("ag",))
        assert all(c == set(range(p)) for row in contrib for c in row)


def test_data_volume_shrinks_with_depth():
    """Dimension i moves N / (d1 ... d(i-1)) elements: the paper's point."""
    plan = Plan((4, 16, 4))
    n = 256 * 1000
    s = build_schedule(n, plan, 5)
    per_dim = {}
    for st in s.steps:
        if st.reduce:
            per_dim[st.dim] = per_dim.get(st.dim, 0) + st.send[1] - st.send[0]
    assert per_dim[0] == n * 3 // 4
    assert per_dim[1] == n // 4 * 15 // 16
    assert per_dim[2] == n // 64 * 3 // 4


def test_flat_ring_shards_match_reduce_scatter_block():
    for p in (1, 2, 3, 5, 8):
        for n in (0, 1, p - 1, p + 1, 100):
            bounds = [shard_bounds(n, (p,), r) for r in range(p)]
            sizes = [b - a for a, b in bounds]
            assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
            assert [a for a, _ in bounds] == sorted(a for a, _ in bounds)


def test_split_coords_chunks():
    assert [split(0, 10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [split(5, 6, 3, i) for i in range(3)] == [(5, 6), (6, 6), (6, 6)]
    assert coords(5, (2, 3)) == (1, 2)
    assert chunk_ranges(3, 10, 4) == [(3, 7), (7, 10)]
    assert chunk_ranges(3, 3, 4) == []
    with pytest.raises(ValueError):
        chunk_ranges(0, 1, 0)


@pytest.mark.parametrize(
    "dims,size,msg",
    [((2, 3), 5, "describe 6 ranks"), ((0, 2), 0, "positive"), ((), 1, "non-empty"), ((2.5,), 2, "ints")],
)
def test_validate_dims_errors(dims, size, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        validate_dims(dims, size)


def test_plan_rejects_bad_order():
    with pytest.raises(ValueError, match="permutation"):
        Plan((2, 2), (0, 1, 1, 3))
    assert Plan((2, 2), (0, 1, 2, 3)).order is None
