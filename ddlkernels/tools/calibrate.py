"""Measure the running job's links and write a topology file the planner and simulator can use.

Worked example
--------------
``mpirun -n 4 python -m ddlkernels calibrate --out here.json`` on one 2-core
machine finds one level (all 4 ranks share memory) and measures, in order:

1. latency and bandwidth of that level: ranks 0 and 1 ping-pong messages of
   8 B .. 16 MiB while the others sleep (``Ibarrier`` + ``sleep`` polling, so
   idle ranks do not steal the cores); one-way time t(n) = RTT / 2, latency =
   t(8 B), bandwidth = 1 / slope of t over the sizes >= 256 KiB;
2. what the level carries when everyone talks at once: every rank
   ``Sendrecv``-s 64 MiB in 1 MiB chunks around a ring inside its group; if the groups move
   less than (members x bandwidth), the measured total becomes the level's
   ``capacity`` (on a node: the memory bus and the cores shared by the copies);
   on higher levels, the number of ``links`` leaving a group is how many
   single-message bandwidths the group's members reach together;
3. whether the level's bytes move while the receiver computes: rank 1 posts
   a 16 MiB receive, computes for three transfer times, then waits; a wait
   that still takes most of a transfer means the receiver's CPU does the copy
   (``cpu_copy``, host shared memory), a short one means a DMA engine did;
4. the reduction rate: every rank at once computes ``out = src + slot`` over a
   64 MiB float32 buffer in 1 MiB chunks with numpy, the engine's pattern,
   bytes of result per second per rank.

On a cluster, step 1 and 2 repeat for each level with a pair of ranks whose
first common group is that level (same node, other node in the rack, other
rack), so nothing assumes a single level.  The structure comes from
``topology.detect`` (or from ``structure``, a topology file whose placement
stands in for the real one, e.g. to treat ranks 0-1 and 2-3 as two nodes).
"""

from __future__ import annotations

import time

import numpy as np

from ..algorithms.hier import node_split
from ..select.topology import Level, Topology, detect, _replace

__all__ = ["calibrate", "pingpong", "fit_alpha_beta"]

DEFAULT_SIZES = (8, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def _idle_wait(comm):
    """Barrier that sleeps instead of spinning, so measuring ranks keep the cores."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def pingpong(comm, a: int, b: int, sizes=DEFAULT_SIZES, reps: int = 20) -> dict[int, float]:
    """One-way seconds per message size between ranks ``a`` and ``b`` (fastest of ``reps`` round trips / 2).

    The fastest, not the median: on a shared machine other jobs only ever add
    time, and the planner needs what the link can do.

    Collective over ``comm``: every other rank waits without spinning.
    Returns the timings on every rank.
    """
    r = comm.Get_rank()
    out: dict[int, float] = {}
    if r in (a, b):
        peer = b if r == a else a
        for n in sizes:
            buf = np.zeros(max(n, 1), dtype=np.uint8)[:n]
            times = []
            for i in range(reps + 2):
                if r == a:
                    t0 = time.perf_counter()
                    comm.Send(buf, peer, 77)
                    comm.Recv(buf, peer, 77)
                    if i >= 2:  # two warm-up round trips (connection setup, page faults)
                        times.append((time.perf_counter() - t0) / 2)
                else:
                    comm.Recv(buf, peer, 77)
                    comm.Send(buf, peer, 77)
            if r == a:
                out[n] = float(np.min(times))
    _idle_wait(comm)
    return comm.bcast(out, root=a)


def fit_alpha_beta(times: dict[int, float], min_bw_size: int = 256 << 10) -> tuple[float, float]:
    """(latency s, bandwidth B/s) from one-way times: latency = the smallest message's time,
    bandwidth = 1 / least-squares slope over sizes >= ``min_bw_size`` (all sizes if fewer than two)."""
    sizes = sorted(times)
    alpha = times[sizes[0]]
    big = [n for n in sizes if n >= min_bw_size]
    if len(big) < 2:
        big = sizes
    x = np.array(big, dtype=float)
    y = np.array([times[n] for n in big])
    slope = np.polyfit(x, y, 1)[0] if len(big) >= 2 else y[0] / max(x[0], 1)
    if not slope > 0:  # noise on a flat curve: fall back to the largest message's average rate
        slope = y[-1] / x[-1]
    return float(alpha), float(1.0 / slope)


def _ring_exchange(comm, members: list[list[int]], nbytes: int, reps: int, chunk: int = 1 << 20) -> float:
    """Every rank in ``members`` (lists of rings) sends ``nbytes`` to its ring successor at once,
    in ``chunk``-byte Sendrecv-s walking through the buffers as the engine's chunks do (so that
    buffers larger than the caches cost what they cost the engine).

    Returns the fastest of ``reps`` exchanges (each timed on its slowest rank), on every rank.
    """
    r = comm.Get_rank()
    ring = next((m for m in members if r in m), None)
    sbuf = np.ones(nbytes, dtype=np.uint8)
    rbuf = np.ones(nbytes, dtype=np.uint8)
    times = []
    for i in range(reps + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        if ring is not None and len(ring) > 1:
            q = ring.index(r)
            nxt, prv = ring[(q + 1) % len(ring)], ring[(q - 1) % len(ring)]
            for a in range(0, nbytes, chunk):
                b = min(a + chunk, nbytes)
                comm.Sendrecv(sbuf[a:b], nxt, 78, rbuf[a:b], prv, 78)
        dt = comm.allreduce(time.perf_counter() - t0, op=_max())
        if i:
            times.append(dt)
    return float(np.min(times))


def _stalls_while_busy(comm, a: int, b: int, beta: float, nbytes: int = 16 << 20) -> tuple[bool, float]:
    """Whether a message into rank ``b`` moves only while ``b`` is inside MPI (``cpu_copy``).

    ``a`` sends ``nbytes``; ``b`` posts the receive, computes for three times
    the transfer time, then waits.  If the bytes moved during the computation
    the wait is short; if ``b``'s CPU does the copy (host shared memory) the
    whole transfer is still ahead.  Returns (stalls, wait / transfer time).
    """
    r = comm.Get_rank()
    transfer = nbytes / beta
    ratio = 0.0
    if r in (a, b):
        buf = np.zeros(nbytes, dtype=np.uint8)
        ratios = []
        for _ in range(3):
            if r == a:
                comm.Send(buf, b, 79)
            else:
                req = comm.Irecv(buf, a, 79)
                x = np.ones(1 << 14, dtype=np.float32)
                t_end = time.perf_counter() + 3 * transfer + 1e-3
                while time.perf_counter() < t_end:
                    np.multiply(x, 1.0, out=x)  # busy outside MPI, as a rank reducing a chunk
                t0 = time.perf_counter()
                req.Wait()
                ratios.append((time.perf_counter() - t0) / transfer)
        if r == b:
            ratio = float(min(ratios))
    _idle_wait(comm)
    ratio = comm.bcast(ratio, root=b)
    return ratio > 0.5, ratio


def _max():
    from mpi4py import MPI

    return MPI.MAX


def _reduce_rate(comm, nbytes: int = 64 << 20, chunk: int = 1 << 20, seconds: float = 0.3) -> float:
    """Bytes/s of float32 sum per rank, every rank reducing at once, in the engine's pattern:
    ``out[a:b] = src[a:b] + slot`` over ``chunk``-byte pieces of an ``nbytes`` buffer (mean over ranks)."""
    n, c = nbytes // 4, chunk // 4
    src = np.arange(n, dtype=np.float32)
    out = np.empty_like(src)
    slot = np.ones(c, dtype=np.float32)
    out += 0  # first touch outside the timing
    comm.Barrier()
    rate = 0.0
    t_end = time.perf_counter() + seconds
    while True:  # the best pass over the buffer: other jobs only slow passes down
        t0 = time.perf_counter()
        for a in range(0, n, c):
            b = min(a + c, n)
            np.add(src[a:b], slot[: b - a], out=out[a:b])
        t1 = time.perf_counter()
        rate = max(rate, n * 4 / (t1 - t0))
        if t1 >= t_end:
            break
    return float(np.mean(comm.allgather(rate)))


def calibrate(comm, *, rack_map=None, structure: Topology | None = None, sizes=DEFAULT_SIZES, reps: int = 20, concurrent_bytes: int = 64 << 20, reduce_bytes: int = 64 << 20) -> Topology:
    """Measure every level of the job's topology; collective over ``comm``. Returns the same Topology on every rank.

    ``rack_map``  -- host -> rack map for ``detect`` (path or dict).
    ``structure`` -- a topology whose placement replaces detection (its link values are ignored).
    ``sizes``     -- ping-pong message sizes in bytes; ``reps`` round trips per size.
    ``concurrent_bytes``, ``reduce_bytes`` -- working sets of the concurrent
    exchange and of the reduction test: larger than the caches by default,
    since the engine streams gradients that are.
    """
    p = comm.Get_size()
    if structure is not None:
        if structure.ranks != p:
            raise ValueError(f"structure describes {structure.ranks} ranks but the communicator has {p}")
        topo = structure
    else:
        nodes, where = node_split(comm)
        nodes.Free()
        topo = detect(where, rack_map=rack_map)
    ids = topo.group_ids()
    levels = []
    stamp = comm.bcast(time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), root=0)  # same file on every rank
    notes = [
        f"measured by python -m ddlkernels calibrate with {p} ranks on {stamp}",
        f"ping-pong sizes {list(sizes)} B, fastest of {reps} round trips each; latency = one-way time of the smallest size, bandwidth = 1/slope over sizes >= 256 KiB",
        f"concurrent: every rank Sendrecv-s {concurrent_bytes} B in 1 MiB chunks around rings that cross the level at once",
    ]
    for j, lv in enumerate(topo.levels, start=1):
        # A pair whose first common group is level j: rank 0 and the first rank
        # in the same level-j group but another level-(j-1) group.
        a = 0
        b = next((x for x in range(p) if ids[j][x] == ids[j][a] and ids[j - 1][x] != ids[j - 1][a]), None)
        if b is None:
            levels.append(lv)
            notes.append(f"level {lv.name}: no pair of ranks differs first at this level; values kept from the structure")
            continue
        t = pingpong(comm, a, b, sizes, reps)
        alpha, beta = fit_alpha_beta(t)
        # Concurrent rings: inside every level-j group, the members of each
        # level-(j-1) group pair up position by position with the next group's.
        rings = _level_rings(ids, j, p)
        dt = _ring_exchange(comm, rings, concurrent_bytes, max(3, reps // 4))
        per_flow = concurrent_bytes / dt
        flows_per_port = _flows_per_port(rings, ids, j)
        links, capacity = 1, None
        if j == 1:
            # Each rank is its own level-1 port (one link); what the level as a
            # whole carries is the group's shared capacity (memory bus, cores).
            members = max(len(set(x for x in range(p) if ids[1][x] == g)) for g in set(ids[1]))
            total = members * per_flow
            if total < 0.9 * members * beta:
                capacity = total
        else:
            links = int(min(flows_per_port, max(1, round(flows_per_port * per_flow / beta))))
        # Measured, not assumed: do the bytes move while the receiver computes?
        stalls, ratio = _stalls_while_busy(comm, a, b, beta)
        notes.append(f"level {lv.name}: a 16 MiB message into a busy rank still needed {ratio:.2f} x its transfer time "
                     f"once the rank waited -> cpu_copy {'true' if stalls else 'false'}")
        levels.append(Level(name=lv.name, fanout=lv.fanout, bandwidth=beta, latency=alpha, links=links, capacity=capacity, cpu_copy=stalls,
                            note=f"one-way times {{size: s}} = { {k: round(v, 9) for k, v in t.items()} }; concurrent rate per flow {per_flow:.3e} B/s with {flows_per_port} flow(s) per port"))
    rrate = _reduce_rate(comm, reduce_bytes)
    notes.append(f"reduce_rate: numpy float32 out[a:b] = src[a:b] + slot over a {reduce_bytes} B buffer in 1 MiB chunks, all {p} ranks at once, mean per rank")
    measured = Topology(levels=tuple(levels), ranks=p, name="calibrated", reduce_rate=rrate, placement=topo.placement,
                        hostnames=topo.hostnames)
    overhead, t_engine, t_model = _chunk_overhead(comm, measured, reps)
    notes.append(f"chunk_overhead: the engine's flat ring on {p} float32 (one chunk per step) took {t_engine * 1e6:.1f} us, "
                 f"fastest of {max(10 * reps, 50)}; the simulator with no overhead says {t_model * 1e6:.1f} us; the difference over "
                 f"the {2 * (p - 1)} chunks each rank receives")
    return Topology(levels=tuple(levels), ranks=p, name="calibrated", reduce_rate=rrate, chunk_overhead=overhead,
                    placement=topo.placement, hostnames=topo.hostnames, notes=tuple(notes))


def _chunk_overhead(comm, topo: Topology, reps: int) -> tuple[float, float, float]:
    """Seconds of CPU per received chunk that the engine adds beyond the modeled transfer and reduction.

    Times the engine itself (the library's ring, flat, on one element per
    rank, so every step is one tiny chunk) and subtracts what the simulator
    predicts for that call with ``chunk_overhead = 0``: what remains is the
    per-chunk software cost (Python, mpi4py, request handling, and on
    oversubscribed cores the wait for a peer to be scheduled).  Collective;
    returns ``(overhead, engine time, model time)``, the same on every rank.
    """
    from ..communicator import Communicator
    from ..ring.schedule import Plan
    from .simulator import simulate

    p = comm.Get_size()
    if p == 1:
        return 0.0, 0.0, 0.0
    dc = Communicator(comm, small_bytes=0)  # the ring, never MPI's own allreduce
    try:
        x = np.arange(p, dtype=np.float32)
        y = np.empty_like(x)
        for _ in range(3):
            dc.allreduce(x, out=y, dims=(p,))
        times = []
        # Many tries: a call takes tens of microseconds, and on oversubscribed
        # cores the fastest one is rare.
        for _ in range(max(10 * reps, 50)):
            comm.Barrier()
            t0 = time.perf_counter()
            dc.allreduce(x, out=y, dims=(p,))
            times.append(comm.allreduce(time.perf_counter() - t0, op=_max()))
        engine = float(np.min(times))
        model = simulate(topo, Plan((p,), dc.plan(0, (p,)).order), p * 4, verify=False).time_s
    finally:
        dc.free()
    return max(0.0, (engine - model) / (2 * (p - 1))), engine, model


def _level_rings(ids, j: int, p: int) -> list[list[int]]:
    """Rings that cross level j: for level 1, all ranks of each level-1 group; above, the i-th rank of
    every level-(j-1) group of a level-j group."""
    if j == 1:
        groups: dict[int, list[int]] = {}
        for r in range(p):
            groups.setdefault(ids[1][r], []).append(r)
        return list(groups.values())
    rings: dict[tuple[int, int], list[int]] = {}
    pos: dict[int, int] = {}
    for r in range(p):
        sub = ids[j - 1][r]
        i = pos.get(sub, 0)
        pos[sub] = i + 1
        rings.setdefault((ids[j][r], i), []).append(r)
    return [ring for ring in rings.values() if len({ids[j - 1][x] for x in ring}) > 1]


def _flows_per_port(rings, ids, j: int) -> int:
    """The most ring edges leaving one level-(j-1) group at once (1 for level 1)."""
    count: dict[int, int] = {}
    for ring in rings:
        for q, r in enumerate(ring):
            nxt = ring[(q + 1) % len(ring)]
            if ids[j - 1][r] != ids[j - 1][nxt]:
                count[ids[j - 1][r]] = count.get(ids[j - 1][r], 0) + 1
    return max(count.values(), default=1)


def with_params(structure: Topology, params: Topology) -> Topology:
    """``structure``'s placement with ``params``' link values, level by level (for reusing a calibration)."""
    levels = tuple(
        _replace(params.levels[i], name=lv.name, fanout=lv.fanout) if i < params.depth else lv for i, lv in enumerate(structure.levels)
    )
    return Topology(levels=levels, ranks=structure.ranks, name=structure.name, reduce_rate=params.reduce_rate,
                    chunk_overhead=params.chunk_overhead, placement=structure.placement, hostnames=structure.hostnames)
