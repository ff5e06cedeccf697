"""PyTorch data parallelism in Horovod's shape: gradient reduction overlapped with backward.

    import ddlkernels.torch as ddt
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = ddt.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    ddt.broadcast_parameters(model.state_dict(), root=0)      # same start on every rank
    for x, y in loader:                                        # each rank its own shard
        opt.zero_grad()
        loss_fn(model(x), y).backward()                        # buckets reduce while this runs
        opt.step()                                             # waits, then updates

The optimizer's worked example is in ``ddlkernels/torch/optimizer.py``.

DistributedDataParallel instead (docs/gpus.md)::

    ddt.init_process_group("gloo")                   # rank and size from MPI
    model = torch.nn.parallel.DistributedDataParallel(model.to(ddt.set_device()))
    model.register_comm_hook(ddt.HookState(), ddt.allreduce_hook)   # buckets reduced by ddlkernels

or every ``torch.distributed`` collective on ddlkernels (``process_group.py``)::

    ddt.init_process_group("ddlkernels")             # DDP, dist.all_reduce, ... unchanged

``ddt.all_reduce(t)`` reduces in place, as ``torch.distributed.all_reduce``;
``broadcast_object`` and ``broadcast_optimizer_state`` resume a job as
Horovod's do.

Needs the optional extra: ``pip install ddlkernels[torch]`` (torch >= 2.1).
"""

from __future__ import annotations

try:
    import torch
    import torch.distributed
except ImportError as _exc:  # pragma: no cover - exercised by tests with torch hidden
    raise ImportError(
        "ddlkernels.torch needs PyTorch, which is not installed: pip install ddlkernels[torch]"
    ) from _exc

from .broadcast import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .compression import Compression
from .ddp import (HookState, all_reduce, allreduce_hook, bfloat16_compress_hook, fp16_compress_hook,
                  init_process_group, set_device)
from .optimizer import OPTIMIZER_FUSION_BYTES, DistributedOptimizer, _DistributedOptimizer, backend_input_dtype

if torch.distributed.is_available():  # a torch built without it has no process groups to extend
    from .process_group import ProcessGroupDDL, register as _register

    _register()  # init_process_group("ddlkernels") from here on

__all__ = [
    "DistributedOptimizer",
    "Compression",
    "broadcast_parameters",
    "broadcast_object",
    "broadcast_optimizer_state",
    "all_reduce",
    "init_process_group",
    "set_device",
    "HookState",
    "allreduce_hook",
    "fp16_compress_hook",
    "bfloat16_compress_hook",
] + (["ProcessGroupDDL"] if torch.distributed.is_available() else [])
