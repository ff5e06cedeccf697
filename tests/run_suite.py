"""Run the whole test suite: single-process tests, then the MPI tests under several rank counts.

    python tests/run_suite.py [--ranks 1,2,3,4] [--compile-jobs 2] [--jobs 2] [pytest args...]

The single-process tests run in ``--jobs`` pytest processes side by side, each
test file in the first one free to take it (tests/share_files.py).

Each MPI run is ``mpirun -n N python -m mpi4py tests/_mpi_pytest.py tests/mpi``
with ``MPIEXEC_TIMEOUT`` set, so a rank that fails aborts the job (through
mpi4py's abort-on-exception and tests/mpi/conftest.py) and a hang is killed.
Running as root and with more ranks than cores works without flags.  A run
whose launcher fails before any test starts (``LAUNCH_FAILURES``) is
launched again, at most ``LAUNCHES`` times in all; nothing else is retried.
The last line is the total in pytest's words, e.g. "123 passed, 0 failed".
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
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


#: What Open MPI's launcher prints when it fails before it starts any rank -- a known transient of
#: PRRTE/PMIx start-up (seen once in a CI run here: "mpirun -n 2: exit 213 in 0.0 s"; lfortran's CI
#: reports the same, lfortran/lfortran#8610).  Nothing of the suite ran, so it is launched again.
LAUNCH_FAILURES = ("The PMIx server's listener thread failed to start",)
#: Launches of one run, at most (the first and the retries).
LAUNCHES = 3


def launch_failed(output: str) -> bool:
    """Whether ``output`` is the launcher failing before any test ran (no pytest summary in it)."""
    return any(m in output for m in LAUNCH_FAILURES) and not any(count(output).values())


def run(cmd, env, label):
    for launch in range(1, LAUNCHES + 1):
        print(f"\n=== {label}: {' '.join(cmd)}", flush=True)
        t = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sys.stdout.write(proc.stdout)
        print(f"=== {label}: exit {proc.returncode} in {time.time() - t:.1f} s", flush=True)
        if proc.returncode == 0 or not launch_failed(proc.stdout) or launch == LAUNCHES:
            return proc.returncode, count(proc.stdout)
        print(f"=== {label}: the launcher failed before any test ran; launching again ({launch + 1} of "
              f"{LAUNCHES})", flush=True)


def run_shared(cmd, env, label, jobs):
    """``cmd``, a pytest command, in ``jobs`` processes side by side sharing its test files out
    (tests/share_files.py): (the first nonzero exit or 0, the counts of all)."""
    if jobs <= 1:
        return run(cmd, env, label)
    with tempfile.TemporaryDirectory(prefix="ddl-share-") as where:
        print(f"\n=== {label}: {jobs} x {' '.join(cmd)} --share-files {where}/claims", flush=True)
        os.mkdir(os.path.join(where, "claims"))
        t = time.time()
        procs = []
        for j in range(jobs):
            out = open(os.path.join(where, f"out{j}"), "w+")  # a file, not a pipe: nobody reads until the end
            procs.append((subprocess.Popen([*cmd, "--share-files", os.path.join(where, "claims"),
                                            "--basetemp", os.path.join(where, f"tmp{j}")],
                                           cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True), out))
        rcs, totals = [], {}
        for j, (proc, out) in enumerate(procs):
            rcs.append(proc.wait())
            out.seek(0)
            text = out.read()
            out.close()
            print(f"--- {label}, process {j + 1} of {jobs}: exit {rcs[-1]}", flush=True)
            sys.stdout.write(text)
            for k, v in count(text).items():
                totals[k] = totals.get(k, 0) + v
        rc = next((r for r in rcs if r), 0)
        print(f"=== {label}: exit {rc} in {time.time() - t:.1f} s", flush=True)
        return rc, totals


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,3,4", help="comma-separated rank counts for tests/mpi")
    ap.add_argument("--timeout", type=int, default=900, help="MPIEXEC_TIMEOUT per mpirun, seconds")
    ap.add_argument("--only", choices=["serial", "mpi"], help="run one half only")
    ap.add_argument("--compile-jobs", type=int, default=2,
                    help="processes compiling the CPU loops into Numba's cache first (python -m ddlkernels "
                         "compile); 0: none, each test run compiles what it calls")
    ap.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 4),
                    help="pytest processes running the single-process tests side by side (default: the cores, "
                         "at most 4); 1: one process")
    args, rest = ap.parse_known_args(argv)
    totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    failed_runs = []
    if args.compile_jobs > 0:
        # On a fresh clone every loop compiles in the first run that calls it: under mpirun, in every rank at
        # once, in processes holding a whole test session (a 2-rank run ran into its 15-minute timeout so).  Once here,
        # in lean processes side by side, it takes a few minutes; later runs find it in the cache.
        rc, _ = run([sys.executable, "-m", "ddlkernels", "compile", "--quiet", "--jobs", str(args.compile_jobs)],
                    dict(os.environ), "compile ahead")
        if rc != 0:
            failed_runs.append(f"compile ahead (exit {rc})")
    if args.only != "mpi":
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "tests", "--ignore=tests/mpi", *rest]
        rc, c = run_shared(cmd, dict(os.environ), "single process", args.jobs)
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
