"""The host backend's compiled sum and product for float32, float64, int32 and int64 (``NumpyBackend.reduce``).

Purpose: ``dst = a + b`` (or ``a * b``) over 1-D arrays, the ring's inner
step per chunk, at the speed of the memory whatever the arrays' alignment.
numpy's own loop (AVX-512 on the Intel VM of bench/results) runs at half
speed when its operands sit at different offsets within a 64-byte line,
because then every vector load of one of them splits across two lines;
which offsets a caller's arrays have is up to its allocator (glibc puts a
large ``malloc`` 16 bytes past a page, a small one anywhere 16-aligned).
LLVM's loop here does not care.  Measured with the three arrays at chosen
offsets (a and b on a line, dst 0 / 16 / 32 / 48 bytes past one), float32,
256 KiB each, GB/s counted as STREAM does (read 2, write 1): numpy 113 /
65 / 80 / 66, this loop 117 / 99 / 132 / 101, a copy of the same size 95;
at 1 MiB (three arrays overflow the 2 MiB L2) and 16 MiB both at 30-33 and
27-29, the copy at 62-65 and 29.  A call costs about what numpy's does
(263 against 240 ns for 16 elements).

Preconditions, checked here, else ``reduce`` returns False and the caller
uses numpy: the three arrays 1-D of one length (the backend checks that
they have one dtype), and ``dst`` either exactly ``a``, exactly ``b`` or
disjoint from both (numpy defines partial overlap by buffering; this loop
would read elements it had already written).  Operands in order: ``a op b``
for every element, as numpy's ufunc computes it, and the same bits.

Why a module of its own: Numba's on-disk cache finds a function again in
the next process only if it is defined at module level, and it notices a
change only to the file that defines it; these loops inline nothing from
other files.
"""

import numpy as np
from numba import njit

#: op codes of ``reduce``.
SUM, PROD = 0, 1


@njit(inline="always")
def _extent(x):
    # [lo, hi) bytes of a 1-D array, whatever the sign of its stride.
    lo = x.ctypes.data
    span = (x.shape[0] - 1) * x.strides[0]
    if span < 0:
        return lo + span, lo + x.itemsize
    return lo, lo + span + x.itemsize


@njit(inline="always")
def _same(x, y):
    return x.ctypes.data == y.ctypes.data and x.strides[0] == y.strides[0]


@njit(inline="always")
def _overlap(x, y):
    xl, xh = _extent(x)
    yl, yh = _extent(y)
    return xl < yh and yl < xh


@njit(inline="always")
def _add(u, v):
    return u + v


@njit(inline="always")
def _mul(u, v):
    return u * v


# Each shape of loop reads and writes through as few arrays as it can: LLVM vectorizes a loop over arrays it
# cannot prove disjoint only behind a run-time overlap check, and dst = dst + b written as dst[i] = a[i] + b[i]
# with a is dst fails that check and runs scalar.
@njit(inline="always")
def _reduce(d, a, b, combine):
    n = d.shape[0]
    if _same(d, a):
        for i in range(n):
            d[i] = combine(d[i], b[i])
    elif _same(d, b):
        for i in range(n):
            d[i] = combine(a[i], d[i])
    elif _overlap(d, a) or _overlap(d, b):
        return False
    else:
        for i in range(n):
            d[i] = combine(a[i], b[i])
    return True


@njit(cache=True, nogil=True)
def reduce(d, a, b, op):
    """``d = a op b`` (op ``SUM`` or ``PROD``); False, having written nothing, where the preconditions fail."""
    n = d.shape[0]
    if a.shape[0] != n or b.shape[0] != n:
        return False
    if n == 0:
        return True
    if op == SUM:
        return _reduce(d, a, b, _add)
    return _reduce(d, a, b, _mul)
