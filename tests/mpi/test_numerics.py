"""Numerics: the documented error bound of float sums, one rounding per pairwise op, and NaN/Inf as numpy.

docs/reliability.md states the bound tested here.  Every pairwise
combination is computed in the accumulation type (float32 for float16 and
bfloat16) and rounded once to the storage type, and such a double rounding
is still a correct rounding of the exact sum (f32 has >= 2t + 2 bits for
t = 11 and t = 8), so each of the p - 1 additions of an element's sum makes
a relative error of at most u, the storage type's unit roundoff:

    |sum_ddl - sum_exact| <= gamma(m) * sum_i |x_i|,   gamma(k) = k u / (1 - k u)

    avg:  |avg_ddl - sum_exact / p| <= gamma(m) * sum_i |x_i| / p + gamma(3) * |sum_exact / p|

where m is the depth of the summation tree: m = sum_i (d_i - 1) for dims
(d_1, ..., d_k) -- the ring along dimension 1 chains d_1 - 1 additions,
the next dimension chains d_2 - 1 additions of those partial sums, and so
on -- so m = p - 1 for the flat ring and less for a box (16 x 16: 30, not
255).  dims=None may run MPI's own allreduce, whose tree has depth at most
p - 1, so that case is held to m = p - 1.  The average adds the rounding of
1/p, of the product, and of the store.
The data are random with mixed signs and magnitudes over several binades,
so that cancellation makes the bound tight in relative terms; the largest
observed error / bound ratio is printed for the docs.
"""

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels
from ddlkernels._dtypes import BFLOAT16, dtype_name
from helpers import dims_cases

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
U = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}
FLOATS = [np.dtype(np.float16), BFLOAT16, np.dtype(np.float32)]
IDS = [dtype_name(d) for d in FLOATS]


def gamma(k, u):
    return k * u / (1 - k * u)


def inputs(n, dt, seed):
    """Every rank's input (rebuilt on every rank from the seed): mixed signs, magnitudes 2^-6 .. 2^6."""
    out = []
    for r in range(P):
        rng = np.random.default_rng([seed, r])
        v = rng.uniform(1, 2, n) * 2.0 ** rng.integers(-6, 7, n) * np.where(rng.random(n) < 0.5, -1, 1)
        out.append(v.astype(dt))
    return out


def depth(dims):
    return P - 1 if dims is None else sum(d - 1 for d in dims)


@pytest.mark.parametrize("dt", FLOATS, ids=IDS)
@pytest.mark.parametrize("dims", dims_cases(P), ids=str)
def test_sum_and_avg_within_documented_bound(dt, dims):
    n = 20011
    xs = inputs(n, dt, seed=17)
    x64 = np.stack([a.astype(np.float64) for a in xs])
    exact = x64.sum(axis=0)  # exact: <= 24-bit significands over 13 binades, p <= 8: < 53 bits
    absum = np.abs(x64).sum(axis=0)
    u = U[dtype_name(dt)]
    m = depth(dims)
    got = ddlkernels.allreduce(xs[RANK], "sum", dims=dims, chunk_bytes=4096).astype(np.float64)
    err = np.abs(got - exact)
    bound = gamma(m, u) * absum
    assert (err <= bound).all(), f"sum: {np.count_nonzero(err > bound)} elements beyond the bound"
    if P == 1:
        assert (err == 0).all()
    else:
        # The comparison is not vacuous: rounding does happen.
        assert err.max() > 0
    ratio = float((err / np.where(bound > 0, bound, 1)).max())
    got_avg = ddlkernels.allreduce(xs[RANK], "avg", dims=dims, chunk_bytes=4096).astype(np.float64)
    err_avg = np.abs(got_avg - exact / P)
    bound_avg = gamma(m, u) * absum / P + gamma(3, u) * np.abs(exact / P)
    assert (err_avg <= bound_avg).all(), f"avg: {np.count_nonzero(err_avg > bound_avg)} elements beyond the bound"
    if RANK == 0:
        print(f"\nnumerics p={P} {dtype_name(dt)} dims={dims}: max sum error / bound = {ratio:.3f}, "
              f"max relative error vs sum|x| = {float((err / absum).max()):.3g} (bound gamma({m}) = {gamma(m, u):.3g})")


@pytest.mark.parametrize("dt", FLOATS, ids=IDS)
def test_two_ranks_round_once(dt):
    """With 2 ranks each sum is one pairwise op: exactly the correctly rounded exact sum."""
    if P != 2:
        pytest.skip("the exact one-rounding check needs exactly 2 ranks")
    xs = inputs(50_000, dt, seed=5)
    exact = (xs[0].astype(np.float64) + xs[1].astype(np.float64)).astype(dt)  # the f64 sum of two is exact
    for dims in dims_cases(P):
        got = ddlkernels.allreduce(xs[RANK], "sum", dims=dims)
        assert np.array_equal(got.view(np.uint8), exact.view(np.uint8)), f"dims={dims}"


SPECIAL_OPS = ["sum", "avg", "max", "min", "prod"]


def special_inputs(dt):
    """Rank r's input: NaN, +Inf and -Inf placed on chosen ranks, small integers elsewhere.

    Position groups (each repeated, so every chunk and block sees them):
    0 NaN on rank 0 only; 1 NaN on the last rank only; 2 +Inf on rank 0;
    3 -Inf on the last rank; 4 +Inf on rank 0 and -Inf on the last rank;
    5 +Inf on rank 0 and 0 elsewhere (prod: NaN); 6 NaN and Inf together;
    7 ordinary values.
    """
    groups = 8
    reps = 37
    i = np.arange(groups * reps)
    g = i % groups
    v = ((i * 7 + RANK * 3) % 5 + 1).astype(np.float64)  # 1..5, exact in every float type
    last = P - 1
    v[(g == 0) & (RANK == 0)] = np.nan
    v[(g == 1) & (RANK == last)] = np.nan
    v[(g == 2) & (RANK == 0)] = np.inf
    v[(g == 3) & (RANK == last)] = -np.inf
    v[(g == 4) & (RANK == 0)] = np.inf
    v[(g == 4) & (RANK == last)] = -np.inf if P > 1 else np.inf
    v[(g == 5)] = 0.0
    v[(g == 5) & (RANK == 0)] = np.inf
    v[(g == 6) & (RANK == 0)] = np.nan
    v[(g == 6) & (RANK == last)] = np.inf
    return v.astype(dt)


def numpy_reduce(stack64, op):
    with np.errstate(invalid="ignore"):  # inf - inf and 0 * inf are the point here
        return _numpy_reduce(stack64, op)


def _numpy_reduce(stack64, op):
    if op == "sum":
        return np.add.reduce(stack64, axis=0)
    if op == "avg":
        return np.add.reduce(stack64, axis=0) / P
    if op == "max":
        return np.maximum.reduce(stack64, axis=0)
    if op == "min":
        return np.minimum.reduce(stack64, axis=0)
    return np.multiply.reduce(stack64, axis=0)


@pytest.mark.sweep
@pytest.mark.parametrize("dt", FLOATS + [np.dtype(np.float64)], ids=IDS + ["float64"])
@pytest.mark.parametrize("op", SPECIAL_OPS)
def test_nan_inf_propagate_as_numpy(dt, op):
    x = special_inputs(dt)
    stack = np.stack([a.astype(np.float64) for a in COMM.allgather(x)])
    ref = numpy_reduce(stack, op)
    # Small with dims=None: MPI's own allreduce where the library uses it;
    # dims=(p,) and a tiny chunk: the ring through many chunks.
    for kw in [dict(), dict(dims=(P,), chunk_bytes=64), dict(dims=(P,), chunk_bytes=64, timeout=60)]:
        got = ddlkernels.allreduce(x, op, **kw).astype(np.float64)
        what = f"{dtype_name(dt)} {op} {kw}"
        assert np.array_equal(np.isnan(got), np.isnan(ref)), f"{what}: NaN positions differ"
        inf = np.isinf(ref)
        assert np.array_equal(np.isinf(got), inf), f"{what}: Inf positions differ"
        assert np.array_equal(got[inf], ref[inf]), f"{what}: Inf signs differ"
        fin = np.isfinite(ref)
        assert np.allclose(got[fin], ref[fin], rtol=4 * U.get(dtype_name(dt), 2.0**-53) * P, atol=0), what


def test_float16_sum_overflows_to_inf_as_numpy():
    """A partial sum beyond float16's range is +Inf, as numpy's float16 sum of the same values."""
    x = np.full(1000, 40000.0, np.float16)
    got = ddlkernels.allreduce(x, dims=(P,))
    with np.errstate(over="ignore"):  # the overflow is what is tested
        ref = np.stack([x] * P).sum(axis=0, dtype=np.float16)
    assert np.array_equal(got, ref)
    assert np.isinf(got).all() == (P > 1)
