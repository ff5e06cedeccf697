"""Compile the CPU loops and the CUDA kernels before the first call: ``python -m ddlkernels compile``.

Purpose: the first call of each dtype and op compiles its loop (the window's
pieced allreduce takes ~5 s on the 2-core VM), in every rank of the job at
once, inside the first collectives; the first device launch of each kind
of kernel compiles it with NVRTC (kernels/reduce.cu one kind at a time, and
pack.cu: up to seconds each, every rank of a node at once).  A container
image, a cluster's shared install or a CI machine can
pay that once, ahead of any job, spread over ``jobs`` processes, and needs
no GPU for it: NVRTC compiles for the compute capabilities it is told.  What
is compiled is found again by every later process (Numba's cache:
``__pycache__`` beside each kernel module, or ``NUMBA_CACHE_DIR``; the CUDA
images: ``DDLKERNELS_CACHE_DIR``, ``ddlkernels.kernels.sources``).

Preconditions: Numba importable (the CUDA kernels: CuPy's NVRTC).  The
signatures below are the argument types the callers pass
(``ddlkernels.algorithms.shm``, ``window_shards``, ``cma``,
``ddlkernels.backends._numpy``, ``ddlkernels.kernels.half``);
tests/mpi/test_shm.py checks that a real call compiles nothing outside them.

Use::

    python -m ddlkernels compile                     # every loop, float32/float64/int32/int64, 2 processes;
                                                     # the CUDA kernels for the GPUs this machine has
    python -m ddlkernels compile --dtypes float32 --jobs 4
    python -m ddlkernels compile --cuda 80,90        # the CUDA kernels for A100s and H100s, GPU or not
"""

from __future__ import annotations

import importlib
import os
import time

import numpy as np

#: The dtypes compiled unless told otherwise: what gradients and counters are.
DTYPES = ("float32", "float64", "int32", "int64")
_OPS = ("sum", "prod", "max", "min")


def _table():
    """``[(module, function, per_dtype, argument types builder)]``: ``per_dtype`` False for loops on a fixed type."""
    from numba import from_dtype, types as T

    i, b, f = T.int64, T.boolean, T.float32
    I1, I2 = T.Array(i, 1, "C"), T.Array(i, 2, "C")
    U8, U16 = T.Array(T.uint8, 1, "C"), T.Array(T.uint16, 1, "C")

    def x(dt, ndim=1):
        return T.Array(from_dtype(np.dtype(dt)), ndim, "C")

    rows = []
    for op in _OPS:
        rows += [
            ("window_loops", f"small_fold_{op}", True, lambda d: (x(d), x(d, 2), i, x(d), I1, i, i, i, i)),
            ("window_loops", f"pieces_allreduce_{op}", True,
             lambda d: (x(d), I1, I1, i, x(d), I1, i, i, i, b, b, b, I2)),
            ("window_loops", f"pieces_reduce_scatter_{op}", True,
             lambda d: (x(d), I1, i, x(d), I1, i, i, i, I1, I1, b, I2)),
            ("cma_loops", f"cma_allreduce_{op}", True,
             lambda d: (x(d), x(d), i, I1, i, i, i, I1, x(d, 2), x(d), I1, b, I2)),
        ]
    rows += [
        ("window_loops", "small_allgather", True, lambda d: (x(d), x(d, 2), i, x(d), I1, i, i, I1, I1)),
        ("window_loops", "pieces_allgather", True, lambda d: (x(d), I1, i, x(d), I1, i, i, i, I1, I1, b, b, I2)),
        ("cma_loops", "cma_allgather", False, lambda d: (U8, U8, i, I1, i, i, I1, I1, I1, I1)),
        ("node_primitives", "arrive", False, lambda d: (I1, i, i)),
        ("node_primitives", "arrived", False, lambda d: (I1, i, i)),
        ("node_primitives", "barrier", False, lambda d: (I1, i, i, i, i)),
        ("node_primitives", "_wait", False, lambda d: (I1, i, i, i)),
        ("half_loops", "apart", False, lambda d: (U16, U16, U16, f, i, i)),
        ("half_loops", "into_a", False, lambda d: (U16, U16, f, i, i)),
        ("half_loops", "into_b", False, lambda d: (U16, U16, f, i, i)),
    ]
    for op in ("sum", "prod"):  # the host backend's loop: float and int dtypes only (host_loops)
        rows.append(("host_loops", f"reduce_{op}", True, lambda d: (x(d), x(d), x(d), i)))
    return rows


def _host_dtype(module, dtype) -> bool:
    return module != "host_loops" or np.dtype(dtype).kind in "fi" and np.dtype(dtype).itemsize >= 4


def signatures(dtypes=DTYPES) -> dict:
    """``{dispatcher: {argument types}}`` that ``compile_all(dtypes)`` compiles (imports Numba)."""
    out = {}
    for module, name, per_dtype, sig in _table():
        fn = getattr(importlib.import_module(f"ddlkernels.kernels.{module}"), name)
        want = out.setdefault(fn, set())
        for d in (dtypes if per_dtype else (None,)):
            if d is None or _host_dtype(module, d):
                want.add(sig(d))
    return out


def _compile_one(task):
    """Compile one loop for its dtypes (a worker's unit: one function, so that no two processes write the same
    cache index at once).  Returns (name, signatures compiled, seconds)."""
    module, name, dtypes = task
    t = time.perf_counter()
    fn = getattr(importlib.import_module(f"ddlkernels.kernels.{module}"), name)
    rows = {(m, n): (per, sig) for m, n, per, sig in _table()}
    per_dtype, sig = rows[(module, name)]
    done = 0
    for d in (dtypes if per_dtype else (None,)):
        if d is None or _host_dtype(module, d):
            fn.compile(sig(d))  # found in the cache, or compiled and saved there
            done += 1
    return f"{module}.{name}", done, time.perf_counter() - t, "signature"


def compile_all(dtypes=DTYPES, jobs: int = 2, report=None) -> int:
    """Compile every loop of ``_table`` for ``dtypes`` into Numba's cache in ``jobs`` processes; the count of
    signatures.  ``report(line)`` is told of each loop as it is done."""
    for d in dtypes:  # a bad name fails here, before any process starts
        try:
            np.dtype(d)
        except TypeError:
            raise ValueError(f"ddlkernels compile: {d!r} is not a numpy dtype name") from None
    tasks = [(m, n, tuple(dtypes)) for m, n, _, _ in _table()]
    # The longest first (the single-copy loops, then the window's), the short ones fill in at the end.
    tasks.sort(key=lambda t: ("cma_loops", "window_loops").index(t[0]) if t[0] in ("cma_loops", "window_loops") else 2)
    if jobs <= 1:
        results = map(_compile_one, tasks)
        return sum(_report(r, report) for r in results)
    import multiprocessing

    # spawn: a fork of a process that has MPI or threads running is not safe.
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return sum(_report(r, report) for r in pool.imap_unordered(_compile_one, tasks))


def visible_archs() -> tuple:
    """The compute capabilities of the GPUs this process sees (e.g. ``(90,)``), () without a GPU or CuPy."""
    try:
        import cupy

        rt = cupy.cuda.runtime
        return tuple(sorted({int(cupy.cuda.Device(d).compute_capability) for d in range(rt.getDeviceCount())}))
    except Exception:  # noqa: BLE001 -- no CuPy, no driver, no device: nothing to compile for
        return ()


def _compile_cuda_one(task):
    from .sources import compile_source

    name, unit, arch, cache_dir = task
    t = time.perf_counter()
    # found in the cache, or compiled and kept there
    target, _ = compile_source(name, arch, cache_dir=cache_dir, defines=unit)
    return f"{' '.join([name, *unit])} for {target}", 1, time.perf_counter() - t, "image"


def compile_cuda(archs, jobs: int = 2, report=None, cache_dir=None) -> int:
    """Compile kernels/*.cu (``sources.SOURCES``, each compile unit a first call can ask: ``sources.units``) for
    each compute capability of ``archs`` (e.g. ``(80, 90)``) into the CUDA image cache (``cache_dir``, default
    ``DDLKERNELS_CACHE_DIR``'s) in ``jobs`` processes, as the first device calls on such a GPU would; the count
    of images.  ``report(line)`` is told of each."""
    from .sources import SOURCES, units

    tasks = [(name, unit, arch, cache_dir) for arch in sorted({int(a) for a in archs}) for name in SOURCES
             for unit in units(name)]
    if jobs <= 1 or len(tasks) <= 1:
        return sum(_report(r, report) for r in map(_compile_cuda_one, tasks))
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(min(jobs, len(tasks))) as pool:
        return sum(_report(r, report) for r in pool.imap_unordered(_compile_cuda_one, tasks))


def cuda_archs(spec: str) -> tuple:
    """``--cuda``'s compute capabilities: "auto" those of the GPUs here, "none" none, else a comma list."""
    spec = spec.strip().lower()
    if spec in ("auto", "none"):
        return visible_archs() if spec == "auto" else ()
    try:
        return tuple(sorted({int(a) for a in spec.split(",") if a.strip()}))
    except ValueError:
        raise ValueError(f"ddlkernels compile: --cuda takes auto, none or compute capabilities such as 80,90, "
                         f"got {spec!r}") from None


def _report(result, report):
    name, done, seconds, unit = result
    if report is not None:
        report(f"{name:40s} {done} {unit}(s) {seconds:6.1f} s")
    return done


def main(args) -> int:
    from .._config import defaults

    t = time.perf_counter()
    dtypes = tuple(s.strip() for s in args.dtypes.split(",") if s.strip())
    report = None if args.quiet else print
    auto, cache = args.cuda.strip().lower() == "auto", defaults().cache_dir
    try:  # a bad --cuda fails before the CPU loops' minutes
        archs = cuda_archs(args.cuda)
        if archs and cache is None and not auto:
            raise ValueError("ddlkernels compile: DDLKERNELS_CACHE_DIR is off: compiled CUDA kernels would not be kept")
        n = compile_all(dtypes, jobs=args.jobs, report=report)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    print(f"compiled or found {n} signatures in {time.perf_counter() - t:.1f} s "
          f"(cache: {os.environ.get('NUMBA_CACHE_DIR') or '__pycache__ beside the kernel modules'})")
    if not archs or cache is None:
        if auto:
            print("CUDA kernels: no GPU visible here (--cuda 80,90 compiles them for given compute capabilities)"
                  if not archs else "CUDA kernels: not compiled, DDLKERNELS_CACHE_DIR is off (they would not be kept)")
        return 0
    t = time.perf_counter()
    try:
        k = compile_cuda(archs, jobs=args.jobs, report=report)
    except Exception as exc:  # noqa: BLE001 -- NVRTC missing or failing: said, with a non-zero exit
        raise SystemExit(f"ddlkernels compile: the CUDA kernels for {list(archs)}: {type(exc).__name__}: {exc}") from None
    print(f"compiled or found {k} CUDA kernel images for compute capabilities {', '.join(map(str, archs))} "
          f"in {time.perf_counter() - t:.1f} s (cache: {cache})")
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("compile", help="compile the CPU loops and CUDA kernels ahead of the first call",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated numpy dtype names (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="processes compiling at once (default: %(default)s)")
    p.add_argument("--cuda", default="auto",
                   help="compute capabilities to compile the CUDA kernels for, e.g. 80,90 (no GPU needed); "
                        "auto: the GPUs here; none (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="only the closing lines")
    p.set_defaults(func=main)
