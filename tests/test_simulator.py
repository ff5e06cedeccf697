"""The simulator: exact against alpha-beta closed forms on simple networks, and it catches schedule bugs."""

import dataclasses

import pytest

from ddlkernels.select import topology as T
from ddlkernels.ring.schedule import Plan, build_schedule
from ddlkernels.tools.simulator import ScheduleError, simulate
from ddlkernels.select.topology import Level, Topology

INF_REDUCE = 1e30  # reductions free: the closed forms below have no compute term


def uniform(p, bw=1e9, lat=1e-5, **kw):
    return Topology(levels=(Level("node", p, bw, lat, **kw),), ranks=p, reduce_rate=INF_REDUCE)


def ring_closed_form(p, nbytes, bw, lat):
    # 2 (p - 1) steps, each: one latency plus one block of nbytes / p at bw.
    return 2 * (p - 1) * (lat + nbytes / p / bw)


@pytest.mark.parametrize("p", [2, 3, 5, 7, 8, 13])
@pytest.mark.parametrize("nbytes", [4 * 13 * 8 * 7 * 5 * 3, 4 * 13 * 8 * 7 * 5 * 3 * 64])
def test_flat_ring_matches_closed_form(p, nbytes):
    # One chunk per step (chunk >= block) and blocks that divide evenly: the
    # simulated time is the alpha-beta formula exactly.
    bw, lat = 2e9, 7e-6
    res = simulate(uniform(p, bw, lat), (p,), nbytes, chunk_bytes=1 << 30, reduce_rate=INF_REDUCE, verify=True)
    assert res.time_s == pytest.approx(ring_closed_form(p, nbytes, bw, lat), rel=1e-9)
    assert res.verified


@pytest.mark.parametrize("dims", [(2, 3), (3, 2), (2, 2, 2), (4, 3), (5, 2)])
def test_box_on_uniform_network_matches_closed_form(dims):
    # On one switch every ring edge has its own port: dimension i costs
    # 2 (d_i - 1) (lat + N_i / d_i / bw) with N_i the bytes entering it.
    p = 1
    for d in dims:
        p *= d
    bw, lat, nbytes = 1e9, 3e-6, 4 * 720 * 64
    want, n = 0.0, nbytes
    for d in dims:
        want += 2 * (d - 1) * (lat + n / d / bw)
        n /= d
    res = simulate(uniform(p, bw, lat), dims, nbytes, chunk_bytes=1 << 30, reduce_rate=INF_REDUCE)
    assert res.time_s == pytest.approx(want, rel=1e-9)


def test_pipelining_bounds():
    # With chunks, the ring keeps its links busy: the time lies between the
    # bandwidth bound and the unpipelined formula.
    p, bw, lat, nbytes = 6, 1e9, 2e-5, 48 << 20
    topo = uniform(p, bw, lat)
    unpiped = simulate(topo, (p,), nbytes, chunk_bytes=1 << 30).time_s
    piped = simulate(topo, (p,), nbytes, chunk_bytes=256 << 10).time_s
    assert 2 * (p - 1) / p * nbytes / bw < piped < unpiped


def test_reduction_rate_costs_time():
    p, nbytes = 4, 8 << 20
    fast = simulate(uniform(p), (p,), nbytes, chunk_bytes=1 << 20, reduce_rate=INF_REDUCE).time_s
    slow = simulate(uniform(p), (p,), nbytes, chunk_bytes=1 << 20, reduce_rate=0.25e9).time_s
    # 3 reduce-scatter steps of 2 MiB each reduced at 0.25 GB/s cannot finish before 25 ms.
    assert slow > 3 * (2 << 20) / 0.25e9 > fast


@pytest.mark.parametrize("p", [2, 3, 5])
def test_chunk_overhead_adds_per_received_chunk_on_the_critical_path(p):
    # One chunk per step: every step waits for the previous rank's forward,
    # so each of the 2 (p - 1) received chunks adds its overhead in series.
    bw, lat, o, nbytes = 2e9, 7e-6, 11e-6, 4 * 3 * 5 * 64
    topo = dataclasses.replace(uniform(p, bw, lat), chunk_overhead=o)
    res = simulate(topo, (p,), nbytes, chunk_bytes=1 << 30, reduce_rate=INF_REDUCE, verify=True)
    assert res.time_s == pytest.approx(ring_closed_form(p, nbytes, bw, lat) + 2 * (p - 1) * o, rel=1e-9)
    assert res.verified


def test_chunk_overhead_round_trips_and_rejects_negative():
    topo = dataclasses.replace(uniform(3), chunk_overhead=2.5e-5)
    assert Topology.from_json(topo.to_json()).chunk_overhead == 2.5e-5
    assert "chunk_overhead" not in uniform(3).to_dict()  # 0: not modelled, not written
    with pytest.raises(T.TopologyError, match="chunk_overhead"):
        dataclasses.replace(uniform(3), chunk_overhead=-1e-6)
    with pytest.raises(T.TopologyError, match="chunk_overhead"):
        Topology.from_dict({**uniform(3).to_dict(), "chunk_overhead": "fast"})


def two_nodes(links):
    return Topology(
        levels=(Level("node", 4, 100e9, 1e-6), Level("rack", 2, 1e9, 1e-5, links=links)),
        ranks=8,
        reduce_rate=INF_REDUCE,
    )


def test_rings_leaving_a_node_share_its_nic():
    # dims (4, 2): dimension 2 runs 4 rings of 2 ranks, one per GPU position,
    # every one crossing the nodes' single NIC.  Its phases take 4 x as long
    # as with 4 NICs; dimension 1 (inside the node) is unaffected.
    nbytes = 4 * (1 << 20)
    one = simulate(two_nodes(1), (4, 2), nbytes, chunk_bytes=1 << 30)
    four = simulate(two_nodes(4), (4, 2), nbytes, chunk_bytes=1 << 30)
    d1 = one.phase_end_s[0]
    assert d1 == pytest.approx(four.phase_end_s[0])
    inter_one = one.phase_end_s[1] - one.phase_end_s[0]
    inter_four = four.phase_end_s[1] - four.phase_end_s[0]
    block = nbytes / 4 / 2
    assert inter_four == pytest.approx(1e-5 + block / 1e9, rel=1e-6)
    assert inter_one == pytest.approx(1e-5 + 4 * block / 1e9, rel=1e-6)


def test_bad_ring_order_uses_a_link_twice():
    # Flat ring over 2 nodes of 4: in topology order the NIC carries one
    # message each way; interleaving the nodes makes every edge cross it.
    topo = two_nodes(1)
    nbytes = 8 << 20
    good = simulate(topo, Plan((8,)), nbytes, chunk_bytes=1 << 30).time_s
    bad = simulate(topo, Plan((8,), (0, 4, 1, 5, 2, 6, 3, 7)), nbytes, chunk_bytes=1 << 30).time_s
    assert bad > 3 * good


@pytest.mark.parametrize("p, dims", [(1, (1,)), (2, (2,)), (3, (3,)), (4, (2, 2)), (5, (5,)), (6, (3, 2)), (7, (7,)), (8, (2, 2, 2)), (8, (4, 2)), (12, (2, 3, 2))])
@pytest.mark.parametrize("count", [0, 1, 2, 7, 11, 97, 1009])
@pytest.mark.parametrize("chunk_elems, window", [(1 << 20, 4), (3, 1), (5, 2)])
def test_data_verified_for_edge_sizes(p, dims, count, chunk_elems, window):
    topo = uniform(p)
    res = simulate(topo, dims, count * 8, itemsize=8, chunk_bytes=chunk_elems * 8, window=window, verify=True)
    assert res.verified
    if p == 1 or count == 0:
        assert res.time_s == 0.0


def test_odd_orders_verified():
    for order in [(2, 0, 1, 5, 3, 4), (5, 4, 3, 2, 1, 0)]:
        assert simulate(uniform(6), Plan((2, 3), order), 6 * 8 * 31, itemsize=8, chunk_bytes=16, verify=True).verified


def schedules(count, dims):
    plan = Plan(dims)
    return [build_schedule(count, plan, r) for r in range(plan.size)]


def test_catches_mismatched_ranges():
    # The last reduce-scatter step's receive is not forwarded, so only the
    # send/receive matching can see that it expects one element less.
    s = schedules(60, (3,))
    steps = list(s[1].steps)
    steps[1] = dataclasses.replace(steps[1], recv=(steps[1].recv[0], steps[1].recv[1] - 1))
    s[1] = dataclasses.replace(s[1], steps=tuple(steps))
    with pytest.raises(ScheduleError, match="receives that message into"):
        simulate(uniform(3), (3,), 60 * 4, schedules=s)


def test_catches_send_that_is_not_the_block_just_received():
    s = schedules(60, (4,))
    steps = list(s[2].steps)
    steps[1] = dataclasses.replace(steps[1], send=steps[2].send)
    s[2] = dataclasses.replace(s[2], steps=tuple(steps))
    with pytest.raises(ScheduleError, match="forwards the block"):
        simulate(uniform(4), (4,), 60 * 4, schedules=s)


def test_catches_missing_step_as_deadlock_or_unmatched():
    s = schedules(60, (4,))
    s[3] = dataclasses.replace(s[3], steps=s[3].steps[:2] + s[3].steps[3:])
    with pytest.raises(ScheduleError):
        simulate(uniform(4), (4,), 60 * 4, schedules=s)


def test_catches_wrong_peer():
    s = schedules(60, (4,))
    steps = [dataclasses.replace(st, recv_peer=(st.recv_peer + 1) % 4) for st in s[0].steps]
    s[0] = dataclasses.replace(s[0], steps=tuple(steps))
    with pytest.raises(ScheduleError):
        simulate(uniform(4), (4,), 60 * 4, schedules=s)


def test_catches_wrong_data_that_matches_fine():
    # Every rank copies instead of reducing in the first step: all messages
    # match, only the data is wrong.
    s = schedules(60, (2, 2))
    s = [dataclasses.replace(x, steps=(dataclasses.replace(x.steps[0], reduce=False),) + x.steps[1:]) for x in s]
    with pytest.raises(ScheduleError, match="wrong data"):
        simulate(uniform(4), (2, 2), 60 * 4, schedules=s, verify=True)


def test_deterministic_and_bytes_accounted():
    topo = T.load_preset("powerai-ddl").subset(32)
    a = simulate(topo, (4, 8), 4 << 20)
    b = simulate(topo, (4, 8), 4 << 20)
    assert a.time_s == b.time_s and a.messages == b.messages
    # Dimension 1 (inside nodes) moves 2 * 3/4 of the data per rank, the rest crosses the NIC.
    per_rank = 4 << 20
    assert a.bytes_by_level[0] == pytest.approx(32 * 2 * 3 / 4 * per_rank)
    assert a.bytes_by_level[1] == pytest.approx(32 * 2 * 7 / 8 * per_rank / 4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="ranks"):
        simulate(uniform(4), (2, 3), 100)
    with pytest.raises(ValueError, match="chunk_bytes"):
        simulate(uniform(4), (4,), 100, chunk_bytes=2)
    with pytest.raises(ValueError, match="window"):
        simulate(uniform(4), (4,), 100, window=0)
    with pytest.raises(ValueError):
        simulate(uniform(4), (4,), -1)
