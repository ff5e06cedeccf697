"""Run every Numba kernel in the Numba CUDA simulator and compare with numpy.

Run as a script in its own process: ``NUMBA_ENABLE_CUDASIM=1`` must be set
before numba is first imported, and the rest of a test session must keep the
real (compile-only) numba-cuda.  Prints one JSON object: for each kernel name
``{"ok": bool, "max_err": float, "cases": int, "detail": str}``.

Used by tests/test_numba_sim.py and bench/kernels/kernel_report.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    raise SystemExit("numba_sim_worker.py must run with NUMBA_ENABLE_CUDASIM=1 set in its environment")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

import _kernel_ref as K  # noqa: E402
from ddlkernels.kernels import numba_cuda as N  # noqa: E402

# Small grids: the simulator runs each thread as a Python thread (~140 us each).
# 2 x 16 = 32 threads; lengths up to 131 make the grid-stride loops wrap.
GRID, BLOCK = 2, 16
LENGTHS = (0, 1, 7, 9, 33, 67, 131)


def storage(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint16) if x.dtype == K.BFLOAT16 else x


def run_reduce(op, dtype):
    suf = K.SUFFIX[dtype]
    kern = N.reduce_kernel(op, suf)
    argt = N.ARG_TYPES[suf]
    max_err, cases, ok, detail = 0.0, 0, True, ""
    for n in LENGTHS:
        for p in (3, 7):
            a0, b0 = K.make_pair(dtype, n, seed=n + p, op=op)
            arg = argt(K.kernel_arg(dtype, op, p))
            # 3-operand form
            ref = K.reference(op, a0, b0, p)
            d_a, d_b = cuda.to_device(storage(a0)), cuda.to_device(storage(b0))
            d_out = cuda.device_array(n, dtype=storage(a0).dtype)
            with np.errstate(all="ignore"):
                kern[GRID, BLOCK](d_out, d_a, d_b, arg)
            got = d_out.copy_to_host().view(dtype)
            good, err, bad = K.compare(got, ref, op)
            cases += 1
            max_err = max(max_err, err)
            if not good and ok:
                ok, detail = False, f"n={n} p={p} 3-operand: first mismatch at {bad}: {got[bad]!r} vs {ref[bad]!r}"
            if (K.bits_view(d_a.copy_to_host().view(dtype)) != K.bits_view(a0)).any():
                ok, detail = False, f"n={n}: input a modified"
            # 2-operand, in place: dst = op(dst, b)
            ref2 = a0.copy()
            with np.errstate(all="ignore"):
                K.NumpyBackend().reduce("sum" if op == "avg" else op, ref2, b0, avg_p=p if op == "avg" else None)
                kern[GRID, BLOCK](d_a, d_a, d_b, arg)
            got2 = d_a.copy_to_host().view(dtype)
            good, err, bad = K.compare(got2, ref2, op)
            cases += 1
            max_err = max(max_err, err)
            if not good and ok:
                ok, detail = False, f"n={n} p={p} in place: first mismatch at {bad}: {got2[bad]!r} vs {ref2[bad]!r}"
    return {"ok": ok, "max_err": max_err, "cases": cases, "detail": detail}


def run_pack():
    """The kernels straight from a hand-written table of 2-byte words: pieces of 3 words in a grid smaller
    than the rows, blocks narrower than a piece, an empty tensor, a gap between tensors left alone."""
    lens = (0, 1, 5, 16, 33, 2)  # words
    tensors = [((np.arange(n) * 37 + 11 * k) % 65521).astype(np.uint16) for k, n in enumerate(lens)]
    offsets = np.cumsum([0] + list(lens[:-1])).astype(np.int64) + 3
    total = int(offsets[-1] + lens[-1])
    d_t = [cuda.to_device(t) for t in tensors]
    rows = [(d.ctypes.data + 2 * s, min(3, n - s), offsets[k] + s)
            for k, (d, n) in enumerate(zip(d_t, lens)) for s in range(0, n, 3)]
    table = cuda.to_device(np.array(rows, dtype=np.int64))
    d_buf = cuda.to_device(np.full(total + 4, 7, np.uint16))
    N.pack_kernel(2)[5, 2](table, d_buf)
    buf = d_buf.copy_to_host()
    expect = np.full(total + 4, 7, np.uint16)
    for t, o in zip(tensors, offsets):
        expect[o:o + t.size] = t
    ok = bool((buf == expect).all())
    for d in d_t:
        d.copy_to_device(np.zeros(d.shape[0], np.uint16))
    N.unpack_kernel(2)[5, 2](table, d_buf)
    ok2 = all((d.copy_to_host() == t).all() for d, t in zip(d_t, tensors))
    return {"ok": ok and ok2, "max_err": 0.0 if ok and ok2 else float("inf"), "cases": 2,
            "detail": "" if ok and ok2 else f"pack ok={ok} unpack ok={ok2}"}


def main(argv):
    only = set(argv[1:])
    results = {}
    for dtype in K.DTYPES:
        for op in K.OPS:
            name = f"ddl_reduce_{op}_{K.SUFFIX[dtype]}"
            if only and name not in only:
                continue
            results[name] = run_reduce(op, dtype)
    if not only or "ddl_pack" in only:
        r = run_pack()
        results["ddl_pack"] = results["ddl_unpack"] = r
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main(sys.argv)
