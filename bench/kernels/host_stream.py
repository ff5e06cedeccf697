"""The host reduce's out-of-place loop with and without non-temporal stores, next to a copy, by size.

    python bench/kernels/host_stream.py [--sizes 4M,16M,32M,64M,128M] [--rounds 9]

One process, float32 sum, GB/s as STREAM counts them (reduce: read 2, write
1 array; ``np.copyto`` copy: read 1, write 1).  Each round runs the plain loop,
the streamed loop (``ddlkernels.kernels.host_loops.reduce[SUM](..., stream_from=0)``) and
the copy once each, in that order, on their own arrays; medians over rounds.
This is the measurement behind ``ddlkernels.kernels.host_loops.STREAM_FROM``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ddlkernels.tools.bench import parse_size
from ddlkernels.kernels.host_loops import SUM, reduce


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1M,4M,16M,32M,64M,128M")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    print(f"{'size':>6} | {'plain':>6} {'stream':>6} {'copy':>6} GB/s | stream/plain plain/copy stream/copy")
    for s in args.sizes.split(","):
        nbytes = parse_size(s)
        n = nbytes // 4
        a, b = (np.random.default_rng(k).random(n, dtype=np.float32) for k in (1, 2))
        d, e, c = np.empty_like(a), np.empty_like(a), np.empty_like(a)
        reduce[SUM](d, a, b, 1 << 62)
        reduce[SUM](e, a, b, 0)
        if not np.array_equal(d, e):
            raise SystemExit(f"{s}: the streamed loop's result differs")
        times = {"plain": [], "stream": [], "copy": []}
        for _ in range(args.rounds):
            for name, run in (("plain", lambda: reduce[SUM](d, a, b, 1 << 62)), ("stream", lambda: reduce[SUM](e, a, b, 0)),
                              ("copy", lambda: np.copyto(c, a))):
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
        gb = {k: (2 if k == "copy" else 3) * nbytes / float(np.median(v)) / 1e9 for k, v in times.items()}
        print(f"{s:>6} | {gb['plain']:6.1f} {gb['stream']:6.1f} {gb['copy']:6.1f}      | {gb['stream'] / gb['plain']:12.2f}"
              f" {gb['plain'] / gb['copy']:10.2f} {gb['stream'] / gb['copy']:11.2f}", flush=True)


if __name__ == "__main__":
    main()
