"""bench/sweeps/targets.py reads a sweep's JSON into the issue's targets: each ratio, its placement, and the verdict."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def _targets():
    spec = importlib.util.spec_from_file_location("targets", os.path.join(ROOT, "bench", "sweeps", "targets.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _line(busbw, path=""):
    return {"busbw_GBps": busbw, "wrong": 0, "path": path}


def test_ratios_placements_and_the_copy_ceiling(tmp_path):
    rows = []
    for inplace in (False, True):
        for nbytes, ddl, mpi, link, copy in ((4 * MiB, 9.0, 6.0, 20.0, 30.0), (16 * MiB, 8.0, 5.0, 10.0, 12.0)):
            impls = {"ddlkernels": _line(ddl + inplace, "shm"), "MPI_Allreduce": _line(mpi), "Sendrecv link": _line(link)}
            impls["memcpy"] = {"skipped": "the copy bound is out of place", "wrong": None} if inplace else _line(copy)
            rows.append({"collective": "allreduce", "bytes": nbytes, "inplace": inplace, "impls": impls})
    meta = {"ranks": 2, "mpi": "Open MPI v5, test", "iters": 3,
            "start": {"loadavg": [0.5, 0.5, 0.5], "cpus": 2, "date_utc": "2026-11-22T00:00:00Z"}}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    _, items = _targets().sweep_targets(str(path))
    got = {what: (measured, ok) for what, measured, _, ok in items}
    assert got["2 ranks, 4 MiB: ddlkernels / MPI_Allreduce"] == ("1.50", True)
    assert got["2 ranks, 16 MiB: ddlkernels / MPI_Allreduce"] == ("1.60", False)
    assert got["2 ranks, 16 MiB in place: ddlkernels / MPI_Allreduce"] == ("1.80", True)
    assert got["2 ranks, 16 MiB: ddlkernels / Sendrecv link"] == ("0.80", False)
    assert got["2 ranks, 16 MiB in place: ddlkernels / Sendrecv link"] == ("0.90", True)
    assert got["2 ranks, 16 MiB: (context) memcpy / Sendrecv link"][0] == "1.20; ddlkernels / memcpy 0.67"
    assert "2 ranks, 16 MiB in place: (context) memcpy / Sendrecv link" not in got  # skipped in place
    assert got["2 ranks, every size: min ddlkernels / MPI_Allreduce"] == ("1.50 (at 4194304 B, path shm)", True)
    assert got["2 ranks: #wrong"] == ("0", True)


def test_kernel_rows_per_dtype_against_the_copy_of_the_same_type_interleaved_where_run(tmp_path):
    def bench(name, gbps):
        return {"name": name, "extra_info": {"GBps_median": gbps}}

    data = {"benchmarks": [
        bench("bench_backend_reduce[16M-float32]", 40.0), bench("bench_stream_copy[16M-float32]", 50.0),
        bench("bench_backend_reduce[16M-float16]", 30.0), bench("bench_stream_copy[16M-float16]", 60.0),
        bench("bench_backend_reduce_inplace[16M-bfloat16]", 45.0), bench("bench_stream_copy[16M-bfloat16]", 50.0),
        bench("bench_numpy_add[16M-float16]", 1.0),  # not the backend: no row
        {"name": "bench_reduce_vs_copy_interleaved[1M]",
         "extra_info": {"reduce_over_copy": 0.9, "reduce_GBps_median": 90.0, "copy_GBps_median": 100.0}},
        # timed apart at a size that also ran interleaved: context, whatever its ratio
        bench("bench_backend_reduce[1M-float32]", 30.0), bench("bench_stream_copy[1M-float32]", 60.0),
    ]}
    path = tmp_path / "k.json"
    path.write_text(json.dumps(data))
    _, items = _targets().kernel_targets(str(path))
    got = {what: (measured, ok) for what, measured, _, ok in items}
    assert got == {
        "backend_reduce 1M: / STREAM copy, interleaved rounds": ("90% (90.0 vs 100.0 GB/s)", True),
        "(context) backend_reduce 1M: / STREAM copy, timed apart": ("50% (30.0 vs 60.0 GB/s)", True),
        "backend_reduce 16M: / STREAM copy": ("80% (40.0 vs 50.0 GB/s)", True),
        "backend_reduce_inplace 16M bfloat16: / STREAM copy": ("90% (45.0 vs 50.0 GB/s)", True),
        "backend_reduce 16M float16: / STREAM copy": ("50% (30.0 vs 60.0 GB/s)", False),
    }
