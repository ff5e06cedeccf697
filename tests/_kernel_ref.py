"""Shared by the kernel tests and bench/kernels/kernel_report.py: inputs, reference, comparison.

The reference is ddlkernels' numpy backend itself (``NumpyBackend.reduce``):
the contract of every backend is "the same bits as the numpy backend for the
same inputs" (``ddlkernels/backends/__init__.py``).

Inputs are unique per element and seed, and the first ``len(SPECIALS)**2``
elements of a float pair (a, b) hold every ordered pair of special values
(NaN, +-0, +-inf, a subnormal, ...), so NaN propagation, operand order and the
sign of a zero tie are checked, on the vector path and the scalar tail alike.
"""

from __future__ import annotations

import numpy as np

from ddlkernels._dtypes import BFLOAT16, acc_dtype
from ddlkernels.backends._numpy import NumpyBackend

__all__ = ["DTYPES", "SUFFIX", "OPS", "make_pair", "reference", "chain", "compare", "kernel_arg", "bits_view"]

#: Storage dtypes in kernel-suffix order.
DTYPES = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))
SUFFIX = {DTYPES[0]: "f16", DTYPES[1]: "bf16", DTYPES[2]: "f32", DTYPES[3]: "f64", DTYPES[4]: "i32", DTYPES[5]: "i64"}
#: Kernel op names: "avg" is the sum with the fused scale.
OPS = ("sum", "prod", "max", "min", "avg")

_FLOAT_SPECIALS = (np.nan, -0.0, 0.0, np.inf, -np.inf, 1.5, -2.0, 1e-40)


def bits_view(x: np.ndarray) -> np.ndarray:
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _floats(n, dtype, seed):
    i = np.arange(n, dtype=np.float64)
    # distinct magnitudes, alternating signs, a seed-dependent offset
    x = (i * 0.731 + 0.125 + seed * 0.0171) * np.where(i % 2 == 0, 1.0, -1.0)
    x = x * (1.0 + seed) / 7.0
    return x


def make_pair(dtype, n: int, seed: int = 0, op: str = "sum"):
    """Two arrays (a, b) of ``n`` elements of ``dtype``, unique per element and seed."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" or dtype == BFLOAT16:
        a = _floats(n, dtype, seed)
        b = _floats(n, dtype, seed + 1)[::-1].copy()
        if op == "prod":  # stay mostly finite in half precision
            a = np.sign(a) * (1.0 + np.abs(a) % 3.0)
            b = np.sign(b) * (0.5 + np.abs(b) % 2.0)
        k = len(_FLOAT_SPECIALS)
        m = min(n, k * k)
        idx = np.arange(m)
        a[:m] = np.array(_FLOAT_SPECIALS)[idx // k]
        b[:m] = np.array(_FLOAT_SPECIALS)[idx % k]
        with np.errstate(all="ignore"):
            return a.astype(dtype), b.astype(dtype)
    info = np.iinfo(dtype)
    i = np.arange(n, dtype=np.uint64)
    # a multiplicative hash spreads the values over every bit (both signs)
    mix = (i + np.uint64(977 * (seed + 1))) * np.uint64(0x9E3779B97F4A7C15)
    mix ^= mix >> np.uint64(29)
    a = mix.astype(dtype.str.replace("i", "u")).view(dtype).copy()
    b = (mix * np.uint64(40503) + np.uint64(seed)).astype(dtype.str.replace("i", "u")).view(dtype).copy()
    specials = np.array([info.min, info.max, -1, 0, 1, -7, 7], dtype=dtype)
    k = len(specials)
    m = min(n, k * k)
    idx = np.arange(m)
    a[:m] = specials[idx // k]
    b[:m] = specials[idx % k]
    if op == "avg":
        # keep some sums small and negative so floor division is exercised on
        # both sides of zero, the rest wrap
        a[m::3] //= 1 << 20
        b[m::3] //= 1 << 20
    return a, b


def kernel_arg(dtype, op: str, p: int) -> float:
    """The kernels' last argument: 1/p in the accumulation type (floats) or p (ints)."""
    dtype = np.dtype(dtype)
    if op != "avg":
        return 0.0
    if dtype.kind in "iu":
        return p
    return float(acc_dtype(dtype).type(1.0 / p))


def reference(op: str, a, b, p: int, dst=None):
    """numpy backend: ``op(a, b)`` ("avg" -> sum with ``avg_p=p``) into a new array (or ``dst``)."""
    out = np.empty_like(a) if dst is None else dst
    with np.errstate(all="ignore"):
        if op == "avg":
            NumpyBackend().reduce("sum", out, a, b, avg_p=p)
        else:
            NumpyBackend().reduce(op, out, a, b)
    return out


def chain(op: str, ops):
    """What a fold of ``ops`` must give (kernels/reduce.cu's ddl_fold, ``reduce_many``): the numpy backend's
    chain of pairwise steps in order ("avg": sums, scaled by 1 / len(ops) in the last step)."""
    k, ref = len(ops), ops[0].copy()
    for j in range(1, k):
        reference(op if op != "avg" or j == k - 1 else "sum", ref, ops[j], k, dst=ref)
    return ref


def compare(got: np.ndarray, ref: np.ndarray, op: str):
    """(ok, max_abs_error, first_bad_index): bitwise equality, NaN payloads excepted for arithmetic.

    max/min select one operand, so their NaNs keep their bits and are compared
    bitwise; sum/prod/avg NaNs are compared as NaNs (a GPU produces the
    canonical NaN where x86 keeps an operand's payload).
    """
    gb, rb = bits_view(got), bits_view(ref)
    same = gb == rb
    if ref.dtype.kind == "f" or ref.dtype == BFLOAT16:
        g64, r64 = got.astype(np.float64), ref.astype(np.float64)
        if op not in ("max", "min"):
            same |= np.isnan(g64) & np.isnan(r64)
        with np.errstate(all="ignore"):
            diff = np.abs(g64 - r64)
        diff[np.isnan(g64) & np.isnan(r64)] = 0.0
        diff[np.isinf(g64) & (g64 == r64)] = 0.0
        diff[~same & (diff == 0)] = np.inf  # e.g. +0 vs -0, NaN vs number: a real mismatch
        err = float(diff[~same].max()) if (~same).any() else 0.0
    else:
        diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
        err = float(diff.max()) if diff.size else 0.0
    bad = np.flatnonzero(~same)
    return (bad.size == 0, err, int(bad[0]) if bad.size else -1)
