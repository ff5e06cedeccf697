"""bench/targets.py reads a sweep's JSON into the issue's targets: each ratio, its placement, and the verdict."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def _targets():
    spec = importlib.util.spec_from_file_location("targets", os.path.join(ROOT, "bench", "targets.py"))
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
