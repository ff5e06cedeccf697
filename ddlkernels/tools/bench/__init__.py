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

The package, in the order a sweep uses it (each module's docstring opens with an example)::

    sizes     sizes, types and collective names, as the command line spells them
    buffers   inputs and exact results (``pattern``, ``expected``), and where buffers lie (``_placed``)
    calls     each line's make / run / count-wrong functions (ddlkernels, MPI, link, copy, Python ring)
    impls     the ``Collective`` record, and ``make_impls``, which builds the lines a sweep compares
    runner    ``run_sweep``: warmup, timed samples and checks, one row per size
    report    nccl-tests' table and footer, CSV, JSON and a plot of the rows

Every name below is importable from ``ddlkernels.tools.bench`` as before the split.
"""

from __future__ import annotations

from .buffers import _HUGE, PAGES, SENTINEL, _placed, _placement, expected, pattern
from .calls import LINK_CHUNK_BYTES
from .impls import _DDL, _TUNED_PARAM, ALLREDUCE_IMPLS, TUNED_ALGORITHMS, Collective, make_impls, tuned_label
from .report import CSV_COLUMNS, average_busbw, comment, dump_json, format_footer, format_table, plot_rows, write_csv
from .runner import MAX_BATCH, MAX_REDO, MAX_SETTLE, _progress_bar, run_sweep
from .sizes import (COLLECTIVES, NCCL_REFUSED, NCCL_TYPES, format_size, nccl_type_name, parse_dtype, parse_size,
                    sweep_sizes)

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
    # Public too, though not star-imported before the split:
    "format_size",
    "SENTINEL",
    "PAGES",
    "LINK_CHUNK_BYTES",
    "NCCL_REFUSED",
    "MAX_BATCH",
    "MAX_SETTLE",
    "MAX_REDO",
    "average_busbw",
    "comment",
    "CSV_COLUMNS",
    # Private, reached through the package by bench_cli, tests and bench/studies/shm_pieces.py:
    "_DDL",
    "_HUGE",
    "_TUNED_PARAM",
    "_placed",
    "_placement",
    "_progress_bar",
]
