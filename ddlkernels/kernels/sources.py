"""Where the CUDA C sources of kernels/ are, and how they are compiled at run time.

setup.py installs the top-level ``kernels/`` directory of the checkout as the
package ``ddlkernels.kernels.cuda``, so in a wheel the .cu files sit beside
this module; in a source checkout (``PYTHONPATH=.``) that folder does not
exist and the files are read from ``<checkout>/kernels``.  ``kernel_dir()``
tries the installed folder first, then the checkout.

``compile_source`` compiles a file with NVRTC itself rather than through
CuPy's ``RawModule``: CuPy appends ``-ftz=true`` to every NVRTC compile,
after the caller's options, and flush-to-zero turns float32 and bfloat16
subnormals into zeros (every f32/bf16 kernel then differs from numpy on
them).  Our options say ``-ftz=false`` and nothing is appended.  The result
is a cubin for the device's own architecture when this NVRTC knows it, else
PTX for the newest architecture it knows (the driver compiles it), cached on
disk by a hash of everything that went in (``DDLKERNELS_CACHE_DIR``).

The .cu files include ``cuda_fp16.h`` and ``cuda_bf16.h``; NVRTC has no
default include path, so ``cuda_include_dirs()`` lists toolkit header
directories that exist here, those of the CUDA major version of the NVRTC in
use first (pip wheels: ``nvidia/cu13/include`` for CUDA 13,
``nvidia/cuda_runtime/include`` for CUDA 12).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

__all__ = ["kernel_dir", "read_source", "SOURCES", "KINDS", "unit_of", "units", "cuda_include_dirs",
           "nvrtc_options", "NUMERIC_OPTIONS", "pick_target", "compile_source"]

#: The kernel files and the kernels each defines (see the headers of the files).
SOURCES = ("reduce.cu", "pack.cu")
#: reduce.cu's kinds of kernel (``ddl_<kind>_<op>_<t>``) and their bits of its DDL_KINDS mask.  Each kind is a
#: compile of its own, made on its first need: the whole file took NVRTC about as long as the four kinds
#: together (bench/results/kernel_report.md), and a job's first call needs one or two of them.
KINDS = {"reduce": 1, "realign": 2, "fold": 4, "fold_realign": 8}


def unit_of(source: str, kernel: str) -> tuple:
    """The macros of the compile of ``source`` that defines ``kernel``: ``("DDL_KINDS=<its kind's bit>",)``
    for reduce.cu's, () (the whole file) for the others'."""
    if source != "reduce.cu":
        return ()
    kind = kernel[len("ddl_"):].rsplit("_", 2)[0]
    if not kernel.startswith("ddl_") or kind not in KINDS:
        raise ValueError(f"reduce.cu defines no kernel {kernel!r} (ddl_<kind>_<op>_<t>, kind one of {list(KINDS)})")
    return (f"DDL_KINDS={KINDS[kind]}",)


def units(source: str) -> list:
    """Every compile ``unit_of`` asks of ``source``: what a first call can need (``python -m ddlkernels
    compile --cuda`` makes them all)."""
    return [(f"DDL_KINDS={bit}",) for bit in KINDS.values()] if source == "reduce.cu" else [()]


def kernel_dir() -> Path:
    """Directory holding reduce.cu and pack.cu (installed package, else checkout)."""
    here = Path(__file__).resolve().parent
    installed, checkout = here / "cuda", here.parent.parent / "kernels"
    for d in (installed, checkout):
        if (d / SOURCES[0]).is_file():
            return d
    raise FileNotFoundError(
        "ddlkernels' CUDA sources (reduce.cu, pack.cu) were not found in the installed package "
        f"ddlkernels.kernels.cuda ({installed}) nor in {checkout}; reinstall ddlkernels"
    )


def read_source(name: str) -> str:
    """Text of kernel source ``name`` (e.g. "reduce.cu")."""
    if name not in SOURCES:
        raise ValueError(f"unknown kernel source {name!r}; expected one of {SOURCES}")
    return (kernel_dir() / name).read_text(encoding="utf-8")


def cuda_include_dirs(major: int | None = None) -> list[str]:
    """Existing directories that hold cuda_fp16.h; those of CUDA ``major`` (the NVRTC's) first."""
    wheel = []  # (CUDA major, dir) of the pip-installed toolkit headers
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        for sub, ver in (("cu13", 13), ("cu12", 12), ("cuda_runtime", 12)):
            wheel.append((ver, str(Path(loc) / sub / "include")))
    if major is not None:
        wheel.sort(key=lambda vd: vd[0] != major)  # stable: the NVRTC's own major first
    dirs = [d for _, d in wheel] + ["/usr/local/cuda/include"]
    out = []
    for d in dirs:
        if (Path(d) / "cuda_fp16.h").is_file() and d not in out:
            out.append(d)
    return out


#: Numerics every compile of our sources states explicitly: IEEE subnormals (no flush to zero), correctly
#: rounded division and square root, and no contraction of a multiply and an add into an FMA, so a kernel
#: gives numpy's bits (kernels/reduce.cu's header).
NUMERIC_OPTIONS = ("-ftz=false", "-prec-div=true", "-prec-sqrt=true", "-fmad=false")


def nvrtc_options(arch: str | None = None, extra=(), major: int | None = None) -> tuple[str, ...]:
    """NVRTC options for our sources: C++17, the numerics above, include path, optional ``-arch=<arch>``."""
    opts = ["-std=c++17", *NUMERIC_OPTIONS, *(f"-I{d}" for d in cuda_include_dirs(major))]
    if arch:
        opts.append(f"-arch={arch}")
    return (*opts, *extra)


def pick_target(device_arch: int, supported) -> str:
    """The NVRTC target for a device of compute capability ``device_arch`` (e.g. 90): ``sm_<arch>`` (a cubin)
    when NVRTC supports it, else ``compute_<newest supported below it>`` (PTX the driver compiles)."""
    supported = sorted(int(a) for a in supported)
    if device_arch in supported:
        return f"sm_{device_arch}"
    older = [a for a in supported if a <= device_arch]
    if not older:
        raise RuntimeError(
            f"this NVRTC supports compute capabilities {supported}, none of them at or below the device's "
            f"{device_arch}: install the CUDA toolkit wheels that match the GPU (e.g. cupy-cuda12x's NVRTC 12)"
        )
    return f"compute_{older[-1]}"


def _nvrtc_compile(nvrtc, source: str, name: str, options) -> bytes:
    """Compile with CuPy's NVRTC binding (``cupy_backends.cuda.libs.nvrtc``); cubin for sm_*, else PTX."""
    prog = nvrtc.createProgram(source, name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC failed to compile {name} with {' '.join(options)}:\n{log}") from exc
        if any(o.startswith("-arch=sm_") for o in options):
            return bytes(nvrtc.getCUBIN(prog))
        ptx = nvrtc.getPTX(prog)
        return (ptx.encode() if isinstance(ptx, str) else bytes(ptx)).rstrip(b"\0") + b"\0"
    finally:
        nvrtc.destroyProgram(prog)


def compile_source(name: str, device_arch: int, *, nvrtc=None, cache_dir=None, defines=()) -> tuple[str, bytes]:
    """``(target, image)``: kernels/<name> compiled for a device of compute capability ``device_arch``.

    ``image`` is a cubin (``target`` "sm_XX") or NUL-terminated PTX ("compute_XX"), ready for
    ``cuModuleLoadData``.  ``nvrtc``: the NVRTC binding (default CuPy's); ``cache_dir``: where compiled
    images are kept (default ``ddlkernels._config``'s, None-valued there: no disk cache); ``defines``: macros
    defined for the compile (a study's variant of a kernel; the library defines none).
    """
    if nvrtc is None:
        from cupy_backends.cuda.libs import nvrtc
    major, minor = nvrtc.getVersion()
    target = pick_target(int(device_arch), nvrtc.getSupportedArchs())
    options = nvrtc_options(target, extra=tuple(f"-D{d}" for d in defines), major=major)
    source = read_source(name)
    if cache_dir is None:
        from .._config import defaults

        cache_dir = defaults().cache_dir
    key = hashlib.sha256("\0".join([name, source, f"nvrtc {major}.{minor}", *options]).encode()).hexdigest()
    path = Path(cache_dir) / f"{key}.{'cubin' if target.startswith('sm_') else 'ptx'}" if cache_dir else None
    if path is not None and path.is_file():
        return target, path.read_bytes()
    image = _nvrtc_compile(nvrtc, source, name, options)
    if path is not None:
        try:  # written whole or not at all: ranks of one node compile the same file at once
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep a cache shared by an image build from its users
            with os.fdopen(fd, "wb") as f:
                f.write(image)
            os.replace(tmp, path)
        except OSError:
            pass  # an unwritable cache only costs the compile next time
    return target, image
