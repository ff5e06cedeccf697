"""Fuzz: hypothesis draws collectives and ddlkernels must match numpy on every rank, bitwise alike.

Rank 0 runs hypothesis; each drawn case is broadcast, every rank runs it and
checks what it can alone (no exception, input untouched out of place, its
shard equal to its slice of the gathered whole), and rank 0 checks the rest:
the result against the numpy reference (exact for integers and max/min;
extended precision and the documented error bound for float sum, avg and
prod, see ``float_bound``) and the SHA-256 of every rank's result equal to
its own.  Any complaint from any rank fails the example on rank 0, so
hypothesis shrinks it with the other ranks following along.

The space: the job's size p (run the file under mpirun -n 1..8), n in
0 .. 10^6 biased to the edges (0, 1, p - 1, p, p + 1, primes, chunk and
block boundaries), every dtype and op, dims = every ordered factorization
of p (with and without size-1 dimensions) or None, chunk sizes from 1 byte
to 1 MiB, in place or out of place, the collective (allreduce,
reduce_scatter + allgather, mpi4py-shaped Allreduce), three Communicators
(default; ring only with 1 and 2 receive slots), validate and timeout on or
off, and two kinds of data (a grid unique per rank and element, random).

Short run by default (CI); the long run sets the number of examples:

    DDLKERNELS_FUZZ_EXAMPLES=1500 mpirun -n 5 python -m mpi4py tests/_mpi_pytest.py tests/mpi/test_fuzz.py

and the last line of rank 0's output counts cases run and wrong.
"""

import hashlib
import math
import os

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import ddlkernels
from helpers import ALL_DTYPES, OPS, reference

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
EXAMPLES = int(os.environ.get("DDLKERNELS_FUZZ_EXAMPLES", "25"))
# Messages per call are capped so that a 1-byte chunk on a 10^6-element
# buffer stays a test of the chunk logic rather than of patience.
MAX_CHUNKS = 2048


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
    base = factorizations(p)
    with_ones = [(1,) + base[-1], base[0] + (1,)] if p > 1 else [(1, 1)]
    return base + with_ones + [None]


def edge_sizes(p):
    primes = [2, 3, 5, 7, 13, 31, 127, 257, 4099, 65537, 999_983]
    edges = {0, 1, p - 1, p, p + 1, 2 * p - 1, 2 * p + 1, p * p + 1, 1 << 16, (1 << 16) + 1, 10**6}
    # Around the default chunk (1 MiB of float32) and the small-message threshold (64 KiB).
    edges |= {(1 << 18) - 1, (1 << 18) + 1, (1 << 14) - 1, (1 << 14) + 1}
    return sorted(e for e in edges | set(primes) if 0 <= e <= 10**6)


COLLECTIVES = ["allreduce", "rs+ag", "Allreduce"]
CHUNKS = [None, 1, 2, 6, 64, 1000, 4096, 65536, 1 << 20]

cases = st.fixed_dictionaries(
    {
        "n": st.one_of(
            st.sampled_from(edge_sizes(P)), st.integers(0, 64), st.integers(0, 5000), st.integers(0, 10**6)
        ),
        "dtype": st.sampled_from(range(len(ALL_DTYPES))),
        "op": st.sampled_from(OPS),
        "dims": st.sampled_from(dims_choices(P)),
        "chunk_bytes": st.sampled_from(CHUNKS),
        "inplace": st.booleans(),
        "collective": st.sampled_from(COLLECTIVES),
        "comm": st.sampled_from([0, 1, 2]),
        "data": st.sampled_from(["grid", "random"]),
        "seed": st.integers(0, 2**31 - 1),
        "validate": st.booleans(),
        "timeout": st.sampled_from([None, 300.0]),
    }
)

_COMMS = []


def communicators():
    if not _COMMS:
        _COMMS.append(ddlkernels.Communicator(COMM))
        _COMMS.append(ddlkernels.Communicator(COMM, small_bytes=0, window=1))
        _COMMS.append(ddlkernels.Communicator(COMM, small_bytes=0, window=2))
    return _COMMS


def normalize(case):
    """Clamp the chunk so that a call sends at most about MAX_CHUNKS messages."""
    dt = ALL_DTYPES[case["dtype"]]
    nbytes = case["n"] * np.dtype(dt).itemsize
    cb = case["chunk_bytes"]
    if cb is not None:
        case["chunk_bytes"] = max(cb, math.ceil(nbytes / MAX_CHUNKS))
    return case


def make_input(case, rank):
    """Rank ``rank``'s input: a deterministic function of the case, so rank 0 can rebuild every input."""
    n, dt = case["n"], np.dtype(ALL_DTYPES[case["dtype"]])
    if case["data"] == "grid":
        from helpers import rank_data

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


def run_case(case):
    """Run ``case`` on this rank; return (complaints, result or None)."""
    x = make_input(case, RANK)
    keep = x.copy()
    comm = communicators()[case["comm"]]
    op, dims, cb = case["op"], case["dims"], case["chunk_bytes"]
    kw = dict(validate=case["validate"], timeout=case["timeout"])
    errs = []
    try:
        if case["collective"] == "allreduce":
            if case["inplace"]:
                y = x.copy()
                r = comm.allreduce(y, op, out=y, dims=dims, chunk_bytes=cb, **kw)
                if r is not y:
                    errs.append("in-place allreduce did not return out")
            else:
                y = comm.allreduce(x, op, dims=dims, chunk_bytes=cb, **kw)
        elif case["collective"] == "Allreduce":
            mpi_op = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}.get(op, op)
            # Allreduce has no dims/chunk arguments: the Communicator's defaults apply.
            if case["inplace"]:
                y = x.copy()
                comm.Allreduce(MPI.IN_PLACE, y, mpi_op, **kw)
            else:
                y = np.full_like(x, 3)
                comm.Allreduce(x, y, mpi_op, **kw)
        else:
            shard = comm.reduce_scatter(x, op, dims=dims, chunk_bytes=cb, **kw)
            y = comm.allgather(shard, dims=dims, chunk_bytes=cb, **kw)
            lo, hi = comm.shard_range(case["n"], dims)
            if shard.shape != (hi - lo,) or not np.array_equal(shard.view(np.uint8), y[lo:hi].view(np.uint8)):
                errs.append(f"rank {RANK}: shard differs from its slice [{lo}, {hi}) of the allgather")
    except Exception as e:  # reported, so that rank 0 fails the example instead of this rank alone
        return [f"rank {RANK}: {type(e).__name__}: {e}"], None
    if not np.array_equal(x.view(np.uint8), keep.view(np.uint8)):
        errs.append(f"rank {RANK}: input modified")
    return errs, y


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
    """Complaints about ``y`` (empty if right): exact for integers and max/min, within float_bound otherwise."""
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
        bad = np.nonzero(~(err <= float_bound(inputs, op, dt, ref)))[0]
    if bad.size:
        i = int(bad[0])
        return [f"result: {bad.size} wrong elements, first at {i}: got {got[i]!r}, reference {ref[i]!r}"]
    return []


def check_on_root(case, results_digest, y):
    """Rank 0: reference and identical bits everywhere."""
    errs = []
    if any(d != results_digest[0] for d in results_digest):
        differ = [r for r, d in enumerate(results_digest) if d != results_digest[0]]
        errs.append(f"ranks {differ} hold different bits than rank 0")
    if y is not None:
        dt = ALL_DTYPES[case["dtype"]]
        inputs = [make_input(case, r) for r in range(P)]
        errs += check_result(y, inputs, case["op"], dt)
    return errs


STATS = {"run": 0, "wrong": 0}


def one_case(case):
    """Collective: every rank runs ``case``; returns the complaints (on rank 0, all of them)."""
    errs, y = run_case(case)
    digest = None if y is None else hashlib.sha256(np.ascontiguousarray(y).view(np.uint8).tobytes()).hexdigest()
    all_errs = COMM.gather(errs, root=0)
    digests = COMM.gather(digest, root=0)
    if RANK != 0:
        return []
    flat = [e for es in all_errs for e in es]
    if not flat:
        flat = check_on_root(case, digests, y)
    return flat


def follower():
    while True:
        case = COMM.bcast(None, root=0)
        if case is None:
            return
        one_case(case)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.generate, Phase.shrink],
    print_blob=True,
)
@given(case=cases)
def leader(case):
    case = normalize(dict(case))
    COMM.bcast(case, root=0)
    errs = one_case(case)
    STATS["run"] += 1
    if errs:
        STATS["wrong"] += 1
    assert not errs, f"case {case}: " + "; ".join(errs[:8])


def test_fuzz_collectives():
    communicators()  # collective: created by all ranks before rank 0 starts drawing
    if RANK != 0:
        follower()
        return
    try:
        leader()
    finally:
        COMM.bcast(None, root=0)
        # The count (shrinking included) for the long run's report.
        print(f"\nfuzz: p={P} cases run={STATS['run']} wrong={STATS['wrong']}", flush=True)


def test_factorizations_are_complete():
    assert sorted(factorizations(12)) == sorted(
        [(12,), (2, 6), (6, 2), (3, 4), (4, 3), (2, 2, 3), (2, 3, 2), (3, 2, 2)]
    )
    assert factorizations(7) == [(7,)]
    for dims in dims_choices(P):
        assert dims is None or math.prod(dims) == P
