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
                                   fusion_bytes=400)
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
                                   fusion_bytes=400)
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
