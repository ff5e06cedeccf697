"""Pure parts of the benchmark harness: sizes, the tuned-algorithm table against ompi_info, tables, JSON, plots."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ddlkernels._bench import (TUNED_ALGORITHMS, dump_json, format_size, format_table, parse_size, plot_rows,
                               sweep_sizes, tuned_label)


def test_sizes():
    assert parse_size("4K") == 4096 and parse_size("64M") == 64 << 20 and parse_size("123") == 123
    for n in (0, 1, 1000, 4096, 3 << 20, 1 << 30):
        assert parse_size(format_size(n)) == n
    assert sweep_sizes(4096, 64 << 20, 4)[-1] == 64 << 20
    with pytest.raises(ValueError):
        parse_size("4 parsecs")


def _ompi_info():
    exe = os.path.join(os.path.dirname(sys.executable), "ompi_info")
    return exe if os.path.exists(exe) else shutil.which("ompi_info")


@pytest.mark.skipif(_ompi_info() is None, reason="ompi_info not found: the MPI in use is not Open MPI")
@pytest.mark.parametrize("param", sorted(TUNED_ALGORITHMS))
def test_tuned_numbers_match_ompi_info(param):
    out = subprocess.run([_ompi_info(), "--param", "coll", "tuned", "--level", "9"], capture_output=True,
                         text=True, timeout=60).stdout
    block = out.split(f'"coll_tuned_{param}_algorithm"', 1)
    assert len(block) == 2, f"ompi_info lists no coll_tuned_{param}_algorithm"
    valid = re.search(r"Valid values: ([^\n]+)", block[1]).group(1)
    listed = {name: int(num) for num, name in re.findall(r"(\d+)\|(\w+)", valid)}
    for name, num in TUNED_ALGORITHMS[param].items():
        assert listed.get(name) == num, (param, name, num, valid)


def test_tuned_label():
    env = {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1", "OMPI_MCA_coll_tuned_allreduce_algorithm": "6"}
    assert tuned_label("allreduce", env) == "[tuned rabenseifner]"
    assert tuned_label("allgather", env) == ""
    assert tuned_label("allreduce", {"OMPI_MCA_coll_tuned_allreduce_algorithm": "6"}) == ""  # not in force


def _rows():
    def m(t, bus, wrong=0, path=""):
        return {"time_us_min": t, "time_us_median": t, "algbw_GBps": bus, "busbw_GBps": bus, "busbw_GBps_max": bus,
                "wrong": wrong, "path": path}

    return [{"collective": "allreduce", "bytes": b, "count": b // 4, "dtype": "float32", "op": "sum", "ranks": 2,
             "inplace": False,
             "impls": {"ddlkernels": m(10.0, 2.0 * i + 1, path="ring"), "MPI_Allreduce": m(20.0, 1.0),
                       "Sendrecv link": m(5.0, 4.0),
                       "MPI_Allreduce[tuned ring]": {"skipped": "no MPI datatype", "wrong": None}}}
            for i, b in enumerate((4096, 65536))]


def test_table_ratios_and_json(tmp_path):
    rows = _rows()
    text = format_table(rows, ["ddlkernels", "MPI_Allreduce", "Sendrecv link", "MPI_Allreduce[tuned ring]"],
                        ratio_of=[("ddlkernels", "MPI_Allreduce"), ("ddlkernels", "Sendrecv link")])
    lines = text.splitlines()
    assert "ddl/MPI" in lines[0] and "ddl/link" in lines[0]
    assert re.search(r"\|\s+1\.00 \|\s+0\.25 \| ring$", lines[2]), lines[2]
    assert re.search(r"\|\s+3\.00 \|\s+0\.75 \| ring$", lines[3]), lines[3]
    assert "skipped: no MPI datatype" in text
    dump_json(tmp_path / "r.json", {"ranks": 2}, rows)
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == rows


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    plot_rows(tmp_path / "r.png", _rows(), title="test")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _smaps(address):
    """The /proc/self/smaps fields of the mapping holding ``address`` (name -> the words after it), or None."""
    fields = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if fields is not None:
                    return fields
                lo, hi = (int(v, 16) for v in head.split("-"))
                fields = {} if lo <= address < hi else None
            elif fields is not None:
                fields[head.rstrip(":")] = line.split()[1:]
    return fields


def _thp_mode():
    """The machine's transparent huge page setting ("always", "madvise", "never"), or None."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


@pytest.mark.parametrize("pages,flag", [("small", "nh"), ("huge", "hg")])
@pytest.mark.parametrize("shape,dtype", [((0,), np.float32), ((1,), np.int64), ((3, 5), np.float16),
                                         ((1 << 20,), np.float32), ((3 << 20,), np.float32)])
def test_bench_buffers_are_own_copies_on_the_pages_asked_for(shape, dtype, pages, flag):
    """``_placed``: the same values in writable memory of its own; on Linux a mapping marked no-huge-pages
    (VmFlags ``nh``) or huge pages (``hg``) for every line alike; huge ones start past a 2 MiB boundary by
    an offset that differs from one buffer to the next."""
    from ddlkernels import _bench

    before = _bench._placement["pages"]
    _bench._placement["pages"] = pages
    try:
        a = (np.arange(int(np.prod(shape))) % 251).astype(dtype).reshape(shape)
        b, c = _bench._placed(a), _bench._placed(a)
    finally:
        _bench._placement["pages"] = before
    for x in (b, c):
        assert x.shape == a.shape and x.dtype == a.dtype and np.array_equal(a, x)
        assert x.flags.writeable and x.flags.c_contiguous and not np.shares_memory(a, x)
    assert not np.shares_memory(b, c)
    if b.size:
        b.flat[0] = 7
        assert a.flat[0] == 0 and c.flat[0] == 0  # copies, not views
        if pages == "huge":
            offsets = {x.ctypes.data % _bench._HUGE for x in (b, c)}
            assert len(offsets) == 2 and all(0 < o < _bench._HUGE for o in offsets)
    if sys.platform.startswith("linux") and b.nbytes:
        fields = _smaps(b.ctypes.data)
        assert fields is not None and flag in fields["VmFlags"], fields
        # Private memory, as a numpy array's own, and on the pages asked for: shared (shmem) pages would
        # take no huge pages whatever the advice (the harness mapped so until this was checked).
        assert "sh" not in fields["VmFlags"], fields
        huge_kib = int(fields["AnonHugePages"][0])
        if pages == "small":
            assert huge_kib == 0, fields
        elif b.nbytes >= 2 * _bench._HUGE and _thp_mode() in ("always", "madvise"):
            assert huge_kib >= 2048, f"no huge page under a {b.nbytes}-byte buffer: {fields}"


@pytest.mark.parametrize("pages", ["small", "huge"])
def test_lines_of_a_size_share_a_buffer_per_role_when_it_holds_the_same_bytes(pages):
    """``run_sweep`` restarts ``_placed``'s sequence for each line: a line's n-th buffer is the one the line
    before placed n-th, if that holds the same bytes (so lines differ by what they run, not by where their
    buffers lie); other bytes, another shape or dtype get memory of their own."""
    from ddlkernels import _bench

    before = dict(_bench._placement)
    _bench._placement.update(pages=pages, pool={})
    try:
        x, out = np.arange(4096, dtype=np.float32), np.full(4096, _bench.SENTINEL, np.float32)
        _bench._placement["next"] = 0
        line_a = [_bench._placed(x), _bench._placed(out)]
        _bench._placement["next"] = 0
        line_b = [_bench._placed(x), _bench._placed(out)]
        _bench._placement["next"] = 0
        line_c = [_bench._placed(x + 1), _bench._placed(out.astype(np.float64)), _bench._placed(out)]
        _bench._placement.update(next=0, pool=None)  # outside run_sweep: nothing shared
        alone = _bench._placed(x)
    finally:
        _bench._placement.clear()
        _bench._placement.update(before)
    assert line_b[0] is line_a[0] and line_b[1] is line_a[1]
    assert not np.shares_memory(line_a[0], line_a[1])
    assert not any(np.shares_memory(c, a) for c in line_c for a in line_a)
    assert np.array_equal(line_c[0], x + 1) and line_c[1].dtype == np.float64
    assert not np.shares_memory(alone, line_a[0]) and np.array_equal(alone, x)


def test_run_sweep_refuses_unknown_pages():
    from ddlkernels._bench import run_sweep

    with pytest.raises(ValueError, match="pages must be one of small, huge"):
        run_sweep(None, [], [], pages="big")
