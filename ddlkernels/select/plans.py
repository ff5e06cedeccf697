"""The ring's plans of one Communicator: which box and rank order a call uses, and the schedules and shards
that follow from them, cached.

Worked example, 8 ranks on 2 nodes of 4, a 64 MiB allreduce::

    plan(64 MiB)            the planner costs (8,), (2, 4), (4, 2), (2, 2, 2) on the
                            topology and keeps the fastest, say (4, 2): rings of 4
                            inside each node, then of 2 across
    schedule(count, plan)   this rank's steps of that box (ddlkernels.ring.schedule)
    all_shards(count)       every rank's reduce_scatter shard, on the box the
                            planner chooses for 1 GiB, whatever the call's size,
                            so that shard_range(count) never depends on the dtype
"""

from __future__ import annotations

from ..ring.schedule import Plan, build_schedule, shard_bounds, validate_dims
from .planner import _bucket, choose_plan

__all__ = ["Plans", "SHARD_PLAN_BYTES"]

#: The size the box of reduce_scatter and allgather is planned for: the two halves are used on large buffers
#: (sharded optimizers), and a box that changed with the dtype's size would make ``shard_range`` ambiguous.
SHARD_PLAN_BYTES = 1 << 30


class Plans:
    """The plans, schedules and shard bounds of a communicator of ``size`` ranks (this one ``rank``) laid out
    as ``topology`` (ring order ``order``), for pipeline chunks of ``chunk_bytes``."""

    def __init__(self, size, rank, topology, order, chunk_bytes):
        self.size, self.rank, self.topology, self.order, self.chunk_bytes = size, rank, topology, order, chunk_bytes
        self._plans: dict = {}
        self._shards: dict = {}
        self._schedules: dict = {}

    def plan(self, nbytes: int = 0, dims=None) -> Plan:
        """The box and rank order of a collective of ``nbytes`` bytes: ``dims`` as given, else the planner's
        choice for the size (``ddlkernels.select.planner``)."""
        key = tuple(dims) if dims is not None else _bucket(nbytes)
        plan = self._plans.get(key)
        if plan is None:
            if dims is not None:
                plan = Plan(validate_dims(dims, self.size), self.order)
            else:
                plan = choose_plan(self.topology, self.size, nbytes, chunk_bytes=self.chunk_bytes)[0]
            if len(self._plans) >= 1024:  # a job with ever new box arguments must not grow this without bound
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def shard_plan(self, dims):
        """The box of reduce_scatter / allgather: fixed per communicator, so that shards depend on ``count`` only."""
        return self.plan(0, dims) if dims is not None else self.plan(SHARD_PLAN_BYTES)

    def all_shards(self, count: int, dims):
        """Every rank's ``shard_range(count, dims)``, cached: a small reduce_scatter or allgather pays for it once."""
        key = (count, None if dims is None else tuple(dims))
        hit = self._shards.get(key)
        if hit is None:
            plan = self.shard_plan(dims)
            if len(self._shards) >= 1024:
                self._shards.clear()
            hit = self._shards[key] = [shard_bounds(count, plan.dims, plan.index_of(r)) for r in range(self.size)]
        return hit

    def shard_range(self, count: int, dims=None, rank=None) -> tuple[int, int]:
        plan = self.shard_plan(dims)
        return shard_bounds(count, plan.dims, plan.index_of(self.rank if rank is None else rank))

    def rank_ordered(self, count) -> bool:
        """Whether the shards of ``count`` elements lie in rank order, as MPI's own collectives place blocks."""
        b = self.all_shards(count, None)
        return all(b[r][1] == b[r + 1][0] for r in range(self.size - 1))

    def schedule(self, count, plan, kind):
        """This rank's schedule of ``kind`` ("ar", "rs" or "ag") for ``count`` elements on ``plan``."""
        key = (count, plan, kind)
        s = self._schedules.get(key)
        if s is None:
            if len(self._schedules) > 256:
                self._schedules.clear()
            s = build_schedule(count, plan, self.rank, reduce_scatter=kind != "ag", allgather=kind != "rs")
            self._schedules[key] = s
        return s

    def __len__(self):
        """How many plans and schedules are cached (a soak test's bound)."""
        return len(self._plans) + len(self._schedules)
