"""The CUDA kernels on a GPU beside torch and CuPy built-ins, in one run: GB/s, host time per launch, results checked.

    python bench/kernels/device_kernels.py [--sizes 64M,256M,512M] [-n 20] [--json r.json]

* reduce ``dst = a + b`` (ddlkernels' CuPy backend, kernels/reduce.cu) against ``torch.add(out=)``,
  ``cupy.add(out=)`` and a device copy (``cupy.copyto``), for float32, float16 and bfloat16 (CuPy has
  no bfloat16: torch only), out of place and in place (``dst`` is ``a``), aligned and "+1" (``a`` and
  ``b`` one element off a 16-byte boundary: out of place into an aligned output, ``ddl_realign``; in
  place, ``ddl_reduce`` after a scalar head); GB/s of bytes moved, as STREAM counts them
  (reduce 3 x size, copy 2 x size), median of ``-n`` runs timed with CUDA events, the lines taken in
  turn within each run, each run queued behind a kernel that holds the GPU until the host has launched
  it (the events time the device's work, not the host's launch, which the next line times);
* host time per launch: 1000 back-to-back 1 MiB launches of each, divided by 1000 (the device
  synchronized after, not between), the Numba backend's reduce beside the CuPy backend's;
* the fold of 4 operands (the CUDA IPC allreduce's reduce-scatter at 4 ranks): one ``ddl_fold`` launch
  against the chain of 3 reduce launches it replaces, the same bits; and the fold writing 4 destinations
  (the IPC allreduce out of place) against the fold and 3 copies; and the fold of the allreduce where 2
  ranks share one GPU (2 inputs of 256 MiB into 2 outputs) against torch.add and a copy; and 2 operands one
  element in folded into 2 aligned outputs, ``ddl_fold_realign`` against ``ddl_fold``'s element path;
* pack: 182 tensors of a ResNet-like mix of sizes (313 MiB) into one buffer against ``torch.cat``,
  by the CuPy backend and by the Numba one (the same table of kernels/pack.cu, read in 8-byte words).

The Numba lines are left out, with the reason, where numba-cuda cannot run on the device.

Every ddlkernels result is compared with torch's, bit for bit (one addition rounds alike in
every library); any difference makes the run exit 1.  Needs CuPy, torch and a CUDA device;
exits 2 without, having timed nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402

from ddlkernels.backends._device import _kernel_op  # noqa: E402
from ddlkernels.tools.bench import parse_size  # noqa: E402


def gpu_or_say_why(script):
    """``(cupy, torch)`` where a CUDA device is, else None after saying why (the caller exits 2)."""
    cp, torch, why = _gpu()
    if cp is None:
        print(f"{script}: no GPU to measure on ({why}); nothing was timed", flush=True)
        return None
    return cp, torch


def _gpu():
    try:
        import cupy as cp
        import torch

        if cp.cuda.runtime.getDeviceCount() < 1 or not torch.cuda.is_available():
            return None, None, "no CUDA device (CuPy or torch)"
        return cp, torch, None
    except Exception as exc:  # noqa: BLE001 -- no CuPy, torch or driver: the reason is the message
        return None, None, f"{type(exc).__name__}: {exc}".splitlines()[0]


# A GPU left idle between runs waits, after the start event, for the host to launch the run: the events would
# time the launch's host cost with the kernel (11.4 us a launch for the CuPy backend's reduce, 7.8 us for
# torch.add, beside about 57 us for torch.add's 64 MiB float32 reduce on the H200: device_kernels_h200.txt).
# So each run starts behind a kernel that keeps one thread busy for longer than the host takes to launch the
# run (nvbench's "blocking kernel"); host time per launch is a line of its own.
_SPIN = r"""
extern "C" __global__ void ddl_bench_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""
#: the spin before a run: this many times the run's host time, plus SPIN_MIN_S, at most SPIN_MAX_S
SPIN_FACTOR, SPIN_MIN_S, SPIN_MAX_S = 3, 50e-6, 20e-3


def _events_ms(cp, fn, iters):
    """Median milliseconds of ``fn()`` over ``iters`` runs, each between two CUDA events on the null stream
    (torch's default stream and CuPy's current one here)."""
    return _events_ms_each(cp, {"fn": fn}, iters)["fn"]


def _events_ms_each(cp, fns, iters):
    """Median milliseconds of device work of every function of ``fns`` (name -> function), each run twice
    untimed first (the second timing its host cost), then timed with CUDA events on the null stream behind
    the spin kernel, in turn within each of ``iters`` iterations, so that the GPU's clocks and the other
    processes' load drift alike over every line instead of favouring the one timed first."""
    spin = cp.RawKernel(_SPIN, "ddl_bench_spin")
    times, waits = {k: [] for k in fns}, {}
    for k, fn in fns.items():
        fn()
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        fn()
        host = time.perf_counter() - t
        waits[k] = np.uint64(min(SPIN_MAX_S, SPIN_MIN_S + SPIN_FACTOR * host) * 1e9)
        cp.cuda.Device().synchronize()
    for _ in range(iters):
        for k, fn in fns.items():
            a, b = cp.cuda.Event(), cp.cuda.Event()
            spin((1,), (1,), (waits[k],))
            a.record()
            fn()
            b.record()
            b.synchronize()
            times[k].append(cp.cuda.get_elapsed_time(a, b))
    return {k: float(np.median(v)) for k, v in times.items()}


def _numba_backend():
    """(ddlkernels' Numba backend, numba.cuda) on the device, or (None, why not)."""
    try:
        from numba import cuda

        from ddlkernels.backends import get_backend

        nbe = get_backend("numba")
        if nbe.simulated:
            return None, "the Numba CUDA simulator is on (NUMBA_ENABLE_CUDASIM)"
        return nbe, cuda
    except Exception as exc:  # noqa: BLE001 -- no numba-cuda that runs here: the reason is the message
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64M,256M,512M", help="bytes per array, comma list (K/M/G)")
    ap.add_argument("-n", "--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    gpu = gpu_or_say_why("device_kernels")
    if gpu is None:
        return 2
    cp, torch = gpu
    from ddlkernels.backends import get_backend

    be = get_backend("cupy")
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["name"]
    gpu = name.decode() if isinstance(name, bytes) else str(name)
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    rows, wrong = [], 0
    print(f"# {gpu}; median of {args.iters} runs, CUDA events, each run queued behind a spin kernel; "
          f"GB/s = bytes moved / time (reduce 3x, copy 2x)")
    print(f"{'case':<40} {'ddlkernels':>11} {'torch.add':>10} {'cp.add':>8} {'copy':>8} {'ddl/torch':>10}")
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        for dname in ("float32", "float16", "bfloat16"):
            n = size // torch.tensor([], dtype=tdt[dname]).element_size()
            for off in (0, 1):
                for inplace in (False, True):
                    ta = torch.rand(n + off, device="cuda").to(tdt[dname])[off:]
                    tb = torch.rand(n + off, device="cuda").to(tdt[dname])[off:]
                    tout = torch.empty_like(ta)
                    view = (lambda t: cp.from_dlpack(t.view(torch.int16)).view(np.uint16)) if dname == "bfloat16" \
                        else cp.from_dlpack
                    a, b, out = view(ta), view(tb), view(tout)
                    dst = a if inplace else out
                    keep = ta.clone()
                    ref = torch.add(ta, tb)
                    be.reduce("sum", dst, a, b)
                    got = ta if inplace else tout
                    wrong += int((got.view(torch.int16) != ref.view(torch.int16)).sum().item()) if dname != "float32" \
                        else int((got.view(torch.int32) != ref.view(torch.int32)).sum().item())
                    if inplace:
                        ta.copy_(keep)
                    fns = {"ddlkernels": lambda: be.reduce("sum", dst, a, b),
                           "torch.add": lambda: torch.add(ta, tb, out=ta if inplace else tout)}
                    if dname != "bfloat16":
                        fns["cp.add"] = lambda: cp.add(a, b, out=dst)
                    fns["copy"] = lambda: cp.copyto(out, a)
                    ms = _events_ms_each(cp, fns, args.iters)
                    gbs = {k: (2 if k == "copy" else 3) * size / (v * 1e-3) / 1e9 for k, v in ms.items()}
                    case = f"reduce {size >> 20}M {dname} {'in place' if inplace else 'out'}{' +1' if off else ''}"
                    rows.append({"case": case, "GBps": gbs})
                    print(f"{case:<40} {gbs['ddlkernels']:>11.0f} {gbs['torch.add']:>10.0f} "
                          f"{gbs.get('cp.add', float('nan')):>8.0f} {gbs['copy']:>8.0f} "
                          f"{gbs['ddlkernels'] / gbs['torch.add']:>10.3f}", flush=True)
    # The IPC allreduce's fold of 4 ranks' shards: one ddl_fold launch (reduce_many) against the chain of 3.
    n = (64 << 20) // 4
    xs = [cp.random.rand(n, dtype=np.float32) for _ in range(4)]
    fdst, cdst = cp.empty(n, np.float32), cp.empty(n, np.float32)

    def chain():
        be.reduce("sum", cdst, xs[0], xs[1])
        be.reduce("sum", cdst, cdst, xs[2])
        be.reduce("sum", cdst, cdst, xs[3])

    be.reduce_many("sum", fdst, xs)
    chain()
    wrong += int(cp.count_nonzero(fdst.view(np.uint32) != cdst.view(np.uint32)))
    fold_ms = _events_ms(cp, lambda: be.reduce_many("sum", fdst, xs), args.iters)
    chain_ms = _events_ms(cp, chain, args.iters)
    print(f"\n# fold of 4 x 64 MiB float32: ddl_fold {fold_ms:.3f} ms, 3 chained reduces {chain_ms:.3f} ms "
          f"({chain_ms / fold_ms:.2f}x)")
    # Out of place the IPC allreduce writes each shard into every rank's output from the fold (4 ranks: 3 more
    # destinations) against the fold into one and 3 copies of it.
    outs = [cp.empty(n, np.float32) for _ in range(3)]

    def fold_then_copies():
        be.reduce_many("sum", cdst, xs)
        for o in outs:
            cp.copyto(o, cdst)

    be.reduce_many("sum", fdst, xs, also=outs)
    wrong += sum(int(cp.count_nonzero(o.view(np.uint32) != cdst.view(np.uint32))) for o in outs)
    multi_ms = _events_ms(cp, lambda: be.reduce_many("sum", fdst, xs, also=outs), args.iters)
    copies_ms = _events_ms(cp, fold_then_copies, args.iters)
    print(f"# fold of 4 into 4 destinations: one ddl_fold {multi_ms:.3f} ms, fold + 3 copies {copies_ms:.3f} ms "
          f"({copies_ms / multi_ms:.2f}x)")
    # Where every rank shares one GPU, rank 0 folds every rank's whole input into every output in one launch
    # (ddlkernels.algorithms.ipc): at 2 ranks and 256 MiB, 2 operands into 2 destinations.  Against torch.add and
    # a copy; the fold's time alone bounds the allreduce's bus bandwidth (bytes / t at 2 ranks).
    n = (256 << 20) // 4
    x2 = [cp.random.rand(n, dtype=np.float32) for _ in range(2)]
    o2 = [cp.empty(n, np.float32) for _ in range(2)]
    t2 = [torch.as_tensor(v, device="cuda") for v in x2 + o2]
    be.reduce_many("sum", o2[0], x2, also=o2[1:])
    ref = cp.add(x2[0], x2[1])
    wrong += sum(int(cp.count_nonzero(o.view(np.uint32) != ref.view(np.uint32))) for o in o2)

    def add_and_copy():
        torch.add(t2[0], t2[1], out=t2[2])
        t2[3].copy_(t2[2])

    one_gpu = _events_ms_each(cp, {"fold": lambda: be.reduce_many("sum", o2[0], x2, also=o2[1:]),
                                   "torch": add_and_copy}, args.iters)
    print(f"# the one-GPU allreduce's fold at 2 ranks, 256 MiB float32, 2 inputs into 2 outputs: ddl_fold "
          f"{one_gpu['fold']:.3f} ms ({4 * (256 << 20) / one_gpu['fold'] / 1e6:.0f} GB/s moved), torch.add + copy "
          f"{one_gpu['torch']:.3f} ms; the allreduce's bus bandwidth at most "
          f"{(256 << 20) / one_gpu['fold'] / 1e6:.0f} GB/s")
    # Operands one element in (the IPC allreduce of a view, out of place): ddl_fold_realign, which reduce_many
    # takes there, against ddl_fold's element path on the same pointers; 2 operands of 128 MiB, 2 outputs.  The
    # reference: the pairwise reduce (ddl_realign).
    realign_ms = {}

    def differ(outs, ref):
        return sum(int(cp.count_nonzero(o.view(f"u{o.dtype.itemsize}") != ref.view(f"u{o.dtype.itemsize}")))
                   for o in outs)

    for dname, dt in (("float32", np.float32), ("float16", np.float16)):
        n = (128 << 20) // np.dtype(dt).itemsize
        xo = [cp.random.rand(n + 1).astype(dt)[1:] for _ in range(2)]
        oo = [cp.empty(n, dt) for _ in range(2)]
        suf = "f32" if dname == "float32" else "f16"
        arg = _kernel_op("sum", suf, None)[1]
        ref = cp.empty(n, dt)
        be.reduce("sum", ref, xo[0], xo[1])
        realigned = _events_ms_each(cp, {
            "fold_realign": lambda: be.reduce_many("sum", oo[0], xo, also=oo[1:]),
            "fold": lambda: be._launch_fold(f"ddl_fold_sum_{suf}", oo[0], xo, n, arg, oo[1:])},
            args.iters)
        wrong += differ(oo, ref)  # the element path's, timed last
        be.reduce_many("sum", oo[0], xo, also=oo[1:])
        wrong += differ(oo, ref)
        realign_ms[dname] = realigned
        print(f"# fold of 2 x 128 MiB {dname} one element in, into 2 aligned outputs: ddl_fold_realign "
              f"{realigned['fold_realign']:.3f} ms, ddl_fold's element path {realigned['fold']:.3f} ms "
              f"({realigned['fold'] / realigned['fold_realign']:.2f}x)")
    # Host time per launch, 1 MiB float32.
    n = (1 << 20) // 4
    a, b, out = cp.random.rand(n, dtype=np.float32), cp.random.rand(n, dtype=np.float32), cp.empty(n, np.float32)
    ta, tb, tout = (torch.as_tensor(x, device="cuda") for x in (a, b, out))
    launches = {"ddlkernels": lambda: be.reduce("sum", out, a, b), "cp.add": lambda: cp.add(a, b, out=out),
                "torch.add": lambda: torch.add(ta, tb, out=tout)}
    nbe, numba = _numba_backend()
    if nbe is None:
        print(f"# the Numba backend's lines are left out: {numba}")
    else:  # its own output, checked against cp.add's after the launches
        nout = cp.empty(n, np.float32)
        try:
            na, nb, nd = (numba.as_cuda_array(x) for x in (a, b, nout))
            nbe.reduce("sum", nd, na, nb)
            cp.cuda.Device().synchronize()
            launches["ddlkernels numba"] = lambda: nbe.reduce("sum", nd, na, nb)
        except Exception as exc:  # noqa: BLE001 -- a Numba that fails here: the other lines still run
            print(f"# the Numba backend's lines are left out: {type(exc).__name__}: {exc}".splitlines()[0])
            nbe = None
    host_us = {}
    for k, fn in launches.items():
        fn()
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(1000):
            fn()
        host_us[k] = (time.perf_counter() - t0) / 1000 * 1e6
        cp.cuda.Device().synchronize()
    print("\n# host time per launch, 1 MiB float32, 1000 back to back: "
          + ", ".join(f"{k} {v:.1f} us" for k, v in host_us.items())
          + f"; ddlkernels / cp.add {host_us['ddlkernels'] / host_us['cp.add']:.2f}")
    if nbe is not None:
        wrong += int(cp.count_nonzero(nout.view(np.uint32) != cp.add(a, b).view(np.uint32)))
    # Pack: a ResNet-50-like mix of 182 tensors.
    rng = np.random.default_rng(0)
    counts = [int(c) for c in rng.choice([64, 256, 2048, 4096, 36864, 147456, 589824, 2359296], 182)]
    tensors = [cp.random.rand(c, dtype=np.float32) for c in counts]
    from ddlkernels.backends._device import pack_offsets

    offs, total = pack_offsets([t.nbytes for t in tensors])
    buf = cp.empty(total // 4, np.float32)
    tts = [torch.as_tensor(t, device="cuda") for t in tensors]
    be.pack(tensors, buf)
    for t, o in zip(tensors, offs):
        wrong += int(cp.count_nonzero(buf[o // 4: o // 4 + t.size] != t))
    pack_ms = _events_ms(cp, lambda: be.pack(tensors, buf), args.iters)
    cat_ms = _events_ms(cp, lambda: torch.cat(tts), args.iters)
    nbytes = sum(t.nbytes for t in tensors)
    print(f"# pack of {len(tensors)} tensors ({nbytes / 2**20:.0f} MiB): ddlkernels {2 * nbytes / pack_ms / 1e6:.0f} GB/s, "
          f"torch.cat {2 * nbytes / cat_ms / 1e6:.0f} GB/s, ratio {cat_ms / pack_ms:.2f}")
    npack_ms = None
    if nbe is not None:  # the same pack by the Numba backend, into a buffer of its own
        nbuf = cp.zeros_like(buf)
        nts, nbd = [numba.as_cuda_array(t) for t in tensors], numba.as_cuda_array(nbuf)
        nbe.pack(nts, nbd)
        for t, o in zip(tensors, offs):
            wrong += int(cp.count_nonzero(nbuf[o // 4: o // 4 + t.size].view(np.uint32) != t.view(np.uint32)))
        npack_ms = _events_ms(cp, lambda: nbe.pack(nts, nbd), args.iters)
        print(f"# the same pack by the Numba backend: {2 * nbytes / npack_ms / 1e6:.0f} GB/s, "
              f"ratio to torch.cat {cat_ms / npack_ms:.2f}")
    print(f"\nwrong elements in all: {wrong}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "reduce": rows, "host_us_per_launch": host_us,
                       "fold4_ms": fold_ms, "chain3_ms": chain_ms,
                       "fold4_into4_ms": multi_ms, "fold4_copies3_ms": copies_ms,
                       "fold2_into2_256M_ms": one_gpu["fold"], "add_copy_256M_ms": one_gpu["torch"],
                       "fold2_into2_off1_128M_ms": realign_ms,
                       "pack": {"tensors": len(tensors), "bytes": nbytes, "ms": pack_ms, "torch_cat_ms": cat_ms,
                                "numba_ms": npack_ms},
                       "wrong": wrong}, f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
