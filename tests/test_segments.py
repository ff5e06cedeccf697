"""Segments: a fusion bucket read where its tensors lie, element for element equal to the packed buffer."""

import numpy as np
import pytest

from ddlkernels.ring.segments import Segments
from ddlkernels.backends import get_backend

NP = get_backend("numpy")


def layout(rng, count):
    """Random non-overlapping parts with gaps (and empty parts) inside ``[0, count)``; returns parts and the packed buffer."""
    parts, packed, pos = [], np.zeros(count, np.float32), 0
    while pos < count:
        pos += int(rng.integers(0, 4))  # a gap of 0..3
        n = min(int(rng.integers(0, 9)), max(0, count - pos))
        arr = rng.standard_normal(n).astype(np.float32)
        if pos + n <= count:
            parts.append((pos, arr))
            packed[pos : pos + n] = arr
        pos += n
    return parts, packed


@pytest.mark.parametrize("seed", range(20))
def test_every_range_reads_as_the_packed_buffer(seed):
    rng = np.random.default_rng(seed)
    count = int(rng.integers(0, 60))
    parts, packed = layout(rng, count)
    seg = Segments(count, np.float32, parts)
    for a in range(count + 1):
        for b in range(a, count + 1):
            out = np.full(count, np.nan, np.float32)
            seg.copy_to(out, a, b)
            assert np.array_equal(out[a:b], packed[a:b]), (a, b)
            assert np.isnan(out[:a]).all() and np.isnan(out[b:]).all(), "wrote outside [a, b)"
            covered = [(lo, hi) for lo, hi, _, _ in seg.pieces(a, b)]
            assert covered == sorted(covered) and sum(hi - lo for lo, hi in covered) == b - a


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_reduce_into_equals_reducing_the_packed_buffer(op):
    rng = np.random.default_rng(1)
    parts, packed = layout(rng, 97)
    seg = Segments(97, np.float32, parts)
    other = rng.standard_normal(97).astype(np.float32)
    for a, b in [(0, 97), (3, 41), (40, 41), (60, 97), (5, 5)]:
        got = np.full(97, np.nan, np.float32)
        want = got.copy()
        seg.reduce_into(NP.reduce, op, got, a, b, other[a:b])
        NP.reduce(op, want[a:b], packed[a:b], other[a:b])
        assert np.array_equal(got, want, equal_nan=True), (op, a, b)


def test_bad_parts_are_refused():
    with pytest.raises(ValueError, match="overlaps"):
        Segments(10, np.float32, [(0, np.zeros(4, np.float32)), (3, np.zeros(2, np.float32))])
    with pytest.raises(ValueError, match="overruns"):
        Segments(4, np.float32, [(2, np.zeros(3, np.float32))])
    with pytest.raises(ValueError, match="float32"):
        Segments(4, np.float32, [(0, np.zeros(2, np.float64))])
