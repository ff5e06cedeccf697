"""Host kernels for float16 and bfloat16: widen, compute in float32, round once, in one pass.

numpy has no fast 16-bit float arithmetic on the host.  Its float16 loops
convert element by element in C, and ml_dtypes' bfloat16 loops are not
vectorised: both run far below a copy's speed (measured:
bench/results/constants.md, float16 and bfloat16).  Gradients are often
exchanged in these types, so this is where a host allreduce of them spent
its time.

Each kernel is one loop that Numba compiles for the host CPU, and that LLVM
vectorises (``ddlkernels.kernels.half_loops``, cached on disk)::

    dst[i] = narrow(widen(a[i]) + widen(b[i]))          sum
    dst[i] = narrow(widen(a[i]) * widen(b[i]))          prod
    dst[i] = narrow((widen(a[i]) + widen(b[i])) * s)    avg (s = float32(1/p))
    dst[i] = a[i] if a >= b or a is NaN else b[i]       max (float16: numpy's half loop;
                                                             bfloat16: > instead of >=)

float16 widens and narrows through LLVM's ``half`` type (one ``vcvtph2ps``
/ ``vcvtps2ph`` per vector on x86 with F16C).  bfloat16 is the top half of a
float32: widening is a shift, narrowing rounds to nearest even, and a NaN
becomes the quiet NaN of its sign (0x7FC0 / 0xFFC0), as ml_dtypes' cast
does.  Worked example, float16 sum::

    a = 0x3C00 (1.0), b = 0x1000 (2**-11)
    widen:   1.0f and 0.00048828125f
    add:     1.00048828125f        exact in float32
    narrow:  0x3C00 (1.0)          a tie between 1.0 and 1.0 + 2**-10: to even

The bits are numpy's own float16 add: float32 carries at least 2 x 11 + 2
significand bits, so rounding first to float32 and then to float16 gives the
correctly rounded sum (Figueroa, 1995), which is what numpy computes.

The results are bit for bit numpy's ufuncs (``tests/test_numpy_backend.py``,
NaN payloads included); ``reduce`` returns False when Numba cannot be
imported or compiled here, and the caller then uses numpy.
"""

from __future__ import annotations

import threading

import numpy as np

from .._dtypes import BFLOAT16

__all__ = ["reduce", "available"]

_F16 = np.dtype(np.float16)
_LOCK = threading.RLock()  # available() compiles through _loops()
_LOOPS: list = []  # [(apart, into_a, into_b)] once defined
_STATE = {"ok": None}  # None: not tried yet; then True/False


#: The codes ``ddlkernels.kernels.half_loops`` takes for an op and a type.
_OPS = {"sum": 0, "prod": 1, "avg": 2, "max": 3, "min": 4}
_KINDS = {"f16": 0, "bf16": 1}


def _try_compile() -> bool:
    """Compile and check one kernel per type; False (numpy is used) if Numba is missing or fails here."""
    try:
        for kind, dt in (("f16", _F16), ("bf16", BFLOAT16)):
            if dt is None:
                continue
            a = np.array([1.0, -2.5, 65504.0, np.inf, np.nan, 3.0], dt)
            b = np.array([0.25, 2.5, 65504.0, -1.0, 1.0, np.nan], dt)
            dst = np.empty_like(a)
            _loops()[0](dst.view(np.uint16), a.view(np.uint16), b.view(np.uint16), np.float32(1), _OPS["sum"], _KINDS[kind])
            with np.errstate(all="ignore"):
                if not np.array_equal(dst.view(np.uint16), np.add(a, b).view(np.uint16)):
                    return False
        return True
    except Exception:  # noqa: BLE001 - no Numba, no LLVM half support: numpy still works
        return False


def _loops():
    """``(apart, into_a, into_b)`` of ``ddlkernels.kernels.half_loops``."""
    if not _LOOPS:
        with _LOCK:
            if not _LOOPS:
                from . import half_loops as k  # imports (and may compile) here, not at import of this module

                _LOOPS.append((k.apart, k.into_a, k.into_b))
    return _LOOPS[0]


def available() -> bool:
    """Whether the compiled kernels are used on this machine (compiles on first call)."""
    if _STATE["ok"] is None:
        with _LOCK:
            if _STATE["ok"] is None:
                _STATE["ok"] = _try_compile()
    return _STATE["ok"]


def reduce(op: str, dst, a, b, scale=None) -> bool:
    """``dst = op(a, b)`` for float16/bfloat16 1-D arrays; "avg" multiplies by ``scale``.

    Returns False, having done nothing, when the dtype is not a half type or
    the kernels are not available (the caller then uses numpy).  ``dst`` may
    be ``a`` or ``b``.
    """
    dt = dst.dtype
    if dt == _F16:
        kind = 0
    elif BFLOAT16 is not None and dt == BFLOAT16:
        kind = 1
    else:
        return False
    if not (_STATE["ok"] or (_STATE["ok"] is None and available())):
        return False
    if op == "avg" and scale is None:
        raise ValueError("avg needs a scale")
    code = _OPS.get(op)
    if code is None:
        raise ValueError(f"no half-precision kernel for op {op!r}")
    apart, into_a, into_b = _loops()
    scale = np.float32(1.0 if scale is None else scale)
    d = dst.view(np.uint16)
    if a is dst or _same(dst, a):
        into_a(d, b.view(np.uint16), scale, code, kind)
    elif b is dst or _same(dst, b):
        into_b(d, a.view(np.uint16), scale, code, kind)
    else:
        if np.may_share_memory(dst, a):  # partial overlap: numpy's result is as if a were read first
            a = a.copy()
        if np.may_share_memory(dst, b):
            b = b.copy()
        apart(d, a.view(np.uint16), b.view(np.uint16), scale, code, kind)
    return True


def _same(x, y) -> bool:
    """Whether x and y are views of the very same elements (not just overlapping)."""
    return (x.__array_interface__["data"][0] == y.__array_interface__["data"][0]
            and x.strides == y.strides and x.shape == y.shape)
