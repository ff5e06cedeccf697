"""Building a ring schedule and choosing a plan: the per-call setup the engine caches.

``build_schedule`` runs once per (count, plan, kind) and is then served from
the Communicator's cache; ``choose_plan`` (the topology planner) once per
(topology, p, size bucket).  Cold numbers say what the first call of a new
shape costs, warm ones what every later call pays.
"""

import pytest

from ddlkernels.ring.schedule import Plan, build_schedule, chunk_ranges

COUNT = 350 * 2**20 // 4  # a 350 MB float32 gradient: the paper's ResNet-101 figure


@pytest.mark.parametrize("dims", [(2,), (8,), (64,), (4, 16), (4, 16, 4), (256,)], ids=lambda d: "x".join(map(str, d)))
def bench_build_schedule(benchmark, run, dims):
    plan = Plan(tuple(dims))
    benchmark.group = "schedule"
    run(benchmark, build_schedule, COUNT, plan, plan.size - 1, iterations=5)
    s = build_schedule(COUNT, plan, plan.size - 1)
    assert len(s.steps) == 2 * sum(d - 1 for d in dims)


def bench_chunk_ranges(benchmark, run):
    """Cutting one ring step of 350 MB / 8 into 1 MiB chunks."""
    benchmark.group = "schedule"
    run(benchmark, chunk_ranges, 0, COUNT // 8, (1 << 20) // 4, iterations=10)


planner = pytest.importorskip("ddlkernels.select.planner", reason="ddlkernels.select.planner is not available")
if not hasattr(planner, "choose_plan"):
    pytest.skip("ddlkernels.select.planner has no choose_plan", allow_module_level=True)


@pytest.fixture(scope="module")
def topology():
    from ddlkernels.select.topology import load_preset

    return load_preset("powerai-ddl")


@pytest.mark.parametrize("p", [16, 256])
def bench_choose_plan_cold(benchmark, run, topology, p):
    """First call for a (topology, p, size): edge rates computed, every factorization costed."""

    def setup():
        planner._PLAN_CACHE.clear()
        planner._model.cache_clear()
        return (topology, p, 350 * 2**20), {}

    benchmark.group = "planner"
    run(benchmark, planner.choose_plan, setup=setup)
    plan, info = planner.choose_plan(topology, p, 350 * 2**20)
    assert plan.size == p and info["candidates"] >= 1


@pytest.mark.parametrize("p", [16, 256])
def bench_choose_plan_uncached_size(benchmark, run, topology, p):
    """Model cached, plan not: a new message size on a known topology (the formula only)."""

    def setup():
        planner._PLAN_CACHE.clear()
        return (topology, p, 350 * 2**20), {}

    planner.choose_plan(topology, p, 1 << 20)  # warm the per-topology model
    benchmark.group = "planner"
    run(benchmark, planner.choose_plan, setup=setup)


@pytest.mark.parametrize("p", [16, 256])
def bench_choose_plan_warm(benchmark, run, topology, p):
    """Every later call: a dictionary hit."""
    planner.choose_plan(topology, p, 350 * 2**20)
    benchmark.group = "planner"
    run(benchmark, planner.choose_plan, topology, p, 350 * 2**20, iterations=100)
