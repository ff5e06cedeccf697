"""Where the CUDA C sources of kernels/ are, and how to compile them at run time.

setup.py installs the top-level ``kernels/`` directory of the checkout as the
package ``ddlkernels.kernels``, so in a wheel the .cu files sit next to the
Python modules; in a source checkout (``PYTHONPATH=.``) that package does not
exist and the files are read from ``<checkout>/kernels``.  ``kernel_dir()``
tries the installed package first, then the checkout.

The .cu files include ``cuda_fp16.h`` and ``cuda_bf16.h``; NVRTC (which
CuPy's RawModule uses) has no default include path, so ``cuda_include_dirs()``
lists toolkit header directories that exist here, preferring the headers of
the pip-installed CUDA runtime (they match the pip-installed NVRTC).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["kernel_dir", "read_source", "SOURCES", "cuda_include_dirs", "nvrtc_options"]

#: The kernel files and the kernels each defines (see the headers of the files).
SOURCES = ("reduce.cu", "pack.cu")


def kernel_dir() -> Path:
    """Directory holding reduce.cu and pack.cu (installed package, else checkout)."""
    try:
        spec = importlib.util.find_spec("ddlkernels.kernels")
    except ImportError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if (Path(loc) / SOURCES[0]).is_file():
                return Path(loc)
    checkout = Path(__file__).resolve().parent.parent / "kernels"
    if (checkout / SOURCES[0]).is_file():
        return checkout
    raise FileNotFoundError(
        "ddlkernels' CUDA sources (reduce.cu, pack.cu) were not found in the installed package "
        f"ddlkernels.kernels nor in {checkout}; reinstall ddlkernels"
    )


def read_source(name: str) -> str:
    """Text of kernel source ``name`` (e.g. "reduce.cu")."""
    if name not in SOURCES:
        raise ValueError(f"unknown kernel source {name!r}; expected one of {SOURCES}")
    return (kernel_dir() / name).read_text(encoding="utf-8")


def cuda_include_dirs() -> list[str]:
    """Existing directories that hold cuda_fp16.h, best match for NVRTC 12 first."""
    dirs = []
    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs += [str(Path(loc) / "include") for loc in spec.submodule_search_locations]
    dirs += ["/usr/local/cuda/include"]
    out = []
    for d in dirs:
        if (Path(d) / "cuda_fp16.h").is_file() and d not in out:
            out.append(d)
    return out


def nvrtc_options(arch: str | None = None, extra=()) -> tuple[str, ...]:
    """NVRTC options for our sources: C++17, include path, optional ``-arch=<arch>``."""
    opts = ["-std=c++17", *(f"-I{d}" for d in cuda_include_dirs())]
    if arch:
        opts.append(f"-arch={arch}")
    return (*opts, *extra)
