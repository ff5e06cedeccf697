"""ddlkernels' own host time around its device work, without a GPU (nothing is launched, nothing copied).

On a GPU every microsecond of Python before a launch is a microsecond the
device may wait, and where a benchmark times a call between CUDA events it is
part of the time.  Each part below runs the library's code with the CUDA calls
taken out, so that only our own work is timed:

1. ``reduce_many``'s argument checks: what the CUDA IPC allreduce's fold costs
   before its launch.  The IPC allreduce of p ranks folds p shards into p
   outputs in one kernel (``ddlkernels.algorithms.ipc``); before the launch,
   ``DeviceBackend.reduce_many`` checks that the outputs are disjoint and which
   operands are, or touch, an output.  Timed on the CuPy backend: CuPy arrays
   over made-up device addresses (the launch is replaced by one that does
   nothing).  The shapes are the IPC allreduce's own: in place, each rank's
   input shard is an output; out of place, the operands lie apart from the
   outputs.  Up to 8 ranks, the fold of one launch (beyond, an in-place fold
   goes through a scratch buffer these made-up addresses cannot give).
2. ``reduce`` down to the pairwise reduce kernel's call (CuPy backend, as
   in 1; the loaded kernel a recorder): the part of "host time per launch"
   that is ours, which ``bench/kernels/device_kernels.py`` measures whole on
   a GPU beside cp.add.
3. The Numba backend's lookup of its kernel, which every launch makes
   (``ddlkernels.kernels.numba_cuda.reduce_kernel``), per dtype.
4. A pack of 182 tensors (the mix ``bench/kernels/device_kernels.py`` packs
   against ``torch.cat``: 313 MiB) before its one launch, its table
   already on the device (CuPy backend, as in 1; the stream and the kernel
   replaced).  ``device_kernels.py`` times the pack between two CUDA events
   recorded around the call, so this host time is part of what it measures.
5. One CUDA IPC allreduce's own host time (``IpcNode.allreduce``, the same
   buffers every call, as a training loop's) at 2, 4 and 8 ranks: one
   process, the CuPy backend with its CUDA calls doing nothing (as in 1), and
   an exchange in which the other ranks' parts are this rank's with handles
   of their own.

    python bench/studies/host_costs.py [--calls 20000] [--ranks 2,4,8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

N = 1 << 18  # elements per shard (1 MiB of float32): the checks do not depend on it


def arrays(cp, base, count, step):
    """``count`` float32 CuPy arrays of N elements at ``base``, ``base + step``, ... (never dereferenced)."""
    out = []
    for k in range(count):
        mem = cp.cuda.UnownedMemory(base + k * step, N * 4, None, 0)
        out.append(cp.ndarray((N,), np.float32, cp.cuda.MemoryPointer(mem, 0)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--ranks", default="2,4,8")
    args = ap.parse_args(argv)
    ranks = [int(v) for v in args.ranks.split(",")]
    if not all(2 <= p <= 8 for p in ranks):
        ap.error("--ranks: from 2 to 8")
    try:
        import cupy as cp

        from ddlkernels.backends._cupy import CupyBackend
    except ImportError as exc:
        print(f"host_costs: needs CuPy ({exc})")
        return 2
    be = CupyBackend()
    return (fold_checks(be, cp, ranks, args.calls) or pairwise(be, cp, args.calls) or numba_lookup(args.calls)
            or pack(cp, max(1, args.calls // 20)) or ipc(cp, ranks, max(1, args.calls // 4)))


def fold_checks(be, cp, ranks, calls) -> int:
    """(1) ``reduce_many`` of p ranks' shards in the IPC allreduce's two shapes, the launch replaced by nothing."""
    launches = []
    be._launch_fold = lambda name, dst, srcs, n, arg, also=(): launches.append(len(srcs))
    print(f"reduce_many host time per call, CuPy backend, launch replaced by nothing, {calls} calls")
    for p in ranks:
        outs = arrays(cp, 0x7F0000000000, p, 1 << 24)  # one shard of each rank's output, ranks apart
        apart = arrays(cp, 0x7E0000000000, p, 1 << 24)
        for shape, srcs in (("in place", outs), ("out of place", apart)):
            launches.clear()
            t = time.perf_counter()
            for _ in range(calls):
                be.reduce_many("sum", outs[0], srcs, also=outs[1:])
            us = (time.perf_counter() - t) / calls * 1e6
            if launches != [p] * calls:  # one launch of every operand per call, or the wrong path was timed
                print(f"p={p} {shape}: launches of {sorted(set(launches))} operands, not one of {p} per call")
                return 1
            print(f"p={p} {shape:13s} {us:7.2f} us per call")
    return 0


def pairwise(be, cp, calls) -> int:
    """(2) ``reduce("sum", out, a, b)`` of three buffers apart, down to the kernel call: the backend's own
    ``_launch_reduce`` and ``_function`` run, the loaded kernels are recorders, the device and stream CuPy
    would report are made up."""
    (out,), (a,), (b,) = (arrays(cp, base, 1, 0) for base in (0x7D0000000000, 0x7C0000000000, 0x7B0000000000))
    names = []

    class Stream:  # what a launch asks of CuPy's current stream
        ptr = 0

    cp.cuda.runtime.getDevice = lambda: 0
    cp.cuda.get_current_stream = lambda: Stream
    for label in ("sum", "avg"):
        name = f"ddl_reduce_{label}_f32"
        be._functions[(0, name)] = lambda grid, block, args, stream=None, name=name: names.append(name)
    for label, avg_p in (("sum", None), ("avg", 4)):
        names.clear()
        t = time.perf_counter()
        for _ in range(calls):
            be.reduce("sum", out, a, b, avg_p=avg_p)
        us = (time.perf_counter() - t) / calls * 1e6
        if names != [f"ddl_reduce_{label}_f32"] * calls:
            print(f"reduce {label}: launched {sorted(set(names))}, not one ddl_reduce_{label}_f32 per call")
            return 1
        print(f"reduce {label} of 3 buffers apart {us:7.2f} us per call, to the kernel call")
    return 0


def numba_lookup(calls) -> int:
    """(3) The kernel lookup of every Numba launch, per dtype suffix (the kernel made once before)."""
    try:
        from ddlkernels.kernels.numba_cuda import SUFFIXES, reduce_kernel

        for suf in SUFFIXES:
            reduce_kernel("sum", suf)  # made (not compiled) once
    except ImportError as exc:
        print(f"numba-cuda: left out ({exc})")
        return 0
    print(f"Numba backend: reduce_kernel lookup per launch, {calls} calls")
    for suf in SUFFIXES:
        t = time.perf_counter()
        for _ in range(calls):
            reduce_kernel("sum", suf)
        print(f"{suf:5s} {(time.perf_counter() - t) / calls * 1e6:7.2f} us per launch")
    return 0


def pack(cp, calls) -> int:
    """(4) ``CupyBackend.pack`` of device_kernels.py's 182 tensors, offsets chosen by the pack, table cached."""
    from ddlkernels.backends._cupy import CupyBackend

    be = CupyBackend()
    rng = np.random.default_rng(0)  # device_kernels.py's mix
    counts = [int(c) for c in rng.choice([64, 256, 2048, 4096, 36864, 147456, 589824, 2359296], 182)]
    tensors, at = [], 0x7A0000000000
    for c in counts:
        mem = cp.cuda.UnownedMemory(at, c * 4, None, 0)
        tensors.append(cp.ndarray((c,), np.float32, cp.cuda.MemoryPointer(mem, 0)))
        at += -(-c * 4 // 512) * 512
    total = sum(-(-c * 4 // 16) * 16 for c in counts)
    buf = cp.ndarray((total // 4,), np.float32, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(at, total, None, 0), 0))

    class Stream:  # what the pack asks of CuPy's current stream: its handle
        ptr = 0

    launches = []
    cp.cuda.get_current_stream = lambda: Stream
    be.current_device = lambda: 0
    be._upload = lambda host, stream: host
    be._function = lambda source, name: lambda grid, block, args, stream=None: launches.append(name)
    be.pack(tensors, buf)  # the table made
    launches.clear()
    t = time.perf_counter()
    for _ in range(calls):
        be.pack(tensors, buf)
    us = (time.perf_counter() - t) / calls * 1e6
    if launches != ["ddl_pack"] * calls:
        print(f"pack: launched {sorted(set(launches))}, not one ddl_pack per call")
        return 1
    print(f"pack of {len(tensors)} tensors ({sum(counts) * 4 / 2**20:.0f} MiB), {calls} calls: {us:.1f} us per call")
    return 0


def ipc(cp, ranks, calls) -> int:
    """(5) ``IpcNode.allreduce`` of 1 MiB of float32 on the CuPy backend over made-up buffers, its CUDA calls
    (events, waits, handles, copies, the fold's launch) doing nothing; peers' views are CuPy arrays, as on a
    GPU."""
    from ddlkernels.algorithms import ipc as I
    from ddlkernels.backends._cupy import CupyBackend

    class Done:
        def Wait(self):
            pass

    class Exchange:
        """p ranks in this process: every rank's part of an exchange is this rank's, the handles apart."""

        def __init__(self, p):
            self.p = p

        def Get_size(self):
            return self.p

        def Get_rank(self):
            return 0

        def Iallgather(self, send, recv):
            n = send.shape[0]
            for q in range(self.p):
                recv[q * n:(q + 1) * n] = send
                if n == I._RECORD.itemsize:
                    recv[q * n:(q + 1) * n].view(I._RECORD)["key"][0, :, 0] = 100 + q
            return Done()

    folds = []

    class NoDevice(CupyBackend):
        """The CuPy backend with every CUDA call a no-op; a handle names its buffer, a peer's mapping lies
        where its handle says."""

        compute_stream = record = current_device = lambda self, *a: 0
        record_on = wait = copy = ipc_close = lambda self, *a: None
        ipc_export = lambda self, b: ((b"h%x" % b.data.ptr).ljust(64, b"\0"), 0)  # noqa: E731
        ipc_open = lambda self, key: 0x500000000000 + key[0] * (1 << 36)  # noqa: E731
        ipc_event = lambda self: (object(), b"e".ljust(64, b"\0"))  # noqa: E731
        ipc_open_event = lambda self, key: object()  # noqa: E731
        _launch_fold = lambda self, name, dst, srcs, n, arg, also=(): folds.append(len(srcs))  # noqa: E731

    print(f"CUDA IPC allreduce, 1 MiB float32, its own host time ({calls} calls)")
    for p in ranks:
        be, node = NoDevice(), I.IpcNode(Exchange(p))
        (x,), (y,) = arrays(cp, 0x100000000000, 1, 0), arrays(cp, 0x200000000000, 1, 0)
        node.allreduce(be, x, y, "sum")  # maps the made-up peers once
        folds.clear()
        t = time.perf_counter()
        for _ in range(calls):
            node.allreduce(be, x, y, "sum")
        us = (time.perf_counter() - t) / calls * 1e6
        if folds != [p] * calls:  # one fold of every rank's shard per call, or another path was timed
            print(f"p={p}: folds of {sorted(set(folds))} operands, not one of {p} per call")
            return 1
        print(f"p={p} {us:7.2f} us per call")
    return 0

if __name__ == "__main__":
    sys.exit(main())
