"""The benchmark harness behind ``python -m ddlkernels job`` and ``bench/``: nccl-tests in spirit.

Each collective is a small record (``Collective``): how many bytes a call
moves, the factor that turns algorithm bandwidth into bus bandwidth, how to
make its input, how to run it once, and how to count wrong elements.  The
harness sweeps sizes, runs every implementation at every size in the same
process (so ratios are measured side by side), times iterations as the
*slowest* rank sees them (a collective is done when its last rank is), and
checks every iteration's result when asked.

Timing of one iteration: barrier, ``t0``, one call, ``t1``; the iteration's
time is the maximum of ``t1 - t0`` over ranks (one small allreduce, outside
the timed region).  Reported: min and median over iterations.

busbw (nccl-tests, doc/PERFORMANCE.md): algbw = bytes / time; for allreduce
busbw = algbw * 2 (p - 1) / p, comparable to a link's bandwidth whatever p is.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ._dtypes import acc_dtype, check_dtype, dtype_name, normalize_op

__all__ = ["Collective", "parse_size", "sweep_sizes", "run_sweep", "format_table", "ALLREDUCE_IMPLS"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}


def parse_size(text) -> int:
    """"4K", "64M", "1G", "350MB", "123" -> bytes (binary units: K = 1024)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]?B?)\s*", str(text), re.I)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 4K, 64M, 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def sweep_sizes(begin: int, end: int, factor: int) -> list[int]:
    if begin < 0 or end < begin or factor < 2:
        raise ValueError("need 0 <= begin <= end and factor >= 2")
    out, s = [], begin
    while s <= end:
        out.append(s)
        s = s * factor if s else 1
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
    #: make(comm, count, dtype, op) -> state; run(state) -> None; wrong(state) -> int
    make: Callable
    run: Callable
    wrong: Callable
    #: which algorithm ran, for the table ("ring", "mpi", ...); may read state
    path: Callable = field(default=lambda state: "")


def _ar_factor(p):
    return 2.0 * (p - 1) / p if p > 1 else 1.0


def _make_ar(comm, count, dtype, op, inplace=False):
    p, r = comm.Get_size(), comm.Get_rank()
    x = pattern(count, r, p, dtype, op)
    return {"comm": comm, "x": x, "pristine": x.copy(), "out": np.empty_like(x), "op": op,
            "inplace": inplace, "expect": expected(count, p, dtype, op)}


def _wrong_ar(st):
    got = st["x"] if st["inplace"] else st["out"]
    n = int(np.count_nonzero(got != st["expect"]))
    if st["inplace"]:
        np.copyto(st["x"], st["pristine"])
    return n


def _ddl_make(comm, count, dtype, op, inplace=False, **kw):
    from ._comm import as_communicator

    st = _make_ar(comm, count, dtype, op, inplace)
    st["dc"] = as_communicator(comm) if not kw else __import__("ddlkernels").Communicator(comm, **kw)
    return st


def _ddl_run(st):
    if st["inplace"]:
        st["dc"].allreduce(st["x"], st["op"], out=st["x"])
    else:
        st["dc"].allreduce(st["x"], st["op"], out=st["out"])


def _mpi_run(st):
    from mpi4py import MPI

    op = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[st["op"]]
    if st["inplace"]:
        st["comm"].Allreduce(MPI.IN_PLACE, st["x"], op)
        buf = st["x"]
    else:
        st["comm"].Allreduce(st["x"], st["out"], op)
        buf = st["out"]
    if st["op"] == "avg":
        from ._comm import _scale_inplace

        _scale_inplace(buf, st["comm"].Get_size())


ALLREDUCE_IMPLS = {
    "ddlkernels": Collective("ddlkernels", _ar_factor, _ddl_make, _ddl_run, _wrong_ar,
                             path=lambda st: st["dc"].last_algorithm or ""),
    "MPI_Allreduce": Collective("MPI_Allreduce", _ar_factor, _make_ar, _mpi_run, _wrong_ar),
}


def _time_one(comm, fn, state):
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    fn(state)
    dt = time.perf_counter() - t0
    return comm.allreduce(dt, op=MPI.MAX)


def run_sweep(comm, sizes, impls, *, dtype="float32", op="sum", iters=20, warmup=5, check=True, inplace=False,
              progress=True):
    """Run every implementation at every size; return a list of row dicts (same on every rank)."""
    dt = check_dtype(np.dtype(dtype) if dtype != "bfloat16" else __import__("ml_dtypes").bfloat16)
    op = normalize_op(op)
    p = comm.Get_size()
    rows = []
    bar = None
    if progress and comm.Get_rank() == 0 and sys.stderr.isatty():
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(sizes) * len(impls), desc="sweep", unit="case", leave=False)
        except ImportError:
            bar = None
    for nbytes in sizes:
        count = nbytes // dt.itemsize
        row = {"bytes": count * dt.itemsize, "count": count, "dtype": dtype_name(dt), "op": op, "ranks": p,
               "inplace": inplace, "impls": {}}
        for impl in impls:
            st = impl.make(comm, count, dt, op, inplace)
            wrong = 0
            for _ in range(warmup):
                impl.run(st)
                if check:
                    wrong += impl.wrong(st)
            times = []
            for _ in range(iters):
                times.append(_time_one(comm, impl.run, st))
                if check:
                    wrong += impl.wrong(st)
            from mpi4py import MPI

            wrong = comm.allreduce(wrong, op=MPI.SUM)
            tmin, tmed = min(times), float(np.median(times))
            algbw = row["bytes"] / tmed / 1e9 if tmed > 0 else 0.0
            row["impls"][impl.name] = {
                "time_us_min": tmin * 1e6,
                "time_us_median": tmed * 1e6,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * impl.bus_factor(p),
                "wrong": int(wrong) if check else None,
                "path": impl.path(st),
            }
            if bar is not None:
                bar.update(1)
        rows.append(row)
    if bar is not None:
        bar.close()
    return rows


def format_table(rows, impls, ratio_of=None) -> str:
    """nccl-tests-like text table; ``ratio_of=(a, b)`` adds a busbw(a)/busbw(b) column."""
    names = [i.name if hasattr(i, "name") else i for i in impls]
    head1 = f"{'size(B)':>12} {'count':>11} {'type':>8} {'op':>5}"
    head2 = " " * len(head1)
    for n in names:
        head1 += f" | {n[:31]:^31}"
        head2 += f" | {'time(us)':>9} {'algbw':>6} {'busbw':>6} {'#wrong':>6}"
    if ratio_of:
        head1 += " | busbw"
        head2 += " | ratio"
    has_path = any(r["impls"][n]["path"] for r in rows for n in names)
    if has_path:
        head1 += " | path"
        head2 += " |"
    lines = [head1, head2]
    for r in rows:
        line = f"{r['bytes']:>12} {r['count']:>11} {r['dtype']:>8} {r['op']:>5}"
        for n in names:
            m = r["impls"][n]
            w = "-" if m["wrong"] is None else str(m["wrong"])
            line += f" | {m['time_us_median']:>9.1f} {m['algbw_GBps']:>6.2f} {m['busbw_GBps']:>6.2f} {w:>6}"
        if ratio_of:
            a, b = (r["impls"][x]["busbw_GBps"] for x in ratio_of)
            line += f" | {a / b if b else float('nan'):>5.2f}"
        if has_path:
            line += " | " + ",".join(f"{r['impls'][n]['path']}" for n in names if r["impls"][n]["path"])
        lines.append(line)
    return "\n".join(lines)


def dump_json(path, meta, rows):
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
