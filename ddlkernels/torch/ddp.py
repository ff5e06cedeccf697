"""``torch.distributed`` users: the process group from MPI, the local GPU, ``all_reduce``, and DDP's hooks.

    ddt.init_process_group("gloo")                   # rank and size from MPI
    model = torch.nn.parallel.DistributedDataParallel(model.to(ddt.set_device()))
    model.register_comm_hook(ddt.HookState(), ddt.allreduce_hook)   # buckets reduced by ddlkernels
"""

from __future__ import annotations


import torch

from ..communicator import as_communicator

__all__ = ["all_reduce", "init_process_group", "set_device", "DeviceStreams", "ProgressStreams", "HookState",
           "allreduce_hook", "fp16_compress_hook", "bfloat16_compress_hook"]


def all_reduce(tensor, op="sum", *, comm=None, async_op: bool = False):
    """Reduce ``tensor`` over every rank *in place*, as ``torch.distributed.all_reduce(tensor)`` does.

    ``ddlkernels.allreduce(t)`` returns a new tensor and leaves ``t`` alone;
    this is ``ddlkernels.allreduce(t, op, out=t)``.  ``op``: a name or a
    ``torch.distributed.ReduceOp``.  ``async_op=True`` returns a handle whose
    ``wait()`` finishes the reduction (``ddlkernels.allreduce_async``, the
    progress thread); otherwise ``None``, as torch returns.
    """
    from ..asynchronous import allreduce_async

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_reduce: expected a torch.Tensor, got {type(tensor).__name__}")
    if async_op:
        return allreduce_async(tensor, op, comm=comm, out=tensor)
    as_communicator(comm).allreduce(tensor, op, out=tensor)
    return None


# -- Horovod parity: compression, broadcast_object, broadcast_optimizer_state ------------------


def init_process_group(backend: str = "gloo", *, comm=None, master_addr=None, timeout=None) -> None:
    """Initialise ``torch.distributed`` with the ranks of ``comm`` (default COMM_WORLD): rank and world size
    from MPI, the rendezvous through a ``TCPStore`` whose port the root picks and MPI broadcasts.

    What ``DistributedDataParallel`` needs under ``mpirun`` (no ``MASTER_ADDR`` /
    ``MASTER_PORT`` to set).  ``master_addr``: the address the other ranks
    reach rank 0 at (default 127.0.0.1 when every rank is on one node, else
    rank 0's host name).  ``timeout``: a ``datetime.timedelta`` for torch.
    Collective.  Does nothing when ``torch.distributed`` is already
    initialised with this rank and size; raises ``RuntimeError`` when it is
    initialised otherwise.
    """
    import datetime
    import socket

    import torch.distributed as dist

    c = as_communicator(comm)
    mpi = c.comm
    rank, size = c.rank, c.size
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != size:
            raise RuntimeError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, but this is rank {rank} of {size} of comm")
        return
    hosts = mpi.allgather(socket.gethostname())
    addr = master_addr or ("127.0.0.1" if len(set(hosts)) == 1 else hosts[0])
    wait = timeout or datetime.timedelta(minutes=5)
    store, port, error = None, None, None
    if rank == 0:
        try:
            # Port 0: the system picks a free one, so no port is guessed and none can be taken meanwhile.
            store = dist.TCPStore(addr, 0, size, is_master=True, timeout=wait, wait_for_workers=False)
            port = store.port
        except Exception as exc:  # every rank must learn it, or they would wait in bcast forever
            error = f"{type(exc).__name__}: {exc}"
    port, error = mpi.bcast((port, error), root=0)
    if error is not None:
        raise RuntimeError(f"init_process_group: rank 0 could not open a TCPStore on {addr}: {error}")
    if rank != 0:
        store = dist.TCPStore(addr, port, size, is_master=False, timeout=wait)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=wait)


def set_device(comm=None) -> "torch.device":
    """Pin this rank to its GPU (``ddlkernels.local_device``: one per local rank, or the one GPU shared) and
    return it; ``torch.device("cpu")`` where torch sees no CUDA device.

    Collective over ``comm`` the first time (the local rank comes from MPI),
    so every rank calls it, with or without a GPU.
    """
    from .._local import local_device, local_rank

    local_rank(comm)  # collective on first use: every rank takes part, GPU or not
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return torch.device("cpu")
    index = local_device(torch.cuda.device_count(), comm)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# -- DistributedDataParallel communication hooks -------------------------------------------


class DeviceStreams:
    """A stream of its own per CUDA device, made at the first use (the progress thread's collectives, the process
    group's messages)."""

    def __init__(self):
        self._streams: dict = {}  # CUDA device index -> its stream

    def stream(self, device):
        """The CUDA stream of ``device`` (made at the first): a stream of its own, as NCCL's, so that the work
        queued on it runs beside the caller's kernels instead of in their queue."""
        s = self._streams.get(device.index)
        if s is None:
            s = self._streams[device.index] = torch.cuda.Stream(device)
        return s


class ProgressStreams(DeviceStreams):
    """A communicator's progress thread and, per CUDA device, the stream its collectives run on.

    What the DDP hooks' state and the ``ddlkernels`` process group share.
    Creating one is collective (the progress thread duplicates the communicator).
    """

    def __init__(self, comm=None):
        from ..asynchronous import progress_engine

        super().__init__()
        self.comm = as_communicator(comm)
        self.size = self.comm.size
        # The collectives run on the progress thread: DDP waits on the returned future from C++, which
        # cannot poll MPI_Iallreduce requests (progress="hooks").
        self.engine = progress_engine(self.comm, "thread")


class HookState(ProgressStreams):
    """The state of ddlkernels' DDP hooks: the communicator and its progress thread.

        model = torch.nn.parallel.DistributedDataParallel(model)
        model.register_comm_hook(ddlkernels.torch.HookState(), ddlkernels.torch.allreduce_hook)

    ``comm``: mpi4py ``Intracomm`` or ``ddlkernels.Communicator`` (default
    COMM_WORLD); its ranks must be the process group's, in the same order
    (``init_process_group`` makes them so).  Creating one is collective (the
    progress thread duplicates the communicator); passing ``None`` as the
    hook's state instead creates the default one at the first bucket.
    """

    def __init__(self, comm=None):
        import torch.distributed as dist

        c = as_communicator(comm)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != c.size:
            raise ValueError(f"the DDP hook's communicator has {c.size} ranks but torch.distributed's world "
                             f"has {dist.get_world_size()}; pass the communicator of the process group's ranks")
        super().__init__(c)


_DEFAULT_HOOK_STATE = None


def _hook_state(state) -> HookState:
    global _DEFAULT_HOOK_STATE
    if isinstance(state, HookState):
        return state
    if state is None:
        if _DEFAULT_HOOK_STATE is None or _DEFAULT_HOOK_STATE.engine.closed:
            _DEFAULT_HOOK_STATE = HookState()
        return _DEFAULT_HOOK_STATE
    from mpi4py import MPI

    from ..communicator import Communicator

    if isinstance(state, (MPI.Intracomm, Communicator)):
        c = as_communicator(state)
        cached = getattr(c, "_ddl_hook_state", None)
        if cached is None or cached.engine.closed:
            cached = c._ddl_hook_state = HookState(c)
        return cached
    raise TypeError(f"the state of ddlkernels' DDP hooks is None, an mpi4py Intracomm, a ddlkernels.Communicator "
                    f"or a ddlkernels.torch.HookState, got {type(state).__name__} (torch's own hooks take a "
                    f"process group there; this hook reduces over MPI)")


def _bucket_hook(state, bucket, wire=None):
    """Reduce a DDP bucket's flat gradient on the progress thread; a future of the averaged tensor.

    CPU: the reduction runs in the bucket's memory; the future is completed
    from the progress thread when it is done, so backward goes on meanwhile.
    CUDA: an event recorded on the current stream at the call marks the
    bucket's values as produced; on the progress thread the state's stream of
    the device waits for it and runs the reduction (ddlkernels runs a torch
    tensor's call on torch's current stream) and the decompressing copy; the
    future is a CUDA-aware ``torch.futures.Future(devices=[...])``, whose
    ``set_result`` records an event on that stream, and DDP's wait makes its
    own stream wait for that event.  The host waits for neither: the next
    bucket's reduction is queued while the GPU still runs this one.
    """
    st = _hook_state(state)
    buf = bucket.buffer()
    dev = buf.device
    cuda = dev.type == "cuda"
    fut = torch.futures.Future(devices=[dev]) if cuda else torch.futures.Future()
    if st.size == 1:  # the average over one rank is the gradient itself
        fut.set_result(buf)
        return fut
    if wire is not None and buf.dtype.is_floating_point and buf.dtype != wire:
        # As torch's fp16_compress_hook: divided first (one rounding, in the gradient's own dtype), so the
        # 16-bit sum overflows only where the average would; the result comes back into the bucket.
        buf.div_(st.size)
        send, op = buf.to(wire), "sum"
    else:
        send, op = buf, "avg"
    ready = None
    if cuda:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(dev))

    def reduce(c):
        c.allreduce(send, op, out=send)  # on this thread's current torch stream of dev (Backend.stream_of)
        if send is not buf:
            buf.copy_(send)
        fut.set_result(buf)

    def run(c):
        try:
            if not cuda:
                return reduce(c)
            side = st.stream(dev)
            with torch.cuda.stream(side):
                side.wait_event(ready)
                if send is not buf:  # made on the caller's stream, used on this one until its work has run
                    send.record_stream(side)
                reduce(c)
        except BaseException as exc:
            fut.set_exception(exc)
            raise

    st.engine.submit(run)
    return fut


def allreduce_hook(state, bucket):
    """DDP communication hook: average the bucket over the ranks with ddlkernels (the ring, on the progress thread).

        model.register_comm_hook(None, ddlkernels.torch.allreduce_hook)   # COMM_WORLD

    ``state``: None (COMM_WORLD), an mpi4py ``Intracomm``, a
    ``ddlkernels.Communicator`` or a ``HookState``.  Returns a
    ``torch.futures.Future`` of the averaged flat gradient, completed from
    the progress thread, so buckets reduce while backward goes on.  DDP
    starts its buckets in the same order on every rank, which is what
    ddlkernels' collectives need.
    """
    return _bucket_hook(state, bucket)


def fp16_compress_hook(state, bucket):
    """``allreduce_hook`` with the bucket sent as float16 (divided by the rank count first, as torch's hook)."""
    return _bucket_hook(state, bucket, torch.float16)


def bfloat16_compress_hook(state, bucket):
    """``allreduce_hook`` with the bucket sent as bfloat16 (divided by the rank count first, as torch's hook).

    Not called ``bf16_compress_hook``: DDP refuses a hook of that name
    unless NCCL >= 2.10 is present, whatever the hook does.
    """
    return _bucket_hook(state, bucket, torch.bfloat16)
