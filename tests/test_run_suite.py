"""tests/run_suite.py launches a run again only when Open MPI's launcher failed before any test ran."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run_suite  # noqa: E402

PMIX = ("--------------------------------------------------------------------------\n"
        "The PMIx server's listener thread failed to start. We cannot\ncontinue.\n")


def test_only_a_launcher_failure_before_any_test_counts_as_one():
    assert run_suite.launch_failed(PMIX)
    # Tests ran (a pytest summary): whatever else it says, the run's result stands.
    assert not run_suite.launch_failed(PMIX + "1 failed, 3 passed in 2.00s\n")
    assert not run_suite.launch_failed("E   AssertionError\n1 failed in 0.50s\n")
    assert not run_suite.launch_failed("prterun detected that one or more processes exited with non-zero status")


def _flaky(tmp_path, fails):
    """A command that prints the launcher failure and exits 213 ``fails`` times, then passes one test."""
    state = tmp_path / "launches"
    state.write_text("0")
    script = tmp_path / "flaky.py"
    script.write_text(
        "import sys, pathlib\n"
        f"p = pathlib.Path({str(state)!r}); k = int(p.read_text()) + 1; p.write_text(str(k))\n"
        f"if k <= {fails}:\n"
        f"    print({PMIX!r}); sys.exit(213)\n"
        "print('1 passed in 0.01s')\n")
    return [sys.executable, str(script)], state


def test_a_failed_launch_is_launched_again_and_then_counts(tmp_path, capsys):
    cmd, state = _flaky(tmp_path, fails=1)
    rc, counts = run_suite.run(cmd, dict(os.environ), "flaky")
    assert (rc, counts["passed"], state.read_text()) == (0, 1, "2")
    assert "launching again (2 of 3)" in capsys.readouterr().out


def test_a_launcher_that_keeps_failing_fails_the_run(tmp_path):
    cmd, state = _flaky(tmp_path, fails=99)
    rc, counts = run_suite.run(cmd, dict(os.environ), "flaky")
    assert rc == 213 and not any(counts.values()) and state.read_text() == str(run_suite.LAUNCHES)


def test_a_test_failure_is_not_launched_again(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('1 failed in 0.01s')\nsys.exit(1)\n")
    rc, counts = run_suite.run([sys.executable, str(script)], dict(os.environ), "fails")
    assert rc == 1 and counts["failed"] == 1


def _passed(out):
    return [line.split()[0] for line in out.splitlines() if line.endswith("PASSED") or " PASSED " in line]


def test_processes_side_by_side_run_every_test_once(capsys):
    # Three files, two processes: each test passes in exactly one of them, as in one process alone.
    files = ["tests/test_segments.py", "tests/test_schedule.py", "tests/test_piece_cuts.py"]
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *files]
    rc, alone = run_suite.run_shared(cmd, dict(os.environ), "alone", 1)
    one = _passed(capsys.readouterr().out)
    assert rc == 0 and alone["passed"] == len(one) == len(set(one)) > 0
    rc, shared = run_suite.run_shared(cmd, dict(os.environ), "shared", 2)
    two = _passed(capsys.readouterr().out)
    assert rc == 0 and shared == alone
    assert sorted(two) == sorted(one)


def test_a_file_is_claimed_once(tmp_path):
    import share_files

    assert share_files.claim(str(tmp_path), "tests/test_a.py")
    assert not share_files.claim(str(tmp_path), "tests/test_a.py")
    assert share_files.claim(str(tmp_path), "tests/test_b.py")
