"""Wall time and exit status of the failure jobs of tests/test_no_hang.py, as a table for the docs.

    python bench/no_hang.py

Each row is one ``mpirun -n 4`` job of tests/_reliability_job.py (launch
included); the last column is the line of its output that says why it ended.
"""

import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from test_no_hang import run_job  # noqa: E402

SCENARIOS = [
    ("mismatch-count", True),
    ("mismatch-dtype", True),
    ("mismatch-op", True),
    ("mismatch-dims", True),
    ("raise-mid-collective", True),
    ("raise-between-helper", False),
    ("stuck-rank-timeout", False),
]
WHY = re.compile(r"(ValueError: ddlkernels.*|RuntimeError: .*|CollectiveTimeout: allreduce timed out.*rank 3.*)")


def main():
    print(f"{'scenario':<22} {'launch':<18} {'exit':>4} {'seconds':>8}  why")
    worst = 0.0
    for scenario, mpi4py_main in SCENARIOS:
        rc, elapsed, out = run_job(scenario, mpi4py_main=mpi4py_main)
        worst = max(worst, elapsed)
        m = WHY.search(out)
        launch = "python -m mpi4py" if mpi4py_main else "python (helper)"
        print(f"{scenario:<22} {launch:<18} {rc:>4} {elapsed:>8.1f}  {m.group(1)[:110] if m else '?'}", flush=True)
    print(f"slowest job: {worst:.1f} s")


if __name__ == "__main__":
    main()
