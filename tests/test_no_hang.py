"""No hang: jobs in which one rank fails end non-zero within a bound, and say why.

Each test launches ``mpirun -n 4`` on tests/_reliability_job.py (4 ranks on
any machine: the launch oversubscribes) and measures the wall time of the
whole job, launch included.  ``MPIEXEC_TIMEOUT`` is the backstop: a job that
hangs is killed after it and then fails the bound.  The control case shows
that the bound is not trivially met: the same failure without
``abort_on_exception`` and without ``-m mpi4py`` hangs until the launcher's
timeout kills it.
"""

import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run_suite import mpi_env, mpirun  # noqa: E402

JOB = os.path.join(HERE, "_reliability_job.py")
RANKS = 4
BOUND = 30.0  # seconds, launch included (issue 7)


def run_job(scenario, *, mpi4py_main=True, timeout=60):
    cmd = [mpirun(), "-n", str(RANKS), sys.executable]
    if mpi4py_main:
        cmd += ["-m", "mpi4py"]
    cmd += [JOB, scenario]
    t = time.monotonic()
    proc = subprocess.run(cmd, env=mpi_env(timeout), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc.returncode, time.monotonic() - t, proc.stdout.decode(errors="replace")


MISMATCH = {
    "count": "(count differ): ranks 0-2 passed count=1000; rank 3 passed count=1001",
    "dtype": "(dtype, chunk differ): ranks 0-2 passed dtype=float32, chunk=",
    "op": "(op differ): ranks 0-2 passed op=sum; rank 3 passed op=max",
    "dims": "(dims differ): ranks 0-2 passed dims=None",
}


@pytest.mark.parametrize("kind", sorted(MISMATCH))
def test_mismatch_ends_the_job_with_the_error(kind):
    rc, elapsed, out = run_job(f"mismatch-{kind}")
    assert rc != 0, out
    assert elapsed < BOUND, f"job took {elapsed:.1f} s"
    assert "ddlkernels.allreduce: ranks called with different arguments " + MISMATCH[kind] in out, out[-3000:]
    assert "completed without error" not in out


def test_rank_raising_mid_collective_ends_the_job():
    rc, elapsed, out = run_job("raise-mid-collective")
    assert rc != 0, out
    assert elapsed < BOUND, f"job took {elapsed:.1f} s"
    assert "injected fault in rank 2's reduction, mid-collective" in out


def test_abort_on_exception_ends_a_plain_python_job():
    rc, elapsed, out = run_job("raise-between-helper", mpi4py_main=False)
    assert rc != 0, out
    assert elapsed < BOUND, f"job took {elapsed:.1f} s"
    assert "[rank 2] aborting the MPI job after an exception" in out
    assert "rank 2 fails between collectives" in out


def test_stuck_rank_is_named_by_timeout_and_the_job_ends():
    rc, elapsed, out = run_job("stuck-rank-timeout", mpi4py_main=False)
    assert rc != 0, out
    assert elapsed < BOUND, f"job took {elapsed:.1f} s"
    # Rank 3 never joins; its ring successor (rank 0) names it.
    assert "allreduce timed out after 3 s on rank 0: waiting to receive from rank 3" in out, out[-3000:]


def test_control_without_helper_the_job_hangs():
    """Without the helper or -m mpi4py the failure hangs the job: only the launcher's timeout ends it."""
    limit = 8
    rc, elapsed, out = run_job("raise-between-bare", mpi4py_main=False, timeout=limit)
    assert rc != 0
    assert elapsed >= limit, f"expected a hang killed after {limit} s, job ended after {elapsed:.1f} s:\n{out[-2000:]}"


def _raised_after(out):
    """Per waiting rank, the seconds after which its call raised CollectiveTimeout (the job prints them)."""
    import re

    return {int(r): float(t) for r, t in re.findall(r"rank (\d+): CollectiveTimeout after ([\d.]+) s", out)}


def test_rank_absent_at_the_first_call_every_other_rank_raises_and_the_job_ends():
    """The first call creates the default Communicator (a collective duplicate): under the call's timeout=3."""
    rc, elapsed, out = run_job("absent-first-call")
    assert rc != 0, out
    assert elapsed < BOUND, f"job took {elapsed:.1f} s"
    raised = _raised_after(out)
    assert sorted(raised) == [0, 1, 2] and max(raised.values()) < 10, out[-3000:]
    assert "waiting to complete MPI_Comm_idup" in out


def test_exit_after_a_caught_timeout_is_clean():
    """A late rank completes the call the others abandoned; a new Communicator works; every rank exits 0."""
    rc, elapsed, out = run_job("timeout-caught-exit")
    assert rc == 0, out[-3000:]
    assert elapsed < BOUND, f"job took {elapsed:.1f} s"
    assert out.count("completed without error") == RANKS and out.count(": caught allreduce timed out") == RANKS - 1


def test_exit_with_a_message_posted_stops_the_poller_first():
    """Ranks exit with a receive posted on the ddlkernels torch group: its poller has ended before MPI finalizes
    (tests/_torch_exit_job.py), and every rank exits 0."""
    pytest.importorskip("torch.distributed", reason="torch with torch.distributed not installed")
    cmd = [mpirun(), "-n", "2", sys.executable, os.path.join(HERE, "_torch_exit_job.py")]
    t = time.monotonic()
    proc = subprocess.run(cmd, env=mpi_env(60), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, out[-3000:]
    assert time.monotonic() - t < BOUND
    assert out.count("exiting with a receive posted") == 2, out[-3000:]
    assert out.count("poller alive at exit: False") == 2, out[-3000:]
