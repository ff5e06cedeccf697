"""What a line's buffers hold and where they lie: inputs, exact results, and memory of their own.

Worked example (2 ranks, allreduce sum of 4 float32)::

    pattern(4, 0, 2, "float32")        -> [-8, -1,  6,  -4]    ((7 i + 13 rank) % 17) - 8
    pattern(4, 1, 2, "float32")        -> [ 5, -5,  2,  -8]
    expected(4, 2, "float32", "sum")   -> [-3, -6,  8, -12]    what every rank must hold, exactly
    _sentinels(4, "float32")           -> [99, 99, 99,  99]    an output: elements left unwritten count as wrong

Every buffer a line hands to its collective is a copy in a mapping of its own, on the pages
``run_sweep(pages=)`` asks for, and the lines of one size share their buffers role by role (why: the
comment above ``PAGES``).
"""

from __future__ import annotations

import mmap

import numpy as np

from ..._dtypes import acc_dtype


#: Value written into outputs after each check: outside pattern's [-8, 8] and
#: exact in every dtype, so stale or unwritten elements count as wrong.
SENTINEL = 99


#: pattern's values repeat every 17 elements (sums) and every 4 (products): every 68 for both, so both
#: functions compute one period and repeat it (an expected() of 64 Mi elements on 4 ranks took 11 s).
_PERIOD = 68


def _periodic(count: int, one_period) -> np.ndarray:
    """``one_period(m)`` (the first ``m`` elements) repeated to ``count`` elements (by doubling: about two
    copies of the result)."""
    head = one_period(min(count, _PERIOD))
    if count <= _PERIOD:
        return head
    out = np.empty(count, head.dtype)
    out[:_PERIOD] = head
    filled = _PERIOD  # always a whole number of periods: every copy starts on a period's first element
    while filled < count:
        k = min(filled, count - filled)
        out[filled:filled + k] = out[:k]
        filled += k
    return out


def pattern(count: int, rank: int, size: int, dtype, op: str = "sum") -> np.ndarray:
    """Input of rank ``rank``: values that move with element and rank, and reduce exactly in every type.

    Sums: integers in [-8, 8].  Products: factors from {1, -1, 2, 1/2} (integers:
    {1, -1, 2, 1}), so every partial product is a power of two, exact in
    float16 and bfloat16 for any rank count these benchmarks run.
    """
    def one_period(m):
        key = np.arange(m, dtype=np.int64) * 7 + rank * 13
        if op == "prod":
            table = np.array([1, -1, 2, 1] if np.dtype(dtype).kind in "iu" else [1, -1, 2, 0.5])
            return table[key % 4].astype(dtype)
        return (key % 17 - 8).astype(dtype)

    return _periodic(count, one_period)


def expected(count: int, size: int, dtype, op: str) -> np.ndarray:
    """The exact result every rank must hold, computed locally from ``pattern``.

    Partial sums of ``pattern`` are small integers, exact in every type, so
    the only rounding is avg's scale, done here as the library defines it.
    """
    dtype = np.dtype(dtype)

    def one_period(m):
        stack = np.stack([pattern(m, r, size, np.float64 if dtype.kind not in "iu" else np.int64, op)
                          for r in range(size)])
        if op in ("sum", "avg"):
            res = stack.sum(axis=0)
        elif op == "prod":
            res = stack.prod(axis=0)
        else:
            res = stack.max(axis=0) if op == "max" else stack.min(axis=0)
        res = res.astype(dtype)
        if op == "avg":
            if dtype.kind in "iu":
                res = res // dtype.type(size)
            else:
                acc = acc_dtype(dtype)
                res = (res.astype(acc) * acc.type(1.0 / size)).astype(dtype)
        return res

    return _periodic(count, one_period)


#: Every buffer a line hands to its collective lies in memory of its own, on
#: pages of one kind for every line (``_placed``; ``run_sweep(pages=)``,
#: ``--pages``).  numpy asks for huge pages on allocations from 4 MiB
#: (``madvise``), which back only the 2 MiB-aligned stretches inside them, so
#: how much of a buffer they backed hung on where malloc put it -- and with it
#: the cost of every copy through it, most of all MPI's copy between
#: processes, which pins the peer's pages.  Two lines running the same MPI call
#: differed by a third by which line's buffers landed where: ``mpirun -n 2
#: python bench/allreduce.py -c reduce_scatter,allgather -b 4M -e 16M -f 4 -n
#: 30 -w 14 --small-bytes 1G`` (ddlkernels running MPI's call beside MPI's own
#: line) measured 0.70-0.76 for reduce_scatter at 4 MiB in four runs; with
#: huge pages off for the whole machine both lines ran alike.  "huge" (the
#: default) maps every buffer ``MADV_HUGEPAGE`` from a 2 MiB boundary: the
#: pages numpy asks for on a large array, and those MPI's copy between
#: processes and the Sendrecv link run fastest on (``mpirun -n 2 python
#: bench/allreduce.py -b 4M -e 64M -f 4 -n 20 -w 10 --impls
#: ddlkernels,mpi,link,copy --pages small|huge``, alternated twice: the link
#: took 179-184 / 1220-1235 / 4445-4476 us at 4 / 16 / 64 MiB on small pages,
#: 63-66 / 675-691 / 1977-3042 on huge ones), so that the peers are measured
#: at their best.  "small" maps it ``MADV_NOHUGEPAGE``.  Huge buffers start
#: past the boundary by a few KiB and cache
#: lines further in than the last, so that two buffers of a line do not
#: start on the same cache sets (tried with every buffer exactly on a 2 MiB
#: boundary: MPI's reduce_scatter at 16 MiB ran several times slower, with
#: huge pages and without).
#:
#: And every line of a size runs on the same buffers: ``run_sweep`` restarts
#: the sequence of offsets for each line, and ``_placed`` hands a line the
#: buffer the line before placed in the same role (its n-th) when it holds
#: the same bytes (``_placement["pool"]``, emptied per size; None outside
#: ``run_sweep``, where every call places a buffer of its own).  With a buffer
#: of their own each, two lines running the same MPI call still differed by
#: 2x, whichever line ran first, and differently from one run to the next
#: (not by their offsets: also so with every line's at the same ones; the
#: cause is not known): ``mpirun -n 2 python bench/allreduce.py
#: -c allgather -b 256K -e 16M -f 4 -n 30 -w 14 --small-bytes 1G --impls
#: ddlkernels,mpi`` (and ``-c allreduce``, ``--place in``) measured
#: ddlkernels (MPI's call) / MPI 0.45-0.48 for the allgather at 256 KiB-1
#: MiB in four runs, 0.49-0.59 in place, 0.54 once out of place at 1 MiB;
#: on shared buffers 0.94-1.01 everywhere in two runs each.
PAGES = ("small", "huge")
_HUGE = 2 << 20
_placement = {"pages": "huge", "next": 0, "pool": None}


def _placed(a):
    """A copy of ``a`` in an anonymous mapping of its own, on the pages ``run_sweep`` set (see above) -- or the
    buffer an earlier line of this size placed in the same role (``_placement["pool"]``, in ``run_sweep``)
    when it holds the same bytes."""
    if a.nbytes == 0:
        return a.copy()
    k = _placement["next"] = (_placement["next"] + 1) % 32
    key = (k, a.dtype.str, a.shape)
    pool = _placement["pool"]
    hit = None if pool is None else pool.get(key)
    if hit is not None and hit.tobytes() == a.tobytes():  # tobytes: C order whatever the layout
        return hit
    if _placement["pages"] == "huge":
        at = k * (4096 + 64)
        m = _anonymous(a.nbytes + _HUGE + at)
        start = -_address(m) % _HUGE + at
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)
    else:
        m, start = _anonymous(a.nbytes), 0
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere the mapping is what the system gives
            m.madvise(mmap.MADV_NOHUGEPAGE)
    out = np.frombuffer(m, dtype=np.uint8, count=a.nbytes, offset=start).view(a.dtype).reshape(a.shape)
    out[...] = a
    if pool is not None:
        pool[key] = out
    return out


def _anonymous(nbytes):
    """``nbytes`` of private anonymous memory, as a numpy array's own would be.

    ``mmap.mmap(-1, n)`` alone maps MAP_SHARED: shmem pages, which take no
    transparent huge pages unless the machine's shmem setting allows them
    (``/sys/kernel/mm/transparent_hugepage/shmem_enabled``, "never" here), so
    ``MADV_HUGEPAGE`` on them did nothing.
    """
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, nbytes)


def _address(m):
    """Where the mapping ``m`` starts."""
    return np.frombuffer(m, dtype=np.uint8, count=1).ctypes.data


def _sentinels(count, dtype):
    """``count`` SENTINELs of ``dtype``, placed (``_placed``): an output buffer."""
    return _placed(np.full(count, SENTINEL, dtype=dtype))
