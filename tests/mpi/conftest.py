"""MPI test session: a failure on any rank aborts the whole job (tests/_mpi_abort.py)."""

import os
import sys

# Without a GPU, device tests run in the Numba CUDA simulator, which must be
# switched on before numba is first imported by any test module; deciding
# it here, before collection, keeps that independent of module order.
if "numba" not in sys.modules and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _mpi_abort import pytest_runtest_makereport  # noqa: E402,F401
