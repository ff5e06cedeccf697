"""The shared-memory loops' streaming copy (``ddlkernels.kernels.node_primitives._stream``): every alignment and length.

The copy writes a destination's whole aligned 64-byte lines with
non-temporal stores and the bytes before and after them with memcpy, so an
off-by-one in either bound copies too little or writes past the end: every
destination offset within a line, lengths around one and two lines, each
checked with its neighbours untouched.
"""

import platform

import numpy as np
import pytest
from numba import njit

from ddlkernels.kernels.node_primitives import _stream


@njit
def _copy_streamed(dst, src):
    _stream(dst, src, True)


@njit
def _copy_cached(dst, src):
    _stream(dst, src, False)


@pytest.mark.parametrize("copy", [_copy_streamed, _copy_cached], ids=["streamed", "cached"])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.float64], ids=lambda d: d.__name__)
def test_every_offset_and_length_copies_exactly_its_range(copy, dtype):
    item = np.dtype(dtype).itemsize
    line = 64 // item
    src = np.arange(1, 8 * line + 1).astype(dtype)  # no element equals the guard value
    lengths = sorted({0, 1, line - 1, line, line + 1, 2 * line - 1, 2 * line, 2 * line + 1, 3 * line + 5,
                      5 * line + 7})
    base = np.empty(12 * line, dtype)
    for offset in range(line + 1):
        for src_offset in (0, 1):
            for n in lengths:
                base[...] = 0
                copy(base[offset : offset + n], src[src_offset : src_offset + n])
                what = f"offset {offset}, source offset {src_offset}, {n} elements"
                assert np.array_equal(base[offset : offset + n], src[src_offset : src_offset + n]), what
                assert not base[:offset].any() and not base[offset + n :].any(), f"{what}: wrote outside"


def test_a_strided_destination_takes_the_element_loop():
    src = np.arange(1, 40, dtype=np.float32)
    dst = np.zeros(2 * src.size, np.float32)
    _copy_streamed(dst[::2], src)
    assert np.array_equal(dst[::2], src) and not dst[1::2].any()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="checks x86 instructions")
def test_the_streamed_copy_is_non_temporal_stores_and_a_fence():
    """What the copy is for: LLVM kept the non-temporal hint (``movnt*``) and the fence after it."""
    a = np.zeros(256, np.float32)
    _copy_streamed(a, a[::-1].copy())
    _copy_cached(a, a[::-1].copy())
    streamed = _copy_streamed.inspect_asm(_copy_streamed.signatures[0])
    cached = _copy_cached.inspect_asm(_copy_cached.signatures[0])
    assert "movnt" in streamed and "movnt" not in cached
    # A sequentially consistent fence: mfence, or the locked no-op LLVM prefers on x86.
    assert "mfence" in streamed or "lock\t\tor" in streamed or "lock or" in streamed
