"""DistributedDataParallel on a CUDA model with ddlkernels' hooks, under ``mpirun -n 2, 3, 4`` on the one GPU.

The hooks reduce each bucket on the progress thread (``ddlkernels.torch.ddp``), ordered after the
backward kernels that wrote it and before DDP's use of the result by CUDA events: a missing one
shows as parameters that differ between ranks or from the same training with DDP's own gloo
allreduce.  With the default state the Communicator's tuner picks among its device algorithms (the
staged ring, "host", CUDA IPC) bucket size by bucket size, trials included; "ring" pins the staged
ring.  Tolerances as tests/mpi/test_torch_ddp.py states them for the same model and data.  DDP over
the ``ddlkernels`` process group (``dist.new_group(backend="ddlkernels")``) the same way, and its
collectives and its send / recv on tensors of a stream of their own.

Never the simulator (tests/gpu/gpu_env.py): without a device every test skips.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from mpi4py import MPI

import gpu_env as G
import ddlkernels

pytestmark = G.needs_device
COMM = MPI.COMM_WORLD
P, R = COMM.Get_size(), COMM.Get_rank()
STEPS, LR = 4, 0.1


@pytest.fixture(scope="module")
def ddt():
    G.torch_cuda()
    import torch.distributed as dist

    import ddlkernels.torch as ddt

    if not dist.is_gloo_available():
        pytest.skip("torch.distributed without gloo: no reference run")
    ddt.init_process_group("gloo")
    yield ddt
    COMM.Barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ring(ddt):
    with ddlkernels.Communicator(COMM, small_bytes=0, ipc=False) as dc:
        state = ddt.HookState(dc)
        yield state
        state.engine.close()


def train(torch, hook=None, state=None, group=None):
    """STEPS of SGD with momentum through DDP on the GPU (buckets of ~2 KB: several per step) over ``group``
    (default: the gloo one); the parameters, flat, on the host."""
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 4)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=2e-3, process_group=group)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    for s in range(STEPS):
        g = torch.Generator().manual_seed(7919 * s + R)
        x, y = torch.randn(6, 10, generator=g).cuda(), torch.randint(0, 4, (6,), generator=g).cuda()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).cpu()


@pytest.mark.parametrize("hook,state,rtol,atol", [
    ("allreduce_hook", "ring", 2e-6, 1e-6),
    ("allreduce_hook", None, 2e-6, 1e-6),
    ("bfloat16_compress_hook", "ring", 1e-2, 2e-3),
])
def test_ddp_with_the_hook_on_a_cuda_model(ddt, ring, hook, state, rtol, atol):
    torch = G.torch_cuda()
    ours = train(torch, getattr(ddt, hook), ring if state == "ring" else state)
    gloo = train(torch)
    crc = zlib.crc32(ours.numpy().view(np.uint8).tobytes())
    assert len(set(COMM.allgather(crc))) == 1, f"{hook}: parameters differ between ranks"
    err = (ours - gloo).abs()
    assert torch.all(err <= atol + rtol * gloo.abs()), f"{hook}: max difference {float(err.max()):.3g} from gloo"


def test_ddp_and_collectives_on_the_ddlkernels_process_group(ddt):
    """``dist.new_group(backend="ddlkernels")`` on CUDA tensors: DDP over it against DDP over gloo (the same
    tolerance as the hook's), and all_reduce / reduce_scatter_tensor of tensors a kernel on a stream of
    their own produced, asynchronous, the result read on that stream after ``wait()``."""
    torch = G.torch_cuda()
    import torch.distributed as dist

    group = dist.new_group(backend="ddlkernels")
    ours, gloo = train(torch, group=group), train(torch)
    crc = zlib.crc32(ours.numpy().view(np.uint8).tobytes())
    assert len(set(COMM.allgather(crc))) == 1, "DDP on the ddlkernels group: parameters differ between ranks"
    err = (ours - gloo).abs()
    assert torch.all(err <= 1e-6 + 2e-6 * gloo.abs()), f"max difference {float(err.max()):.3g} from gloo"
    s = torch.cuda.Stream()
    n = 1000003
    base = torch.arange(n * P, dtype=torch.float32) % 251
    with torch.cuda.stream(s):
        x = (base.cuda() + R) * 2  # kernels on s produce the input
        w = dist.all_reduce(x, group=group, async_op=True)
        w.wait()  # s waits for the result; the host does not wait for the device
        got = x.cpu()
        shard = torch.empty(n, device="cuda")
        y = (base.cuda() + R) * 2
        dist.reduce_scatter_tensor(shard, y, group=group)
        part = shard.cpu()
    want = (base * P + P * (P - 1) / 2) * 2
    assert torch.equal(got, want), "all_reduce of a tensor made on a stream of its own"
    assert torch.equal(part, want[R * n:(R + 1) * n]), "reduce_scatter_tensor of a tensor made on its stream"
    dist.destroy_process_group(group)


def test_messages_of_cuda_tensors_on_the_ddlkernels_process_group(ddt):
    """send / recv of CUDA tensors made and read on a stream of their own: the send's copy to host waits for
    the kernel that made the tensor; the receive's copy into the tensor comes before the read that follows
    ``wait()``; bfloat16 and 0 elements too, and a receive from any rank."""
    torch = G.torch_cuda()
    import torch.distributed as dist

    if P < 2:
        pytest.skip("messages between ranks need 2 ranks")
    group = dist.new_group(backend="ddlkernels")
    nxt, prv = (R + 1) % P, (R - 1) % P
    s = torch.cuda.Stream()
    for n, dtype in ((1 << 22, torch.float32), (4097, torch.bfloat16), (0, torch.float16)):
        base = torch.arange(n, dtype=torch.float32) % 251
        with torch.cuda.stream(s):
            torch.cuda._sleep(50_000_000)  # the kernels that make x run late: a send that does not wait reads 0s
            x = (base.cuda() + R).to(dtype)
            got = torch.zeros(n, dtype=dtype, device="cuda")
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, prv, group),
                                            dist.P2POp(dist.isend, x, nxt, group)])
            for w in works:
                w.wait()
            seen = (got.float() * 1).cpu()  # a kernel on s after wait(): the received bytes
        torch.cuda.synchronize()
        assert all(w.is_completed() for w in works), "is_completed() once the device has run everything"
        assert torch.equal(seen, (base + prv).to(dtype).float()), f"ring of {n} {dtype} on a stream of its own"
    t = torch.full((5,), float(R), device="cuda")
    if R == 0:
        for _ in range(P - 1):
            buf = torch.empty(5, device="cuda")
            src = dist.recv(buf, group=group)
            assert torch.equal(buf.cpu(), torch.full((5,), float(src))), f"from rank {src}"
    else:
        dist.send(t, dst=0, group=group)
    dist.destroy_process_group(group)


def test_flags_and_bytes_of_cuda_tensors_on_the_ddlkernels_process_group(ddt):
    """CUDA tensors of dtypes ddlkernels' kernels do not reduce: a uint8 all_reduce MAX and a bool one (MPI's
    reductions through host memory), and a uint8 all_gather_into_tensor (int32 words through the device
    allgather; one byte off the words' boundary through a copy), each made by a kernel on a stream of its own."""
    torch = G.torch_cuda()
    import torch.distributed as dist

    group = dist.new_group(backend="ddlkernels")
    s = torch.cuda.Stream()
    n = 4096
    base = torch.arange(n * P, dtype=torch.int64)
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # the kernels that make the inputs run late
        flags = ((base.cuda() * 7 + R * 13) % 251).to(torch.uint8)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        votes = (base.cuda() % P == R)
        dist.all_reduce(votes, group=group)  # SUM of bool: or
        mine = ((base[:n].cuda() * 3 + R) % 256).to(torch.uint8)
        whole = torch.empty(n * P, dtype=torch.uint8, device="cuda")
        dist.all_gather_into_tensor(whole, mine, group=group)
        off = torch.empty(n * P + 1, dtype=torch.uint8, device="cuda")[1:]
        dist.all_gather_into_tensor(off, mine, group=group)
        got = [flags.cpu(), votes.cpu(), whole.cpu(), off.cpu()]
    want_flags = torch.stack([(base * 7 + q * 13) % 251 for q in range(P)]).amax(0).to(torch.uint8)
    assert torch.equal(got[0], want_flags), "all_reduce MAX of uint8"
    assert bool(got[1].all()), "all_reduce of bool: every element is some rank's"
    want = torch.cat([((base[:n] * 3 + q) % 256).to(torch.uint8) for q in range(P)])
    assert torch.equal(got[2], want) and torch.equal(got[3], want), "all_gather_into_tensor of uint8"
    dist.destroy_process_group(group)
