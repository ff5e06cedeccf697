"""What the kernel's copy between processes costs against a copy in user space: the ceiling of "cma".

    python bench/kernels/kernel_copy.py [--bytes 16M,64M] [--pieces 256K,512K] [--rounds 7]

The single-copy allreduce (``ddlkernels.algorithms.cma``) moves every byte between
processes with ``process_vm_readv`` (a peer's input, from memory, into a
piece of its own that stays in cache) and ``process_vm_writev`` (a folded
piece, from its cache, into a peer's output in memory).  This times those two
moves against libc's ``memcpy`` doing the same, piece after piece over each
``--bytes`` buffer (larger than L2), in one process (a process may read and
write its own memory so: the kernel pins and copies exactly as for a peer's),
from compiled loops (the allreduce's own calls: ``ddlkernels.kernels.cma_loops._vm``,
``_copy``).  Four lines, interleaved round by round, each the
median over rounds, GB/s of bytes copied:

* ``memcpy in`` / ``readv in``: buffer piece -> one piece-sized array, piece by piece;
* ``memcpy out`` / ``writev out``: one piece-sized array -> buffer piece, piece by piece.

Why it matters: in the single-copy allreduce nearly all the time is these
copies. ``perf record -a -g -- mpirun -n 4 python bench/studies/profile_engine.py
16M --cma -w 20 -n 1500``, then ``perf report --no-children --sort sym -g
none --time 30%-80%`` (the steady middle of the run): ``_copy_to_iter`` 37 %
and ``_copy_from_iter`` 35 % of all CPU time on the 2-core Xeon VM (the
reads and the pushes); with 2 ranks (``-n 6000``) 43 % and 25 %. The kernel
copies a page (4 KiB) at a time, one ``rep movsb`` each, where libc's copy
of a piece is one; the ratios readv / memcpy and writev / memcpy below are
how much of the machine's copy bandwidth the algorithm can reach. On that
machine (seven runs through the 64 MiB buffer, five through the 16 MiB one;
``bench/results/kernel_copy.txt`` is another): 0.79-0.92 (readv) and
0.79-0.88 (writev) through 64 MiB, 0.59-0.73 and 0.52-0.80 through 16 MiB
(whose copies can partly come from the last-level cache; there they lose
most). The bytes of every copy are checked.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from numba import njit

from ddlkernels.tools.bench import parse_size
from ddlkernels.algorithms.cma import PIECE_BYTES, PIECE_BYTES_WIDE
from ddlkernels.kernels.cma_loops import _vm
from ddlkernels.kernels.node_primitives import _copy


@njit(nogil=True)
def _kernel(pid, big, piece, iov, write):
    # Piece after piece of big: process_vm_readv into piece (write False) or process_vm_writev from it.
    bad = 0
    for a in range(0, big.shape[0] - piece.shape[0] + 1, piece.shape[0]):
        if not _vm(pid, piece, big.ctypes.data + a, iov, write):
            bad += 1
    return bad


@njit(nogil=True)
def _memcpy(big, piece, write):
    # The same moves with libc's memcpy: big's pieces into piece (write False), or piece into them.
    n = piece.shape[0]
    for a in range(0, big.shape[0] - n + 1, n):
        if write:
            _copy(big[a : a + n], piece)
        else:
            _copy(piece, big[a : a + n])
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", default="16M,64M", help="the buffers streamed through, piece by piece (default 16M,64M)")
    ap.add_argument("--pieces", default=f"{PIECE_BYTES_WIDE >> 10}K,{PIECE_BYTES >> 10}K",
                    help="piece sizes (default: the single-copy allreduce's, ddlkernels.algorithms.cma.piece_for)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    pid = os.getpid()
    iov = np.zeros(4, np.int64)
    print(f"# one process, GB/s of bytes copied (median of {args.rounds} rounds)")
    print(f"{'buffer':>6} {'piece':>6} | {'memcpy in':>9} {'readv in':>9} {'memcpy out':>10} {'writev out':>10} |"
          f" readv/memcpy writev/memcpy")
    for b in args.bytes.split(","):
        nbytes = parse_size(b)
        src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
        dst = np.zeros(nbytes, np.uint8)
        for s in args.pieces.split(","):
            _line(pid, iov, src, dst, b, s, args.rounds)


def _line(pid, iov, src, dst, b, s, rounds):
    nbytes = src.shape[0]
    size = parse_size(s)
    if not 0 < size <= nbytes:
        raise SystemExit(f"--pieces: {s} must be between 1 byte and the buffer's {b}")
    piece = np.zeros(size, np.uint8)
    covered = nbytes // size * size
    lines = {"memcpy in": lambda: _memcpy(src, piece, False),
             "readv in": lambda: _kernel(pid, src, piece, iov, False),
             "memcpy out": lambda: _memcpy(dst, piece, True),
             "writev out": lambda: _kernel(pid, dst, piece, iov, True)}
    times = {k: [] for k in lines}
    for r in range(rounds + 1):  # round 0 compiles and faults the pages in, untimed
        for k, (name, run) in enumerate(lines.items()):
            piece[:] = 0 if name.endswith(" in") else 1 + (r * 4 + k) % 255  # a value no earlier line wrote
            t0 = time.perf_counter()
            bad = run()
            dt = time.perf_counter() - t0
            if bad:
                raise SystemExit(f"{name}: {bad} process_vm_readv/writev calls failed (ptrace permission?)")
            got, want = ((piece, src[covered - size : covered]) if name.endswith(" in")
                         else (dst[:covered].reshape(-1, size), piece))
            if not (got == want).all():
                raise SystemExit(f"{name}: the bytes copied differ from the source")
            if r:
                times[name].append(dt)
    gb = {k: covered / float(np.median(v)) / 1e9 for k, v in times.items()}
    print(f"{b:>6} {s:>6} | {gb['memcpy in']:9.3g} {gb['readv in']:9.3g} {gb['memcpy out']:10.3g} {gb['writev out']:10.3g} |"
          f" {gb['readv in'] / gb['memcpy in']:12.3g} {gb['writev out'] / gb['memcpy out']:13.3g}", flush=True)


if __name__ == "__main__":
    main()
