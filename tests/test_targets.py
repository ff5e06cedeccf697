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


def _device_run(tmp_path, name, p, rows):
    path = tmp_path / name
    path.write_text(json.dumps({"gpu": "a test GPU", "ranks": p, "dtype": "float32", "missing": {}, "rows": rows}))
    return str(path)


def _ms_line(ms, nbytes, p, wrong=0):
    return {"ms": ms, "busbw_GBps": nbytes / (ms * 1e-3) * 2 * (p - 1) / p / 1e9, "wrong": wrong}


def test_device_targets_of_issue_31_at_their_thresholds(tmp_path):
    """Each GPU target judged on either side of its threshold: busbw, the speed-up over the hand-rolled loop,
    staged against host arrays, the kernels' worst case per dtype and alignment, host time, pack, wrong."""
    t = _targets()
    big = 256 * MiB
    ms300 = big / 300e9 * 1e3  # 2 ranks: busbw = bytes / t
    rows2 = [{"bytes": MiB, "lines": {"ddlkernels": _ms_line(0.5, MiB, 2), "hand-rolled": _ms_line(0.999, MiB, 2)},
              "ddlkernels_ran": "ipc"},
             {"bytes": 64 * MiB, "lines": {"ddlkernels": _ms_line(1.0, 64 * MiB, 2),
                                           "hand-rolled": _ms_line(80.0, 64 * MiB, 2),
                                           "ddlkernels staged": _ms_line(20.0, 64 * MiB, 2),
                                           "ddlkernels host": _ms_line(17.0, 64 * MiB, 2)}, "staged_ran": "host"},
             {"bytes": big, "lines": {"ddlkernels": _ms_line(ms300, big, 2),
                                      "hand-rolled": _ms_line(ms300 * 99.9, big, 2, wrong=1)}}]
    rows4 = [{"bytes": big, "lines": {"ddlkernels": _ms_line(big * 1.5 / 199e9 * 1e3, big, 4),
                                      "hand-rolled": _ms_line(300.0, big, 4)}}]
    got = {}
    for path in (_device_run(tmp_path, "np2.json", 2, rows2), _device_run(tmp_path, "np4.json", 4, rows4)):
        _, items = t.device_sweep_targets(path)
        got.update({what: ok for what, _, _, ok in items})
    assert got == {"2 ranks: #wrong": False, "2 ranks, 1 MiB: ddlkernels / hand-rolled loop": False,
                   "2 ranks, 64 MiB: staged / host arrays": True, "2 ranks, 256 MiB: ddlkernels busbw": True,
                   "2 ranks, 256 MiB: ddlkernels / hand-rolled loop": False, "4 ranks: #wrong": True,
                   "4 ranks, 256 MiB: ddlkernels busbw": False}
    reduce = [{"case": case, "GBps": {"ddlkernels": ddl, "torch.add": 1000.0}} for case, ddl in (
        ("reduce 64M float32 out", 970.0), ("reduce 512M float32 in place", 990.0), ("reduce 1M float16 out", 500.0),
        ("reduce 256M float16 out", 969.0), ("reduce 256M float16 out +1", 980.0))]
    kern = tmp_path / "kernels.json"
    kern.write_text(json.dumps({"gpu": "a test GPU", "reduce": reduce, "wrong": 0,
                                "host_us_per_launch": {"ddlkernels": 12.1, "cp.add": 10.0},
                                "pack": {"tensors": 3, "bytes": 1, "ms": 1.0, "torch_cat_ms": 0.99},
                                "fold2_into2_256M_ms": 0.5, "add_copy_256M_ms": 0.6}))
    _, items = t.device_kernel_targets(str(kern))
    got = {what: (measured.split()[0], ok) for what, measured, _, ok in items}
    assert got == {"reduce / torch.add, 64-512 MiB float32: the worst": ("0.97", True),  # 1 MiB is out of range
                   "reduce / torch.add, 64-512 MiB float16: the worst": ("0.969", False),
                   "reduce / torch.add, 64-512 MiB float16, one element off: the worst": ("0.98", True),
                   "host time per launch / cupy.add's": ("1.21", False),
                   "pack of 3 tensors / torch.cat": ("0.99", False), "kernels: #wrong": ("0", True),
                   "(context) the 2-rank one-GPU fold, 256 MiB": ("0.500", True)}
    assert "busbw at most 537 GB/s" in next(m for what, m, _, _ in items if "one-GPU fold" in what)


def test_device_targets_read_every_committed_gpu_run():
    """Every committed GPU result (bench/results/*_h*.json) gives a verdict for each target it measured."""
    import glob

    t = _targets()
    sweeps = sorted(glob.glob(os.path.join(ROOT, "bench", "results", "device_allreduce_np*_h*.json")))
    kernels = sorted(glob.glob(os.path.join(ROOT, "bench", "results", "device_kernels_h*.json")))
    assert sweeps and kernels
    for path in sweeps:
        _, items = t.device_sweep_targets(path)
        assert any("256 MiB: ddlkernels busbw" in what for what, *_ in items), path
        assert any("1 MiB: ddlkernels / hand-rolled loop" in what for what, *_ in items), path
    for path in kernels:
        _, items = t.device_kernel_targets(path)
        assert sum("reduce / torch.add" in what for what, *_ in items) == 6, path
