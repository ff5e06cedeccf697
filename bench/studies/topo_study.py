"""The planner and the simulator on the presets: the tables of issue 4, written to bench/results/.

    python bench/studies/topo_study.py headline   # powerai-ddl, 256 ranks, 350 MB: choice, flat, 2-level, bound
    python bench/studies/topo_study.py sizes      # 64 KB .. 1 GB on powerai-ddl: choice vs flat vs 2-level
    python bench/studies/topo_study.py scaling    # 100 MB at 4 .. 256 ranks on every preset (feeds plot_scaling.py)

Every time is a simulation of the engine's own schedule (chunk 1 MiB, window
4, as the engine's defaults); "model" is the planner's closed-form estimate;
"bound" the alpha-beta lower bound of docs/planner.md.  Sizes are binary
(350 MB = 350 MiB), as on the command line.
"""

from __future__ import annotations

import json
import os
import sys
import time

from ddlkernels.select.planner import choose_plan, lower_bound, model_time, _model
from ddlkernels.tools.simulator import simulate
from ddlkernels.select.topology import load

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results")


def two_level(topo):
    f = topo.levels[0].fanout
    return (f, topo.ranks // f) if 1 < f < topo.ranks else None


def terms(topo, dims, nbytes):
    """(latency term, bandwidth term) of the model: 2 sum (d_i - 1) mean latency_i, and the rest."""
    m = _model(topo)
    lat, stride = 0.0, 1
    for d in dims:
        if d > 1:
            lat += 2 * (d - 1) * m.edges(stride, d)[0]
        stride *= d
    return lat, model_time(topo, dims, nbytes) - lat


def sim(topo, dims_or_plan, nbytes):
    return simulate(topo, dims_or_plan, nbytes, verify=False).time_s


def headline():
    topo = load("powerai-ddl")
    n = 350 << 20
    plan, info = choose_plan(topo, 256, n)
    out = {
        "topology": "powerai-ddl", "ranks": 256, "bytes": n,
        "lower_bound_s": lower_bound(topo, n),
        "planner": {"dims": list(plan.dims), "simulated_s": sim(topo, plan, n), "model_s": info["time_s"]},
        "flat": {"dims": [256], "simulated_s": sim(topo, (256,), n), "model_s": model_time(topo, (256,), n)},
        "two_level": {"dims": [4, 64], "simulated_s": sim(topo, (4, 64), n), "model_s": model_time(topo, (4, 64), n)},
        "per_level": {"dims": [4, 16, 4], "simulated_s": sim(topo, (4, 16, 4), n), "model_s": model_time(topo, (4, 16, 4), n)},
        "alternatives": info["alternatives"],
    }
    out["planner_vs_bound"] = out["planner"]["simulated_s"] / out["lower_bound_s"] - 1
    # Planning time: a fresh model (cold cache) and a cached call.
    from ddlkernels.select import planner as P

    P._PLAN_CACHE.clear()
    P._model.cache_clear()
    t0 = time.perf_counter()
    choose_plan(topo, 256, n)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(1000):
        choose_plan(topo, 256, n)
    warm = (time.perf_counter() - t0) / 1000
    out["plan_seconds_cold"], out["plan_seconds_cached"] = cold, warm
    write("headline-powerai-350MB", out, [
        "| shape | dims | simulated (ms) | model (ms) | vs bound |",
        "| --- | --- | --- | --- | --- |",
        *[f"| {k} | {'x'.join(map(str, out[k]['dims']))} | {out[k]['simulated_s'] * 1e3:.2f} | {out[k]['model_s'] * 1e3:.2f} | {100 * (out[k]['simulated_s'] / out['lower_bound_s'] - 1):+.1f} % |"
          for k in ("planner", "flat", "two_level", "per_level")],
        f"| lower bound | | {out['lower_bound_s'] * 1e3:.2f} | | |",
        "",
        f"planning 256 ranks: {cold * 1e3:.1f} ms cold, {warm * 1e6:.1f} us cached",
    ])


def sizes():
    topo = load("powerai-ddl")
    rows = []
    for n in [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]:
        plan, info = choose_plan(topo, 256, n)
        row = {"bytes": n, "lower_bound_s": lower_bound(topo, n)}
        for key, dims in (("planner", plan.dims), ("flat", (256,)), ("two_level", (4, 64))):
            lat, bw = terms(topo, dims, n)
            row[key] = {"dims": list(dims), "simulated_s": sim(topo, dims, n), "model_s": lat + bw,
                        "latency_term_s": lat, "bandwidth_term_s": bw}
        rows.append(row)
        print(n, row["planner"]["dims"], row["planner"]["simulated_s"], row["flat"]["simulated_s"], row["two_level"]["simulated_s"], flush=True)
    lines = ["| size | planner dims | planner (ms) | flat (ms) | 2-level 4x64 (ms) | flat / planner | 2-level / planner | bound (ms) | dominant term (planner; flat) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        dom = lambda x: "latency" if x["latency_term_s"] > x["bandwidth_term_s"] else "bandwidth"
        lines.append(f"| {fmt_size(r['bytes'])} | {'x'.join(map(str, r['planner']['dims']))} | {r['planner']['simulated_s'] * 1e3:.3f} | "
                     f"{r['flat']['simulated_s'] * 1e3:.3f} | {r['two_level']['simulated_s'] * 1e3:.3f} | "
                     f"{r['flat']['simulated_s'] / r['planner']['simulated_s']:.2f} | {r['two_level']['simulated_s'] / r['planner']['simulated_s']:.2f} | "
                     f"{r['lower_bound_s'] * 1e3:.3f} | {dom(r['planner'])}; {dom(r['flat'])} |")
    write("sizes-powerai-256", {"topology": "powerai-ddl", "ranks": 256, "rows": rows}, lines)


def scaling():
    n = 100 << 20
    out = {"bytes": n, "presets": {}}
    lines = []
    for name in ("powerai-ddl", "dgx1-goyal", "h100-ib"):
        full = load(name)
        rows = []
        for p in [4, 8, 16, 32, 64, 128, 256]:
            try:
                topo = full.subset(p)
            except ValueError:
                continue
            plan, info = choose_plan(topo, p, n)
            row = {"ranks": p, "lower_bound_s": lower_bound(topo, n),
                   "planner": {"dims": list(plan.dims), "simulated_s": sim(topo, plan, n)},
                   "flat": {"dims": [p], "simulated_s": sim(topo, (p,), n)}}
            tl = two_level(topo)
            row["two_level"] = {"dims": list(tl), "simulated_s": sim(topo, tl, n)} if tl else None
            rows.append(row)
            print(name, p, row["planner"], row["flat"]["simulated_s"], flush=True)
        out["presets"][name] = rows
        base = rows[0]["planner"]["simulated_s"]
        lines += [f"### {name}, 100 MB (ResNet-50 gradients)", "",
                  "| ranks | planner dims | planner (ms) | flat (ms) | 2-level (ms) | bound (ms) | planner minus smallest job (ms) |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            tl = f"{r['two_level']['simulated_s'] * 1e3:.2f} ({'x'.join(map(str, r['two_level']['dims']))})" if r["two_level"] else "-"
            lines.append(f"| {r['ranks']} | {'x'.join(map(str, r['planner']['dims']))} | {r['planner']['simulated_s'] * 1e3:.2f} | "
                         f"{r['flat']['simulated_s'] * 1e3:.2f} | {tl} | {r['lower_bound_s'] * 1e3:.2f} | {(r['planner']['simulated_s'] - base) * 1e3:+.2f} |")
        lines.append("")
    write("scaling-100MB", out, lines)


def fmt_size(n):
    for unit, s in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= s:
            return f"{n / s:g} {unit}"
    return f"{n} B"


def write(name, data, lines):
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, name + ".json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(OUT, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    {"headline": headline, "sizes": sizes, "scaling": scaling}[sys.argv[1]]()
