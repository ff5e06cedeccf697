"""ddlkernels.torch under any rank count: DistributedOptimizer, broadcast_parameters, bad input.

Every rank trains on its own data; after every step the parameters must be
bitwise identical on all ranks, equal to the update with the rank-averaged
gradient, and identical whether the reductions overlap backward or not.
"""

import copy
import importlib
import sys

import numpy as np
import pytest
from mpi4py import MPI

from helpers import assert_same_on_all_ranks

torch = pytest.importorskip("torch", reason="torch not installed (pip install -e .[torch])")
ddt = importlib.import_module("ddlkernels.torch")

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
torch.set_num_threads(1)


class MLP(torch.nn.Sequential):
    """A Sequential whose child named "unused" takes no part in forward (so it never gets a gradient)."""

    def forward(self, x):
        for name, m in self.named_children():
            if name != "unused":
                x = m(x)
        return x


def mlp(seed=0, extra=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)]
    m = MLP(*layers)
    if extra:
        m.add_module("unused", torch.nn.Linear(3, 2))
    return m


def rank_batch(step, rank, n=6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def params_bytes(model):
    return np.concatenate([p.detach().numpy().reshape(-1).view(np.uint8) for p in model.parameters()])


def train(model, opt, steps, bpps=1):
    for s in range(steps):
        opt.zero_grad()
        for k in range(bpps):
            x, y = rank_batch(s * bpps + k, RANK)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        assert_same_on_all_ranks(COMM, params_bytes(model), f"parameters after step {s}")


@pytest.mark.parametrize("overlap,progress", [(True, "thread"), (True, "hooks"), (False, "thread")])
def test_every_step_identical_on_all_ranks_and_equal_to_averaged_gradient(overlap, progress):
    model = mlp(seed=1)
    ref = copy.deepcopy(model)
    opt = ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   fusion_bytes=700, overlap=overlap, progress=progress)
    assert isinstance(opt, torch.optim.SGD)
    assert len(opt._ddl_buckets) > 1  # small buckets: several reductions per step
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(3):
        opt.zero_grad()
        x, y = rank_batch(s, RANK)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        # Reference: every rank's gradient, computed here from the same data, averaged in float64.
        ref_opt.zero_grad()
        grads = []
        for r in range(P):
            ref.zero_grad()
            xr, yr = rank_batch(s, r)
            torch.nn.functional.cross_entropy(ref(xr), yr).backward()
            grads.append([p.grad.double().clone() for p in ref.parameters()])
        for k, p in enumerate(ref.parameters()):
            p.grad = (sum(g[k] for g in grads) / P).float()
        ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"step {s}: {name} differs from the averaged update"
        assert_same_on_all_ranks(COMM, params_bytes(model), f"parameters after step {s}")
        # The reference follows the distributed model exactly from here on.
        ref.load_state_dict(model.state_dict())


@pytest.mark.parametrize("small_bytes", [0, 1 << 20])
def test_overlap_on_and_off_give_the_same_bits(small_bytes):
    """With the algorithm pinned (the ring, or MPI_Allreduce below small_bytes), overlap changes no bit.

    The progress thread works on its own Communicator, which takes the
    caller's settings; MPI_Iallreduce ("hooks") may add in another order than
    MPI_Allreduce.  Left to the tuner, the two communicators could settle on
    different algorithms for a size, which add in different orders.
    """
    import ddlkernels

    runs = []
    with ddlkernels.Communicator(COMM, small_bytes=small_bytes) as dc:
        for overlap in (True, False):
            model = mlp(seed=2)
            opt = ddt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model.named_parameters(),
                                           fusion_bytes=500, overlap=overlap, progress="thread", comm=dc)
            train(model, opt, 3)
            runs.append(params_bytes(model))
    assert np.array_equal(runs[0], runs[1])


def test_backward_passes_per_step_accumulates_then_reduces_once():
    model = mlp(seed=3)
    opt = ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   backward_passes_per_step=2, fusion_bytes=600)
    twin = copy.deepcopy(model)
    twin_opt = ddt.DistributedOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1), twin.named_parameters(),
                                        fusion_bytes=600)
    for s in range(2):
        opt.zero_grad()
        x0, y0 = rank_batch(2 * s, RANK)
        torch.nn.functional.cross_entropy(model(x0), y0).backward()
        assert opt._ddl_next == 0, "a reduction started before the last backward pass"
        x1, y1 = rank_batch(2 * s + 1, RANK)
        torch.nn.functional.cross_entropy(model(x1), y1).backward()
        assert opt._ddl_next == len(opt._ddl_buckets)
        opt.step()
        # Same gradient in one backward pass: the sum of both losses.
        twin_opt.zero_grad()
        (torch.nn.functional.cross_entropy(twin(x0), y0) + torch.nn.functional.cross_entropy(twin(x1), y1)).backward()
        twin_opt.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)
        assert_same_on_all_ranks(COMM, params_bytes(model), f"step {s}")
    opt.zero_grad()
    for k in range(2):
        torch.nn.functional.cross_entropy(model(x0), y0).backward()
    with pytest.raises(RuntimeError, match="computed 3 times before step"):
        torch.nn.functional.cross_entropy(model(x0), y0).backward()
    opt.synchronize()  # the buckets started by the second pass finish; nothing is left in flight
    COMM.Barrier()


def test_broadcast_parameters_from_any_root():
    for root in sorted({0, P - 1}):
        model = mlp(seed=10 + RANK)  # different weights on every rank
        model.register_buffer("steps", torch.tensor(RANK, dtype=torch.int64))
        model.register_buffer("bf16", torch.full((3,), RANK + 0.5, dtype=torch.bfloat16))
        theirs = COMM.bcast(params_bytes(model) if RANK == root else None, root=root)
        ddt.broadcast_parameters(model.state_dict(), root=root)
        assert np.array_equal(params_bytes(model), theirs)
        assert int(model.steps) == root and float(model.bf16[0]) == root + 0.5
        assert_same_on_all_ranks(COMM, params_bytes(model), "after broadcast")


def test_parameter_without_gradient_is_an_error_on_every_rank_then_training_continues():
    model = mlp(seed=4, extra=True)  # "unused" never takes part in forward
    opt = ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   fusion_bytes=400, missing_grads="error")
    x, y = rank_batch(0, RANK)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match=r"did not receive a gradient.*rank 0: 'unused.bias' \(0 of 1\), 'unused.weight' \(0 of 1\)"):
        opt.step()
    COMM.Barrier()


def test_gradient_missing_on_one_rank_only_raises_everywhere_without_hang():
    if P == 1:
        pytest.skip("needs 2 or more ranks to disagree")
    model = mlp(seed=5)
    opt = ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   fusion_bytes=400, missing_grads="error")
    x, y = rank_batch(0, RANK)
    if RANK == P - 1:
        out = model[:3](x)  # skips the last two layers: their gradients never come
        out.sum().backward()
    else:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match=rf"rank {P - 1}: '4.bias' \(0 of 1\), '4.weight' \(0 of 1\)"):
        opt.step()
    # Nothing is left in flight: a normal step works on every rank.
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert_same_on_all_ranks(COMM, params_bytes(model), "after recovery")


def test_different_models_on_different_ranks_raise_on_every_rank():
    if P == 1:
        pytest.skip("needs 2 or more ranks to disagree")
    model = mlp(seed=6, extra=RANK == P - 1)
    with pytest.raises(ValueError, match=r"DistributedOptimizer: ranks passed different arguments: rank 0 passed "
                                         r"\d+ tensors, rank \d+ \d+"):
        ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    model = mlp(seed=6)
    if RANK == P - 1:
        model[4] = torch.nn.Linear(16, 4)
    with pytest.raises(ValueError, match=r"tensor \d+ is 4.bias float32\[3\] on rank 0 but 4.bias float32\[4\] on rank"):
        ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    sd = mlp(seed=6).state_dict()
    if RANK == 0:
        del sd["4.bias"]
    with pytest.raises(ValueError, match="broadcast_parameters: ranks passed different arguments"):
        ddt.broadcast_parameters(sd)
    COMM.Barrier()


def test_local_bad_input():
    model = mlp(seed=7)
    model[0].weight = torch.nn.Parameter(torch.zeros(16, 8, device="meta"))
    with pytest.raises(ValueError, match=r"one device, but '0.weight' is on meta and '0.bias' on cpu"):
        ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    model = mlp(seed=7)
    with pytest.raises(ValueError, match="does not name 2 parameter"):
        ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), list(model.named_parameters())[2:])
    with pytest.raises(ValueError, match="'avg' or 'sum'"):
        ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op="max")
    with pytest.raises(ValueError, match="backward_passes_per_step must be a positive int"):
        ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="missing_grads must be 'zeros' or 'error'"):
        ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), missing_grads="skip")
    with pytest.raises(TypeError, match="compress\\(\\) and decompress\\(\\)"):
        ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=object())
    with pytest.raises(ValueError, match="compression 'fp8'"):
        ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression="fp8")
    with pytest.raises(ValueError, match=r"progress='hooks' .* travel as \['float16'\]"):
        ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression="fp16", progress="hooks")
    COMM.Barrier()


def test_missing_torch_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    monkeypatch.delitem(sys.modules, "ddlkernels.torch")
    with pytest.raises(ImportError, match=r"pip install ddlkernels\[torch\]"):
        importlib.import_module("ddlkernels.torch")
    monkeypatch.undo()
    assert importlib.import_module("ddlkernels.torch") is not None


def test_progress_auto_hooks_for_float32_thread_for_bfloat16():
    model = mlp(seed=8)
    opt = ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    assert opt.ddl_progress == "hooks"
    model = mlp(seed=8).to(torch.bfloat16)
    opt = ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   fusion_bytes=300)
    assert opt.ddl_progress == "thread"  # MPI_Iallreduce cannot add bfloat16
    for s in range(2):
        opt.zero_grad()
        x, y = rank_batch(s, RANK)
        torch.nn.functional.cross_entropy(model(x.to(torch.bfloat16)), y).backward()
        opt.step()
        raw = np.concatenate([p.detach().view(torch.int16).numpy().reshape(-1).view(np.uint8) for p in model.parameters()])
        assert_same_on_all_ranks(COMM, raw, f"bfloat16 step {s}")


@pytest.mark.parametrize("name,ours", [("SUM", "sum"), ("AVG", "avg"), ("MAX", "max"), ("MIN", "min"),
                                       ("PRODUCT", "prod")])
def test_torch_reduce_ops_are_accepted_everywhere_an_op_is(name, ours):
    import torch.distributed as dist

    import ddlkernels

    kind = getattr(dist.ReduceOp, name)
    x = torch.arange(1, 8, dtype=torch.float64) * (RANK + 1) / 4  # exact in float64 under every op here
    want = ddlkernels.allreduce(x, ours)
    for op in (kind, dist.ReduceOp(kind)):  # the RedOpType member and a ReduceOp holding it
        assert torch.equal(ddlkernels.allreduce(x, op), want)
        got = torch.empty_like(x)
        ddlkernels.Allreduce(x, got, op)
        assert torch.equal(got, want)
        assert torch.equal(ddlkernels.allreduce_many_async([x], op).wait()[0], want)


def test_bitwise_and_premul_torch_ops_are_refused_before_any_message():
    import torch.distributed as dist

    import ddlkernels

    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BXOR, dist.ReduceOp.PREMUL_SUM):
        with pytest.raises(ValueError, match="ReduceOp SUM, AVG, MAX, MIN and PRODUCT"):
            ddlkernels.allreduce(torch.ones(3), op)
    COMM.Barrier()


# -- Horovod parity: compression, gradients missing on some ranks, broadcasts -------------------


def averaged_reference(model, step, batch_of=rank_batch, loss_of=None):
    """Every rank's gradient of ``model`` (a copy, on this rank's data for each rank), averaged in float64:
    ``{name: (mean gradient, mean |gradient|)}``; a parameter no rank has a gradient for is absent."""
    sums, abss = {}, {}
    for r in range(P):
        ref = copy.deepcopy(model)
        ref.zero_grad(set_to_none=True)
        x, y = batch_of(step, r)
        (loss_of(ref, x, y, r) if loss_of else torch.nn.functional.cross_entropy(ref(x), y)).backward()
        for name, p in ref.named_parameters():
            if p.grad is not None:
                g = p.grad.double()
                sums[name] = sums.get(name, 0) + g
                abss[name] = abss.get(name, 0) + g.abs()
    return {n: (sums[n] / P, abss[n] / P) for n in sums}


@pytest.mark.parametrize("compression,unit,tiny", [("fp16", 2.0**-11, 2.0**-25), ("bf16", 2.0**-8, 2.0**-134)])
@pytest.mark.parametrize("overlap", [True, False])
def test_compressed_gradients_are_the_average_within_the_wire_types_rounding(compression, unit, tiny, overlap):
    """Each rank's gradient / P rounds once to 16 bits, and every partial sum of the ring once more: P
    roundings of at most ``unit`` times the mean |gradient| each (plus one of the sum; ``tiny``: half the
    spacing of the wire type's subnormals, the rounding's floor), and the same bits on every rank."""
    comp = {"fp16": ddt.Compression.fp16, "bf16": ddt.Compression.bf16}[compression]
    model = mlp(seed=11)
    opt = ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   fusion_bytes=700, compression=comp, overlap=overlap, progress="thread")
    from ddlkernels._dtypes import dtype_name

    assert {dtype_name(b.dtype) for b in opt._ddl_buckets} == {{"fp16": "float16", "bf16": "bfloat16"}[compression]}
    for s in range(3):
        ref = averaged_reference(model, s)
        opt.zero_grad()
        x, y = rank_batch(s, RANK)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        for name, p in model.named_parameters():
            mean, mean_abs = ref[name]
            err = (p.grad.double() - mean).abs()
            bound = (P + 1) * (unit * mean_abs + tiny)
            assert torch.all(err <= bound), f"step {s} {name}: error {float((err - bound).max())} over the bound"
        with opt.skip_synchronize():
            opt.step()
        assert_same_on_all_ranks(COMM, params_bytes(model), f"{compression} step {s}")


def test_fp16_compression_divides_first_so_a_sum_past_65504_does_not_overflow():
    """Every rank's gradient is 40000 (exact in float16); the sum over 2 or more ranks passes float16's
    largest value 65504, the average does not."""
    model = mlp(seed=12)
    opt = ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   compression=ddt.Compression.fp16)
    opt.zero_grad()
    (40000.0 * sum(p.sum() for p in model.parameters())).backward()
    opt.synchronize()
    for name, p in model.named_parameters():
        assert torch.all(torch.isfinite(p.grad)), name
        assert torch.allclose(p.grad, torch.full_like(p.grad, 40000.0), rtol=(P + 1) * 2.0**-11, atol=0), name
    opt.zero_grad()


class Branchy(torch.nn.Module):
    """``b`` takes part in forward only where asked (some ranks), ``never`` nowhere."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(13)
        self.a, self.b, self.never = torch.nn.Linear(8, 3), torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)

    def forward(self, x, use_b=False):
        return self.a(x) + self.b(x) if use_b else self.a(x)


def _branchy_loss(model, x, y, rank):
    return torch.nn.functional.cross_entropy(model(x, use_b=rank % 2 == 0), y)


@pytest.mark.parametrize("compression", [None, "fp16"])
@pytest.mark.parametrize("progress", ["thread", "hooks"])
def test_missing_gradients_are_averaged_as_zeros_and_none_anywhere_stays_none(compression, progress):
    """Horovod's behaviour: ``b`` (used on even ranks only) gets the sum of the even ranks' gradients / P
    on every rank; ``never`` (used nowhere) keeps ``grad = None``, so SGD with momentum and weight decay
    leaves it alone, as one process would."""
    if compression is not None and progress == "hooks":
        pytest.skip("MPI_Iallreduce cannot add float16")
    model = Branchy()
    never = model.never.weight.detach().clone()
    opt = ddt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1),
                                   model.named_parameters(), fusion_bytes=64, compression=compression,
                                   progress=progress)
    unit, tiny = (0.0, 0.0) if compression is None else (2.0**-11, 2.0**-25)
    for s in range(2):
        ref = averaged_reference(model, s, loss_of=_branchy_loss)
        assert "never.weight" not in ref and ("b.weight" in ref)
        opt.zero_grad()
        x, y = rank_batch(s, RANK)
        _branchy_loss(model, x, y, RANK).backward()
        opt.synchronize()
        for name, p in model.named_parameters():
            if name.startswith("never"):
                assert p.grad is None, name
                continue
            mean, mean_abs = ref[name]
            bound = (P + 1) * (unit * mean_abs + tiny) + 1e-6 * mean_abs + 1e-9  # float32 sums: 1e-6 relative
            assert torch.all((p.grad.double() - mean).abs() <= bound), f"step {s} {name}"
        with opt.skip_synchronize():
            opt.step()
        assert torch.equal(model.never.weight, never)
        assert_same_on_all_ranks(COMM, params_bytes(model), f"step {s}")


def test_broadcast_object_from_any_root():
    for root in sorted({0, P - 1}):
        mine = {"rank": RANK, "epoch": 10 * RANK, "t": torch.full((3,), float(RANK))}
        got = ddt.broadcast_object(mine, root_rank=root)
        assert got["rank"] == root and got["epoch"] == 10 * root and torch.equal(got["t"], torch.full((3,), float(root)))
    with pytest.raises(ValueError, match=r"root must be a rank in \[0, "):
        ddt.broadcast_object(1, root_rank=P)
    COMM.Barrier()


def _state_bytes(opt):
    sd = opt.state_dict()
    parts = []
    for k in sorted(sd["state"]):
        for name in sorted(sd["state"][k]):
            v = sd["state"][k][name]
            t = v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            parts.append(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def test_broadcast_optimizer_state_resumes_every_rank_from_the_roots_state():
    for root in sorted({0, P - 1}):
        model = mlp(seed=14)
        model.register_buffer("bf", torch.zeros(2, dtype=torch.bfloat16))
        # The root has stepped (Adam's moments and step counts exist); the others have not, and their
        # learning rate differs.
        base = torch.optim.Adam(model.parameters(), lr=0.01 if RANK == root else 0.5)
        if RANK == root:
            for s in range(2):
                base.zero_grad()
                x, y = rank_batch(s, RANK)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                base.step()
        ddt.broadcast_parameters(model.state_dict(), root=root)
        ddt.broadcast_optimizer_state(base, root_rank=root)
        assert base.param_groups[0]["lr"] == 0.01
        assert len(base.state_dict()["state"]) == len(list(model.parameters()))
        assert_same_on_all_ranks(COMM, _state_bytes(base), f"optimizer state from root {root}")
        # Training goes on from there in step, through the distributed optimizer.
        opt = ddt.DistributedOptimizer(base, model.named_parameters(), fusion_bytes=600)
        train(model, opt, 2)
        assert_same_on_all_ranks(COMM, _state_bytes(opt), "optimizer state after two more steps")


def test_broadcast_optimizer_state_refuses_different_groups_on_every_rank():
    if P == 1:
        pytest.skip("needs 2 or more ranks to disagree")
    model = mlp(seed=15)
    params = list(model.parameters())
    groups = [{"params": params}] if RANK else [{"params": params[:2]}, {"params": params[2:]}]
    with pytest.raises(ValueError, match="broadcast_optimizer_state: ranks passed different arguments"):
        ddt.broadcast_optimizer_state(torch.optim.SGD(groups, lr=0.1))
    COMM.Barrier()


# -- torch habits -------------------------------------------------------------------------


def test_all_reduce_is_in_place_as_torch_distributed_all_reduce():
    import torch.distributed as dist

    t = torch.arange(5, dtype=torch.float32) + 8 * RANK
    want = sum(torch.arange(5, dtype=torch.float32) + 8 * r for r in range(P))
    assert ddt.all_reduce(t) is None
    assert torch.equal(t, want)
    t = torch.arange(5, dtype=torch.int64) * (RANK + 1)
    h = ddt.all_reduce(t, dist.ReduceOp.MAX, async_op=True)
    h.wait()
    assert torch.equal(t, torch.arange(5, dtype=torch.int64) * P)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        ddt.all_reduce(np.zeros(3))
    COMM.Barrier()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_empty_results_have_torchs_own_strides(dtype):
    """A result with no element (an empty tensor reduced, a shard of a buffer shorter than the ranks) has the
    strides of ``torch.empty``: numpy gives empty arrays zero strides, and ``.view(torch.uint8)`` of a
    bfloat16 tensor with those raised in the caller's code."""
    import ddlkernels

    dt = getattr(torch, dtype)
    got = {"allreduce (0, 3)": ddlkernels.allreduce(torch.ones(0, 3, dtype=dt), "sum")}
    c = ddlkernels.Communicator(COMM)
    lo, hi = c.shard_range(1)
    got["reduce_scatter of 1"] = c.reduce_scatter(torch.ones(1, dtype=dt), "sum")  # empty past rank 0
    got["allgather of 0"] = c.allgather(torch.ones(0, dtype=dt), count=0)
    for what, t in got.items():
        assert t.dtype == dt and t.stride() == torch.empty(t.shape).stride(), f"{what}: strides {t.stride()}"
        t.view(torch.uint8)
    assert got["reduce_scatter of 1"].shape == (hi - lo,)
    c.free()


def test_set_device_pins_the_local_ranks_gpu(monkeypatch):
    import ddlkernels

    if not torch.cuda.is_available():
        assert ddt.set_device() == torch.device("cpu")
    picked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for count in (1, 2, P):
        monkeypatch.setattr(torch.cuda, "device_count", lambda c=count: c)
        monkeypatch.setattr(torch.cuda, "set_device", picked.append)
        dev = ddt.set_device()
        want = ddlkernels.device_index(count, ddlkernels.local_rank(), ddlkernels.local_size())
        assert dev == torch.device("cuda", want) and picked[-1] == want
