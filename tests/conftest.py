"""Fixtures shared by the single-process and the MPI tests."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import rank_data, reference, assert_close  # noqa: E402,F401


@pytest.fixture(scope="session")
def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD
