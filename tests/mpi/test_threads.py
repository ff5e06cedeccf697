"""Threads: collectives from two threads at once, each on its own Communicator, work; on one Communicator they
raise at once.

Each test uses Communicators of its own, whose shared-memory windows, progress
engines and tuner trials are created while the other thread creates its own:
the setup that crashed Open MPI (two windows created at once) or paired one
rank's engine with another thread's on its peer.  Results are checked exactly
(values unique per rank, element and iteration).  bench/reliability/thread_stress.py is
the long run of the same (docs/reliability.md, "Threads").
"""

import importlib.util
import os
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import ddlkernels
from ddlkernels.asynchronous import progress_engine
from helpers import rank_data

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
ODD = P - 1

needs_two = pytest.mark.skipif(P < 2, reason="needs 2 or more ranks")


def _bench(name):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "reliability", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_threads(*fns):
    """Run ``fns`` in threads at once; re-raise the first exception any raised."""
    errors = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guarded(f)) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def want(n, dtype, salt):
    return sum(rank_data(n, r, P, np.float64, salt=salt) for r in range(P)).astype(dtype)


@needs_two
def test_horovod_pattern_async_then_a_blocking_metric_then_wait():
    """allreduce_async on a communicator, a blocking allreduce of a metric on it from the calling thread, then
    wait(): the engine's thread and the caller create their windows at the same trial call."""
    sub = COMM.Dup()  # fresh: its Communicator and engine are created by this test
    try:
        for it in range(24):
            g = rank_data(1024, RANK, P, np.float32, salt=it)
            h = ddlkernels.allreduce_async(g, comm=sub)
            metric = ddlkernels.allreduce(np.array([float(RANK + it)]), comm=sub)
            assert metric[0] == sum(r + it for r in range(P))
            assert np.array_equal(h.wait(), want(1024, np.float32, it)), it
    finally:
        progress_engine(sub).close()
        sub.Free()


@needs_two
def test_free_closes_the_progress_engine_after_its_queued_work():
    """``free`` ends the engine the Communicator's asynchronous calls started (a thread and a duplicate
    communicator): ``_ENGINES`` holds the Communicator weakly, so unclosed it would outlive it.  A reduction
    still queued when ``free`` starts completes first."""
    dc = ddlkernels.Communicator(COMM)
    x = rank_data(100, RANK, P, np.float32, salt=3)
    assert np.array_equal(ddlkernels.allreduce_async(x, comm=dc).wait(), want(100, np.float32, 3))
    eng = progress_engine(dc)
    h = ddlkernels.allreduce_async(x, comm=dc)
    dc.free()
    assert eng.closed and not eng._thread.is_alive() and eng.comm.comm is None
    assert np.array_equal(h.wait(), want(100, np.float32, 3))


@needs_two
@pytest.mark.parametrize("asynchronous", [False, True], ids=["blocking", "async"])
def test_two_threads_on_two_communicators(asynchronous):
    """Each thread its own Communicator, both through the tuner's trials (windows created at once); with
    ``allreduce_async`` each Communicator's engine is created by its own thread, paired across ranks."""
    a, b = ddlkernels.Communicator(COMM), ddlkernels.Communicator(COMM)

    def loop(dc, n, salt):
        def run():
            for it in range(24):
                x = rank_data(n, RANK, P, np.float64, salt=salt + it)
                y = ddlkernels.allreduce_async(x, comm=dc).wait() if asynchronous else dc.allreduce(x)
                assert np.array_equal(y, want(n, np.float64, salt + it)), (n, it, dc.last_algorithm)
        return run

    run_threads(loop(a, 700, 0), loop(b, 1500, 1000))
    if asynchronous:
        progress_engine(a).close()
        progress_engine(b).close()
    a.free()
    b.free()


@needs_two
def test_one_communicator_used_by_two_threads_at_once_raises_before_communicating():
    """A second thread's call while one is inside a collective on the Communicator raises RuntimeError at once;
    the collective in progress is unaffected."""
    dc = ddlkernels.Communicator(COMM)
    x = rank_data(1 << 14, RANK, P, np.float64)
    got, entering = {}, threading.Event()

    def inside():
        if RANK == ODD:
            time.sleep(1.0)  # the others wait inside the ring for this rank meanwhile
        entering.set()
        got["y"] = dc.allreduce(x, dims=(P,))

    t = threading.Thread(target=inside)
    t.start()
    if RANK != ODD:
        entering.wait()
        time.sleep(0.1)  # the thread is inside its collective now, waiting for the last rank
        for call in (lambda: dc.allreduce(x), lambda: dc.reduce_scatter(x), lambda: dc.allgather(x, count=x.size * P),
                     lambda: ddlkernels.allreduce_async(x, comm=dc), lambda: dc.free()):
            with pytest.raises(RuntimeError, match="another thread is inside a collective on the same Communicator"):
                call()
    t.join()
    assert np.array_equal(got["y"], want(x.size, np.float64, 0))
    dc.free()


@needs_two
def test_threads_stress_short():
    """bench/reliability/thread_stress.py, short: two threads, async and blocking, three Communicators."""
    calls, wrong, errors = _bench("thread_stress").stress(COMM, iters=12)
    assert not errors, errors[0]
    assert calls == 2 * 12 + 3 * 12 + 3  # train: 2 per iteration; eval: 3, and 1 more every 4th
    assert COMM.allreduce(wrong) == 0
