"""The multi-dimensional ring schedule: pure data, no MPI.

Worked example
--------------
Six ranks arranged as a 2 x 3 box (``dims = (2, 3)``); dimension 1 varies
fastest, so with the identity order rank ``r`` has coordinates
``(r % 2, r // 2)``::

        c2 = 0      c2 = 1      c2 = 2
    c1=0  r0 <--------r2 <--------r4          dimension-2 rings run
          ^|          ^|          ^|          along the rows (3 ranks),
          |v          |v          |v          dimension-1 rings along the
    c1=1  r1 <--------r3 <--------r5          columns (2 ranks).

A buffer of n = 12 elements, every rank holding its own copy ``x_r``:

1. ReduceScatter along dimension 1 (rings {r0,r1}, {r2,r3}, {r4,r5}).
   The buffer is cut into d1 = 2 blocks, A = [0, 6) and B = [6, 12).  In one
   step each rank sends the block it will *not* own and reduces the one it
   receives: after it, r0 holds A summed over {r0, r1}, r1 holds B summed
   over {r0, r1}.  Each rank moved n/2 elements over the fast link.

2. ReduceScatter along dimension 2 (rings {r0,r2,r4}, {r1,r3,r5}), on the
   half each rank now owns.  r0, r2, r4 all own A = [0, 6); it is cut into
   d2 = 3 blocks A0 = [0, 2), A1 = [2, 4), A2 = [4, 6) and a plain ring
   reduce-scatter runs in 2 steps: r0 ends with A0 summed over all six
   ranks, r2 with A1, r4 with A2.  Each rank moved 2 * n/6 elements over
   the slower link: the deeper the dimension, the less data it carries.

3. AllGather along dimension 2, then along dimension 1: the same rings in
   reverse order, copying instead of reducing.  Every rank ends with the
   whole reduced buffer, and every element was reduced on exactly one rank
   (its owner) and copied everywhere else, so all ranks hold identical bits.

A plain ring reduce-scatter over ring positions 0..d-1 (position q sends to
q+1 and receives from q-1) runs d-1 steps; at step s position q sends block
(q - s - 1) mod d and receives and reduces block (q - s - 2) mod d, so that it
ends owning block q.  The allgather that follows sends block (q - s) mod d and
receives block (q - s - 1) mod d.  The block a rank receives at step s is the
one it sends at step s + 1, which lets an executor forward a chunk as soon as
it has been reduced (or received) instead of waiting for the whole step.

Shards
------
A rank's final shard is found by cutting [0, n) into d1 balanced blocks, the
block of its c1 into d2 balanced blocks, and so on (``shard_bounds``).  For
the flat ring ``(p,)`` this is the usual "rank r owns block r" of
``MPI_Reduce_scatter_block``; for a box it is the nested cut, which keeps
every range contiguous.  Balanced means: the first ``n % d`` blocks have one
element more than the others, so blocks of one cut differ by at most one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "Plan",
    "Step",
    "Schedule",
    "split",
    "coords",
    "shard_bounds",
    "build_schedule",
    "chunk_ranges",
    "rings",
    "validate_dims",
]

REDUCE_SCATTER = "reduce_scatter"
ALLGATHER = "allgather"


def validate_dims(dims: Sequence[int], size: int) -> tuple[int, ...]:
    """Return ``dims`` as a tuple of ints after checking that it describes a box of ``size`` ranks."""
    try:
        out = tuple(int(d) for d in dims)
    except TypeError:
        raise TypeError(f"dims must be a sequence of positive ints, got {dims!r}") from None
    if any(int(d) != d for d in dims):
        raise TypeError(f"dims must be a sequence of positive ints, got {dims!r}")
    if not out or any(d < 1 for d in out):
        raise ValueError(f"dims must be a non-empty sequence of positive ints, got {dims!r}")
    prod = 1
    for d in out:
        prod *= d
    if prod != size:
        raise ValueError(f"dims {out} describe {prod} ranks but the communicator has {size}")
    return out


@dataclass(frozen=True)
class Plan:
    """The shape of one collective: a box of ranks and the order they fill it in.

    ``dims``  -- sizes d1, ..., dk of the box; dimension 1 (the first) is the
                 innermost: its rings should run over the fastest links.
    ``order`` -- ``order[i]`` is the communicator rank placed at box index
                 ``i = c1 + d1 * (c2 + d2 * (c3 + ...))``; ``None`` is the
                 identity.  Ring order inside every dimension follows it.
    """

    dims: tuple[int, ...]
    order: tuple[int, ...] | None = None

    def __post_init__(self):
        dims = tuple(self.dims)
        if not dims or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in dims):
            raise ValueError(f"dims must be a non-empty tuple of positive ints, got {self.dims!r}")
        object.__setattr__(self, "dims", dims)
        if self.order is not None:
            order = tuple(int(r) for r in self.order)
            if sorted(order) != list(range(self.size)):
                raise ValueError(f"order must be a permutation of range({self.size}), got {order}")
            if order == tuple(range(self.size)):
                order = None
            object.__setattr__(self, "order", order)

    @property
    def size(self) -> int:
        return _prod(self.dims)

    def rank_at(self, index: int) -> int:
        """Communicator rank at box index ``index``."""
        return index if self.order is None else self.order[index]

    def index_of(self, rank: int) -> int:
        """Box index of communicator rank ``rank``."""
        return rank if self.order is None else self.order.index(rank)


def _prod(xs: Sequence[int]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def split(start: int, stop: int, parts: int, i: int) -> tuple[int, int]:
    """The ``i``-th of ``parts`` balanced blocks of ``[start, stop)``.

    The first ``(stop - start) % parts`` blocks hold one element more.
    """
    n = stop - start
    q, r = divmod(n, parts)
    lo = start + i * q + min(i, r)
    return lo, lo + q + (1 if i < r else 0)


def coords(index: int, dims: Sequence[int]) -> tuple[int, ...]:
    """Coordinates (c1, ..., ck) of box index ``index``; c1 varies fastest."""
    out = []
    for d in dims:
        index, c = divmod(index, d)
        out.append(c)
    return tuple(out)


def _index(c: Sequence[int], dims: Sequence[int]) -> int:
    i = 0
    for ci, d in zip(reversed(c), reversed(dims)):
        i = i * d + ci
    return i


def shard_bounds(count: int, dims: Sequence[int], index: int) -> tuple[int, int]:
    """``(start, stop)`` of the shard owned by box index ``index`` after the reduce-scatter.

    ``count`` is the number of elements of the whole buffer.  The public entry
    point is ``ddlkernels.shard_range``, which maps a communicator rank to its
    box index through the plan in use.
    """
    lo, hi = 0, count
    for c, d in zip(coords(index, dims), dims):
        lo, hi = split(lo, hi, d, c)
    return lo, hi


@dataclass(frozen=True)
class Step:
    """One ring step of one rank: send one range to ``send_peer``, receive one from ``recv_peer``.

    Ranges are ``(start, stop)`` element offsets into the whole buffer.  When
    ``reduce`` is true the received range is combined with the local one
    (reduce-scatter); otherwise it overwrites it (allgather).  ``phase`` counts
    the phases of the collective (one per dimension and direction) and is
    used as the message tag, so messages of different phases never match.
    """

    phase: int
    kind: str
    dim: int
    step: int
    send_peer: int
    recv_peer: int
    send: tuple[int, int]
    recv: tuple[int, int]
    reduce: bool


@dataclass(frozen=True)
class Schedule:
    """Everything one rank does in one collective, in order."""

    count: int
    plan: Plan
    rank: int
    steps: tuple[Step, ...]
    shard: tuple[int, int]

    @property
    def phases(self) -> int:
        return 1 + max((s.phase for s in self.steps), default=-1)


def _ring_steps(rank, index, plan, dim, lo, hi, phase, kind):
    dims = plan.dims
    d = dims[dim]
    c = list(coords(index, dims))
    q = c[dim]
    c[dim] = (q + 1) % d
    nxt = plan.rank_at(_index(c, dims))
    c[dim] = (q - 1) % d
    prv = plan.rank_at(_index(c, dims))
    steps = []
    for s in range(d - 1):
        if kind == REDUCE_SCATTER:
            sb, rb = (q - s - 1) % d, (q - s - 2) % d
        else:
            sb, rb = (q - s) % d, (q - s - 1) % d
        steps.append(
            Step(
                phase=phase,
                kind=kind,
                dim=dim,
                step=s,
                send_peer=nxt,
                recv_peer=prv,
                send=split(lo, hi, d, sb),
                recv=split(lo, hi, d, rb),
                reduce=kind == REDUCE_SCATTER,
            )
        )
    return steps


def build_schedule(count: int, plan: Plan, rank: int, *, reduce_scatter: bool = True, allgather: bool = True) -> Schedule:
    """The steps communicator rank ``rank`` runs for a collective over ``count`` elements.

    ``reduce_scatter`` and ``allgather`` select the two halves, so that the
    same function describes ``allreduce`` (both), ``reduce_scatter`` and
    ``allgather``.  Dimensions of size 1 contribute no steps.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not 0 <= rank < plan.size:
        raise ValueError(f"rank {rank} outside a plan of {plan.size} ranks")
    dims = plan.dims
    index = plan.index_of(rank)
    c = coords(index, dims)
    # The range this rank owns before each dimension's reduce-scatter.
    bounds = [(0, count)]
    for ci, d in zip(c, dims):
        bounds.append(split(*bounds[-1], d, ci))
    steps: list[Step] = []
    phase = 0
    if reduce_scatter:
        for dim, d in enumerate(dims):
            if d > 1:
                steps += _ring_steps(rank, index, plan, dim, *bounds[dim], phase, REDUCE_SCATTER)
                phase += 1
    if allgather:
        for dim in reversed(range(len(dims))):
            if dims[dim] > 1:
                steps += _ring_steps(rank, index, plan, dim, *bounds[dim], phase, ALLGATHER)
                phase += 1
    return Schedule(count=count, plan=plan, rank=rank, steps=tuple(steps), shard=bounds[-1])


def rings(steps) -> list[list[Step]]:
    """Split a schedule's steps into its rings: consecutive runs with one phase number.

    Every executor (the MPI engine, the simulator) walks a schedule ring by
    ring, because a ring's sends complete before the next ring may touch the
    blocks they read.
    """
    out: list[list[Step]] = []
    cur: list[Step] = []
    for st in steps:
        if cur and st.phase != cur[0].phase:
            out.append(cur)
            cur = []
        cur.append(st)
    if cur:
        out.append(cur)
    return out


def chunk_ranges(start: int, stop: int, chunk: int) -> list[tuple[int, int]]:
    """Cut ``[start, stop)`` into consecutive pieces of at most ``chunk`` elements (none if empty)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 element, got {chunk}")
    return [(a, min(a + chunk, stop)) for a in range(start, stop, chunk)]
