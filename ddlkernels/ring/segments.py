"""``Segments``: many host arrays at fixed offsets of one virtual buffer, reduced without packing them first.

Worked example, a fusion bucket of float32 with ``a`` (3 elements) at offset
0 and ``c`` (20) at offset 4::

    element   0 1 2 | 3   | 4 ... 23
    reads     a[0:3]| gap | c[0:20]       (the gap reads as 0)

The ring engine (``ddlkernels.ring.engine``) reads each element of a
``Segments`` where it lies: the block it sends first, and each block it
reduces, so a bucket costs 1/d1 of a copy of the buffer instead of all of it
(``ddlkernels.fusion``).
"""

from __future__ import annotations

import bisect

import numpy as np

__all__ = ["Segments"]


class Segments:
    """A read-only flat host buffer of ``count`` elements made of 1-D arrays at element offsets.

    ``parts``: ``[(offset, array), ...]`` in increasing, non-overlapping
    order, every array 1-D of ``dtype``; elements no part covers (alignment
    gaps) read as zeros.  ``src`` of ``execute`` for a host backend.
    """

    __slots__ = ("count", "dtype", "shape", "_starts", "_parts")

    def __init__(self, count: int, dtype, parts):
        self.count = int(count)
        self.dtype = np.dtype(dtype)
        self.shape = (self.count,)
        end = 0
        for off, arr in parts:
            if off < end or arr.ndim != 1 or arr.dtype != self.dtype or off + arr.shape[0] > self.count:
                raise ValueError(f"Segments: part at offset {off} overlaps, is not 1-D {self.dtype}, or overruns")
            end = off + arr.shape[0]
        self._parts = [(int(off), arr) for off, arr in parts if arr.shape[0]]
        self._starts = [off for off, _ in self._parts]

    def pieces(self, a: int, b: int):
        """``(lo, hi, array or None, index in array)`` covering ``[a, b)`` in order; None is a gap."""
        i = max(0, bisect.bisect_right(self._starts, a) - 1)
        pos = a
        parts = self._parts
        while pos < b:
            if i < len(parts):
                off, arr = parts[i]
                end = off + arr.shape[0]
                if end <= pos:
                    i += 1
                    continue
                if off > pos:  # a gap before the next part
                    hi = min(off, b)
                    yield pos, hi, None, 0
                    pos = hi
                    continue
                hi = min(end, b)
                yield pos, hi, arr, pos - off
                pos = hi
            else:
                yield pos, b, None, 0
                pos = b

    def copy_to(self, out, a: int, b: int) -> None:
        """``out[a:b] = self[a:b]``."""
        self.copy_into(out[a:b], a, b)

    def copy_into(self, dst, a: int, b: int) -> None:
        """``dst[:b - a] = self[a:b]``."""
        for lo, hi, arr, k in self.pieces(a, b):
            if arr is None:
                dst[lo - a : hi - a] = 0
            else:
                dst[lo - a : hi - a] = arr[k : k + hi - lo]

    def reduce_into(self, reduce, op, out, a: int, b: int, other, avg_p=None) -> None:
        """``out[a:b] = op(self[a:b], other)``, ``other`` holding ``b - a`` elements, with ``reduce`` of a backend."""
        for lo, hi, arr, k in self.pieces(a, b):
            o = other[lo - a : hi - a]
            if arr is None:
                # Gaps are padding nobody reads; zeros op the peer's padding keeps them defined.
                out[lo:hi] = 0
                reduce(op, out[lo:hi], out[lo:hi], o, avg_p=avg_p)
            else:
                reduce(op, out[lo:hi], arr[k : k + hi - lo], o, avg_p=avg_p)
