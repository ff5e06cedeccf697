"""Where the time of ``Communicator.allreduce`` goes, from py-spy's raw (collapsed) stacks.

    python bench/studies/pyspy_summary.py /tmp/prof.0.txt [/tmp/prof.1.txt ...] [--src /work/main]

Only samples inside ``Communicator.allreduce`` count.  Each is put in one
bucket by the innermost ddlkernels source line on its stack (the line's text
is read from the source tree, so the classification follows the engine as it
changes) or, with ``py-spy --native``, by the native frame below it:

  MPI wait      a line that waits for requests (Wait, Waitall, Waitany, Testall, ...);
  (--native)    waits and posts split into "MPI poll" (spinning in MPI's progress
                loop: the peer is not ready) and "MPI copy" (the kernel's CMA copy
                or memcpy: data moving)
  MPI post      a line that starts a transfer (Isend, Irecv, Start, Startall, isend(, irecv()
  MPI collective MPI's own Allreduce (small-message path)
  reduce        a line that calls the reduction kernel (reduce(, np.add, ufuncs, _scale)
  copy          a line that copies (copy(, copyto)
  python        everything else inside allreduce: argument checks, planning,
                schedule lookups, slicing, loops: per-call and per-chunk overhead
"""

from __future__ import annotations

import argparse
import os
import re
from collections import Counter

BUCKETS = ("MPI wait", "MPI poll", "MPI copy", "MPI post", "MPI collective", "reduce", "copy", "python")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+):(?P<line>\d+)\)$")
_RULES = [
    ("MPI wait", re.compile(r"\b(Wait|Waitall|Waitany|Waitsome|Test|Testall|Testany|wait_all|_wait_all|wait)\s*\(")),
    ("MPI collective", re.compile(r"\b(Allreduce|Reduce_scatter|Allgather|Barrier|mpi_allreduce)\s*\(")),
    ("MPI post", re.compile(r"\b(Isend|Irecv|Send_init|Recv_init|Start|Startall|isend|irecv|start)\s*\(")),
    ("reduce", re.compile(r"\b(reduce|ufunc|_scale_inplace|add|multiply|maximum|minimum|floor_divide)\s*\(")),
    ("copy", re.compile(r"\b(copy|copyto)\s*\(")),
]


def _source_line(src, path, line, cache={}):  # noqa: B006 - a memo of files read
    key = (src, path)
    if key not in cache:
        full = os.path.join(src, path)
        try:
            with open(full) as f:
                cache[key] = f.read().splitlines()
        except OSError:
            cache[key] = []
    lines = cache[key]
    return lines[line - 1] if 0 < line <= len(lines) else ""


def classify(stack: list[str], src: str) -> str | None:
    """Bucket of one sample, or None when it is outside ``Communicator.allreduce``."""
    if not any(f.startswith("Communicator.allreduce ") for f in stack):
        return None
    # innermost ddlkernels frame and what lies below it
    for i in range(len(stack) - 1, -1, -1):
        m = _FRAME.match(stack[i])
        if m and m.group("file").startswith("ddlkernels/"):
            text = _source_line(src, m.group("file"), int(m.group("line")))
            below = ";".join(stack[i + 1:])
            for name, rule in _RULES:
                if rule.search(text):
                    if name in ("MPI wait", "MPI post") and below:
                        return _native_split(name, below)
                    return name
            if re.search(r"PyMPI_Wait|MPI_Wait|ompi_request_default_wait|MPI_Waitall", below):
                return "MPI wait"
            if re.search(r"ufunc|add|_multiply", below):
                return "reduce"
            return "python"
    return "python"


def _native_split(name: str, below: str) -> str:
    """With ``py-spy --native``: split an MPI call into spinning in MPI's progress loop and moving data.

    Open MPI's shared-memory transport moves a large message with one
    ``process_vm_readv`` (CMA) done by the receiver inside the progress loop;
    the kernel's copy shows as an unresolvable native frame (``0x... (?)``)
    or as memcpy.  It happens in whichever call finds the message ready: a
    Wait, or the Irecv itself.  Samples whose innermost native frame is the
    progress machinery are polling: waiting for the peer.
    """
    frames = below.split(";")
    leaf = frames[-1]
    if re.search(r"process_vm_readv|memcpy|memmove|\(\?\)", ";".join(frames[-2:])):
        return "MPI copy"
    if re.search(r"opal_progress|ompi_sync_wait|ompi_request_default_wait|PMPI_Wait|mutex|libmpi|libopen-pal|"
                 r"Wait \(mpi4py", leaf):
        return "MPI poll"
    return name


def summarize(path: str, src: str):
    counts: Counter = Counter()
    lines: Counter = Counter()
    total = 0
    with open(path) as f:
        for raw in f:
            raw = raw.rstrip("\n")
            if not raw:
                continue
            stack_text, _, n = raw.rpartition(" ")
            n = int(n)
            total += n
            stack = stack_text.split(";")
            bucket = classify(stack, src)
            if bucket is None:
                continue
            counts[bucket] += n
            for fr in reversed(stack):
                m = _FRAME.match(fr)
                if m and m.group("file").startswith("ddlkernels/"):
                    lines[(bucket, fr, _source_line(src, m.group("file"), int(m.group("line"))).strip())] += n
                    break
    return total, counts, lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--src", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."),
                    help="source tree the profiled ddlkernels came from (default: this checkout)")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    for path in a.files:
        total, counts, lines = summarize(path, a.src)
        inside = sum(counts.values())
        print(f"## {path}: {total} samples, {inside} inside Communicator.allreduce")
        for b in BUCKETS:
            if counts[b]:
                print(f"   {b:<15} {counts[b]:>7}  {counts[b] / inside:6.1%}")
        print("   top lines:")
        for (b, fr, text), n in lines.most_common(a.top):
            print(f"   {n / inside:6.1%}  {b:<14} {fr}  | {text[:70]}")


if __name__ == "__main__":
    main()
