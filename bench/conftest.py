"""pytest-benchmark for bench/: fixed rounds everywhere, MPI-aware, and a bandwidth summary.

Every benchmark here calls ``run(benchmark, fn, ...)``, which uses
``benchmark.pedantic`` with a fixed number of rounds: pytest-benchmark's
auto-calibration picks a different number of rounds on every rank, which
deadlocks anything collective and desynchronises ranks that are meant to
load the memory system at the same time.

Under ``mpirun`` (detected from the launcher's environment):

* every rank runs every benchmark; a barrier before each keeps them in step,
  so the kernels are measured with all ranks competing for memory bandwidth,
  as they do inside a ring;
* rank 0 reports on the terminal; other ranks write bench/.mpi-logs/rank<R>.log;
* ``--benchmark-json PATH``: rank 0 writes PATH, rank R writes PATH.rank<R>
  (one JSON per rank); ``--bench-json-rank0-only`` keeps only rank 0's.

Bandwidth: a benchmark that moves bytes passes ``nbytes`` (bytes counted as
STREAM does: a copy reads 1 and writes 1 array, a reduce ``dst = a + b``
reads 2 and writes 1; write-allocate traffic is not counted).  GB/s from the
median round goes into the JSON's ``extra_info`` and into the summary printed
at the end, with each kernel's bandwidth as a fraction of the STREAM-like
copy measured at the same size in the same session.
"""

from __future__ import annotations

import os
import sys

import pytest

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
_RESULTS: dict = {}


def _comm():
    if not any(k in os.environ for k in _MPI_ENV):
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None


def pytest_addoption(parser):
    g = parser.getgroup("ddlkernels bench")
    g.addoption("--bench-rounds", type=int, default=15, help="rounds per benchmark (fixed; default 15)")
    g.addoption("--bench-json-rank0-only", action="store_true", help="under MPI: no JSON from ranks > 0")


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark reads --benchmark-json
def pytest_configure(config):
    comm = _comm()
    if comm is None or comm.Get_rank() == 0:
        return
    rank = comm.Get_rank()
    logdir = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".mpi-logs")
    os.makedirs(logdir, exist_ok=True)
    log = open(os.path.join(logdir, f"rank{rank}.log"), "w", buffering=1)
    # pytest's terminal writer holds a duplicate of the original stdout taken
    # before any conftest runs, so redirecting fd 1 is not enough: point the
    # writer itself at the log.
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        from _pytest.config import create_terminal_writer

        tr._tw = create_terminal_writer(config, file=log)
    sys.stdout = log
    js = getattr(config.option, "benchmark_json", None)
    if js is not None:
        # Every rank was given PATH; rank 0 keeps it.  (pytest-benchmark >= 5
        # holds a path, older versions an open file.)
        name = getattr(js, "name", None) if hasattr(js, "close") else None
        if name is not None:
            js.close()
            js = name
        per_rank = type(js)(f"{js}.rank{rank}") if not isinstance(js, str) else f"{js}.rank{rank}"
        if name is not None and not config.option.bench_json_rank0_only:
            per_rank = open(per_rank, "wb")
        config.option.benchmark_json = None if config.option.bench_json_rank0_only else per_rank


@pytest.fixture(autouse=True)
def _in_step():
    comm = _comm()
    if comm is not None:
        comm.Barrier()
    yield


@pytest.fixture
def rounds(request):
    return request.config.getoption("--bench-rounds")


@pytest.fixture
def run(rounds):
    """``run(benchmark, fn, *args, nbytes=None, group=None, setup=None, iterations=1)``: pedantic, fixed rounds."""

    def _run(benchmark, fn, *args, nbytes=None, key=None, iterations=1, setup=None, warmup_rounds=2):
        if setup is not None:
            benchmark.pedantic(fn, setup=setup, rounds=rounds, warmup_rounds=warmup_rounds)
        else:
            benchmark.pedantic(fn, args=args, rounds=rounds, iterations=iterations, warmup_rounds=warmup_rounds)
        st = benchmark.stats.stats
        if nbytes:
            benchmark.extra_info["bytes_counted"] = nbytes
            benchmark.extra_info["GBps_median"] = nbytes / st.median / 1e9
            benchmark.extra_info["GBps_max"] = nbytes / st.min / 1e9
            if key is not None:
                _RESULTS[key] = nbytes / st.median / 1e9
        return st

    return _run


def pytest_terminal_summary(terminalreporter):
    if not _RESULTS:
        return
    tr = terminalreporter
    tr.section("bandwidth (GB/s from the median round; STREAM counting) and fraction of the copy")
    by_size: dict = {}
    for (kind, size, dtype), gbps in _RESULTS.items():
        by_size.setdefault((size, dtype), {})[kind] = gbps
    comm = _comm()
    if comm is not None:
        tr.write_line(f"{comm.Get_size()} ranks measured at once (rank 0 shown)")
    for (size, dtype), kinds in sorted(by_size.items()):
        copy, icopy = kinds.get("copy"), kinds.get("copy (interleaved)")
        parts = []
        for kind, gbps in sorted(kinds.items()):
            ref = icopy if kind.endswith("(interleaved)") else copy
            frac = f" ({gbps / ref:.0%} of copy)" if ref and not kind.startswith("copy") else ""
            parts.append(f"{kind} {gbps:.2f}{frac}")
        tr.write_line(f"{size:>10} {dtype:>8}: " + "; ".join(parts))
