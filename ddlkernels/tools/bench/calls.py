"""What each line does, as three functions: make its state, run one call, count the wrong elements.

Worked example (MPI's allreduce line by hand, on any number of ranks)::

    st = _make_ar(comm, 1024, np.float32, "sum")   # x = pattern(...), out = 1024 SENTINELs, expect = expected(...)
    _mpi_ar_run(st)                                # comm.Allreduce(x, out, MPI.SUM)
    _wrong_ar(st)                                  # -> 0; out refilled with SENTINEL, x checked untouched

One section per collective (allreduce, reduce_scatter, allgather: ddlkernels' and MPI's calls), then
the baselines: the link (one ring step by ``Sendrecv``, also as 1 MiB pieces), the copy bound and a
textbook Python ring.  A ``make`` returns a dict, the line's state, which its ``run`` and ``wrong``
read; ddlkernels' lines find their ``Communicator`` in it under "dc" (``impls.make_impls`` puts it
there, and pairs the functions into ``Collective`` records).
"""

from __future__ import annotations

import numpy as np

from .buffers import SENTINEL, _placed, _sentinels, expected, pattern


# -- shared helpers -------------------------------------------------------------


def _mpi_op(op):
    from mpi4py import MPI

    return {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[op]


def _scale(buf, p):
    from ..._dtypes import scale_inplace

    scale_inplace(buf, p)


def _count_wrong(got, want):
    return int(np.count_nonzero(got != want))


# -- allreduce --------------------------------------------------------------------


def _make_ar(comm, count, dtype, op, inplace=False):
    p, r = comm.Get_size(), comm.Get_rank()
    x = _placed(pattern(count, r, p, dtype, op))
    out = _sentinels(count, dtype)
    return {"comm": comm, "x": x, "pristine": x.copy(), "out": out, "op": op,
            "inplace": inplace, "expect": expected(count, p, dtype, op)}


def _wrong_ar(st):
    got = st["x"] if st["inplace"] else st["out"]
    n = _count_wrong(got, st["expect"])
    if st["inplace"]:
        np.copyto(st["x"], st["pristine"])
    else:
        st["out"].fill(SENTINEL)
    # The input of an out-of-place call must come back untouched.
    if not st["inplace"]:
        n += _count_wrong(st["x"], st["pristine"])
    return n


def _ddl_run(st):
    if st["inplace"]:
        st["dc"].allreduce(st["x"], st["op"], out=st["x"])
    else:
        st["dc"].allreduce(st["x"], st["op"], out=st["out"])


def _ddl_settling(st):
    return st["dc"].tuning(st["x"], st["op"])


def _mpi_ar_run(st):
    from mpi4py import MPI

    op = _mpi_op(st["op"])
    if st["inplace"]:
        st["comm"].Allreduce(MPI.IN_PLACE, st["x"], op)
        buf = st["x"]
    else:
        st["comm"].Allreduce(st["x"], st["out"], op)
        buf = st["out"]
    if st["op"] == "avg":
        _scale(buf, st["comm"].Get_size())


# -- reduce_scatter ----------------------------------------------------------------


def _make_rs_common(comm, count, dtype, op):
    p, r = comm.Get_size(), comm.Get_rank()
    x = _placed(pattern(count, r, p, dtype, op))
    return {"comm": comm, "x": x, "pristine": x.copy(), "op": op, "full": expected(count, p, dtype, op)}


def _ddl_rs_run(st):
    # Into a reused output, as the MPI line does: a loop of calls allocates nothing.
    st["res"] = st["dc"].reduce_scatter(st["x"], st["op"], out=st["out"])


def _ddl_rs_wrong(st):
    got = st.pop("res", None)
    if got is not st["out"]:
        return len(st["expect"]) or 1
    n = _count_wrong(st["x"], st["pristine"]) + _count_wrong(got, st["expect"])
    st["out"].fill(SENTINEL)
    return n


def _mpi_rs_make(comm, count, dtype, op, inplace=False):
    st = _make_rs_common(comm, count, dtype, op)
    p, r = comm.Get_size(), comm.Get_rank()
    block = count // p
    st.update(block=block, inplace=inplace, expect=st["full"][r * block:(r + 1) * block])
    st["out"] = _sentinels(block, dtype)
    return st


def _mpi_rs_run(st):
    from mpi4py import MPI

    comm, op = st["comm"], _mpi_op(st["op"])
    if st["inplace"]:
        # MPI-3: with IN_PLACE the input is recvbuf and the block lands at its start.
        comm.Reduce_scatter_block(MPI.IN_PLACE, st["x"], op)
        res = st["x"][: st["block"]]
    else:
        comm.Reduce_scatter_block(st["x"], st["out"], op)
        res = st["out"]
    if st["op"] == "avg":
        _scale(res, comm.Get_size())


def _mpi_rs_wrong(st):
    if st["inplace"]:
        n = _count_wrong(st["x"][: st["block"]], st["expect"])
        np.copyto(st["x"], st["pristine"])
        return n
    n = _count_wrong(st["out"], st["expect"]) + _count_wrong(st["x"], st["pristine"])
    st["out"].fill(SENTINEL)
    return n


# -- allgather -----------------------------------------------------------------------


def _gathered(comm, count, dtype, bounds):
    """The allgather result: rank r's shard ``bounds[r]`` holds its own pattern values there."""
    p = comm.Get_size()
    full = np.empty(count, dtype=dtype)
    for r, (lo, hi) in enumerate(bounds):
        full[lo:hi] = pattern(hi, r, p, dtype)[lo:hi]
    return full


def _ddl_ag_run(st):
    # Into a reused output, as the MPI line does; its size gives the count, as after a reduce_scatter of a
    # known buffer, which spares the call the exchange of shard lengths (Communicator.allgather).
    st["res"] = st["dc"].allgather(st["shard"], out=st["out"])


def _ddl_ag_wrong(st):
    got = st.pop("res", None)
    if got is not st["out"]:
        return len(st["expect"]) or 1
    n = _count_wrong(got, st["expect"]) + _count_wrong(st["shard"], st["pristine"])
    st["out"].fill(SENTINEL)
    return n


def _mpi_ag_make(comm, count, dtype, op, inplace=False):
    p, r = comm.Get_size(), comm.Get_rank()
    block = count // p
    bounds = [(q * block, (q + 1) * block) for q in range(p)]
    full = _gathered(comm, count, dtype, bounds)
    lo, hi = bounds[r]
    shard = _placed(full[lo:hi])  # before out, as ddlkernels' line places them (run_sweep: same offsets per role)
    out = _sentinels(count, dtype)
    if inplace:
        out[lo:hi] = full[lo:hi]
    return {"comm": comm, "inplace": inplace, "shard": shard, "pristine": full[lo:hi].copy(),
            "out": out, "expect": full, "lo": lo, "hi": hi}


def _mpi_ag_run(st):
    from mpi4py import MPI

    if st["inplace"]:
        st["comm"].Allgather(MPI.IN_PLACE, st["out"])
    else:
        st["comm"].Allgather(st["shard"], st["out"])


def _mpi_ag_wrong(st):
    n = _count_wrong(st["out"], st["expect"]) + _count_wrong(st["shard"], st["pristine"])
    st["out"].fill(SENTINEL)
    if st["inplace"]:
        st["out"][st["lo"]:st["hi"]] = st["shard"]
    return n


# -- the link: one ring step -----------------------------------------------------------


def _link_make(comm, count, dtype, op, inplace=False):
    """Every rank sends N/p elements to rank r+1 and receives N/p from rank r-1: one ring step."""
    p, r = comm.Get_size(), comm.Get_rank()
    m = count // p if p > 1 else count
    send = _placed(pattern(m, r, p, dtype))
    recv = _sentinels(m, dtype)
    prev = (r - 1) % p
    # Bytes on the wire, as the engine sends them: MPI needs no datatype (bfloat16 has none).
    return {"comm": comm, "send": send, "recv": recv, "next": (r + 1) % p, "prev": prev,
            "wire": (send.view(np.uint8), recv.view(np.uint8)), "expect": pattern(m, prev, p, dtype)}


def _link_run(st):
    send, recv = st["wire"]
    st["comm"].Sendrecv(send, st["next"], 7, recv, st["prev"], 7)


def _link_wrong(st):
    n = _count_wrong(st["recv"], st["expect"])
    st["recv"].fill(SENTINEL)
    return n


#: Piece size of the chunked link: the engine's default pipeline chunk.
LINK_CHUNK_BYTES = 1 << 20


def _linkc_make(comm, count, dtype, op, inplace=False):
    st = _link_make(comm, count, dtype, op, inplace)
    n = st["wire"][0].shape[0]
    st["pieces"] = [(a, min(a + LINK_CHUNK_BYTES, n)) for a in range(0, n, LINK_CHUNK_BYTES)]
    return st


def _linkc_run(st):
    """The same ring step as a train of 1 MiB Irecv/Isend pairs, all in flight at once."""
    from mpi4py import MPI

    send, recv = st["wire"]
    comm, nxt, prv = st["comm"], st["next"], st["prev"]
    reqs = [comm.Irecv(recv[a:b], prv, 8) for a, b in st["pieces"]]
    reqs += [comm.Isend(send[a:b], nxt, 8) for a, b in st["pieces"]]
    MPI.Request.Waitall(reqs)


def _link_bytes(nbytes, p):
    return nbytes // p if p > 1 else nbytes


# -- the copy bound: what any out-of-place allreduce must move at least ------------------


def _copy_make(comm, count, dtype, op, inplace=False):
    x = _placed(pattern(count, comm.Get_rank(), comm.Get_size(), dtype))
    return {"x": x, "pristine": x.copy(), "expect": x.copy(), "out": _sentinels(count, dtype)}


def _copy_run(st):
    np.copyto(st["out"], st["x"])


def _copy_wrong(st):
    # The same reads and writes, in the same order, as an out-of-place
    # allreduce line's check (_wrong_ar), so that both start their next timed
    # call from the same cache state: a bound measured warmer would be no bound.
    n = _count_wrong(st["out"], st["expect"])
    st["out"].fill(SENTINEL)
    return n + _count_wrong(st["x"], st["pristine"])


# -- a textbook Python ring: the baseline the engine's pipelining is measured against ------


def _pyring_make(comm, count, dtype, op, inplace=False):
    st = _make_ar(comm, count, dtype, op, inplace)
    p = comm.Get_size()
    bounds = [(count * i // p, count * (i + 1) // p) for i in range(p)]
    st["bounds"] = bounds
    st["tmp"] = _placed(np.empty(max(b - a for a, b in bounds) if count else 0, dtype=dtype))
    return st


_UFUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def _pyring_run(st):
    """Flat ring, one whole block per step: p-1 Sendrecv + reduce steps, then p-1 Sendrecv steps.

    No pipelining (a step's reduction waits for its whole block), no chunking,
    a temporary for each received block: what a few lines of mpi4py give.
    """
    comm, bounds = st["comm"], st["bounds"]
    p, r = comm.Get_size(), comm.Get_rank()
    out = st["x"] if st["inplace"] else st["out"]
    if not st["inplace"]:
        np.copyto(out, st["x"])
    if p == 1:
        return
    nxt, prv = (r + 1) % p, (r - 1) % p
    wire, tmp, ufunc = out.view(np.uint8), st["tmp"], _UFUNCS[st["op"]]
    isz = out.itemsize
    for s in range(p - 1):  # reduce-scatter: rank r ends owning block r + 1
        (sa, sb), (ra, rb) = bounds[(r - s) % p], bounds[(r - s - 1) % p]
        t = tmp[: rb - ra]
        comm.Sendrecv(wire[sa * isz:sb * isz], nxt, 11, t.view(np.uint8), prv, 11)
        ufunc(out[ra:rb], t, out=out[ra:rb])
    for s in range(p - 1):  # allgather
        (sa, sb), (ra, rb) = bounds[(r + 1 - s) % p], bounds[(r - s) % p]
        comm.Sendrecv(wire[sa * isz:sb * isz], nxt, 12, wire[ra * isz:rb * isz], prv, 12)
    if st["op"] == "avg":
        _scale(out, p)
