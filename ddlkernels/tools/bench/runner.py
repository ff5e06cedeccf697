"""The timing loop: ``run_sweep`` runs every line at every size and returns one row per size.

Worked example (2 ranks; the numbers illustrate)::

    rows = run_sweep(MPI.COMM_WORLD, [4096, 1 << 20], make_impls("allreduce"), iters=20, warmup=5)
    rows[1]["impls"]["ddlkernels"]
        -> {"time_us_min": 590.1, "time_us_median": 612.0, "algbw_GBps": 1.71, "busbw_GBps": 1.71,
            "wrong": 0, "path": "ring", ...}      (busbw = 1 MiB / 612 us * 2 (p - 1) / p)

Per size: each line makes its state (its buffers placed, ``buffers._placed``); one untimed call and
``warmup`` - 1 untimed samples per line, more while ddlkernels' tuner is still trying; then ``iters``
timed samples, one line after the other in turn.  A sample is a barrier and ``batch`` calls, timed
as the slowest rank saw them, and checked right after.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from ..._dtypes import check_dtype, dtype_name, normalize_op
from .buffers import PAGES, _placement
from .sizes import format_size, nccl_type_name, parse_dtype


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
#: candidates it needs 60 calls below 256 KiB, 48 above: ddlkernels.select.tuner.tuning_calls).
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
              progress="auto", kind="allreduce", bar=None, interleave=True, min_sample_s=0.0, pages="huge",
              even=True):
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
    ``even``: reduce_scatter and allgather counts rounded down to a multiple of
    p, where MPI's equal blocks and ddlkernels' shards coincide; False keeps
    every count as given (lines that place uneven blocks themselves: the
    device sweep's).
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
            count = _count_for(kind, nbytes // dt.itemsize, p) if even else nbytes // dt.itemsize
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
                    # down: ddlkernels.select.tuner): settle again untimed, amid the other
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
