"""Pure parts of the benchmark harness: sizes, the tuned-algorithm table against ompi_info, tables, JSON, plots."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ddlkernels.tools.bench import (TUNED_ALGORITHMS, dump_json, format_size, format_table, parse_size, plot_rows,
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
    text = format_table(rows, ["ddlkernels", "MPI_Allreduce", "Sendrecv link", "MPI_Allreduce[tuned ring]"])
    lines = text.splitlines()
    assert "ddl/x" in lines[1]
    body = [ln.split() for ln in lines[3:] if not ln.startswith("#")]
    # Per size: ddl (no ratio, its path), MPI (ddl/MPI), link (ddl/link), the skipped tuned line.
    assert body[0][9:] == ["ddl", "ring"] and body[1][9:] == ["MPI", "1.00"] and body[2][9:] == ["link", "0.25"]
    assert body[3][9:] == ["MPI[ring]", "skipped"]
    assert body[4][9:] == ["ddl", "ring"] and body[5][9:] == ["MPI", "3.00"] and body[6][9:] == ["link", "0.75"]
    assert "# MPI_Allreduce[tuned ring] skipped: no MPI datatype" in text
    dump_json(tmp_path / "r.json", {"ranks": 2}, rows)
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == rows


# nccl-tests 2.19, src/util.cu writeResultHeader and writeBenchmarkLinePreamble/Body: the columns of one
# placement, and src/common.cu test_typenames: the type names.
NCCL_COLUMNS = ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"]
NCCL_TYPENAMES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double", "bfloat16",
                  "f8e4m3", "f8e5m2"]


_ITEMSIZE = {"float32": 4, "float16": 2, "float64": 8, "bfloat16": 2, "int32": 4, "int64": 8}


def _all_lines_rows(dtype="float32", wrong=0, inplace=False):
    """Every line the harness has, with the longest names and paths it prints."""
    def m(bus, path=""):
        return {"time_us_min": 123456.7, "time_us_median": 123456.7, "algbw_GBps": bus, "busbw_GBps": bus,
                "busbw_GBps_max": bus, "wrong": wrong, "path": path, "remeasured": 0}

    names = ["ddlkernels", "ddlkernels (shared input)", "ddl ring", "MPI_Allreduce",
             "MPI_Allreduce[tuned rabenseifner]", "Sendrecv link", "python ring", "chunked link", "memcpy"]
    rows = []
    for b in (0, 8, 1 << 30):
        impls = {n: m(1.5 + k, "shm-nt (re-measured 2x)" if n.startswith("ddl") else "") for k, n in enumerate(names)}
        impls["ddlkernels"]["remeasured"] = 2
        rows.append({"collective": "allreduce", "bytes": b, "count": b // _ITEMSIZE[dtype], "dtype": dtype, "op": "prod",
                     "ranks": 1024, "inplace": inplace, "impls": impls})
    return rows, names


@pytest.mark.parametrize("dtype,name", [("float32", "float"), ("float16", "half"), ("float64", "double"),
                                        ("bfloat16", "bfloat16"), ("int32", "int32"), ("int64", "int64")])
def test_table_has_nccl_tests_columns_and_types_and_fits_120_columns(dtype, name):
    rows, names = _all_lines_rows(dtype)
    lines = format_table(rows, names).splitlines()
    assert lines[1].split()[1:10] == NCCL_COLUMNS
    assert "out-of-place" in lines[0]
    assert max(len(ln) for ln in lines) <= 120, max(lines, key=len)
    body = [ln.split() for ln in lines[3:] if not ln.startswith("#")]
    assert len(body) == len(rows) * len(names)
    for f in body:
        assert f[2] == name and name in NCCL_TYPENAMES and f[3] == "prod" and f[4] == "-1" and f[8] == "0"
        assert int(f[1]) * _ITEMSIZE[dtype] == int(f[0])
    assert body[0][-1] == "shm-nt+"  # re-measured: marked, explained below the table
    assert any("path+" in ln for ln in lines)
    lines = format_table(_all_lines_rows(dtype, wrong=None, inplace=True)[0], names).splitlines()
    assert "in-place" in lines[0] and all(ln.split()[8] == "N/A" for ln in lines[3:] if not ln.startswith("#"))


def test_footer_is_nccl_tests_and_scripts_that_read_it_read_ours():
    from ddlkernels.tools.bench import format_footer

    rows = _rows()
    names = ["ddlkernels", "MPI_Allreduce", "Sendrecv link", "MPI_Allreduce[tuned ring]"]
    text = format_footer(rows, names)
    assert text.splitlines()[0] == "# Out of bounds values : 0 OK"
    # What scripts do with nccl-tests' output: the one line, its last field.
    avg = [ln for ln in text.splitlines() if "Avg bus bandwidth" in ln]
    assert len(avg) == 1 and avg[0].startswith("# Avg bus bandwidth    : ")
    assert float(avg[0].split()[-1]) == pytest.approx((1.0 + 3.0) / 2)  # ddlkernels' busbw, both sizes
    assert "#   MPI_Allreduce: average bus bandwidth 1 GB/s" in text
    rows[0]["impls"]["MPI_Allreduce"]["wrong"] = 3
    assert format_footer(rows, names).splitlines()[0] == "# Out of bounds values : 3 FAILED"


def test_csv_has_one_record_per_size_and_line():
    import csv
    import io

    from ddlkernels.tools.bench import CSV_COLUMNS, write_csv

    rows = _rows()
    out = io.StringIO()
    write_csv(out, rows, ["ddlkernels", "MPI_Allreduce", "Sendrecv link", "MPI_Allreduce[tuned ring]"])
    recs = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert tuple(recs[0]) == CSV_COLUMNS
    assert len(recs) == 2 * 3  # the skipped line has no records
    assert recs[0]["type"] == "float" and recs[0]["root"] == "-1" and recs[0]["placement"] == "out-of-place"
    assert recs[0]["line"] == "ddlkernels" and float(recs[0]["busbw_GBps"]) == 1.0 and recs[0]["path"] == "ring"


@pytest.mark.parametrize("name,want", [("float", "float32"), ("half", "float16"), ("double", "float64"),
                                       ("bfloat16", "bfloat16"), ("int32", "int32"), ("int64", "int64"),
                                       ("float32", "float32"), ("FLOAT", "float32"), ("bf16", "bfloat16")])
def test_type_names_are_nccl_tests_first(name, want):
    from ddlkernels.tools.bench import nccl_type_name, parse_dtype
    from ddlkernels._dtypes import dtype_name

    assert dtype_name(parse_dtype(name)) == want
    assert nccl_type_name(parse_dtype(name)) in NCCL_TYPENAMES


@pytest.mark.parametrize("name,why", [("int8", "8-bit integers"), ("uint8", "unsigned"), ("uint32", "unsigned"),
                                      ("uint64", "unsigned"), ("f8e4m3", "8-bit floats"), ("f8e5m2", "8-bit floats"),
                                      ("int", "ambiguous"), ("char", "8-bit"), ("complex64", "unknown type")])
def test_types_not_reduced_here_are_refused_by_name(name, why):
    from ddlkernels.tools.bench import parse_dtype

    with pytest.raises(TypeError, match=why):
        parse_dtype(name)


def test_additive_sizes_as_nccl_tests_f_1():
    assert sweep_sizes(0, 3 << 20, 1, 1 << 20) == [0, 1 << 20, 2 << 20, 3 << 20]
    with pytest.raises(ValueError):
        sweep_sizes(0, 10, 1)


def _parse(argv):
    from ddlkernels.tools.cli import build_parser

    return build_parser().parse_args(argv)


def test_job_and_bench_take_nccl_tests_options():
    from ddlkernels.tools.bench_cli import expand_nccl_arguments

    for cmd in ("job", "bench"):
        a = _parse([cmd, "-b", "8", "-e", "32", "-f", "2", "-n", "5", "-w", "1", "-c", "0", "-o", "avg", "-d", "half",
                    "-g", "0", "--csv", "-"])
        assert (a.begin, a.end, a.factor, a.iters, a.warmup, a.check, a.op, a.dtype, a.ngpus, a.csv) == \
            ("8", "32", 2, 5, 1, 0, "avg", "half", 0, "-")
        assert expand_nccl_arguments(a) == (["float16"], ["avg"], [8, 16, 32])
        a = _parse([cmd, "--minbytes", "1K", "--maxbytes", "3K", "--stepbytes", "1K", "--datatype", "all",
                    "--warmup_iters", "3", "--check", "--op", "all"])
        dtypes, ops, sizes = expand_nccl_arguments(a)
        assert sizes == [1024, 2048, 3072] and a.warmup == 3 and a.check == 1
        assert expand_nccl_arguments(_parse([cmd, "-b", "0", "-e", "2M", "-f", "1"]))[2] == [0, 1 << 20, 2 << 20]
        assert dtypes == ["int32", "int64", "float16", "float32", "float64", "bfloat16"]
        assert ops == ["sum", "avg", "max", "min", "prod"]
        assert _parse([cmd]).check == 1 and _parse([cmd, "--no-check"]).check == 0
        assert expand_nccl_arguments(_parse([cmd, "-d", "float"]))[0] == ["float32"]  # not numpy's float64
    a = _parse(["bench", "--collective", "reduce_scatter,allgather"])
    assert a.collective == "reduce_scatter,allgather"


@pytest.mark.parametrize("argv,message", [
    (["-c", "reduce_scatter"], "the collective is --collective reduce_scatter"),
    (["-g", "1"], "launch one rank per GPU"),
    (["-g", "8"], "launch one rank per GPU"),
    (["-c", "-1"], "count >= 0"),
])
def test_options_that_cannot_run_are_refused_with_the_way_out(argv, message, capsys):
    for cmd in ("job", "bench"):
        with pytest.raises(SystemExit):
            _parse([cmd, *argv])
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [(["-o", "mulsum"], "premultiplied sum"), (["-d", "int8"], "8-bit integers"),
                                          (["-d", "uint64"], "unsigned"), (["-f", "0"], "factor >= 2")])
def test_nccl_tests_values_we_do_not_reduce_are_refused(argv, message):
    from ddlkernels.tools.bench_cli import expand_nccl_arguments

    for cmd in ("job", "bench"):
        with pytest.raises(SystemExit, match=message):
            expand_nccl_arguments(_parse([cmd, *argv]))


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
    from ddlkernels.tools import bench as _bench

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
    from ddlkernels.tools import bench as _bench

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
    from ddlkernels.tools.bench import run_sweep

    with pytest.raises(ValueError, match="pages must be one of small, huge"):
        run_sweep(None, [], [], pages="big")
