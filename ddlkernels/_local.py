"""Which GPU a rank uses: its rank among the ranks of its node, and the node's device count.

    import ddlkernels
    dev = ddlkernels.local_device(torch.cuda.device_count())   # collective on the first call
    torch.cuda.set_device(dev)                                  # (or ddlkernels.torch.set_device())

Worked example, 2 nodes of 4 GPUs, ``mpirun -n 8`` (4 ranks per node)::

    world rank      0  1  2  3 | 4  5  6  7
    local rank      0  1  2  3 | 0  1  2  3     ranks sharing the node's memory, in world order
    device          0  1  2  3 | 0  1  2  3     one GPU per local rank

    one node with one GPU, mpirun -n 4:   local ranks 0 1 2 3 -> device 0 0 0 0 (all share it)
    a node with 2 GPUs and 4 ranks:       local ranks 0 1 2 3 -> device 0 1 0 1 (round robin)
    a launcher that hides all but one GPU per rank (Slurm --gpus-per-task=1,
    CUDA_VISIBLE_DEVICES set per rank): each rank counts 1 device -> device 0, its own

The local rank comes from ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``: the
ranks MPI itself puts on one node, whatever launcher started them (Open MPI,
MPICH, Slurm's srun), without reading launcher-specific environment variables.
docs/gpus.md has the launch lines.
"""

from __future__ import annotations

__all__ = ["local_rank", "local_size", "local_device", "device_index"]

_KEYVAL = None
_WORLD = None  # (local rank, local size) of COMM_WORLD: the common case, without attribute lookups


def _local(comm):
    global _KEYVAL, _WORLD
    from mpi4py import MPI

    from .communicator import Communicator

    if isinstance(comm, Communicator):
        comm = comm.mpi_comm
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(f"comm must be an mpi4py Intracomm or a ddlkernels.Communicator, got {comm!r}")
    world = comm == MPI.COMM_WORLD
    if world and _WORLD is not None:
        return _WORLD
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval()
    cached = comm.Get_attr(_KEYVAL)
    if cached is None:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            cached = (node.Get_rank(), node.Get_size())
        finally:
            node.Free()
        comm.Set_attr(_KEYVAL, cached)
    if world:
        _WORLD = cached
    return cached


def local_rank(comm=None) -> int:
    """This rank's index among the ranks of ``comm`` on its node (0 .. local_size - 1, in rank order).

    Collective over ``comm`` (default COMM_WORLD) the first time it is asked
    for that communicator (every rank must call it then); cached after.
    """
    return _local(comm)[0]


def local_size(comm=None) -> int:
    """How many ranks of ``comm`` share this rank's node.  Collective on first use, as ``local_rank``."""
    return _local(comm)[1]


def device_index(devices: int, local_rank: int, local_size: int) -> int:
    """The GPU index for ``local_rank`` of ``local_size`` ranks on a node where this rank sees ``devices`` GPUs.

    One GPU per local rank while there are enough; with fewer GPUs than
    ranks, round robin (with one GPU, every rank shares it).
    """
    for name, v in (("devices", devices), ("local_rank", local_rank), ("local_size", local_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if devices < 1:
        raise ValueError(f"this rank sees no GPU (devices={devices}): no device to pick")
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local_rank {local_rank} is not in [0, {local_size})")
    return local_rank % devices


def local_device(devices: int, comm=None) -> int:
    """``device_index(devices, local_rank(comm), local_size(comm))``: the GPU this rank should use.

    ``devices``: how many GPUs this process sees (``torch.cuda.device_count()``,
    ``cupy.cuda.runtime.getDeviceCount()``).  Collective on first use, as ``local_rank``.
    """
    r, n = _local(comm)
    return device_index(devices, r, n)
