"""Plot simulated allreduce time vs ranks (flat ring, 2-level, planner's choice) from bench/studies/topo_study.py scaling.

    python bench/studies/topo_study.py scaling        # writes bench/results/scaling-100MB.json
    python bench/studies/plot_scaling.py              # writes bench/results/scaling-100MB.png
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(HERE, "..", "results", "scaling-100MB.json"))
    ap.add_argument("--out", default=os.path.join(HERE, "..", "results", "scaling-100MB.png"))
    args = ap.parse_args()
    with open(args.data) as f:
        data = json.load(f)
    presets = data["presets"]
    fig, axes = plt.subplots(1, len(presets), figsize=(5.2 * len(presets), 4.2), squeeze=False)
    for ax, (name, rows) in zip(axes[0], presets.items()):
        p = [r["ranks"] for r in rows]
        ax.plot(p, [r["flat"]["simulated_s"] * 1e3 for r in rows], "o-", label="flat ring (p)")
        tl = [(r["ranks"], r["two_level"]["simulated_s"] * 1e3) for r in rows if r["two_level"]]
        if tl:
            ax.plot(*zip(*tl), "s-", label="2-level (node x rest)")
        ax.plot(p, [r["planner"]["simulated_s"] * 1e3 for r in rows], "^-", label="planner's choice")
        ax.plot(p, [r["lower_bound_s"] * 1e3 for r in rows], "k:", label="alpha-beta lower bound")
        for r in rows:
            ax.annotate("x".join(map(str, r["planner"]["dims"])), (r["ranks"], r["planner"]["simulated_s"] * 1e3),
                        textcoords="offset points", xytext=(0, -12), ha="center", fontsize=6)
        ax.set_xscale("log", base=2)
        ax.set_xticks(p)
        ax.set_xticklabels([str(x) for x in p])
        ax.set_xlabel("ranks (GPUs)")
        ax.set_ylabel("simulated allreduce time (ms)")
        ax.set_title(f"{name}: {data['bytes'] >> 20} MB float32")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Simulated engine schedule (chunk 1 MiB, window 4) on the presets", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
