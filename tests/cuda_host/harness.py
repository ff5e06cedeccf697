"""Build the host harness (g++ + cuda_host.h + kernels/*.cu) and call it through ctypes.

``build(workdir)`` compiles ``host_reduce.cpp`` and ``host_pack.cpp`` -- each
of which includes the unmodified ``kernels/<file>.cu`` -- into shared
libraries and returns a ``Harness`` whose methods launch one kernel over a
whole grid on the CPU (see ``cuda_host.h`` for why that is faithful).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

__all__ = ["HERE", "KERNELS", "CUDA_INCLUDE", "gxx", "build", "Harness"]

HERE = Path(__file__).resolve().parent
KERNELS = HERE.parent.parent / "kernels"
CUDA_INCLUDE = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"

# -ffp-contract=off: the host must not fuse a*b+c where the device would not
# (the kernels never present such a pattern, but the harness must not add one).
CXXFLAGS = ["-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-Wall", "-Wno-unused-function"]


def gxx():
    """Path of g++, or None."""
    return shutil.which("g++")


def _compile(src: Path, out: Path, opt: str = "-O1"):
    flags = [f if f != "-O1" else opt for f in CXXFLAGS]
    cmd = [gxx(), *flags, f"-I{CUDA_INCLUDE}", str(src), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"host harness build failed: {' '.join(cmd)}\n{res.stderr}")
    return ctypes.CDLL(str(out))


class Harness:
    def __init__(self, reduce_lib, pack_lib):
        self._r, self._p = reduce_lib, pack_lib
        self._r.host_reduce.argtypes = [
            ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_double,
        ]
        self._r.host_reduce.restype = ctypes.c_int
        self._r.host_reduce_name.restype = ctypes.c_char_p
        self._r.host_fold.argtypes = [
            ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong,
            ctypes.c_double,
        ]
        self._r.host_fold.restype = ctypes.c_int
        self._r.host_set_readable.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._r.host_set_readable.restype = None
        self._r.host_stray_reads.restype = ctypes.c_ulonglong
        self._r.host_fold_name.restype = ctypes.c_char_p
        for f in (self._p.host_pack, self._p.host_unpack):
            f.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_int,
                          ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            f.restype = None

    def reduce_kernels(self) -> list[str]:
        """Names of every kernel reduce.cu defines (from its own X-macro list)."""
        return [self._r.host_reduce_name(i).decode() for i in range(self._r.host_reduce_count())]

    def reduce(self, name, dst: np.ndarray, a: np.ndarray, b: np.ndarray, arg: float, grid=3, block=32, reverse=False):
        """Run kernel ``name`` over ``grid`` x ``block`` threads: dst = op(a, b) (numpy arrays, any offsets)."""
        n = dst.size
        assert a.size == n and b.size == n
        rc = self._r.host_reduce(name.encode(), grid, block, int(reverse),
                                 dst.ctypes.data, a.ctypes.data, b.ctypes.data, n, float(arg))
        if rc != 0:
            raise KeyError(name)

    def reads_outside(self, arrays, run) -> int:
        """How many of the loads ``run()`` makes through __ldg/__ldcg/__ldca reach outside the bytes of ``arrays``
        (up to 8; such a load returns zeros instead of reading)."""
        assert len(arrays) <= 8, "the harness keeps 8 readable ranges"
        lo = np.array([a.ctypes.data for a in arrays], np.uint64)
        hi = np.array([a.ctypes.data + a.nbytes for a in arrays], np.uint64)
        self._r.host_set_readable(lo.ctypes.data, hi.ctypes.data, len(arrays))
        try:
            run()
            return int(self._r.host_stray_reads())
        finally:
            self._r.host_set_readable(None, None, 0)

    def fold_kernels(self) -> list[str]:
        """Names of every fold kernel reduce.cu defines (its DDL_FOLD_KERNELS list)."""
        return [self._r.host_fold_name(i).decode() for i in range(self._r.host_fold_count())]

    def fold(self, name, dst: np.ndarray, srcs, arg: float, grid=3, block=32, reverse=False, also=()):
        """Run fold kernel ``name``: dst = srcs[0] op srcs[1] op ... (2 to 8 numpy arrays, any offsets), and
        each array of ``also`` (up to 7) the same."""
        n = dst.size
        assert 2 <= len(srcs) <= 8 and all(s.size == n for s in srcs)
        assert len(also) <= 7 and all(e.size == n for e in also)
        ptrs = np.array([s.ctypes.data for s in srcs] + [srcs[0].ctypes.data] * (8 - len(srcs)), np.uint64)
        extra = np.array([e.ctypes.data for e in also] + [dst.ctypes.data] * (7 - len(also)), np.uint64)
        rc = self._r.host_fold(name.encode(), grid, block, int(reverse), dst.ctypes.data, ptrs.ctypes.data,
                               len(srcs), extra.ctypes.data, len(also), n, float(arg))
        if rc != 0:
            raise KeyError(name)

    def pack(self, table: np.ndarray, buf: np.ndarray, grid=(2, 2), block=32, reverse=False):
        self._p.host_pack(grid[0], grid[1], block, int(reverse), table.ctypes.data, table.shape[0], buf.ctypes.data)

    def unpack(self, table: np.ndarray, buf: np.ndarray, grid=(2, 2), block=32, reverse=False):
        self._p.host_unpack(grid[0], grid[1], block, int(reverse), table.ctypes.data, table.shape[0], buf.ctypes.data)


def build(workdir, opt: str = "-O1") -> Harness:
    """Compile both harness libraries into ``workdir`` (``opt``: g++ optimisation flag, e.g. "-O2" for bench/)."""
    workdir = Path(workdir)
    return Harness(_compile(HERE / "host_reduce.cpp", workdir / "libhost_reduce.so", opt),
                   _compile(HERE / "host_pack.cpp", workdir / "libhost_pack.so", opt))
