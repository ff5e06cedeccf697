"""The device path on a device whose queued work runs late, in random legal orders (tests/stream_emulator.py).

A GPU runs a kernel or copy whenever its stream and events allow, so a missing
event wait corrupts data only now and then; the Numba simulator runs work the
moment it is queued and never shows it.  Here every copy and kernel of the
staged transport, the CUDA-aware transport (MPI handed the "device" memory,
which is host memory), the engine, fusion, the progress thread and the torch
optimizer runs late, under seeded schedules, and every result must equal,
bit for bit, the host path of the same Communicator -- read back through the
caller's stream, as ``cupy.asnumpy`` would.

The second half shows that this catches what it is for: each event wait and
host synchronization of the device path is removed in turn (a source-level
mutation of that one line), and the same workloads must then give wrong
results.  A mutation that no workload catches fails its test.
"""

import contextlib
import inspect
import textwrap
import time

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels
from ddlkernels import asynchronous as _async
from ddlkernels.algorithms import host as _host, ipc as _ipc, mpi as _mpi
from ddlkernels.collectives import streams as _streams
from ddlkernels.transport import direct as _transport, staged as _staged
from ddlkernels._dtypes import SUPPORTED_DTYPES
from helpers import GPU_LAYOUTS
from stream_emulator import Event, emulated_device

COMM = MPI.COMM_WORLD
P, R = COMM.Get_size(), COMM.Get_rank()
pytestmark = pytest.mark.skipif(P < 2, reason="one rank exchanges nothing: the transports are not used")

# 16-byte chunks and 2 receive slots: the largest size gives every rank's block 3 chunks of float32 or more at any
# rank count, so slots are reused within a step (37 alone gave 2 from 5 ranks on, and a receive that did not wait
# for the reduction still reading its slot went unnoticed).
CHUNK = 16
SIZES = sorted({1, 3, P + 1, max(37, 3 * (CHUNK // 4) * P + 1)})
SEEDS = {"lazy": (1, 2), "random": (3,)}


def data(n, dtype, salt=0):
    """Unique per rank and element, exact in every float type (multiples of 1/16)."""
    dt = np.dtype(dtype)
    key = np.arange(n, dtype=np.int64) * P + R + 7919 * salt
    if dt.kind == "i":
        return (key * 2654435761 % 100003 - 50001).astype(dt)
    return (((key * 37) % 251 - 125) / 16.0).astype(dt)


def comm_for(aware):
    return ddlkernels.Communicator(COMM, chunk_bytes=CHUNK, small_bytes=0, window=2, cuda_aware=aware, shm=False)


def wrong_anywhere(bad: int) -> int:
    """Wrong results summed over ranks (the same number on every rank)."""
    return COMM.allreduce(bad, op=MPI.SUM)


# -- workloads: each returns how many of its results differ from the host path ----------------------------

def ring_workload(be, c, dtypes=(np.float32,), ops=("sum",)):
    """allreduce, in and out of place, flat ring and (where P is even) a 2-D box, on a caller stream that
    is not the default; plus the input overwritten on that stream right after the call."""
    bad = 0
    s = be.new_stream()
    boxes = [None] + ([(2, P // 2)] if P % 2 == 0 and P > 2 else [])
    with be.current(s):
        for dt in dtypes:
            for op in ops:
                for n in SIZES:
                    for dims in boxes:
                        x = data(n, dt, salt=n)
                        host = c.allreduce(x, op, dims=dims)
                        d = be.to_device(x)
                        got = c.allreduce(d, op, dims=dims)
                        be.write(d, np.zeros_like(x))  # the caller reuses its input at once
                        bad += not np.array_equal(be.to_host(got).view(np.uint8), host.view(np.uint8))
                        d = be.to_device(x)
                        c.allreduce(d, op, out=d, dims=dims)
                        bad += not np.array_equal(be.to_host(d).view(np.uint8), host.view(np.uint8))
    return bad


def shard_workload(be, c):
    """reduce_scatter calls alternating between two streams, then allgathers of their shards: the
    scratch buffer and the receive slots are the Communicator's, shared by every call, and each call's
    last kernel is still queued when the next one starts."""
    bad = 0
    a, b = be.new_stream(), be.new_stream()
    counts = SIZES + [2 * P + 3]
    shards = []
    for k, n in enumerate(counts):
        with be.current(a if k % 2 else b):
            shards.append(c.reduce_scatter(be.to_device(data(n, np.float32, salt=k)), "sum"))
    wholes = []
    for k, (n, shard) in enumerate(zip(counts, shards)):
        with be.current(b if k % 2 else a):  # the other stream: it must wait for the shard's
            wholes.append(c.allgather(shard, count=n))
    for k, (n, shard, whole) in enumerate(zip(counts, shards, wholes)):
        x = data(n, np.float32, salt=k)
        bad += not np.array_equal(be.to_host(shard, a if k % 2 else b), c.reduce_scatter(x, "sum"))
        bad += not np.array_equal(be.to_host(whole, b if k % 2 else a), c.allreduce(x, "sum"))
    return bad


def fusion_workload(be, c):
    """allreduce_many (pack kernel -> ring -> unpack kernel) on two streams in turn; read at the end.  Every
    bucket holds several tensors, so each call ends with an unpack of the Communicator's fusion buffer."""
    bad = 0
    a, b = be.new_stream(), be.new_stream()
    shapes = [(3,), (2, 5), (1,), (7,), (4, 3), (2,)]  # buckets of 96 bytes: [3, 10, 1] and [7, 12, 2]
    pending = []
    for k in range(4):
        hosts = [data(int(np.prod(sh)), np.int32, salt=10 * k + i).reshape(sh) for i, sh in enumerate(shapes)]
        s = a if k % 2 else b
        with be.current(s):
            outs = ddlkernels.allreduce_many([be.to_device(h) for h in hosts], "sum", comm=c, fusion_bytes=96)
        pending.append((s, outs, [c.allreduce(h, "sum") for h in hosts]))
    for s, outs, refs in pending:
        for o, ref in zip(outs, refs):
            bad += not np.array_equal(be.to_host(o, s), ref)
    return bad


def async_workload(be, c):
    """allreduce_many_async / allreduce_async on the progress thread, started and waited on caller streams
    that differ from handle to handle (the pool's buffers pass from one handle to the next), and a handle
    waited for on two streams in turn (``wait(stream=)``)."""
    bad = 0
    a, b = be.new_stream(), be.new_stream()
    shapes = [(5,), (3, 2), (9,)]
    pending = []
    for k in range(4):
        s = a if k % 2 else b
        hosts = [data(int(np.prod(sh)), np.float32, salt=20 * k + i).reshape(sh) for i, sh in enumerate(shapes)]
        with be.current(s):
            h = ddlkernels.allreduce_many_async([be.to_device(x) for x in hosts], "sum", comm=c)
            outs = h.wait()
            h1 = ddlkernels.allreduce_async(be.to_device(hosts[0]), "avg", comm=c)
            one = h1.wait()
        pending.append((s, outs, [c.allreduce(x, "sum") for x in hosts], one, c.allreduce(hosts[0], "avg")))
    # Started with stream=, waited for there and then on a second stream, read there first (wait(stream=)).
    refs = [c.allreduce(x, "sum") for x in hosts]
    first, second = be.new_stream(), be.new_stream()
    h = ddlkernels.allreduce_many_async([be.to_device(x, stream=first) for x in hosts], "sum", comm=c, stream=first)
    h.wait(stream=first)
    for o, ref in zip(h.wait(stream=second), refs):
        bad += not np.array_equal(be.to_host(o, second), ref)
    for s, outs, refs, one, ref1 in pending:
        for o, ref in zip(outs, refs):
            bad += not np.array_equal(be.to_host(o, s), ref)
        bad += not np.array_equal(be.to_host(one, s), ref1)
    return bad


def torch_workload(be, c, steps=4):
    """DistributedOptimizer (progress thread) on "CUDA" parameters (CPU tensors claimed by the emulator):
    each step's backward, hooks and ``synchronize()`` on another caller stream, every step's reduced
    gradients read only at the end, through the stream they were installed on (as an optimizer update
    queued there would read them).  They must equal, bitwise, the same steps on host tensors.  The
    parameters are not updated, so both runs see the same model.
    """
    torch = pytest.importorskip("torch")
    import ddlkernels.torch as ddt

    def steps_of(device_like):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        opt = ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), comm=c, progress="thread",
                                       fusion_bytes=128)
        streams = [be.new_stream(), be.new_stream()]
        installed = []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + R)
            x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
            s = streams[step % 2]
            with be.current(s) if device_like else contextlib.nullcontext():
                opt.zero_grad()  # new gradient tensors each step
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.synchronize()
            installed.append((s, [p.grad for p in model.parameters()]))
        out = []
        for s, grads in installed:
            if device_like:
                be.emu.sync_stream(s)
            out += [gr.detach().numpy().reshape(-1) for gr in grads]
        return np.concatenate(out)

    host = steps_of(False)
    type(be).claim_torch = True  # from here CPU tensors are "CUDA" tensors of the emulated device
    try:
        dev = steps_of(True)
    finally:
        type(be).claim_torch = False
    return int(not np.array_equal(host.view(np.uint8), dev.view(np.uint8)))


def long_workload(be, c):
    """Messages of many chunks per ring step: the staging transport runs out of free pinned slots and
    takes back the oldest one whose host-to-device copy was queued."""
    bad = 0
    with be.current(be.new_stream()):
        for n in (301,):
            x = data(n, np.float32, salt=n)
            bad += not np.array_equal(be.to_host(c.allreduce(be.to_device(x), "sum")), c.allreduce(x, "sum"))
    return bad


def ipc_workload(be, c):
    """The CUDA IPC allreduce (device memory the peers map): in and out of place on two caller streams in
    turn, the input overwritten right after each call, results read at the end through their streams; at
    most 2 peers' allocations mapped at once (new buffers every call: mappings retired while queued work
    still uses them), and ``close_peer_memory`` after the last call, with every call's work still
    queued.  A mapping closed before its last use fails the work that uses it (``run`` counts it)."""
    c = ddlkernels.Communicator(COMM, shm=False, ipc=True)
    a, b = be.new_stream(), be.new_stream()
    pending = []
    saved, _ipc.MAPPED = _ipc.MAPPED, 2  # read when the first call maps
    try:
        for k, n in enumerate(SIZES + [2 * P + 3]):
            s = a if k % 2 else b
            x = data(n, np.float32, salt=k)
            with be.current(s):
                d = be.to_device(x)
                out = c.allreduce(d, "sum", out=None if k % 3 else d)
                if out is not d:
                    be.write(d, np.zeros_like(x))  # the caller reuses its input at once
            pending.append((s, out, c.allreduce(x, "sum")))
    finally:
        _ipc.MAPPED = saved
    if R % 2:  # the even ranks' devices run first: a read of an odd rank's input before it is written shows
        time.sleep(0.2)
    c.close_peer_memory()  # with every call's work still queued
    bad = sum(not np.array_equal(be.to_host(o, s), ref) for s, o, ref in pending)
    c.free()
    return bad


def ipc_shared_gpus_workload(be, c):
    """The CUDA IPC allreduce, then reduce_scatter and allgather, where ranks share GPUs (the lowest rank on each
    does its part for all, the ranks block on their own streams): each input written on the caller's stream
    right before its call, each result read right after it through that stream, the input overwritten at once."""
    c = ddlkernels.Communicator(COMM, shm=False, ipc=True)
    s, bad = be.new_stream(), 0
    if R % 2:  # odd ranks' hosts are slow to wait for their streams: their late work stays late
        wait = be.sync_stream
        be.sync_stream = lambda stream: (time.sleep(0.002), wait(stream))
    try:
        with be.current(s):
            for k, n in enumerate(SIZES + [2 * P + 3]):
                x = data(n, np.float32, salt=k)
                d = be.to_device(np.zeros_like(x))
                be.write(d, x)  # late under "lazy": rank 0 must not read it before it has run
                out = c.allreduce(d, "sum", out=None if k % 2 else d)
                if R == 0:  # a leader's host is slow to read: its peers read their results first
                    time.sleep(0.002)
                got = be.to_host(out, s)  # nothing orders rank 0's kernel before this but the call itself
                if out is not d:
                    be.write(d, np.zeros_like(x))
                bad += not np.array_equal(got, c.allreduce(x, "sum"))
                # reduce_scatter, then allgather of the shard: the leaders fold and write for their GPU's ranks
                be.write(d, x)
                shard = c.reduce_scatter(d, "sum")
                be.write(d, np.zeros_like(x))
                whole = c.allgather(shard, count=n)
                be.write(shard, np.zeros(shard.shape[0], x.dtype))
                bad += not np.array_equal(be.to_host(whole, s), c.allreduce(x, "sum"))
    finally:
        be.__dict__.pop("sync_stream", None)
    c.free()
    return bad


def host_workload(be, c):
    """The "host" algorithm in pieces of 16 bytes (its 3 pinned slots reused within each call and across
    calls; the first call cut evenly, the next ones ramped from 1 element (``piece_cuts``), so that its inner
    tuner settles new piece sizes between calls), then of 64 (new slots, while the last
    calls' copies up from the old ones are still queued: the pinned pool's next owner scribbles on them as
    they are dropped): in and out of place on two caller streams, the output's old contents written on the
    caller's stream just before each call, the input overwritten right after it, results read at the end
    (exact sums: every inner algorithm's bits)."""
    c = ddlkernels.Communicator(COMM, shm=False, ipc=False)
    algo = c.algorithms["host"]
    algo.piece_bytes = 16
    a, b = be.new_stream(), be.new_stream()
    pending = []
    # 37 first, in pieces of 4 and 1: later calls' new piece sizes (the inner tuner's trials, in slot 0) meet
    # copies up of earlier calls still queued.
    for k, n in enumerate([37] + SIZES + [2 * P + 3, 38, 41]):
        s = a if k % 2 else b
        x = data(n, np.float32, salt=k)
        algo.ramp = 1 if k == 0 else _host.RAMP
        if n == 41:
            algo.piece_bytes = 64
        with be.current(s):
            d = be.to_device(x)
            out = d if k % 3 == 0 else be.to_device(np.zeros_like(x))
            if out is not d:
                be.write(out, np.full_like(x, -3.0))
            c.settle(d, "host")
            got = c.allreduce(d, "sum", out=out)
            if got is not d:
                be.write(d, np.zeros_like(x))
        pending.append((s, got, c.allreduce(x, "sum")))
    bad = sum(not np.array_equal(be.to_host(o, s), ref) for s, o, ref in pending)
    c.free()
    return bad


def host_sharded_workload(be, c):
    """"host" reduce_scatter and allgather in pieces of 24 bytes (a few elements of each rank's shard a
    piece, its slots reused within and across calls and shared with an allreduce between them), on two
    caller streams, every out= written on the caller's stream just before its call, inputs overwritten right
    after, results read at the end (exact sums: every inner algorithm's bits)."""
    c = ddlkernels.Communicator(COMM, shm=False, ipc=False)
    c.algorithms["host"].piece_bytes = 24
    a, b = be.new_stream(), be.new_stream()
    pending = []
    for k, n in enumerate([37] + SIZES + [5 * P + 3]):
        s = a if k % 2 else b
        x = data(n, np.float32, salt=k)
        lo, hi = c.shard_range(n)
        with be.current(s):
            d = be.to_device(x)
            shard = be.to_device(np.zeros(hi - lo, np.float32))
            be.write(shard, np.full(hi - lo, -3.0, np.float32))
            whole = be.to_device(np.zeros(n, np.float32))
            be.write(whole, np.full(n, -5.0, np.float32))
            for kind in ("reduce_scatter", "allgather", "allreduce"):
                c.settle(d, "host", collective=kind)
            c.reduce_scatter(d, "sum", out=shard)
            be.write(d, np.zeros_like(x))
            mine = be.to_device(x[lo:hi])
            c.allgather(mine, count=n, out=whole)
            be.write(mine, np.zeros(hi - lo, np.float32))
            again = c.allreduce(be.to_device(x), "sum")
        pending += [(s, shard, c.reduce_scatter(x, "sum")), (s, whole, c.allgather(x[lo:hi], count=n)),
                    (s, again, c.allreduce(x, "sum"))]
    bad = sum(not np.array_equal(be.to_host(o, s), ref) for s, o, ref in pending)
    c.free()
    return bad


def mpi_workload(be, c):
    """MPI's own collectives handed the "device" memory (CUDA-aware on every rank): allreduce in and out of
    place ("avg" scaled on the stream after MPI), reduce_scatter and allgather, on a caller stream that is
    not the default, each input written on that stream right before its call and overwritten right after;
    against the same Communicator's host calls settled on MPI's too, bit for bit."""
    c = ddlkernels.Communicator(COMM, shm=False, cuda_aware=True)
    bad = 0

    def same(got, want):
        return np.array_equal(be.to_host(got).view(np.uint8), want.view(np.uint8))

    with be.current(be.new_stream()):
        for n in SIZES:
            for op, dt in (("sum", np.float32), ("avg", np.float64), ("max", np.int32)):
                x = data(n, dt, salt=n)
                d = be.to_device(x)
                for arr in (x, d):
                    for kind in ("allreduce", "reduce_scatter"):
                        c.settle(arr, "mpi", op, collective=kind)
                    c.settle(arr, "mpi", collective="allgather")
                got = c.allreduce(d, op)
                be.write(d, np.zeros_like(x))  # the caller reuses its input at once
                bad += not same(got, c.allreduce(x, op))
                d = be.to_device(x)
                bad += not same(c.allreduce(d, op, out=d), c.allreduce(x, op))
                d = be.to_device(x)
                got = c.reduce_scatter(d, op)
                be.write(d, np.zeros_like(x))
                bad += not same(got, c.reduce_scatter(x, op))
                lo, hi = c.shard_range(n)
                mine = be.to_device(x[lo:hi])
                got = c.allgather(mine, count=n)
                be.write(mine, np.zeros(hi - lo, dt))
                bad += not same(got, c.allgather(x[lo:hi], count=n))
                bad += c.last_algorithm != "mpi"
    c.free()
    return bad


WORKLOADS = {
    "ring-staged": lambda be: ring_workload(be, comm_for(False)),
    "ring-staged-long": lambda be: long_workload(be, comm_for(False)),
    "ring-aware": lambda be: ring_workload(be, comm_for(True)),
    "mpi-aware": lambda be: mpi_workload(be, None),
    "shards-staged": lambda be: shard_workload(be, comm_for(False)),
    "shards-aware": lambda be: shard_workload(be, comm_for(True)),
    "fusion": lambda be: fusion_workload(be, comm_for(False)),
    "async": lambda be: async_workload(be, comm_for(False)),
    "torch": lambda be: torch_workload(be, comm_for(False)),
    "ipc": lambda be: ipc_workload(be, None),
    "ipc-one-gpu": lambda be: ipc_shared_gpus_workload(be, None),
    "ipc-two-gpus": lambda be: ipc_shared_gpus_workload(be, None),
    "host": lambda be: host_workload(be, None),
    "host-sharded": lambda be: host_sharded_workload(be, None),
}


def run(workload, policy, seed):
    """Wrong results of ``workload``, and work that ran through a peer's mapping already closed."""
    layout = {"ipc-one-gpu": "one", "ipc-two-gpus": "two"}.get(workload, "own")
    with emulated_device(seed=1000 * seed + R, policy=policy, ipc=workload.startswith("ipc"),
                         gpu=GPU_LAYOUTS[layout](R)) as be:
        return WORKLOADS[workload](be) + be.faults


# -- the device path is right on a device that runs late -----------------------------------------------

@pytest.mark.parametrize("policy", sorted(SEEDS))
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_device_path_equals_host_path_under_late_random_schedules(workload, policy):
    bad = sum(run(workload, policy, seed) for seed in SEEDS[policy])
    assert wrong_anywhere(bad) == 0, f"{workload} under {policy}: {bad} wrong results on rank {R}"


@pytest.mark.parametrize("aware", [False, True], ids=["staged", "cuda-aware"])
def test_every_dtype_and_op_bitwise(aware):
    with emulated_device(seed=77 + R, policy="lazy") as be:
        bad = ring_workload(be, comm_for(aware), dtypes=SUPPORTED_DTYPES, ops=("sum", "avg", "max", "min", "prod"))
    assert wrong_anywhere(bad) == 0


def test_eager_schedule_is_what_launch_blocking_does():
    """Everything run the moment it is queued (CUDA_LAUNCH_BLOCKING=1): right, with or without the waits."""
    with emulated_device(seed=5, policy="eager") as be:
        assert wrong_anywhere(ring_workload(be, comm_for(False))) == 0


def test_a_dropped_buffer_meets_its_next_owner_as_with_cupys_pools():
    """The emulator's pools (tests/stream_emulator.py): a device buffer dropped while a copy on another stream
    still reads it gives that copy the next owner's bytes, as CuPy's pool would; work queued on the stream
    the buffer was taken on runs before its next owner, so reading it there stays right; a pinned buffer
    dropped while a copy still writes it puts that copy's bytes into the next pinned buffer of its size."""
    x = np.arange(64, dtype=np.float32) + R
    garbage = np.full(x.nbytes, 0xA5, np.uint8)
    with emulated_device(seed=R, policy="lazy") as be:
        other = be.new_stream()
        for keep in (True, False):
            d = be.to_device(x)  # on the current stream
            host = be.pinned(x.nbytes)
            be.wait(other, be.record(be.current_stream()))
            be.d2h(host, d, other)
            kept = d if keep else None
            del d  # with keep False, the last reference: the block goes back to the current stream's pool
            be.sync(be.record(be.current_stream()))  # that stream runs first: its next owner's write too
            be.sync(be.record(other))
            assert np.array_equal(host, x.view(np.uint8) if keep else garbage), keep
            del kept
        d = be.to_device(x)
        same = be.pinned(x.nbytes)
        be.d2h(same, d, be.current_stream())  # queued where the block was taken: before its next owner
        del d
        be.sync(be.record(be.current_stream()))
        assert np.array_equal(same, x.view(np.uint8))
        d = be.to_device(x)
        late = be.pinned(x.nbytes)
        be.wait(other, be.record(be.current_stream()))
        be.d2h(late, d, other)
        del late  # dropped while the copy into it is queued
        mine = be.pinned(x.nbytes)  # the same block, at once
        mine[...] = 7
        be.sync(be.record(other))
        assert np.array_equal(mine, x.view(np.uint8))  # the late copy wrote into the next owner's buffer
        assert be.device_pool.freed >= 2 and be.pinned_pool.reused >= 1


def test_drain_runs_what_a_pool_finalizer_queues_while_it_drains():
    """A block freed by a collection inside ``drain`` (between its last scan for ready work and its check that
    nothing is left) queues its next owner's write then; drain runs it instead of calling it work that can never
    run.  The device fuzz met it entering a case, once in some thousand cases, as the cyclic garbage of the case
    before (its Communicator) was collected there."""
    with emulated_device(seed=R, policy="lazy") as be:
        held = [be.to_device(np.arange(5.0) + R)]
        be.sync(be.record(be.current_stream()))
        real, freed = be.emu._ready, []

        def ready_then_collect():
            got = real()
            if not got and held:  # the scan found nothing: the last reference goes now, as in a collection
                held.clear()
                freed.append(True)
            return got

        be.emu._ready = ready_then_collect
        try:
            be.emu.drain()
        finally:
            del be.emu._ready
        assert freed and be.device_pool.freed >= 1
        assert not [op for s in be.emu.streams for op in s.queue]


def test_a_block_freed_while_an_operation_is_queued_goes_in_line_before_it():
    """A collection inside ``enqueue`` (while the new operation is built) may free a block taken on the same
    stream: its next owner's write joins that stream first, and the new operation must wait for it in line,
    not skip it (then forcing the operation found "work that can never run"; test_ipc's hierarchical failure
    case met it once in some dozens of suite runs, in the staged ring across nodes)."""
    with emulated_device(seed=R, policy="lazy") as be:
        s = be.current_stream()
        held = [be.to_device(np.arange(5.0) + R)]
        be.sync(be.record(s))
        freed = be.device_pool.freed

        class Collecting:  # the operation's dependencies, read while it is built: the block goes then
            def __iter__(self):
                held.clear()
                return iter(())

        op = be.emu.enqueue(s, None, "marker", deps=Collecting())
        assert be.device_pool.freed == freed + 1
        be.sync(Event(op))
        assert not s.queue


def test_bfloat16_and_torch_tensors_keep_their_type_through_every_path():
    """A device backend holds bfloat16 as its uint16 bits (CuPy has no bfloat16).  The buffers the library packs
    (allreduce_many, the progress thread's pool, the torch optimizer's buckets) and the shards it allocates
    (reduce_scatter, allgather) must still be reduced as bfloat16 and handed back as the caller's type: a
    torch tensor stays a torch tensor of its dtype.  Every result equals, bitwise, the same calls on host
    tensors."""
    torch = pytest.importorskip("torch")
    import ddlkernels.torch as ddt

    c = comm_for(False)

    def calls(device_like, be=None):
        g = torch.Generator().manual_seed(R)
        ts = [(torch.randn(n, generator=g) * 4).to(dt) for n in (5, 3, 1, 2 * P + 1) for dt in (torch.bfloat16,
                                                                                               torch.float32)]
        got = ddlkernels.allreduce_many(ts, "sum", comm=c, fusion_bytes=64)
        got += [ddlkernels.allreduce_async(t.clone(), "avg", comm=c).wait() for t in ts[:2]]
        got += ddlkernels.allreduce_many_async(ts, "max", comm=c).wait()
        for t in ts[:2]:
            shard = c.reduce_scatter(t, "sum")
            got += [shard, c.allgather(shard, count=t.numel())]
            lo, hi = c.shard_range(t.numel())
            into, whole = torch.full((hi - lo,), -3.0).to(t.dtype), torch.full((t.numel(),), -3.0).to(t.dtype)
            if c.reduce_scatter(t, "max", out=into) is not into or c.allgather(into, count=t.numel(), out=whole) \
                    is not whole:
                got.append(torch.zeros(1))  # not the out given: differs from the host run's results
            got += [into, whole]
        for overlap in (True, False):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
            model = model.to(torch.bfloat16)
            opt = ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), comm=c, progress="thread",
                                           fusion_bytes=128, overlap=overlap)
            x = torch.randn(5, 6, generator=g).to(torch.bfloat16)
            opt.zero_grad()
            model(x).float().square().sum().backward()
            opt.synchronize()
            got += [p.grad for p in model.parameters()]
        if device_like:
            be.emu.sync_stream(be.current_stream())
        return [(type(t), t.dtype, tuple(t.shape), t.detach().reshape(-1).view(torch.uint8).numpy().copy())
                for t in got]

    host = calls(False)
    with emulated_device(seed=21 + R, policy="lazy", claim_torch=True) as be:
        dev = calls(True, be)
    c.free()
    assert len(host) == len(dev)
    bad = [k for k, (h, d) in enumerate(zip(host, dev)) if h[:3] != d[:3] or not np.array_equal(h[3], d[3])]
    assert wrong_anywhere(len(bad)) == 0, f"rank {R}: results {bad} differ: " + "; ".join(
        f"{host[k][:3]} vs {dev[k][:3]}" for k in bad[:4])


def test_a_shard_out_over_the_input_raises_before_communicating():
    """reduce_scatter's and allgather's ``out`` over the input's device memory: writing it would change the
    input while peers still read it; every rank raises before any message."""
    with emulated_device(seed=R) as be:
        c = comm_for(False)
        n = 4 * P + 1
        lo, hi = c.shard_range(n)
        mem = be.to_device(data(2 * n, np.float32))
        x = mem[:n]
        with pytest.raises(ValueError, match="out overlaps the input"):
            c.reduce_scatter(x, "sum", out=mem[lo + 1:hi + 1])
        with pytest.raises(ValueError, match="out overlaps the input"):  # over this rank's shard, on every rank
            c.allgather(x[lo:hi], count=n, out=mem[lo + 1:lo + 1 + n])
        COMM.Barrier()  # nobody entered a collective
        c.free()


def test_a_stream_capturing_a_cuda_graph_is_refused_before_communicating():
    """A call whose stream captures a CUDA graph (``torch.cuda.graph``, CuPy's ``begin_capture``) would record
    its copies and kernels for a replay that sends no message: every collective, fused and asynchronous call
    refuses it, on the current stream or ``stream=``, before anything is queued there (the emulator fails any
    work queued on a capturing stream) or sent, and so does the ``wait`` of a call started outside; once the
    capture ends the same calls give the host path's results, so no rank was left with a message in flight."""
    with emulated_device(seed=R, policy="lazy") as be:
        c = comm_for(False)
        n = 4 * P + 1
        x = data(n, np.float32, salt=9)
        s = be.new_stream()
        d, out = be.to_device(x, stream=s), be.to_device(np.zeros(n, np.float32), stream=s)
        lo, hi = c.shard_range(n)
        calls = {
            "allreduce": lambda **k: c.allreduce(d, "sum", **k),
            "allreduce out=": lambda **k: c.allreduce(d, "sum", out=out, **k),
            "reduce_scatter": lambda **k: c.reduce_scatter(d, "sum", **k),
            "allgather": lambda **k: c.allgather(d[lo:hi], count=n, **k),
            "allreduce_many": lambda **k: ddlkernels.allreduce_many([d, d[:3]], "sum", comm=c, **k),
            "allreduce_async": lambda **k: ddlkernels.allreduce_async(d, "sum", comm=c, **k).wait(),
            "allreduce_many_async": lambda **k: ddlkernels.allreduce_many_async([d], "sum", comm=c, **k).wait(),
        }
        be.sync_stream(s)  # the input is written before the capture begins
        for name, call in calls.items():
            for how in ("current", "stream="):
                with be.capture(s):
                    with pytest.raises(RuntimeError, match="inside a CUDA graph capture: the stream is capturing"):
                        if how == "current":
                            with be.current(s):
                                call()
                        else:
                            call(stream=s)
                assert s.queue == [], f"{name} ({how}) queued work on the capturing stream"
        COMM.Barrier()  # nobody entered a collective
        h = ddlkernels.allreduce_async(d, "sum", comm=c, stream=s)  # started outside, waited inside: refused too
        with be.capture(s):
            with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
                h.wait(stream=s)
        with be.current(s):
            want = c.allreduce(x, "sum")
            assert np.array_equal(be.to_host(h.wait(), s), want)  # the handle is whole: waited outside
            assert np.array_equal(be.to_host(calls["allreduce"](), s), want)
            assert np.array_equal(be.to_host(calls["reduce_scatter"](), s), want[lo:hi])
            assert np.array_equal(be.to_host(calls["allreduce_async"](), s), want)
        c.free()


def test_wait_orders_the_stream_it_is_given():
    """``Handle.wait(stream=s)`` orders ``s``, not the caller's current stream, after the reductions (and unpacks
    there); a later ``wait(stream=t)`` orders ``t`` too.  Under "lazy" nothing runs unless a read forces it, so
    a read on a stream that was not ordered sees the output before the reductions wrote it.  Host arrays
    refuse ``stream=`` at ``wait`` as at the start."""
    with emulated_device(seed=9 + R, policy="lazy") as be:
        c = comm_for(False)
        s, t = be.new_stream(), be.new_stream()
        bad = 0
        for k, (n, many) in enumerate([(37, False), (P + 1, True), (1000, True)]):
            x = data(n, np.float32, salt=30 + k)
            want = c.allreduce(x, "sum")  # the host path of the same Communicator

            def start():
                d = be.to_device(x, stream=s)
                if many:  # two tensors: packed into one pool buffer, unpacked by wait
                    return ddlkernels.allreduce_many_async([d[:n // 2], d[n // 2:]], "sum", comm=c, stream=s)
                return ddlkernels.allreduce_async(d, "sum", comm=c, stream=s)

            def read(res, on):
                return np.concatenate([be.to_host(g, on) for g in (res if many else [res])])

            bad += not np.array_equal(read(start().wait(stream=s), s), want)  # the current stream stays unordered
            h = start()
            h.wait(stream=s)
            bad += not np.array_equal(read(h.wait(stream=t), t), want)  # a second wait, read before s runs
        x = data(5, np.float32)
        h = ddlkernels.allreduce_async(x, "sum", comm=c)
        with pytest.raises(ValueError, match="stream= orders device work"):
            h.wait(stream=s)
        bad += not np.array_equal(h.wait(), c.allreduce(x, "sum"))
        c.free()
    assert wrong_anywhere(bad) == 0


def test_under_a_timeout_the_staged_ring_polls_until_its_copies_have_run():
    """With ``timeout=`` the ring waits by polling (``Test``, event queries), and the staged transport posts a
    send once a query sees its copy to pinned memory done.  A device finishes queued work in finite time,
    so the emulator's queries must too: under "lazy" they never did, and every rank waited to receive.
    (A hang here shows as ``CollectiveTimeout`` after 30 s.)"""
    with emulated_device(seed=5 + R, policy="lazy") as be:
        c = ddlkernels.Communicator(COMM, chunk_bytes=CHUNK, small_bytes=0, window=2, cuda_aware=False, shm=False,
                                    ipc=False, timeout=30.0)
        bad = 0
        for n in SIZES:
            x = data(n, np.float32, salt=n)
            d = be.to_device(x)
            for kind in ("allreduce", "reduce_scatter"):
                c.settle(d, "ring", collective=kind)
            bad += not np.array_equal(be.to_host(c.allreduce(d, "sum")), c.allreduce(x, "sum"))
            bad += not np.array_equal(be.to_host(c.reduce_scatter(d, "sum")), c.reduce_scatter(x, "sum"))
        c.free()
    assert wrong_anywhere(bad) == 0


def test_mpi_takes_device_buffers_only_where_every_rank_is_cuda_aware():
    """Whether MPI takes device buffers is agreed at creation: with one rank not CUDA-aware, none hands MPI
    device memory (the ring stages, "mpi" is no device candidate), and the rank that is says why; with every
    rank aware, "mpi" is a device candidate where MPI computes the call with numpy's bits (float sums and
    products, integer ops; not float max, nor float16), and a fixed ``small_bytes`` sends it such calls below it."""
    mixed = ddlkernels.Communicator(COMM, shm=False, cuda_aware=R != 0)
    aware = ddlkernels.Communicator(COMM, shm=False, cuda_aware=True)
    with emulated_device(seed=R, policy="lazy") as be:
        d, h = be.to_device(data(99, np.float32)), be.to_device(data(99, np.float16))
        assert mixed.cuda_aware()[0] is False and "mpi" not in mixed.candidates(d)
        assert R == 0 or "not on every rank" in mixed.cuda_aware()[1]
        assert aware.cuda_aware()[0] is True
        assert aware.candidates(d)[0] == "mpi" and "mpi" in aware.candidates(d, "prod")
        assert "mpi" not in aware.candidates(d, "max") and "mpi" not in aware.candidates(h)
        assert "nbc" not in aware.candidates(d)  # GPU-aware MPIs document their blocking collectives only
        fixed = ddlkernels.Communicator(COMM, shm=False, cuda_aware=True, small_bytes=1 << 20)
        assert fixed.candidates(d) == ("mpi",) and fixed.candidates(d, "max") == ("ring",)  # as host calls
        fixed.free()
    mixed.free()
    aware.free()


def test_mpi_on_device_buffers_under_a_deadline():
    """With ``timeout=`` MPI's blocking call on device buffers runs on the Communicator's helper thread (the
    caller's device made current there), after the work queued on the call's stream has run."""
    with emulated_device(seed=7 + R, policy="lazy") as be:
        c = ddlkernels.Communicator(COMM, shm=False, cuda_aware=True, timeout=30.0)
        bad = 0
        with be.current(be.new_stream()):
            for n in SIZES:
                x = data(n, np.float64, salt=n)
                d = be.to_device(x)
                for arr in (x, d):
                    c.settle(arr, "mpi", "avg")
                bad += not np.array_equal(be.to_host(c.allreduce(d, "avg")), c.allreduce(x, "avg"))
                bad += c.last_algorithm != "mpi"
        c.free()
    assert wrong_anywhere(bad) == 0


def test_stream_argument_orders_the_call_on_that_stream():
    """``stream=`` instead of the current stream: the input is written on s, the call ordered on s."""
    with emulated_device(seed=11 + R, policy="lazy") as be:
        c = comm_for(False)
        s = be.new_stream()
        x = data(37, np.float32, salt=4)
        d = be.to_device(x, stream=s)  # the current (default) stream knows nothing of this copy
        got = c.allreduce(d, "sum", stream=s)
        assert np.array_equal(be.to_host(got, s), c.allreduce(x, "sum"))
        with pytest.raises(ValueError, match="host arrays"):
            c.allreduce(x, "sum", stream=s)
        c.free()


@pytest.mark.parametrize("kind", ["many", "async"])
def test_new_outputs_of_a_fused_call_are_made_on_its_stream(kind):
    """allreduce_many and allreduce_many_async with ``stream=`` make their new outputs on that stream, where they
    write them.  Made on the caller's current stream, an output took a block just freed there whose late work
    (its old owner's copy, its next owner's write) overwrote the result once that stream ran (the device fuzz
    found it through torch tensors, where an empty tensor's output block is dropped at once)."""
    with emulated_device(seed=13 + R, policy="lazy") as be:
        c = comm_for(False)
        s = be.new_stream()
        x = data(7, np.float32, salt=5)
        d = be.to_device(x, stream=s)
        tmp = be.to_device(np.zeros(7, np.float32))  # on the current stream, which runs nothing yet ...
        del tmp  # ... and dropped: its block is free again, that work still queued
        if kind == "many":
            outs = ddlkernels.allreduce_many([d], "sum", comm=c, stream=s)
        else:
            outs = ddlkernels.allreduce_many_async([d], "sum", comm=c, stream=s).wait(stream=s)
        be.sync_stream(be.current_stream())  # the current stream's late work runs
        assert np.array_equal(be.to_host(outs[0], s), c.allreduce(x, "sum"))
        c.free()


# -- every wait is needed: remove one, and some workload gives wrong results -----------------------------

def _mutated(obj, name, line, nth=0):
    """``obj.name`` (a function or method) recompiled from its source without the ``nth`` line containing
    ``line`` (a statement: a ``pass`` keeps the block valid)."""
    fn = inspect.unwrap(getattr(obj, name))
    src = textwrap.dedent(inspect.getsource(fn))
    lines = src.splitlines()
    hits = [i for i, ln in enumerate(lines) if line in ln]
    assert len(hits) > nth, f"mutation target {line!r} not found in {obj.__name__}.{name}: the code changed"
    i = hits[nth]
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = indent + "pass  # mutated"
    ns = dict(fn.__globals__)
    exec(compile("\n".join(lines), f"<mutated {name}>", "exec"), ns)
    return ns[name]


HOSTS = ["host", "host-sharded"]  # "host" holds one pipeline for its three collectives: both must catch
#: (id, where, function, the line removed, which occurrence, workloads that must catch it)
MUTATIONS = [
    ("staged-land-waits-for-kernels", _staged.StagedTransport, "_land", "be.wait(self._h2d, be.record(compute))",
     0, ["ring-staged"]),
    ("staged-kernels-wait-for-land", _staged.StagedTransport, "_land", "be.wait(compute, ev)", 0, ["ring-staged"]),
    ("staged-send-waits-for-kernels", _staged.StagedTransport, "isend",
     "be.wait(self._d2h, be.record(be.compute_stream()))", 0, ["ring-staged"]),
    ("staged-send-posted-after-its-copy", _staged.StagedTransport, "_post_oldest", "self.backend.sync(s.ev)", 0,
     ["ring-staged"]),
    ("staged-slot-reuse-waits-for-its-copy", _staged.StagedTransport, "_acquire", "self.backend.sync(ev)", 0,
     ["ring-staged-long"]),
    ("aware-send-waits-for-kernels", _transport.HostTransport, "__init__", "_sync()", 0, ["ring-aware"]),
    ("mpi-reads-after-queued-work", _mpi.Mpi, "_blocking", "be.sync_stream(be.compute_stream())", 0, ["mpi-aware"]),
    ("aware-recv-waits-for-kernels", _transport.HostTransport, "__init__", "_sync()", 1, ["ring-aware"]),
    ("call-waits-for-previous-call", _streams, "on_stream", "be.wait(s, tail)", 0,
     ["shards-staged", "fusion"]),
    ("call-leaves-its-tail-unless-its-stream-ran", _streams, "on_stream", "self._tails[where(be)] = be.record(s)", 0,
     ["shards-staged", "fusion"]),
    ("progress-thread-waits-for-caller", _async.ThreadEngine, "_run", "be.wait(s, d.ready)", 0, ["async"]),
    ("caller-waits-for-progress-thread", _async._Device, "order_caller", "be.wait(be.call_stream(self.like, stream), self.done)", 0,
     ["async"]),
    ("pool-buffer-waits-for-last-unpack", _async._Pool, "take", "backend.wait(backend.compute_stream(), ev)", 0,
     ["async"]),
    ("second-wait-waits-for-first-unpack", _async.Handle, "wait",
     "be.wait(be.call_stream(job.tensors[0], stream), self._ready)", 0, ["async"]),
    ("ipc-reads-wait-for-peers-inputs", _ipc.IpcNode, "_call", "be.wait(s, d.event(parts[q][0][_READY]))", 0,
     ["ipc"]),
    ("ipc-result-waits-for-peers-writes", _ipc.IpcNode, "_call", "be.wait(s, d.event(parts[q][0][_DONE]))", 0,
     ["ipc"]),
    ("ipc-inputs-ready-recorded", _ipc.IpcNode, "_call", "be.record_on(s, d.ready)", 0, ["ipc"]),
    ("ipc-writes-done-recorded", _ipc.IpcNode, "_call", "be.record_on(s, d.done)", 0, ["ipc"]),
    ("ipc-mapping-closed-after-its-last-use", _ipc.Mapped, "reap", "continue  # queued work", 0, ["ipc"]),
    ("ipc-shared-gpus-reads-after-inputs-ran", _ipc.IpcNode, "_call", "be.sync_stream(s)", 0,
     ["ipc-one-gpu", "ipc-two-gpus"]),
    ("ipc-shared-gpus-results-after-leaders-ran", _ipc.IpcNode, "_call", "be.sync_stream(s)", 1,
     ["ipc-one-gpu", "ipc-two-gpus"]),
    ("close-peer-memory-waits-for-device-work", ddlkernels.Communicator, "close_peer_memory",
     "get_backend(key[0]).sync(ev)", 0, ["ipc"]),
    ("host-down-waits-for-caller", _host.Host, "_pipeline", "be.wait(cp.d2h, be.record(compute))", 0, HOSTS),
    ("host-slot-reuse-waits-for-its-copy-up", _host.Host, "_pipeline", "be.wait(cp.d2h, cp.freed[s])", 0, HOSTS),
    ("host-reads-after-copy-down", _host.Host, "_pipeline", "be.sync(landed[k])", 0, HOSTS),
    ("host-caller-waits-for-copies-up", _host.Host, "_pipeline", "be.wait(compute, cp.freed[", 0, HOSTS),
    ("host-inner-trials-wait-for-copies-up", _host.Host, "_settle_inner", "cp.drain()", 0, HOSTS),
    ("host-old-slots-drained-before-dropped", _host.Host, "_copies_for", "cp.drain()", 0, ["host"]),
]


def _torch_mutation():
    torch = pytest.importorskip("torch")  # noqa: F841
    import ddlkernels.torch as ddt

    return ("optimizer-pack-waits-for-last-unpack", ddt.optimizer._DistributedOptimizer, "_ddl_start",
            "be.wait(be.compute_stream(), self._ddl_unpacked[k])", 0, ["torch"])


@pytest.mark.parametrize("index", range(len(MUTATIONS) + 1),
                         ids=[m[0] for m in MUTATIONS] + ["optimizer-pack-waits-for-last-unpack"])
def test_removing_any_one_wait_gives_wrong_results(index, monkeypatch):
    ident, obj, name, line, nth, catchers = MUTATIONS[index] if index < len(MUTATIONS) else _torch_mutation()
    monkeypatch.setattr(obj, name, _mutated(obj, name, line, nth))
    caught = {}
    for w in catchers:
        caught[w] = wrong_anywhere(sum(run(w, "lazy", seed) for seed in (1, 2)))
    if R == 0:  # shown with pytest -s: how many results each workload got wrong without this wait
        print(f"\n{ident}: wrong results without it: {caught}")
    assert any(caught.values()), f"removing {line!r} from {obj.__name__}.{name} went unnoticed: {caught}"
