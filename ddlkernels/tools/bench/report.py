"""Reports of a sweep's rows: nccl-tests' table and closing lines, CSV, JSON and a PNG of busbw.

Worked example (one row of ``run_sweep``: 2 ranks, allreduce of 1 MiB float32)::

    print(format_table(rows, ["ddlkernels", "MPI_Allreduce", "Sendrecv link"]))

    #                                                             out-of-place
    #       size         count      type   redop    root     time   algbw   busbw  #wrong  line  ddl/x path
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)
         1048576        262144     float     sum      -1   612.00    1.71    1.71       0  ddl         ring
         1048576        262144     float     sum      -1   700.00    1.50    1.50       0  MPI    1.14
         1048576        262144     float     sum      -1   250.00    2.10    2.10       0  link   0.82
    # lines: ddl = ddlkernels, MPI = MPI_Allreduce, link = Sendrecv link

(ddl/x: ddlkernels' busbw over the row's; the link's time is one ring step of N/p bytes.)

``format_footer`` adds nccl-tests' closing lines ("# Out of bounds values", "# Avg bus bandwidth"),
``write_csv`` one record per row and line, ``dump_json`` the rows with their meta data, and
``plot_rows`` a PNG of busbw against size, one panel per collective, type, op and placement.
"""

from __future__ import annotations

import json

from .sizes import format_size, nccl_type_name


def _busbw(m, stat):
    return m["busbw_GBps"] if stat == "median" else m.get("busbw_GBps_max", m["busbw_GBps"])


def _num(value, width) -> str:
    """nccl-tests' getFloatStr: two decimals, fewer when they do not fit ``width``, else an exponent."""
    for fmt in ("{:%d.2f}", "{:%d.1f}", "{:%d.0f}"):
        text = (fmt % width).format(value)
        if len(text) <= width:
            return text
    return ("{:%d.1e}" % width if width >= 7 else "{:%d.0e}" % width).format(value)


#: nccl-tests' row: size, count, type, redop, root, then per placement time, algbw, busbw, #wrong, with its
#: widths (src/util.cu); "root" is -1 for the collectives here, as nccl-tests prints for them.
_PRE = "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}"
_BODY = "  {:>7}  {:>6}  {:>6}  {:>6}"


def format_table(rows, impls, ratio_of=None, stat="median") -> str:
    """nccl-tests' table: one row per size and line, nccl-tests' columns first, then the line and more.

        size count type redop root | time algbw busbw #wrong | line ddl/x path

    The first nine columns are nccl-tests' (its names: type "float" for
    float32, "half", "double"; redop; root -1), for the placement of the rows
    (one table per placement: both in one row, as nccl-tests prints them,
    would not fit 120 columns beside the line's name).  ``line``: the short
    name of the implementation; ``ddl/x``: busbw of ``ratio_of`` (a line
    name, or the first name of a pair or of the first pair; default: the
    first ddlkernels line) over this row's busbw; ``path``: the algorithm
    ddlkernels ran ("+": its tuner measured the size again during the timed
    iterations).  ``stat``: "median" (default) or "min" time per iteration.
    """
    names = [i.name if hasattr(i, "name") else i for i in impls]
    if isinstance(ratio_of, str):
        ref = ratio_of
    elif ratio_of:
        ref = ratio_of[0] if isinstance(ratio_of[0], str) else ratio_of[0][0]
    else:
        ref = next((n for n in names if n.startswith("ddlkernels")), None)
    labels = {n: _short(n) for n in names}
    lw = max([4] + [len(v) for v in labels.values()])
    place = "in-place" if rows and all(r.get("inplace") for r in rows) else "out-of-place"
    ratio_label = f"{_short(ref)}/x" if ref else ""
    lines = [
        ("# " + " " * 50 + f"{place:^33}").rstrip(),
        "# " + "{:>10}  {:>12}  {:>8}  {:>6}  {:>6}".format("size", "count", "type", "redop", "root")
        + _BODY.format("time", "algbw", "busbw", "#wrong") + f"  {'line':<{lw}} {ratio_label:>6} path",
        ("# " + "{:>10}  {:>12}  {:>8}  {:>6}  {:>6}".format("(B)", "(elements)", "", "", "")
         + _BODY.format("(us)", "(GB/s)", "(GB/s)", "")).rstrip(),
    ]
    remeasured = False
    for r in rows:
        pre = _PRE.format(r["bytes"], r["count"], r.get("type") or nccl_type_name(r["dtype"]), r["op"], -1)
        refm = r["impls"].get(ref) if ref else None
        for n in names:
            m = r["impls"].get(n)
            if m is None:
                continue
            if "skipped" in m:
                lines.append(pre + _BODY.format("-", "-", "-", "-") + f"  {labels[n]:<{lw}} {'':>6} skipped")
                continue
            t = m["time_us_median"] if stat == "median" else m["time_us_min"]
            bus = _busbw(m, stat)
            alg = bus / m["busbw_GBps"] * m["algbw_GBps"] if m["busbw_GBps"] else 0.0
            wrong = "N/A" if m["wrong"] is None else f"{m['wrong']:g}"
            ratio = ""
            if n != ref and refm and "skipped" not in refm:
                ratio = _num(_busbw(refm, stat) / bus, 6) if bus else "inf"
            path = str(m.get("path") or "").split(" (re-measured")[0]
            if m.get("remeasured"):
                path += "+"
                remeasured = True
            lines.append((pre + _BODY.format(_num(t, 7), _num(alg, 6), _num(bus, 6), wrong)
                          + f"  {labels[n]:<{lw}} {ratio:>6} {path}").rstrip())
    legend = ", ".join(f"{v} = {k}" for k, v in labels.items() if k != v)
    if legend:
        import textwrap

        lines += textwrap.wrap(legend, 120, initial_indent="# lines: ", subsequent_indent="#   ")
    if remeasured:
        lines.append("# path+: the tuner measured the size again during the timed iterations (JSON: remeasured)")
    skipped = {(n, r["impls"][n]["skipped"]) for r in rows for n in names if "skipped" in r["impls"].get(n, {})}
    for n, why in sorted(skipped):
        lines.append(f"# {n} skipped: {why}")
    return "\n".join(lines)


def comment(text, width=120) -> str:
    """``text`` as "# " lines of at most ``width`` columns (continuations indented)."""
    import textwrap

    return "\n".join(textwrap.wrap(text, width, initial_indent="# ", subsequent_indent="#   ",
                                    break_on_hyphens=False))


def average_busbw(rows, name, stat="median"):
    """Mean busbw of line ``name`` over every row it ran in (nccl-tests' "Avg bus bandwidth"), or None."""
    vals = [_busbw(r["impls"][name], stat) for r in rows if "skipped" not in r["impls"].get(name, {"skipped": 1})]
    return sum(vals) / len(vals) if vals else None


def format_footer(rows, names, stat="median") -> str:
    """nccl-tests' closing lines: out-of-bounds (wrong) values and the average bus bandwidth.

    "# Avg bus bandwidth" is the first ddlkernels line's, averaged over every
    row (sizes, types, ops and placements alike, as nccl-tests averages
    everything it ran), so scripts that read nccl-tests' line read ours; the
    other lines' averages follow in lines of their own wording.
    """
    wrong = sum((r["impls"][n].get("wrong") or 0) for r in rows for n in names if n in r["impls"])
    checked = any(r["impls"][n].get("wrong") is not None for r in rows for n in names if n in r["impls"])
    lines = [f"# {'Out of bounds values':<20} : {wrong} {('FAILED' if wrong else 'OK') if checked else 'N/A'}"]
    main = next((n for n in names if n.startswith("ddlkernels")), names[0] if names else None)
    avg = average_busbw(rows, main, stat) if main else None
    if avg is not None:
        lines.append(f"# {'Avg bus bandwidth':<20} : {avg:g}")
    for n in names:
        a = average_busbw(rows, n, stat)
        if n != main and a is not None:
            lines.append(f"#   {n}: average bus bandwidth {a:g} GB/s")
    return "\n".join(lines)


CSV_COLUMNS = ("collective", "line", "size", "count", "type", "redop", "root", "placement", "time_us", "algbw_GBps",
               "busbw_GBps", "wrong", "path")


def write_csv(out, rows, names, stat="median") -> None:
    """One CSV record per row and line (columns ``CSV_COLUMNS``) to the text stream ``out``."""
    import csv

    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in rows:
        for n in names:
            m = r["impls"].get(n)
            if m is None or "skipped" in m:
                continue
            t = m["time_us_median"] if stat == "median" else m["time_us_min"]
            bus = _busbw(m, stat)
            alg = bus / m["busbw_GBps"] * m["algbw_GBps"] if m["busbw_GBps"] else 0.0
            w.writerow([r.get("collective", "allreduce"), n, r["bytes"], r["count"],
                        r.get("type") or nccl_type_name(r["dtype"]), r["op"], -1,
                        "in-place" if r.get("inplace") else "out-of-place", f"{t:.3f}", f"{alg:.6g}", f"{bus:.6g}",
                        "" if m["wrong"] is None else m["wrong"], m.get("path") or ""])


def _short(name):
    """Column label: "ddl", "ddl[chunk=256K]", "MPI", "MPI[ring]", "link"."""
    if name.startswith("ddlkernels") and not name.endswith("(shared input)"):
        return "ddl" + name[len("ddlkernels"):]
    if name.startswith("MPI_"):
        rest = name.split("[", 1)
        return "MPI" + ("[" + rest[1].replace("tuned ", "") if len(rest) > 1 else "")
    return {"Sendrecv link": "link", "python ring": "pyring", "chunked link": "clink", "ddl ring": "ring",
            "memcpy": "copy", "ddlkernels (shared input)": "shared"}.get(name, name)


def dump_json(path, meta, rows):
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def plot_rows(path, rows, title="", stat="median"):
    """PNG of busbw vs message size, one line per implementation, one panel per (collective, dtype, op, in place).

    Every implementation of a panel was measured in the same run; the x axis is
    the buffer's bytes N (log 2), the y axis busbw in GB/s (see the module
    docstring for the Sendrecv link's definition).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict = {}
    for r in rows:
        key = (r.get("collective", "allreduce"), r["dtype"], r["op"], r["inplace"])
        groups.setdefault(key, []).append(r)
    n = len(groups)
    cols = 1 if n == 1 else 2
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(7.5 * cols, 4.8 * nrows), squeeze=False)
    styles = {"Sendrecv link": dict(color="black", linestyle="--", marker="")}
    for ax, (key, grp) in zip(axes.flat, groups.items()):
        grp = sorted(grp, key=lambda r: r["bytes"])
        names = []
        for r in grp:
            for name in r["impls"]:
                if name not in names:
                    names.append(name)
        for name in names:
            pts = [(r["bytes"], _busbw(r["impls"][name], stat)) for r in grp
                   if name in r["impls"] and "skipped" not in r["impls"][name] and r["bytes"] > 0]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=name, **styles.get(name, dict(marker="o", markersize=3)))
        coll, dt, op, inplace = key
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size N (bytes)")
        ax.set_ylabel(f"busbw (GB/s, {stat} time)")
        ax.set_title(f"{coll} {dt} {op} {'in place' if inplace else 'out of place'}", fontsize=10)
        ticks = [r["bytes"] for r in grp if r["bytes"] > 0]
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_size(t) for t in ticks], rotation=45, fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
