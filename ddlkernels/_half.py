"""Host kernels for float16 and bfloat16: widen, compute in float32, round once, in one pass.

numpy has no fast 16-bit float arithmetic on the host.  Its float16 loops
convert element by element in C, and ml_dtypes' bfloat16 loops are not
vectorised: on the 2-core machine ``bench/bench_reduce.py`` measured
``np.add`` at 2 % of a same-size copy for float16 and the float32-scratch
bfloat16 path at 13 %.  Gradients are often exchanged in these types, so
this is where a host allreduce of them spent its time.

Each kernel here is one loop that Numba compiles for the host CPU, and that
LLVM vectorises::

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

from ._dtypes import BFLOAT16

__all__ = ["reduce", "available"]

_F16 = np.dtype(np.float16)
_LOCK = threading.RLock()  # available() compiles through _kernel()
_KERNELS: dict = {}
_STATE = {"ok": None}  # None: not tried yet; then True/False


def _build(op: str, kind: str):
    """``(apart(dst, a, b, s), into_a(dst, b, s), into_b(dst, a, s))`` for ``op`` on uint16 views of ``kind``.

    ``kind``: "f16" or "bf16".  Numba compiles each on its first call.
    """
    from llvmlite import ir
    from numba import njit, types
    from numba.core.extending import intrinsic

    if kind == "f16":

        @intrinsic
        def widen(typingctx, h):
            def codegen(context, builder, sig, args):
                return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

            return types.float32(types.uint16), codegen

        @intrinsic
        def narrow(typingctx, x):
            # fptrunc: round to nearest even, overflow to infinity, NaN stays NaN.
            def codegen(context, builder, sig, args):
                return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

            return types.uint16(types.float32), codegen

    else:

        @intrinsic
        def as_f32(typingctx, u):
            def codegen(context, builder, sig, args):
                return builder.bitcast(args[0], ir.FloatType())

            return types.float32(types.uint32), codegen

        @intrinsic
        def as_u32(typingctx, x):
            def codegen(context, builder, sig, args):
                return builder.bitcast(args[0], ir.IntType(32))

            return types.uint32(types.float32), codegen

        @njit(inline="always")
        def widen(h):
            return as_f32(np.uint32(h) << np.uint32(16))

        @njit(inline="always")
        def narrow(x):
            u = as_u32(x)
            if x != x:  # a NaN becomes the quiet NaN of its sign, as ml_dtypes' cast does
                return np.uint16(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
            return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    # Which NaN comes out when both operands are NaN is fixed here, not left
    # to the order LLVM picks for the instruction: numpy's float16 loops and
    # ml_dtypes' return the second operand's (b's), so a NaN b is returned
    # (quieted: y + y).  avg is defined by the backend as numpy's float32
    # a + b (``NumpyBackend.reduce``), which returns a's.
    if op == "sum":

        def combine(ha, hb, scale):
            x, y = widen(ha), widen(hb)
            return narrow(y + y if y != y else x + y)

    elif op == "prod":

        def combine(ha, hb, scale):
            x, y = widen(ha), widen(hb)
            return narrow(y * y if y != y else x * y)

    elif op == "avg":

        def combine(ha, hb, scale):
            x, y = widen(ha), widen(hb)
            return narrow((x + x if x != x else x + y) * scale)

    elif op in ("max", "min"):
        # Select one operand's bits, as numpy's loops do: no rounding, and a
        # NaN in a wins.  numpy's float16 loop keeps a on a tie (>=, <=), so a
        # signed zero comes from a; float32 (and so bfloat16 through it) from b.
        tie = kind == "f16"
        if op == "max":

            def combine(ha, hb, scale):
                x, y = widen(ha), widen(hb)
                return ha if (x > y or x != x or (tie and x == y)) else hb

        else:

            def combine(ha, hb, scale):
                x, y = widen(ha), widen(hb)
                return ha if (x < y or x != x or (tie and x == y)) else hb

    else:
        raise ValueError(f"no half-precision kernel for op {op!r}")
    combine = njit(inline="always")(combine)

    # Three loops: dst apart from both operands, dst = a, dst = b.  Each
    # element depends only on its own index, so every form vectorises; but
    # LLVM cannot prove that of two arrays that may overlap, and with dst
    # and a the same memory its run-time overlap check sends the 3-array
    # loop to scalar code (1.7 GB/s instead of 36 for float16 in place).
    def apart(dst, a, b, scale):
        for i in range(dst.shape[0]):
            dst[i] = combine(a[i], b[i], scale)

    def into_a(dst, b, scale):
        for i in range(dst.shape[0]):
            dst[i] = combine(dst[i], b[i], scale)

    def into_b(dst, a, scale):
        for i in range(dst.shape[0]):
            dst[i] = combine(a[i], dst[i], scale)

    # nogil: the asynchronous API reduces on a helper thread.  No fastmath:
    # every operation must round as numpy's does.
    return tuple(njit(nogil=True)(f) for f in (apart, into_a, into_b))


def _try_compile() -> bool:
    """Compile and check one kernel per type; False (numpy is used) if Numba is missing or fails here."""
    try:
        for kind, dt in (("f16", _F16), ("bf16", BFLOAT16)):
            if dt is None:
                continue
            a = np.array([1.0, -2.5, 65504.0, np.inf, np.nan, 3.0], dt)
            b = np.array([0.25, 2.5, 65504.0, -1.0, 1.0, np.nan], dt)
            dst = np.empty_like(a)
            _kernel("sum", kind)[0](dst.view(np.uint16), a.view(np.uint16), b.view(np.uint16), np.float32(1))
            with np.errstate(all="ignore"):
                if not np.array_equal(dst.view(np.uint16), np.add(a, b).view(np.uint16)):
                    return False
        return True
    except Exception:  # noqa: BLE001 - no Numba, no LLVM half support: numpy still works
        return False


def _kernel(op, kind):
    k = _KERNELS.get((op, kind))
    if k is None:
        with _LOCK:
            k = _KERNELS.get((op, kind))
            if k is None:
                k = _KERNELS[(op, kind)] = _build(op, kind)
    return k


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
        kind = "f16"
    elif BFLOAT16 is not None and dt == BFLOAT16:
        kind = "bf16"
    else:
        return False
    if not (_STATE["ok"] or (_STATE["ok"] is None and available())):
        return False
    if op == "avg" and scale is None:
        raise ValueError("avg needs a scale")
    apart, into_a, into_b = _kernel(op, kind)
    scale = np.float32(1.0 if scale is None else scale)
    d = dst.view(np.uint16)
    if a is dst or _same(dst, a):
        into_a(d, b.view(np.uint16), scale)
    elif b is dst or _same(dst, b):
        into_b(d, a.view(np.uint16), scale)
    else:
        if np.may_share_memory(dst, a):  # partial overlap: numpy's result is as if a were read first
            a = a.copy()
        if np.may_share_memory(dst, b):
            b = b.copy()
        apart(d, a.view(np.uint16), b.view(np.uint16), scale)
    return True


def _same(x, y) -> bool:
    """Whether x and y are views of the very same elements (not just overlapping)."""
    return (x.__array_interface__["data"][0] == y.__array_interface__["data"][0]
            and x.strides == y.strides and x.shape == y.shape)
