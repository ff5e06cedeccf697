"""MPI test session: a failure on any rank aborts the whole job (tests/_mpi_abort.py), and the grids of cases
marked ``sweep`` are shared out among the rank counts 2, 3 and 4.

The suite runs tests/mpi under 1, 2, 3 and 4 ranks.  A sweep (every dtype x
op x size x form of one algorithm) at all three counts of 2 or more would be
most of the suite's time, so each of its cases runs at one of them, chosen by
a hash of the case's id: every rank count still runs every algorithm on a
third of each grid, with sizes 0, 1, p - 1 and p + 1 of its own, and every
case runs somewhere.  ``--every-rank-count`` runs the whole grid at this
count (``python tests/run_suite.py --every-rank-count``); at 1 rank and at 5
or more, the whole grid runs anyway.
"""

import os
import sys
import zlib

# Without a GPU, device tests run in the Numba CUDA simulator, which must be
# switched on before numba is first imported by any test module; deciding
# it here, before collection, keeps that independent of module order.
if "numba" not in sys.modules and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _mpi_abort import pytest_runtest_makereport  # noqa: E402,F401

#: The rank counts that share each sweep's cases out among themselves.
SHARING = (2, 3, 4)


def share(nodeid: str, size: int) -> bool:
    """Whether the sweep case ``nodeid`` runs at ``size`` ranks: at one count of ``SHARING``, the same on every
    rank (crc32, not ``hash``, which is salted per process)."""
    if size not in SHARING:
        return True
    return zlib.crc32(nodeid.encode()) % len(SHARING) == SHARING.index(size)


def pytest_collection_modifyitems(config, items):
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()
    if config.getoption("--every-rank-count"):
        return
    keep = [it for it in items if it.get_closest_marker("sweep") is None or share(it.nodeid, size)]
    if len(keep) < len(items):
        kept = set(map(id, keep))
        config.hook.pytest_deselected(items=[it for it in items if id(it) not in kept])
        items[:] = keep
