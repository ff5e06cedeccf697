"""Bench scripts that lean on internals run to the end, on tiny sizes (each checks what it measures)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")

pytestmark = [
    pytest.mark.skipif(not os.path.exists(MPIRUN), reason="no mpirun beside this python"),
    pytest.mark.skipif(any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_RANK")), reason="already under mpirun"),
]


def run(*args):
    return run_all(args)[0]


def run_all(*arglists, at_once=4):
    """Each of ``arglists`` under ``mpirun -n 2``, ``at_once`` jobs at a time (most of a short run is starting
    up); their outputs, after asserting that every one succeeded."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", MPIEXEC_TIMEOUT="120")
    outs = []
    for k in range(0, len(arglists), at_once):
        wave = arglists[k:k + at_once]
        procs = [subprocess.Popen([MPIRUN, "-n", "2", sys.executable, "-m", "mpi4py", *args], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in wave]
        for args, (out, err, rc) in zip(wave, finish(procs)):
            assert rc == 0, f"{args}: {out}{err}"
            outs.append(out)
    return outs


def finish(procs, timeout=300):
    """(stdout, stderr, exit status) of each of ``procs`` (started together); any still running on an error is
    killed."""
    try:
        return [(*proc.communicate(timeout=timeout), proc.returncode) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()


def test_shm_pieces_compares_every_setting_with_mpi():
    S = "bench/studies/shm_pieces.py"
    outs = run_all((S, "--sizes", "64K,200K", "--pieces", "16K,64K", "--rounds", "2"),
                   (S, "--small", "--sizes", "4K", "--rounds", "2"),
                   (S, "--small", "--spins", "0,100", "--sizes", "4K", "--rounds", "2"),
                   (S, "--small", "--shards", "--sizes", "4K,1000", "--rounds", "2"),
                   (S, "--stream", "--sizes", "64K", "--rounds", "2"),
                   (S, "--stream", "--shards", "--sizes", "64K", "--rounds", "2"),
                   (S, "--spill", "--sizes", "64K", "--rounds", "2"),
                   (S, "--cma", "--pages", "huge", "--sizes", "64K,3M", "--pieces", "4K,1M", "--rounds", "2"))
    pieces, small, spins, shards, stream, stream_shards, spill, cma = outs
    lines = [ln for ln in pieces.splitlines() if not ln.startswith("#")]
    assert [ln.split()[0] for ln in lines] == ["64K", "200K"]
    assert all("MPI_Allreduce" in ln and "piece 16K" in ln and "piece 64K" in ln for ln in lines)
    assert "whole" in small and "pieces" in small
    assert "spin 0 " in spins and "spin 100 " in spins
    # The shard lines check their results once (a wrong one exits non-zero, failing run_all()).
    rows = [ln for ln in shards.splitlines() if not ln.startswith("#")]
    assert len(rows) == 2 and all(f" {k} " in ln for ln in rows for k in
                                  ("MPI_Reduce_scatter_block", "reduce_scatter", "MPI_Allgather", "allgather"))
    # Non-temporal stores or not: both lines' results are checked against MPI's.
    assert " cached " in stream and " streamed " in stream and "cached/streamed" in stream
    assert (" allgather cached " in stream_shards and " allgather streamed " in stream_shards
            and "allgather cached/streamed" in stream_shards)
    assert " kept " in spill and " spilled " in spill and "kept/spilled" in spill
    # The single copy by piece size beside the window, on placed buffers (each line's result checked).
    assert " cma 4K " in cma and " cma 1M " in cma and "shm/cma 1M" in cma


def test_shm_costs_prints_every_line_and_checks_the_allreduce():
    out = run("bench/studies/shm_costs.py", "--sizes", "1M,3M", "--rounds", "2")  # 3 MiB: a last piece that is short
    rows = [ln for ln in out.splitlines() if not ln.startswith("#")]
    assert [ln.split()[0] for ln in rows] == ["1M", "3M"]
    for ln in rows:
        assert all(f" {k} " in ln for k in ("link", "memcpy", "shm", "shm-nt", "ring", "private"))
        assert "busbw / link: shm" in ln and "shm - private" in ln


def test_tuner_watch_prints_rounds_and_checks_every_result():
    out = run("bench/studies/tuner_watch.py", "--bytes", "1M", "--seconds", "1", "--calls", "4")
    rows = [ln.split() for ln in out.splitlines() if not ln.startswith("#")]
    assert rows and all(len(r) == 6 and float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
    assert "#wrong 0" in out.splitlines()[-1]
    assert "after its calls slowed down" in out.splitlines()[-1] and "after quiet checks" in out.splitlines()[-1]


def test_tuner_trials_prints_both_orders_for_every_rank():
    out = run("bench/studies/tuner_trials.py", "--sizes", "4K")
    rows = [ln.split() for ln in out.splitlines() if not ln.startswith("#")]
    assert [r[1] for r in rows] == ["turns", "blocks"]
    for r in rows:  # "mpi:" t0 t1 "nbc:" t0 t1 "shm:" t0 t1
        assert r[2::3] == ["mpi:", "nbc:", "shm:"]
        assert all(float(v) > 0 for v in r[3:5] + r[6:8] + r[9:11])


def test_fastpath_overhead_runs_the_fast_path():
    """It settles the tuner by hand (internal state) and asserts the fast path ran."""
    proc = subprocess.run([sys.executable, "bench/studies/fastpath_overhead.py", "--calls", "200"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("us per call") == 7
    for what in ("allreduce", "reduce_scatter", "allgather"):
        assert f"Communicator.{what}(" in proc.stdout


def test_host_stream_compares_both_loops_and_checks_their_bits():
    """It calls the compiled loop with its threshold argument (internal) and exits non-zero if the two loops'
    results differ."""
    proc = subprocess.run([sys.executable, "bench/kernels/host_stream.py", "--sizes", "4K,100K", "--rounds", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.split("|")[0].strip() in ("4K", "100K")]
    assert len(rows) == 2, proc.stdout


def test_kernel_copy_times_both_directions_and_checks_the_bytes():
    """Pieces that divide the buffer and one that does not; it exits non-zero if a copied byte differs."""
    proc = subprocess.run([sys.executable, "bench/kernels/kernel_copy.py", "--bytes", "64K,100K", "--pieces", "4K,7K",
                           "--rounds", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if not line.startswith(("#", "buffer"))]
    assert [r[:2] for r in rows] == [["64K", "4K"], ["64K", "7K"], ["100K", "4K"], ["100K", "7K"]], proc.stdout
    assert all(len(r) == 10 and min(map(float, r[3:7] + r[8:])) > 0 for r in rows), proc.stdout  # 4 GB/s, 2 ratios


def test_first_calls_runs_a_cold_then_a_warm_job_and_checks_the_result():
    """It launches mpirun itself (twice, on one new Numba cache) and exits non-zero on a wrong result."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", MPIEXEC_TIMEOUT="240")
    proc = subprocess.run([sys.executable, "bench/studies/first_calls.py", "--bytes", "4K", "--calls", "5"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = [ln for ln in proc.stdout.splitlines() if ln.startswith("job ")]
    assert len(jobs) == 2 and "empty cache" in jobs[0] and "cache of job 1" in jobs[1], proc.stdout
    assert all("for the 5 calls" in ln and ln.endswith("result right") for ln in jobs), proc.stdout


def test_profile_engine_runs_cma_alone_and_the_tuned_path():
    """``--cma`` runs the single-copy allreduce whatever the tuner would pick; the script checks the last result."""
    out = run("bench/studies/profile_engine.py", "64K", "--cma", "-w", "1", "-n", "3")
    assert "path cma (forced)" in out, out
    out = run("bench/studies/profile_engine.py", "4K", "--small-bytes", "tuned", "-w", "1", "-n", "3")
    assert "2 ranks, 4K:" in out and "(forced)" not in out, out


def test_header_says_how_an_iteration_is_timed_per_placement():
    """Out of place: batches of calls per size; in place: one call, never an empty batch list."""
    both = run("bench/sweeps/allreduce.py", "-b", "4K", "-e", "8K", "-n", "2", "-w", "1", "--place", "both",
               "--no-progress", "--impls", "ddlkernels,mpi")
    assert "(out of place; per size: 4Kx" in both
    assert "# in place: an iteration is one call" in both
    inplace = run("bench/sweeps/allreduce.py", "-b", "4K", "-e", "8K", "-n", "2", "-w", "1", "--place", "in",
                  "--no-progress", "--impls", "ddlkernels,mpi")
    assert "back-to-back calls lasting" not in inplace
    assert "# in place: an iteration is one call" in inplace


def test_chunk_cost_counts_chunks_and_fits_their_cost():
    """Host arrays: one row per chunk size with the chunks a rank sends, the slope row, every result checked."""
    out = run("bench/studies/chunk_cost.py", "--bytes", "100K", "--chunks", "4K,10K,64K", "-n", "2", "-w", "1")
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if not ln.startswith("#")}
    # 25600 float32 in 2 blocks of 12800: chunks of 1024, 2560 and 16384 elements, 2 (p - 1) = 2 steps
    assert [rows[c][1] for c in ("4K", "10K", "64K")] == ["26", "10", "2"], out
    assert "us per chunk (slope)" in out and "wrong elements in all: 0" in out, out


def test_process_group_study_times_every_call_beside_gloo():
    pytest.importorskip("torch", reason="torch not installed (pip install -e .[torch])")
    out = run("bench/studies/process_group.py", "--sizes", "4K,1000", "--repeat", "1", "--warmup", "0")
    lines = [ln.split() for ln in out.splitlines() if ln and not ln.startswith(("#", "call"))]
    calls = [ln[0] for ln in lines if len(ln) == 6]
    assert calls == 2 * ["all_reduce", calls[1], calls[2], "broadcast", "send/recv"], out
    assert all(ln[-1] == "0" for ln in lines if len(ln) == 6), out
    assert "wrong results in all: 0" in out, out


def test_device_benchmarks_time_nothing_without_a_gpu(tmp_path):
    """Without a CUDA device the device sweep, the kernel benchmark and the GPU studies say why and exit 2,
    with no line of numbers (never a host stand-in), and so does tests/gpu/run_on_device.sh, which runs them
    where there is one."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a CUDA device is here: tests/gpu/run_on_device.sh runs the sweep")
    except Exception:  # noqa: BLE001 -- no CuPy or no driver: the case under test
        pass
    scripts = (("bench/sweeps/device_allreduce.py", "--sizes", "4K"),
               ("bench/kernels/device_kernels.py", "--sizes", "4K"),
               ("bench/studies/chunk_cost.py", "--device", "cuda", "--bytes", "4K"),
               ("bench/studies/ipc_schedules.py", "--sizes", "4K"),
               ("bench/studies/ipc_profile.py", "--sizes", "4K"),
               ("bench/studies/reduce_launch.py", "--sizes", "4K"),
               ("bench/studies/half_sums.py", "--sizes", "4K"),
               ("bench/studies/staged_pieces.py", "--sizes", "4K"))
    # All at once (each is mostly its imports), the GPU session's script too: its MPI and device probes run
    # here, and it stops before any step.
    procs = [subprocess.Popen([sys.executable, script, *args], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for script, *args in scripts]
    procs.append(subprocess.Popen(["bash", "tests/gpu/run_on_device.sh"], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path))))
    *done, (out, err, rc) = finish(procs, timeout=180)
    for (script, *_), (sout, serr, src) in zip(scripts, done):
        assert src == 2, script + sout + serr
        assert "no GPU to measure on" in sout and "nothing was timed" in sout, script
        assert "GB/s" not in sout and "##" not in sout, script
    assert rc == 2, out + err
    assert "device: none: " in out and "no CUDA device: nothing was tested" in out, out
    assert "===" not in out, out
