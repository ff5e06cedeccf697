"""How "host" (device buffers through pinned memory, ``ddlkernels.algorithms.host``) should cut a call: its
pieces side by side with the host-array allreduce it is held to, in one run.

    mpirun -n 4 python bench/studies/staged_pieces.py --sizes 64M,256M -n 10

The staged target (issue: staged >= 0.85x the host-array path at 64 MiB and up) is judged on the device
sweep's "ddlkernels staged" line, which runs "host" with its default cut.  A call costs about the host's
allreduce of its pieces plus the first piece's copy down and the last one's copy up, which nothing
overlaps; the lines vary the cut alone:

    host arrays   the same bytes as numpy arrays, the library's tuned call (the sweep's "ddlkernels host")
    ramp 8M       the library's cut: pieces of 8 MiB, from 1 MiB at either end (``piece_cuts``, RAMP 8)
    even 8M       pieces of 8 MiB, the last one short (RAMP 1): the cut before the ramp
    even 4M       pieces of 4 MiB; fewer bytes in the copies nothing overlaps, twice the host calls
    even 16M      pieces of 16 MiB; half the host calls, twice the bytes at either end
    ramp 16M      pieces of 16 MiB, from 1 MiB at either end (RAMP 16)

Each staged line is a Communicator of its own (ipc=False, cuda_aware=False, "host" settled), so each has
its own pinned slots and inner Communicator.  Timed by the device sweep's harness
(``ddlkernels.tools.bench.runner.run_sweep``): the lines in rounds, a sample being barrier, t0, one call,
the device synchronized, t1; the slowest rank's time, median of ``-n``.  Every result is checked (small
integers: exact sums) and poisoned before the next call; a wrong element makes the run exit 1.  Needs
CuPy and a CUDA device on every rank (exits 2 without, having timed nothing).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from ddlkernels.algorithms.host import piece_cuts  # noqa: E402
from ddlkernels.tools.bench import parse_size  # noqa: E402
from ddlkernels.tools.bench.device import CupyDevice, gpu_name, gpu_or_say_why  # noqa: E402
from ddlkernels.tools.bench.impls import Collective  # noqa: E402
from ddlkernels.tools.bench.runner import run_sweep  # noqa: E402

MiB = 1 << 20
#: line -> (piece bytes, ramp)
CUTS = {"ramp 8M": (8 * MiB, 8), "even 8M": (8 * MiB, 1), "even 4M": (4 * MiB, 1), "even 16M": (16 * MiB, 1),
        "ramp 16M": (16 * MiB, 16)}


def measure(comm, dev, sizes, cuts=CUTS, iters=10, warmup=3):
    """Rows ``{"bytes": N, line: ms, ...}`` (the same on every rank) and the wrong elements of every line,
    summed over ranks and calls.  ``dev``: the device sweep's ``CupyDevice`` interface (the tests hand it the
    stream emulator's); ``cuts``: line -> (piece bytes, ramp)."""
    import ddlkernels

    p, me = comm.Get_size(), comm.Get_rank()
    if p < 2:  # one rank reduces nothing: no "host" algorithm (ddlkernels.algorithms.host.Host.probe)
        raise ValueError("staged_pieces: one rank has nothing to reduce; run it under mpirun -n 2 or more")
    host = ddlkernels.Communicator(comm)
    staged = {}
    for name, (piece, ramp) in cuts.items():
        c = staged[name] = ddlkernels.Communicator(comm, ipc=False, cuda_aware=False)
        c.algorithms["host"].piece_bytes, c.algorithms["host"].ramp = piece, ramp
    wrong, rows = 0, []
    for nbytes in sizes:
        n = nbytes // 4
        base = np.arange(n, dtype=np.int64) % 251
        xh, oh = (base + me).astype(np.float32), np.empty(n, np.float32)
        want = (p * base + p * (p - 1) // 2).astype(np.float32)
        x, out, poison = dev.array(xh), dev.empty(n, np.float32), dev.array(np.full(n, -1, np.float32))
        for c in staged.values():
            c.settle(x, "host")

        def timed(fn):
            def run(_):
                fn()
                dev.synchronize()
            return run

        def checked(result):
            def check(_):
                bad = int(np.count_nonzero(result() != want))
                dev.copy(out, poison)  # the next sample must write the result again
                oh.fill(-1)
                dev.synchronize()
                return bad
            return check

        impls = [Collective("host arrays", lambda q: 2 * (q - 1) / q, lambda *_: None,
                            timed(lambda: host.allreduce(xh, "sum", out=oh)), checked(lambda: oh),
                            settling=lambda _: host.tuning(xh))]
        impls += [Collective(name, lambda q: 2 * (q - 1) / q, lambda *_: None,
                             timed(lambda c=c: c.allreduce(x, "sum", out=out)), checked(lambda: dev.to_host(out)))
                  for name, c in staged.items()]
        got = run_sweep(comm, [nbytes], impls, iters=iters, warmup=warmup, progress=False)[0]
        wrong += sum(m["wrong"] for m in got["impls"].values())
        rows.append({"bytes": nbytes, **{name: m["time_us_median"] / 1e3 for name, m in got["impls"].items()}})
    for c in (host, *staged.values()):
        c.free()
    return rows, wrong


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64M,256M")
    ap.add_argument("-n", "--iters", type=int, default=10)
    ap.add_argument("-w", "--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    p, me = comm.Get_size(), comm.Get_rank()
    cp = gpu_or_say_why(comm, "staged_pieces")  # collective; each rank on its local_device
    if cp is None:
        return 2
    try:
        rows, wrong = measure(comm, CupyDevice(cp), [parse_size(s) for s in args.sizes.split(",")], CUTS,
                              args.iters, args.warmup)
    except ValueError as exc:  # before any call, on every rank alike
        if me == 0:
            print(exc)
        return 2
    gpus = len(set(comm.allgather(cp.cuda.Device().pci_bus_id)))
    if me == 0:
        print(f"# {p} ranks on {gpus} GPU(s), {gpu_name(cp)}, float32 allreduce of device buffers through pinned "
              f"memory (\"host\"), median of {args.iters} after {args.warmup}, slowest rank; ms (x host arrays)")
        print(table(rows, CUTS))
        print(f"\nwrong elements in all: {wrong}", flush=True)
    return 1 if wrong else 0


def table(rows, cuts=CUTS) -> str:
    """One row per size: every line's ms and its ratio to the host arrays'; then each cut's pieces."""
    names = ["host arrays", *cuts]
    lines = [f"{'size':>6} " + " ".join(f"{k:>17}" for k in names)]
    for row in rows:
        lines.append(f"{row['bytes'] >> 20:>5}M " + " ".join(
            f"{row[k]:>8.3f} ({row['host arrays'] / row[k]:>5.2f})" for k in names))
    for row in rows:
        n = row["bytes"] // 4
        lines.append(f"# pieces at {row['bytes'] >> 20}M: " + "; ".join(
            f"{k} {len(piece_cuts(n, b // 4, r))}" for k, (b, r) in cuts.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
