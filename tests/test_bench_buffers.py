"""The benchmarks' inputs and exact results (ddlkernels.tools.bench.buffers) against their formulas.

``pattern`` and ``expected`` compute one period of their values and repeat it (cheap at 64 Mi elements);
here they must equal the formulas element by element, at the period's edges and past them.
"""

import numpy as np
import pytest

from ddlkernels._dtypes import SUPPORTED_DTYPES, acc_dtype, dtype_name
from ddlkernels.tools.bench.buffers import expected, pattern

COUNTS = (0, 1, 16, 67, 68, 69, 136, 137, 1000, 4099, 100003)


def formula(count, rank, dtype, op):
    key = np.arange(count, dtype=np.int64) * 7 + rank * 13
    if op == "prod":
        return np.array([1, -1, 2, 1] if np.dtype(dtype).kind in "iu" else [1, -1, 2, 0.5])[key % 4].astype(dtype)
    return (key % 17 - 8).astype(dtype)


@pytest.mark.parametrize("op", ["sum", "avg", "prod", "max", "min"])
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=dtype_name)
def test_pattern_and_expected_are_their_formulas(dtype, op):
    dt = np.dtype(dtype)
    wide = np.int64 if dt.kind in "iu" else np.float64
    for p in (1, 2, 3, 7):
        for n in COUNTS:
            for r in range(p):
                got = pattern(n, r, p, dt, op)
                assert got.dtype == dt and np.array_equal(got.view(np.uint8), formula(n, r, dt, op).view(np.uint8))
            stack = np.stack([formula(n, r, wide, op) for r in range(p)]) if n else np.zeros((p, 0), wide)
            reduce = {"sum": np.sum, "avg": np.sum, "prod": np.prod, "max": np.max, "min": np.min}[op]
            want = reduce(stack, axis=0).astype(dt)
            if op == "avg":
                acc = acc_dtype(dt)
                want = want // dt.type(p) if dt.kind in "iu" else (want.astype(acc) * acc.type(1.0 / p)).astype(dt)
            got = expected(n, p, dt, op)
            assert got.dtype == dt and np.array_equal(got.view(np.uint8), want.view(np.uint8)), (p, n)
