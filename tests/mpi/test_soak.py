"""Short soak (bench/reliability/soak.py runs the long one): many back-to-back allreduces, all exact, memory flat.

600 calls of mixed sizes (up to 20,000 elements), dtypes, ops, chunk sizes,
dims and in place / out of place, every result compared exactly with its
closed form, twice: the first pass loads every kernel and makes every plan
the sequence needs (each loop Numba loads adds a MiB or so, and which
calls first need one depends on the rank count: from 5 ranks on, some came
after a warm-up of 200 calls), the second repeats it; resident memory
between its first call and its last may differ by less than 5 %, and the
plan/schedule/buffer caches stay bounded.
"""

import os
import sys

from mpi4py import MPI

import ddlkernels

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench", "reliability"))
from soak import soak  # noqa: E402


def test_short_soak_exact_and_flat():
    comm = ddlkernels.Communicator(MPI.COMM_WORLD)
    lines = []  # the long soak's progress lines (bench/reliability/soak.py prints them on rank 0)
    first = soak(comm, 600, [200, 600], seed=7, max_n=20_000, log=lines.append)
    assert [ln.split(":")[0] for ln in lines] == ["step 200", "step 600"], lines
    assert first["wrong"] == 0, f"{first['wrong']} wrong results, first: {first['first_bad']}"
    res = soak(comm, 600, [1, 600], seed=7, max_n=20_000)  # the same calls again
    assert res["wrong"] == 0, f"{res['wrong']} wrong results, first: {res['first_bad']}"
    assert res["growth_max"] < 0.05, f"resident memory grew {res['growth_max']:+.2%}: {res['rss']}"
    assert len(comm.ring_plans) <= 1024 + 257  # plans and schedules cached, bounded
    comm.free()
