"""pytest under mpirun: rank 0 reports on the terminal, other ranks write tests/.mpi-logs/rank<R>.log.

Failures on any rank still reach stderr (tests/mpi/conftest.py prints them
before aborting the job), so nothing is lost by quieting the other ranks.
"""

import os
import sys

import pytest
from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
if rank != 0:
    logdir = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".mpi-logs")
    os.makedirs(logdir, exist_ok=True)
    fd = os.open(os.path.join(logdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    sys.stdout = os.fdopen(1, "w", buffering=1)
code = pytest.main(["-p", "no:cacheprovider", "--color=no", *sys.argv[1:]])
# Exit code 5 (no tests collected) is not a failure of a rank-count-specific skip.
sys.exit(0 if code in (0, 5) else int(code))
