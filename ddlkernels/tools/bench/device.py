"""Allreduce of GPU buffers beside what a GPU user would otherwise run, every result checked.

Used by ``python -m ddlkernels job`` (``--device``, on a GPU by default where every rank has one) and
``bench/sweeps/device_allreduce.py``.  Worked example, 2 ranks on one GPU, 64 MiB of float32::

    gpu_everywhere(comm)        (cupy, None): every rank sees a CUDA device (else None and why)
    sweep(comm, cp, [64 << 20], "float32", iters=10, warmup=3)
        per line, 3 untimed calls, then 10 timed ones: barrier, t0, one call, the
        device synchronized, t1; the iteration's time is the slowest rank's
        -> [{"bytes": 67108864, "lines": {"ddlkernels": {"ms": .., "busbw_GBps": ..,
             "wrong": 0}, "hand-rolled": {...}, ...}, "ddlkernels_ran": "ipc"}]
    table(rows) -> one block per size: ms, busbw, x the hand-rolled loop, wrong elements

The lines (each where it can run; ``sweep``'s ``missing`` says why one could not)::

    ddlkernels          CuPy buffers, the library's own choice (its tuner settled first)
    ddlkernels ipc      ipc=True: the ranks of one node reduce each other's memory over CUDA IPC
    ddlkernels staged   ipc=False, cuda_aware=False: through pinned host memory, the ring's chunks or
                        "host"'s pieces (ddlkernels.algorithms.host), as its tuner settled
    hand-rolled         cupy.asnumpy into pinned memory, MPI_Allreduce, copy back: the loop users write
    mpi device          MPI_Allreduce on the CuPy buffers themselves, where MPI is CUDA-aware
    gloo                torch.distributed's gloo on CUDA tensors
    nccl                torch.distributed's NCCL, when no two ranks share a GPU
    ddlkernels host     the same bytes as numpy arrays
    device copy         every rank copies its buffer once on its GPU: a floor no allreduce beats

busbw = bytes / t x 2 (p - 1) / p (nccl-tests).  Inputs are ``pattern``'s small
integers, so every sum is exact and a misplaced chunk shows as wrong elements.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

from .buffers import expected, pattern

__all__ = ["gpu_everywhere", "sweep", "table"]


def gpu_everywhere(comm):
    """``(cupy, None)`` when every rank of ``comm`` has CuPy and a CUDA device, else ``(None, why)``
    (collective); the device is the rank's ``ddlkernels.local_device``."""
    import ddlkernels

    cp, why = None, None
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            why = "no CUDA device"
        else:
            cp = cupy
    except Exception as exc:  # noqa: BLE001 -- no CuPy, no driver: the reason is the message
        why = f"{type(exc).__name__}: {exc}".splitlines()[0]
    whys = comm.allgather(why)
    if any(w is not None for w in whys):
        return None, next(w for w in whys if w is not None)
    cp.cuda.Device(ddlkernels.local_device(cp.cuda.runtime.getDeviceCount(), comm)).use()
    return cp, None


def gpu_name(cp) -> str:
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _torch_groups(comm, cp, own_gpu):
    """torch.distributed on ``comm``'s ranks (gloo, and an NCCL group when ``own_gpu``), or why not."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        return None, None, f"no torch ({exc})"
    if not torch.cuda.is_available():
        return None, None, "torch has no CUDA"
    if not dist.is_initialized():
        if comm.Get_rank() == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        else:
            port = None
        port, host = comm.bcast((port, socket.gethostname()) if comm.Get_rank() == 0 else None)
        os.environ.setdefault("MASTER_ADDR", host)
        os.environ.setdefault("MASTER_PORT", str(port))
        torch.cuda.set_device(cp.cuda.runtime.getDevice())
        dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
    nccl = dist.new_group(backend="nccl") if own_gpu and dist.is_nccl_available() else None
    return torch, nccl, None


def _lines(comm, cp, dtype):
    """name -> (setup(n) -> state, run(state), result(state) -> host array or None); name -> why not run;
    the Communicators to free."""
    import ddlkernels
    from mpi4py import MPI

    p, r = comm.Get_size(), comm.Get_rank()
    dt = np.dtype(dtype)
    one_node = comm.allreduce(ddlkernels.local_size(comm)) == p * p
    own_gpu = len(set(comm.allgather((socket.gethostname(), cp.cuda.Device().pci_bus_id)))) == p
    # shm left to the default: device calls never use the window themselves, "host"'s inner Communicator does.
    tuned = ddlkernels.Communicator(comm)
    ipc = ddlkernels.Communicator(comm, shm=False, ipc=True) if one_node else None
    staged = ddlkernels.Communicator(comm, ipc=False, cuda_aware=False)
    host = ddlkernels.Communicator(comm)
    out, missing = {}, {}

    def dev(n):
        return {"x": cp.asarray(pattern(n, r, p, dt)), "out": cp.empty(n, dt)}

    def ddl(c):
        return dev, lambda s: c.allreduce(s["x"], "sum", out=s["out"]), lambda s: cp.asnumpy(s["out"])

    out["ddlkernels"] = ddl(tuned)
    if ipc is not None and "ipc" in ipc.algorithms:
        out["ddlkernels ipc"] = ddl(ipc)
    else:
        missing["ddlkernels ipc"] = "the ranks span several nodes"
    out["ddlkernels staged"] = ddl(staged)

    def hand_setup(n):
        import cupyx

        s = dev(n)
        s["h"], s["r"] = cupyx.empty_pinned((n,), dt), cupyx.empty_pinned((n,), dt)
        return s

    def hand_run(s):
        cp.asnumpy(s["x"], out=s["h"])
        comm.Allreduce(s["h"], s["r"], MPI.SUM)
        s["out"].set(s["r"])

    out["hand-rolled"] = (hand_setup, hand_run, lambda s: cp.asnumpy(s["out"]))
    aware, why_not = host.cuda_aware()
    if aware:
        def mpi_run(s):
            cp.cuda.get_current_stream().synchronize()  # MPI reads the memory now, outside any stream
            comm.Allreduce(s["x"], s["out"], MPI.SUM)

        out["mpi device"] = (dev, mpi_run, lambda s: cp.asnumpy(s["out"]))
    else:
        missing["mpi device"] = f"MPI is not CUDA-aware ({why_not})"
    torch, nccl, why = _torch_groups(comm, cp, own_gpu)
    if torch is None:
        missing["gloo"] = missing["nccl"] = why
    else:
        import torch.distributed as dist

        def t_setup(n):
            return {"t": torch.as_tensor(pattern(n, r, p, dt), device="cuda")}

        def t_run(group):
            def run(s):
                s["y"] = s["t"].clone()
                dist.all_reduce(s["y"], group=group)
            return run

        out["gloo"] = (t_setup, t_run(None), lambda s: s["y"].cpu().numpy())
        if nccl is not None:
            out["nccl"] = (t_setup, t_run(nccl), lambda s: s["y"].cpu().numpy())
        else:
            missing["nccl"] = "ranks share a GPU (NCCL needs one each)"
    out["ddlkernels host"] = (lambda n: {"x": pattern(n, r, p, dt), "out": np.empty(n, dt)},
                              lambda s: host.allreduce(s["x"], "sum", out=s["out"]), lambda s: s["out"])
    out["device copy"] = (dev, lambda s: cp.copyto(s["out"], s["x"]), None)
    return out, missing, [c for c in (tuned, ipc, staged, host) if c is not None]


def _measure(comm, cp, line, n, dtype, iters, warmup):
    from mpi4py import MPI

    setup, run, result = line
    s = setup(n)
    want = expected(n, comm.Get_size(), dtype, "sum")
    for _ in range(warmup):
        run(s)
    cp.cuda.Device().synchronize()
    times, wrong = [], 0
    for _ in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        run(s)
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
        if result is not None:
            wrong += int(np.count_nonzero(result(s) != want))
    return comm.allreduce(float(np.median(times)), op=MPI.MAX), comm.allreduce(wrong)


def sweep(comm, cp, sizes, dtype="float32", iters=10, warmup=3):
    """``(rows, missing)``: every line at every size in bytes (see the module comment); collective."""
    p = comm.Get_size()
    lines, missing, comms = _lines(comm, cp, dtype)
    rows = []
    try:
        for size in sizes:
            n = size // np.dtype(dtype).itemsize
            tuned, staged, host = comms[0], comms[-2], comms[-1]
            h = pattern(n, comm.Get_rank(), p, dtype)
            x = cp.asarray(h)
            for c, buf in ((tuned, x), (staged, x), (host, h)):  # each line runs what its tuner settled on
                while c.tuning(buf):
                    c.allreduce(buf, "sum")
            row = {"bytes": n * np.dtype(dtype).itemsize, "lines": {}}
            for name, line in lines.items():
                t, wrong = _measure(comm, cp, line, n, dtype, iters, warmup)
                row["lines"][name] = {"ms": t * 1e3, "busbw_GBps": row["bytes"] / t * 2 * (p - 1) / p / 1e9,
                                      "wrong": wrong}
            row["ddlkernels_ran"] = tuned.last_algorithm
            row["staged_ran"] = staged.last_algorithm
            rows.append(row)
    finally:
        for c in comms:
            c.free()
    return rows, missing


def table(rows) -> str:
    """One block per size: each line's median ms, busbw, its speed against the hand-rolled loop, wrong elements."""
    from .sizes import format_size

    out = []
    for row in rows:
        hand = row["lines"]["hand-rolled"]["ms"]
        out.append(f"\n## {format_size(row['bytes'])} (ddlkernels ran {row['ddlkernels_ran']}, "
                   f"ddlkernels staged {row.get('staged_ran')})")
        out.append(f"{'line':<20} {'ms':>10} {'busbw GB/s':>11} {'x hand-rolled':>14} {'wrong':>6}")
        for name, m in row["lines"].items():
            out.append(f"{name:<20} {m['ms']:>10.3f} {m['busbw_GBps']:>11.1f} {hand / m['ms']:>14.2f} {m['wrong']:>6}")
    return "\n".join(out)
