"""What the fuzz tests share (tests/mpi/test_fuzz.py on host arrays, test_device_fuzz.py on the emulated device).

Rank 0 draws cases with hypothesis and broadcasts each (``drive``); every
rank runs it and reports what it can check alone; rank 0 checks the rest: the
result against the numpy reference (exact for integers and max/min; extended
precision and the documented error bound for float sum, avg and prod, see
``float_bound``) and the SHA-256 of every rank's result equal to its own.
Any complaint from any rank fails the example on rank 0, so hypothesis
shrinks it with the other ranks following along.
"""

from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from mpi4py import MPI

from helpers import ALL_DTYPES, rank_data, reference

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()


def factorizations(p):
    """Every ordered factorization of p into factors >= 2 ((1,) for p = 1)."""
    if p == 1:
        return [(1,)]
    out = [(p,)]
    for d in range(2, p):
        if p % d == 0:
            out += [(d,) + rest for rest in factorizations(p // d)]
    return out


def dims_choices(p):
    """Every box of p ranks, with and without size-1 dimensions, and None (the library's choice)."""
    base = factorizations(p)
    with_ones = [(1,) + base[-1], base[0] + (1,)] if p > 1 else [(1, 1)]
    return base + with_ones + [None]


def make_input(case, rank):
    """Rank ``rank``'s input for ``case`` (its n, dtype index, data kind and seed): a deterministic function of
    them, so rank 0 can rebuild every rank's input."""
    n, dt = case["n"], np.dtype(ALL_DTYPES[case["dtype"]])
    if case["data"] == "grid":
        return rank_data(n, rank, P, dt, salt=case["seed"] % 997)
    rng = np.random.default_rng([case["seed"], rank])
    if dt.kind in "iu":
        hi = 2**20 if dt.itemsize == 4 else 2**40
        return rng.integers(-hi, hi, size=n, dtype=dt)
    # Magnitudes in [0.5, 2): a product over 8 ranks stays inside float16's
    # normal range, sums of mixed signs exercise cancellation.
    mag = rng.uniform(0.5, 2.0, size=n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(dt)


_U = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}


def _gamma(k, u):
    return k * u / (1 - k * u)


def float_bound(inputs, op, dt, ref):
    """Elementwise bound on |ddlkernels - exact| for float sum/avg/prod (docs/reliability.md).

    Every pairwise op is one correct rounding to the storage type (unit
    roundoff u), p - 1 of them per element: sum  gamma(p-1) sum|x|;
    avg  that / p + gamma(3) |avg| (1/p, the product, the store); prod
    gamma(p-1) |prod| plus, for products that reach the subnormal range,
    half the smallest subnormal per rounding, magnified by at most the
    later factors (bounded by prod max(1, |x_i|)).  The reference is
    computed in x87 extended precision (64-bit significand): its own error,
    gamma(p-1) at u = 2^-64, is added so float64 data are judged fairly.
    """
    from ddlkernels._dtypes import dtype_name

    name = dtype_name(dt)
    u, g = _U[name], _gamma(P - 1, _U[name])
    stack = np.stack([a.astype(np.longdouble) for a in inputs])
    absum = np.abs(stack).sum(axis=0)
    g_ref = _gamma(P - 1, 2.0**-64)
    if op == "sum":
        return g * absum + g_ref * absum
    if op == "avg":
        return (g + g_ref) * absum / P + _gamma(3, u) * np.abs(ref)
    tiny = float(ml_finfo(dt).smallest_subnormal) / 2
    big = np.prod(np.maximum(np.abs(stack), 1), axis=0)
    return (g + g_ref) * np.abs(ref) + (P - 1) * tiny * big * (1 + g)


def ml_finfo(dt):
    from ddlkernels._dtypes import BFLOAT16

    if BFLOAT16 is not None and np.dtype(dt) == BFLOAT16:
        import ml_dtypes

        return ml_dtypes.finfo(BFLOAT16)
    return np.finfo(dt)


def check_result(y, inputs, op, dt):
    """Complaints about ``y`` (empty if right): exact for integers and max/min, within float_bound otherwise
    (or the IEEE overflow where a partial result can pass the dtype's range)."""
    from ddlkernels._dtypes import dtype_name

    dt = np.dtype(dt)
    got = np.asarray(y).reshape(-1)
    if got.shape != inputs[0].shape:
        return [f"result has shape {got.shape}, expected {inputs[0].shape}"]
    if dt.kind in "iu" or op in ("max", "min"):
        ref = reference(inputs, op, dt)
        if dt.kind in "iu":
            bad = np.nonzero(got != ref)[0]
        else:  # max/min of floats: one of the inputs, exactly
            bad = np.nonzero(got.astype(np.float64) != np.asarray(ref, dtype=np.float64))[0]
    else:
        stack = np.stack([a.astype(np.longdouble) for a in inputs])
        ref = stack.prod(axis=0) if op == "prod" else stack.sum(axis=0)
        if op == "avg":
            ref = ref / P
        err = np.abs(got.astype(np.longdouble) - ref)
        ok = err <= float_bound(inputs, op, dt, ref)
        # A partial result past the dtype's largest value rounds to inf, in whatever order the algorithm
        # combines the ranks (from 9 ranks the grid data's float16 products reach it).  Where some order's
        # partial can (a product's magnitude is at most that of the factors' max(1, |x|); a sum's positive
        # partials at most the sum of the positive terms, its negative ones likewise), IEEE's answer is inf:
        # of the product's sign (NaN where a factor is 0), of either sign that can overflow in a sum (NaN
        # where both can).
        wide, lim = got.astype(np.longdouble), float(ml_finfo(dt).max) / (1 + _gamma(P, _U[dtype_name(dt)]))
        if op == "prod":
            over = np.prod(np.maximum(np.abs(stack), 1), axis=0) >= lim
            ieee = np.where(ref == 0, np.isnan(wide), np.isinf(wide) & (np.sign(wide) == np.sign(ref)))
        else:
            up = np.where(stack > 0, stack, 0).sum(axis=0) >= lim
            down = np.where(stack < 0, -stack, 0).sum(axis=0) >= lim
            over = up | down
            ieee = ((wide == np.inf) & up) | ((wide == -np.inf) & down) | (np.isnan(wide) & up & down)
        bad = np.nonzero(~(ok | (over & ieee)))[0]
    if bad.size:
        i = int(bad[0])
        return [f"result: {bad.size} wrong elements, first at {i}: got {got[i]!r}, reference {ref[i]!r}"]
    return []


def digest(y) -> str | None:
    """The SHA-256 of ``y``'s bytes (None for no result): equal on every rank when the bits are."""
    return None if y is None else hashlib.sha256(np.ascontiguousarray(y).view(np.uint8).tobytes()).hexdigest()


def gathered(errs, digests):
    """Collective: this rank's complaints and digests (a list, one per result) to rank 0.  On rank 0 every
    rank's complaints, or if there are none, which results differ in bits from rank 0's; [] elsewhere."""
    all_errs = COMM.gather(errs, root=0)
    all_digests = COMM.gather(digests, root=0)
    if RANK != 0:
        return []
    flat = [e for es in all_errs for e in es]
    if flat:
        return flat
    for k, mine in enumerate(all_digests[0]):
        differ = [r for r, ds in enumerate(all_digests) if ds[k] != mine]
        if differ:
            flat.append(f"result {k}: ranks {differ} hold different bits than rank 0")
    return flat


def drive(cases, one_case, examples, label):
    """Run ``examples`` cases drawn from the strategy ``cases`` on every rank.

    Rank 0 draws and broadcasts; every rank calls ``one_case(case)``, a collective that returns the complaints
    (every rank's, on rank 0).  A complaint fails the example on rank 0 and hypothesis shrinks it, the other
    ranks following.  Rank 0 prints "<label>: p=P cases run=N wrong=W" (shrinking included) at the end.
    """
    if RANK != 0:
        while True:
            case = COMM.bcast(None, root=0)
            if case is None:
                return
            one_case(case)
    stats = {"run": 0, "wrong": 0}

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate, Phase.shrink], print_blob=True)
    @given(case=cases)
    def leader(case):
        COMM.bcast(case, root=0)
        errs = one_case(case)
        stats["run"] += 1
        stats["wrong"] += bool(errs)
        assert not errs, f"case {case}: " + "; ".join(errs[:8])

    try:
        leader()
    finally:
        COMM.bcast(None, root=0)
        print(f"\n{label}: p={P} cases run={stats['run']} wrong={stats['wrong']}", flush=True)
