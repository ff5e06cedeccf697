"""The long fuzz run: tests/mpi/test_fuzz.py under mpirun -n 1..8 (5..8 oversubscribed), >= 10,000 cases.

    python bench/reliability/fuzz_long.py [--examples 1250] [--ranks 1,2,3,4,5,6,7,8]
    python bench/reliability/fuzz_long.py --test device [--examples 1000]     (tests/mpi/test_device_fuzz.py)

Each rank count runs ``--examples`` hypothesis examples (shrinking, if a
case fails, adds more); the device fuzz's cases are programs of 1 to 4 calls
on the stream emulator, from 2 ranks.  Prints one line per rank count and the total:
"fuzz long run: N cases, W wrong, R failed runs".  Exit status 0 only when
every run passed.
"""

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from run_suite import mpi_env, mpirun  # noqa: E402


#: --test: (the pytest id, the variable that sets its examples, the fewest ranks it runs at)
TESTS = {"host": ("tests/mpi/test_fuzz.py::test_fuzz_collectives", "DDLKERNELS_FUZZ_EXAMPLES", 1),
         "device": ("tests/mpi/test_device_fuzz.py::test_fuzz_device_programs", "DDLKERNELS_DEVICE_FUZZ_EXAMPLES", 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=1250, help="hypothesis examples per rank count")
    ap.add_argument("--ranks", default=None, help="default 1,2,...,8 (device: from 2)")
    ap.add_argument("--test", choices=sorted(TESTS), default="host",
                    help="host: test_fuzz.py (host arrays); device: test_device_fuzz.py (the emulated device)")
    ap.add_argument("--timeout", type=int, default=7200, help="MPIEXEC_TIMEOUT per run, seconds")
    args = ap.parse_args()
    total = wrong = 0
    failed = []
    test, variable, first = TESTS[args.test]
    ranks = args.ranks or ",".join(str(p) for p in range(first, 9))
    for p in [int(x) for x in ranks.split(",")]:
        env = mpi_env(args.timeout)
        env[variable] = str(args.examples)
        cmd = [mpirun(), "-n", str(p), sys.executable, "-m", "mpi4py", os.path.join("tests", "_mpi_pytest.py"),
               "-q", "-s", "-p", "no:randomly", test]
        t = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        m = re.search(r"fuzz: p=(\d+) cases run=(\d+) wrong=(\d+)", proc.stdout)
        run, bad = (int(m.group(2)), int(m.group(3))) if m else (0, 0)
        total += run
        wrong += bad
        status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
        print(f"p={p}: {run} cases, {bad} wrong, {time.time() - t:.0f} s, {status}", flush=True)
        if proc.returncode != 0:
            failed.append(p)
            sys.stdout.write(proc.stdout[-6000:])
    print(f"{'device ' if args.test == 'device' else ''}fuzz long run: {total} cases, {wrong} wrong, {len(failed)} failed runs {failed or ''}".rstrip())
    return 1 if failed or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
