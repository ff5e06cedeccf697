"""Host time of ``reduce_many``'s argument checks: what the IPC allreduce's fold costs before its launch.

The CUDA IPC allreduce of p ranks folds p shards into p outputs in one kernel
(``ddlkernels.algorithms.ipc``); before the launch, ``DeviceBackend.reduce_many``
checks that the outputs are disjoint and which operands are, or touch, an
output.  This times that host work alone on the CuPy backend: CuPy arrays over
made-up device addresses (nothing reads them: the launch is replaced by one
that does nothing), so it runs with or without a GPU.  The shapes are the IPC
allreduce's own: in place, each rank's input shard is an output; out of place,
the operands lie apart from the outputs.

    python bench/studies/fold_checks.py [--calls 20000] [--ranks 2,4,8]

Up to 8 ranks, the fold of one launch (beyond, an in-place fold goes through a
scratch buffer these made-up addresses cannot give).
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
    try:
        import cupy as cp

        from ddlkernels.backends._cupy import CupyBackend
    except ImportError as exc:
        print(f"fold_checks: needs CuPy ({exc})")
        return 2
    be = CupyBackend()
    launches = []
    be._launch_fold = lambda name, dst, srcs, n, arg, also=(): launches.append(len(srcs))
    print(f"reduce_many host time per call, CuPy backend, launch replaced by nothing, {args.calls} calls")
    ranks = [int(v) for v in args.ranks.split(",")]
    if not all(2 <= p <= 8 for p in ranks):
        ap.error("--ranks: from 2 to 8")
    for p in ranks:
        outs = arrays(cp, 0x7F0000000000, p, 1 << 24)  # one shard of each rank's output, ranks apart
        apart = arrays(cp, 0x7E0000000000, p, 1 << 24)
        for shape, srcs in (("in place", outs), ("out of place", apart)):
            launches.clear()
            t = time.perf_counter()
            for _ in range(args.calls):
                be.reduce_many("sum", outs[0], srcs, also=outs[1:])
            us = (time.perf_counter() - t) / args.calls * 1e6
            if launches != [p] * args.calls:  # one launch of every operand per call, or the wrong path was timed
                print(f"p={p} {shape}: launches of {sorted(set(launches))} operands, not one of {p} per call")
                return 1
            print(f"p={p} {shape:13s} {us:7.2f} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
