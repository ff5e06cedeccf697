"""Collectives of GPU buffers beside what a GPU user would otherwise run, every result checked.

Used by ``python -m ddlkernels job`` (``--device``, on a GPU by default where every rank has one),
``python -m ddlkernels bench --device cuda`` (allreduce, reduce_scatter, allgather) and
``bench/sweeps/device_allreduce.py``.  Worked example, 2 ranks on one GPU, 64 MiB of float32::

    gpu_everywhere(comm)        (cupy, None): every rank sees a CUDA device (else None and why)
    sweep(comm, CupyDevice(cp), [64 << 20], "float32", iters=10, warmup=3)
        the library's tuners settled first; then 3 untimed rounds and 10 timed ones
        of every line in turn (ddlkernels.tools.bench.runner), a sample being:
        barrier, t0, one call, the device synchronized, t1, the slowest rank's time
        -> [{"bytes": 67108864, "lines": {"ddlkernels": {"ms": .., "busbw_GBps": ..,
             "wrong": 0}, "hand-rolled": {...}, ...}, "ddlkernels_ran": "ipc"}]
    table(rows) -> one block per size: ms, busbw, x the hand-rolled loop, wrong elements

The lines (each where it can run; ``sweep``'s ``missing`` says why one could not)::

    ddlkernels          CuPy buffers, the library's own choice (its tuner settled first)
    ddlkernels ipc      ipc=True: the ranks of one node reduce each other's memory over CUDA IPC
    ddlkernels hier     allreduce, "hier": CUDA IPC inside each node, across nodes what its own tuner
                        chose (the header names it); on one node, nodes of k ranks made up by node
                        labels (k the largest divisor of p below p)
    ddlkernels staged   ipc=False, cuda_aware=False: through pinned host memory, the ring's chunks or
                        "host"'s pieces (ddlkernels.algorithms.host), as its tuner settled
    ddlkernels torch    the first line's Communicator on torch CUDA tensors: what a PyTorch user calls
                        (no copy: the tensors' memory, on torch's current stream)
    hand-rolled         copy down into pinned memory, MPI's collective, copy back: the loop users write
    mpi device          MPI's collective on the CuPy buffers themselves, where MPI is CUDA-aware
    gloo                torch.distributed's gloo on CUDA tensors
    ddlkernels group    the same torch.distributed calls on the "ddlkernels" process group
                        (ddlkernels.torch.process_group): what DDP and FSDP users get from it
    nccl                torch.distributed's NCCL, when no two ranks share a GPU
    ddlkernels host     the same bytes as numpy arrays
    device copy         every rank copies its input once on its GPU: a floor no collective beats

reduce_scatter leaves each rank its shard of the sum and allgather gathers
every rank's shard: ddlkernels' lines at ``shard_range``, the others in rank
order (``MPI_Reduce_scatter``, ``MPI_Allgatherv``), each checked at its own.
busbw = bytes / t x 2 (p - 1) / p for allreduce, x (p - 1) / p for the others
(nccl-tests; bytes: the whole buffer).  Inputs are ``pattern``'s small
integers, so every sum is exact and a misplaced chunk shows as wrong elements.

What the sweep does with device memory goes through a ``CupyDevice``, so that
the tests run every line's logic on the stream emulator's device.
"""

from __future__ import annotations

import os
import socket

import numpy as np

from .buffers import expected, pattern
from .runner import run_sweep

__all__ = ["gpu_everywhere", "gpu_or_say_why", "gpu_name", "CupyDevice", "sweep", "table", "report", "COLLECTIVES"]

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")
#: lines of other libraries, left out (with the reason) where they refuse a call
OPTIONAL = ("gloo", "nccl", "ddlkernels group")


class CupyDevice:
    """The sweep's device memory and copies, on CuPy and the current device."""

    def __init__(self, cp):
        self.cp = cp

    def name(self) -> str:
        return gpu_name(self.cp)

    def ident(self):
        """Which GPU this rank drives (ranks with the same one share it)."""
        return self.cp.cuda.Device().pci_bus_id

    def index(self) -> int:
        return self.cp.cuda.runtime.getDevice()

    def array(self, host):
        return self.cp.asarray(host)

    def empty(self, n, dtype):
        return self.cp.empty(n, dtype)

    def to_host(self, d):
        return self.cp.asnumpy(d)

    def pinned(self, n, dtype):
        import cupyx

        return cupyx.empty_pinned((n,), dtype)

    def down(self, host, d):
        """``d`` into ``host`` (pinned), waited for."""
        self.cp.asnumpy(d, out=host)

    def up(self, d, host):
        d.set(host)

    def copy(self, dst, src):
        self.cp.copyto(dst, src)

    def synchronize(self):
        self.cp.cuda.Device().synchronize()


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


def gpu_or_say_why(comm, script: str):
    """CuPy, each rank on its GPU (``gpu_everywhere``; collective), or None once rank 0 has printed why
    ``script`` timed nothing: the benchmarks' and studies' first step, before any line of numbers."""
    cp, why = gpu_everywhere(comm)
    if cp is None and comm.Get_rank() == 0:
        print(f"{script}: no GPU to measure on ({why}); nothing was timed", flush=True)
    return cp


def gpu_name(cp) -> str:
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _torch_groups(comm, dev, own_gpu):
    """torch.distributed on ``comm``'s ranks (gloo as the default group, an NCCL group when ``own_gpu``, and
    a ``ddlkernels`` one): ``(torch, nccl group or None, ddlkernels group, None)``, or ``(None, None, None,
    why not)``."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        return None, None, None, f"no torch ({exc})"
    if not torch.cuda.is_available():
        return None, None, None, "torch has no CUDA"
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
        torch.cuda.set_device(dev.index())
        dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
    nccl = dist.new_group(backend="nccl") if own_gpu and dist.is_nccl_available() else None
    global _DDL_GROUP
    if _DDL_GROUP is None:  # one for the process, as the default group: each has a progress thread
        import ddlkernels.torch as ddt  # registers the "ddlkernels" backend

        _DDL_GROUP = dist.new_group(backend=ddt.process_group.BACKEND)
    return torch, nccl, _DDL_GROUP, None


_DDL_GROUP = None  # the "ddlkernels" process group of the sweeps (``_torch_groups``)


def _blocks(n, p):
    """Rank-order blocks of ``n`` as MPI's collectives place them: the first ``n % p`` one longer."""
    q, m = divmod(n, p)
    cuts = [s * q + min(s, m) for s in range(p + 1)]
    return [(cuts[s], cuts[s + 1]) for s in range(p)]


def _case(kind, n, p, r, dt, bounds):
    """(this rank's input, its output's length, the output it must hold) for ``kind`` with shards ``bounds``."""
    lo, hi = bounds[r]
    if kind == "allreduce":
        return pattern(n, r, p, dt), n, expected(n, p, dt, "sum")
    if kind == "reduce_scatter":
        return pattern(n, r, p, dt), hi - lo, expected(n, p, dt, "sum")[lo:hi]
    whole = np.empty(n, dt)
    for q, (a, b) in enumerate(bounds):
        whole[a:b] = pattern(n, q, p, dt)[a:b]
    return whole[lo:hi].copy(), n, whole


def _lines(comm, dev, dtype, kind):
    """name -> (setup(n) -> state with "want", run(state), result(state) -> host array or None); name -> why
    not run; the Communicators made, by role ("tuned", "ipc", "hier", "staged", "host"), to free, and the
    "ddlkernels" process group's ("group"), to settle only."""
    import ddlkernels
    from mpi4py import MPI

    p, r = comm.Get_size(), comm.Get_rank()
    dt = np.dtype(dtype)
    one_node = comm.allreduce(ddlkernels.local_size(comm)) == p * p
    own_gpu = len(set(comm.allgather((socket.gethostname(), dev.ident())))) == p
    # shm left to the default: device calls never use the window themselves, "host"'s inner Communicator does.
    tuned = ddlkernels.Communicator(comm)
    ipc = ddlkernels.Communicator(comm, shm=False, ipc=True) if one_node else None
    out, missing = {}, {}
    hier, k = None, made_up_node_size(p)
    if kind != "allreduce":
        missing["ddlkernels hier"] = "hier serves allreduce only"
    elif one_node and k is None:
        missing["ddlkernels hier"] = f"{p} ranks cannot be split into 2+ nodes of 2+ ranks each"
    else:  # on one node, nodes of k ranks made up by labels; else MPI's own nodes
        hier = ddlkernels.Communicator(comm, node=r // k if one_node else None)
        if "hier" not in hier.algorithms:
            missing["ddlkernels hier"] = "the nodes differ in size or hold one rank each"
    staged = ddlkernels.Communicator(comm, ipc=False, cuda_aware=False)
    host = ddlkernels.Communicator(comm)

    def ddl_bounds(n):
        return [tuned.shard_range(n, rank=q) for q in range(p)]

    def dev_setup(bounds_of):
        def setup(n):
            x, m, want = _case(kind, n, p, r, dt, bounds_of(n))
            return {"n": n, "x": dev.array(x), "out": dev.empty(m, dt), "want": want}
        return setup

    def ddl_call(c, x, o, n):
        if kind == "allreduce":
            c.allreduce(x, "sum", out=o)
        elif kind == "reduce_scatter":
            c.reduce_scatter(x, "sum", out=o)
        else:
            c.allgather(x, count=n, out=o)

    def ddl(c):
        return (dev_setup(ddl_bounds), lambda s: ddl_call(c, s["x"], s["out"], s["n"]),
                lambda s: dev.to_host(s["out"]))

    out["ddlkernels"] = ddl(tuned)
    if ipc is not None and "ipc" in ipc.algorithms:
        out["ddlkernels ipc"] = ddl(ipc)
    else:
        missing["ddlkernels ipc"] = "the ranks span several nodes"
    if hier is not None and "hier" in hier.algorithms:
        hier_setup, hier_run, hier_result = ddl(hier)

        def settled(n):
            s = hier_setup(n)
            if "hier" in hier.candidates(s["x"]):  # not after CUDA IPC failed on a rank: then the ring
                hier.settle(s["x"], "hier")
            return s

        out["ddlkernels hier"] = (settled, hier_run, hier_result)
    out["ddlkernels staged"] = ddl(staged)

    def mpi_call(x, o, n):
        """MPI's collective, rank-order blocks (device or pinned buffers alike)."""
        if kind == "allreduce":
            comm.Allreduce(x, o, MPI.SUM)
        elif kind == "reduce_scatter":
            comm.Reduce_scatter(x, o, [b - a for a, b in _blocks(n, p)], MPI.SUM)
        else:
            counts = [b - a for a, b in _blocks(n, p)]
            comm.Allgatherv(x, [o, (counts, [a for a, _ in _blocks(n, p)])])

    mpi_setup = dev_setup(lambda n: _blocks(n, p))

    def hand_setup(n):
        s = mpi_setup(n)
        s["h"], s["r"] = dev.pinned(s["x"].shape[0], dt), dev.pinned(s["out"].shape[0], dt)
        return s

    def hand_run(s):
        dev.down(s["h"], s["x"])
        mpi_call(s["h"], s["r"], s["n"])
        dev.up(s["out"], s["r"])

    out["hand-rolled"] = (hand_setup, hand_run, lambda s: dev.to_host(s["out"]))
    aware, why_not = host.cuda_aware()
    if aware:
        def mpi_run(s):
            dev.synchronize()  # MPI reads the memory now, outside any stream
            mpi_call(s["x"], s["out"], s["n"])

        out["mpi device"] = (mpi_setup, mpi_run, lambda s: dev.to_host(s["out"]))
    else:
        missing["mpi device"] = f"MPI is not CUDA-aware ({why_not})"
    torch, nccl, ddl_group, why = _torch_groups(comm, dev, own_gpu)
    if torch is None:
        missing["gloo"] = missing["nccl"] = missing["ddlkernels torch"] = missing["ddlkernels group"] = why
    else:
        import torch.distributed as dist

        def torch_setup(n):
            x, m, want = _case(kind, n, p, r, dt, ddl_bounds(n))
            t = torch.as_tensor(x, device="cuda")
            return {"n": n, "x": t, "out": torch.empty(m, dtype=t.dtype, device="cuda"), "want": want}

        out["ddlkernels torch"] = (torch_setup, lambda s: ddl_call(tuned, s["x"], s["out"], s["n"]),
                                   lambda s: s["out"].cpu().numpy())

        def t_setup(n):
            x, m, want = _case(kind, n, p, r, dt, _blocks(n, p))
            t, y = torch.as_tensor(x, device="cuda"), torch.empty(m, dtype=torch.as_tensor(x[:0]).dtype, device="cuda")
            return {"n": n, "t": t, "want": want, "y": y, "x": t, "out": y}  # x, out: what a tuner is asked of

        def t_run(group):
            def run(s):
                n, t, y = s["n"], s["t"], s["y"]
                if kind == "allreduce":
                    y.copy_(t)
                    dist.all_reduce(y, group=group)
                elif kind == "reduce_scatter":
                    dist.reduce_scatter(y, [t[a:b] for a, b in _blocks(n, p)], group=group)
                else:
                    dist.all_gather([y[a:b] for a, b in _blocks(n, p)], t, group=group)
            return run

        out["gloo"] = (t_setup, t_run(None), lambda s: s["y"].cpu().numpy())
        out["ddlkernels group"] = (t_setup, t_run(ddl_group), lambda s: s["y"].cpu().numpy())
        if nccl is not None:
            out["nccl"] = (t_setup, t_run(nccl), lambda s: s["y"].cpu().numpy())
        else:
            missing["nccl"] = "ranks share a GPU (NCCL needs one each)"

    def host_setup(n):
        x, m, want = _case(kind, n, p, r, dt, ddl_bounds(n))
        return {"n": n, "x": x, "out": np.empty(m, dt), "want": want}

    out["ddlkernels host"] = (host_setup, lambda s: ddl_call(host, s["x"], s["out"], s["n"]), lambda s: s["out"])

    def copy_setup(n):  # the whole buffer: what an allreduce reads and writes, a reduce_scatter reads, ...
        return {"a": dev.array(pattern(n, r, p, dt)), "b": dev.empty(n, dt)}

    out["device copy"] = (copy_setup, lambda s: dev.copy(s["b"], s["a"]), None)
    made = {"tuned": tuned, "ipc": ipc, "hier": hier, "staged": staged, "host": host,
            # the group's Communicator, which its progress thread runs; settled from here while it idles
            "group": None if torch is None else ddl_group.communicator}
    return out, missing, {name: c for name, c in made.items() if c is not None}


def made_up_node_size(p: int):
    """Ranks per made-up node for the hier line on one node: the largest divisor 2 <= k < p, else None."""
    return next((k for k in range(p - 1, 1, -1) if p % k == 0), None)


def _collectives(lines, comms, dev, n, kind, factor, missing):
    """One size's lines as the harness's ``Collective``s (``runner.run_sweep`` times them), each line's state
    made now.  A line of another library whose first call raises (torch.distributed refuses what a backend
    lacks, gloo's uneven reduce_scatter say, on every rank alike and before any communication) is left out,
    the reason in ``missing``; a ddlkernels line that raises stops the sweep."""
    from .impls import Collective

    # each ddlkernels line's Communicator, by its role in ``_lines``' third value ("tuned": the plain line)
    tuners = {"ddlkernels" if role == "tuned" else f"ddlkernels {role}": c for role, c in comms.items()}
    tuners["ddlkernels torch"] = comms["tuned"]  # the same Communicator on torch tensors
    out = []
    for name, (setup, run, result) in list(lines.items()):
        s = setup(n)
        if name in OPTIONAL:
            try:
                run(s)
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                missing[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                del lines[name]
                continue

        def timed(st, run=run):  # the call and its device work: the device synchronized inside the sample
            run(st)
            dev.synchronize()

        def wrong(st, result=result):
            return 0 if result is None else int(np.count_nonzero(result(st) != st["want"]))

        def settling(st, c=tuners.get(name)):
            # whether its tuner measures this size again (its watch: the calls slowed down); asked of the whole
            # buffer, which an allgather's input is not
            return c is not None and c.tuning(st["out"] if kind == "allgather" else st["x"], collective=kind)

        out.append(Collective(name, lambda p: factor, lambda *_, s=s: s, timed, wrong, settling=settling))
    return out


def _settle(comm, dev, comms, kind, n, dtype):
    """Run each ddlkernels line's calls of this size until its tuner has settled, so that timed iterations
    run what it chose: its trials alone, where the other lines' calls would make each round of them cost a
    round of every line.  ``comms``: ``_lines``' third value ("hier" is settled by its line's setup)."""
    p, r = comm.Get_size(), comm.Get_rank()
    for role, c in comms.items():
        if role == "hier":
            continue
        h = pattern(n, r, p, dtype)
        x = h if role == "host" else dev.array(h)
        while c.tuning(x, collective=kind):
            if kind == "allgather":
                lo, hi = c.shard_range(n)
                c.allgather(x[lo:hi], count=n)
            else:
                getattr(c, kind)(x, "sum")


#: what every line can reduce: MPI, the hand-rolled loop's, has no float16 or bfloat16 reduction, nor CuPy bfloat16
DTYPES = ("float32", "float64", "int32", "int64")


def _check_dtype(dtype):
    if np.dtype(dtype).name not in DTYPES:
        raise ValueError(f"GPU buffers: dtype {np.dtype(dtype).name} is not one every line reduces (MPI, the "
                         f"hand-rolled loop's, has no float16 or bfloat16); one of {', '.join(DTYPES)} "
                         f"(bench/kernels/device_kernels.py times the kernels in float16 and bfloat16)")


def sweep(comm, dev, sizes, dtype="float32", iters=10, warmup=3, collective="allreduce"):
    """``(rows, missing)``: every line of ``collective`` at every size in bytes (see the module comment);
    collective.  ``dev``: a ``CupyDevice``."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    _check_dtype(dtype)
    p = comm.Get_size()
    factor = 2 * (p - 1) / p if collective == "allreduce" else (p - 1) / p
    lines, missing, comms = _lines(comm, dev, dtype, collective)
    rows = []
    try:
        for size in sizes:
            n = size // np.dtype(dtype).itemsize
            tuned, staged = comms["tuned"], comms["staged"]
            _settle(comm, dev, comms, collective, n, dtype)
            impls = _collectives(lines, comms, dev, n, collective, factor, missing)
            got = run_sweep(comm, [n * np.dtype(dtype).itemsize], impls, dtype=dtype, iters=iters, warmup=warmup,
                            kind=collective, progress=False, even=False)[0]
            row = {"bytes": got["bytes"], "collective": collective, "lines": {}}
            for name, m in got["impls"].items():
                row["lines"][name] = {"ms": m["time_us_median"] / 1e3, "busbw_GBps": m["busbw_GBps"],
                                      "wrong": m["wrong"], "remeasured": m["remeasured"]}
            row["ddlkernels_ran"] = tuned.last_algorithm
            row["staged_ran"] = staged.last_algorithm
            if "ddlkernels hier" in row["lines"]:
                row["hier_ran"] = comms["hier"].last_algorithm
                across = comms["hier"].algorithms["hier"].across()
                if across is not None:  # what its step across nodes ran: its own tuner's choice
                    row["hier_across"] = across.last_algorithm
            if "ddlkernels ipc" in row["lines"]:  # buffers CUDA IPC could not export (one more device copy each),
                row["ipc_staged"] = comm.allreduce(comms["ipc"].algorithms["ipc"].staged())  # all ranks, all calls
            rows.append(row)
    finally:
        for role, c in comms.items():
            if role != "group":  # the process group's own, which lives as long as the group (``_torch_groups``)
                c.free()
    return rows, missing


def table(rows) -> str:
    """One block per size: each line's median ms, busbw, its speed against the hand-rolled loop, wrong elements."""
    from .sizes import format_size

    out = []
    for row in rows:
        hand = row["lines"]["hand-rolled"]["ms"]
        out.append(f"\n## {row.get('collective', 'allreduce')} {format_size(row['bytes'])} (ddlkernels ran "
                   f"{row['ddlkernels_ran']}, ddlkernels staged {row.get('staged_ran')}"
                   + (f", ddlkernels hier {row['hier_ran']}" if "hier_ran" in row else "")
                   + (f" (across nodes {row['hier_across']})" if "hier_across" in row else "")
                   + (f"; ddlkernels ipc staged {row['ipc_staged']} buffers so far" if row.get("ipc_staged") else "")
                   + ")")
        out.append(f"{'line':<20} {'ms':>10} {'busbw GB/s':>11} {'x hand-rolled':>14} {'wrong':>6}")
        for name, m in row["lines"].items():
            out.append(f"{name:<20} {m['ms']:>10.3f} {m['busbw_GBps']:>11.1f} {hand / m['ms']:>14.2f} {m['wrong']:>6}")
    return "\n".join(out)


def report(comm, dev, collectives, dtypes, sizes, iters, warmup, json_path=None) -> int:
    """Every collective and dtype swept, their tables printed (rank 0) and written as JSON; how many wrong
    elements in all (``job --device cuda`` and ``bench --device cuda``)."""
    import json

    from . import comment

    for dt in dtypes:  # before any GPU work, the same on every rank
        try:
            _check_dtype(dt)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    rank0 = comm.Get_rank() == 0
    if rank0:
        print(comment(f"ddlkernels {', '.join(collectives)} on GPU buffers ({dev.name()}), {comm.Get_size()} ranks, "
                      f"beside the hand-rolled copy down + MPI + copy up loop, gloo, NCCL where every rank has its own "
                      f"GPU, host arrays and a device copy; median of {iters} after {warmup} warmup, slowest rank; "
                      f"busbw = bytes/t x 2(p-1)/p (allreduce), x (p-1)/p (the others)"), flush=True)
    wrong, everything = 0, []
    for kind in collectives:
        for dt in dtypes:
            rows, missing = sweep(comm, dev, sizes, dt, iters, warmup, collective=kind)
            wrong += sum(m["wrong"] for r in rows for m in r["lines"].values())
            everything.append({"collective": kind, "dtype": dt, "missing": missing, "rows": rows})
            if rank0:
                print(f"\n# {kind} {dt}" + "".join(f"; {name}: not run ({why})" for name, why in missing.items()))
                print(table(rows), flush=True)
    if rank0:
        print(f"\n# wrong elements in all: {wrong}", flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"gpu": dev.name(), "ranks": comm.Get_size(), "runs": everything}, f, indent=1)
    return wrong
