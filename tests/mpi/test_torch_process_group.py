"""``torch.distributed`` on the ``ddlkernels`` process group, against gloo in the same job.

The default group is ``init_process_group("ddlkernels")`` (rank and size from
MPI); a gloo group of the same ranks computes every reference.  Each
collective, on data unique per rank and element, must give gloo's bits (the
sums of small integers and of multiples of 1/16 are exact in any order; max
and min are exact); DDP trained on the ddlkernels group must end within a
stated tolerance of DDP on gloo and identical on every rank.  A group of some
ranks, asynchronous calls, coalesced ones, gather, scatter and all_to_all of any
dtype, point-to-point messages of every dtype beside the collectives, and the
refusals (an op, a non-contiguous tensor, uneven splits, a peer or tag MPI
cannot take) raised before any message.
"""

import datetime
import importlib
import types

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels
from helpers import assert_same_on_all_ranks

torch = pytest.importorskip("torch", reason="torch not installed (pip install -e .[torch])")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
ddt = importlib.import_module("ddlkernels.torch")
pg_module = importlib.import_module("ddlkernels.torch.process_group")

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
torch.set_num_threads(1)
SIZES = sorted({0, 1, max(P - 1, 1), P + 1, 7, 4097})
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16]
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names warn): the new where present
GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SCATTER_FROM = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@pytest.fixture(scope="module")
def gloo():
    ddt.init_process_group(pg_module.BACKEND)
    assert dist.get_backend() == pg_module.BACKEND and isinstance(dist.group.WORLD, ddt.ProcessGroupDDL)
    g = dist.new_group(backend="gloo")
    yield g
    COMM.Barrier()
    dist.destroy_process_group()


def data(n, dtype, salt=0, rank=RANK):
    """Unique per rank and element, exact in every dtype (multiples of 1/16 up to 2^6)."""
    key = torch.arange(n, dtype=torch.int64) * P + rank + 7919 * salt
    v = (key * 37) % 251 - 125
    return (v if not dtype.is_floating_point else v / 16.0).to(dtype)


def same(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.view(torch.int16) if got.dtype == torch.bfloat16 else got,
                       want.view(torch.int16) if want.dtype == torch.bfloat16 else want), what


def test_all_reduce_every_dtype_op_and_size_as_gloo(gloo):
    for dtype in DTYPES:
        for name, op in OPS.items():
            for n in SIZES:
                x = data(n, dtype, salt=n)
                ref = x.float() if dtype in (torch.float16, torch.bfloat16) else x.clone()  # gloo: no 16-bit max
                dist.all_reduce(ref, op=op, group=gloo)
                got = x.clone()
                dist.all_reduce(got, op=op)
                same(got, ref.to(dtype), f"all_reduce {dtype} {name} n={n}")
                assert_same_on_all_ranks(COMM, got.float().numpy(), f"all_reduce {dtype} {name} n={n}")


def test_avg_product_async_and_coalesced(gloo):
    x = data(4097, torch.float64, salt=1)
    avg = x.clone()
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    ref = x.clone()
    dist.all_reduce(ref, group=gloo)
    assert torch.allclose(avg, ref / P, rtol=0, atol=1e-12)
    small = torch.tensor([1.0, -2.0, 0.5]) * (RANK + 1)
    prod, pref = small.clone(), small.clone()
    dist.all_reduce(prod, op=dist.ReduceOp.PRODUCT)
    dist.all_reduce(pref, op=dist.ReduceOp.PRODUCT, group=gloo)
    same(prod, pref, "product")
    z = torch.complex(data(9, torch.float32, salt=8), data(9, torch.float32, salt=9))  # torch passes its floats
    zref = z.clone()
    dist.all_reduce(z)
    dist.all_reduce(zref, group=gloo)
    assert torch.equal(z, zref), "complex sum"
    # Asynchronous: the works complete in call order; wait() gives each its result.
    ts = [data(n, torch.float32, salt=n) for n in SIZES]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for t, w, n in zip(ts, works, SIZES):
        w.wait(timeout=datetime.timedelta(seconds=60))
        assert w.is_completed()
        r = data(n, torch.float32, salt=n)
        dist.all_reduce(r, group=gloo)
        same(t, r, f"async n={n}")
    # A callback on a collective's future that starts another: it runs on the progress thread, inside the
    # first one's completion, and must not wait for the group's own bookkeeping.
    first, second = data(5, torch.float32, salt=20), data(6, torch.int64, salt=21)
    refs = [first.clone(), second.clone()]
    chained = dist.all_reduce(first, async_op=True).get_future().then(
        lambda f: dist.all_reduce(second, async_op=True))
    chained.wait().wait()
    for r in refs:
        dist.all_reduce(r, group=gloo)
    same(first, refs[0], "the collective with a callback")
    same(second, refs[1], "the collective its callback started")
    # Coalesced: one call for several tensors of several dtypes and shapes.
    tensors = [data(n, d, salt=3).reshape(-1, 1) for n, d in zip((5, 4097, 0), (torch.float32, torch.int64,
                                                                                    torch.float16))]
    refs = [t.clone() for t in tensors]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in tensors:
            dist.all_reduce(t)
    cm.wait()
    for r in refs:
        dist.all_reduce(r, group=gloo)
    for t, r in zip(tensors, refs):
        same(t, r, f"coalesced {t.dtype}")


@pytest.mark.parametrize("n", [1, 5, 4097])
def test_gather_scatter_broadcast_reduce_barrier_as_gloo(gloo, n):
    x = data(n, torch.float32, salt=2)
    # all_gather (a list) and into one tensor
    outs, refs = [torch.empty(n) for _ in range(P)], [torch.empty(n) for _ in range(P)]
    dist.all_gather(outs, x)
    dist.all_gather(refs, x, group=gloo)
    for q in range(P):
        same(outs[q], refs[q], f"all_gather block {q}")
    whole, wref = torch.empty(n * P), torch.cat(refs)
    GATHER_INTO(whole, x)
    same(whole, wref, GATHER_INTO.__name__)
    # reduce_scatter of one tensor and of a list
    big = data(n * P, torch.float32, salt=3)
    shard, sref = torch.empty(n), big.clone()
    SCATTER_FROM(shard, big)
    dist.all_reduce(sref, group=gloo)
    same(shard, sref[RANK * n:(RANK + 1) * n], SCATTER_FROM.__name__)
    shard2 = torch.empty(n)
    dist.reduce_scatter(shard2, list(big.chunk(P)))
    same(shard2, shard, "reduce_scatter")
    # In place, as FSDP calls them (NCCL allows it): the input is this rank's block of the output, and the
    # output this rank's block of the input.
    whole2 = torch.empty(n * P)
    whole2[RANK * n:(RANK + 1) * n] = x
    GATHER_INTO(whole2, whole2[RANK * n:(RANK + 1) * n])
    same(whole2, wref, "in-place " + GATHER_INTO.__name__)
    big2 = big.clone()
    SCATTER_FROM(big2[RANK * n:(RANK + 1) * n], big2)
    same(big2[RANK * n:(RANK + 1) * n], shard, "in-place " + SCATTER_FROM.__name__)
    for root in range(P):
        b = data(n, torch.float64, salt=4)
        dist.broadcast(b, src=root)
        same(b, data(n, torch.float64, salt=4, rank=root), f"broadcast from {root}")
        r = data(n, torch.int64, salt=5)
        dist.reduce(r, dst=root)
        rr = data(n, torch.int64, salt=5)
        dist.all_reduce(rr, group=gloo)
        same(r, rr if RANK == root else data(n, torch.int64, salt=5), f"reduce to {root}")
    dist.barrier()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.bool])
def test_gather_scatter_and_all_to_all_move_every_byte(gloo, dtype):
    """Nothing to reduce, any dtype (bool and 16-bit floats included): each block where it belongs."""
    def block(n, rank, salt):
        return data(n, torch.int64, salt=salt, rank=rank).to(dtype)

    for root in range(P):
        outs = [torch.empty(5, dtype=dtype) for _ in range(P)] if RANK == root else None
        dist.gather(block(5, RANK, 1), outs, dst=root)
        if RANK == root:
            for q in range(P):
                same(outs[q], block(5, q, 1), f"gather to {root}: block of {q}")
        got = torch.empty(5, dtype=dtype)
        dist.scatter(got, [block(5, root, q) for q in range(P)] if RANK == root else None, src=root)
        same(got, block(5, root, RANK), f"scatter from {root}")
    # all_to_all_single, equal parts and uneven ones (rows of 3: rank q sends r (q + r) % 3 + 1 rows)
    x = torch.cat([block(4 * 3, RANK, q) for q in range(P)]).reshape(-1, 3)
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)
    same(y, torch.cat([block(4 * 3, q, RANK) for q in range(P)]).reshape(-1, 3), "all_to_all_single")
    rows = [(q + RANK) % 3 + 1 for q in range(P)]
    x = torch.cat([block(r * 3, RANK, q) for q, r in enumerate(rows)]).reshape(-1, 3)
    y = torch.empty(sum(rows), 3, dtype=dtype)
    dist.all_to_all_single(y, x, output_split_sizes=rows, input_split_sizes=rows)
    same(y, torch.cat([block(r * 3, q, RANK) for q, r in enumerate(rows)]).reshape(-1, 3), "uneven")
    outs = [torch.empty(r, dtype=dtype) for r in rows]
    dist.all_to_all(outs, [block(r, RANK, q) for q, r in enumerate(rows)])
    for q, r in enumerate(rows):
        same(outs[q], block(r, q, RANK), f"all_to_all: block from {q}")


def raw(n, dtype, sender, salt):
    """``n`` elements of ``dtype`` whose bytes are random per sender and salt (NaNs and subnormals among them)."""
    g = torch.Generator().manual_seed(1000 * salt + sender)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
    return torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8).view(dtype)


def same_bytes(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), what


P2P_DTYPES = [*DTYPES, torch.bool, torch.int8, torch.complex64]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.bool])
def test_flags_and_bytes_reduce_as_gloo(gloo, dtype):
    """uint8, int8 and bool, which gloo reduces and ddlkernels' kernels do not (MPI's own reductions): every op
    gloo takes, all_reduce, reduce, reduce_scatter and reduce_scatter_tensor (in place too), sums that wrap."""
    ops = {**OPS, "product": dist.ReduceOp.PRODUCT}
    for n in (0, 1, P + 1, 257):
        def x(salt):
            v = raw(n * P, dtype, RANK, salt)
            return v if dtype == torch.bool else v % 7 + (100 if salt % 2 else 0)  # products stay small sometimes

        for k, (name, op) in enumerate(ops.items()):
            t, ref = x(k), ref_of(x(k), op, gloo)
            dist.all_reduce(t, op=op)
            same_bytes(t, ref, f"all_reduce {name} of {n * P} {dtype}")
            summed = ref_of(x(k + 10), op, gloo)
            for root in range(P):
                r = x(k + 10)
                dist.reduce(r, dst=root, op=op)
                same_bytes(r, summed if RANK == root else x(k + 10), f"reduce {name} to {root}")
            full = ref_of(x(k + 20), op, gloo)[RANK * n:(RANK + 1) * n]
            shard = torch.empty(n, dtype=dtype)
            SCATTER_FROM(shard, x(k + 20), op=op)
            same_bytes(shard, full, f"{SCATTER_FROM.__name__} {name} of {n} {dtype}")
            shard2 = torch.empty(n, dtype=dtype)
            dist.reduce_scatter(shard2, list(x(k + 20).chunk(P)) if n else [torch.empty(0, dtype=dtype)] * P, op=op)
            same_bytes(shard2, full, f"reduce_scatter {name} of {n} {dtype}")
            inplace = x(k + 20)
            SCATTER_FROM(inplace[RANK * n:(RANK + 1) * n], inplace, op=op)
            same_bytes(inplace[RANK * n:(RANK + 1) * n], full, f"in-place {SCATTER_FROM.__name__} {name}")
    # Coalesced beside a dtype of ddlkernels' own, as one call
    mixed = [raw(5, dtype, RANK, 40), data(9, torch.float32, salt=40)]
    refs = [ref_of(m.clone(), dist.ReduceOp.MAX, gloo) for m in mixed]
    with dist._coalescing_manager():
        for m in mixed:
            dist.all_reduce(m, op=dist.ReduceOp.MAX)
    for m, r in zip(mixed, refs):
        same_bytes(m, r, f"coalesced MAX of {m.dtype}")
    with pytest.raises(ValueError, match="not AVG"):
        dist.all_reduce(torch.ones(3, dtype=dtype), op=dist.ReduceOp.AVG)


def ref_of(t, op, gloo):
    """gloo's all_reduce of ``t``, a bool's bytes made 0 or 1 (gloo adds bools as bytes: True is 2 and more)."""
    dist.all_reduce(t, op=op, group=gloo)
    return t.view(torch.uint8).ne(0) if t.dtype == torch.bool else t


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.int16, torch.complex64, torch.float32])
def test_all_gather_of_any_dtype_moves_every_byte(gloo, dtype):
    """all_gather and all_gather_into_tensor of dtypes ddlkernels does not reduce (FSDP2 gathers mixed parameters
    as uint8): byte counts of words of 8, of 4 and of neither, tensors off a word's boundary, in place."""
    for n in (0, 1, 3, 4, 8, 13, 4096):
        x = raw(n, dtype, RANK, 90 + n)
        want = torch.cat([raw(n, dtype, q, 90 + n) for q in range(P)])
        outs = [torch.empty(n, dtype=dtype) for _ in range(P)]
        dist.all_gather(outs, x)
        same_bytes(torch.cat(outs), want, f"all_gather of {n} {dtype}")
        cols = torch.zeros(n, P, dtype=dtype)  # outputs that are not contiguous: a column each
        dist.all_gather([cols[:, q] for q in range(P)], x)
        same_bytes(cols.t().contiguous().reshape(-1), want, f"all_gather of {n} {dtype} into columns")
        # Input and output one byte into a buffer: no word view of either.
        size = x.element_size()
        buf = torch.empty((n * P + 1) * size + 1, dtype=torch.uint8)
        src = torch.empty((n + 1) * size + 1, dtype=torch.uint8)[1:1 + n * size]
        src.copy_(x.view(torch.uint8).reshape(-1))
        out = buf[1:1 + n * P * size]
        GATHER_INTO(out, src)
        same_bytes(out, want.reshape(-1).view(torch.uint8), f"all_gather_into_tensor of {n} {dtype}, off by one")
        whole = torch.empty(n * P, dtype=dtype)  # in place: the input is this rank's block of the output
        whole[RANK * n:(RANK + 1) * n] = x
        GATHER_INTO(whole, whole[RANK * n:(RANK + 1) * n])
        same_bytes(whole, want, f"in-place all_gather_into_tensor of {n} {dtype}")


def test_object_collectives(gloo):
    """torch's object collectives, made of all_gather and broadcast of uint8 and int64, and of send and recv."""
    obj = {"rank": RANK, "list": list(range(RANK + 1)), "text": "x" * (RANK * 7 + 1)}
    every = [None] * P
    dist.all_gather_object(every, obj)
    assert every == [{"rank": q, "list": list(range(q + 1)), "text": "x" * (q * 7 + 1)} for q in range(P)]
    for root in range(P):
        objs = [f"from {root}", root * 10, None] if RANK == root else [None] * 3
        dist.broadcast_object_list(objs, src=root)
        assert objs == [f"from {root}", root * 10, None]
        got = [None] * P if RANK == root else None
        dist.gather_object(("g", RANK), got, dst=root)
        assert RANK != root or got == [("g", q) for q in range(P)]
        mine = [None]
        dist.scatter_object_list(mine, [f"s{root}.{q}" for q in range(P)] if RANK == root else None, src=root)
        assert mine == [f"s{root}.{RANK}"]
    if P > 1:
        if RANK == 0:
            dist.send_object_list([{"to": 1}, "x"], dst=1)
        elif RANK == 1:
            got = [None, None]
            dist.recv_object_list(got, src=0)
            assert got == [{"to": 1}, "x"]


def test_point_to_point_moves_every_byte_in_call_order(gloo):
    """A ring of isend/irecv pairs (batch_isend_irecv), every dtype and size; tags matched out of call order;
    two messages on one tag in call order; a receive from any rank names its sender."""
    nxt, prv = (RANK + 1) % P, (RANK - 1) % P
    for k, dtype in enumerate(P2P_DTYPES):
        for n in SIZES:
            got = torch.empty(n, dtype=dtype)
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, prv), dist.P2POp(dist.isend,
                                                                                       raw(n, dtype, RANK, k), nxt)])
            for w in works:
                w.wait()
            same_bytes(got, raw(n, dtype, prv, k), f"ring of {n} {dtype}")
    # Tags: sent 5 then 3, received 3 then 5; 32 on tag 7 arrive in the order they were sent.
    tags = (5, 3, *[7] * 32)
    sends = [dist.isend(raw(9, torch.float32, RANK, 50 + i), dst=nxt, tag=t) for i, t in enumerate(tags)]
    bufs = [torch.empty(9) for _ in tags]
    for i in (1, 0, *range(2, len(tags))):
        dist.recv(bufs[i], src=prv, tag=tags[i])
    for w in sends:
        w.wait()
    for i, buf in enumerate(bufs):
        same_bytes(buf, raw(9, torch.float32, prv, 50 + i), f"message {i} by tag and order")
    # From any rank: rank 0 hears every other rank, in whatever order they arrive, and learns who sent what.
    if RANK == 0:
        heard = set()
        for _ in range(P - 1):
            buf = torch.empty(17, dtype=torch.int64)
            src = dist.recv(buf, tag=11)
            heard.add(src)
            same_bytes(buf, raw(17, torch.int64, src, 60), f"from rank {src}, received from any rank")
        assert heard == set(range(1, P)), heard
    else:
        dist.send(raw(17, torch.int64, RANK, 60), dst=0, tag=11)


def test_a_message_waits_for_no_collective(gloo):
    """A send and a receive each called before a collective the peer makes first: neither waits behind the
    other's queue (a message larger than any eager limit: the send completes only once it is received)."""
    if P < 2:
        pytest.skip("messages between ranks need 2 ranks")
    n = 3 << 20  # 12 MiB of float32
    g, gref = data(41, torch.float32, salt=8), data(41, torch.float32, salt=8)
    dist.all_reduce(gref, group=gloo)
    g2 = g.clone()
    got = torch.empty(n)
    if RANK == 0:  # sends, then reduces; rank 1 reduces, then receives
        w = dist.isend(raw(n, torch.float32, 0, 70), dst=1)
        dist.all_reduce(g)
        w.wait()
    elif RANK == 1:
        dist.all_reduce(g)
        assert dist.recv(got, src=0) == 0
        same_bytes(got, raw(n, torch.float32, 0, 70), "the message sent before a collective")
    else:
        dist.all_reduce(g)
    if RANK == 1:  # the other way round: rank 1 receives, then reduces; rank 0 reduces, then sends
        r = dist.irecv(got, src=0)
        h = dist.all_reduce(g2, async_op=True)
        r.wait()
        h.wait()
        assert r._source_rank() == 0
        same_bytes(got, raw(n, torch.float32, 0, 71), "the message received before a collective")
    elif RANK == 0:
        dist.all_reduce(g2)
        dist.send(raw(n, torch.float32, 0, 71), dst=1)
    else:
        dist.all_reduce(g2)
    same(g, gref, "the all_reduce between the messages")
    same(g2, gref, "the second all_reduce between the messages")


def test_a_message_of_another_size_raises_where_it_lands(gloo):
    if P < 2:
        pytest.skip("messages between ranks need 2 ranks")
    if RANK == 0:
        for n in (5, 3):
            dist.send(raw(n, torch.float32, 0, 80), dst=1, tag=n)
    elif RANK == 1:
        with pytest.raises(ValueError, match="longer message"):
            dist.recv(torch.empty(4), src=0, tag=5)
        with pytest.raises(ValueError, match="got a message of 12 bytes"):
            dist.recv(torch.empty(4), src=0, tag=3)
    t = data(7, torch.int32, salt=9)  # the group goes on
    ref = t.clone()
    dist.all_reduce(t)
    dist.all_reduce(ref, group=gloo)
    same(t, ref, "after the mismatched messages")


def test_a_receive_left_at_shutdown_fails_and_nothing_hangs(gloo):
    sub = dist.new_group(list(range(P)), backend=pg_module.BACKEND)
    w = dist.irecv(torch.empty(3), src=RANK, tag=99, group=sub)  # nobody sends it
    messages = sub._messages
    dist.destroy_process_group(sub)
    with pytest.raises(RuntimeError, match="shut down before this recv completed"):
        w.wait()
    assert messages._thread is None or not messages._thread.is_alive(), "the poller outlived its group"


def test_a_pipeline_of_a_stage_a_rank_trains_as_one_process(gloo):
    """torch.distributed.pipelining's GPipe over the group's messages (activations forward, gradients back, 4
    microbatches through P stages): the last stage's losses are one process's bits, every stage's gradients
    within rounding of one process's."""
    pipelining = pytest.importorskip("torch.distributed.pipelining", reason="torch without pipelining")
    if P < 2:
        pytest.skip("a pipeline needs 2 ranks or more")

    def layer(q):
        torch.manual_seed(1000 + q)
        return torch.nn.Linear(8, 8)

    def loss_fn(out, y):
        return ((out - y) ** 2).mean()

    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    mine = layer(RANK)
    stage = pipelining.PipelineStage(mine, stage_index=RANK, num_stages=P, device=torch.device("cpu"))
    schedule = pipelining.ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn, scale_grads=True)
    losses = []
    if RANK == 0:
        schedule.step(x)
    elif RANK == P - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    chain = torch.nn.Sequential(*[layer(q) for q in range(P)])
    ref = [loss_fn(chain(xb), yb) for xb, yb in zip(x.chunk(4), y.chunk(4))]
    (sum(ref) / 4).backward()
    if RANK == P - 1:
        assert [float(v) for v in losses] == [float(v) for v in ref], "the pipeline's losses"
    for got, want in zip(mine.parameters(), chain[RANK].parameters()):
        assert torch.allclose(got.grad, want.grad, rtol=1e-5, atol=1e-7), f"stage {RANK}'s gradients"


def test_ddp_on_the_group_trains_as_ddp_on_gloo(gloo):
    """A few SGD steps of DDP with momentum (small buckets: several per step) on data unique to each rank."""
    def train(group):
        torch.manual_seed(3)
        m = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(m, process_group=group, bucket_cap_mb=0.002)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for step in range(4):
            g = torch.Generator().manual_seed(7919 * step + RANK)
            x, y = torch.randn(6, 10, generator=g), torch.randint(0, 4, (6,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    ours, theirs = train(None), train(gloo)
    assert_same_on_all_ranks(COMM, ours.numpy(), "DDP on the ddlkernels group")
    # Sums of the same gradients in another order: float32 rounding apart (test_torch_ddp.py's tolerance).
    err = (ours - theirs).abs()
    assert torch.all(err <= 1e-6 + 2e-6 * theirs.abs()), f"max difference {float(err.max()):.3g} from gloo"


def test_fsdp2_on_the_group_trains_as_one_process(gloo):
    """FSDP2 (``fully_shard``: parameters sharded, gathered in place, gradients reduce-scattered) over the
    ddlkernels group: after a few SGD steps the gathered parameters match one process training the same
    model on every rank's data (the mean of the per-rank losses)."""
    fsdp = pytest.importorskip("torch.distributed.fsdp", reason="torch without FSDP")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("torch without FSDP2 (fully_shard, torch >= 2.6)")
    from torch.distributed.device_mesh import init_device_mesh

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def inputs(step, rank):
        return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))

    mesh = init_device_mesh("cpu", (P,))  # its group: a new one of the default backend, ddlkernels
    model, ref = make(), make()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        model(inputs(step, RANK)).square().sum().backward()
        opt.step()
        ropt.zero_grad()
        (sum(ref(inputs(step, q)).square().sum() for q in range(P)) / P).backward()
        ropt.step()
    got = {k: v.full_tensor() for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), f"{k}: {float((got[k] - v).abs().max()):.3g}"


def test_a_group_of_some_ranks(gloo):
    if P < 2:
        pytest.skip("a group of some ranks needs 2 ranks or more")
    members = list(range(0, P, 2)) if P > 2 else [1]
    sub = dist.new_group(members, backend=pg_module.BACKEND)
    x = data(37, torch.int32, salt=6)
    if RANK in members:
        got = x.clone()
        dist.all_reduce(got, group=sub)
        want = sum(data(37, torch.int32, salt=6, rank=q).long() for q in members).to(torch.int32)
        same(got, want, "all_reduce over the group's ranks")
        assert dist.get_rank(sub) == members.index(RANK) and dist.get_world_size(sub) == len(members)
        engine = sub._state.engine
        dist.destroy_process_group(sub)
        assert engine.closed, "the group's progress thread outlived the group"
    dist.barrier()


def test_refusals_come_before_any_message(gloo):
    cases = [(lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.BAND), ValueError,
              "SUM, AVG, MAX, MIN and PRODUCT"),
             (lambda: dist.all_reduce(torch.ones(4, 4).t()), ValueError, "contiguous"),
             (lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16)), TypeError, "int16"),
             (lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool), op=dist.ReduceOp.AVG), ValueError, "not AVG"),
             (lambda: dist.all_to_all_single(torch.empty(P), torch.ones(P), [1] * P, [2] * P), ValueError,
              "do not cut")]
    world = dist.group.WORLD
    cases += [(lambda: world.send([torch.ones(1)], P, 0), ValueError, f"rank {P} of a group of {P}"),
              (lambda: dist.isend(torch.ones(1), dst=RANK, tag=-1), ValueError, "tags 0 to"),
              (lambda: dist.irecv(torch.ones(4, 4).t(), src=RANK), ValueError, "contiguous")]
    for call, err, match in cases:
        with pytest.raises(err, match=match):
            call()
    if P > 1:  # a collective a peer has not joined yet: wait() gives up after its timeout
        late = torch.ones(3)
        w = dist.all_reduce(late, async_op=True) if RANK == 0 else None
        if RANK == 0:
            with pytest.raises(RuntimeError, match="did not complete within"):
                w.wait(timeout=datetime.timedelta(milliseconds=200))
        COMM.Barrier()
        if RANK != 0:
            dist.all_reduce(late)
        else:
            w.wait()
        assert torch.equal(late, torch.full((3,), float(P))), "the late collective"
    t = data(11, torch.float32, salt=7)  # nobody sent anything: the next collective pairs up as ever
    ref = t.clone()
    dist.all_reduce(t)
    dist.all_reduce(ref, group=gloo)
    same(t, ref, "after the refusals")


def test_the_group_timeout_ends_a_wait_for_a_rank_that_does_not_come(gloo):
    """torch's ``timeout=`` of a group: a collective no other rank joins fails with ``CollectiveTimeout`` naming
    it, so does one queued behind it, and the group refuses every later collective (its messages are in
    flight); a receive nobody sends gives up at its wait().  The late ranks then join the barrier, so nothing
    is left in flight."""
    if P < 2:
        pytest.skip("a rank that does not come needs 2 ranks")
    # 1.5 s: long beside the late barrier's skew between ranks on a loaded machine, short for the suite
    sub = dist.new_group(backend=pg_module.BACKEND, timeout=datetime.timedelta(seconds=1.5))
    assert sub._watchdog.timeout == 1.5 and sub.communicator.timeout is None  # a watchdog, not a deadline
    if RANK == 0:
        first = dist.barrier(group=sub, async_op=True)
        behind = dist.all_reduce(torch.ones(3), group=sub, async_op=True)
        for w in (first, behind):
            with pytest.raises(ddlkernels.CollectiveTimeout, match="barrier timed out after 1.5 s on rank 0"):
                w.wait()
        with pytest.raises(RuntimeError, match="unusable"):
            dist.all_reduce(torch.ones(3), group=sub)
    else:
        w = dist.irecv(torch.empty(2), src=0, tag=5, group=sub)
        with pytest.raises(RuntimeError, match="a recv from rank 0 did not complete within 1.5 s"):
            w.wait()
    COMM.Barrier()
    if RANK != 0:
        dist.barrier(group=sub)  # completes rank 0's abandoned one
    else:
        for q in range(1, P):
            dist.send(torch.ones(2), dst=q, group=sub, tag=5)  # the receives left posted complete
    dist.destroy_process_group(sub)
    t = data(5, torch.float32, salt=12)  # the default group goes on
    ref = t.clone()
    dist.all_reduce(t)
    dist.all_reduce(ref, group=gloo)
    same(t, ref, "the default group after a subgroup timed out")


def test_torch_ranks_must_be_mpis():
    """The default group's creator refuses torch ranks other than MPI's (every rank alike, nothing sent)."""
    wrong = types.SimpleNamespace(global_ranks_in_group=[], group_rank=(RANK + 1) % P, group_size=P)
    if P > 1:
        with pytest.raises(RuntimeError, match="init_process_group"):
            pg_module._create(wrong)
    with pytest.raises(RuntimeError, match="init_process_group"):
        pg_module._create(types.SimpleNamespace(global_ranks_in_group=[], group_rank=RANK, group_size=P + 1))
