"""The f16 and bf16 sums added two lanes an instruction against the same kernels widened to float, on a GPU, one run.

    python bench/studies/half_sums.py [--sizes 64M,256M,512M] [-n 20]

kernels/reduce.cu adds f16 and bf16 words in pairs (add.rn.f16x2 / bf16x2: ``WordOp``); compiled with
``DDL_WIDEN_HALF_SUMS`` defined, the same kernels widen every element to float, add and round back, as they did
before.  This compiles both (``compile_source``'s ``defines``) and times ``ddl_reduce_sum`` (aligned) and
``ddl_realign_sum`` (both operands one element in, an aligned output) of each beside ``torch.add``, launched as
the CuPy backend launches them (256 threads a block, a 128-bit word a thread), GB/s as
bench/kernels/device_kernels.py counts them (3 x size), median of ``-n`` runs by its timer (each run behind a
kernel that holds the GPU until the run is queued), the three lines in turn.

Every timed result is compared with torch's bit for bit.  Before the timing, both variants sum 2^24 pairs of
bit patterns, each of the 65536 in a against 256 others in b (NaN, infinities, subnormals and the largest
values among them), and must agree with torch.add bit for bit, NaN with NaN (payloads may differ); any
difference makes the run exit 1.  Needs CuPy, torch and a CUDA device; exits 2 without, having timed nothing.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402

from ddlkernels.tools.bench import parse_size  # noqa: E402

THREADS = 256
#: variants: label -> macros defined for the compile (DDL_KINDS=3: the reduce and realign kernels alone, all that
#: is timed here, a fraction of the whole file's NVRTC time)
VARIANTS = {"paired": ("DDL_KINDS=3",), "widened": ("DDL_KINDS=3", "DDL_WIDEN_HALF_SUMS")}
TYPES = (("float16", "f16"), ("bfloat16", "bf16"))


def _nan(bits, suf):
    """Which of ``bits`` (uint16 patterns) are NaNs of the type ``suf``."""
    exp, man = (0x7C00, 0x03FF) if suf == "f16" else (0x7F80, 0x007F)
    return ((bits & exp) == exp) & ((bits & man) != 0)


def patterns_disagree(cp, torch, mods, suf) -> dict:
    """For each variant, the elements where its sums of 2^24 pairs of bit patterns differ from torch.add's
    (NaN against NaN agrees)."""
    a = cp.tile(cp.arange(65536, dtype=cp.uint16), 256)
    i = cp.arange(a.size, dtype=cp.uint32)
    b = ((i * np.uint32(40503) + (i >> 16) * np.uint32(7919)) & np.uint32(0xFFFF)).astype(cp.uint16)
    n = a.size
    tdt = torch.float16 if suf == "f16" else torch.bfloat16
    ref = cp.from_dlpack(torch.add(*(torch.from_dlpack(v.view(cp.int16)).view(tdt) for v in (a, b))).view(torch.int16))
    ref = ref.view(cp.uint16)
    bad = {}
    for label, m in mods.items():
        out = cp.empty_like(a)
        m.get_function(f"ddl_reduce_sum_{suf}")((-(-n // (THREADS * 8)),), (THREADS,),
                                                (out, a, b, np.uint64(n), np.float32(0)))
        bad[label] = int(cp.count_nonzero((out != ref) & ~(_nan(out, suf) & _nan(ref, suf))))
    return bad


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64M,256M,512M", help="bytes per array, comma list (K/M/G)")
    ap.add_argument("-n", "--iters", type=int, default=20)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels"))
    from device_kernels import _events_ms_each, gpu_or_say_why

    gpu = gpu_or_say_why("half_sums")
    if gpu is None:
        return 2
    cp, torch = gpu
    from ddlkernels.kernels.sources import compile_source

    arch = int(cp.cuda.Device().compute_capability)
    mods = {}
    for label, defines in VARIANTS.items():
        _, image = compile_source("reduce.cu", arch, defines=defines)
        mods[label] = cp.cuda.function.Module()
        mods[label].load(image)
    wrong = 0
    for _, suf in TYPES:
        bad = patterns_disagree(cp, torch, mods, suf)
        print(f"# {suf}: 2^24 pairs of bit patterns, sums unlike torch.add's (NaN as NaN): "
              + ", ".join(f"{k} {v}" for k, v in bad.items()))
        wrong += sum(bad.values())
    print("# GB/s (3 x size / time), median of runs behind a spin kernel; +1: both operands one element in")
    print(f"{'case':<24} {'paired':>9} {'widened':>9} {'torch.add':>10} {'paired/widened':>15} {'paired/torch':>13}")
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        n = size // 2
        for dname, suf in TYPES:
            for off in (0, 1):
                ta = torch.rand(n + off, device="cuda").to(tdt[dname])[off:]
                tb = torch.rand(n + off, device="cuda").to(tdt[dname])[off:]
                tout = torch.empty(n, dtype=tdt[dname], device="cuda")
                a, b, out = (cp.from_dlpack(t.view(torch.int16)).view(np.uint16) for t in (ta, tb, tout))
                ref = torch.add(ta, tb).view(torch.int16)
                kind = "realign" if off else "reduce"
                fns = {}
                for label, m in mods.items():
                    fn = m.get_function(f"ddl_{kind}_sum_{suf}")

                    def launch(fn=fn):
                        fn((-(-n // (THREADS * 8)),), (THREADS,), (out, a, b, np.uint64(n), np.float32(0)))

                    tout.fill_(-1)
                    launch()
                    wrong += int((tout.view(torch.int16) != ref).sum().item())
                    fns[label] = launch
                fns["torch.add"] = lambda: torch.add(ta, tb, out=tout)
                ms = _events_ms_each(cp, fns, args.iters)
                g = {k: 3 * size / (v * 1e-3) / 1e9 for k, v in ms.items()}
                case = f"{size >> 20}M {dname}{' +1' if off else ''}"
                print(f"{case:<24} {g['paired']:>9.0f} {g['widened']:>9.0f} {g['torch.add']:>10.0f} "
                      f"{g['paired'] / g['widened']:>15.3f} {g['paired'] / g['torch.add']:>13.3f}", flush=True)
    print(f"\nwrong elements in all: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
