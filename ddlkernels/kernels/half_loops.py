"""The compiled loops of ``ddlkernels.kernels.half``, at module level so that Numba's on-disk cache finds them.

Imported only by ``ddlkernels.kernels.half`` (which says what they compute and
why), on the first half-precision reduction: importing this module imports
Numba.  ``apart(dst, a, b, scale, op, kind)``, ``into_a(dst, b, scale, op,
kind)`` and ``into_b(dst, a, scale, op, kind)`` take uint16 views and the
codes ``_half._OPS`` / ``_half._KINDS``.

Why a module of its own: Numba's on-disk cache (``cache=True``) finds a
function again in the next process only if it is defined at module level;
built per op in a closure they compiled in every process (measured:
bench/results/constants.md, float16 and bfloat16).
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic


@intrinsic
def f16_widen(typingctx, h):
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def f16_narrow(typingctx, x):
    # fptrunc: round to nearest even, overflow to infinity, NaN stays NaN.
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


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
def bf16_widen(h):
    # bfloat16 is the top half of a float32.
    return as_f32(np.uint32(h) << np.uint32(16))


@njit(inline="always")
def bf16_narrow(x):
    u = as_u32(x)
    if x != x:  # a NaN becomes the quiet NaN of its sign, as ml_dtypes' cast does
        return np.uint16(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
    # Round to nearest even on the 16 bits dropped.
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


# One combine per (op, type).  Which NaN comes out when both operands are
# NaN is fixed here, not left to the order LLVM picks for the instruction:
# numpy's float16 loops and ml_dtypes' return the second operand's (b's),
# so a NaN b is returned (quieted: y + y).  avg is defined by the backend
# as numpy's float32 a + b (``NumpyBackend.reduce``), which returns a's.
# max/min select one operand's bits, as numpy's loops do: no rounding, and
# a NaN in a wins.  numpy's float16 loop keeps a on a tie (>=, <=), so a
# signed zero comes from a; float32 (and so bfloat16 through it) from b.
def _combines(widen, narrow, tie):
    def sum_(ha, hb, scale):
        x, y = widen(ha), widen(hb)
        return narrow(y + y if y != y else x + y)

    def prod(ha, hb, scale):
        x, y = widen(ha), widen(hb)
        return narrow(y * y if y != y else x * y)

    def avg(ha, hb, scale):
        x, y = widen(ha), widen(hb)
        return narrow((x + x if x != x else x + y) * scale)

    if tie:
        def max_(ha, hb, scale):
            x, y = widen(ha), widen(hb)
            return ha if (x >= y or x != x) else hb

        def min_(ha, hb, scale):
            x, y = widen(ha), widen(hb)
            return ha if (x <= y or x != x) else hb
    else:
        def max_(ha, hb, scale):
            x, y = widen(ha), widen(hb)
            return ha if (x > y or x != x) else hb

        def min_(ha, hb, scale):
            x, y = widen(ha), widen(hb)
            return ha if (x < y or x != x) else hb

    return [njit(inline="always")(f) for f in (sum_, prod, avg, max_, min_)]


f16_sum, f16_prod, f16_avg, f16_max, f16_min = _combines(f16_widen, f16_narrow, True)
bf16_sum, bf16_prod, bf16_avg, bf16_max, bf16_min = _combines(bf16_widen, bf16_narrow, False)


# Three entry points: dst apart from both operands, dst = a, dst = b.
# Each element depends only on its own index, so every loop vectorises; but
# LLVM cannot prove that of two arrays that may overlap, and with dst and a
# the same memory its run-time overlap check sends the 3-array loop to
# scalar code, many times slower (bench/results/constants.md, float16 and bfloat16).
#
# Each entry point picks one of ten loops once per call: op and kind are
# run-time integers (one compiled function, cached on disk, instead of one
# per op), and with a branch on them inside a single loop LLVM kept the
# loop scalar (tried; several times slower than these).  nogil: the
# asynchronous API reduces on a helper thread.  No fastmath: every
# operation must round as numpy's does.
@njit(nogil=True, cache=True)
def apart(dst, a, b, scale, op, kind):
    if kind == 0:
        if op == 0:
            for i in range(dst.shape[0]):
                dst[i] = f16_sum(a[i], b[i], scale)
        elif op == 1:
            for i in range(dst.shape[0]):
                dst[i] = f16_prod(a[i], b[i], scale)
        elif op == 2:
            for i in range(dst.shape[0]):
                dst[i] = f16_avg(a[i], b[i], scale)
        elif op == 3:
            for i in range(dst.shape[0]):
                dst[i] = f16_max(a[i], b[i], scale)
        else:
            for i in range(dst.shape[0]):
                dst[i] = f16_min(a[i], b[i], scale)
    else:
        if op == 0:
            for i in range(dst.shape[0]):
                dst[i] = bf16_sum(a[i], b[i], scale)
        elif op == 1:
            for i in range(dst.shape[0]):
                dst[i] = bf16_prod(a[i], b[i], scale)
        elif op == 2:
            for i in range(dst.shape[0]):
                dst[i] = bf16_avg(a[i], b[i], scale)
        elif op == 3:
            for i in range(dst.shape[0]):
                dst[i] = bf16_max(a[i], b[i], scale)
        else:
            for i in range(dst.shape[0]):
                dst[i] = bf16_min(a[i], b[i], scale)


@njit(nogil=True, cache=True)
def into_a(dst, b, scale, op, kind):
    if kind == 0:
        if op == 0:
            for i in range(dst.shape[0]):
                dst[i] = f16_sum(dst[i], b[i], scale)
        elif op == 1:
            for i in range(dst.shape[0]):
                dst[i] = f16_prod(dst[i], b[i], scale)
        elif op == 2:
            for i in range(dst.shape[0]):
                dst[i] = f16_avg(dst[i], b[i], scale)
        elif op == 3:
            for i in range(dst.shape[0]):
                dst[i] = f16_max(dst[i], b[i], scale)
        else:
            for i in range(dst.shape[0]):
                dst[i] = f16_min(dst[i], b[i], scale)
    else:
        if op == 0:
            for i in range(dst.shape[0]):
                dst[i] = bf16_sum(dst[i], b[i], scale)
        elif op == 1:
            for i in range(dst.shape[0]):
                dst[i] = bf16_prod(dst[i], b[i], scale)
        elif op == 2:
            for i in range(dst.shape[0]):
                dst[i] = bf16_avg(dst[i], b[i], scale)
        elif op == 3:
            for i in range(dst.shape[0]):
                dst[i] = bf16_max(dst[i], b[i], scale)
        else:
            for i in range(dst.shape[0]):
                dst[i] = bf16_min(dst[i], b[i], scale)


@njit(nogil=True, cache=True)
def into_b(dst, a, scale, op, kind):
    if kind == 0:
        if op == 0:
            for i in range(dst.shape[0]):
                dst[i] = f16_sum(a[i], dst[i], scale)
        elif op == 1:
            for i in range(dst.shape[0]):
                dst[i] = f16_prod(a[i], dst[i], scale)
        elif op == 2:
            for i in range(dst.shape[0]):
                dst[i] = f16_avg(a[i], dst[i], scale)
        elif op == 3:
            for i in range(dst.shape[0]):
                dst[i] = f16_max(a[i], dst[i], scale)
        else:
            for i in range(dst.shape[0]):
                dst[i] = f16_min(a[i], dst[i], scale)
    else:
        if op == 0:
            for i in range(dst.shape[0]):
                dst[i] = bf16_sum(a[i], dst[i], scale)
        elif op == 1:
            for i in range(dst.shape[0]):
                dst[i] = bf16_prod(a[i], dst[i], scale)
        elif op == 2:
            for i in range(dst.shape[0]):
                dst[i] = bf16_avg(a[i], dst[i], scale)
        elif op == 3:
            for i in range(dst.shape[0]):
                dst[i] = bf16_max(a[i], dst[i], scale)
        else:
            for i in range(dst.shape[0]):
                dst[i] = bf16_min(a[i], dst[i], scale)
