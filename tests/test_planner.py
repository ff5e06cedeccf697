"""The planner: candidates, choices that follow the topology, the lower bound, and its agreement with the simulator."""

import math

import pytest

from ddlkernels.select import topology as T
from ddlkernels.ring.schedule import Plan
from ddlkernels.select.planner import candidates, choose_plan, factorizations, lower_bound, model_time
from ddlkernels.tools.simulator import simulate
from ddlkernels.select.topology import Level, Topology


def test_factorizations():
    assert sorted(factorizations(12)) == sorted([(12,), (2, 6), (6, 2), (3, 4), (4, 3), (2, 2, 3), (2, 3, 2), (3, 2, 2)])
    assert len(factorizations(256)) == 128  # compositions of 8
    assert factorizations(13) == [(13,)]
    assert factorizations(1) == [(1,)]
    assert all(len(f) <= 2 for f in factorizations(64, max_factors=2))


def test_candidates_cover_flat_levels_merged_and_split():
    c = set(candidates(T.load_preset("powerai-ddl")))
    assert (256,) in c  # flat ring
    assert (4, 16, 4) in c  # one dimension per level
    assert (64, 4) in c and (4, 64) in c  # merged levels
    assert (2, 2, 16, 4) in c and (4, 4, 4, 4) in c  # a level split


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8, 12, 16, 64, 128, 256])
@pytest.mark.parametrize("nbytes", [0, 4, 65536, 350 << 20])
def test_choice_is_a_valid_plan(p, nbytes):
    topo = T.load_preset("powerai-ddl") if p in (1, 2, 4, 8, 12, 16, 64, 128, 256) else Topology(levels=(Level("n", p, 1e9, 1e-6),), ranks=p)
    plan, info = choose_plan(topo, p, nbytes)
    assert isinstance(plan, Plan) and plan.size == p
    assert math.prod(info["dims"]) == p and tuple(info["dims"]) == plan.dims
    assert info["time_s"] == min(a["time_s"] for a in info["alternatives"]) or len(plan.dims) < min(len(a["dims"]) for a in info["alternatives"] if a["time_s"] < info["time_s"])
    assert info["lower_bound_s"] <= info["time_s"] + 1e-15


def test_order_follows_placement():
    # Ranks placed round robin over 2 nodes: the plan's order puts node-mates
    # next to each other so that dimension 1's rings stay in the node.
    params = Topology(levels=(Level("node", 4, 50e9, 1e-6), Level("rack", 2, 5e9, 5e-6)), ranks=8, reduce_rate=1e12)
    topo = T._group_structure([r % 2 for r in range(8)], None, None, params, 1e9, "rr")
    plan, info = choose_plan(topo, 8, 64 << 20)
    assert plan.order == (0, 2, 4, 6, 1, 3, 5, 7)
    assert plan.dims[0] == 4  # the fast level carries the most data


def test_small_messages_prefer_fewer_latencies():
    topo = Topology(levels=(Level("n", 64, 10e9, 10e-6),), ranks=64)
    plan, _ = choose_plan(topo, 64, 1024)
    steps = sum(d - 1 for d in plan.dims)
    assert steps < 63  # a box beats the flat ring's 63 latencies per direction


def test_slow_top_level_gets_least_data():
    # Two 8-rank nodes joined by a slow link: the node must be dimension 1.
    topo = Topology(levels=(Level("node", 8, 100e9, 2e-6), Level("net", 2, 2e9, 10e-6)), ranks=16, reduce_rate=1e12)
    plan, info = choose_plan(topo, 16, 256 << 20)
    assert plan.dims[0] == 8
    assert info["time_s"] < model_time(topo, (16,), 256 << 20) and info["time_s"] < model_time(topo, (2, 8), 256 << 20)


def test_cached_per_size_bucket():
    topo = T.load_preset("dgx1-goyal")
    a = choose_plan(topo, 256, 100_000_000)
    b = choose_plan(topo, 256, 100_000_001)
    assert a[0] is b[0] and a[1] is b[1]


def test_bad_arguments():
    topo = T.load_preset("powerai-ddl")
    with pytest.raises(ValueError):
        choose_plan(topo, 0, 10)
    with pytest.raises(ValueError):
        choose_plan(topo, 256, -1)
    with pytest.raises(T.TopologyError):
        choose_plan(topo, 6, 10)
    with pytest.raises(TypeError):
        choose_plan("powerai-ddl", 256, 10)


def test_lower_bound_formula():
    topo = T.load_preset("powerai-ddl")
    n = 350 << 20
    # 64 nodes behind one 10 GB/s NIC each: 2 * 63/64 * N / 10 GB/s, plus one inter-rack latency.
    assert lower_bound(topo, n) == pytest.approx(2 * 63 / 64 * n / 10e9 + 12e-6)
    assert lower_bound(topo.subset(1), n) == 0.0
    one = Topology(levels=(Level("node", 4, 1e9, 1e-6, capacity=2e9),), ranks=4)
    assert lower_bound(one, n) == pytest.approx(max(2 * 3 / 4 * n / 1e9, 2 * 3 * n / 2e9) + 1e-6)


@pytest.mark.parametrize("name, p", [("powerai-ddl", 16), ("powerai-ddl", 32), ("dgx1-goyal", 16), ("h100-ib", 16)])
@pytest.mark.parametrize("nbytes", [64 << 10, 8 << 20])
def test_simulated_times_respect_the_lower_bound_and_the_model(name, p, nbytes):
    topo = T.load_preset(name).subset(p)
    lb = lower_bound(topo, nbytes)
    for dims in {(p,), choose_plan(topo, p, nbytes)[0].dims, (topo.levels[0].fanout, p // topo.levels[0].fanout)}:
        sim = simulate(topo, dims, nbytes, verify=False).time_s
        assert sim >= lb
        # The planner's formula is an approximation of the simulation, not a bound: it must stay close.
        assert model_time(topo, dims, nbytes) == pytest.approx(sim, rel=0.35)


def _cli(*args):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "ddlkernels", *args], capture_output=True, text=True, cwd=root)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_cli_plan_and_simulate_json():
    out = _cli("plan", "--topology", "powerai-ddl", "--bytes", "350MB", "--json")
    assert out["dims"] and math.prod(out["dims"]) == 256
    assert 0 < out["lower_bound_s"] <= out["time_s"]
    assert out["alternatives"][0]["dims"] == out["dims"]
    sim = _cli("simulate", "--topology", "powerai-ddl", "--ranks", "16", "--bytes", "1M", "--dims", "16", "--json")
    assert sim["dims"] == [16] and sim["verified"] is True
    assert 0 < sim["lower_bound_s"] <= sim["time_s"]
    auto = _cli("simulate", "--topology", "powerai-ddl", "--ranks", "16", "--bytes", "1M", "--json")
    assert math.prod(auto["dims"]) == 16 and auto["time_s"] <= sim["time_s"]
