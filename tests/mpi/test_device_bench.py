"""The device benchmark (ddlkernels.tools.bench.device) run whole on the stream emulator's device.

What ``job --device cuda`` and ``bench --device cuda`` run on a GPU, every
line of every collective, with the emulator's device in place of CuPy's
(``EmuDevice``: the sweep's ``CupyDevice`` interface): the lines' inputs,
calls and checks must give 0 wrong elements, and a line that gets its bytes
wrong must be counted wrong.  Nothing here is timed or CUDA's: the figures
come from tests/gpu/run_on_device.sh on a GPU.
"""

import numpy as np
import pytest
from mpi4py import MPI

from ddlkernels.tools.bench import device as D
from ddlkernels.tools.bench.buffers import expected
from stream_emulator import emulated_device

COMM = MPI.COMM_WORLD
P, R = COMM.Get_size(), COMM.Get_rank()
# bytes: one float32; an odd count (shards of unequal lengths); past the host algorithm's 8 MiB pieces is
# too slow here, so pieces come from a small piece_bytes instead (see the test).
SIZES = [4, 4 * 1031]


class EmuDevice:
    """``CupyDevice``'s interface on the stream emulator's backend ``be``."""

    def __init__(self, be):
        self.be = be

    def name(self):
        return "stream emulator"

    def ident(self):
        return ("emu", R)  # a device of its own per rank

    def index(self):
        return 0

    def array(self, host):
        return self.be.to_device(host)

    def empty(self, n, dtype):
        return self.be.empty(n, dtype)

    def to_host(self, d):
        return self.be.to_host(d)

    def pinned(self, n, dtype):
        return np.empty(n, dtype)

    def down(self, host, d):
        host[...] = self.be.to_host(d)

    def up(self, d, host):
        self.be.write(d, host)

    def copy(self, dst, src):
        self.be.copy(dst, src)

    def synchronize(self):
        self.be.synchronize()


class DroppingDevice(EmuDevice):
    """Copies up lose their last element: the hand-rolled line's results must come out wrong."""

    def up(self, d, host):
        bad = host.copy()
        bad[-1:] = 99
        self.be.write(d, bad)


def study(name):
    """bench/studies/NAME.py as a module: the studies are scripts, not a package."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "bench" / "studies"
                                                  / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class MisreadDevice(EmuDevice):
    """Reads of device memory lose their first element: every staged line's results must come out wrong."""

    def to_host(self, d):
        got = self.be.to_host(d).copy()
        got[:1] = 99
        return got


@pytest.fixture(autouse=True)
def small_host_pieces(monkeypatch):
    from ddlkernels.algorithms import host

    monkeypatch.setattr(host.Host, "piece_bytes", 64)  # several pieces a call, slots reused


@pytest.mark.parametrize("kind", D.COLLECTIVES)
def test_every_line_of_every_collective_right(kind):
    with emulated_device(seed=R, policy="random", ipc=True) as be:
        rows, missing = D.sweep(COMM, EmuDevice(be), SIZES, "float32", iters=2, warmup=1, collective=kind)
    want = {"ddlkernels", "ddlkernels staged", "hand-rolled", "ddlkernels host", "device copy"}
    for row, size in zip(rows, SIZES):
        assert row["bytes"] == size and row["collective"] == kind
        assert want <= set(row["lines"]), row["lines"].keys()
        wrong = {name: m["wrong"] for name, m in row["lines"].items() if m["wrong"]}
        assert not wrong, f"{kind} {size} B: {wrong}"
        assert all(m["ms"] > 0 for m in row["lines"].values())
    optional = ("ddlkernels ipc", "ddlkernels hier", "ddlkernels torch", "mpi device", "gloo", "nccl",
                "ddlkernels group")
    for name in optional:  # each ran, or says why not
        assert (name in rows[0]["lines"]) != bool(missing.get(name)), (name, missing)
    # hier: allreduce where the ranks of this one node make nodes of 2+ ranks (node labels), and it ran hier
    assert ("ddlkernels hier" in rows[0]["lines"]) == (kind == "allreduce" and D.made_up_node_size(P) is not None)
    assert all(row.get("hier_ran", "hier") == "hier" for row in rows), [row.get("hier_ran") for row in rows]
    # and says what its step across nodes ran (its own tuner's choice among the device algorithms)
    assert all(row["hier_across"] in ("ring", "host") for row in rows if "hier_ran" in row), rows
    # the IPC line's buffers are all exportable here: none staged (the row says so wherever that line ran)
    assert all(row.get("ipc_staged", 0) == 0 and ("ipc_staged" in row) == ("ddlkernels ipc" in row["lines"])
               for row in rows), [row.get("ipc_staged") for row in rows]
    text = D.table(rows)
    assert text.count(f"## {kind} ") == len(SIZES) and "x hand-rolled" in text


def test_a_line_with_wrong_bytes_is_counted_wrong():
    with emulated_device(seed=R, policy="lazy") as be:
        rows, _ = D.sweep(COMM, DroppingDevice(be), SIZES[1:], "int32", iters=2, warmup=0,
                          collective="reduce_scatter")
    lines = rows[0]["lines"]
    assert lines["hand-rolled"]["wrong"] == 2 * P  # the last element of every rank's shard, each iteration
    assert lines["ddlkernels"]["wrong"] == 0 and lines["ddlkernels host"]["wrong"] == 0


def test_lines_are_timed_in_rounds_and_a_size_measured_again_is_settled_and_its_sample_redone(monkeypatch):
    """Iteration i of every line runs before iteration i + 1 of any (a GPU's clocks or a neighbour's load then
    fall on every line alike); where a tuner measures its size again after a timed sample, the sample is
    redone once it has settled, and the row counts it (``ddlkernels.tools.bench.runner``)."""
    import ddlkernels

    calls, real_lines, real_tuning = [], D._lines, ddlkernels.Communicator.tuning

    def spying(comm, dev, dtype, kind):
        out, missing, comms = real_lines(comm, dev, dtype, kind)
        for name, (setup, run, result) in list(out.items()):
            out[name] = (setup, lambda s, run=run, name=name: (calls.append(name), run(s)), result)
        return out, missing, comms

    def reopened_once(self, x, op="sum", *, collective="allreduce"):  # after the first timed sample only
        if calls == ["ddlkernels"]:
            calls.append("(reopened)")
            return True
        return real_tuning(self, x, op, collective=collective)

    monkeypatch.setattr(D, "_lines", spying)
    monkeypatch.setattr(ddlkernels.Communicator, "tuning", reopened_once)
    with emulated_device(seed=R, policy="random") as be:
        # (reduce_scatter: no hier line, whose tuner would still measure after CUDA IPC failed on its first call)
        rows, _ = D.sweep(COMM, EmuDevice(be), SIZES[1:], "float32", iters=2, warmup=0, collective="reduce_scatter")
    names = list(rows[0]["lines"])
    assert names[0] == "ddlkernels" and len(names) >= 5, names
    assert calls == ["ddlkernels", "(reopened)"] + names + names, calls
    assert [m["remeasured"] for m in rows[0]["lines"].values()] == [1] + [0] * (len(names) - 1)
    assert all(m["wrong"] == 0 for m in rows[0]["lines"].values())


def test_report_prints_every_collective_and_the_wrong_count(capsys, tmp_path):
    path = tmp_path / "r.json"
    path = COMM.bcast(str(path))
    with emulated_device(seed=R, policy="lazy") as be:
        wrong = D.report(COMM, EmuDevice(be), ["reduce_scatter", "allgather"], ["int32"], SIZES[:1], 1, 0,
                         path if R == 0 else None)
    assert wrong == 0
    out = capsys.readouterr().out
    if R == 0:
        assert "# reduce_scatter int32" in out and "# allgather int32" in out and "wrong elements in all: 0" in out
        import json

        runs = json.load(open(path))["runs"]
        assert [r["collective"] for r in runs] == ["reduce_scatter", "allgather"]


def test_bench_device_cuda_refuses_without_a_gpu_and_what_it_cannot_time(capsys):
    from ddlkernels.tools.bench_cli import main

    cp, _ = D.gpu_everywhere(COMM)
    if cp is not None:
        pytest.skip("a GPU on every rank: bench --device cuda runs on it (tests/gpu/run_on_device.sh)")
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cuda", "-b", "1K", "-e", "1K", "--collective", "reduce_scatter"])
    assert exc.value.code == 2
    out = capsys.readouterr().out
    assert ("nothing was timed" in out) if R == 0 else out == ""
    with pytest.raises(SystemExit, match="out of place, -o sum"):
        main(["--device", "cuda", "-b", "1K", "-e", "1K", "--place", "both"])


def test_chunk_cost_study_lines_right():
    """bench/studies/chunk_cost.py's lines (the host ring, the staged device ring) at several chunk sizes:
    every result exact, the chunks a call sends growing as the chunk shrinks."""
    cost = study("chunk_cost")
    n, dt = 3001, np.dtype(np.float32)
    want = expected(n, P, dt, "sum")
    with emulated_device(seed=R, policy="random") as be:
        found, missing, comms = cost.lines(COMM, EmuDevice(be), n, dt)
        try:
            assert "staged" in found and ("cuda-aware" in found) != bool(missing.get("cuda-aware"))
            for chunk in (64, 1024, 1 << 20):
                for name, (run, sync, result) in found.items():
                    run(chunk)
                    sync()
                    assert np.array_equal(result(), want), (name, chunk)
            m = [cost.chunks_per_call(comms[0], n, dt.itemsize, c) for c in (64, 1024)]
            assert (m[0] > m[1] >= 2 * (P - 1)) if P > 1 else m == [0, 0]  # one rank sends nothing
        finally:
            for c in comms:
                c.free()


@pytest.mark.parametrize("device", [EmuDevice, MisreadDevice])
def test_staged_pieces_study_lines_right(device):
    """bench/studies/staged_pieces.py's lines: the host arrays' allreduce and "host" under several cuts of
    the call (the even cut and the ramp, small pieces so that a call ramps), each line's result checked."""
    pieces = study("staged_pieces")
    cuts = {"ramp 64": (64, 8), "even 64": (64, 1), "ramp 256": (256, 16)}
    if P == 1:
        with emulated_device(seed=R, policy="random") as be, pytest.raises(ValueError, match="mpirun -n 2"):
            pieces.measure(COMM, device(be), [4 * 1031], cuts)
        return
    with emulated_device(seed=R, policy="random") as be:
        rows, wrong = pieces.measure(COMM, device(be), [4 * 1031], cuts, iters=2, warmup=1)
    assert [set(r) for r in rows] == [{"bytes", "host arrays", *cuts}]
    assert all(rows[0][k] > 0 for k in ("host arrays", *cuts))
    if device is EmuDevice:
        assert wrong == 0
    else:  # the first element, on every rank, in every checked call (warmup and timed) of each staged line
        assert wrong >= len(cuts) * P * 2
    text = pieces.table(rows, cuts)
    assert "ramp 64" in text and "( 1.00)" in text and "# pieces at 0M: ramp 64 " in text  # host arrays: x 1


def test_a_line_another_library_refuses_is_left_out_with_its_reason(monkeypatch):
    """torch.distributed refuses what a backend lacks (as gloo may an uneven reduce_scatter): the sweep goes
    on without that line and says why; a ddlkernels line that raises stops it."""
    real = D._lines

    def with_refusing(comm, dev, dtype, kind):
        out, missing, comms = real(comm, dev, dtype, kind)
        missing.pop("gloo", None)
        out["gloo"] = (lambda n: {"want": None}, lambda s: (_ for _ in ()).throw(RuntimeError("no such op\nmore")),
                       None)
        return out, missing, comms

    monkeypatch.setattr(D, "_lines", with_refusing)
    with emulated_device(seed=R, policy="lazy") as be:
        rows, missing = D.sweep(COMM, EmuDevice(be), SIZES, "int32", iters=1, warmup=0, collective="reduce_scatter")
    assert missing["gloo"] == "RuntimeError: no such op"
    assert all("gloo" not in r["lines"] and "hand-rolled" in r["lines"] for r in rows)

    def broken(comm, dev, dtype, kind):
        out, missing, comms = real(comm, dev, dtype, kind)
        out["ddlkernels"] = (out["ddlkernels"][0], lambda s: (_ for _ in ()).throw(RuntimeError("bug")), None)
        return out, missing, comms

    monkeypatch.setattr(D, "_lines", broken)
    with emulated_device(seed=R, policy="lazy") as be:
        with pytest.raises(RuntimeError, match="bug"):
            D.sweep(COMM, EmuDevice(be), SIZES[:1], "int32", iters=1, warmup=0)


def test_a_dtype_some_line_cannot_reduce_is_refused_before_any_work():
    with emulated_device(seed=R, policy="lazy") as be:
        for dt in ("float16", "bfloat16"):
            with pytest.raises(SystemExit, match="no float16 or bfloat16"):
                D.report(COMM, EmuDevice(be), ["allreduce"], ["float32", dt], SIZES, 1, 0)
            with pytest.raises(ValueError, match="float32, float64, int32, int64"):
                D.sweep(COMM, EmuDevice(be), SIZES, dt)
