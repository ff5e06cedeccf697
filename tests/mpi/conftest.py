"""MPI test session: a failure on any rank aborts the whole job (tests/_mpi_abort.py), and the grids of cases
marked ``sweep`` are shared out among the rank counts 2, 3 and 4.

The suite runs tests/mpi under 1, 2, 3 and 4 ranks.  A sweep (every dtype x
op x form of one algorithm) in full at all three counts of 2 or more would be
most of the suite's time, so each group of its cases runs at one of them,
chosen by a hash of the group: every rank count still runs every algorithm
on a third of each grid, and every group runs at some count.  A group is
the values of the parameters the marker names, or of all parameters: with
``@pytest.mark.sweep("dtype", "op")`` each dtype and op runs with every
size (0, 1, p - 1, p + 1, ... of its rank count) at one count.  A
parameter whose values depend on the rank count must not be part of the
group, or a group seen only at one count might run at none.
``--every-rank-count`` runs the whole grid at this count
(``bash tests/run_all.sh --every-rank-count``); at 1 rank and at 5 or more
the whole grid runs anyway.

A test marked ``one_rank`` exchanges nothing (a backend's kernels in the
Numba simulator, say): at N ranks it would only run N times at once, so it
runs at 1 rank alone (at every count with ``--every-rank-count``).
"""

import os
import sys
import zlib

import pytest

# Without a GPU, device tests run in the Numba CUDA simulator, which must be
# switched on before numba is first imported by any test module; deciding
# it here, before collection, keeps that independent of module order.
if "numba" not in sys.modules and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _mpi_abort import pytest_runtest_makereport  # noqa: E402,F401

#: The rank counts that share each sweep's cases out among themselves.
SHARING = (2, 3, 4)


def group(item) -> str:
    """The id of ``item``'s group within its sweep: the test and the values of the parameters the marker names
    (all of them without names)."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    names = item.get_closest_marker("sweep").args or sorted(params)
    missing = [n for n in names if n not in params]
    if missing:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.sweep names parameters it does not have: {missing}")
    return item.nodeid.split("[")[0] + "[" + ",".join(f"{n}={params[n]!r}" for n in names) + "]"


def share(key: str, size: int) -> bool:
    """Whether the group ``key`` runs at ``size`` ranks: at one count of ``SHARING``, the same on every rank
    (crc32, not ``hash``, which is salted per process)."""
    if size not in SHARING:
        return True
    return zlib.crc32(key.encode()) % len(SHARING) == SHARING.index(size)


def pytest_collection_modifyitems(config, items):
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()
    if config.getoption("--every-rank-count"):
        return
    keep = [it for it in items if (it.get_closest_marker("sweep") is None or share(group(it), size))
            and (it.get_closest_marker("one_rank") is None or size == 1)]
    if len(keep) < len(items):
        kept = set(map(id, keep))
        config.hook.pytest_deselected(items=[it for it in items if id(it) not in kept])
        items[:] = keep
