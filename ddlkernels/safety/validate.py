"""``validate=True``: check that every rank called the same collective with the same arguments.

Ranks that disagree on the element count, dtype, op, dims or chunk size do
not fail cleanly on their own: a ring of receives sized for one count meets
sends sized for another, and the job hangs, dies on a truncation error on one
rank while the others wait, or -- worst -- returns wrong numbers.  Each rank
can only check its own arguments, so agreement costs one collective: every
rank contributes a fixed-size record of int64 and ``MPI_Allgather`` gives
every rank the whole table.  Every rank then runs the same comparison on the
same table, so either all proceed or all raise the same ``ValueError``.
The common case -- everyone agrees -- needs less than the table: one
``MPI_Allreduce(MAX)`` of the record and its negation gives every field's
maximum and minimum over ranks, and they are equal everywhere exactly when
all ranks agree.  That costs O(log p) small messages instead of an
allgather's O(p) data; only when some field differs do the ranks gather
the whole table to say who passed what.

Worked example, 3 ranks, rank 1 passes float64 and a different count::

    record   [magic, failed, kind, count, dtype, op, chunk, path, ndims, d1..d7]
    rank 0   [  ...,      0,    0,    10,     2,  0, 262144,   0,    -1, ...]
    rank 1   [  ...,      0,    0,    11,     3,  0, 131072,   0,    -1, ...]
    rank 2   [  ...,      0,    0,    10,     2,  0, 262144,   0,    -1, ...]

    ValueError (on ranks 0, 1 and 2): ddlkernels.allreduce: ranks called with
    different arguments (count, dtype, chunk differ): ranks 0, 2 passed
    count=10, dtype=float32, chunk=262144 elements; rank 1 passed count=11,
    dtype=float64, chunk=131072 elements

(the chunk differs because the same ``chunk_bytes`` holds half as many
float64 elements: the ring would cut the blocks differently on rank 1).

A rank whose *local* checks fail (say, an unsupported dtype) would otherwise
raise alone and leave the others waiting; with validation on it still joins
the exchange with its ``failed`` flag set, the ranks exchange the error
texts in a second, rare collective, and the other ranks raise a
``ValueError`` quoting it while that rank raises its own exception.

The cost is one small allreduce per call (see docs/reliability.md for the
measured ratio); it is off by default and turned on per call, per
``Communicator``, or for a whole job with ``DDLKERNELS_VALIDATE=1``.  Every
rank must use the same setting: a rank that validates while another does not
is itself a mismatch that no check can see (a ``timeout=`` turns that hang
into an error).
"""

from __future__ import annotations

import zlib

import numpy as np

from .._dtypes import OPS, SUPPORTED_DTYPES, dtype_name

__all__ = ["check_agreement", "report_local_failure", "Call", "KINDS", "PATHS"]

#: Collectives, by code in the record.
KINDS = ("allreduce", "reduce_scatter", "allgather")
#: Algorithm a rank is about to run (ddlkernels.select.choice).
#: The ring, MPI_Allreduce, MPI_Iallreduce + Wait, the shared window (result blocks stored normally or
#: non-temporally), the window per node + across nodes, the single copy, CUDA IPC (every name in
#: ``ddlkernels.algorithms.REGISTRY``; new names go last, as the record stores the index).
PATHS = ("ring", "mpi", "nbc", "shm", "hier", "shm-nt", "cma", "ipc", "host")

_MAGIC = 0x64646C6B  # "ddlk": a record from something else is reported, not misread
_MAX_DIMS = 7
_LEN = 9 + _MAX_DIMS + 2  # ... d1..d7, then the Communicator's small_bytes and shm
_NONE = -1  # "not given" / "not compared" (and small_bytes=None: measured)
_FIELDS = ("collective", "count", "dtype", "op", "dims", "chunk", "small_bytes", "shm", "path")
#: ``Communicator(shm=...)``, by code in the record.
_SHM = (None, True, False)


def _code(value, table, what):
    if value is None:
        return _NONE
    try:
        return table.index(value)
    except ValueError:
        raise ValueError(f"check_agreement: unknown {what} {value!r}") from None


def _record(kind, count, dtype, op, dims, chunk, path, failed, small_bytes=None, shm=_NONE):
    rec = np.full(_LEN, _NONE, dtype=np.int64)
    rec[0] = _MAGIC
    rec[1] = 1 if failed else 0
    rec[2] = _code(kind, KINDS, "kind")
    rec[3] = _NONE if count is None else int(count)
    rec[4] = _NONE if dtype is None else [np.dtype(d) for d in SUPPORTED_DTYPES].index(np.dtype(dtype))
    rec[5] = _code(op, OPS, "op")
    rec[6] = _NONE if chunk is None else int(chunk)
    rec[7] = _code(path, PATHS, "path")
    if dims is not None:
        dims = tuple(int(d) for d in dims)
        rec[8] = len(dims)
        if len(dims) <= _MAX_DIMS:
            rec[9 : 9 + len(dims)] = dims
        else:  # a box of more than 7 dimensions: compare a checksum of the tuple
            rec[9] = zlib.crc32(repr(dims).encode())
    rec[9 + _MAX_DIMS] = _NONE if small_bytes is None else int(small_bytes)
    rec[10 + _MAX_DIMS] = _NONE if shm is _NONE else _SHM.index(shm)
    return rec


def _describe(rec):
    """Field name -> readable value of one record (the fields a message may quote)."""
    nd = int(rec[8])
    if nd == _NONE:
        dims = "None"
    elif nd <= _MAX_DIMS:
        dims = str(tuple(int(d) for d in rec[9 : 9 + nd]))
    else:
        dims = f"<{nd} dimensions, crc {int(rec[9]):#x}>"

    def pick(i, table):
        return "?" if rec[i] == _NONE else table[int(rec[i])]

    return {
        "collective": pick(2, KINDS),
        "count": "?" if rec[3] == _NONE else str(int(rec[3])),
        "dtype": pick(4, [dtype_name(d) for d in SUPPORTED_DTYPES]),
        "op": pick(5, OPS),
        "dims": dims,
        "chunk": "n/a" if rec[6] == _NONE else f"{int(rec[6])} elements",
        "small_bytes": "None" if rec[9 + _MAX_DIMS] == _NONE else str(int(rec[9 + _MAX_DIMS])),
        "shm": pick(10 + _MAX_DIMS, [str(v) for v in _SHM]),
        "path": pick(7, PATHS),
    }


def _ranks_text(ranks):
    """"rank 3" / "ranks 0, 2, 5-9" (consecutive runs collapsed)."""
    runs, start = [], ranks[0]
    prev = start
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def _exchange(comm, rec, deadline):
    """None when every rank sent the same record, else the table of all records (collective).

    Nonblocking calls on every rank, waited for or polled: ranks with and without a ``timeout=`` make
    the same calls (a blocking and a nonblocking collective never match).
    """
    from mpi4py import MPI

    from .deadline import complete

    both = np.concatenate([rec, -rec])
    red = np.empty_like(both)
    complete(comm.Iallreduce(both, red, MPI.MAX), deadline, "the argument check (MPI_Iallreduce)")
    if np.array_equal(red[:_LEN], -red[_LEN:]):
        return None
    # Some field differs (every rank sees the same maxima and minima, so all take this branch).
    table = np.empty((comm.Get_size(), _LEN), dtype=np.int64)
    complete(comm.Iallgather(rec, table), deadline, "the argument check (MPI_Iallgather)")
    return table


#: Bytes of one rank's error text in the second exchange (longer texts are cut).
_TEXT = 1024


def _local_errors(comm, table, error, deadline=None):
    """Second exchange, only when some rank failed locally: everyone learns the messages."""
    from .deadline import complete

    mine = np.zeros(_TEXT, dtype=np.uint8)
    if error is not None:
        text = f"{type(error).__name__}: {error}".encode(errors="replace")[:_TEXT]
        mine[: len(text)] = np.frombuffer(text, dtype=np.uint8)
    texts = np.empty((comm.Get_size(), _TEXT), dtype=np.uint8)
    complete(comm.Iallgather(mine, texts), deadline, "the argument check (MPI_Iallgather)")
    return [row.tobytes().rstrip(b"\0").decode(errors="replace") or None for row in texts]


def report_local_failure(comm, *, kind, error, deadline=None) -> None:
    """Join the agreement exchange as a rank whose local checks raised ``error``.

    Collective: the other ranks are in ``check_agreement`` for the same call.
    Returns normally; the caller re-raises ``error`` itself.
    """
    table = _exchange(comm, _record(kind, None, None, None, None, None, None, True), deadline)
    # Same decision as check_agreement's on the same table; None: every rank failed alike.
    if table is not None and table[:, 1].any():
        _local_errors(comm, table, error, deadline)


def check_agreement(comm, *, kind, count, dtype, op, dims, chunk=None, path=None, small_bytes=None, shm=_NONE,
                    deadline=None) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks passed equal arguments.

    Collective over ``comm``: one ``MPI_Iallreduce`` of 36 int64 when the
    ranks agree, plus an ``MPI_Iallgather`` of 18 int64 per rank when not.
    ``kind`` is one of ``KINDS``; ``count`` the element count (``None``:
    not compared, e.g. allgather's shard lengths, which legitimately
    differ); ``dtype`` a supported numpy dtype; ``op`` one of ``OPS`` or
    ``None``; ``dims`` a tuple or ``None`` (the library's choice -- a rank
    passing ``None`` and one passing an explicit box disagree even when the
    boxes happen to match, because on another machine they would not);
    ``chunk`` the pipeline chunk in elements; ``path`` one of ``PATHS``;
    ``small_bytes`` and ``shm`` the ``Communicator``'s settings of those
    names, which choose the path (``shm`` not given: not compared).
    ``deadline``: a ``ddlkernels.safety.deadline.Deadline`` when the call has a timeout.
    """
    table = _exchange(comm, _record(kind, count, dtype, op, dims, chunk, path, False, small_bytes, shm), deadline)
    if table is None:
        return
    size = table.shape[0]
    foreign = [r for r in range(size) if table[r, 0] != _MAGIC]
    if foreign:
        raise ValueError(
            f"ddlkernels.{kind}: {_ranks_text(foreign)} sent a malformed argument record: "
            "they are not in a ddlkernels collective with validation on (every rank must validate, or none)"
        )
    failed = [r for r in range(size) if table[r, 1]]
    if failed:
        msgs = _local_errors(comm, table, None, deadline)
        detail = "; ".join(f"rank {r}: {msgs[r]}" for r in failed[:8])
        more = f" (and {len(failed) - 8} more)" if len(failed) > 8 else ""
        raise ValueError(
            f"ddlkernels.{kind}: {_ranks_text(failed)} failed the local argument checks, so no rank "
            f"started the collective: {detail}{more}"
        )
    if (table == table[0]).all():
        return
    described = [_describe(table[r]) for r in range(size)]
    differ = [f for f in _FIELDS if len({d[f] for d in described}) > 1]
    if any(f not in ("chunk", "path") for f in differ):
        # The path (and with it whether a chunk applies) follows from the
        # arguments, e.g. a count in another size bucket of the tuner: name the
        # arguments only.  A path that differs alone is reported (a bug).
        if "path" in differ:
            differ = [f for f in differ if f not in ("chunk", "path")]
    # Groups of ranks that passed the same values, in order of their first rank.
    groups: dict = {}
    for r, d in enumerate(described):
        groups.setdefault(tuple(d[f] for f in differ), []).append(r)
    parts = []
    for values, ranks in list(groups.items())[:8]:
        passed = ", ".join(f"{f}={v}" for f, v in zip(differ, values))
        parts.append(f"{_ranks_text(ranks)} passed {passed}")
    more = f"; and {len(groups) - 8} more groups" if len(groups) > 8 else ""
    raise ValueError(
        f"ddlkernels.{kind}: ranks called with different arguments ({', '.join(differ)} differ): "
        + "; ".join(parts)
        + more
    )


class Call:
    """One collective call's reliability state: whether to validate, and its deadline.

    ``Communicator`` creates one only when the call validates or has a
    timeout (otherwise it passes ``None`` and nothing here runs).  Used as a
    context manager around the call:

    * ``agree(...)`` runs ``check_agreement`` (when validating) right before
      the first communication; it marks the point after which an exception
      is no longer a local one;
    * an exception raised before that point is announced to the other ranks
      (``report_local_failure``) so that they raise too instead of waiting;
    * a ``CollectiveTimeout`` marks the ``Communicator`` unusable, because
      messages of the abandoned collective are still in flight on it.
    """

    __slots__ = ("owner", "kind", "validate", "deadline", "agreed")

    def __init__(self, owner, kind, validate, deadline):
        self.owner = owner
        self.kind = kind
        self.validate = validate
        self.deadline = deadline
        self.agreed = False

    def agree(self, *, count, dtype, op, dims, chunk, path):
        # Set first: a mismatch raised by check_agreement is a collective
        # error every rank raises, not a local failure to announce.
        self.agreed = True
        if self.validate:
            owner = self.owner
            check_agreement(owner.comm, kind=self.kind, count=count, dtype=dtype, op=op, dims=dims,
                            chunk=chunk, path=path, small_bytes=owner.small_bytes, shm=owner.shm,
                            deadline=self.deadline)

    def __enter__(self):
        return self

    def __exit__(self, etype, exc, tb):
        if exc is None:
            return False
        from .deadline import CollectiveTimeout

        if isinstance(exc, CollectiveTimeout):
            self.owner._break(str(exc))
        elif self.validate and not self.agreed and isinstance(exc, Exception):
            try:
                report_local_failure(self.owner.comm, kind=self.kind, error=exc, deadline=self.deadline)
            except CollectiveTimeout as t:
                self.owner._break(str(t))
                raise
        return False
