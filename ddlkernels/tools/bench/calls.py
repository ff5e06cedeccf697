"""The benchmark harness behind ``python -m ddlkernels job``/``bench`` and ``bench/*.py``: nccl-tests in spirit.

Each implementation of a collective is a small record (``Collective``, as
nccl-tests' ``struct testColl``): the factor that turns algorithm bandwidth
into bus bandwidth, how to make its input, how to run it once, how to count
wrong elements, and which algorithm ran.  The harness sweeps sizes, runs every
implementation at every size in the same process (so ratios are measured side
by side, under the same load), times iterations as the *slowest* rank sees
them (a collective is done when its last rank is), and checks every
iteration's result when asked.

Worked example (2 ranks, allreduce of N = 16 MiB float32, median t = 10 ms)::

    algbw = N / t                 = 1.68 GB/s
    busbw = algbw * 2 (p - 1) / p = 1.68 GB/s   (p = 2: factor 1)

    link: one ring step, every rank Sendrecv's N/p = 8 MiB to rank r+1 while
    receiving 8 MiB from rank r-1; median t_link = 4 ms
    link bandwidth = (N / p) / t_link = 2.10 GB/s  -> ddlkernels / link = 0.80

Why those definitions agree: a ring allreduce is 2 (p - 1) steps in each of
which every rank sends N / p bytes to its neighbour, so busbw is exactly the
rate at which one rank pushes bytes into its outgoing link, averaged over the
whole collective.  The "Sendrecv link" line measures the same quantity for a
single step with nothing else to do (no reduction, no Python between chunks):
it is the practical ceiling of a ring on this machine and MPI library.

Timing of one iteration: barrier, ``t0``, one call, ``t1``; the iteration's
time is the maximum of ``t1 - t0`` over ranks (one small allreduce, outside
the timed region).  Reported: min and median over iterations.

busbw factors (nccl-tests, doc/PERFORMANCE.md), N = total bytes of the buffer:

    allreduce        algbw = N / t      busbw = algbw * 2 (p - 1) / p
    reduce_scatter   algbw = N / t      busbw = algbw * (p - 1) / p
    allgather        algbw = N / t      busbw = algbw * (p - 1) / p
    Sendrecv link    algbw = (N/p) / t  busbw = algbw

For reduce_scatter and allgather N is rounded down to a multiple of p
elements so that ``MPI_Reduce_scatter_block``/``MPI_Allgather`` (equal
blocks) and ddlkernels (balanced shards) move the same bytes.

Checks: inputs come from ``pattern`` (small integers that move with rank and
element, so a misplaced chunk fails), expected results from ``expected``
(exact in every dtype).  After each checked iteration the output is refilled
with a sentinel, so an iteration that writes nothing is caught too.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ._dtypes import acc_dtype, check_dtype, dtype_name, normalize_op

__all__ = [
    "Collective",
    "COLLECTIVES",
    "ALLREDUCE_IMPLS",
    "TUNED_ALGORITHMS",
    "parse_size",
    "parse_dtype",
    "nccl_type_name",
    "NCCL_TYPES",
    "sweep_sizes",
    "pattern",
    "expected",
    "make_impls",
    "run_sweep",
    "format_table",
    "format_footer",
    "write_csv",
    "dump_json",
    "plot_rows",
    "tuned_label",
]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}

#: Value written into outputs after each check: outside pattern's [-8, 8] and
#: exact in every dtype, so stale or unwritten elements count as wrong.
SENTINEL = 99

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")

#: Open MPI's coll/tuned algorithm numbers, as printed by
#: ``ompi_info --param coll tuned --level 9`` (Open MPI 5.0.x); forcing one
#: needs ``OMPI_MCA_coll_tuned_use_dynamic_rules=1`` and
#: ``OMPI_MCA_coll_tuned_<collective>_algorithm=<number>`` in the environment
#: *before* MPI_Init.  bench/test_tuned_table.py checks this table against the
#: installed ompi_info.
TUNED_ALGORITHMS = {
    "allreduce": {"basic_linear": 1, "nonoverlapping": 2, "recursive_doubling": 3, "ring": 4,
                  "segmented_ring": 5, "rabenseifner": 6},
    "reduce_scatter_block": {"basic_linear": 1, "recursive_doubling": 2, "recursive_halving": 3, "butterfly": 4},
    "allgather": {"linear": 1, "bruck": 2, "recursive_doubling": 3, "ring": 4, "neighbor": 5, "two_proc": 6,
                  "sparbit": 7},
}
#: Which MPI collective (and tuned parameter) stands beside each of ours.
_TUNED_PARAM = {"allreduce": "allreduce", "reduce_scatter": "reduce_scatter_block", "allgather": "allgather"}


def parse_size(text) -> int:
    """"4K", "64M", "1G", "350MB", "123" -> bytes (binary units: K = 1024)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]?B?)\s*", str(text), re.I)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 4K, 64M, 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: int) -> str:
    """Bytes -> the shortest exact "4K"/"64M"/"123" spelling (inverse of ``parse_size``)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


#: nccl-tests' type names (``-d``, and the "type" column) of the dtypes ddlkernels reduces, in nccl-tests'
#: order; numpy's names are accepted too.  ``-d float`` is float32, as in nccl-tests (numpy: float64).
NCCL_TYPES = {"int32": "int32", "int64": "int64", "half": "float16", "float": "float32", "double": "float64",
              "bfloat16": "bfloat16"}
_TYPE_ALIASES = {"float16": "float16", "float32": "float32", "float64": "float64", "bf16": "bfloat16",
                 "fp16": "float16", "fp32": "float32", "fp64": "float64"}
#: nccl-tests types that ddlkernels does not reduce, and why (refused, never mapped to something else).
NCCL_REFUSED = {"int8": "8-bit integers", "uint8": "unsigned integers", "uint32": "unsigned integers",
                "uint64": "unsigned integers", "f8e4m3": "8-bit floats", "f8e5m2": "8-bit floats",
                "char": "8-bit integers (nccl-tests' old name of int8)",
                "int": "an ambiguous name (nccl-tests' old int32, numpy's int64): say int32 or int64"}
_NCCL_NAME = {v: k for k, v in NCCL_TYPES.items()}


def parse_dtype(name) -> np.dtype:
    """A type name -> a dtype ddlkernels reduces: nccl-tests' ("float" = float32, "half", "double",
    "bfloat16", "int32", "int64") or numpy's ("float32", "float16", ...); ``TypeError`` otherwise."""
    if not isinstance(name, str):
        return check_dtype(np.dtype(name))
    key = name.strip().lower()
    canonical = NCCL_TYPES.get(key) or _TYPE_ALIASES.get(key)
    if canonical is None:
        supported = ", ".join(f"{k} ({v})" if k != v else k for k, v in NCCL_TYPES.items())
        why = NCCL_REFUSED.get(key)
        if why is not None:
            raise TypeError(f"type {name!r}: ddlkernels does not reduce {why}; supported: {supported}")
        raise TypeError(f"unknown type {name!r}; supported: {supported} (numpy's names work too)")
    if canonical == "bfloat16":
        import ml_dtypes

        return check_dtype(np.dtype(ml_dtypes.bfloat16))
    return check_dtype(np.dtype(canonical))


def nccl_type_name(dtype) -> str:
    """The name nccl-tests prints for a dtype ("float" for float32, "half", "double", ...)."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    return _NCCL_NAME.get(name, name)


def sweep_sizes(begin: int, end: int, factor: int, step: int | None = None) -> list[int]:
    """Sizes from ``begin`` to ``end``: times ``factor`` each (``factor`` >= 2), or, as nccl-tests does
    with ``-f 1``, plus ``step`` bytes each."""
    if begin < 0 or end < begin or factor < 1 or (factor == 1 and (step is None or step < 1)):
        raise ValueError("need 0 <= begin <= end, and factor >= 2, or factor 1 with a step >= 1")
    out, s = [], begin
    while s <= end:
        out.append(s)
        s = s + step if factor == 1 else (s * factor if s else 1)
    return out


def pattern(count: int, rank: int, size: int, dtype, op: str = "sum") -> np.ndarray:
    """Input of rank ``rank``: values that move with element and rank, and reduce exactly in every type.

    Sums: integers in [-8, 8].  Products: factors from {1, -1, 2, 1/2} (integers:
    {1, -1, 2, 1}), so every partial product is a power of two, exact in
    float16 and bfloat16 for any rank count these benchmarks run.
    """
    i = np.arange(count, dtype=np.int64)
    key = i * 7 + rank * 13
    if op == "prod":
        table = np.array([1, -1, 2, 1] if np.dtype(dtype).kind in "iu" else [1, -1, 2, 0.5])
        return table[key % 4].astype(dtype)
    return (key % 17 - 8).astype(dtype)


def expected(count: int, size: int, dtype, op: str) -> np.ndarray:
    """The exact result every rank must hold, computed locally from ``pattern``.

    Partial sums of ``pattern`` are small integers, exact in every type, so
    the only rounding is avg's scale, done here as the library defines it.
    """
    dtype = np.dtype(dtype)
    stack = np.stack([pattern(count, r, size, np.float64 if dtype.kind not in "iu" else np.int64, op) for r in range(size)])
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


@dataclass
class Collective:
    """One implementation of one collective, as the harness sees it."""

    name: str
    #: busbw = algbw * bus_factor(p)
    bus_factor: Callable[[int], float]
    #: make(comm, count, dtype, op, inplace) -> state; run(state) -> None; wrong(state) -> int
    make: Callable
    run: Callable
    wrong: Callable
    #: which algorithm ran, for the table ("ring", "mpi", ...); may read state
    path: Callable = field(default=lambda state: "")
    #: bytes one call is charged for algbw, from the buffer's bytes N and p (default N)
    algbw_bytes: Callable = field(default=lambda nbytes, p: nbytes)
    #: why this implementation cannot run (dtype, op, inplace), or None; decided
    #: locally and identically on every rank, so skipping never splits the ranks
    unsupported: Callable = field(default=lambda dtype, op, inplace: None)
    #: whether the next call would still be a tuner trial (the same on every
    #: rank); warmup goes on until it is False, at most ``MAX_SETTLE`` calls
    settling: Callable = field(default=lambda state: False)


# -- shared helpers -------------------------------------------------------------


def _ar_factor(p):
    return 2.0 * (p - 1) / p if p > 1 else 1.0


def _rs_factor(p):
    return (p - 1) / p if p > 1 else 1.0


def _mpi_op(op):
    from mpi4py import MPI

    return {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[op]


def _mpi_unsupported(dtype, op, inplace):
    """MPI has no avg (we scale after a sum, as a user would) and may lack a datatype (bfloat16)."""
    from mpi4py import MPI
    from mpi4py.util.dtlib import from_numpy_dtype

    try:
        dt = from_numpy_dtype(np.dtype(dtype))
    except (ValueError, KeyError, TypeError) as exc:
        return f"no MPI datatype for {dtype_name(dtype)} ({exc})"
    if dt == MPI.DATATYPE_NULL:
        return f"no MPI datatype for {dtype_name(dtype)}"
    return None


def _scale(buf, p):
    from ._comm import _scale_inplace

    _scale_inplace(buf, p)


def _count_wrong(got, want):
    return int(np.count_nonzero(got != want))


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


# -- allreduce --------------------------------------------------------------------


def _make_ar(comm, count, dtype, op, inplace=False):
    p, r = comm.Get_size(), comm.Get_rank()
    x = _placed(pattern(count, r, p, dtype, op))
    out = _sentinels(count, dtype)
    return {"comm": comm, "x": x, "pristine": x.copy(), "out": out, "op": op,
            "inplace": inplace, "expect": expected(count, p, dtype, op)}


def _wrong_ar(st):
    got = st["x"] if st["inplace"] else st["out"]
    n = _count_wrong(got, st["expect"])
    if st["inplace"]:
        np.copyto(st["x"], st["pristine"])
    else:
        st["out"].fill(SENTINEL)
    # The input of an out-of-place call must come back untouched.
    if not st["inplace"]:
        n += _count_wrong(st["x"], st["pristine"])
    return n


def _ddl_run(st):
    if st["inplace"]:
        st["dc"].allreduce(st["x"], st["op"], out=st["x"])
    else:
        st["dc"].allreduce(st["x"], st["op"], out=st["out"])


def _ddl_settling(st):
    return st["dc"].tuning(st["x"], st["op"])


def _mpi_ar_run(st):
    from mpi4py import MPI

    op = _mpi_op(st["op"])
    if st["inplace"]:
        st["comm"].Allreduce(MPI.IN_PLACE, st["x"], op)
        buf = st["x"]
    else:
        st["comm"].Allreduce(st["x"], st["out"], op)
        buf = st["out"]
    if st["op"] == "avg":
        _scale(buf, st["comm"].Get_size())


# -- reduce_scatter ----------------------------------------------------------------


def _make_rs_common(comm, count, dtype, op):
    p, r = comm.Get_size(), comm.Get_rank()
    x = _placed(pattern(count, r, p, dtype, op))
    return {"comm": comm, "x": x, "pristine": x.copy(), "op": op, "full": expected(count, p, dtype, op)}


def _ddl_rs_run(st):
    # Into a reused output, as the MPI line does: a loop of calls allocates nothing.
    st["res"] = st["dc"].reduce_scatter(st["x"], st["op"], out=st["out"])


def _ddl_rs_wrong(st):
    got = st.pop("res", None)
    if got is not st["out"]:
        return len(st["expect"]) or 1
    n = _count_wrong(st["x"], st["pristine"]) + _count_wrong(got, st["expect"])
    st["out"].fill(SENTINEL)
    return n


def _mpi_rs_make(comm, count, dtype, op, inplace=False):
    st = _make_rs_common(comm, count, dtype, op)
    p, r = comm.Get_size(), comm.Get_rank()
    block = count // p
    st.update(block=block, inplace=inplace, expect=st["full"][r * block:(r + 1) * block])
    st["out"] = _sentinels(block, dtype)
    return st


def _mpi_rs_run(st):
    from mpi4py import MPI

    comm, op = st["comm"], _mpi_op(st["op"])
    if st["inplace"]:
        # MPI-3: with IN_PLACE the input is recvbuf and the block lands at its start.
        comm.Reduce_scatter_block(MPI.IN_PLACE, st["x"], op)
        res = st["x"][: st["block"]]
    else:
        comm.Reduce_scatter_block(st["x"], st["out"], op)
        res = st["out"]
    if st["op"] == "avg":
        _scale(res, comm.Get_size())


def _mpi_rs_wrong(st):
    if st["inplace"]:
        n = _count_wrong(st["x"][: st["block"]], st["expect"])
        np.copyto(st["x"], st["pristine"])
        return n
    n = _count_wrong(st["out"], st["expect"]) + _count_wrong(st["x"], st["pristine"])
    st["out"].fill(SENTINEL)
    return n


# -- allgather -----------------------------------------------------------------------


def _gathered(comm, count, dtype, bounds):
    """The allgather result: rank r's shard ``bounds[r]`` holds its own pattern values there."""
    p = comm.Get_size()
    full = np.empty(count, dtype=dtype)
    for r, (lo, hi) in enumerate(bounds):
        full[lo:hi] = pattern(hi, r, p, dtype)[lo:hi]
    return full


def _ddl_ag_run(st):
    # Into a reused output, as the MPI line does; its size gives the count, as after a reduce_scatter of a
    # known buffer, which spares the call the exchange of shard lengths (Communicator.allgather).
    st["res"] = st["dc"].allgather(st["shard"], out=st["out"])


def _ddl_ag_wrong(st):
    got = st.pop("res", None)
    if got is not st["out"]:
        return len(st["expect"]) or 1
    n = _count_wrong(got, st["expect"]) + _count_wrong(st["shard"], st["pristine"])
    st["out"].fill(SENTINEL)
    return n


def _mpi_ag_make(comm, count, dtype, op, inplace=False):
    p, r = comm.Get_size(), comm.Get_rank()
    block = count // p
    bounds = [(q * block, (q + 1) * block) for q in range(p)]
    full = _gathered(comm, count, dtype, bounds)
    lo, hi = bounds[r]
    shard = _placed(full[lo:hi])  # before out, as ddlkernels' line places them (run_sweep: same offsets per role)
    out = _sentinels(count, dtype)
    if inplace:
        out[lo:hi] = full[lo:hi]
    return {"comm": comm, "inplace": inplace, "shard": shard, "pristine": full[lo:hi].copy(),
            "out": out, "expect": full, "lo": lo, "hi": hi}


def _mpi_ag_run(st):
    from mpi4py import MPI

    if st["inplace"]:
        st["comm"].Allgather(MPI.IN_PLACE, st["out"])
    else:
        st["comm"].Allgather(st["shard"], st["out"])


def _mpi_ag_wrong(st):
    n = _count_wrong(st["out"], st["expect"]) + _count_wrong(st["shard"], st["pristine"])
    st["out"].fill(SENTINEL)
    if st["inplace"]:
        st["out"][st["lo"]:st["hi"]] = st["shard"]
    return n


# -- the link: one ring step -----------------------------------------------------------


def _link_make(comm, count, dtype, op, inplace=False):
    """Every rank sends N/p elements to rank r+1 and receives N/p from rank r-1: one ring step."""
    p, r = comm.Get_size(), comm.Get_rank()
    m = count // p if p > 1 else count
    send = _placed(pattern(m, r, p, dtype))
    recv = _sentinels(m, dtype)
    prev = (r - 1) % p
    # Bytes on the wire, as the engine sends them: MPI needs no datatype (bfloat16 has none).
    return {"comm": comm, "send": send, "recv": recv, "next": (r + 1) % p, "prev": prev,
            "wire": (send.view(np.uint8), recv.view(np.uint8)), "expect": pattern(m, prev, p, dtype)}


def _link_run(st):
    send, recv = st["wire"]
    st["comm"].Sendrecv(send, st["next"], 7, recv, st["prev"], 7)


def _link_wrong(st):
    n = _count_wrong(st["recv"], st["expect"])
    st["recv"].fill(SENTINEL)
    return n


#: Piece size of the chunked link: the engine's default pipeline chunk.
LINK_CHUNK_BYTES = 1 << 20


def _linkc_make(comm, count, dtype, op, inplace=False):
    st = _link_make(comm, count, dtype, op, inplace)
    n = st["wire"][0].shape[0]
    st["pieces"] = [(a, min(a + LINK_CHUNK_BYTES, n)) for a in range(0, n, LINK_CHUNK_BYTES)]
    return st


def _linkc_run(st):
    """The same ring step as a train of 1 MiB Irecv/Isend pairs, all in flight at once."""
    from mpi4py import MPI

    send, recv = st["wire"]
    comm, nxt, prv = st["comm"], st["next"], st["prev"]
    reqs = [comm.Irecv(recv[a:b], prv, 8) for a, b in st["pieces"]]
    reqs += [comm.Isend(send[a:b], nxt, 8) for a, b in st["pieces"]]
    MPI.Request.Waitall(reqs)


def _link_bytes(nbytes, p):
    return nbytes // p if p > 1 else nbytes


# -- the copy bound: what any out-of-place allreduce must move at least ------------------


def _copy_make(comm, count, dtype, op, inplace=False):
    x = _placed(pattern(count, comm.Get_rank(), comm.Get_size(), dtype))
    return {"x": x, "pristine": x.copy(), "expect": x.copy(), "out": _sentinels(count, dtype)}


def _copy_run(st):
    np.copyto(st["out"], st["x"])


def _copy_wrong(st):
    # The same reads and writes, in the same order, as an out-of-place
    # allreduce line's check (_wrong_ar), so that both start their next timed
    # call from the same cache state: a bound measured warmer would be no bound.
    n = _count_wrong(st["out"], st["expect"])
    st["out"].fill(SENTINEL)
    return n + _count_wrong(st["x"], st["pristine"])


# -- a textbook Python ring: the baseline the engine's pipelining is measured against ------


def _pyring_make(comm, count, dtype, op, inplace=False):
    st = _make_ar(comm, count, dtype, op, inplace)
    p = comm.Get_size()
    bounds = [(count * i // p, count * (i + 1) // p) for i in range(p)]
    st["bounds"] = bounds
    st["tmp"] = _placed(np.empty(max(b - a for a, b in bounds) if count else 0, dtype=dtype))
    return st


_UFUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def _pyring_run(st):
    """Flat ring, one whole block per step: p-1 Sendrecv + reduce steps, then p-1 Sendrecv steps.

    No pipelining (a step's reduction waits for its whole block), no chunking,
    a temporary for each received block: what a few lines of mpi4py give.
    """
    comm, bounds = st["comm"], st["bounds"]
    p, r = comm.Get_size(), comm.Get_rank()
    out = st["x"] if st["inplace"] else st["out"]
    if not st["inplace"]:
        np.copyto(out, st["x"])
    if p == 1:
        return
    nxt, prv = (r + 1) % p, (r - 1) % p
    wire, tmp, ufunc = out.view(np.uint8), st["tmp"], _UFUNCS[st["op"]]
    isz = out.itemsize
    for s in range(p - 1):  # reduce-scatter: rank r ends owning block r + 1
        (sa, sb), (ra, rb) = bounds[(r - s) % p], bounds[(r - s - 1) % p]
        t = tmp[: rb - ra]
        comm.Sendrecv(wire[sa * isz:sb * isz], nxt, 11, t.view(np.uint8), prv, 11)
        ufunc(out[ra:rb], t, out=out[ra:rb])
    for s in range(p - 1):  # allgather
        (sa, sb), (ra, rb) = bounds[(r + 1 - s) % p], bounds[(r - s) % p]
        comm.Sendrecv(wire[sa * isz:sb * isz], nxt, 12, wire[ra * isz:rb * isz], prv, 12)
    if st["op"] == "avg":
        _scale(out, p)


# -- the registry ------------------------------------------------------------------------


def tuned_label(kind: str, environ=None) -> str:
    """"[tuned ring]" when Open MPI's algorithm for ``kind`` is forced through the environment, else ""."""
    env = os.environ if environ is None else environ
    if env.get("OMPI_MCA_coll_tuned_use_dynamic_rules", "").lower() not in ("1", "true", "yes", "t", "y",
                                                                            "enabled"):
        return ""
    param = _TUNED_PARAM[kind]
    raw = env.get(f"OMPI_MCA_coll_tuned_{param}_algorithm", "")
    if raw in ("", "0", "ignore"):
        return ""
    names = {str(v): k for k, v in TUNED_ALGORITHMS[param].items()}
    return f"[tuned {names.get(raw, raw)}]"


_MPI_NAMES = {"allreduce": "MPI_Allreduce", "reduce_scatter": "MPI_Reduce_scatter_block",
              "allgather": "MPI_Allgather"}


class _DdlFactory:
    """One ``Communicator`` per set of options, shared by every size of a sweep (creating one is collective)."""

    def __init__(self):
        self._cache = {}

    def get(self, comm, options):
        key = (id(comm), tuple(sorted(options.items())))
        hit = self._cache.get(key)
        if hit is None:
            from ._comm import Communicator, as_communicator

            # Default options: the communicator the module-level API would use.
            hit = (Communicator(comm, **options), True) if options else (as_communicator(comm), False)
            self._cache[key] = hit
        return hit[0]

    def free(self):
        """Free the communicators made here (collective: call on every rank)."""
        for dc, ours in self._cache.values():
            if ours:
                dc.free()
        self._cache.clear()


_DDL = _DdlFactory()


def _ddl_label(options):
    if not options:
        return "ddlkernels"
    parts = []
    for k, v in sorted(options.items()):
        short = {"chunk_bytes": "chunk", "small_bytes": "small", "window": "window"}.get(k, k)
        parts.append(f"{short}={format_size(v) if k.endswith('bytes') else v}")
    return f"ddlkernels[{','.join(parts)}]"


def make_impls(kind: str, which=("ddlkernels", "mpi", "link"), ddl_options=({},), mpi_label=None):
    """The records of one collective: ddlkernels (one per option set), MPI's own, the Sendrecv link.

    ``which`` may also name "ring": for allreduce, ddlkernels with the tuner
    off and the ring at every size; "pyring": for allreduce, a textbook Python ring
    (whole-block ``Sendrecv`` steps, no pipelining) as a baseline; and
    "linkchunk": the link's ring step moved as 1 MiB Isend/Irecv pieces, all
    posted at once (the step as a chunked pipeline would see it); "copy": for
    allreduce, every rank copying its input buffer into its output (the
    memory traffic an out-of-place allreduce cannot avoid); "shared": ddlkernels on
    an input (allgather: a shard) allocated with ``Communicator.empty``, which the
    shared-memory window's peers read in place.

    ``ddl_options``: dicts of ``Communicator`` keyword arguments (e.g.
    ``{"chunk_bytes": 262144}``), one ddlkernels line each.  ``mpi_label``:
    suffix of the MPI line's name (default: the forced tuned algorithm read
    from the environment, see ``tuned_label``).
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(COLLECTIVES)}")
    label = tuned_label(kind) if mpi_label is None else mpi_label
    out = []
    if "ddlkernels" in which:
        for opts in ddl_options:
            opts = dict(opts)
            if kind == "allreduce":

                def make(comm, count, dtype, op, inplace=False, _o=opts):
                    st = _make_ar(comm, count, dtype, op, inplace)
                    st["dc"] = _DDL.get(comm, _o)
                    return st

                out.append(Collective(_ddl_label(opts), _ar_factor, make, _ddl_run, _wrong_ar,
                                      path=lambda st: st["dc"].last_algorithm or "", settling=_ddl_settling))
            elif kind == "reduce_scatter":

                def make(comm, count, dtype, op, inplace=False, _o=opts):
                    st = _make_rs_common(comm, count, dtype, op)
                    st["dc"] = dc = _DDL.get(comm, _o)
                    lo, hi = dc.shard_range(count)
                    st["expect"] = st["full"][lo:hi]
                    st["out"] = _sentinels(hi - lo, dtype)
                    return st

                out.append(Collective(_ddl_label(opts), _rs_factor, make, _ddl_rs_run, _ddl_rs_wrong,
                                      path=lambda st: st["dc"].last_algorithm or "",
                                      settling=lambda st: st["dc"].tuning(st["x"], st["op"], collective="reduce_scatter"),
                                      unsupported=lambda d, o, inplace: "no in-place reduce_scatter API"
                                      if inplace else None))
            else:

                def make(comm, count, dtype, op, inplace=False, _o=opts):
                    dc = _DDL.get(comm, _o)
                    bounds = [dc.shard_range(count, rank=q) for q in range(comm.Get_size())]
                    full = _gathered(comm, count, dtype, bounds)
                    lo, hi = bounds[comm.Get_rank()]
                    return {"dc": dc, "shard": _placed(full[lo:hi]), "pristine": full[lo:hi].copy(), "expect": full,
                            "out": _sentinels(count, dtype)}

                out.append(Collective(_ddl_label(opts), _rs_factor, make, _ddl_ag_run, _ddl_ag_wrong,
                                      path=lambda st: st["dc"].last_algorithm or "",
                                      settling=lambda st: st["dc"].tuning(st["expect"], collective="allgather"),
                                      unsupported=lambda d, o, inplace: "no in-place allgather API"
                                      if inplace else None))
    if "mpi" in which:
        name = _MPI_NAMES[kind] + label
        if kind == "allreduce":
            out.append(Collective(name, _ar_factor, _make_ar, _mpi_ar_run, _wrong_ar, unsupported=_mpi_unsupported))
        elif kind == "reduce_scatter":
            out.append(Collective(name, _rs_factor, _mpi_rs_make, _mpi_rs_run, _mpi_rs_wrong,
                                  unsupported=_mpi_unsupported))
        else:
            out.append(Collective(name, _rs_factor, _mpi_ag_make, _mpi_ag_run, _mpi_ag_wrong,
                                  unsupported=_mpi_unsupported))
    if "shared" in which:
        # ddlkernels as a user who allocates buffers with Communicator.empty
        # gets it: the input (allgather: the shard) in shared memory, which
        # peers read in place.  Its own Communicator (shm=None is the default,
        # but another key), so its tuner measures apart from the plain line's.
        def shared_copy(dc, a, count):
            buf = dc.empty(count, a.dtype)[: a.size]  # the same shape on every rank: a prefix of it
            buf[...] = a
            return buf

        def sharing(make, key, count_of):
            def make_shared(comm, count, dtype, op, inplace=False):
                st = make(comm, count, dtype, op, inplace)
                dc = st["dc"] = _DDL.get(comm, {"shm": None})
                st[key] = shared_copy(dc, st[key], count_of(dc, count))
                return st

            return make_shared

        name = "ddlkernels (shared input)"
        whole = lambda dc, count: count  # noqa: E731
        if kind == "allreduce":
            out.append(Collective(name, _ar_factor, sharing(_make_ar, "x", whole), _ddl_run, _wrong_ar,
                                  path=lambda st: st["dc"].last_algorithm or "", settling=_ddl_settling))
        else:
            plain = out[0] if out and out[0].name == "ddlkernels" else make_impls(kind, ("ddlkernels",))[0]

            def longest(dc, count):
                return max(b - a for a, b in (dc.shard_range(count, rank=q) for q in range(dc.size)))

            rs = kind == "reduce_scatter"
            out.append(Collective(name, plain.bus_factor, sharing(plain.make, "x" if rs else "shard",
                                                                  whole if rs else longest),
                                  plain.run, plain.wrong, path=plain.path, settling=plain.settling,
                                  unsupported=plain.unsupported))
    if "ring" in which and kind == "allreduce":
        # The multi-dimensional ring engine alone: a fixed small_bytes of 0 turns the tuner off.
        def make_ring(comm, count, dtype, op, inplace=False):
            st = _make_ar(comm, count, dtype, op, inplace)
            st["dc"] = _DDL.get(comm, {"small_bytes": 0})
            return st

        out.append(Collective("ddl ring", _ar_factor, make_ring, _ddl_run, _wrong_ar,
                              path=lambda st: st["dc"].last_algorithm or ""))
    if "pyring" in which and kind == "allreduce":
        out.append(Collective("python ring", _ar_factor, _pyring_make, _pyring_run, _wrong_ar,
                              path=lambda st: "sendrecv"))
    if "copy" in which and kind == "allreduce":
        # Every rank copies its N-byte input into its N-byte output, all ranks at
        # once: the memory traffic an out-of-place allreduce cannot avoid (read
        # the input, write the output), timed like a collective.  Charged as an
        # allreduce of N bytes, so its busbw is the ceiling of one that costs
        # no more than that copy.
        out.append(Collective("memcpy", _ar_factor, _copy_make, _copy_run, _copy_wrong, path=lambda st: "copy",
                              unsupported=lambda d, o, inplace: "the copy bound is out of place" if inplace else None))
    if "linkchunk" in which:
        out.append(Collective("chunked link", lambda p: 1.0, _linkc_make, _linkc_run, _link_wrong,
                              algbw_bytes=_link_bytes))
    if "link" in which:
        # The link has no placement: the same line stands beside in-place runs.
        out.append(Collective("Sendrecv link", lambda p: 1.0, _link_make, _link_run, _link_wrong,
                              algbw_bytes=_link_bytes))
    return out


def _ddl_ar_make_default(comm, count, dtype, op, inplace=False):
    st = _make_ar(comm, count, dtype, op, inplace)
    st["dc"] = _DDL.get(comm, {})
    return st


#: The two lines of ``python -m ddlkernels job`` (kept as the job's stable interface).
ALLREDUCE_IMPLS = {
    "ddlkernels": Collective("ddlkernels", _ar_factor, _ddl_ar_make_default, _ddl_run, _wrong_ar,
                             path=lambda st: st["dc"].last_algorithm or "", settling=_ddl_settling),
    "MPI_Allreduce": Collective("MPI_Allreduce", _ar_factor, _make_ar, _mpi_ar_run, _wrong_ar,
                                unsupported=_mpi_unsupported),
}


def _count_for(kind, count, p):
    # Equal MPI blocks and balanced ddlkernels shards coincide when p divides the count.
    return count if kind == "allreduce" else count - count % p


def _time_one(comm, fn, state, batch=1):
    """Seconds per call of ``batch`` back-to-back calls after a barrier, on the slowest rank (equal everywhere)."""
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(batch):
        fn(state)
    dt = (time.perf_counter() - t0) / batch
    return comm.allreduce(dt, op=MPI.MAX)


#: Most calls one timed sample may batch (``min_sample_s``).
MAX_BATCH = 1000
#: Most extra warmup calls spent letting ddlkernels' tuner settle (with three
#: candidates it needs 60 calls below 256 KiB, 48 above: ddlkernels._tuner.tuning_calls).
MAX_SETTLE = 100
#: Most times one timed sample is redone because the tuner reopened its size
#: during it (then the last one counts, whatever ran).
MAX_REDO = 3


def _progress_bar(comm, total, progress):
    if not progress or comm.Get_rank() != 0:
        return None
    if progress == "auto" and not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="sweep", unit="case", leave=False, file=sys.stderr, mininterval=0.5)


def run_sweep(comm, sizes, impls, *, dtype="float32", op="sum", iters=20, warmup=5, check=True, inplace=False,
              progress="auto", kind="allreduce", bar=None, interleave=True, min_sample_s=0.0, pages="huge"):
    """Run every implementation at every size; return a list of row dicts (same on every rank).

    Each row: ``bytes`` (of the buffer, N), ``count``, ``dtype``, ``op``,
    ``ranks``, ``inplace``, ``collective`` and ``impls[name]`` with
    ``time_us_min``/``time_us_median`` (slowest rank), ``algbw_GBps``/
    ``busbw_GBps`` (from the median), ``busbw_GBps_max`` (from the min),
    ``wrong`` (summed over ranks and iterations; None when unchecked),
    ``path`` and, when it could not run, ``skipped`` with the reason.
    ``progress``: True, False or "auto" (only on a terminal); rank 0 only.
    Warmup is one untimed call per line (its set-up), then ``warmup`` - 1
    untimed samples per line, taken as the timed ones are (interleaved or
    not, ``batch`` calls after a barrier), and more while an
    implementation's tuner is still measuring (``Collective.settling``), so
    that timed iterations run the algorithm it settled on, chosen in the
    conditions they are timed in.
    ``interleave``: time iteration i of every implementation before iteration
    i + 1 of any (default), so that load from other processes, which comes
    and goes, falls on every line alike; False runs each line's iterations
    back to back, each line's warmup just before them.
    ``min_sample_s``: a timed sample is ``batch`` calls back to back (as
    nccl-tests times its iterations), with ``batch`` the same for every line
    of a size and chosen from one untimed probe so that the fastest line's
    sample lasts about this long (at most ``MAX_BATCH``).  A 5 us call timed
    alone between barriers mostly measures the barrier's skew; 0 (default)
    times single calls.  In place, calls would compound, so samples stay
    single calls.  ``batch`` is recorded per row.
    ``pages``: "small" or "huge", the pages of every buffer the lines hand to
    their collectives (see ``PAGES``).
    """
    from mpi4py import MPI

    if pages not in PAGES:
        raise ValueError(f"pages must be one of {', '.join(PAGES)}, not {pages!r}")
    _placement["pages"] = pages
    dt = parse_dtype(dtype) if isinstance(dtype, str) else check_dtype(np.dtype(dtype))
    op = normalize_op(op)
    p = comm.Get_size()
    rows = []
    own_bar = bar is None
    if own_bar:
        bar = _progress_bar(comm, len(sizes) * len(impls), progress)
    try:
        for nbytes in sizes:
            count = _count_for(kind, nbytes // dt.itemsize, p)
            row = {"collective": kind, "bytes": count * dt.itemsize, "count": count, "dtype": dtype_name(dt),
                   "type": nccl_type_name(dt), "op": op if kind != "allgather" else "-", "ranks": p,
                   "inplace": inplace, "impls": {}}
            active = []  # [impl, state, wrong, times, redone]
            _placement["pool"] = {}  # this size's buffers (the last size's go with their lines' states)
            for impl in impls:
                why = impl.unsupported(dt, op, inplace)
                if why:
                    row["impls"][impl.name] = {"skipped": why, "wrong": None}
                    if bar is not None:
                        bar.update(1)
                    continue
                # Every line's buffers in the same memory, role by role (its input first, then its output:
                # _placed's sequence starts again and hands out the buffer the line before placed there, where
                # it holds the same bytes), so that lines differ by what they run, not by where their buffers
                # lie (see _placement).
                _placement["next"] = 0
                active.append([impl, impl.make(comm, count, dt, op, inplace), 0, [], 0])  # impl, state, wrong, times, redone
            def sample(a):
                """One sample of line ``a`` (a barrier, ``batch`` calls), then its check; its time per call."""
                t = _time_one(comm, a[0].run, a[1], batch)
                if check:  # right after its call: the next line writes the same output
                    a[2] += a[0].wrong(a[1])
                return t

            def warm(rounds, lines):
                """``rounds`` rounds of one untimed sample per line of ``lines`` in turn, then more while one's
                tuner is measuring (at most MAX_SETTLE).  Interleaved, the tuner's trials run amid the other
                lines' calls, as the timed samples of what it chose then do.  Warmed line by line, each alone,
                its trials ran with the caches only its own calls had filled: at 16 MiB, 4 ranks on 2 cores,
                they chose the window (7.6 ms a call in its trials), which then took 9.3 ms per timed sample,
                where cma, forced, took 6.9 ms (``bench/allreduce.py -b 8M -e 16M -f 2 -n 30 -w 14 --impls
                ddlkernels,ring,mpi,link,pyring,copy``, the tuner's trials printed).  ``settling`` is the same
                on every rank, so every rank runs the same rounds."""
                for k in range(rounds + MAX_SETTLE):
                    busy = k < rounds or any(a[0].settling(a[1]) for a in lines)
                    if not busy:
                        break
                    for a in lines:
                        sample(a)

            batch = 1
            first = min(warmup, 1)  # the first warmup call: each line's lazy set-up (windows, compiled loops),
            for a in active if first else ():  # out of the probe
                if bar is not None:
                    bar.set_postfix_str(f"{kind} {format_size(row['bytes'])} {a[0].name}", refresh=False)
                sample(a)
            if min_sample_s > 0 and not inplace and active:
                probe = min([sample(a) for a in active])  # one call each (batch is still 1)
                batch = int(min(MAX_BATCH, max(1, min_sample_s // max(probe, 1e-9))))
            row["batch"] = batch

            def timed(a):
                impl, st = a[0], a[1]
                for _ in range(MAX_REDO + 1):
                    t = _time_one(comm, impl.run, st, batch)
                    if check:
                        a[2] += impl.wrong(st)
                    if not impl.settling(st):
                        break
                    # The tuner measures this size again (its watch saw the calls slow
                    # down: ddlkernels._tuner): settle again untimed, amid the other
                    # lines as before, then time the sample anew, so that every timed
                    # sample runs a settled choice.  settling() is the same on every
                    # rank, so all ranks redo alike.
                    a[4] += 1
                    warm(0, active if interleave else [a])
                a[3].append(t)

            if interleave:
                # One iteration of each implementation in turn: a burst of load from
                # other processes then slows every line alike instead of one.
                warm(warmup - first, active)
                for _ in range(iters):
                    for a in active:
                        timed(a)
            else:
                for a in active:
                    warm(warmup - first, [a])
                    for _ in range(iters):
                        timed(a)
            for impl, st, wrong, times, redone in active:
                wrong = comm.allreduce(wrong, op=MPI.SUM)
                tmin, tmed = min(times), float(np.median(times))
                nb = impl.algbw_bytes(row["bytes"], p)
                algbw = nb / tmed / 1e9 if tmed > 0 else 0.0
                row["impls"][impl.name] = {
                    "time_us_min": tmin * 1e6,
                    "time_us_median": tmed * 1e6,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * impl.bus_factor(p),
                    "busbw_GBps_max": (nb / tmin / 1e9 if tmin > 0 else 0.0) * impl.bus_factor(p),
                    "wrong": int(wrong) if check else None,
                    "path": impl.path(st) + (f" (re-measured {redone}x)" if redone else ""),
                    "remeasured": redone,
                }
                if bar is not None:
                    bar.update(1)
            # Keep the table's column order: the order of ``impls``.
            row["impls"] = {i.name: row["impls"][i.name] for i in impls if i.name in row["impls"]}
            del active
            rows.append(row)
    finally:
        _placement["pool"] = None  # also when a line raises: later _placed calls get memory of their own
    if own_bar and bar is not None:
        bar.close()
    return rows


def _busbw(m, stat):
    return m["busbw_GBps"] if stat == "median" else m.get("busbw_GBps_max", m["busbw_GBps"])


def _num(value, width) -> str:
    """nccl-tests' getFloatStr: two decimals, fewer when they do not fit ``width``, else an exponent."""
    for fmt in ("{:%d.2f}", "{:%d.1f}", "{:%d.0f}"):
        text = (fmt % width).format(value)
        if len(text) <= width:
            return text
    return ("{:%d.1e}" % width if width >= 7 else "{:%d.0e}" % width).format(value)


#: nccl-tests' row: size, count, type, redop, root, then per placement time, algbw, busbw, #wrong, with its
#: widths (src/util.cu); "root" is -1 for the collectives here, as nccl-tests prints for them.
_PRE = "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}"
_BODY = "  {:>7}  {:>6}  {:>6}  {:>6}"


def format_table(rows, impls, ratio_of=None, stat="median") -> str:
    """nccl-tests' table: one row per size and line, nccl-tests' columns first, then the line and more.

        size count type redop root | time algbw busbw #wrong | line ddl/x path

    The first nine columns are nccl-tests' (its names: type "float" for
    float32, "half", "double"; redop; root -1), for the placement of the rows
    (one table per placement: both in one row, as nccl-tests prints them,
    would not fit 120 columns beside the line's name).  ``line``: the short
    name of the implementation; ``ddl/x``: busbw of ``ratio_of`` (a line
    name, or the first name of a pair or of the first pair; default: the
    first ddlkernels line) over this row's busbw; ``path``: the algorithm
    ddlkernels ran ("+": its tuner measured the size again during the timed
    iterations).  ``stat``: "median" (default) or "min" time per iteration.
    """
    names = [i.name if hasattr(i, "name") else i for i in impls]
    if isinstance(ratio_of, str):
        ref = ratio_of
    elif ratio_of:
        ref = ratio_of[0] if isinstance(ratio_of[0], str) else ratio_of[0][0]
    else:
        ref = next((n for n in names if n.startswith("ddlkernels")), None)
    labels = {n: _short(n) for n in names}
    lw = max([4] + [len(v) for v in labels.values()])
    place = "in-place" if rows and all(r.get("inplace") for r in rows) else "out-of-place"
    ratio_label = f"{_short(ref)}/x" if ref else ""
    lines = [
        ("# " + " " * 50 + f"{place:^33}").rstrip(),
        "# " + "{:>10}  {:>12}  {:>8}  {:>6}  {:>6}".format("size", "count", "type", "redop", "root")
        + _BODY.format("time", "algbw", "busbw", "#wrong") + f"  {'line':<{lw}} {ratio_label:>6} path",
        ("# " + "{:>10}  {:>12}  {:>8}  {:>6}  {:>6}".format("(B)", "(elements)", "", "", "")
         + _BODY.format("(us)", "(GB/s)", "(GB/s)", "")).rstrip(),
    ]
    remeasured = False
    for r in rows:
        pre = _PRE.format(r["bytes"], r["count"], r.get("type") or nccl_type_name(r["dtype"]), r["op"], -1)
        refm = r["impls"].get(ref) if ref else None
        for n in names:
            m = r["impls"].get(n)
            if m is None:
                continue
            if "skipped" in m:
                lines.append(pre + _BODY.format("-", "-", "-", "-") + f"  {labels[n]:<{lw}} {'':>6} skipped")
                continue
            t = m["time_us_median"] if stat == "median" else m["time_us_min"]
            bus = _busbw(m, stat)
            alg = bus / m["busbw_GBps"] * m["algbw_GBps"] if m["busbw_GBps"] else 0.0
            wrong = "N/A" if m["wrong"] is None else f"{m['wrong']:g}"
            ratio = ""
            if n != ref and refm and "skipped" not in refm:
                ratio = _num(_busbw(refm, stat) / bus, 6) if bus else "inf"
            path = str(m.get("path") or "").split(" (re-measured")[0]
            if m.get("remeasured"):
                path += "+"
                remeasured = True
            lines.append((pre + _BODY.format(_num(t, 7), _num(alg, 6), _num(bus, 6), wrong)
                          + f"  {labels[n]:<{lw}} {ratio:>6} {path}").rstrip())
    legend = ", ".join(f"{v} = {k}" for k, v in labels.items() if k != v)
    if legend:
        import textwrap

        lines += textwrap.wrap(legend, 120, initial_indent="# lines: ", subsequent_indent="#   ")
    if remeasured:
        lines.append("# path+: the tuner measured the size again during the timed iterations (JSON: remeasured)")
    skipped = {(n, r["impls"][n]["skipped"]) for r in rows for n in names if "skipped" in r["impls"].get(n, {})}
    for n, why in sorted(skipped):
        lines.append(f"# {n} skipped: {why}")
    return "\n".join(lines)


def comment(text, width=120) -> str:
    """``text`` as "# " lines of at most ``width`` columns (continuations indented)."""
    import textwrap

    return "\n".join(textwrap.wrap(text, width, initial_indent="# ", subsequent_indent="#   ",
                                    break_on_hyphens=False))


def average_busbw(rows, name, stat="median"):
    """Mean busbw of line ``name`` over every row it ran in (nccl-tests' "Avg bus bandwidth"), or None."""
    vals = [_busbw(r["impls"][name], stat) for r in rows if "skipped" not in r["impls"].get(name, {"skipped": 1})]
    return sum(vals) / len(vals) if vals else None


def format_footer(rows, names, stat="median") -> str:
    """nccl-tests' closing lines: out-of-bounds (wrong) values and the average bus bandwidth.

    "# Avg bus bandwidth" is the first ddlkernels line's, averaged over every
    row (sizes, types, ops and placements alike, as nccl-tests averages
    everything it ran), so scripts that read nccl-tests' line read ours; the
    other lines' averages follow in lines of their own wording.
    """
    wrong = sum((r["impls"][n].get("wrong") or 0) for r in rows for n in names if n in r["impls"])
    checked = any(r["impls"][n].get("wrong") is not None for r in rows for n in names if n in r["impls"])
    lines = [f"# {'Out of bounds values':<20} : {wrong} {('FAILED' if wrong else 'OK') if checked else 'N/A'}"]
    main = next((n for n in names if n.startswith("ddlkernels")), names[0] if names else None)
    avg = average_busbw(rows, main, stat) if main else None
    if avg is not None:
        lines.append(f"# {'Avg bus bandwidth':<20} : {avg:g}")
    for n in names:
        a = average_busbw(rows, n, stat)
        if n != main and a is not None:
            lines.append(f"#   {n}: average bus bandwidth {a:g} GB/s")
    return "\n".join(lines)


CSV_COLUMNS = ("collective", "line", "size", "count", "type", "redop", "root", "placement", "time_us", "algbw_GBps",
               "busbw_GBps", "wrong", "path")


def write_csv(out, rows, names, stat="median") -> None:
    """One CSV record per row and line (columns ``CSV_COLUMNS``) to the text stream ``out``."""
    import csv

    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in rows:
        for n in names:
            m = r["impls"].get(n)
            if m is None or "skipped" in m:
                continue
            t = m["time_us_median"] if stat == "median" else m["time_us_min"]
            bus = _busbw(m, stat)
            alg = bus / m["busbw_GBps"] * m["algbw_GBps"] if m["busbw_GBps"] else 0.0
            w.writerow([r.get("collective", "allreduce"), n, r["bytes"], r["count"],
                        r.get("type") or nccl_type_name(r["dtype"]), r["op"], -1,
                        "in-place" if r.get("inplace") else "out-of-place", f"{t:.3f}", f"{alg:.6g}", f"{bus:.6g}",
                        "" if m["wrong"] is None else m["wrong"], m.get("path") or ""])


def _short(name):
    """Column label: "ddl", "ddl[chunk=256K]", "MPI", "MPI[ring]", "link"."""
    if name.startswith("ddlkernels") and not name.endswith("(shared input)"):
        return "ddl" + name[len("ddlkernels"):]
    if name.startswith("MPI_"):
        rest = name.split("[", 1)
        return "MPI" + ("[" + rest[1].replace("tuned ", "") if len(rest) > 1 else "")
    return {"Sendrecv link": "link", "python ring": "pyring", "chunked link": "clink", "ddl ring": "ring",
            "memcpy": "copy", "ddlkernels (shared input)": "shared"}.get(name, name)


def dump_json(path, meta, rows):
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def plot_rows(path, rows, title="", stat="median"):
    """PNG of busbw vs message size, one line per implementation, one panel per (collective, dtype, op, in place).

    Every implementation of a panel was measured in the same run; the x axis is
    the buffer's bytes N (log 2), the y axis busbw in GB/s (see the module
    docstring for the Sendrecv link's definition).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict = {}
    for r in rows:
        key = (r.get("collective", "allreduce"), r["dtype"], r["op"], r["inplace"])
        groups.setdefault(key, []).append(r)
    n = len(groups)
    cols = 1 if n == 1 else 2
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(7.5 * cols, 4.8 * nrows), squeeze=False)
    styles = {"Sendrecv link": dict(color="black", linestyle="--", marker="")}
    for ax, (key, grp) in zip(axes.flat, groups.items()):
        grp = sorted(grp, key=lambda r: r["bytes"])
        names = []
        for r in grp:
            for name in r["impls"]:
                if name not in names:
                    names.append(name)
        for name in names:
            pts = [(r["bytes"], _busbw(r["impls"][name], stat)) for r in grp
                   if name in r["impls"] and "skipped" not in r["impls"][name] and r["bytes"] > 0]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=name, **styles.get(name, dict(marker="o", markersize=3)))
        coll, dt, op, inplace = key
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size N (bytes)")
        ax.set_ylabel(f"busbw (GB/s, {stat} time)")
        ax.set_title(f"{coll} {dt} {op} {'in place' if inplace else 'out of place'}", fontsize=10)
        ticks = [r["bytes"] for r in grp if r["bytes"] > 0]
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_size(t) for t in ticks], rotation=45, fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
