"""The reduce kernel's launch shape on a GPU: blocks and threads a block against torch.add, one table.

    python bench/studies/reduce_launch.py [--sizes 64M,256M] [-n 20]

The CuPy backend launches ``ddl_reduce_<op>_<t>`` (kernels/reduce.cu) with 256 threads a block and one
128-bit word a thread (the "None" column); this times other shapes of the same kernel on the same
arrays, out of place and aligned, float32 and float16, GB/s as bench/kernels/device_kernels.py counts them
(3 x size), median of ``-n`` runs timed with CUDA events by device_kernels.py's timer (each run
behind a kernel that holds the GPU until the run is queued).  Every result is compared with torch's bit for
bit; a difference makes the run exit 1.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402

from ddlkernels.tools.bench import parse_size  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64M,256M")
    ap.add_argument("-n", "--iters", type=int, default=20)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels"))
    from device_kernels import _events_ms, gpu_or_say_why

    gpu = gpu_or_say_why("reduce_launch")
    if gpu is None:
        return 2
    cp, torch = gpu

    from ddlkernels.backends import get_backend

    be = get_backend("cupy")
    shapes = [(256, 4096), (256, 1056), (256, 2112), (256, 8448), (512, 2048), (128, 8192), (256, None)]
    wrong = 0
    print("# GB/s (3 x size / time); blocks None = one 16-byte word a thread, no grid-stride rounds")
    print(f"{'case':<22}" + "".join(f"{f'{t}x{b}':>11}" for t, b in shapes) + f"{'torch.add':>11}")
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        for dname, tdt, suf in (("float32", torch.float32, "f32"), ("float16", torch.float16, "f16")):
            ta = torch.rand(size // tdt.itemsize, device="cuda").to(tdt)
            tb = torch.rand(size // tdt.itemsize, device="cuda").to(tdt)
            tout = torch.empty_like(ta)
            a, b, out = cp.from_dlpack(ta), cp.from_dlpack(tb), cp.from_dlpack(tout)
            n = a.shape[0]
            fn = be._function("reduce.cu", f"ddl_reduce_sum_{suf}")
            ref = torch.add(ta, tb)
            row = []
            for threads, blocks in shapes:
                nb = blocks or -(-n // (threads * (16 // tdt.itemsize)))

                def launch(nb=nb, threads=threads):
                    fn((nb,), (threads,), (out, a, b, np.uint64(n), np.float32(0)))

                tout.fill_(-1)
                launch()
                wrong += int((tout.view(torch.int16) != ref.view(torch.int16)).sum().item())
                row.append(3 * size / (_events_ms(cp, launch, args.iters) * 1e-3) / 1e9)
            row.append(3 * size / (_events_ms(cp, lambda: torch.add(ta, tb, out=tout), args.iters) * 1e-3) / 1e9)
            print(f"{f'{size >> 20}M {dname}':<22}" + "".join(f"{g:>11.0f}" for g in row), flush=True)
    print(f"\nwrong elements in all: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
