"""``python -m ddlkernels plan | simulate | calibrate``: the planner, the simulator and calibration on the command line.

    python -m ddlkernels plan --topology powerai-ddl --bytes 350MB
    python -m ddlkernels simulate --topology powerai-ddl --bytes 350MB --dims 256 --json
    mpirun -n 4 python -m ddlkernels calibrate --out calibrated.json

``--topology`` takes a preset name (powerai-ddl, dgx1-goyal, h100-ib) or a
JSON topology file.  Sizes take binary suffixes (K = 1024, "350MB" = 350 MiB),
as every ddlkernels command.  A bad topology file is reported with the field
it concerns and exit status 2; a schedule the simulator cannot run, with 3.
"""

from __future__ import annotations

import json
import re
import sys

__all__ = ["add_subcommands", "parse_size", "parse_dims"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text) -> int:
    """"64K", "350MB", "1G", "123" -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMG]?(?:I?B)?)\s*", str(text), re.I)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 64K, 350MB, 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_dims(text: str) -> tuple[int, ...]:
    """"4,16,4" or "4x16x4" -> (4, 16, 4)."""
    try:
        dims = tuple(int(x) for x in re.split(r"[,x* ]+", text.strip()) if x)
    except ValueError:
        raise ValueError(f"cannot parse dims {text!r}; use e.g. 4,16,4") from None
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"dims must be positive ints, got {text!r}")
    return dims


def _fail(msg: str, code: int):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def _load(args):
    from ..select.topology import TopologyError, load

    try:
        topo = load(args.topology)
        if args.ranks is not None and args.ranks != topo.ranks:
            topo = topo.subset(args.ranks)
    except TopologyError as e:
        _fail(str(e), 2)
    return topo


def _size(args) -> int:
    try:
        n = parse_size(args.bytes)
    except ValueError as e:
        _fail(str(e), 2)
    return n


def _fmt_t(t: float) -> str:
    return f"{t * 1e3:10.3f} ms"


def _plan(args):
    from ..select.planner import choose_plan, model_time

    topo = _load(args)
    nbytes = _size(args)
    plan, info = choose_plan(topo, topo.ranks, nbytes, chunk_bytes=args.chunk_bytes, top=args.top)
    fan = [lv.fanout for lv in topo.levels]
    two_level = (fan[0], topo.ranks // fan[0]) if len(fan) > 1 and fan[0] > 1 else None
    info["flat_time_s"] = model_time(topo, (topo.ranks,), nbytes, chunk_bytes=args.chunk_bytes)
    if two_level:
        info["two_level_dims"] = list(two_level)
        info["two_level_time_s"] = model_time(topo, two_level, nbytes, chunk_bytes=args.chunk_bytes)
    if args.simulate:
        from .simulator import simulate

        info["simulated_s"] = simulate(topo, plan, nbytes, itemsize=args.itemsize, chunk_bytes=args.chunk_bytes, verify=False).time_s
    if args.json:
        print(json.dumps(info))
        return
    print(f"topology   {topo.name}: {topo.ranks} ranks, levels " + " x ".join(f"{lv.name}({lv.fanout})" for lv in topo.levels))
    print(f"message    {nbytes} bytes")
    print(f"choice     dims {'x'.join(map(str, plan.dims))} (ring order: {info['order']}), predicted {_fmt_t(info['time_s'])}"
          + (f", simulated {_fmt_t(info['simulated_s'])}" if "simulated_s" in info else ""))
    print(f"bound      {_fmt_t(info['lower_bound_s'])}  (alpha-beta lower bound, docs/planner.md)")
    print(f"flat ring  {_fmt_t(info['flat_time_s'])}" + (f"   2-level {'x'.join(map(str, two_level))}: {_fmt_t(info['two_level_time_s'])}" if two_level else ""))
    print(f"alternatives ({info['candidates']} boxes costed, best first):")
    for alt in info["alternatives"]:
        print(f"  {'x'.join(map(str, alt['dims'])):>16s} {_fmt_t(alt['time_s'])}  (+{100 * (alt['time_s'] / info['time_s'] - 1):.1f} %)")


def _simulate(args):
    from ..ring.schedule import Plan
    from ..select.planner import choose_plan, lower_bound, model_time
    from .simulator import ScheduleError, simulate

    topo = _load(args)
    nbytes = _size(args)
    order = topo.topology_order()
    if args.dims in (None, "auto"):
        plan, _ = choose_plan(topo, topo.ranks, nbytes, chunk_bytes=args.chunk_bytes)
    else:
        try:
            dims = parse_dims(args.dims)
            plan = Plan(dims, order)
        except ValueError as e:
            _fail(f"--dims: {e}", 2)
        if plan.size != topo.ranks:
            _fail(f"--dims: {'x'.join(map(str, dims))} = {plan.size} ranks, but the topology has {topo.ranks}", 2)
    try:
        res = simulate(topo, plan, nbytes, itemsize=args.itemsize, chunk_bytes=args.chunk_bytes, window=args.window,
                       verify={"auto": None, "yes": True, "no": False}[args.verify])
    except ScheduleError as e:
        _fail(f"schedule: {e}", 3)
    out = res.to_dict()
    out.update(
        topology=topo.name,
        ranks=topo.ranks,
        bytes=nbytes,
        lower_bound_s=lower_bound(topo, nbytes),
        model_time_s=model_time(topo, plan.dims, nbytes, chunk_bytes=res.chunk_bytes),
    )
    if args.json:
        print(json.dumps(out))
        return
    print(f"topology   {topo.name}: {topo.ranks} ranks; {nbytes} bytes; dims {'x'.join(map(str, plan.dims))}; chunk {res.chunk_bytes} B")
    print(f"simulated  {_fmt_t(res.time_s)}   model {_fmt_t(out['model_time_s'])}   lower bound {_fmt_t(out['lower_bound_s'])}")
    print(f"messages   {res.messages}; bytes by level " + ", ".join(f"{lv.name} {b}" for lv, b in zip(topo.levels, res.bytes_by_level)))
    print("phases     " + ", ".join(f"{t * 1e3:.3f}" for t in res.phase_end_s) + " ms (end of each)")
    print(f"data       {'verified: every rank holds the exact sum' if res.verified else 'not verified (use --verify yes)'}")


def _calibrate(args):
    from mpi4py import MPI

    from .calibrate import calibrate
    from ..select.topology import TopologyError, load

    comm = MPI.COMM_WORLD
    try:
        structure = load(args.structure) if args.structure else None
        sizes = tuple(parse_size(s) for s in args.sizes.split(","))
        topo = calibrate(comm, rack_map=args.rack_map, structure=structure, sizes=sizes, reps=args.reps)
    except (TopologyError, ValueError) as e:
        _fail(str(e), 2)
    if comm.Get_rank() == 0:
        if args.out:
            topo.save(args.out)
            print(f"wrote {args.out}")
        for lv in topo.levels:
            cap = f", capacity {lv.capacity:.3e} B/s" if lv.capacity else ""
            print(f"{lv.name:8s} fanout {lv.fanout:4d}  latency {lv.latency * 1e6:8.2f} us  bandwidth {lv.bandwidth:.3e} B/s  links {lv.links}{cap}")
        print(f"reduce   {topo.reduce_rate:.3e} B/s per rank")


def add_subcommands(sub) -> None:
    """Register ``plan``, ``simulate`` and ``calibrate`` on an argparse subparsers object."""

    def common(p):
        p.add_argument("--topology", required=True, help="preset name or topology JSON file")
        p.add_argument("--bytes", required=True, help="message size, e.g. 350MB (binary units)")
        p.add_argument("--ranks", type=int, help="use the first N ranks of the topology (default: all)")
        p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="pipeline chunk in bytes (default 1 MiB, as the engine)")
        p.add_argument("--itemsize", type=int, default=4, help="bytes per element (default 4: float32)")
        p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("plan", help="choose the ring box for a topology and message size")
    common(p)
    p.add_argument("--top", type=int, default=8, help="alternatives to list")
    p.add_argument("--simulate", action="store_true", help="also simulate the chosen plan")
    p.set_defaults(func=_plan)

    p = sub.add_parser("simulate", help="time the engine's schedule on a modeled cluster")
    common(p)
    p.add_argument("--dims", help="force a box, e.g. 256 or 4,16,4 (default: the planner's choice)")
    p.add_argument("--window", type=int, default=None, help="receive slots per step (default: the engine's)")
    p.add_argument("--verify", choices=("auto", "yes", "no"), default="auto", help="move real data and check it")
    p.set_defaults(func=_simulate)

    p = sub.add_parser("calibrate", help="measure latency/bandwidth per level (under mpirun) and write a topology file")
    p.add_argument("--out", default="calibrated-topology.json", help="file to write (rank 0)")
    p.add_argument("--rack-map", help="host -> rack map: JSON object or lines 'host rack'")
    p.add_argument("--structure", help="topology file whose placement replaces detection")
    p.add_argument("--sizes", default="8,1K,16K,256K,1M,4M,16M", help="ping-pong sizes")
    p.add_argument("--reps", type=int, default=20, help="round trips per size")
    p.set_defaults(func=_calibrate)
