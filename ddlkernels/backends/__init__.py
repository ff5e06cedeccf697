"""Array backends: the small interface the engine uses to touch memory.

A backend knows one array library (numpy on the host; CuPy or Numba on a GPU)
and offers the engine exactly what a ring step needs: flat views of user
arrays, scratch buffers, copies, and the pairwise reduction kernels.  The
engine never imports an array library itself; it asks ``get_backend`` for the
backend of an array, or for one by name.

Registry: backends register a name, an import path and a predicate that
recognises their arrays without importing their library (duck typing on
``__cuda_array_interface__`` / ``__dlpack_device__`` / the type's module), so
``import ddlkernels`` never imports CUDA.  Two predicates may both claim an
array (a Numba device array: "cupy" where CuPy is installed, and "numba"):
it goes to the first registered backend that claims it and can be made.
"""

from __future__ import annotations

import abc
import importlib
from typing import Any, Callable

import numpy as np

__all__ = ["Backend", "register_backend", "get_backend", "backend_for", "serves", "available_backends",
           "BackendUnavailable", "torch_result"]


class BackendUnavailable(ImportError):
    """A backend was asked for but its array library cannot be imported."""


class Backend(abc.ABC):
    """What the engine needs from an array library.

    Arrays handed to the engine are 1-D, C-contiguous and of a dtype listed in
    ``ddlkernels._dtypes.SUPPORTED_DTYPES``.  Reductions follow numpy's
    semantics exactly, including NaN propagation and operand order for
    ``max``/``min`` (``np.maximum(dst, src)``), and compute in
    ``_dtypes.acc_dtype`` with one rounding to the storage type, so every
    backend produces the same bits for the same inputs.
    """

    #: registry name
    name: str = ""
    #: True when buffers live in device memory (MPI needs CUDA-awareness or staging)
    device: bool = False

    # -- arrays ---------------------------------------------------------------
    @abc.abstractmethod
    def flat(self, x) -> Any:
        """A 1-D view of ``x`` sharing its memory; ``ValueError`` if ``x`` is not contiguous."""

    @abc.abstractmethod
    def empty(self, n: int, dtype: np.dtype) -> Any:
        """A new uninitialised 1-D buffer of ``n`` elements."""

    @abc.abstractmethod
    def like(self, flat, x, shape=None) -> Any:
        """Wrap the 1-D buffer ``flat`` as an array of ``x``'s type (torch tensors stay tensors, bfloat16 stays
        bfloat16) and shape, or of ``shape`` (a shard of ``x``)."""

    def dtype(self, x) -> np.dtype:
        return np.dtype(x.dtype)

    def overlaps(self, a, b) -> bool:
        """Whether the 1-D contiguous buffers ``a`` and ``b`` (from ``flat`` or ``empty``) share any byte."""
        return bool(np.may_share_memory(a, b))  # exact for two contiguous host buffers: their spans

    def device_id(self, x) -> int | None:
        """Device ordinal of ``x`` (``None`` on the host)."""
        return None

    def wire(self, buf):
        """``buf`` as MPI should see it: the same memory, typed so mpi4py can pass it.

        MPI has no float16/bfloat16 datatype; they travel as 16-bit integers.
        """
        return buf

    # -- kernels ----------------------------------------------------------------
    @abc.abstractmethod
    def copy(self, dst, src) -> None:
        """``dst[:] = src`` (same length, same dtype)."""

    @abc.abstractmethod
    def reduce(self, op: str, dst, a, b=None, *, avg_p: int | None = None) -> None:
        """``dst = op(dst, a)`` or, with ``b``, ``dst = op(a, b)``.

        ``op`` is "sum", "max", "min" or "prod".  ``avg_p`` (only with "sum")
        fuses the scale of "avg": floats become ``(a + b) * (1 / avg_p)`` in
        the accumulation type, integers ``(a + b) // avg_p``.
        """

    @abc.abstractmethod
    def scale(self, dst, p) -> None:
        """"avg"'s last step on ``dst``, a finished sum over ``p`` ranks: ``dst * (1/p)`` in the accumulation
        type for floats, ``floor(dst / p)`` for integers (``ddlkernels._dtypes.scale_inplace``'s bits)."""

    def synchronize(self) -> None:
        """Block until every kernel this backend launched has finished."""


_REGISTRY: dict[str, tuple[str, Callable[[Any], bool]]] = {}
_INSTANCES: dict[str, Backend] = {}
#: name -> (message, cause) of a backend that could not be made: not tried again at every call
_UNAVAILABLE: dict[str, tuple[str, BaseException]] = {}


def torch_result(t):
    """``t``, a torch tensor a backend's ``like`` made of its own array; where it holds no element, a new empty
    tensor of its shape, dtype and device instead: numpy gives an empty array zero strides, torch keeps them, and
    ``.view(dtype)`` to another element size then refuses the caller's result."""
    if t.numel():
        return t
    import torch

    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def register_backend(name: str, target: str, recognises: Callable[[Any], bool]) -> None:
    """Register backend ``name``: ``target`` is "module:Class", imported on first use."""
    _REGISTRY[name] = (target, recognises)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name`` (one instance per process)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; registered: {', '.join(_REGISTRY)}")
    if name not in _INSTANCES:
        if name in _UNAVAILABLE:
            msg, cause = _UNAVAILABLE[name]
            raise BackendUnavailable(msg) from cause
        target, _ = _REGISTRY[name]
        mod, cls = target.split(":")
        try:
            _INSTANCES[name] = getattr(importlib.import_module(mod), cls)()
        except BackendUnavailable as exc:
            _UNAVAILABLE[name] = (str(exc), exc.__cause__)
            raise
    return _INSTANCES[name]


def backend_for(x, name: str | None = None) -> Backend:
    """The backend for array ``x``: ``name`` if given, else the first registered one that recognises ``x`` and
    can be made here (CuPy installed but not importable: the Numba backend takes a Numba or torch array)."""
    if name is not None:
        return get_backend(name)
    if type(x) is np.ndarray:  # the hot case, without walking the registry
        be = _INSTANCES.get("numpy")
        if be is not None:
            return be
    missing = None
    for bname, (_, recognises) in _REGISTRY.items():
        if recognises(x):
            try:
                return get_backend(bname)
            except BackendUnavailable as exc:
                missing = missing or exc
    if missing is not None:
        raise missing
    raise TypeError(
        f"ddlkernels cannot reduce an object of type {type(x).__module__}.{type(x).__qualname__}; "
        f"expected a numpy, CuPy, Numba device or PyTorch array"
    )


def serves(be: Backend, x) -> bool:
    """Whether backend ``be`` takes array ``x`` (an ``out`` of another library than the input, both views of
    device memory, is taken by the input's backend where its predicate claims it)."""
    return _REGISTRY[be.name][1](x)


def available_backends() -> dict[str, str]:
    """Name -> "ok" or the reason the backend cannot be used here."""
    out = {}
    for name in _REGISTRY:
        try:
            get_backend(name)
            out[name] = "ok"
        except ImportError as exc:
            out[name] = f"unavailable: {exc}"
    return out


def _is_host(x) -> bool:
    if isinstance(x, np.ndarray):
        return True
    mod = type(x).__module__
    if mod.startswith("torch"):
        return getattr(getattr(x, "device", None), "type", None) == "cpu"
    return False


register_backend("numpy", "ddlkernels.backends._numpy:NumpyBackend", _is_host)

# Device backends (predicates in _detect import no GPU library; see there for
# how CUDA arrays of other libraries, e.g. torch, are routed).
from ._detect import is_cupy_array as _is_cupy, is_numba_array as _is_numba  # noqa: E402

register_backend("cupy", "ddlkernels.backends._cupy:CupyBackend", _is_cupy)
register_backend("numba", "ddlkernels.backends._numba:NumbaBackend", _is_numba)
