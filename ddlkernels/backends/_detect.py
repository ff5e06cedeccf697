"""Recognise device arrays without importing their libraries.

The predicates registered in ``backends/__init__.py`` must not import cupy,
numba or torch (``import ddlkernels`` never needs CUDA), so they look at the
type's module, at ``__cuda_array_interface__`` (on the type, so a wrapper's
``__getattr__`` cannot answer for it) and at ``__dlpack_device__``, and ask
``importlib.util.find_spec`` -- which finds a package without importing it --
which GPU library is installed.

Routing (``backend_for`` takes the first of cupy, numba that claims an array
and can be made):
  * CuPy arrays -> "cupy".
  * Numba device arrays on a GPU -> "cupy" if CuPy is installed and imports
    (a zero-copy view: a CuPy launch costs a tenth of a Numba one's host
    time, bench/results/device_kernels_h200.txt, and only the CuPy backend
    does CUDA IPC, through a stage for Numba's memory), else "numba";
    ``backend="numba"`` keeps them on Numba's kernels.  The simulator's
    arrays -> "numba" (CuPy cannot see them).
  * Other CUDA arrays (a CUDA torch tensor, anything exporting
    ``__cuda_array_interface__`` or a DLPack CUDA device) -> "cupy" if CuPy
    is installed and imports, else "numba" (whose constructor says what to
    install if numba-cuda is missing too).  Both views are zero-copy.
"""

from __future__ import annotations

import functools
import importlib.util

__all__ = ["is_cupy_array", "is_numba_array", "is_foreign_cuda_array", "has_module"]

# DLPack device types (dlpack.h): 2 = kDLCUDA, 13 = kDLCUDAManaged.
_DLPACK_CUDA = (2, 13)


@functools.lru_cache(maxsize=None)
def has_module(name: str) -> bool:
    """Whether ``name`` is importable, found without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _is_torch_cuda(x) -> bool:
    if not type(x).__module__.startswith("torch"):
        return False
    return getattr(getattr(x, "device", None), "type", None) == "cuda"


def is_foreign_cuda_array(x) -> bool:
    """A CUDA array of a library other than CuPy/Numba (torch, JAX, ...)."""
    t = type(x)
    if t.__module__.startswith("torch"):
        # torch.Tensor defines __cuda_array_interface__ on the class, CPU or not
        return _is_torch_cuda(x)
    if hasattr(t, "__cuda_array_interface__"):
        return True
    dev = getattr(t, "__dlpack_device__", None)
    if dev is not None:
        try:
            return int(x.__dlpack_device__()[0]) in _DLPACK_CUDA
        except Exception:  # a broken exporter is not ours to judge
            return False
    return False


def _is_numba_device_array(t) -> bool:
    # DeviceNDArray and the simulator's FakeCUDAArray both carry this marker.
    return bool(getattr(t, "__cuda_ndarray__", False)) or hasattr(t, "__cuda_array_interface__")


def is_cupy_array(x) -> bool:
    t = type(x)
    mod = t.__module__
    if mod == "cupy" or mod.startswith("cupy."):
        return True
    if mod.startswith("numba"):
        return ".simulator" not in mod and _is_numba_device_array(t) and has_module("cupy")
    return is_foreign_cuda_array(x) and has_module("cupy")


def is_numba_array(x) -> bool:
    """Every Numba device array and every CUDA array of another library: where CuPy is installed and
    imports, the registry gives them to the CuPy backend, which it asks first."""
    t = type(x)
    mod = t.__module__
    if mod.startswith("numba"):
        return _is_numba_device_array(t)
    if mod == "cupy" or mod.startswith("cupy."):
        return False
    return is_foreign_cuda_array(x)
