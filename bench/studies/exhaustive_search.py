"""Exhaustive search: every ordered factorization of p x every order of the topology's levels.

    python bench/studies/exhaustive_search.py --topology powerai-ddl --bytes 350MB --out bench/results/exhaustive-powerai-350MB.json

Orders: the rank index is the mixed-radix number (GPU, node, rack); an order
permutes those digits before the box is filled, e.g. (node, GPU, rack) puts
the 16 nodes of a rack next to each other in the box, so dimension 1 would
run across NICs.  For 256 ranks on powerai-ddl that is 128 factorizations x 6
orders = 768 shapes.  A simulation of 350 MB on 256 ranks takes 5-15 s here,
so all 768 are costed with the planner's model (under each order) and every
shape the model puts within ``--prune`` (10 %) of its best is simulated, plus
a random sample of the pruned ones to check that pruning (their simulated
distance to the best is reported), and the model's largest error on
everything simulated.  The planner's choice is simulated with the same
settings and compared with the best simulated shape.  Results are written
after every simulation, so a long run can be inspected.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time

import numpy as np

from ddlkernels.tools.topo_cli import parse_size
from ddlkernels.ring.schedule import Plan
from ddlkernels.select.planner import DEFAULT_CHUNK_BYTES, _Model, choose_plan, factorizations, lower_bound
from ddlkernels.tools.simulator import simulate
from ddlkernels.select.topology import load


def level_orders(topo):
    """(name, order) for every permutation of the levels' digits; order[box index] = rank."""
    fan = [lv.fanout for lv in topo.levels]
    p = topo.ranks
    ranks = np.arange(p)
    digits = []
    rest = ranks.copy()
    for f in fan:
        digits.append(rest % f)
        rest //= f
    out = []
    for perm in itertools.permutations(range(len(fan))):
        # box index = digit[perm[0]] + f[perm[0]] * (digit[perm[1]] + ...)
        idx = np.zeros(p, dtype=np.int64)
        mult = 1
        for j in perm:
            idx += digits[j] * mult
            mult *= fan[j]
        order = np.empty(p, dtype=np.int64)
        order[idx] = ranks
        out.append(("/".join(topo.levels[j].name for j in perm), tuple(int(r) for r in order)))
    return out


def write_md(result, path):
    """A markdown summary of a result JSON (written beside it)."""
    lines = [
        f"Exhaustive search on {result['topology']}, {result['ranks']} ranks, {result['bytes']} bytes "
        f"({result['space']} shapes = factorizations x level orders; {result['simulated_near']} within "
        f"{100 * result['prune']:.0f} % of the model's best simulated, plus {result['simulated_sample']} pruned ones at random).",
        "",
        f"- planner's choice: {'x'.join(map(str, result['planner']['dims']))} (topology order), simulated "
        f"{result['planner']['simulated_s'] * 1e3:.2f} ms",
        f"- best simulated: {'x'.join(map(str, result['best']['dims']))} in order {result['best']['order']}, "
        f"{result['best']['simulated_s'] * 1e3:.2f} ms",
        f"- planner vs best: {100 * result['planner_vs_best']:+.2f} %; planner vs lower bound "
        f"({result['lower_bound_s'] * 1e3:.2f} ms): {100 * result['planner_vs_bound']:+.2f} %",
        f"- model's largest error on the simulated shapes: {100 * result['model_error_max']:.1f} %; "
        f"best of the pruned sample is {100 * (result['pruned_sample_min_vs_best'] or 0):.1f} % slower than the best",
        "",
        "| dims | order | simulated (ms) | model (ms) | pruned sample |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lines.append(f"| {'x'.join(map(str, r['dims']))} | {r['order']} | {r['simulated_s'] * 1e3:.2f} | {r['model_s'] * 1e3:.2f} | {'yes' if r['pruned'] else ''} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--topology", default="powerai-ddl")
    ap.add_argument("--bytes", default="350MB")
    ap.add_argument("--ranks", type=int)
    ap.add_argument("--prune", type=float, default=0.10, help="simulate every shape the model puts within this of its best")
    ap.add_argument("--sample", type=int, default=24, help="also simulate this many of the pruned shapes, at random")
    ap.add_argument("--out", required=True)
    ap.add_argument("--md-only", action="store_true", help="only rewrite the markdown summary of --out")
    args = ap.parse_args()
    if args.md_only:
        with open(args.out) as f:
            write_md(json.load(f), args.out[:-5] + ".md")
        return
    topo = load(args.topology)
    if args.ranks:
        topo = topo.subset(args.ranks)
    nbytes = parse_size(args.bytes)
    t0 = time.time()
    plan, info = choose_plan(topo, topo.ranks, nbytes)
    chosen = simulate(topo, plan, nbytes, verify=False).time_s
    # 1. Every (factorization, order) through the model (one model per order, edge rates cached).
    space = []
    for oname, order in level_orders(topo):
        model = _Model(topo, order)
        for dims in factorizations(topo.ranks):
            space.append({"dims": list(dims), "order": oname, "model_s": model.time(dims, nbytes, DEFAULT_CHUNK_BYTES, topo.reduce_rate), "_order": order})
    best_model = min(r["model_s"] for r in space)
    near = [r for r in space if r["model_s"] <= best_model * (1 + args.prune)]
    rest = [r for r in space if r["model_s"] > best_model * (1 + args.prune)]
    rng = random.Random(4)
    sample = rng.sample(rest, min(args.sample, len(rest)))
    result = {"topology": topo.name, "ranks": topo.ranks, "bytes": nbytes, "lower_bound_s": lower_bound(topo, nbytes),
              "space": len(space), "prune": args.prune, "simulated_near": len(near), "simulated_sample": len(sample),
              "planner": {"dims": list(plan.dims), "simulated_s": chosen, "model_s": info["time_s"]}}
    # 2. Simulate the shapes the model cannot rule out, and a random sample of those it does.
    done = []
    for r in near + sample:
        r["simulated_s"] = simulate(topo, Plan(tuple(r["dims"]), r["_order"]), nbytes, verify=False).time_s
        r["pruned"] = r in sample
        done.append(r)
        best = min(done, key=lambda x: x["simulated_s"])
        sim_near = [x for x in done if not x["pruned"]]
        result.update(
            best={k: v for k, v in best.items() if k != "_order"},
            planner_vs_best=chosen / best["simulated_s"] - 1,
            planner_vs_bound=chosen / result["lower_bound_s"] - 1,
            model_error_max=max(abs(x["model_s"] / x["simulated_s"] - 1) for x in done),
            pruned_sample_min_vs_best=min((x["simulated_s"] / best["simulated_s"] - 1 for x in done if x["pruned"]), default=None),
            elapsed_s=time.time() - t0,
            rows=sorted(({k: v for k, v in x.items() if k != "_order"} for x in done), key=lambda x: x["simulated_s"]),
        )
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    write_md(result, args.out[:-5] + ".md")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
