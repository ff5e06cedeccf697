"""A discrete-event simulation of the engine's own schedule on a modeled cluster.

Worked example
--------------
Four ranks on two nodes of two ranks each, flat ring ``Plan((4,))``, 8 MB of
float32, chunks of 1 MB.  ``build_schedule`` gives every rank 3 reduce-scatter steps and 3
allgather steps of one 2 MB block each; the simulator cuts each block into two
1 MB chunks, exactly as the engine does, and plays::

    t=0      r0..r3: block of step 0 is local data -> both chunks ready;
             r0->r1, r1->r2, r2->r3, r3->r0 each start chunk 0 (one message
             per connection at a time, in program order, like one MPI pair).
             r1->r2 and r3->r0 leave their node: they share nothing, but each
             crosses its node's NIC (links * bandwidth, shared by every
             message in flight through it) and pays the inter-node latency.
    t=c/bw   chunk 0 of every step-0 message has left; chunk 1 starts.
    t+lat    chunk 0 arrives; the receiver reduces it (bytes / reduce_rate,
             one reduction at a time per rank) and only then may it forward
             that same range as chunk 0 of step 1 -- the dependency the
             engine's pipelining exploits.
    ...      allgather steps copy instead of reduce (no compute time).

Per rank, per step, per chunk, every send is matched to its receive (same
phase, in order, as MPI matches a tag) and the ranges must agree; a send with
no receive, or a dependency that can never be met, raises ``ScheduleError``.
With ``verify=True`` the simulator also moves real data (unique int64 values
per rank and element) through the same events and checks that every rank ends
with the exact sum -- a misplaced range shows as a wrong element.

Network model (see ``ddlkernels.select.topology``): a message from ``a`` to ``b``
whose first common group is at level ``L`` crosses, for each level j <= L, the
level-j links of a's and b's level-(j-1) groups (egress and ingress, full
duplex), plus the level-L group's ``capacity`` if stated.  Messages in flight
share each such resource equally (``links * bandwidth / n``), and one message
never goes faster than ``min(bandwidth_j, j <= L)`` (it rides one link).
Rates are recomputed whenever a message starts or ends.  The level-L latency
is added to each message's arrival but does not hold the link (the next chunk
may start while the previous is in flight, as on a real NIC).  At a level
marked ``cpu_copy`` (host shared memory) the receiving rank's CPU does the
copy: the message also crosses that rank's CPU, which stops moving bytes while
the rank reduces.

Executor model: each rank runs a generator that follows ``_engine.execute``
line by line -- per phase, post the first step's sends; per reduce-scatter
step, ``window`` receive slots, wait / reduce / repost / forward per chunk;
per allgather, every receive posted up front, forward each chunk as it lands;
then wait for all sends before the next phase.  Messages above
``eager_bytes`` move only once their receive is posted (MPI rendezvous).
Each received chunk also costs its rank ``topology.chunk_overhead`` seconds
of CPU (the engine's own software per chunk, measured by ``calibrate``; 0 for
the presets), added to the reduction or, in an allgather, on its own.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from ..ring.schedule import Plan, build_schedule, chunk_ranges, rings as _rings
from ..select.topology import Topology

__all__ = ["simulate", "SimResult", "ScheduleError", "DEFAULT_CHUNK_BYTES"]

#: Chunk size (bytes) used when none is given: the engine's default pipelining unit.
DEFAULT_CHUNK_BYTES = 1 << 20
#: Receive slots per reduce-scatter step, as the engine's default.
DEFAULT_WINDOW = 4
#: Messages up to this size are sent eagerly (Open MPI's shared-memory and
#: InfiniBand eager limits are 4 KiB .. 12 KiB); larger ones wait for the receive.
DEFAULT_EAGER_BYTES = 4096


class ScheduleError(RuntimeError):
    """The schedule cannot run as written: unmatched messages, a deadlock, or wrong data."""


@dataclass
class SimResult:
    """What one simulated collective cost.

    ``time_s``      -- seconds from the start until the last rank is done.
    ``rank_end_s``  -- per rank, when its last receive completed (or its last send left).
    ``phase_end_s`` -- per phase, when its last receive completed on any rank.
    ``messages``    -- chunk messages sent; ``bytes_by_level[j]`` -- bytes of
                       messages whose first common group is level j+1.
    ``verified``    -- True when the data was moved and checked (``verify``).
    """

    time_s: float
    rank_end_s: list[float]
    phase_end_s: list[float]
    messages: int
    bytes_by_level: list[int]
    verified: bool
    dims: tuple[int, ...]
    chunk_bytes: int
    itemsize: int
    count: int
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "dims": list(self.dims),
            "time_s": self.time_s,
            "phase_end_s": self.phase_end_s,
            "messages": self.messages,
            "bytes_by_level": self.bytes_by_level,
            "verified": self.verified,
            "chunk_bytes": self.chunk_bytes,
            "itemsize": self.itemsize,
            "count": self.count,
        }


class _Network:
    """Flows sharing resources; bottleneck fair share, recomputed on every start and end."""

    def __init__(self, topo: Topology):
        self.topo = topo
        self.ids = topo.group_ids()
        self.cap: list[float] = []
        self.res_index: dict[tuple, int] = {}
        self.flows_on: list[set] = []
        self.path_cache: dict[tuple[int, int], tuple] = {}
        self.cpu_full: dict[int, float] = {}
        # flow state, indexed by flow id
        self.f_path: dict[int, tuple] = {}
        self.f_cap: dict[int, float] = {}
        self.f_rem: dict[int, float] = {}
        self.f_rate: dict[int, float] = {}
        self.f_last: dict[int, float] = {}
        self.f_ver: dict[int, int] = {}

    def _res(self, key, capacity) -> int:
        i = self.res_index.get(key)
        if i is None:
            i = self.res_index[key] = len(self.cap)
            self.cap.append(capacity)
            self.flows_on.append(set())
        return i

    def path(self, a: int, b: int):
        """(resources, per-message cap, latency, level) of a message a -> b."""
        key = (a, b)
        hit = self.path_cache.get(key)
        if hit is not None:
            return hit
        ids, levels = self.ids, self.topo.levels
        L = 1
        while ids[L][a] != ids[L][b]:
            L += 1
        res = []
        cap = float("inf")
        for j in range(1, L + 1):
            lv = levels[j - 1]
            c = lv.links * lv.bandwidth
            res.append(self._res(("E", j, ids[j - 1][a]), c))
            res.append(self._res(("I", j, ids[j - 1][b]), c))
            cap = min(cap, lv.bandwidth)
        top = levels[L - 1]
        if top.capacity is not None:
            res.append(self._res(("F", L, ids[L][a]), top.capacity))
        if top.cpu_copy:
            # The receiver's CPU performs the copy, one byte stream at a time
            # at the level's bandwidth; paused while that rank reduces.
            res.append(self.cpu(b, top.bandwidth))
        hit = (tuple(res), cap, top.latency, L)
        self.path_cache[key] = hit
        return hit

    def cpu(self, rank: int, bandwidth: float | None = None) -> int:
        i = self.res_index.get(("C", rank))
        if i is None:
            i = self._res(("C", rank), bandwidth)
            self.cpu_full[i] = bandwidth
        return i

    def set_capacity(self, i: int, cap: float, now: float, push) -> None:
        """Change a resource's capacity (0 pauses its flows) and re-rate the flows through it."""
        self._update(list(self.flows_on[i]), now, push, settle_only=True)
        self.cap[i] = cap
        self._update(list(self.flows_on[i]), now, push)

    def _rate(self, f: int) -> float:
        r = self.f_cap[f]
        cap, flows_on = self.cap, self.flows_on
        for i in self.f_path[f]:
            share = cap[i] / len(flows_on[i])
            if share < r:
                r = share
        return r

    def _update(self, flows, now, push, settle_only=False):
        for g in flows:
            rem = self.f_rem[g] - self.f_rate[g] * (now - self.f_last[g])
            self.f_rem[g] = rem if rem > 0 else 0.0
            self.f_last[g] = now
            if settle_only:
                continue
            rate = self._rate(g)
            if rate != self.f_rate[g] or g not in self.f_ver:
                self.f_rate[g] = rate
                v = self.f_ver.get(g, 0) + 1
                self.f_ver[g] = v
                if rate > 0:  # a paused flow gets its event when it is resumed
                    push(now + self.f_rem[g] / rate, g, v)

    def start(self, f: int, path, cap: float, nbytes: float, now: float, push):
        self.f_path[f] = path
        self.f_cap[f] = cap
        self.f_rem[f] = float(nbytes)
        self.f_rate[f] = 0.0
        self.f_last[f] = now
        affected = set()
        for i in path:
            self.flows_on[i].add(f)
            affected |= self.flows_on[i]
        self._update(affected, now, push)

    def finish(self, f: int, now: float, push):
        affected = set()
        for i in self.f_path[f]:
            s = self.flows_on[i]
            s.discard(f)
            affected |= s
        for d in (self.f_path, self.f_cap, self.f_rem, self.f_rate, self.f_last, self.f_ver):
            del d[f]
        self._update(affected, now, push)


class _Msg:
    """One chunk message: posted by an isend, matched to an irecv in order of (src, dst, tag)."""

    __slots__ = ("src", "dst", "tag", "a", "b", "recv", "arrived", "payload")

    def __init__(self, src, dst, tag, a, b):
        self.src, self.dst, self.tag, self.a, self.b = src, dst, tag, a, b
        self.recv = None
        self.arrived = None  # time the last byte reached the receiver (and the send completed)
        self.payload = None


class _Recv:
    __slots__ = ("rank", "src", "tag", "a", "b", "msg")

    def __init__(self, rank, src, tag, a, b):
        self.rank, self.src, self.tag, self.a, self.b = rank, src, tag, a, b
        self.msg = None


class _Sim:
    """The event loop: per-rank programs (generators mirroring ``_engine.execute``) over ``_Network``."""

    FLOW, ARRIVE, RESUME = 0, 1, 2

    def __init__(self, topo, p, itemsize, rrate, eager_bytes, verify, count):
        self.net = _Network(topo)
        self.cpu_copy = any(lv.cpu_copy for lv in topo.levels)
        if self.cpu_copy:
            bw = max(lv.bandwidth for lv in topo.levels if lv.cpu_copy)
            for r in range(p):
                self.net.cpu(r, bw)
        self.p = p
        self.itemsize = itemsize
        self.rrate = rrate
        self.overhead = topo.chunk_overhead  # CPU seconds per received chunk (Topology.chunk_overhead)
        self.eager = eager_bytes
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.unmatched_sends = defaultdict(deque)  # (src, dst, tag) -> msgs without a receive
        self.unmatched_recvs = defaultdict(deque)
        self.conn_queue = defaultdict(deque)  # (src, dst) -> msgs in posting order, not yet started
        self.conn_busy = defaultdict(bool)
        self.flows: dict[int, _Msg] = {}
        self.arriving: dict[int, _Msg] = {}
        self.nflows = 0
        self.progs: list = [None] * p
        self.waiting: list = [None] * p  # what each rank's program waits for
        self.rank_end = [0.0] * p
        self.messages = 0
        self.bytes_by_level = [0] * topo.depth
        self.verify = verify
        self.data = None
        if verify:
            base = np.arange(count, dtype=np.int64)
            self.data = [base + np.int64(r) * np.int64(count) * 7 + 1 for r in range(p)]

    # ---------------------------------------------------------------- events
    def push(self, t, kind, a, b=0):
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def _push_flow(self, t, f, v):
        self.push(t, self.FLOW, f, v)

    # ------------------------------------------------------------- MPI-like
    def isend(self, src, dst, tag, a, b) -> _Msg:
        m = _Msg(src, dst, tag, a, b)
        q = self.unmatched_recvs[(src, dst, tag)]
        if q:
            self._match(m, q.popleft())
        else:
            self.unmatched_sends[(src, dst, tag)].append(m)
        self.conn_queue[(src, dst)].append(m)
        self._try_start((src, dst))
        return m

    def irecv(self, rank, src, tag, a, b) -> _Recv:
        rq = _Recv(rank, src, tag, a, b)
        q = self.unmatched_sends[(src, rank, tag)]
        if q:
            m = q.popleft()
            self._match(m, rq)
            self._try_start((src, rank))
        else:
            self.unmatched_recvs[(src, rank, tag)].append(rq)
        return rq

    def _match(self, m: _Msg, rq: _Recv):
        if (m.a, m.b) != (rq.a, rq.b):
            raise ScheduleError(
                f"phase {m.tag}: rank {m.src} sends elements [{m.a}, {m.b}) to rank {m.dst}, "
                f"which receives that message into [{rq.a}, {rq.b})"
            )
        m.recv, rq.msg = rq, m

    def _try_start(self, c):
        """Start the next message of connection ``c`` if the wire is free and MPI may move it."""
        if self.conn_busy[c]:
            return
        q = self.conn_queue[c]
        if not q:
            return
        m = q[0]
        nb = (m.b - m.a) * self.itemsize
        # Rendezvous: a message above the eager limit moves only once its receive is posted.
        if m.recv is None and nb > self.eager:
            return
        q.popleft()
        self.conn_busy[c] = True
        path, cap, lat, L = self.net.path(m.src, m.dst)
        self.bytes_by_level[L - 1] += nb
        self.messages += 1
        if self.verify:
            m.payload = self.data[m.src][m.a : m.b].copy()
        self.nflows += 1
        fid = self.nflows  # never reused, so a stale event cannot match a newer flow
        self.flows[fid] = m
        if nb == 0:
            self.push(self.now, self.FLOW, fid, -1)
        else:
            self.net.start(fid, path, cap, nb, self.now, self._push_flow)

    def _flow_done(self, fid):
        m = self.flows.pop(fid)
        if fid in self.net.f_ver:
            self.net.finish(fid, self.now, self._push_flow)
        c = (m.src, m.dst)
        self.conn_busy[c] = False
        lat = self.net.path(m.src, m.dst)[2]
        m.arrived = self.now + lat
        self.arriving[fid] = m
        self.push(m.arrived, self.ARRIVE, fid)
        self._try_start(c)

    # ---------------------------------------------------------------- run
    def run(self, programs):
        for r, prog in enumerate(programs):
            self.progs[r] = prog
            self._advance(r)
        heap, pop = self.heap, heapq.heappop
        while heap:
            t, _, kind, a, b = pop(heap)
            self.now = t
            if kind == self.FLOW:
                if b != -1 and self.net.f_ver.get(a) != b:
                    continue  # superseded by a rate change
                self._flow_done(a)
            elif kind == self.ARRIVE:
                m = self.arriving.pop(a)
                self._check(m.dst)
                self._check(m.src)
            else:
                self.waiting[a] = None
                if self.cpu_copy:
                    i = self.net.cpu(a)
                    self.net.set_capacity(i, self.net.cpu_full[i], self.now, self._push_flow)
                self._advance(a)

    def _satisfied(self, r) -> bool:
        cond = self.waiting[r]
        if cond is None:
            return False
        kind = cond[0]
        if kind == "recv":
            m = cond[1].msg
            return m is not None and m.arrived is not None and m.arrived <= self.now
        if kind == "sends":
            lst, i = cond[1], cond[2]
            while i < len(lst) and lst[i].arrived is not None and lst[i].arrived <= self.now:
                i += 1
            cond[2] = i
            return i == len(lst)
        return False  # compute: resumed by its own event

    def _check(self, r):
        if self._satisfied(r):
            self.waiting[r] = None
            self._advance(r)

    def _advance(self, r):
        """Run rank r's program until it blocks on something not yet true."""
        prog = self.progs[r]
        if prog is None:
            return
        while True:
            try:
                cond = next(prog)
            except StopIteration:
                self.progs[r] = None
                if self.now > self.rank_end[r]:
                    self.rank_end[r] = self.now
                return
            if cond[0] == "compute":
                self.waiting[r] = cond
                self.push(self.now + cond[1], self.RESUME, r)
                if self.cpu_copy:  # the CPU reduces: copies into this rank wait
                    self.net.set_capacity(self.net.cpu(r), 0.0, self.now, self._push_flow)
                return
            if cond[0] == "sends":
                cond = ["sends", cond[1], 0]
            self.waiting[r] = cond
            if not self._satisfied(r):
                return
            self.waiting[r] = None


def _program(sim: _Sim, r: int, sched, ce: int, window: int, phase_end: list):
    """Rank r's part of the collective, step for step the code of ``_engine.execute``.

    Yields what the engine would block on: ("recv", req) for ``req.Wait()``,
    ("compute", seconds) for a reduction kernel, ("sends", msgs) for the
    ``_wait_all(sends)`` that closes each phase.
    """
    isz = sim.itemsize
    data = sim.data
    for ring in _rings(sched.steps):
        tag = ring[0].phase
        nxt, prv = ring[0].send_peer, ring[0].recv_peer
        for st in ring:
            if (st.send_peer, st.recv_peer) != (nxt, prv):
                raise ScheduleError(f"rank {r} phase {tag}: step {st.step} changes ring neighbours, which the engine does not support")
        for s in range(1, len(ring)):
            # The engine forwards what it received at step s-1 as step s's send:
            # the schedule must say the same, or the engine sends the wrong block.
            if ring[s].send != ring[s - 1].recv:
                raise ScheduleError(
                    f"rank {r} phase {tag}: step {s} sends {ring[s].send} but step {s - 1} received {ring[s - 1].recv}; "
                    "the engine forwards the block it just received"
                )
        sends = [sim.isend(r, nxt, tag, a, b) for a, b in chunk_ranges(*ring[0].send, ce)]
        last = len(ring) - 1
        if ring[0].reduce:
            for s, st in enumerate(ring):
                pieces = chunk_ranges(*st.recv, ce)
                reqs = [sim.irecv(r, prv, tag, a, b) for a, b in pieces[:window]]
                for k, (a, b) in enumerate(pieces):
                    rq = reqs[k]
                    yield ("recv", rq)
                    yield ("compute", (b - a) * isz / sim.rrate + sim.overhead)
                    if data is not None:
                        data[r][a:b] += rq.msg.payload
                        rq.msg.payload = None
                    if k + window < len(pieces):
                        reqs.append(sim.irecv(r, prv, tag, *pieces[k + window]))
                    if s != last:
                        sends.append(sim.isend(r, nxt, tag, a, b))
        else:
            posted = [[sim.irecv(r, prv, tag, a, b) for a, b in chunk_ranges(*st.recv, ce)] for st in ring]
            for s, reqs in enumerate(posted):
                for rq in reqs:
                    yield ("recv", rq)
                    if sim.overhead:
                        yield ("compute", sim.overhead)
                    if data is not None:
                        data[r][rq.a : rq.b] = rq.msg.payload
                        rq.msg.payload = None
                    if s != last:
                        sends.append(sim.isend(r, nxt, tag, rq.a, rq.b))
        yield ("sends", sends)
        if sim.now > phase_end[tag]:
            phase_end[tag] = sim.now


def simulate(
    topology: Topology,
    plan,
    nbytes: int,
    *,
    itemsize: int = 4,
    chunk_bytes: int | None = None,
    reduce_rate: float | None = None,
    window: int | None = None,
    eager_bytes: int = DEFAULT_EAGER_BYTES,
    verify: bool | None = None,
    schedules=None,
) -> SimResult:
    """Simulate one allreduce of ``nbytes`` bytes (``nbytes // itemsize`` elements) under ``plan``.

    ``plan``        -- a ``Plan`` or a dims tuple (identity order).
    ``chunk_bytes`` -- the engine's pipelining unit in bytes (default 1 MiB, as the engine).
    ``reduce_rate`` -- bytes/s one rank reduces; default the topology's.
    ``window``      -- receive slots per reduce-scatter step (default 4, as the engine).
    ``eager_bytes`` -- messages up to this size move before their receive is
                       posted; larger ones wait for it (MPI's rendezvous).
    ``verify``      -- move real data and check the sums; default: only when
                       ranks * elements <= 2**22.
    ``schedules``   -- per-rank schedules to run instead of ``build_schedule``'s
                       (tests inject faulty ones).
    """
    if not isinstance(plan, Plan):
        plan = Plan(tuple(int(d) for d in plan))
    p = plan.size
    if p != topology.ranks:
        raise ValueError(f"plan {plan.dims} has {p} ranks but topology {topology.name} has {topology.ranks}")
    if nbytes < 0 or itemsize < 1:
        raise ValueError(f"nbytes must be >= 0 and itemsize >= 1, got {nbytes}, {itemsize}")
    count = nbytes // itemsize
    chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
    if chunk_bytes < itemsize:
        raise ValueError(f"chunk_bytes must be >= itemsize ({itemsize}), got {chunk_bytes}")
    window = DEFAULT_WINDOW if window is None else int(window)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    rrate = topology.reduce_rate if reduce_rate is None else float(reduce_rate)
    if not rrate > 0:
        raise ValueError(f"reduce_rate must be > 0, got {rrate}")
    if verify is None:
        verify = p * count <= (1 << 22)
    if schedules is None:
        schedules = [build_schedule(count, plan, r) for r in range(p)]
    if len(schedules) != p:
        raise ValueError(f"need {p} schedules, got {len(schedules)}")
    nphases = max((s.phases for s in schedules), default=0)
    sim = _Sim(topology, p, itemsize, rrate, eager_bytes, verify, count)
    phase_end = [0.0] * nphases
    sim.run([_program(sim, r, schedules[r], chunk_bytes // itemsize, window, phase_end) for r in range(p)])

    stuck = [r for r in range(p) if sim.progs[r] is not None]
    if stuck:
        r = stuck[0]
        cond = sim.waiting[r]
        what = f"a receive from rank {cond[1].src} of elements [{cond[1].a}, {cond[1].b}) in phase {cond[1].tag}" if cond and cond[0] == "recv" else "its sends to complete"
        raise ScheduleError(f"deadlock: {len(stuck)} ranks never finish; rank {r} waits for {what}")
    leftover = [m for q in sim.unmatched_sends.values() for m in q]
    if leftover:
        m = leftover[0]
        raise ScheduleError(f"phase {m.tag}: rank {m.src} sent elements [{m.a}, {m.b}) to rank {m.dst}, which never receives them")
    verified = False
    if verify:
        want = np.zeros(count, dtype=np.int64)
        base = np.arange(count, dtype=np.int64)
        for r in range(p):
            want += base + np.int64(r) * np.int64(count) * 7 + 1
        for r in range(p):
            bad = np.flatnonzero(sim.data[r] != want)
            if bad.size:
                i = int(bad[0])
                raise ScheduleError(f"wrong data: rank {r} element {i} is {int(sim.data[r][i])}, the sum over ranks is {int(want[i])}")
        verified = True
    return SimResult(
        time_s=max(sim.rank_end, default=0.0),
        rank_end_s=sim.rank_end,
        phase_end_s=phase_end,
        messages=sim.messages,
        bytes_by_level=sim.bytes_by_level,
        verified=verified,
        dims=plan.dims,
        chunk_bytes=chunk_bytes,
        itemsize=itemsize,
        count=count,
    )
