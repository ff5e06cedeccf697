"""Two schedules of the CUDA IPC allreduce side by side, on the ranks of one node: which one a GPU shared by
several ranks wants.

    mpirun -n 2 python bench/studies/ipc_schedules.py --sizes 1M,64M,256M -n 20

Every schedule is the library's protocol (``ddlkernels.algorithms.ipc``): record "ready", a small
allgather, the stream waits for the peers' "ready", the kernels, record "done", a second allgather, the
stream waits for the peers' "done".  They differ only in who runs the kernel:

    two-shot      every rank folds its shard of every rank's input into every rank's output (the
                  library's schedule: with a GPU per rank, p GPUs work at once)
    one kernel    rank 0 folds the whole buffer into every rank's output, the others only wait
                  (ranks that share one GPU share its memory bandwidth anyway; their kernels, each in a
                  context of its own, take turns on it)
    host sync     one kernel, but no stream waits for a peer's event: each rank blocks until its stream
                  has run before each allgather (the library's schedule where the ranks share one GPU)
    ipc node      the library's own schedule called beneath the Communicator (``IpcNode.allreduce``):
                  with its exchange of where the buffers lie, without the call's checks and choice
    library       ``Communicator(ipc=True).allreduce`` of the same buffers: the library's own choice of
                  the schedules above, with what a call of it costs besides
    library pool  the same call on arrays of CuPy's memory pool (``cupy.asarray``, ``cupy.empty``), as
                  the device sweep's lines have, where the lines above have allocations of their own
    library tails the library's call with the event a device call leaves for the next one recorded at
                  every call (``DeviceBackend.idle`` made False), as before calls that end with their
                  stream run stopped leaving one: the ranks that only wait queue a record and a wait on
                  the GPU again; on a Communicator of its own
    protocol      the events and the two allgathers with no kernel: what a call costs beside its bytes
    device copy   every rank copies its input once on its GPU (the sweep's floor line)

Timed by the harness that times ``ddlkernels/tools/bench/device.py``'s lines (``runner.run_sweep``): the
lines in rounds, a sample being barrier, t0, one call, the device synchronized, t1; the slowest rank's
time, median of ``-n``.  Every result is checked (small integers: exact sums), the output poisoned
before the next call; a wrong element makes the run exit 1.  Needs CuPy and a CUDA device on every rank.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from ddlkernels.tools.bench import parse_size  # noqa: E402
from ddlkernels.tools.bench.device import gpu_or_say_why  # noqa: E402
from ddlkernels.tools.bench.impls import Collective  # noqa: E402
from ddlkernels.tools.bench.runner import run_sweep  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,64M,256M")
    ap.add_argument("-n", "--iters", type=int, default=20)
    ap.add_argument("-w", "--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    p, me = comm.Get_size(), comm.Get_rank()
    cp = gpu_or_say_why(comm, "ipc_schedules")  # collective; each rank on its local_device
    if cp is None:
        return 2
    import ddlkernels
    from ddlkernels.backends import get_backend

    be = get_backend("cupy")
    lib = ddlkernels.Communicator(comm, shm=False, ipc=True)
    lib_tails = ddlkernels.Communicator(comm, shm=False, ipc=True)
    node = lib.algorithms["ipc"].node
    why = node.check(be)  # collective; the library's calls then find its verdict made
    if why is not None:
        if me == 0:
            print(f"ipc_schedules: CUDA IPC does not work here ({why})")
        return 2
    s = cp.cuda.get_current_stream()
    (ready, ready_key), (done, done_key) = be.ipc_event(), be.ipc_event()
    keys = comm.allgather((ready_key, done_key))
    peers_ready = [be.ipc_open_event(k[0]) if q != me else None for q, k in enumerate(keys)]
    peers_done = [be.ipc_open_event(k[1]) if q != me else None for q, k in enumerate(keys)]
    wrong, rows = 0, []
    for nbytes in [parse_size(x) for x in args.sizes.split(",")]:
        n = nbytes // 4
        xb, ob = be.ipc_alloc(nbytes), be.ipc_alloc(nbytes)
        x, out = xb.view(np.float32), ob.view(np.float32)
        base = np.arange(n, dtype=np.int64) % 251
        x.set((base + me).astype(np.float32))
        want = (p * base + p * (p - 1) // 2).astype(np.float32)
        handles = comm.allgather((be.ipc_export(xb), be.ipc_export(ob)))
        maps, xs, outs = [], [], []
        for q, ((xk, xo), (ok, oo)) in enumerate(handles):
            if q == me:
                xs.append(x)
                outs.append(out)
                continue
            mx, mo = be.ipc_open(xk), be.ipc_open(ok)
            maps += [mx, mo]
            xs.append(be.ipc_view(mx, xo, n, np.float32))
            outs.append(be.ipc_view(mo, oo, n, np.float32))
        cut = [n * q // p for q in range(p + 1)]

        def protocol(kernels):
            be.record_on(s, ready)
            comm.allgather(None)
            for q in range(p):
                if q != me:
                    be.wait(s, peers_ready[q])
            kernels()
            be.record_on(s, done)
            comm.allgather(None)
            for q in range(p):
                if q != me:
                    be.wait(s, peers_done[q])

        def two_shot():
            lo, hi = cut[me], cut[me + 1]
            be.reduce_many("sum", out[lo:hi], [v[lo:hi] for v in xs],
                           also=[outs[q][lo:hi] for q in range(p) if q != me])

        def one_kernel():
            if me == 0:
                be.reduce_many("sum", out, xs, also=outs[1:])

        def host_sync():
            s.synchronize()
            comm.allgather(None)
            one_kernel()
            s.synchronize()
            comm.allgather(None)

        def with_tails():
            be.idle = lambda stream: False  # this instance only, for this call: the tail is recorded as it was
            try:
                lib_tails.allreduce(x, "sum", out=out)
            finally:
                del be.idle

        copy_dst = cp.empty_like(x)
        x_pool, out_pool = cp.asarray(x), cp.empty_like(x)
        lines = {"two-shot": lambda: protocol(two_shot), "one kernel": lambda: protocol(one_kernel),
                 "host sync": host_sync, "ipc node": lambda: node.allreduce(be, x, out, "sum"),
                 "library": lambda: lib.allreduce(x, "sum", out=out),
                 "library pool": lambda: lib.allreduce(x_pool, "sum", out=out_pool), "library tails": with_tails,
                 "protocol": lambda: protocol(lambda: None), "device copy": lambda: cp.copyto(copy_dst, x)}

        def timed(fn):
            def run(_):
                fn()
                cp.cuda.Device().synchronize()
            return run

        def checked(result):
            def check(_):
                # Right after the call (the harness's allreduce of the sample's time has passed: every rank's
                # writes into my output have run); then poisoned, so that the next sample must write it again.
                bad = int((cp.asnumpy(result) != want).sum())
                result.fill(-1)
                cp.cuda.Device().synchronize()
                return bad
            return check

        impls = [Collective(name, lambda q: 2 * (q - 1) / q, lambda *_: None, timed(fn),
                            (lambda _: 0) if name in ("protocol", "device copy")
                            else checked(out_pool if name == "library pool" else out))
                 for name, fn in lines.items()]
        out.fill(-1)
        out_pool.fill(-1)
        got = run_sweep(comm, [nbytes], impls, iters=args.iters, warmup=args.warmup, progress=False)[0]
        wrong += sum(m["wrong"] for m in got["impls"].values())
        row = {"bytes": nbytes, **{name: m["time_us_median"] / 1e3 for name, m in got["impls"].items()}}
        rows.append(row)
        cp.cuda.Device().synchronize()
        comm.Barrier()
        del x_pool, out_pool  # back to CuPy's pool, not to the driver: the library's mappings of them may stay
        for m in maps:
            be.ipc_close(m)
        lib.close_peer_memory()
        lib_tails.close_peer_memory()
        comm.Barrier()
    lib.free()  # wrong: the harness summed every rank's already
    lib_tails.free()
    gpus = len(set(comm.allgather(cp.cuda.Device().pci_bus_id)))
    if me == 0:
        dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["name"]
        print(f"# {p} ranks on {gpus} GPU(s), {dev.decode() if isinstance(dev, bytes) else dev}, float32 allreduce over CUDA IPC, "
              f"median of {args.iters} after {args.warmup}, slowest rank; ms (busbw GB/s)")
        names = list(lines)
        print(f"{'size':>6} " + " ".join(f"{k:>18}" for k in names))
        for row in rows:
            bus = row["bytes"] * 2 * (p - 1) / p
            print(f"{row['bytes'] >> 20:>5}M " + " ".join(
                f"{row[k]:>9.3f} ({bus / (row[k] * 1e-3) / 1e9:>6.1f})" for k in names))
        print(f"\nwrong elements in all: {wrong}", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
