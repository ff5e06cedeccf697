"""Fixtures shared by the single-process and the MPI tests."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import rank_data, reference, assert_close  # noqa: E402,F401
import share_files  # noqa: E402
from share_files import pytest_runtest_protocol  # noqa: E402,F401  (--share-files: tests/share_files.py)


@pytest.fixture(scope="session")
def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def pytest_addoption(parser):
    parser.addoption("--every-rank-count", action="store_true",
                     help="under mpirun, run every case of each @pytest.mark.sweep test at this rank count, not "
                          "only its share (tests/mpi/conftest.py)")
    share_files.add_option(parser)


def pytest_configure(config):
    config.addinivalue_line("markers", "sweep: a grid of cases shared out among the rank counts 2, 3 and 4 "
                                       "(tests/mpi/conftest.py); --every-rank-count runs them all")
    config.addinivalue_line("markers", "one_rank: a test under mpirun that exchanges nothing, run at 1 rank only "
                                       "(tests/mpi/conftest.py); --every-rank-count runs it at every count")
