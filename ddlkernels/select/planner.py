"""Choose the box (d1, ..., dk) and the rank order of a multi-dimensional ring from the topology.

Worked example
--------------
``powerai-ddl`` (4 GPUs x 16 nodes x 4 racks), 256 ranks, 350 MB::

    candidate        what it is                        modeled cost
    (256,)           flat ring                         every step crosses a NIC-limited
                                                        ring at 9.5 GB/s, 510 latencies
    (4, 64)          2-level: node x rest              NVLink phase, then 4 rings share
                                                        each NIC (2.5 GB/s each)
    (4, 16, 4)       one dimension per level           as above + a small rack phase
    (64, 4)          merged: node+rack, then racks     one ring per rack at 10 GB/s,
                                                        then 4 tiny rings across racks
    (2, 2, 16, 4)    a level split                     ...

Every ordered factorization of p (with at most ``depth + 2`` factors) is a
candidate; the rank order is the topology order (``Topology.topology_order``:
ranks sorted rack, node, GPU), so dimension 1's rings stay inside the
innermost groups and every ring walks the tree the way the paper's figure 1
does (each link used once per direction).  Each candidate is costed with the
alpha-beta model of ``docs/planner.md``:

    T = sum over dimensions i, for reduce-scatter and allgather:
        (d_i - 1) * max(m_i / r_i, a_i + c * (1/r_i + 1/R)) + [m_i > c] (a_i + c / r_i)

where ``m_i`` is the block one rank sends per step of dimension i (N / (d1 ...
di)), ``r_i`` the slowest ring edge's rate once every ring of that dimension
shares the links it crosses (``links * bandwidth / n`` per group, never more
than one link), ``a_i`` the mean latency of the ring's edges (the pipeline's
critical path walks around the ring, one edge per step), ``c`` the pipeline
chunk and ``R`` the reduction rate (reduce-scatter only; in the allgather the
``1/R`` term is absent).

Edge rates depend only on (stride, d) of a dimension, not on the message
size, so they are computed once per topology (vectorised over ranks) and each
call of ``choose_plan`` only evaluates the formula: planning 256 ranks costs a
few ms the first time and microseconds from the cache after.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ..ring.schedule import Plan
from .topology import Topology

__all__ = ["choose_plan", "candidates", "model_time", "lower_bound", "factorizations", "DEFAULT_CHUNK_BYTES"]

DEFAULT_CHUNK_BYTES = 1 << 20


def factorizations(p: int, max_factors: int | None = None) -> list[tuple[int, ...]]:
    """Every ordered factorization of ``p`` into factors >= 2 (``(1,)`` for p = 1)."""
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    if p == 1:
        return [(1,)]
    out: list[tuple[int, ...]] = []

    def rec(rest, prefix):
        if rest == 1:
            out.append(tuple(prefix))
            return
        if max_factors is not None and len(prefix) >= max_factors:
            return
        for d in range(2, rest + 1):
            if rest % d == 0:
                prefix.append(d)
                rec(rest // d, prefix)
                prefix.pop()

    rec(p, [])
    return out


class _Model:
    """Per-topology cache: group ids as arrays and the edge classes of every (stride, d)."""

    def __init__(self, topo: Topology, order=None):
        self.topo = topo
        self.p = topo.ranks
        self.order = np.array(topo.topology_order() if order is None else order, dtype=np.int64)
        self.gid = [np.asarray(g, dtype=np.int64) for g in topo.group_ids()]
        lv = topo.levels
        self.K = len(lv)
        self.bw = np.array([l.bandwidth for l in lv])
        self.cap = np.array([l.links * l.bandwidth for l in lv])
        self.lat = np.array([l.latency for l in lv])
        self.edge_cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def edges(self, stride: int, d: int):
        """(mean latency, max latency, min rate, mean 1/rate) over the ring edges of a dimension (stride, d)."""
        key = (stride, d)
        hit = self.edge_cache.get(key)
        if hit is not None:
            return hit
        p, gid, K = self.p, self.gid, self.K
        idx = np.arange(p)
        c = (idx // stride) % d
        nidx = idx + stride * np.where(c == d - 1, 1 - d, 1)
        src, dst = self.order[idx], self.order[nidx]
        L = np.ones(p, dtype=np.int64)
        for j in range(1, K):
            L += gid[j][src] != gid[j][dst]
        rate = np.full(p, np.inf)
        for j in range(1, K + 1):
            use = L >= j
            if not use.any():
                break
            gs, gd = gid[j - 1][src], gid[j - 1][dst]
            n_out = np.bincount(gs[use], minlength=gs.max() + 1)
            n_in = np.bincount(gd[use], minlength=gd.max() + 1)
            share = self.cap[j - 1] / np.maximum(np.maximum(n_out[gs], n_in[gd]), 1)
            rate = np.where(use, np.minimum(rate, np.minimum(share, self.bw[j - 1])), rate)
        for j in range(1, K + 1):
            capf = self.topo.levels[j - 1].capacity
            if capf is None:
                continue
            use = L == j
            if use.any():
                g = gid[j][src]
                n = np.bincount(g[use], minlength=g.max() + 1)
                rate = np.where(use, np.minimum(rate, capf / np.maximum(n[g], 1)), rate)
        alpha = self.lat[L - 1]
        # The bandwidth term follows the slowest edge; the latency chain of a
        # pipelined ring walks backwards around it, one edge per step, so it
        # pays the edges' mean latency (rings of one dimension are alike).
        hit = (float(alpha.mean()), float(alpha.max()), float(rate.min()), float(np.mean(1.0 / rate)))
        self.edge_cache[key] = hit
        return hit

    def time(self, dims, nbytes: float, chunk: float, R: float) -> float:
        t = 0.0
        stride = 1
        n = float(nbytes)
        for d in dims:
            if d > 1:
                a_mean, a_max, r_min, inv_r = self.edges(stride, d)
                m = n / d
                c = min(chunk, m)
                rs = max(m / min(r_min, R), a_mean + c * (inv_r + 1.0 / R))
                ag = max(m / r_min, a_mean + c * inv_r)
                # With more than one chunk per step, the first chunk of the
                # first step fills the pipeline before the links are all busy.
                fill = a_mean + c * inv_r if m > c else 0.0
                t += (d - 1) * (rs + ag) + 2 * fill
                n = m
            stride *= d
        return float(t)


@lru_cache(maxsize=32)
def _model(topo: Topology) -> _Model:
    return _Model(topo)


def _topology_for(topology: Topology, p: int) -> Topology:
    if p == topology.ranks:
        return topology
    return topology.subset(p)


def candidates(topology: Topology, p: int | None = None) -> list[tuple[int, ...]]:
    """The boxes the planner compares: ordered factorizations of p with at most depth + 2 factors.

    They include the flat ring (p,), one dimension per level (the fan-outs),
    merged levels (products of adjacent fan-outs) and split levels (a fan-out
    cut in two) whenever p allows them.
    """
    topo = _topology_for(topology, topology.ranks if p is None else p)
    return _candidates(topo.ranks, topo.depth)


@lru_cache(maxsize=64)
def _candidates(p: int, depth: int):
    return factorizations(p, max_factors=depth + 2)


def model_time(topology: Topology, dims, nbytes: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, reduce_rate: float | None = None, order=None) -> float:
    """Modeled seconds of an allreduce of ``nbytes`` bytes on box ``dims``.

    ``order`` (``order[box index] = rank``) defaults to the topology order;
    another order builds a fresh model (not cached: for studies, not for planning).
    """
    dims = tuple(int(d) for d in dims)
    topo = _topology_for(topology, math.prod(dims))
    R = topo.reduce_rate if reduce_rate is None else reduce_rate
    model = _model(topo) if order is None else _Model(topo, order)
    return model.time(dims, nbytes, chunk_bytes, R)


def lower_bound(topology: Topology, nbytes: int) -> float:
    """The alpha-beta lower bound of an allreduce of ``nbytes`` bytes on ``topology`` (seconds).

    For each level j, the G level-(j-1) groups (ranks, nodes, racks, ...)
    together must receive at least 2 (G - 1) N bytes (every element's G
    contributions must meet and the result reach all G groups: 2 (G - 1)
    one-way transfers), through G ingress pipes of ``links * bandwidth``: at
    least 2 (G - 1) / G * N / (links * bandwidth).  A top-level ``capacity``
    carries all of it.  Add the least latency: one message must cross the top
    level.  See docs/planner.md for the derivation.
    """
    p = topology.ranks
    if p == 1 or nbytes <= 0:
        return 0.0
    ids = topology.group_ids()
    bw_bound = 0.0
    top = 0
    for j, lv in enumerate(topology.levels, start=1):
        G = len(set(ids[j - 1]))
        n_top = len(set(ids[j]))
        if G > n_top:  # some level-j group has more than one member: this level is crossed
            top = j
        if G > 1:
            bw_bound = max(bw_bound, 2 * (G - 1) / G * nbytes / (lv.links * lv.bandwidth))
    last = topology.levels[-1]
    if last.capacity is not None and len(set(ids[topology.depth - 1])) > 1:
        G = len(set(ids[topology.depth - 1]))
        bw_bound = max(bw_bound, 2 * (G - 1) * nbytes / last.capacity)
    return bw_bound + (topology.levels[top - 1].latency if top else 0.0)


_PLAN_CACHE: dict = {}


def _bucket(nbytes: int) -> int:
    """Size bucket for the plan cache: a quarter-octave, so plans are reused across nearby sizes."""
    if nbytes <= 0:
        return 0
    return int(round(4 * math.log2(nbytes)))


def choose_plan(topology: Topology, p: int, nbytes: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, reduce_rate: float | None = None, top: int = 8):
    """Pick the box and rank order that minimise the modeled time of an allreduce of ``nbytes`` bytes over ``p`` ranks.

    Returns ``(plan, info)``: ``plan`` is a ``Plan`` whose ``order`` follows the
    topology (``order[box index] = rank``); ``info`` holds ``dims``,
    ``time_s`` (modeled seconds), ``lower_bound_s``, ``candidates`` (how
    many boxes were costed) and ``alternatives`` (the ``top`` best, each
    ``{"dims", "time_s"}``, best first), plus the flat ring's modeled time.
    Results are cached per (topology, p, size bucket, chunk).
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a ddlkernels.select.topology.Topology, got {type(topology).__name__}")
    if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 1:
        raise ValueError(f"p must be a positive int, got {p!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    key = (topology, int(p), _bucket(nbytes), chunk_bytes, reduce_rate, top)
    hit = _PLAN_CACHE.get(key)
    if hit is not None:
        return hit
    topo = _topology_for(topology, int(p))
    model = _model(topo)
    R = topo.reduce_rate if reduce_rate is None else reduce_rate
    size = max(int(nbytes), 1)
    scored = sorted((model.time(c, size, chunk_bytes, R), len(c), c) for c in _candidates(topo.ranks, topo.depth))
    # Among boxes the model cannot tell apart (within 0.1 %), take the one with
    # the fewest dimensions: each phase ends with a wait the model does not see.
    near = [s for s in scored if s[0] <= scored[0][0] * (1 + 1e-3)]
    best_t, _, best = min(near, key=lambda s: (s[1], s[0]))
    scored.remove((best_t, len(best), best))
    scored.insert(0, (best_t, len(best), best))
    order = tuple(int(r) for r in model.order)
    plan = Plan(best, order)
    info = {
        "dims": list(best),
        # Rings always follow the topology order; for presets and jobs whose
        # ranks are numbered inside out that order is the identity.
        "order": "topology (identity)" if plan.order is None else "topology",
        "time_s": best_t,
        "lower_bound_s": lower_bound(topo, nbytes),
        "candidates": len(scored),
        "alternatives": [{"dims": list(c), "time_s": t} for t, _, c in scored[:top]],
        "flat_time_s": model.time((topo.ranks,), size, chunk_bytes, R),
        "topology": topo.name,
        "ranks": topo.ranks,
        "bytes": int(nbytes),
    }
    if len(_PLAN_CACHE) > 4096:
        _PLAN_CACHE.clear()
    _PLAN_CACHE[key] = (plan, info)
    return plan, info
