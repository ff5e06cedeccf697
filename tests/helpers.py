"""Test data that is unique per rank and element, and the numpy reference with its error bound."""

from __future__ import annotations

import math

import numpy as np

from ddlkernels._dtypes import SUPPORTED_DTYPES, dtype_name

ALL_DTYPES = list(SUPPORTED_DTYPES)
DTYPE_IDS = [dtype_name(d) for d in ALL_DTYPES]
OPS = ["sum", "avg", "max", "min", "prod"]

# Unit roundoff of each storage type: every pairwise op rounds once to it.
_U = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}


def rank_data(n: int, rank: int, size: int, dtype, salt: int = 0) -> np.ndarray:
    """``n`` values that differ between ranks and between neighbouring elements.

    Integers are ``i * size + rank`` (globally unique), shifted to include
    negatives.  Floats are multiples of 1/16 in [-7.8, 7.8], exactly
    representable in every float type (bfloat16 included), with the element
    index and the rank both moving the value, so a chunk that lands in the
    wrong place or comes from the wrong rank changes the result.
    """
    dt = np.dtype(dtype)
    i = np.arange(n, dtype=np.int64)
    key = i * size + rank + salt * 7919
    if dt.kind in "iu":
        return (key - (n * size) // 2).astype(dt)
    vals = ((key * 37) % 251 - 125).astype(np.float64) / 16.0
    return vals.astype(dt)


def reference(arrays, op: str, dtype):
    """The exact reduction in float64 (floats) or in the dtype itself (integers, wrapping like C)."""
    dt = np.dtype(dtype)
    p = len(arrays)
    if dt.kind in "iu":
        stack = np.stack([np.asarray(a) for a in arrays])
        if op in ("sum", "avg"):
            s = stack.sum(axis=0, dtype=dt)
            return s // dt.type(p) if op == "avg" else s
        if op == "prod":
            return stack.prod(axis=0, dtype=dt)
        return stack.max(axis=0) if op == "max" else stack.min(axis=0)
    stack = np.stack([np.asarray(a).astype(np.float64) for a in arrays])
    if op in ("sum", "avg"):
        s = stack.sum(axis=0)
        return s / p if op == "avg" else s
    if op == "prod":
        return stack.prod(axis=0)
    return stack.max(axis=0) if op == "max" else stack.min(axis=0)


def bound(arrays, op: str, dtype) -> np.ndarray:
    """Elementwise error bound of ddlkernels against ``reference`` (0 = exact).

    Sum: p - 1 roundings to the storage type, each at most u times the
    partial sum, so ``|err| <= (p - 1) u sum|x_i|``; avg adds one rounding of
    the scale (``u |result|``) and the product by a rounded 1/p (another
    ``u |result|``).  Prod: ``((1 + u)^(p-1) - 1) |prod|``.  Max/min and
    integers: exact.  A final ``u |reference|`` covers rounding the float64
    reference itself to the storage type.
    """
    dt = np.dtype(dtype)
    p = len(arrays)
    if dt.kind in "iu" or op in ("max", "min"):
        return np.zeros(np.shape(arrays[0]))
    u = _U[dtype_name(dt)]
    ref = np.abs(reference(arrays, op, dtype))
    if op in ("sum", "avg"):
        s = np.sum([np.abs(np.asarray(a).astype(np.float64)) for a in arrays], axis=0)
        b = (p - 1) * u * s
        if op == "avg":
            b = b / p + 3 * u * ref
        return b + u * ref
    # (1 + u)^p - 1 without the cancellation that makes it 0 for float64; a
    # float64 reference is itself rounded p - 1 times, so it counts twice.
    grow = math.expm1(p * math.log1p(u))
    return (2 if dt == np.float64 else 1) * grow * ref + u * ref


def assert_close(result, arrays, op: str, dtype, what: str = ""):
    """``result`` equals the reference exactly (integers, max/min) or within ``bound``."""
    ref = reference(arrays, op, dtype)
    got = np.asarray(result)
    assert got.shape == np.shape(ref), f"{what}: shape {got.shape} != {np.shape(ref)}"
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        bad = np.nonzero(got.reshape(-1) != np.asarray(ref).reshape(-1))[0]
    elif op in ("max", "min"):
        bad = np.nonzero(got.astype(np.float64).reshape(-1) != np.asarray(ref).reshape(-1))[0]
    else:
        err = np.abs(got.astype(np.float64) - ref)
        bad = np.nonzero(~(err <= bound(arrays, op, dtype)).reshape(-1))[0]
    if bad.size:
        i = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.size} wrong elements, first at {i}: got {got.reshape(-1)[i]!r}, "
            f"reference {np.asarray(ref).reshape(-1)[i]!r}"
        )


def assert_same_on_all_ranks(comm, result, what: str = ""):
    """Every rank holds the very same bits."""
    raw = np.ascontiguousarray(np.asarray(result)).view(np.uint8).reshape(-1)
    digest = np.frombuffer(__import__("hashlib").sha256(raw.tobytes()).digest(), dtype=np.uint8)
    all_digests = comm.allgather(digest.tobytes())
    differ = [r for r, d in enumerate(all_digests) if d != all_digests[0]]
    assert not differ, f"{what}: ranks {differ} hold different bits than rank 0"


def node_size(p: int):
    """Ranks per made-up node (node labels, ``Communicator(node=)``) for ``p`` ranks on this one machine: the
    smallest divisor 2 <= k < p, or None where there is none (1, 2, 3, 5, 7 ranks)."""
    return next((k for k in range(2, p) if p % k == 0), None)


#: How the ranks drive GPUs on the stream emulator (``emulated_device(gpu=)``, a name per rank): each its own, all
#: one, or two dealt out round robin, as ``ddlkernels.local_device`` deals more ranks than a node has GPUs.
GPU_LAYOUTS = {"own": lambda rank: None, "one": lambda rank: "0", "two": lambda rank: str(rank % 2)}


def gpu_leaders(layout: str, p: int) -> list:
    """The lowest rank on each GPU of ``layout`` at ``p`` ranks, in rank order."""
    first = {}
    return sorted({first.setdefault(GPU_LAYOUTS[layout](q) or f"own {q}", q) for q in range(p)})


def dims_cases(p: int) -> list:
    """The boxes every MPI test sweeps: (p,), the first 2-D factorization where p allows, and None."""
    out = [(p,), None]
    for a in range(2, p):
        if p % a == 0:
            out.append((a, p // a))
            break
    return out


def parts_with_gaps(make, seed=5, count=40):
    """``(parts, packed)``: ``count`` float32 arrays ``make(n, k)`` of 0-10 elements at offsets with 0-2 element gaps.

    ``parts`` is ``[(offset, array), ...]`` as ``ddlkernels.ring.engine.Segments``
    takes it; ``packed`` the same values in one zero-filled buffer, two
    elements longer than the last part (a fusion bucket's padding).
    """
    rng = np.random.default_rng(seed)
    parts, pos = [], 0
    for k in range(count):
        pos += int(rng.integers(0, 3))
        n = int(rng.integers(0, 11))
        parts.append((pos, make(n, k)))
        pos += n
    packed = np.zeros(pos + 2, np.float32)
    for off, a in parts:
        packed[off : off + a.size] = a
    return parts, packed


def rank_order_fold(xs, op: str) -> np.ndarray:
    """``((xs[0] op xs[1]) op xs[2]) ...``, each step rounded to the storage type as the numpy backend does,
    "avg" summing and scaling by ``len(xs)`` in the last step: what the window's and CUDA IPC's folds give."""
    from ddlkernels.backends import get_backend

    be, p = get_backend("numpy"), len(xs)
    redop, avg_p = ("sum", p) if op == "avg" else (op, None)
    out = xs[0].copy()
    with np.errstate(all="ignore"):
        for q in range(1, p):
            be.reduce(redop, out, out if q > 1 else xs[0], xs[q], avg_p=avg_p if q == p - 1 else None)
    return out
