"""The host backend's kernels: numpy's semantics, bit for bit, including the bfloat16 fast path."""

import numpy as np
import pytest

from ddlkernels._dtypes import BFLOAT16, SUPPORTED_DTYPES, acc_dtype, dtype_name
from ddlkernels.backends import get_backend

BE = get_backend("numpy")
UF = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def sample(n, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        return rng.integers(-1000, 1000, n).astype(dt)
    x = (rng.standard_normal(n) * 50).astype(dt)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, 65504.0, -3.0]).astype(dt)
    k = min(n, len(specials))
    x[:k] = specials[:k]
    return x


def bits(x):
    return np.ascontiguousarray(x).view(np.uint8)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=[dtype_name(d) for d in SUPPORTED_DTYPES])
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("n", [0, 1, 7, (1 << 16) + 3, 200_001])
def test_reduce_matches_numpy_ufunc_bitwise(dtype, op, n):
    a, b = sample(n, dtype, 1), sample(n, dtype, 2)
    a[8::2], b[9::2] = b[8::2], a[9::2]  # NaNs and infinities meet both operand orders
    with np.errstate(all="ignore"):
        expect = UF[op](a, b)
        dst = np.empty_like(a)
        BE.reduce(op, dst, a, b)
        assert np.array_equal(bits(dst), bits(expect))
        inplace = a.copy()
        BE.reduce(op, inplace, b)
        assert np.array_equal(bits(inplace), bits(expect))


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=[dtype_name(d) for d in SUPPORTED_DTYPES])
@pytest.mark.parametrize("p", [1, 2, 3, 7])
def test_fused_avg_is_one_rounding_of_sum_times_reciprocal(dtype, p):
    a, b = sample(70_001, dtype, 3), sample(70_001, dtype, 4)
    dst = np.empty_like(a)
    with np.errstate(all="ignore"):
        BE.reduce("sum", dst, a, b, avg_p=p)
        if np.dtype(dtype).kind in "iu":
            expect = (a + b) // p
        else:
            acc = acc_dtype(dtype)
            s = (a.astype(acc) + b.astype(acc)).astype(acc)
            expect = (s * acc.type(1.0 / p)).astype(dtype)
    assert np.array_equal(bits(dst), bits(expect))


def test_wire_views_share_memory():
    for dt in (np.float16, BFLOAT16):
        x = np.zeros(5, dt)
        w = BE.wire(x)
        assert w.dtype == np.uint16 and np.shares_memory(w, x)
    x = np.zeros(5, np.float32)
    assert BE.wire(x) is x
