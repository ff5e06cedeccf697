"""Wall time and exit status of the failure jobs of tests/test_no_hang.py, as a table for the docs.

    python bench/reliability/no_hang.py [--only SCENARIO,...] [--repeat N]

Each row is one ``mpirun -n 4`` job of tests/_reliability_job.py (launch
included); the last column is the line of its output that says why it ended
(for the absent-* jobs: the slowest waiting rank's report, with the seconds
after which its call raised).  ``--repeat`` runs each job N times, a row each.
"""

import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests"))
from test_no_hang import run_job  # noqa: E402

SCENARIOS = [
    ("mismatch-count", True),
    ("mismatch-dtype", True),
    ("mismatch-op", True),
    ("mismatch-dims", True),
    ("raise-mid-collective", True),
    ("raise-between-helper", False),
    ("stuck-rank-timeout", False),
    ("absent-first-call", True),
    ("absent-first-shm", True),
    ("absent-first-cma", True),
    ("absent-engine", True),
    ("timeout-caught-exit", True),
]
WHY = re.compile(r"(ValueError: ddlkernels.*|RuntimeError: .*|CollectiveTimeout: allreduce timed out.*rank 3.*"
                 r"|rank 3: scenario .* completed without error)")
RAISED = re.compile(r"rank (\d+): CollectiveTimeout after ([\d.]+) s: (.*)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    print(f"{'scenario':<22} {'launch':<18} {'exit':>4} {'seconds':>8}  why")
    worst = 0.0
    for scenario, mpi4py_main in SCENARIOS:
        if only and scenario not in only:
            continue
        for _ in range(args.repeat):
            rc, elapsed, out = run_job(scenario, mpi4py_main=mpi4py_main)
            worst = max(worst, elapsed)
            raised = RAISED.findall(out)
            if raised:  # every waiting rank's report: the slowest one
                r, t, msg = max(raised, key=lambda m: float(m[1]))
                why = f"{len(raised)} ranks raised, slowest rank {r} after {t} s: {msg}"
            else:
                m = WHY.search(out)
                why = m.group(1) if m else "?"
            launch = "python -m mpi4py" if mpi4py_main else "python (helper)"
            print(f"{scenario:<22} {launch:<18} {rc:>4} {elapsed:>8.1f}  {why[:130]}", flush=True)
    print(f"slowest job: {worst:.1f} s")


if __name__ == "__main__":
    main()
