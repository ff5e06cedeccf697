"""What the node kernels (``node_primitives``, ``window_loops``, ``cma_loops``) and their Python callers agree
on, importable without Numba: the flag lines' layout and the op codes.

Worked example: rank 2's barrier flag is ``flags[2 * FLAG_STRIDE]``, one 64-byte cache line per rank, and
``window_loops.pieces_allreduce[OPCODES["max"]]`` is the compiled piece loop of "max".
"""

from __future__ import annotations

__all__ = ["FLAG_STRIDE", "OPCODES"]

#: int64 elements between two ranks' barrier flags: one 64-byte cache line each.
FLAG_STRIDE = 8
#: Index of each op in the per-op tuples of compiled loops (``small_fold``, ``pieces_allreduce``, ...).
OPCODES = {"sum": 0, "prod": 1, "max": 2, "min": 3}
