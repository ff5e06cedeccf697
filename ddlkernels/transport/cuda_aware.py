"""Can this MPI read and write GPU memory?  And what would a device allreduce do here?

``cuda_aware(comm, override=None)`` answers with ``(aware, reason)``, asking
in this order and stopping at the first definite answer:

1. ``override`` (the ``cuda_aware=`` argument of ``Communicator``, or
   ``DDLKERNELS_CUDA_AWARE`` read by ``_config``): taken as given.
2. MPI 4.1 memory allocation kinds: the info key ``mpi_memory_alloc_kinds``
   of the communicator lists the kinds of memory MPI accepts; a kind
   ``cuda`` (e.g. ``cuda:device``) means device buffers may be passed.
3. The vendor query, through ctypes on the MPI library mpi4py loaded:
   Open MPI's ``MPIX_Query_cuda_support()`` (1 = CUDA support at run time),
   MPICH's ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``.
4. Otherwise: not aware.  Passing device memory to an MPI that cannot read it
   crashes or corrupts; staging through host memory is always correct.

Every MPI wheel on PyPI is built without CUDA, so on such an installation the
answer is "not aware" and device allreduce uses ``ddlkernels.transport.staged``.

``gpu_info()`` collects what ``python -m ddlkernels info`` reports about the
GPU path.
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["cuda_aware", "gpu_info"]

_MPIX_GPU_SUPPORT_CUDA = 0


def _alloc_kinds(comm):
    """The ``mpi_memory_alloc_kinds`` info value of ``comm`` (None if absent)."""
    try:
        info = comm.Get_info()
    except Exception:
        return None
    try:
        value = info.Get("mpi_memory_alloc_kinds")
    finally:
        try:
            info.Free()
        except Exception:
            pass
    if isinstance(value, tuple):  # mpi4py 3: (value, flag)
        value = value[0] if value[1] else None
    return value


def _mpi_lib():
    from mpi4py import MPI

    # dlsym on the extension module's handle also searches the libraries it
    # links, i.e. the very libmpi mpi4py uses.
    return ctypes.CDLL(MPI.__file__)


@functools.lru_cache(maxsize=1)
def _vendor_query():
    """(answer or None, reason), asked once per process (every Communicator's creation asks)."""
    try:
        lib = _mpi_lib()
    except OSError as exc:
        return None, f"cannot open the MPI library for a vendor query ({exc})"
    fn = getattr(lib, "MPIX_Query_cuda_support", None)
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = []
        ok = bool(fn())
        return ok, f"MPIX_Query_cuda_support() = {int(ok)}"
    fn = getattr(lib, "MPIX_GPU_query_support", None)
    if fn is not None:
        flag = ctypes.c_int(0)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        if fn(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0:
            return bool(flag.value), f"MPIX_GPU_query_support(CUDA) = {flag.value}"
    return None, "the MPI library offers neither MPIX_Query_cuda_support nor MPIX_GPU_query_support"


def cuda_aware(comm=None, override=None) -> tuple[bool, str]:
    """``(aware, reason)``: whether MPI on ``comm`` may be handed device buffers.

    ``override``: ``True``/``False`` is returned as is (reason "set
    explicitly"); ``None`` detects (see the module docstring).  ``comm``
    defaults to ``MPI.COMM_WORLD``.
    """
    if override is not None:
        return bool(override), "set explicitly"
    from mpi4py import MPI

    if comm is None:
        comm = MPI.COMM_WORLD
    kinds = _alloc_kinds(comm)
    if kinds is not None and "cuda" in kinds.lower():
        return True, f"mpi_memory_alloc_kinds = {kinds!r}"
    answer, reason = _vendor_query()
    if answer is not None:
        return answer, reason
    seen = f"mpi_memory_alloc_kinds = {kinds!r}" if kinds is not None else "no mpi_memory_alloc_kinds info key"
    return False, f"unknown ({seen}; {reason}): assuming not CUDA-aware"


def _devices():
    """(present: bool, how it was found: str)."""
    from ..backends._detect import has_module

    notes = []
    if has_module("cupy"):
        try:
            import cupy

            n = cupy.cuda.runtime.getDeviceCount()
            return n > 0, f"CuPy sees {n} device(s)"
        except Exception as exc:  # no driver, no device
            notes.append(f"CuPy: {type(exc).__name__}: {exc}".splitlines()[0])
    if has_module("numba"):
        try:
            from numba import config, cuda

            if getattr(config, "ENABLE_CUDASIM", 0):
                return False, "Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1): no real device"
            if cuda.is_available():
                return True, f"Numba sees {len(cuda.gpus)} device(s)"
            notes.append("Numba: no CUDA driver or device")
        except Exception as exc:
            notes.append(f"Numba: {type(exc).__name__}: {exc}".splitlines()[0])
    if not notes:
        notes.append("neither CuPy nor numba-cuda is installed")
    return False, "; ".join(notes)


def gpu_info(comm=None, override=None, aware=None) -> dict:
    """What the GPU path would do here, as plain data for ``python -m ddlkernels info``.

    Keys: ``backends`` (name -> "ok" or why not), ``device`` (bool),
    ``device_note``, ``cuda_aware`` (bool), ``cuda_aware_reason``,
    ``transport`` ("cuda-aware" or "staged"), ``transport_note``.
    ``aware``: ``(aware, reason)`` already decided (``Communicator.cuda_aware()``, agreed by every rank),
    else this rank's ``cuda_aware(comm, override)``.
    """
    from ..backends import available_backends

    backends = {k: v for k, v in available_backends().items() if k != "numpy"}
    present, note = _devices()
    aware, reason = cuda_aware(comm, override) if aware is None else aware
    if aware:
        transport, tnote = "cuda-aware", "device buffers go straight to MPI after a stream synchronize"
    else:
        transport, tnote = "staged", "each chunk goes D2H to pinned host memory, through MPI, H2D (ddlkernels.transport.staged)"
    return {
        "backends": backends,
        "device": present,
        "device_note": note,
        "cuda_aware": aware,
        "cuda_aware_reason": reason,
        "transport": transport,
        "transport_note": tnote,
    }
