"""The benchmark harness (ddlkernels.tools.bench) counts wrong results, and every record it runs is right.

Runs under any rank count.  A benchmark is only as good as its check: here
every record (ddlkernels, MPI's own collective, the Sendrecv link) of every
collective must report 0 wrong elements on edge sizes, and records that
corrupt one element, write nothing, or modify their input must be caught,
and make the command exit 1.
"""

import numpy as np
import pytest

from ddlkernels.tools import bench as B
from ddlkernels.tools.bench import COLLECTIVES, Collective, make_impls, run_sweep

# 0 and 1 element, p-1 / p+1 elements and a prime, in float32 bytes.
EDGE_BYTES = lambda p: sorted({0, 4, 4 * max(p - 1, 1), 4 * (p + 1), 4 * 97, 1 << 12})  # noqa: E731


@pytest.mark.sweep
@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("int32", "max"), ("float64", "avg"), ("bfloat16", "sum"),
                                      ("float16", "prod"), ("int64", "avg")])
@pytest.mark.parametrize("inplace", [False, True])
def test_every_record_is_right(comm, kind, dtype, op, inplace):
    impls = make_impls(kind, which=("ddlkernels", "shared", "mpi", "link", "pyring", "linkchunk", "copy"),
                       ddl_options=({}, {"chunk_bytes": 64, "small_bytes": 0}))
    rows = run_sweep(comm, EDGE_BYTES(comm.Get_size()), impls, dtype=dtype, op=op, iters=2, warmup=1,
                     inplace=inplace, kind=kind, progress=False)
    ran = 0
    for r in rows:
        for name, m in r["impls"].items():
            assert m["wrong"] in (0, None), (kind, dtype, op, inplace, r["bytes"], name, m)
            ran += "skipped" not in m
    assert ran > 0
    if kind != "allreduce":  # equal MPI blocks: the buffer is rounded down to a multiple of p
        assert all(r["count"] % comm.Get_size() == 0 for r in rows)


def _broken(kind, how):
    """The MPI record of ``kind`` with its run wrapped to break the result in one way."""
    good = make_impls(kind, which=("mpi",))[0]
    out_key = {"allreduce": "out", "reduce_scatter": "out", "allgather": "out"}[kind]

    def run(st):
        if how == "nothing":
            return  # the output keeps the sentinel of the last check
        good.run(st)
        if how == "one":
            if st[out_key].size and st["comm"].Get_rank() == 0:
                st[out_key][-1] += 1
        elif how == "input":
            src = st["x"] if "x" in st else st["shard"]
            if src.size and st["comm"].Get_rank() == 0:
                src[0] += 1

    return Collective(f"broken-{how}", good.bus_factor, good.make, run, good.wrong, unsupported=good.unsupported)


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("how", ["nothing", "one", "input"])
def test_wrong_results_are_counted(comm, kind, how):
    p = comm.Get_size()
    nbytes = 4 * 8 * p
    rows = run_sweep(comm, [nbytes], [_broken(kind, how)], iters=3, warmup=2, kind=kind, progress=False)
    wrong = rows[0]["impls"][f"broken-{how}"]["wrong"]
    if how == "nothing":
        per_rank = 8 if kind == "reduce_scatter" else 8 * p  # output elements of one rank
        assert wrong == 5 * per_rank * p  # every element of every iteration on every rank
    elif how == "one":
        assert wrong == 5  # one element on rank 0, in each of 2 + 3 iterations
    else:
        assert wrong >= 5


def test_the_copy_bound_copies_and_is_checked(comm):
    # The "memcpy" line (each rank copies its input into its output) stands
    # beside allreduce only, out of place; a copy that writes nothing is caught.
    copy = make_impls("allreduce", which=("copy",))
    assert [c.name for c in copy] == ["memcpy"] and make_impls("reduce_scatter", which=("copy",)) == []
    n = 4 * 33
    rows = run_sweep(comm, [n], copy, iters=2, warmup=1, progress=False)
    assert rows[0]["impls"]["memcpy"]["wrong"] == 0 and rows[0]["impls"]["memcpy"]["path"] == "copy"
    assert "skipped" in run_sweep(comm, [n], copy, iters=1, warmup=0, inplace=True, progress=False)[0]["impls"]["memcpy"]
    idle = Collective("idle", copy[0].bus_factor, copy[0].make, lambda st: None, copy[0].wrong)
    rows = run_sweep(comm, [n], [idle], iters=2, warmup=1, progress=False)
    assert rows[0]["impls"]["idle"]["wrong"] == 3 * 33 * comm.Get_size()


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("inplace", [False, True])
def test_the_shared_input_line_reads_its_input_from_shared_memory(comm, kind, inplace):
    """The "ddlkernels (shared input)" line: its input (allgather: its shard) is Communicator.empty's
    memory, where a large call's peers read it (a piece-path size here), and every result is checked."""
    shared = make_impls(kind, which=("shared",))
    assert [c.name for c in shared] == ["ddlkernels (shared input)"]
    p = comm.Get_size()
    sizes = [4 * (p + 1), (1 << 18) + 4 * (p + 1)]
    rows = run_sweep(comm, sizes, shared, iters=2, warmup=1, inplace=inplace, kind=kind, progress=False)
    for r in rows:
        m = r["impls"]["ddlkernels (shared input)"]
        assert m["wrong"] == 0 or ("skipped" in m and inplace and kind != "allreduce"), r
    st = shared[0].make(comm, sizes[-1] // 4 // p * p, np.dtype(np.float32), "sum", inplace)
    dc = st["dc"]
    if "shm" in dc.algorithms:  # one node, 2 or more ranks: the input lies in a region of the window
        assert dc.algorithms["shm"].window().shared_at(st["x" if kind != "allgather" else "shard"])[0] > 0


@pytest.mark.parametrize("how", ["one", "nothing"])
def test_batched_samples_still_count_wrong_results_and_record_the_batch(comm, how):
    # min_sample_s: each timed iteration is a batch of back-to-back calls, the
    # same count on every rank; the check after each batch still sees a wrong
    # last result.
    nbytes = 4 * 8 * comm.Get_size()
    rows = run_sweep(comm, [nbytes], [_broken("allreduce", how)], iters=3, warmup=1, progress=False,
                     min_sample_s=0.05)  # generous: batch > 1 even when a probe call stalls
    batch = rows[0]["batch"]
    assert batch > 1 and comm.allgather(batch) == [batch] * comm.Get_size()
    wrong = rows[0]["impls"][f"broken-{how}"]["wrong"]
    # 1 warmup + 1 probe + 3 iterations are checked.
    assert wrong == (5 if how == "one" else 5 * 8 * comm.Get_size() * comm.Get_size())
    inplace = run_sweep(comm, [nbytes], make_impls("allreduce", which=("mpi",)), iters=2, warmup=0, inplace=True,
                        progress=False, min_sample_s=0.002)
    assert inplace[0]["batch"] == 1  # in place, calls would compound


def test_a_line_that_raises_leaves_no_buffer_pool_behind(comm):
    # Inside run_sweep the lines of a size share buffers (_placement["pool"]); after a line raised (on every
    # rank alike: no collective is left half done), a later _placed call must still get memory of its own.
    good = make_impls("allreduce", which=("mpi",))[0]

    def run(st):
        raise RuntimeError("this line fails")

    failing = Collective("failing", good.bus_factor, good.make, run, good.wrong)
    with pytest.raises(RuntimeError, match="this line fails"):
        run_sweep(comm, [4 * 16 * comm.Get_size()], [good, failing], iters=1, warmup=1, progress=False)
    assert B._placement["pool"] is None
    x = np.arange(16, dtype=np.float32)
    assert not np.shares_memory(B._placed(x), B._placed(x))


def test_link_counts_a_missing_message(comm):
    link = make_impls("allreduce", which=("link",))[0]
    silent = Collective("silent", link.bus_factor, link.make, lambda st: None, link.wrong,
                        algbw_bytes=link.algbw_bytes)
    rows = run_sweep(comm, [4 * 16 * comm.Get_size()], [silent], iters=2, warmup=0, progress=False)
    assert rows[0]["impls"]["silent"]["wrong"] == 2 * 16 * comm.Get_size()


def test_command_exits_1_on_a_wrong_result(comm, monkeypatch):
    from ddlkernels.tools import bench_cli as _cli_bench

    monkeypatch.setattr(B, "make_impls", lambda kind, *a, **k: [_broken(kind, "one")])
    args = ["-b", "1K", "-e", "1K", "-n", "2", "-w", "0", "--no-progress", "--quiet"]
    assert _cli_bench.main(args) == 1
    monkeypatch.undo()
    assert _cli_bench.main(args) == 0


def test_busbw_definitions(comm):
    p = comm.Get_size()
    n = 4 * 1024 * p
    rows = run_sweep(comm, [n], make_impls("allreduce"), iters=2, warmup=0, progress=False)
    for name, m in rows[0]["impls"].items():
        t = m["time_us_median"] * 1e-6
        if name == "Sendrecv link":
            want = (n // p if p > 1 else n) / t / 1e9
        else:
            want = n / t / 1e9 * (2 * (p - 1) / p if p > 1 else 1)
        assert m["busbw_GBps"] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("kind", COLLECTIVES)
def test_a_size_measured_again_mid_line_is_settled_untimed_and_the_sample_redone(comm, kind, monkeypatch):
    """The tuner's watch reopens a size during the timed samples: the harness settles it again and redoes the
    sample, so every timed sample ran a settled choice; the row says how often.  DRIFT = 0 makes every check
    reopen (checks then come every 64, 128, ... calls, as a re-measurement that keeps its winner backs off)."""
    from ddlkernels.select import tuner as _tuner

    if comm.Get_size() == 1:
        pytest.skip("one rank: no tuner")
    monkeypatch.setattr(_tuner, "DRIFT", 0.0)
    monkeypatch.setattr(_tuner, "WATCH_CALLS", 8)
    impls = make_impls(kind, which=("ddlkernels", "mpi"))
    nbytes = _tuner.WATCH_FROM * comm.Get_size()  # watched for every collective (allgather: per shard too)
    rows = run_sweep(comm, [nbytes], impls, iters=20, warmup=1, kind=kind, progress=False)
    ddl = rows[0]["impls"]["ddlkernels"]
    assert ddl["wrong"] == 0 and rows[0]["impls"][next(n for n in rows[0]["impls"] if n != "ddlkernels")]["wrong"] == 0
    assert ddl["remeasured"] >= 1, ddl
    assert "re-measured" in ddl["path"]
    assert comm.allgather(ddl["remeasured"]) == [ddl["remeasured"]] * comm.Get_size()


@pytest.mark.parametrize("interleave", [True, False])
def test_a_line_settling_in_warmup_runs_amid_the_other_lines_as_its_timed_samples_do(comm, interleave):
    """A line whose tuner is still measuring warms up in rounds with the other lines (interleaved sweeps), so
    its trials run in the conditions its timed samples then run in; with ``interleave=False`` each line warms
    up alone, just before its own timed samples."""
    mpi = make_impls("allreduce", which=("mpi",))[0]
    calls = []

    def line(name, trials):
        left = {"n": trials}

        def run(st):
            calls.append(name)
            left["n"] -= 1
            mpi.run(st)

        # settling: the same on every rank (every rank counts the same calls)
        return Collective(name, mpi.bus_factor, mpi.make, run, mpi.wrong, settling=lambda st: left["n"] > 0)

    rows = run_sweep(comm, [4 * 16 * comm.Get_size()], [line("tuned", 7), line("plain", 0)], iters=2, warmup=2,
                     interleave=interleave, progress=False)
    assert all(m["wrong"] == 0 for m in rows[0]["impls"].values())
    # First a set-up call of each line (the first warmup call), then:
    if interleave:  # rounds of both lines until "tuned" has made its 7 calls, then 2 timed rounds
        assert calls == ["tuned", "plain"] + ["tuned", "plain"] * 6 + ["tuned", "plain"] * 2, calls
    else:  # each line's warmup (the rest of tuned's 7, plain's second) and its 2 timed calls
        assert calls == ["tuned", "plain"] + ["tuned"] * (6 + 2) + ["plain"] * (1 + 2), calls


def test_job_speaks_nccl_tests(comm, capsys, tmp_path):
    """``job -d half -o avg -c 1 --csv``: nccl-tests' type and op names in the rows, its closing lines, the CSV
    records, every record checked and right."""
    from ddlkernels.tools.cli import main

    path = str(tmp_path / "job.csv") if comm.Get_rank() == 0 else None
    path = comm.bcast(path, root=0)
    main(["job", "-b", "1K", "-e", "4K", "-f", "4", "-n", "2", "-w", "1", "-d", "half", "-o", "avg", "-c", "1",
          "--min-sample-ms", "0", "--csv", path])
    out = capsys.readouterr().out
    if comm.Get_rank() != 0:
        assert out == ""
        return
    rows = [ln.split() for ln in out.splitlines() if ln and not ln.startswith("#")]
    assert [(r[0], r[1], r[2], r[3], r[4], r[8], r[9]) for r in rows] == [
        (b, str(int(b) // 2), "half", "avg", "-1", "0", line) for b in ("1024", "4096") for line in ("ddl", "MPI")]
    assert max(len(ln) for ln in out.splitlines()) <= 120
    assert "# Out of bounds values : 0 OK" in out
    assert float(next(ln for ln in out.splitlines() if ln.startswith("# Avg bus bandwidth    : ")).split()[-1]) > 0
    import csv

    with open(path) as f:
        recs = list(csv.DictReader(f))
    assert [(r["line"], r["size"], r["type"], r["redop"], r["wrong"]) for r in recs] == [
        (line, b, "half", "avg", "0") for b in ("1024", "4096") for line in ("ddlkernels", "MPI_Allreduce")]


def test_job_says_which_buffers_and_refuses_a_gpu_it_does_not_have(comm, capsys):
    """Without a GPU on every rank ``job`` (``--device auto``) runs on host buffers and its header says why;
    ``--device cuda`` exits 2 having timed nothing (tests/gpu/run_on_device.sh runs the GPU side)."""
    from ddlkernels.tools.bench.device import gpu_everywhere
    from ddlkernels.tools.cli import main

    cp, why = gpu_everywhere(comm)
    if cp is not None:
        pytest.skip("a GPU on every rank: the job runs on it (tests/gpu/run_on_device.sh)")
    main(["job", "-b", "1K", "-e", "1K", "-n", "2", "-w", "1", "--min-sample-ms", "0"])
    out = capsys.readouterr().out
    if comm.Get_rank() == 0:
        assert "host (numpy) buffers: no GPU here (" in " ".join(ln.lstrip("# ") for ln in out.splitlines())
    with pytest.raises(SystemExit) as exc:
        main(["job", "--device", "cuda", "-b", "1K", "-e", "1K"])
    assert exc.value.code == 2
    out = capsys.readouterr().out
    assert ("nothing was timed" in out and "busbw" not in out) if comm.Get_rank() == 0 else out == ""


def test_bench_csv_to_stdout_replaces_the_table(comm, capsys):
    from ddlkernels.tools import bench_cli as _cli_bench

    rc = _cli_bench.main(["--collective", "reduce_scatter", "-d", "double", "-o", "max", "-b", "1K", "-e", "1K",
                          "-n", "2", "-w", "1", "-c", "0", "--impls", "ddlkernels,mpi", "--no-progress",
                          "--min-sample-ms", "0", "--csv", "-"])
    assert rc == 0
    out = capsys.readouterr().out
    if comm.Get_rank() != 0:
        return
    lines = out.splitlines()
    assert lines[0].startswith("collective,line,size,count,type,redop,root,placement,")
    assert [ln.split(",")[:6] for ln in lines[1:]] == [
        ["reduce_scatter", "ddlkernels", str(1024 // (8 * comm.Get_size()) * 8 * comm.Get_size()),
         str(1024 // (8 * comm.Get_size()) * comm.Get_size()), "double", "max"],
        ["reduce_scatter", "MPI_Reduce_scatter_block", str(1024 // (8 * comm.Get_size()) * 8 * comm.Get_size()),
         str(1024 // (8 * comm.Get_size()) * comm.Get_size()), "double", "max"]]
    assert all(ln.split(",")[11] == "" for ln in lines[1:])  # -c 0: nothing checked, nothing counted
