"""Compile the kernels for real GPU targets without a GPU, and read what the compilers say.

* ``.cu`` files: NVRTC from cuda-python (``cuda.bindings.nvrtc``, CUDA 12.9,
  reaches sm_70) and the machine's ``nvcc`` (CUDA 13, sm_75 and newer).
* Numba kernels: ``numba.cuda.compile_ptx``, then ``ptxas -v`` from the pip
  CUDA 12.9 toolchain (``nvidia-cuda-nvcc-cu12``) for registers and spills.

Shared by tests/test_compile.py and bench/kernels/kernel_report.py.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ddlkernels.kernels.sources import kernel_dir, nvrtc_options

__all__ = ["nvrtc", "nvcc", "nvcc_path", "ptxas_path", "ptxas", "parse_ptxas", "ptx_entries", "vectorized",
           "numba_ptx", "NVRTC_ARCHS", "NVCC_ARCHS", "NUMBA_ARCHS", "nvrtc_supported", "nvcc_supported"]

#: Targets the kernels are compiled for: the oldest one each compiler still knows (CUDA 12: sm_70; CUDA 13
#: dropped it: sm_75), Ampere and Hopper.  Asked of the compilers, so CUDA 12 and 13 toolchains both work.
WANTED_ARCHS = ((70, 75), (80,), (90,))


def _pick(supported) -> tuple:
    supported = set(supported)
    return tuple(next(a for a in alts if a in supported) for alts in WANTED_ARCHS if any(a in supported for a in alts))


def nvrtc_supported() -> tuple:
    """Compute capabilities the cuda-python NVRTC supports (``nvrtcGetSupportedArchs``); () without it."""
    try:
        from cuda.bindings import nvrtc as N
    except ImportError:
        return ()
    err, n = N.nvrtcGetNumSupportedArchs()
    err, archs = N.nvrtcGetSupportedArchs()
    return tuple(int(a) for a in archs)


def nvcc_supported() -> tuple:
    """Compute capabilities of ``nvcc --list-gpu-arch``; () without nvcc."""
    if nvcc_path() is None:
        return ()
    res = subprocess.run([nvcc_path(), "--list-gpu-arch"], capture_output=True, text=True)
    return tuple(int(m) for m in re.findall(r"compute_(\d+)", res.stdout))


def nvrtc_major():
    try:
        from cuda.bindings import nvrtc as N
    except ImportError:
        return None
    return N.nvrtcVersion()[1]

_INFO = re.compile(r"Function properties for (\S+)\s*\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
                   r"\s*\n.*?Used (\d+) registers", re.S)


def parse_ptxas(log: str) -> dict:
    """``{function: {"regs", "stack", "spill_stores", "spill_loads"}}`` from ``ptxas -v`` output."""
    out = {}
    for m in _INFO.finditer(log):
        name, stack, st, ld, regs = m.group(1), *map(int, m.group(2, 3, 4, 5))
        out[name] = {"regs": regs, "stack": stack, "spill_stores": st, "spill_loads": ld}
    return out


def nvrtc(source: str, arch: str, ptx: bool = False, defines=()) -> tuple:
    """Compile kernels/<source> with NVRTC: ``arch`` "sm_XX" -> cubin (log has ptxas -v), "compute_XX" -> PTX;
    (ok, log, that output), and with ``ptx`` the PTX of the same compile after them (NVRTC keeps it for a
    real architecture too); ``defines``: macros, as ``sources.compile_source`` takes them."""
    from cuda.bindings import nvrtc as N

    src = (kernel_dir() / source).read_bytes()
    err, prog = N.nvrtcCreateProgram(src, source.encode(), 0, [], [])
    try:
        extra = (("-Xptxas=-v",) if arch.startswith("sm_") else ()) + tuple(f"-D{d}" for d in defines)
        opts = [o.encode() for o in nvrtc_options(arch, extra, major=nvrtc_major())]
        (err,) = N.nvrtcCompileProgram(prog, len(opts), opts)
        _, n = N.nvrtcGetProgramLogSize(prog)
        # A bytearray, never b" " * n: NVRTC writes into the buffer, and b" " * 1 is CPython's shared
        # one-byte b" " -- an empty log (n == 1) turned every b" " of the process into b"\x00".
        log = bytearray(n)
        N.nvrtcGetProgramLog(prog, log)
        ok = err == N.nvrtcResult.NVRTC_SUCCESS
        out = text = b""
        if ok:
            _, size = N.nvrtcGetPTXSize(prog)
            text = bytearray(size)
            N.nvrtcGetPTX(prog, text)
            out = text
            if arch.startswith("sm_"):
                _, size = N.nvrtcGetCUBINSize(prog)
                out = bytearray(size)
                N.nvrtcGetCUBIN(prog, out)
        got = (ok, log.decode(errors="replace").rstrip("\x00 "), bytes(out))
        return got + (bytes(text),) if ptx else got
    finally:
        N.nvrtcDestroyProgram(prog)


def nvcc_path():
    return shutil.which("nvcc") or (shutil.which("/usr/local/cuda/bin/nvcc"))


def nvcc(source: str, arch: int, ptx: bool = False) -> tuple[bool, str, str]:
    """``nvcc -std=c++17 -arch=sm_<arch> -cubin kernels/<source>`` with ``-Xptxas -v``: (ok, its output, the
    PTX it compiled when ``ptx``, kept from that same compile (``--keep``), else "")."""
    with tempfile.TemporaryDirectory() as td:
        cmd = [nvcc_path(), "-std=c++17", f"-arch=sm_{arch}", "-Xptxas", "-v", "-cubin",
               str(kernel_dir() / source), "-o", str(Path(td) / "k.cubin")]
        if ptx:
            cmd[1:1] = ["--keep", "--keep-dir", td]
        res = subprocess.run(cmd, capture_output=True, text=True)
        ok = res.returncode == 0
        text = (Path(td) / source).with_suffix(".ptx").read_text(errors="replace") if ok and ptx else ""
        return ok, res.stdout + res.stderr, text


def ptxas_path():
    """ptxas of the pip CUDA 12 toolchain (reaches sm_70), else the one on PATH."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / "bin" / "ptxas"
            if p.is_file():
                return str(p)
    return shutil.which("ptxas")


def ptxas(ptx: str, arch: int) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as td:
        src = Path(td) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([ptxas_path(), "-v", f"-arch=sm_{arch}", str(src), "-o", str(Path(td) / "k.cubin")],
                             capture_output=True, text=True)
        return res.returncode == 0, res.stdout + res.stderr


def ptx_entries(ptx: str) -> dict:
    """``{entry name: body}`` of every ``.entry`` in a PTX text: the text up to the next entry (a line "}" does
    not end one: inline asm such as cuda_fp16.h's ``{add.rn.f16x2 ...;\n}`` writes such lines too)."""
    starts = list(re.finditer(r"\.entry\s+(\w+)\s*\(", ptx))
    ends = [m.start() for m in starts[1:]] + [len(ptx)]
    return {m.group(1): ptx[m.end():end] for m, end in zip(starts, ends)}


def ptx_instructions(body: str) -> int:
    """PTX instructions in an entry's body (``ptx_entries``): its statements, not directives, labels, comments
    or the braces inline asm opens."""
    n = 0
    for line in body.splitlines():
        t = line.strip().lstrip("{").strip()
        if t and not t.startswith((".", "//", "}", ")")) and not t.endswith(":"):
            n += 1
    return n


_V128 = re.compile(r"\b(ld|st)\.global(\.(?:nc|wb|cg|cs|ca|lu|cv|wt))?(\.L\w+::\w+)*\.(v4\.[bfsu]32|v2\.[bfsu]64)\b")


def vectorized(body: str) -> bool:
    """True if a PTX body has both a 128-bit global load and a 128-bit global store."""
    kinds = {m.group(1) for m in _V128.finditer(body)}
    return kinds == {"ld", "st"}


def numba_ptx(pyfunc, sig, cc: int) -> tuple[str, str]:
    """(ptx, entry name) of a Numba kernel compiled for compute capability ``cc`` (e.g. 70)."""
    from numba import cuda

    ptx, _ = cuda.compile_ptx(pyfunc, sig, cc=(cc // 10, cc % 10))
    names = list(ptx_entries(ptx))
    return ptx, names[0] if names else ""


NVRTC_ARCHS = _pick(nvrtc_supported())
NVCC_ARCHS = _pick(nvcc_supported())
#: Numba kernels go through numba-cuda's NVVM and the pip ptxas (CUDA 12 here, which reaches sm_70).
NUMBA_ARCHS = (70, 80, 90)
