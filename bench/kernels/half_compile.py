"""What the first float16/bfloat16 reduction of a process costs: Numba compiling, or loading its cache.

    python bench/kernels/half_compile.py            # 3 processes on an empty cache directory

Each process is a fresh interpreter that imports ddlkernels and runs every
op (sum, prod, avg, max, min) of both types through all three loops of
``ddlkernels.kernels.half`` (dst apart, dst = a, dst = b) once, on 64 elements,
and prints the seconds until the kernels were ready (``available()``) and
for the 30 calls, and how many of the compiled entry points Numba loaded
from its cache (hits) or compiled (misses).  The first process compiles
into a new, empty ``NUMBA_CACHE_DIR``; the next ones load from it, as every
process after the first does in a job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, time
import numpy as np
t0 = time.perf_counter()
from ddlkernels.kernels import half as _half
from ddlkernels._dtypes import BFLOAT16
ok = _half.available()
t1 = time.perf_counter()
for dt in (np.float16, BFLOAT16):
    a = np.arange(64).astype(dt)
    for op in ("sum", "prod", "avg", "max", "min"):
        d = np.empty_like(a)
        assert _half.reduce(op, d, a, a[::-1].copy(), 0.5)   # dst apart
        assert _half.reduce(op, d, d, a, 0.5)                # dst = a
        assert _half.reduce(op, d, a, d, 0.5)                # dst = b
t2 = time.perf_counter()
from ddlkernels.kernels import half_loops as k
fns = (k.apart, k.into_a, k.into_b)
hits = sum(sum(f.stats.cache_hits.values()) for f in fns)
misses = sum(sum(f.stats.cache_misses.values()) for f in fns)
print(json.dumps({"ok": ok, "ready_s": t1 - t0, "calls_s": t2 - t1, "hits": hits, "misses": misses}))
"""


def measure(runs: int, cache_dir: str) -> list[dict]:
    """One dict per fresh process (``ok``, ``ready_s``, ``calls_s``, ``hits``, ``misses``), all on ``cache_dir``."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    rows = []
    for _ in range(runs):
        res = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return rows


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory(prefix="ddl-numba-cache-") as cache:
        print(f"# NUMBA_CACHE_DIR={cache} (empty at the start)")
        print(f"{'process':>8} {'ready(s)':>9} {'30 calls(s)':>12} {'total(s)':>9} {'cache hits':>11} {'compiled':>9}")
        for i, r in enumerate(measure(runs, cache)):
            if not r["ok"]:
                sys.exit("the compiled kernels are not available here (is numba installed?)")
            print(f"{i + 1:>8} {r['ready_s']:>9.2f} {r['calls_s']:>12.2f} {r['ready_s'] + r['calls_s']:>9.2f} "
                  f"{r['hits']:>11} {r['misses']:>9}")


if __name__ == "__main__":
    main()
