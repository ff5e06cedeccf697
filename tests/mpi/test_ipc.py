"""The CUDA IPC allreduce (ddlkernels.algorithms.ipc) on the stream emulator's device, with IPC between ranks.

Each rank's "device" memory lies in files the peers map, IPC events are
counters in them, and every copy and kernel runs late, in a random legal
order (tests/stream_emulator.py): a peer's read of an input not yet written,
or a result read before a peer's write into it, shows as wrong bits.  What
this cannot show is anything of CUDA itself (handles, peer access, the
kernels on a GPU): tests/gpu/run_on_device.sh checks that on a device.
"""

import time

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels
from ddlkernels._dtypes import SUPPORTED_DTYPES, dtype_name
from ddlkernels.algorithms import ipc as ipc_module
from ddlkernels.select.tuner import tuning_calls
from ddlkernels.algorithms.window_shards import cuts
from helpers import GPU_LAYOUTS, gpu_leaders, node_size, rank_data, rank_order_fold as fold
from stream_emulator import emulated_device

COMM = MPI.COMM_WORLD
P, R = COMM.Get_size(), COMM.Get_rank()
pytestmark = pytest.mark.skipif(P < 2, reason="one rank has no peer to map")
SIZES = sorted({0, 1, max(P - 1, 1), P + 1, 13, 4099})
OPS = ("sum", "avg", "prod", "max", "min")


def same_bits(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def wrong_anywhere(bad: int) -> int:
    return COMM.allreduce(bad, op=MPI.SUM)


def placed(be, x, at, shareable=True):
    """``x`` on the device ``at`` elements into a larger allocation (written on the current stream)."""
    whole = be.to_device(np.zeros(x.size + at + 3, x.dtype), shareable=shareable)
    d = whole[at: at + x.size]
    be.write(d, x)
    return d


@pytest.mark.sweep
@pytest.mark.parametrize("policy", ["lazy", "random"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=dtype_name)
def test_every_dtype_op_size_bitwise_in_and_out_of_place(dtype, op, policy):
    """The rank-order fold's bits on every rank, for 0, 1, p - 1, p + 1, a prime and several shards per rank,
    in and out of place, on a caller stream that is not the default; the input, overwritten on that stream
    right after the call, is read by the peers before it changes; the input of an out-of-place call is left
    as it was."""
    bad = []
    with emulated_device(seed=31 * R + len(op), policy=policy, ipc=True) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=True)
        s = be.new_stream()
        with be.current(s):
            for n in SIZES:
                x = rank_data(n, R, P, dtype, salt=n)
                want = fold(COMM.allgather(x), op) if n else x.copy()
                for inplace in (False, True):
                    d = be.to_device(x)
                    got = c.allreduce(d, op, out=d if inplace else None)
                    assert c.last_algorithm == "ipc"
                    if R % 2:  # even ranks' devices run first: an early read of a peer's memory shows
                        time.sleep(0.002)
                    if not inplace:
                        kept = be.to_host(d)
                        be.write(d, np.zeros_like(x))
                        bad += [] if same_bits(kept, x) else [f"n={n}: input modified"]
                    if not same_bits(be.to_host(got), want):
                        bad.append(f"n={n} {'in place' if inplace else 'out of place'}")
        c.free()
    assert wrong_anywhere(len(bad)) == 0, f"rank {R}: {bad}"


@pytest.mark.parametrize("policy", ["lazy", "random"])
def test_any_offset_and_memory_peers_cannot_map(policy):
    """Inputs and outputs at odd element offsets into their allocations, and in memory CUDA IPC cannot export
    (the algorithm's stage): the same bits, in place and out of place, every mix on every rank."""
    bad = []
    with emulated_device(seed=7 + R, policy=policy, ipc=True) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=True)
        for dtype in (np.float32, np.float16):
            for n in (P + 1, 1001):
                x = rank_data(n, R, P, dtype, salt=3)
                want = fold(COMM.allgather(x), "sum")
                for src_ok, dst_ok in ((True, True), (False, True), (True, False), (False, False)):
                    # The mix differs between ranks: a rank's choice of stage is its own.
                    src_ok, dst_ok = (src_ok, dst_ok) if R % 2 == 0 else (dst_ok, src_ok)
                    d = placed(be, x, 1 + R, shareable=src_ok)
                    out = placed(be, np.zeros_like(x), 3, shareable=dst_ok)
                    c.allreduce(d, "sum", out=out)
                    bad += [] if same_bits(be.to_host(out), want) else [f"{n} {dtype.__name__} {src_ok},{dst_ok}"]
                    bad += [] if same_bits(be.to_host(d), x) else [f"{n} input modified"]
                    c.allreduce(d, "sum", out=d)
                    bad += [] if same_bits(be.to_host(d), want) else [f"{n} {dtype.__name__} {src_ok} in place"]
        # Staged: per dtype and size, 0 + 1 + 1 + 2 buffers out of place and 2 inputs in place.
        bad += [] if c.algorithms["ipc"].staged() == 2 * 2 * 6 else [f"staged {c.algorithms['ipc'].staged()}"]
        c.free()
    assert wrong_anywhere(len(bad)) == 0, f"rank {R}: {bad}"


@pytest.mark.parametrize("layout", ["one", "two"])
def test_shared_gpus_sharded_collectives_with_memory_peers_cannot_map(layout):
    """Where ranks share GPUs the leaders write the other ranks' shards (reduce_scatter) and outputs
    (allgather): those at odd offsets and in memory CUDA IPC cannot export go through the owner's stage and
    back, and inputs there too; the same bits, every mix on every rank, inputs unchanged."""
    if len(gpu_leaders(layout, P)) == P:
        pytest.skip(f"{P} ranks on the {layout} layout's GPUs: no GPU serves two")
    bad = []
    with emulated_device(seed=11 + R, policy="random", ipc=True, gpu=GPU_LAYOUTS[layout](R)) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=True)
        for n in (P + 1, 1001):
            x = rank_data(n, R, P, np.float32, salt=5)
            xs = COMM.allgather(x)
            lo, hi = c.shard_range(n)
            want = fold([v[lo:hi] for v in xs], "sum")
            whole = np.concatenate([xs[q][slice(*c.shard_range(n, rank=q))] for q in range(P)])
            for k, (src_ok, dst_ok) in enumerate(((True, False), (False, True), (False, False))):
                src_ok, dst_ok = (src_ok, dst_ok) if (R + k) % 2 == 0 else (dst_ok, src_ok)  # mixes differ by rank
                d = placed(be, x, 1 + R, shareable=src_ok)
                out = placed(be, np.zeros(hi - lo, x.dtype), 3, shareable=dst_ok)
                c.reduce_scatter(d, "sum", out=out)
                assert c.last_algorithm == "ipc"
                bad += [] if same_bits(be.to_host(out), want) else [f"reduce_scatter {n} {src_ok},{dst_ok}"]
                bad += [] if same_bits(be.to_host(d), x) else [f"reduce_scatter {n}: input modified"]
                mine = placed(be, x[lo:hi], 2, shareable=src_ok)
                got = placed(be, np.zeros_like(x), 1, shareable=dst_ok)
                c.allgather(mine, count=n, out=got)
                bad += [] if same_bits(be.to_host(got), whole) else [f"allgather {n} {src_ok},{dst_ok}"]
        assert c.algorithms["ipc"].staged() > 0
        c.free()
    assert wrong_anywhere(len(bad)) == 0, f"rank {R}: {bad}"


def test_peers_allocations_are_opened_once_and_the_least_recent_closed(monkeypatch):
    """Calls on the same buffers open each peer allocation once; with a cap of 2 open mappings and new
    buffers every call, older mappings are closed and every result is still right."""
    with emulated_device(seed=3 + R, policy="lazy", ipc=True) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=True)
        x = rank_data(257, R, P, np.float64, salt=1)
        want = fold(COMM.allgather(x), "sum")
        d, out = be.to_device(x), be.to_device(np.zeros_like(x))
        algo = c.algorithms["ipc"]
        for k in range(4):
            c.allreduce(d, "sum", out=out)
            assert same_bits(be.to_host(out), want), k
            if k == 0:
                first = algo.mapped()
        assert first == 2 * (P - 1) and algo.mapped() == first, (first, algo.mapped())
        monkeypatch.setattr(ipc_module, "MAPPED", 2)
        c.free()
        c = ddlkernels.Communicator(COMM, shm=False, ipc=True)
        for k in range(5):
            got = c.allreduce(be.to_device(x), "sum")
            assert same_bits(be.to_host(got), want), k
        held = c.algorithms["ipc"].mapped(now=True)
        assert 0 < held <= max(2, 2 * (P - 1)), held  # this call's own are never closed
        assert c.algorithms["ipc"].mapped() > 2 * (P - 1)  # new buffers: new opens
        c.free()
        assert be.faults == 0  # no queued work ran through a mapping closed before it (the emulator counts)


def test_the_tuner_measures_ipc_beside_the_ring_for_device_arrays():
    """``ipc=None``: device allreduce has the candidates ("ring", "ipc", "host") where the backend offers IPC,
    and ("ring", "host") where it does not or with ``ipc=False``; the trials run each, each computing the
    right result, and the size settles on one of them, the same on every rank."""
    x = rank_data(3000, R, P, np.float32, salt=9)
    want = fold(COMM.allgather(x), "sum")
    with emulated_device(seed=R, policy="random", ipc=True) as be:
        c = ddlkernels.Communicator(COMM, shm=False)
        d = be.to_device(x)
        assert c.candidates(d) == ("ring", "ipc", "host")
        assert ddlkernels.Communicator(COMM, shm=False, ipc=False).candidates(d) == ("ring", "host")
        seen = []
        for k in range(tuning_calls(x.nbytes, 3) + 2):
            assert same_bits(be.to_host(c.allreduce(d, "sum")), want), k
            seen.append(c.last_algorithm)
        assert set(seen) == {"ring", "ipc", "host"} and not c.tuning(d)
        sizes = c.decisions()["allreduce"]["device_sizes"]
        assert list(sizes.values()) in (["ring"], ["ipc"], ["host"]), sizes
        assert COMM.allgather(sizes) == [sizes] * P
        c.free()
    with emulated_device(seed=R, policy="lazy") as be:  # a backend without IPC
        c = ddlkernels.Communicator(COMM, shm=False)
        assert c.candidates(be.to_device(x)) == ("ring", "host")
        c.free()


def test_under_a_deadline_and_validation():
    """With ``timeout=`` and ``validate=True`` the exchanges wait under the deadline: the same bits."""
    with emulated_device(seed=R, policy="lazy", ipc=True) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=True, validate=True, timeout=60)
        x = rank_data(999, R, P, np.int32, salt=2)
        got = c.allreduce(be.to_device(x), "max")
        assert c.last_algorithm == "ipc" and same_bits(be.to_host(got), fold(COMM.allgather(x), "max"))
        c.free()


def _cannot_map(monkeypatch, what):
    """The last rank cannot map its peers' memory (or their events), as ranks in containers of their own, or
    on GPUs without peer access, cannot."""
    import stream_emulator as SE

    def refused(self, key):
        raise RuntimeError("emulated cudaErrorMapBufferObjectFailed")

    if R == P - 1:
        monkeypatch.setattr(SE.EmuBackend, "ipc_open" if what == "memory" else "ipc_open_event", refused)


@pytest.mark.parametrize("what", ["memory", "events"])
def test_where_a_rank_cannot_map_its_peers_every_rank_takes_the_ring(monkeypatch, what):
    """The first call that chose "ipc" finds out on every rank, before it touches any buffer (a failure
    halfway through would leave the ranks waiting for each other): it warns and runs the ring, and "ipc" is
    no candidate for that backend any more; ``ipc=True`` raises the same error on every rank."""
    _cannot_map(monkeypatch, what)
    x = rank_data(999, R, P, np.int64, salt=3)
    want = fold(COMM.allgather(x), "sum")
    lo, hi = ddlkernels.shard_range(x.size)
    with emulated_device(seed=R, policy="lazy", ipc=True) as be:
        c = ddlkernels.Communicator(COMM, shm=False)
        d = be.to_device(x)
        c.settle(d, "ipc")
        with pytest.warns(RuntimeWarning, match=rf"CUDA IPC failed on rank\(s\) \[{P - 1}\] of {P}"):
            got = c.allreduce(d, "sum")
        assert c.last_algorithm == "ring" and same_bits(be.to_host(got), want)
        for kind in ("allreduce", "reduce_scatter", "allgather"):
            assert "ipc" not in c.candidates(d, collective=kind), kind
        assert same_bits(be.to_host(c.allreduce(d, "sum")), want)
        assert same_bits(be.to_host(c.reduce_scatter(d, "sum")), want[lo:hi])
        c.free()
        forced = ddlkernels.Communicator(COMM, shm=False, ipc=True)
        for _ in range(2):  # the second call from the verdict kept
            with pytest.raises(RuntimeError, match=rf"ipc=True, but CUDA IPC failed on rank\(s\) \[{P - 1}\]"):
                forced.allreduce(d, "sum")
        forced.free()
    COMM.Barrier()  # nobody was left in a collective


@pytest.mark.parametrize("where", ["mapping", "stage", "handle"])
def test_a_failure_inside_a_call_raises_on_every_rank_and_the_next_call_works(monkeypatch, where):
    """After the check passed, the last rank cannot map a peer's new buffer (after the exchange of handles),
    cannot allocate the exportable stage of memory IPC cannot export, or has a handle too long for the
    exchange (both before it): every rank raises the same error from that call, none waits for another in
    a collective; once it can again, calls are right."""
    import stream_emulator as SE

    def refused(self, *args):
        if where == "handle":
            return b"h" * (ipc_module.KEY_BYTES + 1), 0
        raise RuntimeError("emulated cudaErrorMemoryAllocation")

    with emulated_device(seed=R, policy="random", ipc=True) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=True)
        for k, n in enumerate((999, 5000, 7001)):  # each a new allocation, and a larger stage
            x = rank_data(n, R, P, np.float32, salt=k)
            want = fold(COMM.allgather(x), "sum")
            d = be.to_device(x, shareable=where != "stage")
            if k == 1 and R == P - 1:
                monkeypatch.setattr(SE.EmuBackend, {"mapping": "ipc_open", "stage": "ipc_alloc",
                                                    "handle": "ipc_export"}[where], refused)
            if k == 1:
                with pytest.raises(RuntimeError, match=rf"the CUDA IPC allreduce failed on rank\(s\) \[{P - 1}\]"):
                    c.allreduce(d, "sum")
                monkeypatch.undo()
            else:
                assert same_bits(be.to_host(c.allreduce(d, "sum")), want), k
        c.free()


def test_ipc_setting_is_checked():
    with pytest.raises(ValueError, match="ipc must be None, True or False"):
        ddlkernels.Communicator(COMM, ipc="yes")


K = node_size(P)  # ranks per made-up node


@pytest.mark.sweep
@pytest.mark.skipif(K is None, reason=f"{P} ranks cannot be split into 2+ nodes of 2+ ranks each")
@pytest.mark.parametrize("policy", ["lazy", "random"])
@pytest.mark.parametrize("placement", ["block", "round robin"])
def test_hierarchical_over_ipc_inside_made_up_nodes(placement, policy):
    """The hierarchical allreduce on device arrays (ddlkernels.algorithms.hier): IPC inside each node of K
    ranks, the device ring across nodes: every dtype and op ("avg" of float16/bfloat16 excepted, not a
    candidate), 0, 1, p - 1, p + 1, a prime and several shards, in and out of place: the reduction within
    rounding, the same bits on every rank, the input left as it was."""
    from ddlkernels._dtypes import is_half
    from ddlkernels.algorithms.hier import HierAllreduce
    from helpers import assert_close, assert_same_on_all_ranks

    color = R // K if placement == "block" else R % (P // K)
    with emulated_device(seed=17 + R, policy=policy, ipc=True) as be:
        node = COMM.Split(color=color, key=R)
        h = HierAllreduce(COMM, node, lambda cross: ddlkernels.Communicator(cross, shm=False, ipc=False))
        for dtype in SUPPORTED_DTYPES:
            for op in OPS:
                if op == "avg" and is_half(np.dtype(dtype)):
                    continue
                redop, avg_p = ("sum", P) if op == "avg" else (op, None)
                for n in SIZES:
                    x = rank_data(n, R, P, dtype, salt=n)
                    inputs = COMM.allgather(x)
                    what = f"hier {placement} n={n} {dtype_name(dtype)} {op}"
                    d, out = be.to_device(x), be.to_device(np.zeros_like(x))
                    h.run_device(be, be.flat(d), be.flat(out), np.dtype(dtype), redop, avg_p=avg_p)
                    if R % 2:
                        time.sleep(0.001)
                    y = be.to_host(out)
                    assert same_bits(be.to_host(d), x), f"{what}: input modified"
                    assert_close(y, inputs, op, dtype, what)
                    assert_same_on_all_ranks(COMM, y, what)
                    h.run_device(be, be.flat(d), be.flat(d), np.dtype(dtype), redop, avg_p=avg_p)
                    assert same_bits(be.to_host(d), y), f"{what}: in place"
        h.free()


@pytest.mark.skipif(K is None, reason=f"{P} ranks cannot be split into 2+ nodes of 2+ ranks each")
def test_hierarchical_step_across_nodes_finishes_its_trials_in_the_first_call_of_a_size():
    """On device arrays too, the first call of a size lets the Communicator across nodes finish its tuner's
    trials for the shard (on device zeros), bfloat16 (its uint16 bits on the device) included; the result
    right on every rank."""
    from ddlkernels._dtypes import BFLOAT16
    from ddlkernels.algorithms.hier import HierAllreduce
    from helpers import assert_close, assert_same_on_all_ranks

    with emulated_device(seed=3 + R, policy="random", ipc=True) as be:
        node = COMM.Split(color=R // K, key=R)
        h = HierAllreduce(COMM, node, lambda cross: ddlkernels.Communicator(cross, shm=False, ipc=False))
        for n, dtype, op in ((999, np.dtype(np.float32), "sum"), (4099, BFLOAT16, "max")):
            x = rank_data(n, R, P, dtype, salt=8)
            d, out = be.to_device(x), be.to_device(np.zeros_like(x))
            lo, hi = h.bounds(n)[h.local]
            shard = be.empty(hi - lo, dtype)
            assert h.cross.tuning_buffer(be, shard, dtype, op)
            h.run_device(be, be.flat(d), be.flat(out), dtype, op)
            assert not h.cross.tuning_buffer(be, shard, dtype, op)
            y = be.to_host(out)
            assert_close(y, COMM.allgather(x), op, dtype, f"hier n={n} {op}")
            assert_same_on_all_ranks(COMM, y, f"hier n={n} {op}")
        h.free()


@pytest.mark.skipif(K is None, reason=f"{P} ranks cannot be split into 2+ nodes of 2+ ranks each")
def test_hierarchical_where_one_node_cannot_map_takes_the_ring_on_every_node(monkeypatch):
    """Nodes of K ranks (node labels), the last rank's unable to map its peers' memory: every rank of every
    node learns it at the first call that chose "hier" for device arrays, warns and runs the ring (a node
    that went on alone would wait for the others forever)."""
    _cannot_map(monkeypatch, "memory")
    x = rank_data(777, R, P, np.int64, salt=4)
    want = fold(COMM.allgather(x), "max")
    with emulated_device(seed=R, policy="random", ipc=True) as be:
        c = ddlkernels.Communicator(COMM, node=R // K)
        d = be.to_device(x)
        assert "hier" in c.candidates(d, "max")
        c.settle(d, "hier", "max")
        with pytest.warns(RuntimeWarning, match=r"CUDA IPC failed on rank\(s\)"):
            got = c.allreduce(d, "max")
        assert c.last_algorithm == "ring" and same_bits(be.to_host(got), want)
        assert "hier" not in c.candidates(d, "max")
        c.free()
    COMM.Barrier()


@pytest.mark.skipif(K is None, reason=f"{P} ranks cannot be split into 2+ nodes of 2+ ranks each")
def test_hierarchical_where_a_node_fails_inside_a_call_every_node_raises(monkeypatch):
    """The last rank cannot map a peer's new buffer (after the check passed): its node's IPC step fails, and
    every rank of every node raises the same error (the other nodes would otherwise wait for it across
    nodes); once it can again, the next call is right."""
    import stream_emulator as SE
    from ddlkernels.algorithms.hier import HierAllreduce

    def refused(self, key):
        raise RuntimeError("emulated cudaErrorMemoryAllocation")

    with emulated_device(seed=R, policy="random", ipc=True) as be:
        node = COMM.Split(color=R // K, key=R)
        h = HierAllreduce(COMM, node, lambda cross: ddlkernels.Communicator(cross, shm=False, ipc=False))
        for k, n in enumerate((999, 5000, 7001)):  # each a new allocation
            x = rank_data(n, R, P, np.int64, salt=k)
            d, out = be.to_device(x), be.to_device(np.zeros_like(x))
            if k == 1:
                if R == P - 1:
                    monkeypatch.setattr(SE.EmuBackend, "ipc_open", refused)
                with pytest.raises(RuntimeError, match=rf"CUDA IPC reduce_scatter failed on rank\(s\) \[{P - 1}\] of {P}"):
                    h.run_device(be, be.flat(d), be.flat(out), np.dtype(np.int64), "sum")
                monkeypatch.undo()
            else:
                h.run_device(be, be.flat(d), be.flat(out), np.dtype(np.int64), "sum")
                assert same_bits(be.to_host(out), sum(COMM.allgather(x))), k
        h.free()
    COMM.Barrier()


def test_fusion_and_the_progress_thread_run_it_too():
    """allreduce_many (pack, the IPC allreduce of the bucket, unpack) and allreduce_async (the progress
    thread's own stream) on ipc=True: the rank-order fold of each array, bit for bit."""
    with emulated_device(seed=5 + R, policy="random", ipc=True) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=True)
        hosts = [rank_data(n, R, P, np.float32, salt=n) for n in (3, P + 1, 700, 1)]
        wants = [fold(COMM.allgather(h), "avg") for h in hosts]
        outs = ddlkernels.allreduce_many([be.to_device(h) for h in hosts], "avg", comm=c, fusion_bytes=256)
        assert c.last_algorithm == "ipc"
        h = ddlkernels.allreduce_async(be.to_device(hosts[2]), "avg", comm=c)
        late = h.wait()
        for o, want in zip(outs, wants):
            assert same_bits(be.to_host(o), want)
        assert same_bits(be.to_host(late), wants[2])
        c.free()


def test_one_fold_launch_writes_every_rank_s_output(monkeypatch):
    """The fold is one launch (up to 8 ranks) that writes this rank's shard into its own output and the
    p - 1 peers' as it computes it, out of place and in place (where those outputs are the shards it reads)."""
    import stream_emulator as SE

    launches = []
    real = SE.EmuBackend._launch_fold

    def counted(self, name, dst, srcs, n, arg, also=()):
        launches.append((len(srcs), len(also)))
        return real(self, name, dst, srcs, n, arg, also)

    monkeypatch.setattr(SE.EmuBackend, "_launch_fold", counted)
    with emulated_device(seed=4 + R, policy="random", ipc=True) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=True)
        x = rank_data(5 * P + 3, R, P, np.float32, salt=8)
        want = fold(COMM.allgather(x), "sum")
        d = be.to_device(x)
        got = c.allreduce(d, "sum")
        assert same_bits(be.to_host(got), want)
        assert launches == [(P, P - 1)] or P > 8, launches  # past 8 ranks: groups of 8, the last writes 7
        launches.clear()
        c.allreduce(d, "sum", out=d)
        assert same_bits(be.to_host(d), want)
        assert launches == [(P, P - 1)] or P > 8, launches
        c.free()


def shared_gpu_launches(p, n):
    """(operands, outputs besides dst, length) of each fold launch of a leader of the shared-GPU schedule at p
    ranks, over its n elements: the first 8 inputs, then the partial result and 7 more at a time; the last
    launch writes 7 peers' outputs (``reduce_many``), in place too (the leader's output, its own input, is the
    first operand)."""
    got, left = [(min(p, 8), 0, n)], p - min(p, 8)
    while left:
        got.append((1 + min(7, left), 0, n))
        left -= min(7, left)
    got[-1] = (got[-1][0], min(p - 1, 7), n)
    return got


@pytest.mark.parametrize("policy", ["lazy", "random"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64], ids=dtype_name)
@pytest.mark.parametrize("layout", ["one", "two"])
def test_ranks_sharing_gpus_fold_by_leader_after_their_streams_ran(monkeypatch, layout, dtype, policy):
    """Ranks that share GPUs (all one, or two dealt out round robin): the lowest rank on each GPU alone launches;
    in allreduce one fold of its part (``cuts`` over the leaders) of every rank's input into every output (past
    8 ranks in launches of 8 operands, the partial result carried on); the other ranks queue nothing at all on
    the device, no rank records or waits for any event, and no stream waits for a peer's event; the ranks' own
    streams have run before a leader reads and after it writes.  Inputs written on a caller stream right before
    the call and overwritten right after, in and out of place, every op: the rank-order fold's bits on every
    rank.  reduce_scatter and allgather the same way, the leaders folding and writing for the ranks on their
    GPU."""
    leaders = gpu_leaders(layout, P)
    if len(leaders) == P:
        pytest.skip(f"{P} ranks on the {layout} layout's GPUs: no GPU serves two")
    import stream_emulator as SE

    launches, events, queued = [], [], []
    real_fold, real_wait, real_record = SE.EmuBackend._launch_fold, SE.EmuBackend.wait, SE.EmuBackend.record
    real_enqueue = SE.Emulator.enqueue

    def counted(self, name, dst, srcs, n, arg, also=()):
        launches.append((len(srcs), len(also), n))
        return real_fold(self, name, dst, srcs, n, arg, also)

    def wait(self, stream, ev):
        events.append(f"wait {type(ev).__name__}")
        return real_wait(self, stream, ev)

    def record(self, stream):
        events.append("record")
        return real_record(self, stream)

    def enqueue(self, stream, fn, what, deps=(), ext=(), progress=True):
        if progress:  # not a pool's next owner's write, which a collection may queue at any moment
            queued.append(what)
        return real_enqueue(self, stream, fn, what, deps, ext, progress)

    monkeypatch.setattr(SE.EmuBackend, "_launch_fold", counted)
    monkeypatch.setattr(SE.EmuBackend, "wait", wait)
    monkeypatch.setattr(SE.EmuBackend, "record", record)
    monkeypatch.setattr(SE.Emulator, "enqueue", enqueue)
    bad = []

    def call(what, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` with what it queued and recorded checked: nothing but the leaders' work goes to
        the shared GPU, and no event (a call that ends with its stream run leaves no tail for the next one to
        wait on; one of 0 elements returns at once, its caller's work still queued, and leaves one, which the
        call after it waits for)."""
        for log in (launches, events, queued):
            log.clear()
        got = fn(*args, **kwargs)  # c and n: the Communicator and the size of the loop below
        assert c.last_algorithm == "ipc" or n == 0
        if n and call.last_n:
            bad.extend([f"{what}: {events}"] if events else [])
            bad.extend([f"{what}: queued {queued}"] if queued and R not in leaders else [])
        call.last_n = n
        return got

    call.last_n = 0
    with emulated_device(seed=17 * R + 3, policy=policy, ipc=True, gpu=GPU_LAYOUTS[layout](R)) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=True)
        s = be.new_stream()
        with be.current(s):
            for n in SIZES:
                for op in OPS:
                    x = rank_data(n, R, P, dtype, salt=n + len(op))
                    want = fold(COMM.allgather(x), op) if n else x.copy()
                    for inplace in (False, True):
                        d = be.to_device(np.zeros_like(x))
                        be.write(d, x)  # on the caller's stream, right before the call: late under "lazy"
                        how = f"n={n} {op} {'in place' if inplace else 'out of place'}"
                        got = call(how, c.allreduce, d, op, out=d if inplace else None)
                        if not inplace:  # overwritten right after the call: the leaders have read it by then
                            be.write(d, np.zeros_like(x))
                        if not same_bits(be.to_host(got), want):
                            bad.append(how)
                        part = cuts(n, len(leaders))  # the leaders' parts
                        i = leaders.index(R) if R in leaders else None
                        mine = [] if i is None or part[i + 1] == part[i] else \
                            shared_gpu_launches(P, part[i + 1] - part[i])
                        bad += [] if launches == mine else [f"{how}: launches {launches}, not {mine}"]
                # reduce_scatter and allgather: each leader for the ranks on its GPU, ordered by host blocks
                lo, hi = c.shard_range(n)
                xs = COMM.allgather(x)
                for into in (False, True):
                    d = be.to_device(np.zeros_like(x))
                    be.write(d, x)
                    out = be.to_device(np.full(hi - lo, -1, x.dtype)) if into else None
                    got = call(f"reduce_scatter n={n}", c.reduce_scatter, d, "sum", out=out)
                    be.write(d, np.zeros_like(x))  # overwritten right after the call: the leaders have read it
                    want = fold([v[lo:hi] for v in xs], "sum") if hi > lo else x[lo:hi].copy()
                    bad += [] if same_bits(be.to_host(got), want) else [f"reduce_scatter n={n} out={into}"]
                whole = np.concatenate([xs[q][slice(*c.shard_range(n, rank=q))] for q in range(P)])
                for into in (False, True):
                    mine = be.to_device(np.zeros(hi - lo, x.dtype))
                    be.write(mine, x[lo:hi])
                    out = be.to_device(np.full_like(x, -1)) if into else None
                    got = call(f"allgather n={n}", c.allgather, mine, count=n, out=out)
                    be.write(mine, np.zeros(hi - lo, x.dtype))
                    bad += [] if same_bits(be.to_host(got), whole) else [f"allgather n={n} out={into}"]
        assert list(c.algorithms["ipc"].node.leaders(be)) == leaders
        assert (c.algorithms["ipc"].mapped() > 0) == (R in leaders)  # only leaders open their peers' memory
        c.free()
    assert wrong_anywhere(len(bad)) == 0, f"rank {R}: {bad[:5]}"


@pytest.mark.sweep
@pytest.mark.parametrize("policy", ["lazy", "random"])
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=dtype_name)
def test_reduce_scatter_and_allgather_over_ipc(dtype, policy):
    """reduce_scatter: this rank's shard (``shard_range``) of every rank's input folded in rank order, every
    op, with and without ``out``; allgather: every rank's shard in its place of every rank's output; sizes
    0, 1, p - 1, p + 1, a prime and several elements a rank; inputs kept, the same bits on every rank."""
    bad = []
    with emulated_device(seed=13 * R + 1, policy=policy, ipc=True) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=True)
        s = be.new_stream()
        with be.current(s):
            for n in SIZES:
                x = rank_data(n, R, P, dtype, salt=n + 1)
                lo, hi = c.shard_range(n)
                xs = COMM.allgather(x)
                d = be.to_device(x)
                for op in OPS:
                    want = fold([v[lo:hi] for v in xs], op) if hi > lo else x[lo:hi].copy()
                    got = c.reduce_scatter(d, op)
                    assert c.last_algorithm == "ipc" or n == 0
                    bad += [] if same_bits(be.to_host(got), want) else [f"rs n={n} {op}"]
                    out = be.to_device(np.zeros(hi - lo, x.dtype))
                    c.reduce_scatter(d, op, out=out)
                    bad += [] if same_bits(be.to_host(out), want) else [f"rs out= n={n} {op}"]
                bad += [] if same_bits(be.to_host(d), x) else [f"n={n}: input modified"]
                whole = np.empty_like(x)  # every rank's shard where shard_range places it
                for q in range(P):
                    a, b = c.shard_range(n, rank=q)
                    whole[a:b] = xs[q][a:b]
                got = c.allgather(be.to_device(x[lo:hi]), count=n)
                bad += [] if same_bits(be.to_host(got), whole) else [f"ag n={n}"]
        c.free()
    assert wrong_anywhere(len(bad)) == 0, f"rank {R}: {bad}"


def test_reduce_scatter_and_allgather_candidates():
    with emulated_device(seed=R, policy="lazy", ipc=True) as be:
        c = ddlkernels.Communicator(COMM, shm=False)
        d = be.to_device(np.zeros(1000, np.float32))
        host = ("host",) if P > 1 else ()  # "host" reduces pieces of device buffers on the host, from 2 ranks
        assert c.candidates(d, collective="reduce_scatter") == ("ring", "ipc", *host)
        assert c.candidates(d, collective="allgather") == ("ring", "ipc", *host)
        assert ddlkernels.Communicator(COMM, shm=False, ipc=False).candidates(d, collective="allgather") == \
            ("ring", *host)
        c.free()


def test_close_peer_memory_closes_every_mapping_and_later_calls_open_again():
    """``Communicator.close_peer_memory`` (before memory goes back to the driver): after it no peer
    allocation is open on any rank; the next calls open what they need again and give the same bits."""
    x = rank_data(4099, R, P, np.float32, salt=3)
    want = fold(COMM.allgather(x), "sum")
    with emulated_device(seed=R, policy="random", ipc=True) as be:
        c = ddlkernels.Communicator(COMM, shm=False, ipc=True)
        algo = c.algorithms["ipc"]
        d, out = be.to_device(x), be.to_device(np.zeros_like(x))
        first = be.to_host(c.allreduce(d, "sum", out=out))
        opened = algo.mapped()
        assert algo.mapped(now=True) == opened > 0
        c.allreduce(d, "sum", out=out)  # queued, not read: close_peer_memory waits for it
        c.close_peer_memory()
        assert COMM.allgather(algo.mapped(now=True)) == [0] * P
        again = be.to_host(c.allreduce(d, "sum", out=out))
        assert algo.mapped() == 2 * opened and same_bits(first, want) and same_bits(again, want)
        host = ddlkernels.Communicator(COMM)
        host.close_peer_memory()  # nothing mapped, no device call: a barrier
        host.free()
        c.free()
        assert algo.mapped(now=True) == 0 and be.faults == 0
