"""Command line: ``python -m ddlkernels <command>`` (under ``mpirun`` for the collective ones).

  info       versions, MPI library, CUDA-awareness, backends, detected topology
  job        the main job: allreduce sweep, checked, beside MPI's own Allreduce
  compile    the CPU loops (Numba's cache) and CUDA kernels, ahead of a job's first calls

Other subcommands (planner, simulator, calibration, benchmarks) register
themselves from their modules through ``add_subcommands``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that add subcommands: each has add_subcommands(subparsers).
_EXTENSIONS = ("ddlkernels.tools.topo_cli", "ddlkernels.tools.bench_cli")


def _info(args):
    import platform

    import numpy as np
    from mpi4py import MPI

    import ddlkernels
    from ddlkernels import Communicator
    from ddlkernels.backends import available_backends

    comm = MPI.COMM_WORLD
    dc = Communicator(comm, cuda_aware=args.cuda_aware)
    library = MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()  # Open MPI's ends in a NUL
    lines = [
        f"ddlkernels     {ddlkernels.__version__}",
        f"python         {platform.python_version()}  numpy {np.__version__}  mpi4py {__import__('mpi4py').__version__}",
        f"MPI library    {library}",
        f"MPI standard   {'.'.join(map(str, MPI.Get_version()))}; thread level {_thread_level(MPI.Query_thread())}",
        f"ranks          {dc.size}",
    ]
    for name, status in available_backends().items():
        lines.append(f"backend        {name:6s} {status}")
    try:
        from ddlkernels.transport.cuda_aware import gpu_info

        g = gpu_info(dc.comm, aware=dc.cuda_aware())  # what every rank agreed on: the path device calls take
        lines.append(f"GPU device     {'yes' if g.get('device') else 'no'}" + (f" ({g['device_note']})" if g.get("device_note") else ""))
        lines.append(f"CUDA-aware MPI {'yes' if g.get('cuda_aware') else 'no'} ({g.get('cuda_aware_reason', '')})")
        lines.append(f"device path    {g.get('transport')}: {g.get('transport_note', '')}")
    except ImportError as exc:  # pragma: no cover - the module ships with the package
        lines.append(f"GPU            unavailable ({exc})")
    topo = dc.topology
    levels = ", ".join(f"{lv.name} x{lv.fanout}" for lv in topo.levels)
    lines.append(f"topology       {topo.ranks} ranks: {levels}")
    shm = ("no (ranks span nodes, a single rank, or shm=False)" if "shm" not in dc.algorithms
           else "yes: forced (shm=True)" if dc.algorithms.forced else "yes: measured against the others per size")
    lines.append(f"shared memory  {shm}")
    lines.append(f"algorithms     {', '.join(dc.algorithms.names)}")
    for nbytes in (64 << 10, 1 << 20, 64 << 20):
        lines.append(f"planned box    {nbytes >> 10:>6} KiB: {'x'.join(map(str, dc.plan(nbytes).dims))}")
    if comm.Get_rank() == 0:
        print("\n".join(lines))
    dc.free()


def _thread_level(level):
    from mpi4py import MPI

    return {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SERIALIZED: "serialized",
            MPI.THREAD_MULTIPLE: "multiple"}.get(level, str(level))


def _job_device(args, comm, cp, dtypes, ops, sizes):
    """The main job on GPU buffers (``ddlkernels.tools.bench.device``)."""
    from ddlkernels.tools.bench.device import CupyDevice, report

    if ops != ["sum"] or args.inplace or args.csv:
        raise SystemExit("job on GPU buffers: out of place, -o sum, no --csv (its peers' lines are sums); "
                         "--device host runs the host sweep with every option")
    if report(comm, CupyDevice(cp), ["allreduce"], dtypes, sizes, args.iters, args.warmup, args.json):
        sys.exit(1)


def _job(args):
    from mpi4py import MPI

    from ddlkernels.tools.bench import (ALLREDUCE_IMPLS, comment, dump_json, format_footer, format_size, format_table,
                                   run_sweep)
    from ddlkernels.tools.bench_cli import _write_csv, expand_nccl_arguments

    dtypes, ops, sizes = expand_nccl_arguments(args)
    comm = MPI.COMM_WORLD
    where = "host (numpy) buffers (--device host)"
    if args.device != "host":
        from ddlkernels.tools.bench.device import gpu_everywhere

        cp, why = gpu_everywhere(comm)  # collective
        if cp is not None:
            return _job_device(args, comm, cp, dtypes, ops, sizes)
        if args.device == "cuda":
            if comm.Get_rank() == 0:
                print(f"job --device cuda: no GPU on every rank ({why}); nothing was timed", flush=True)
            sys.exit(2)
        where = f"host (numpy) buffers: no GPU here ({why})"
    impls = [ALLREDUCE_IMPLS["ddlkernels"], ALLREDUCE_IMPLS["MPI_Allreduce"]]
    rows = []
    for dt in dtypes:  # nccl-tests' order: every type, then within it every op
        for op in ops:
            rows += run_sweep(comm, sizes, impls, dtype=dt, op=op, iters=args.iters, warmup=args.warmup,
                              check=bool(args.check), inplace=args.inplace, min_sample_s=args.min_sample_ms / 1e3)
    names = [i.name for i in impls]
    wrong = sum((r["impls"][n]["wrong"] or 0) for r in rows for n in names)
    if comm.Get_rank() == 0:
        if args.csv != "-":
            print(comment(
                f"ddlkernels allreduce vs MPI_Allreduce: {comm.Get_size()} ranks, {where}, type {args.dtype}, op "
                f"{args.op}, {'in place' if args.inplace else 'out of place'}, {args.iters} iterations (median), "
                f"time = slowest rank; busbw = algbw * 2(p-1)/p"))
            print(comment(
                "path: which algorithm ddlkernels ran, as its size tuner chose (ring: its multi-dimensional ring; "
                "shm: its shared-memory allreduce, shm-nt: the same with its results written to memory; cma: single "
                "copy, peers' buffers read with process_vm_readv; hier: shm per node + across nodes; mpi / nbc: "
                "MPI_Allreduce / MPI_Iallreduce)"))
            if args.min_sample_ms > 0 and not args.inplace:
                seen = {}
                for r in rows:
                    seen.setdefault(r["bytes"], r["batch"])
                calls = " ".join(f"{format_size(b)}x{n}" for b, n in seen.items())
                print(comment(f"an iteration = back-to-back calls lasting about {args.min_sample_ms:g} ms, as "
                              f"nccl-tests times them (calls per size: {calls})"))
            print(format_table(rows, impls, ratio_of="ddlkernels"))
            print(format_footer(rows, names))
        if args.csv:
            _write_csv(args.csv, rows, names, "median")
        if args.json:
            dump_json(args.json, vars(args) | {"ranks": comm.Get_size(), "mpi": MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()}, rows)
    if wrong:
        sys.exit(1)


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m ddlkernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, MPI, CUDA-awareness, backends, topology")
    p.add_argument("--cuda-aware", type=lambda s: {"1": True, "0": False, "auto": None}[s], default=None,
                   metavar="{1,0,auto}", help="override CUDA-aware MPI detection")
    p.set_defaults(func=_info)
    p = sub.add_parser("job", help="the main job: checked allreduce sweep vs MPI_Allreduce (run under mpirun)",
                       description="ddlkernels' allreduce beside MPI_Allreduce at every size, checked, in "
                                   "nccl-tests' terms: its options (-b -e -f -i -n -w -c -o -d -g), its table "
                                   "columns and its closing lines (# Out of bounds values, # Avg bus bandwidth).")
    from ddlkernels.tools.bench_cli import add_nccl_arguments

    # -w 14 covers the first calls of a size from 256 KiB, in which the library measures MPI's allreduce
    # against the ring; below that its 2 x 17 trial calls finish in the first batched iteration.
    add_nccl_arguments(p, iters=10, warmup=14)
    p.add_argument("--inplace", action="store_true", help="in place (default: out of place)")
    p.add_argument("--device", choices=("auto", "host", "cuda"), default="auto",
                   help="buffers: cuda = CuPy arrays on each rank's GPU, beside the hand-rolled D2H + MPI + H2D "
                        "loop, gloo and NCCL; host = numpy arrays beside MPI_Allreduce; auto (default): cuda where "
                        "every rank has a GPU, else host (the header says which)")
    p.add_argument("--min-sample-ms", type=float, default=2.0,
                   help="time back-to-back calls, enough for about this many ms per iteration, as nccl-tests does "
                        "(the same count for both lines of a size; in place: single calls); 0: single calls "
                        "between barriers")
    p.set_defaults(func=_job)
    from ddlkernels.kernels.precompile import add_subcommand

    add_subcommand(sub)
    for mod in _EXTENSIONS:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise
            continue
        m.add_subcommands(sub)
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.func(args)

