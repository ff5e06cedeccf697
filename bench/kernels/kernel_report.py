"""The GPU kernels' report card, measured here, without a GPU.

    python bench/kernels/kernel_report.py [--out FILE.md]

One row per kernel x dtype, for both implementations (the realign and fold kernels are .cu only):

* kernels/*.cu (what the CuPy backend loads): compiled with NVRTC (CUDA 12.9)
  for sm_70, sm_80, sm_90 and with nvcc (the machine's, sm_75/80/90);
  registers and spill bytes from ptxas (via NVRTC -Xptxas=-v) per arch;
  "vectorized" = the PTX has 128-bit global loads and stores; "PTX instr." =
  the statements of its compute_90 PTX (NVRTC), the whole kernel; executed on the
  CPU through the host harness (tests/cuda_host: g++ + a header defining the
  CUDA built-ins, every thread of the grid run), over the same cases as
  tests/test_cu_host.py; max |error| against the numpy backend (0 = every
  result bit-identical; NaN payloads of sum/prod/avg excepted).
* ddlkernels/kernels/numba_cuda.py: ``numba.cuda.compile_ptx`` for sm_70/80/90,
  registers and spills from ptxas (pip CUDA 12.9), executed in the Numba
  CUDA simulator (tests/numba_sim_worker.py), same comparison.

Nothing here is hard-coded: every cell comes from a compiler or a run made
by this script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "cuda_host")]

import numpy as np  # noqa: E402

import _compile_tools as C  # noqa: E402
import _kernel_ref as K  # noqa: E402
import harness as H  # noqa: E402
from ddlkernels.backends._device import pack_pieces  # noqa: E402
from ddlkernels.kernels import numba_cuda as N  # noqa: E402
from ddlkernels.kernels.sources import KINDS, units  # noqa: E402

ARCHS = C.NVRTC_ARCHS


def cu_compile_info(seconds=None):
    """{kernel: {"nvrtc": {arch: info|None}, "nvcc": {arch: bool}, "vec": bool}} for both .cu files;
    ``seconds``, a dict, gets each NVRTC compile's wall time by (source, arch): the first launch's wait on a
    GPU whose kernels are not in the cache yet."""
    out = {}
    for source in ("reduce.cu", "pack.cu"):
        for arch in ARCHS:
            t = time.perf_counter()
            ok, log, _ = C.nvrtc(source, f"sm_{arch}")
            if seconds is not None:
                seconds[(source, arch)] = time.perf_counter() - t
            for name, info in (C.parse_ptxas(log) if ok else {}).items():
                out.setdefault(name, {"nvrtc": {}, "nvcc": {}, "vec": False})["nvrtc"][arch] = info
        ok, log, ptx = C.nvrtc(source, "compute_90")
        for name, body in (C.ptx_entries(ptx.decode()) if ok else {}).items():
            row = out.setdefault(name, {"nvrtc": {}, "nvcc": {}, "vec": False})
            row["vec"], row["ptx"] = C.vectorized(body), C.ptx_instructions(body)
        if C.nvcc_path():
            for arch in C.NVCC_ARCHS:
                ok, log, _ = C.nvcc(source, arch)
                seen = C.parse_ptxas(log) if ok else {}
                for name, info in seen.items():
                    out.setdefault(name, {"nvrtc": {}, "nvcc": {}, "vec": False})["nvcc"][arch] = (
                        info["spill_stores"] + info["spill_loads"] == 0)
    return out


def host_harness_results(harness):
    """{kernel: (ok, max_err, cases)} over the cases of tests/test_cu_host.py."""
    import test_cu_host as T

    res = {}
    for dtype, kind in itertools.product(K.DTYPES, ("reduce", "realign")):
        v = 16 // dtype.itemsize
        for op in K.OPS:
            name = f"ddl_{kind}_{op}_{K.SUFFIX[dtype]}"
            ok, err, cases = True, 0.0, 0
            stride = 2 * 32  # the (2, 32) launch: lengths past 4 rounds of its stride run several on every thread
            for n in T.lengths(dtype) + [4 * stride * v + 3, 13 * stride * v + 5]:
                for p in (3, 7):
                    a0, b0 = K.make_pair(dtype, n, seed=n + p, op=op)
                    ref = K.reference(op, a0, b0, p)
                    for offs in ((0, 0, 0), (1, 1, 1), (v - 1, v - 1, v - 1), (1, 1, 0)):
                        for grid, block, rev in T.LAUNCHES:
                            _, d = T.aligned(n, dtype, offs[0])
                            _, a = T.aligned(n, dtype, offs[1])
                            _, b = T.aligned(n, dtype, offs[2])
                            a[:], b[:] = a0, b0
                            harness.reduce(name, d, a, b, K.kernel_arg(dtype, op, p), grid, block, rev)
                            good, e, _ = K.compare(d, ref, op)
                            ok &= good
                            err = max(err, e)
                            cases += 1
            res[name] = (ok, err, cases)
    # the fold kernels: test_cu_host's cases, k = 2, 3, 5, 8 operands against the chain of reductions, into
    # dst alone and into dst and 3 more destinations; ddl_fold_realign's operands 1 and 2 elements further in
    # than the outputs, by turns
    for dtype, op, kind in itertools.product(K.DTYPES, K.OPS, ("fold", "fold_realign")):
        name = f"ddl_{kind}_{op}_{K.SUFFIX[dtype]}"
        shift = (lambda j: 1 + j % 2) if kind == "fold_realign" else (lambda j: 0)
        ok, err, cases = True, 0.0, 0
        for n in (0, 1, 16 // dtype.itemsize + 1, 67, 257):
            for k in (2, 3, 5, 8):
                ops, ref = T.fold_case(dtype, op, n, k)
                for off in (0, 1):
                    for grid, block, rev in T.LAUNCHES:
                        for m in (0, 3):
                            _, d = T.aligned(n, dtype, off)
                            also = [T.aligned(n, dtype, off)[1] for _ in range(m)]
                            srcs = []
                            for j, o in enumerate(ops):
                                _, s = T.aligned(n, dtype, off + shift(j))
                                s[:] = o
                                srcs.append(s)
                            harness.fold(name, d, srcs, K.kernel_arg(dtype, op, k), grid, block, rev, also=also)
                            for got in [d] + also:
                                good, e, _ = K.compare(got, ref, op)
                                ok &= good
                                err = max(err, e)
                            cases += 1
        res[name] = (ok, err, cases)
    # pack/unpack: the byte copies of test_cu_host.test_pack_unpack, all paddings
    ok, cases = True, 0
    for pad in (1, 4, 16):
        tensors = T._tensors(pad)
        offsets, buf = T.packed_layout(tensors, pad, 3 if pad == 1 else 0)
        table = np.array([[t.ctypes.data, t.size, o] for t, o in zip(tensors, offsets)], dtype=np.uint64)
        harness.pack(table, buf, (2, 3), 32, True)
        ok &= all((buf[o:o + t.size] == t).all() for t, o in zip(tensors, offsets))
        dests = [np.zeros_like(t) for t in tensors]
        table = np.array([[d.ctypes.data, d.size, o] for d, o in zip(dests, offsets)], dtype=np.uint64)
        harness.unpack(table, buf, (2, 3), 32, False)
        ok &= all((d == t).all() for d, t in zip(dests, tensors))
        # the CuPy backend's launch: 48-byte pieces, one block each
        buf[:] = 0
        table = pack_pieces([t.ctypes.data for t in tensors], [t.size for t in tensors], offsets, 48)
        harness.pack(table, buf, (1, 5), 32, True)
        ok &= all((buf[o:o + t.size] == t).all() for t, o in zip(tensors, offsets))
        cases += 3
    res["ddl_pack"] = res["ddl_unpack"] = (ok, 0.0 if ok else float("inf"), cases)
    return res


def numba_compile_info():
    out = {}
    pack_sig = N.pack_signature()
    jobs = [(f"ddl_reduce_{op}_{suf}", N.reduce_kernel(op, suf, python=True), N.kernel_signature(suf))
            for suf in N.SUFFIXES for op in N.OPS]
    jobs += [("ddl_pack", N.pack_kernel(python=True), pack_sig), ("ddl_unpack", N.unpack_kernel(python=True), pack_sig)]
    for name, fn, sig in jobs:
        row = {"arch": {}, "vec": False}
        for cc in ARCHS:
            try:
                ptx, _ = C.numba_ptx(fn, sig, cc)
            except Exception:
                row["arch"][cc] = None
                continue
            ok, log = C.ptxas(ptx, cc)
            infos = list(C.parse_ptxas(log).values()) if ok else []
            row["arch"][cc] = infos[0] if infos else None
            row["vec"] = row["vec"] or any(C.vectorized(b) for b in C.ptx_entries(ptx).values())
        out[name] = row
    return out


def numba_sim_results():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "numba_sim_worker.py")], env=env,
                         capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return {k: (v["ok"], v["max_err"], v["cases"]) for k, v in json.loads(res.stdout).items()}


_TYPED = ("ddl_reduce_", "ddl_realign_", "ddl_fold_")  # kernels named ..._<dtype>


def _dtype_of(name):
    return name.rsplit("_", 1)[1] if name.startswith(_TYPED) else "bytes"


def _kernel_of(name):
    return name.rsplit("_", 1)[0] if name.startswith(_TYPED) else name


def _yn(b):
    return "yes" if b else "no"


def _fmt_err(ok, err):
    if not ok:
        return f"MISMATCH ({err:g})"
    return "0 (bitwise)" if err == 0 else f"{err:g}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the markdown table to this file")
    args = ap.parse_args(argv)
    t0 = time.time()
    compile_s = {}
    cu = cu_compile_info(compile_s)
    by_kind = {}  # reduce.cu one kind at a time, as a first call compiles it (sources.unit_of)
    for kind, unit in zip(KINDS, units("reduce.cu")):
        t = time.perf_counter()
        ok, log, _ = C.nvrtc("reduce.cu", f"sm_{ARCHS[-1]}", defines=unit)
        by_kind[kind] = time.perf_counter() - t if ok else float("nan")
    with tempfile.TemporaryDirectory() as td:
        host = host_harness_results(H.build(td))
    nb = numba_compile_info()
    sim = numba_sim_results()

    lines = [
        "| impl | kernel | dtype | sm_70 | sm_80 | sm_90 | nvcc sm_75/80/90 | registers 70/80/90 | spills | "
        "128-bit vectorized | PTX instr. | executed | cases | max error vs numpy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = [f"ddl_reduce_{op}_{suf}" for op in N.OPS for suf in N.SUFFIXES] + ["ddl_pack", "ddl_unpack"]
    # .cu only: the kernel for operands at another offset modulo 16 than dst, and the IPC fold
    only_cu = [f"ddl_{kind}_{op}_{suf}" for kind in ("realign", "fold", "fold_realign") for op in N.OPS
               for suf in N.SUFFIXES]
    for name in order[:-2] + only_cu + order[-2:]:
        c = cu.get(name, {"nvrtc": {}, "nvcc": {}, "vec": False})
        regs = "/".join(str(c["nvrtc"][a]["regs"]) if c["nvrtc"].get(a) else "-" for a in ARCHS)
        spills = sum(i["spill_stores"] + i["spill_loads"] for i in c["nvrtc"].values() if i)
        nvcc_ok = "/".join(_yn(c["nvcc"].get(a, False)) for a in C.NVCC_ARCHS)
        ok, err, cases = host.get(name, (False, float("inf"), 0))
        lines.append(
            f"| .cu | {_kernel_of(name)} | {_dtype_of(name)} | "
            + " | ".join(_yn(c["nvrtc"].get(a) is not None) for a in ARCHS)
            + f" | {nvcc_ok} | {regs} | {spills} B | {_yn(c['vec'])} | {c.get('ptx', '-')} | host harness | {cases} | "
            f"{_fmt_err(ok, err)} |"
        )
    for name in order:
        r = nb[name]
        regs = "/".join(str(r["arch"][a]["regs"]) if r["arch"].get(a) else "-" for a in ARCHS)
        spills = sum(i["spill_stores"] + i["spill_loads"] for i in r["arch"].values() if i)
        ok, err, cases = sim.get(name, (False, float("inf"), 0))
        lines.append(
            f"| numba | {_kernel_of(name)} | {_dtype_of(name)} | "
            + " | ".join(_yn(r["arch"].get(a) is not None) for a in ARCHS)
            + f" | n/a | {regs} | {spills} B | {_yn(r['vec'])} | - | simulator | {cases} | {_fmt_err(ok, err)} |"
        )
    table = "\n".join(lines)
    head = (f"Kernel report ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"NVRTC 12.9 for sm_70/80/90, nvcc {'found' if C.nvcc_path() else 'absent'}; "
            f"generated in {time.time() - t0:.0f} s by bench/kernels/kernel_report.py)\n")
    head += ("\nNVRTC compile of each whole file, wall time here (what `python -m ddlkernels compile --cuda` makes "
             "of pack.cu; reduce.cu it compiles one kind at a time, as below), sm_"
             + "/".join(str(a) for a in ARCHS) + ": "
             + "; ".join(f"{src} " + " / ".join(f"{compile_s[(src, a)]:.1f}" for a in ARCHS) + " s"
                         for src in ("reduce.cu", "pack.cu")) + "\n")
    head += (f"\nreduce.cu one kind at a time (what a first launch of a kind waits for where the kernel cache has no "
             f"image of it yet: sources.unit_of), sm_{ARCHS[-1]}: "
             + ", ".join(f"{k} {v:.1f} s" for k, v in by_kind.items()) + "\n")
    print(head)
    print(table)
    if args.out:
        Path(args.out).write_text(head + "\n" + table + "\n")
    bad = [ln for ln in lines[2:] if "MISMATCH" in ln or "| no | no | no |" in ln]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
