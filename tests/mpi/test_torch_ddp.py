"""DistributedDataParallel with ddlkernels' communication hooks, against DDP with torch's own gloo allreduce.

The process group comes from ``ddlkernels.torch.init_process_group`` (gloo,
rank and size from MPI).  A tiny model trains a few steps on data unique to
each rank, once with each hook and once with DDP's default allreduce; the
hook's parameters must be identical on every rank (bitwise) and within a
stated tolerance of the gloo run.
"""

import importlib

import pytest
from mpi4py import MPI

from helpers import assert_same_on_all_ranks

torch = pytest.importorskip("torch", reason="torch not installed (pip install -e .[torch])")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
ddt = importlib.import_module("ddlkernels.torch")

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
torch.set_num_threads(1)
STEPS, LR = 4, 0.1


@pytest.fixture(scope="module", autouse=True)
def process_group():
    ddt.init_process_group("gloo")
    yield
    COMM.Barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ring():
    """A HookState over a Communicator that always runs the ring."""
    import ddlkernels

    with ddlkernels.Communicator(COMM, small_bytes=0) as dc:
        state = ddt.HookState(dc)
        yield state
        state.engine.close()


def model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def batch(step, rank):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(6, 10, generator=g), torch.randint(0, 4, (6,), generator=g)


def train(hook=None, state=None):
    """STEPS of SGD with momentum through DDP (buckets of ~2 KB: several per step); the parameters, flat."""
    net = model()
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=2e-3)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    for s in range(STEPS):
        opt.zero_grad()
        x, y = batch(s, RANK)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def test_process_group_ranks_come_from_mpi():
    assert dist.get_rank() == RANK and dist.get_world_size() == P
    ddt.init_process_group("gloo")  # a second call changes nothing
    assert dist.get_world_size() == P


# Tolerances against torch's gloo run, stated: float32 sums in another order (torch divides each rank's
# bucket by P first, ddlkernels scales the sum) differ by a few ulps, which 4 steps of SGD carry into the
# parameters: at most 1e-6 absolute + 2e-6 relative with float32 on the wire (measured: 0 at 2 ranks, 3e-8
# at 3 and 1.5e-8 at 4).  The 16-bit wires round each gradient (float16: 11 significant bits, bfloat16: 8):
# 2e-4 + 1e-3 relative and 2e-3 + 1e-2 relative (measured at most 2.8e-5 and 1.7e-4 absolute, 2 to 4 ranks).
# The ring is pinned (small_bytes=0) where the state allows it: that is ddlkernels' own algorithm, and the
# size tuner then has nothing to try (its trials of every candidate cost seconds of one-time set-up here).
@pytest.mark.parametrize("hook,state,rtol,atol", [
    ("allreduce_hook", "ring", 2e-6, 1e-6),
    ("allreduce_hook", None, 2e-6, 1e-6),
    ("fp16_compress_hook", "ring", 1e-3, 2e-4),
    ("bfloat16_compress_hook", "ring", 1e-2, 2e-3),
])
def test_ddp_with_the_hook_matches_gloo_and_is_identical_on_every_rank(hook, state, rtol, atol, ring):
    st = ring if state == "ring" else state
    ours = train(getattr(ddt, hook), st)
    gloo = train()
    assert_same_on_all_ranks(COMM, ours.numpy(), f"{hook} parameters")
    err = (ours - gloo).abs()
    assert torch.all(err <= atol + rtol * gloo.abs()), f"{hook}: max difference {float(err.max()):.3g} from gloo"


def test_the_hook_returns_before_the_reduction_and_completes_the_future_later():
    """Rank 0 starts a bucket while the other ranks have not: the hook must return at once with a future
    not yet done (it cannot be: the others have not sent anything), which completes once they start."""
    if P == 1:
        pytest.skip("one rank reduces nothing")

    class Bucket:  # what DDP passes: buffer() is the flat gradient
        def __init__(self, t):
            self.t = t

        def buffer(self):
            return self.t

    state = COMM  # an mpi4py communicator as the state: its Communicator's HookState
    t = torch.arange(1000, dtype=torch.float32) * (RANK + 1)
    if RANK == 0:
        fut = ddt.allreduce_hook(state, Bucket(t))
        assert not fut.done()
        COMM.Barrier()  # only now the others start their part
    else:
        COMM.Barrier()
        fut = ddt.allreduce_hook(state, Bucket(t))
    got = fut.wait()
    assert got is t  # reduced in the bucket's own memory
    total = torch.arange(1000, dtype=torch.float32) * (P * (P + 1) // 2)  # exact
    # "avg" is the sum times 1/p, rounded in float32 (the reciprocal of 7 is not exact, so at 7 ranks that is not
    # always the exact quotient)
    assert torch.equal(t, total * torch.tensor(1 / P, dtype=torch.float32))


def test_a_failing_reduction_fails_the_future_on_every_rank():
    class Bucket:
        def buffer(self):
            return torch.zeros(4, dtype=torch.int8)

    if P == 1:
        pytest.skip("one rank reduces nothing")
    fut = ddt.allreduce_hook(None, Bucket())
    with pytest.raises(Exception, match="unsupported dtype int8"):
        fut.wait()
    COMM.Barrier()


def test_hook_state_refuses_what_is_not_a_communicator_and_a_world_of_another_size():
    class Bucket:
        def buffer(self):
            return torch.zeros(4)

    with pytest.raises(TypeError, match="torch's own hooks take a process group there"):
        ddt.allreduce_hook(dist.group.WORLD, Bucket())
    if P > 1:
        with pytest.raises(ValueError, match=f"communicator has 1 ranks but torch.distributed's world has {P}"):
            ddt.HookState(MPI.COMM_SELF)
    COMM.Barrier()
