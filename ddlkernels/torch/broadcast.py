"""Every rank from the root's state: parameters, any picklable object, an optimizer's state (Horovod's)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..communicator import as_communicator
from ..safety.agreement import check_same_on_all_ranks

__all__ = ["broadcast_parameters", "broadcast_object", "broadcast_optimizer_state"]


def broadcast_parameters(params, root: int = 0, *, comm=None, root_rank=None) -> None:
    """Overwrite ``params`` on every rank with the root's values, in place (collective).

    ``params``: a ``state_dict()`` (taken in sorted name order, as Horovod
    does), ``model.named_parameters()``, or a list of tensors.  ``root_rank``
    is Horovod's name for ``root``.  Raises ``ValueError`` on every rank when
    the ranks pass different names, dtypes or shapes.
    """
    if root_rank is not None:
        root = root_rank
    if isinstance(params, Mapping):
        items = sorted(params.items())
    else:
        items = [t if isinstance(t, tuple) else (f"tensor.{i}", t) for i, t in enumerate(params)]
    c = as_communicator(comm)
    if not isinstance(root, (int, np.integer)) or not 0 <= root < c.size:
        raise ValueError(f"root must be a rank in [0, {c.size}), got {root!r}")
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(t).__name__}, not a torch.Tensor")
    signature = ["broadcast_parameters", int(root), ()] + [(f"{n} {str(t.dtype)}", tuple(t.shape)) for n, t in items]
    check_same_on_all_ranks(c.comm, signature, "broadcast_parameters")
    with torch.no_grad():
        for _, t in items:
            host = t.detach()
            on_host = host.device.type == "cpu" and host.is_contiguous()
            if not on_host:
                host = host.to("cpu").contiguous()
            if host.numel() == 0:
                continue
            # Bytes on the wire: MPI has no float16/bfloat16 type, and a
            # broadcast only moves bits.
            raw = host.reshape(-1).view(torch.uint8).numpy()
            c.comm.Bcast(raw, root=root)
            if not on_host:
                t.copy_(host)


# -- torch habits: the in-place spelling -------------------------------------------------




def broadcast_object(obj, root_rank: int = 0, *, comm=None):
    """Return the root's ``obj`` on every rank (pickled; collective), as Horovod's ``broadcast_object``.

    For tensors, move them to the CPU first: a pickled CUDA tensor is
    unpickled on the same device number as on the root.
    """
    c = as_communicator(comm)
    _check_root(root_rank, c.size)
    return c.comm.bcast(obj if c.rank == root_rank else None, root=root_rank)


def _check_root(root, size):
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"root must be a rank in [0, {size}), got {root!r}")


class _Slot:
    """Where a tensor was in a state dict sent without its data (which follows as raw bytes)."""

    __slots__ = ("index", "dtype", "shape")

    def __init__(self, index, dtype, shape):
        self.index, self.dtype, self.shape = index, dtype, shape


def _take_tensors(obj, found):
    if isinstance(obj, torch.Tensor):
        found.append(obj)
        return _Slot(len(found) - 1, obj.dtype, tuple(obj.shape))
    if isinstance(obj, dict):
        return {k: _take_tensors(v, found) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_take_tensors(v, found) for v in obj)
    return obj


def _put_tensors(obj, tensors):
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _put_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_put_tensors(v, tensors) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer, root_rank: int = 0, *, comm=None) -> None:
    """Load the root's optimizer state (``state_dict()``) into ``optimizer`` on every other rank (collective).

    What resuming a job needs, as Horovod's ``broadcast_optimizer_state``:
    the per-parameter state (momentum buffers, Adam's moments, step counts)
    and the hyperparameters of every parameter group (learning rate, ...),
    whether or not the other ranks' optimizers have stepped yet.  The
    structure is pickled once; the tensors follow as raw bytes (bfloat16
    included) and land on their parameters' devices through
    ``load_state_dict``.  Raises ``ValueError`` on every rank when the ranks'
    optimizers hold different parameter groups.
    """
    c = as_communicator(comm)
    _check_root(root_rank, c.size)
    groups = [len(g["params"]) for g in optimizer.param_groups]
    check_same_on_all_ranks(c.comm, ["broadcast_optimizer_state", int(root_rank), ()] + groups,
                            "broadcast_optimizer_state")
    if c.size == 1:
        return
    found: list = []
    if c.rank == root_rank:
        meta = _take_tensors(optimizer.state_dict(), found)
    else:
        meta = None
    meta, count = c.comm.bcast((meta, len(found)), root=root_rank)
    if c.rank != root_rank:
        specs: dict = {}

        def collect(o):
            if isinstance(o, _Slot):
                specs[o.index] = o
            elif isinstance(o, dict):
                for v in o.values():
                    collect(v)
            elif isinstance(o, (list, tuple)):
                for v in o:
                    collect(v)

        collect(meta)
        found = [torch.empty(specs[i].shape, dtype=specs[i].dtype) for i in range(count)]
    for i, t in enumerate(found):
        host = t.detach()
        if host.device.type != "cpu" or not host.is_contiguous():
            host = host.to("cpu").contiguous()
        if host.numel():
            c.comm.Bcast(host.reshape(-1).view(torch.uint8).numpy(), root=root_rank)
    if c.rank != root_rank:
        optimizer.load_state_dict(_put_tensors(meta, found))


# -- jobs under mpirun: torch.distributed from MPI, one GPU per local rank -----------------
