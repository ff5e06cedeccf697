"""Run the whole test suite: single-process tests, then the MPI tests under several rank counts.

    python tests/run_suite.py [--ranks 1,2,3,4] [--quick] [pytest args...]

Each MPI run is ``mpirun -n N python -m mpi4py tests/_mpi_pytest.py tests/mpi``
with ``MPIEXEC_TIMEOUT`` set, so a rank that fails aborts the job (through
mpi4py's abort-on-exception and tests/mpi/conftest.py) and a hang is killed.
Running as root and with more ranks than cores works without flags.
The last line is the total in pytest's words, e.g. "123 passed, 0 failed".
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def mpi_env(timeout: int) -> dict:
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")  # Open MPI 4
    env["MPIEXEC_TIMEOUT"] = str(timeout)
    return env


def mpirun() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return exe if os.path.exists(exe) else "mpirun"


def count(output: str) -> dict:
    totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for line in output.splitlines()[::-1]:
        if re.search(r"\b(passed|failed|skipped|error|errors|no tests ran)\b", line) and " in " in line:
            for num, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", line):
                word = "error" if word.startswith("error") else word
                if word in totals:
                    totals[word] += int(num)
            break
    return totals


def run(cmd, env, label):
    print(f"\n=== {label}: {' '.join(cmd)}", flush=True)
    t = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(proc.stdout)
    print(f"=== {label}: exit {proc.returncode} in {time.time() - t:.1f} s", flush=True)
    return proc.returncode, count(proc.stdout)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,3,4", help="comma-separated rank counts for tests/mpi")
    ap.add_argument("--timeout", type=int, default=900, help="MPIEXEC_TIMEOUT per mpirun, seconds")
    ap.add_argument("--only", choices=["serial", "mpi"], help="run one half only")
    args, rest = ap.parse_known_args(argv)
    totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    failed_runs = []
    if args.only != "mpi":
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "tests", "--ignore=tests/mpi", *rest]
        rc, c = run(cmd, dict(os.environ), "single process")
        for k in totals:
            totals[k] += c[k]
        if rc not in (0,):
            failed_runs.append(f"single process (exit {rc})")
    if args.only != "serial":
        for n in [int(x) for x in args.ranks.split(",") if x]:
            cmd = [mpirun(), "-n", str(n), sys.executable, "-m", "mpi4py", os.path.join("tests", "_mpi_pytest.py"),
                   "-q", "-rs", "tests/mpi", *rest]
            rc, c = run(cmd, mpi_env(args.timeout), f"mpirun -n {n}")
            for k in totals:
                totals[k] += c[k]
            if rc != 0:
                failed_runs.append(f"mpirun -n {n} (exit {rc})")
                if c["failed"] == 0 and c["error"] == 0:
                    totals["failed"] += 1  # aborted or timed out: count the run as a failure
    print()
    if failed_runs:
        print("FAILED runs: " + "; ".join(failed_runs))
    print(f"{totals['passed']} passed, {totals['failed'] + totals['error']} failed, {totals['skipped']} skipped")
    return 1 if failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
