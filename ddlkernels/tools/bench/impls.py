"""The lines a sweep compares: ``Collective`` records, and ``make_impls``, which builds them by name.

Worked example (allreduce; Open MPI's algorithm not forced)::

    impls = make_impls("allreduce", which=("ddlkernels", "mpi", "link", "pyring"))
    [i.name for i in impls]   -> ['ddlkernels', 'MPI_Allreduce', 'python ring', 'Sendrecv link']
    impls[0].bus_factor(4)    -> 1.5          (busbw = algbw * 2 (p - 1) / p)
    make_impls("allreduce", ("ddlkernels",), ddl_options=({"chunk_bytes": 262144},))[0].name
                              -> 'ddlkernels[chunk=256K]'
    tuned_label("allreduce", {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
                              "OMPI_MCA_coll_tuned_allreduce_algorithm": "4"})   -> '[tuned ring]'

The lines: ddlkernels (one per option set, sharing ``Communicator``s through ``_DDL``), MPI's own
call, ddlkernels on shared input, the ring engine alone, a textbook Python ring, the copy bound and
the link, each from the functions in ``calls``.  ``ALLREDUCE_IMPLS`` are the two lines of
``python -m ddlkernels job``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..._dtypes import dtype_name
from .buffers import _placed, _sentinels
from .calls import (_copy_make, _copy_run, _copy_wrong, _ddl_ag_run, _ddl_ag_wrong, _ddl_rs_run, _ddl_rs_wrong,
                    _ddl_run, _ddl_settling, _gathered, _link_bytes, _link_make, _link_run, _link_wrong, _linkc_make,
                    _linkc_run, _make_ar, _make_rs_common, _mpi_ag_make, _mpi_ag_run, _mpi_ag_wrong, _mpi_ar_run,
                    _mpi_rs_make, _mpi_rs_run, _mpi_rs_wrong, _pyring_make, _pyring_run, _wrong_ar)
from .sizes import COLLECTIVES, format_size


@dataclass
class Collective:
    """One implementation of one collective, as the harness sees it."""

    name: str
    #: busbw = algbw * bus_factor(p)
    bus_factor: Callable[[int], float]
    #: make(comm, count, dtype, op, inplace) -> state; run(state) -> None; wrong(state) -> int
    make: Callable
    run: Callable
    wrong: Callable
    #: which algorithm ran, for the table ("ring", "mpi", ...); may read state
    path: Callable = field(default=lambda state: "")
    #: bytes one call is charged for algbw, from the buffer's bytes N and p (default N)
    algbw_bytes: Callable = field(default=lambda nbytes, p: nbytes)
    #: why this implementation cannot run (dtype, op, inplace), or None; decided
    #: locally and identically on every rank, so skipping never splits the ranks
    unsupported: Callable = field(default=lambda dtype, op, inplace: None)
    #: whether the next call would still be a tuner trial (the same on every
    #: rank); warmup goes on until it is False, at most ``MAX_SETTLE`` calls
    settling: Callable = field(default=lambda state: False)


def _ar_factor(p):
    return 2.0 * (p - 1) / p if p > 1 else 1.0


def _rs_factor(p):
    return (p - 1) / p if p > 1 else 1.0


def _mpi_unsupported(dtype, op, inplace):
    """MPI has no avg (we scale after a sum, as a user would) and may lack a datatype (bfloat16)."""
    from mpi4py import MPI
    from mpi4py.util.dtlib import from_numpy_dtype

    try:
        dt = from_numpy_dtype(np.dtype(dtype))
    except (ValueError, KeyError, TypeError) as exc:
        return f"no MPI datatype for {dtype_name(dtype)} ({exc})"
    if dt == MPI.DATATYPE_NULL:
        return f"no MPI datatype for {dtype_name(dtype)}"
    return None


#: Open MPI's coll/tuned algorithm numbers, as printed by
#: ``ompi_info --param coll tuned --level 9`` (Open MPI 5.0.x); forcing one
#: needs ``OMPI_MCA_coll_tuned_use_dynamic_rules=1`` and
#: ``OMPI_MCA_coll_tuned_<collective>_algorithm=<number>`` in the environment
#: *before* MPI_Init.  bench/test_tuned_table.py checks this table against the
#: installed ompi_info.
TUNED_ALGORITHMS = {
    "allreduce": {"basic_linear": 1, "nonoverlapping": 2, "recursive_doubling": 3, "ring": 4,
                  "segmented_ring": 5, "rabenseifner": 6},
    "reduce_scatter_block": {"basic_linear": 1, "recursive_doubling": 2, "recursive_halving": 3, "butterfly": 4},
    "allgather": {"linear": 1, "bruck": 2, "recursive_doubling": 3, "ring": 4, "neighbor": 5, "two_proc": 6,
                  "sparbit": 7},
}
#: Which MPI collective (and tuned parameter) stands beside each of ours.
_TUNED_PARAM = {"allreduce": "allreduce", "reduce_scatter": "reduce_scatter_block", "allgather": "allgather"}


# -- the registry ------------------------------------------------------------------------


def tuned_label(kind: str, environ=None) -> str:
    """"[tuned ring]" when Open MPI's algorithm for ``kind`` is forced through the environment, else ""."""
    env = os.environ if environ is None else environ
    if env.get("OMPI_MCA_coll_tuned_use_dynamic_rules", "").lower() not in ("1", "true", "yes", "t", "y",
                                                                            "enabled"):
        return ""
    param = _TUNED_PARAM[kind]
    raw = env.get(f"OMPI_MCA_coll_tuned_{param}_algorithm", "")
    if raw in ("", "0", "ignore"):
        return ""
    names = {str(v): k for k, v in TUNED_ALGORITHMS[param].items()}
    return f"[tuned {names.get(raw, raw)}]"


_MPI_NAMES = {"allreduce": "MPI_Allreduce", "reduce_scatter": "MPI_Reduce_scatter_block",
              "allgather": "MPI_Allgather"}


class _DdlFactory:
    """One ``Communicator`` per set of options, shared by every size of a sweep (creating one is collective)."""

    def __init__(self):
        self._cache = {}

    def get(self, comm, options):
        key = (id(comm), tuple(sorted(options.items())))
        hit = self._cache.get(key)
        if hit is None:
            from ...communicator import Communicator, as_communicator

            # Default options: the communicator the module-level API would use.
            hit = (Communicator(comm, **options), True) if options else (as_communicator(comm), False)
            self._cache[key] = hit
        return hit[0]

    def free(self):
        """Free the communicators made here (collective: call on every rank)."""
        for dc, ours in self._cache.values():
            if ours:
                dc.free()
        self._cache.clear()


_DDL = _DdlFactory()


def _ddl_label(options):
    if not options:
        return "ddlkernels"
    parts = []
    for k, v in sorted(options.items()):
        short = {"chunk_bytes": "chunk", "small_bytes": "small", "window": "window"}.get(k, k)
        parts.append(f"{short}={format_size(v) if k.endswith('bytes') else v}")
    return f"ddlkernels[{','.join(parts)}]"


def make_impls(kind: str, which=("ddlkernels", "mpi", "link"), ddl_options=({},), mpi_label=None):
    """The records of one collective: ddlkernels (one per option set), MPI's own, the Sendrecv link.

    ``which`` may also name "ring": for allreduce, ddlkernels with the tuner
    off and the ring at every size; "pyring": for allreduce, a textbook Python ring
    (whole-block ``Sendrecv`` steps, no pipelining) as a baseline; and
    "linkchunk": the link's ring step moved as 1 MiB Isend/Irecv pieces, all
    posted at once (the step as a chunked pipeline would see it); "copy": for
    allreduce, every rank copying its input buffer into its output (the
    memory traffic an out-of-place allreduce cannot avoid); "shared": ddlkernels on
    an input (allgather: a shard) allocated with ``Communicator.empty``, which the
    shared-memory window's peers read in place.

    ``ddl_options``: dicts of ``Communicator`` keyword arguments (e.g.
    ``{"chunk_bytes": 262144}``), one ddlkernels line each.  ``mpi_label``:
    suffix of the MPI line's name (default: the forced tuned algorithm read
    from the environment, see ``tuned_label``).
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(COLLECTIVES)}")
    label = tuned_label(kind) if mpi_label is None else mpi_label
    out = []
    if "ddlkernels" in which:
        for opts in ddl_options:
            opts = dict(opts)
            if kind == "allreduce":

                def make(comm, count, dtype, op, inplace=False, _o=opts):
                    st = _make_ar(comm, count, dtype, op, inplace)
                    st["dc"] = _DDL.get(comm, _o)
                    return st

                out.append(Collective(_ddl_label(opts), _ar_factor, make, _ddl_run, _wrong_ar,
                                      path=lambda st: st["dc"].last_algorithm or "", settling=_ddl_settling))
            elif kind == "reduce_scatter":

                def make(comm, count, dtype, op, inplace=False, _o=opts):
                    st = _make_rs_common(comm, count, dtype, op)
                    st["dc"] = dc = _DDL.get(comm, _o)
                    lo, hi = dc.shard_range(count)
                    st["expect"] = st["full"][lo:hi]
                    st["out"] = _sentinels(hi - lo, dtype)
                    return st

                out.append(Collective(_ddl_label(opts), _rs_factor, make, _ddl_rs_run, _ddl_rs_wrong,
                                      path=lambda st: st["dc"].last_algorithm or "",
                                      settling=lambda st: st["dc"].tuning(st["x"], st["op"], collective="reduce_scatter"),
                                      unsupported=lambda d, o, inplace: "no in-place reduce_scatter API"
                                      if inplace else None))
            else:

                def make(comm, count, dtype, op, inplace=False, _o=opts):
                    dc = _DDL.get(comm, _o)
                    bounds = [dc.shard_range(count, rank=q) for q in range(comm.Get_size())]
                    full = _gathered(comm, count, dtype, bounds)
                    lo, hi = bounds[comm.Get_rank()]
                    return {"dc": dc, "shard": _placed(full[lo:hi]), "pristine": full[lo:hi].copy(), "expect": full,
                            "out": _sentinels(count, dtype)}

                out.append(Collective(_ddl_label(opts), _rs_factor, make, _ddl_ag_run, _ddl_ag_wrong,
                                      path=lambda st: st["dc"].last_algorithm or "",
                                      settling=lambda st: st["dc"].tuning(st["expect"], collective="allgather"),
                                      unsupported=lambda d, o, inplace: "no in-place allgather API"
                                      if inplace else None))
    if "mpi" in which:
        name = _MPI_NAMES[kind] + label
        if kind == "allreduce":
            out.append(Collective(name, _ar_factor, _make_ar, _mpi_ar_run, _wrong_ar, unsupported=_mpi_unsupported))
        elif kind == "reduce_scatter":
            out.append(Collective(name, _rs_factor, _mpi_rs_make, _mpi_rs_run, _mpi_rs_wrong,
                                  unsupported=_mpi_unsupported))
        else:
            out.append(Collective(name, _rs_factor, _mpi_ag_make, _mpi_ag_run, _mpi_ag_wrong,
                                  unsupported=_mpi_unsupported))
    if "shared" in which:
        # ddlkernels as a user who allocates buffers with Communicator.empty
        # gets it: the input (allgather: the shard) in shared memory, which
        # peers read in place.  Its own Communicator (shm=None is the default,
        # but another key), so its tuner measures apart from the plain line's.
        def shared_copy(dc, a, count):
            buf = dc.empty(count, a.dtype)[: a.size]  # the same shape on every rank: a prefix of it
            buf[...] = a
            return buf

        def sharing(make, key, count_of):
            def make_shared(comm, count, dtype, op, inplace=False):
                st = make(comm, count, dtype, op, inplace)
                dc = st["dc"] = _DDL.get(comm, {"shm": None})
                st[key] = shared_copy(dc, st[key], count_of(dc, count))
                return st

            return make_shared

        name = "ddlkernels (shared input)"
        whole = lambda dc, count: count  # noqa: E731
        if kind == "allreduce":
            out.append(Collective(name, _ar_factor, sharing(_make_ar, "x", whole), _ddl_run, _wrong_ar,
                                  path=lambda st: st["dc"].last_algorithm or "", settling=_ddl_settling))
        else:
            plain = out[0] if out and out[0].name == "ddlkernels" else make_impls(kind, ("ddlkernels",))[0]

            def longest(dc, count):
                return max(b - a for a, b in (dc.shard_range(count, rank=q) for q in range(dc.size)))

            rs = kind == "reduce_scatter"
            out.append(Collective(name, plain.bus_factor, sharing(plain.make, "x" if rs else "shard",
                                                                  whole if rs else longest),
                                  plain.run, plain.wrong, path=plain.path, settling=plain.settling,
                                  unsupported=plain.unsupported))
    if "ring" in which and kind == "allreduce":
        # The multi-dimensional ring engine alone: a fixed small_bytes of 0 turns the tuner off.
        def make_ring(comm, count, dtype, op, inplace=False):
            st = _make_ar(comm, count, dtype, op, inplace)
            st["dc"] = _DDL.get(comm, {"small_bytes": 0})
            return st

        out.append(Collective("ddl ring", _ar_factor, make_ring, _ddl_run, _wrong_ar,
                              path=lambda st: st["dc"].last_algorithm or ""))
    if "pyring" in which and kind == "allreduce":
        out.append(Collective("python ring", _ar_factor, _pyring_make, _pyring_run, _wrong_ar,
                              path=lambda st: "sendrecv"))
    if "copy" in which and kind == "allreduce":
        # Every rank copies its N-byte input into its N-byte output, all ranks at
        # once: the memory traffic an out-of-place allreduce cannot avoid (read
        # the input, write the output), timed like a collective.  Charged as an
        # allreduce of N bytes, so its busbw is the ceiling of one that costs
        # no more than that copy.
        out.append(Collective("memcpy", _ar_factor, _copy_make, _copy_run, _copy_wrong, path=lambda st: "copy",
                              unsupported=lambda d, o, inplace: "the copy bound is out of place" if inplace else None))
    if "linkchunk" in which:
        out.append(Collective("chunked link", lambda p: 1.0, _linkc_make, _linkc_run, _link_wrong,
                              algbw_bytes=_link_bytes))
    if "link" in which:
        # The link has no placement: the same line stands beside in-place runs.
        out.append(Collective("Sendrecv link", lambda p: 1.0, _link_make, _link_run, _link_wrong,
                              algbw_bytes=_link_bytes))
    return out


def _ddl_ar_make_default(comm, count, dtype, op, inplace=False):
    st = _make_ar(comm, count, dtype, op, inplace)
    st["dc"] = _DDL.get(comm, {})
    return st


#: The two lines of ``python -m ddlkernels job`` (kept as the job's stable interface).
ALLREDUCE_IMPLS = {
    "ddlkernels": Collective("ddlkernels", _ar_factor, _ddl_ar_make_default, _ddl_run, _wrong_ar,
                             path=lambda st: st["dc"].last_algorithm or "", settling=_ddl_settling),
    "MPI_Allreduce": Collective("MPI_Allreduce", _ar_factor, _make_ar, _mpi_ar_run, _wrong_ar,
                                unsupported=_mpi_unsupported),
}
