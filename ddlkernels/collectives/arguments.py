"""The local checks of a collective's arguments, made before any communication (each rank checks its own).

A rank that finds an error here raises at once; with ``validate`` on, the
other ranks learn of it in the argument check and raise too
(``ddlkernels.safety.validate``).  The collectives call these in this order:
``prepare`` (op, backend, dtype, dims, chunk), ``flat_input``, then the
output's checks (``check_out``, ``check_shard_out``); the fast paths use
``plain_out`` and ``apart``, which decide the same cases cheaply and leave
every error to the full path.
"""

from __future__ import annotations

import numpy as np

from .._dtypes import check_dtype, dtype_name, normalize_op
from ..backends import backend_for, serves
from ..ring.schedule import validate_dims

__all__ = ["prepare", "flat_input", "where", "backend_input_numpy", "buffer_spec", "size", "check_out",
           "plain_out", "apart", "host_overlap", "check_shard_out", "positive", "nonneg", "in_use"]


def prepare(comm, x, op, chunk_bytes, dims, backend_name=None):
    """The local checks every collective makes first: ``(op name, backend, dtype, chunk in elements)``."""
    opname = normalize_op(op)
    backend = backend_for(x, backend_name)
    dtype = check_dtype(backend.dtype(x))
    if dims is not None:
        validate_dims(dims, comm.size)
    chunk_bytes = comm.chunk_bytes if chunk_bytes is None else positive("chunk_bytes", chunk_bytes)
    return opname, backend, dtype, max(1, chunk_bytes // dtype.itemsize)


def flat_input(backend, x):
    """``(flat view, copied?)`` of a collective's input: a non-contiguous host array is reduced through a
    contiguous copy (never silently wrong); a non-contiguous device array is an error."""
    try:
        return backend.flat(x), False
    except ValueError:
        if backend.device:
            raise ValueError(
                "ddlkernels needs a C-contiguous device array; call .copy() (CuPy/torch: .contiguous()) first"
            ) from None
        return np.ascontiguousarray(backend_input_numpy(x)).reshape(-1), True


def where(backend):
    """Key of a backend's buffers and transports: its name, and for a device backend the current device
    (a call makes its array's device current), so that no buffer of one GPU is used on another."""
    return (backend.name, backend.current_device()) if backend.device else backend.name


def backend_input_numpy(x):
    """A numpy view of a host array or CPU torch tensor (for the non-contiguous copy path)."""
    if isinstance(x, np.ndarray):
        return x
    from ..backends import get_backend

    return get_backend("numpy")._as_numpy(x)


def buffer_spec(spec, what):
    """The array an mpi4py buffer specification names (``[buf, MPI.FLOAT]``, ``[buf, count, MPI.FLOAT]``,
    ``[buf, (count, displ), MPI.FLOAT]``, ``[buf, count, displ, MPI.FLOAT]``, ``[buf, count]``): ``buf``
    itself, or a flat view of its elements ``[displ, displ + count)``.  Anything else is returned as it is.
    A datatype that is not the one of ``buf``'s elements is a ``TypeError``: MPI would reinterpret the bytes,
    and ddlkernels reduces by the array's own dtype, so the two cannot be made to agree silently."""
    if not isinstance(spec, (list, tuple)):
        return spec
    from mpi4py import MPI
    from mpi4py.util.dtlib import to_numpy_dtype

    if not 2 <= len(spec) <= 4:
        raise TypeError(f"{what}: an mpi4py buffer specification has 2 to 4 items ([buf, MPI.FLOAT], "
                        f"[buf, count, MPI.FLOAT], ...), got {len(spec)}")
    buf, rest = spec[0], list(spec[1:])
    datatype = rest.pop() if isinstance(rest[-1], (MPI.Datatype, str)) else None
    count = displ = None
    if len(rest) == 2:
        count, displ = rest
    elif len(rest) == 1:
        count = rest[0]
        if isinstance(count, (list, tuple)):
            if len(count) != 2:
                raise TypeError(f"{what}: expected (count, displ), got {count!r}")
            count, displ = count
    for name, v in (("count", count), ("displacement", displ)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
            raise TypeError(f"{what}: the {name} of a buffer specification must be an int >= 0, got {v!r}")
    be = backend_for(buf)
    dtype = be.dtype(buf)
    if datatype is not None:
        try:
            named = np.dtype(datatype) if isinstance(datatype, str) else to_numpy_dtype(datatype)
        except (TypeError, ValueError, KeyError):
            named = None
        if named is None or named != dtype:
            dname = datatype if isinstance(datatype, str) else (datatype.Get_name() or repr(datatype))
            raise TypeError(
                f"{what}: the buffer specification names datatype {dname} "
                f"({'no numpy type' if named is None else dtype_name(named)}) but the array holds "
                f"{dtype_name(dtype)}; ddlkernels reduces by the array's dtype"
                + ("; MPI has no 16-bit float datatype: pass the array alone" if dtype.itemsize == 2
                   and dtype.kind in "fV" else "")
            )
    if count is None and displ is None:
        return buf
    try:
        be.flat(buf)
    except ValueError:
        raise ValueError(f"{what}: a count or displacement needs a C-contiguous buffer") from None
    start = int(displ or 0)
    stop = size(buf) if count is None else start + int(count)
    if stop > size(buf):
        raise ValueError(f"{what}: elements [{start}, {stop}) asked for, but the buffer holds {size(buf)}")
    return buf.reshape(-1)[start:stop]  # a view: the buffer is contiguous


def size(x):
    n = 1
    for s in x.shape:
        n *= int(s)
    return n


def check_out(be, out, x, dtype):
    if type(out) is np.ndarray and type(x) is np.ndarray:
        if out.dtype != dtype:
            raise TypeError(f"out has dtype {dtype_name(out.dtype)} but the input has {dtype_name(dtype)}")
        if out.shape != x.shape:
            raise ValueError(f"out has shape {out.shape} but the input has {x.shape}")
        return
    if not serves(be, out):
        raise TypeError(f"out is a {backend_for(out).name} array but the input is a {be.name} array")
    odt = be.dtype(out)
    if odt != dtype:
        raise TypeError(f"out has dtype {dtype_name(odt)} but the input has {dtype_name(dtype)}")
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out has shape {tuple(out.shape)} but the input has {tuple(x.shape)}")
    if be.device_id(out) != be.device_id(x):
        raise ValueError(f"out is on device {be.device_id(out)} but the input on {be.device_id(x)}")


def plain_out(out, x, shape):
    """Whether ``out`` is a numpy array of ``shape`` (a 1-tuple) the fast paths can write ``x``'s dtype into."""
    if type(out) is not np.ndarray or out.shape != shape or out.dtype != x.dtype:
        return False
    flags = out.flags
    return flags.c_contiguous and flags.writeable and apart(out, flags, x, x.flags)


def apart(out, oflags, x, xflags):
    """Whether numpy arrays ``out`` and ``x`` (``oflags``, ``xflags``: their flags) share no memory.  Two arrays
    that each own their data are two allocations: the common case, decided without ``np.may_share_memory``
    (0.2 us, a fifth of a fast-path call)."""
    return (oflags.owndata and xflags.owndata and out is not x) or not np.may_share_memory(out, x)


TOO_HARD = getattr(np, "exceptions", np).TooHardError  # numpy.exceptions from numpy 1.25


def host_overlap(x, out):
    """Whether two host arrays (numpy, or what ``backend_input_numpy`` makes of them), either of them not
    contiguous, share an element's bytes: exactly where numpy can tell cheaply, else by their spans."""
    a, b = backend_input_numpy(x), backend_input_numpy(out)
    try:
        return bool(np.shares_memory(a, b, max_work=1 << 16))
    except TOO_HARD:
        return bool(np.may_share_memory(a, b))


def check_shard_out(be, out, x, src, dtype, n, what):
    """``out`` of reduce_scatter / allgather: 1-D, ``n`` elements, ``x``'s dtype, backend and device, contiguous,
    writeable and apart from ``x`` (whose flat buffer is ``src``); raised before any communication (every rank
    checks its own).  Returns the backend's flat buffer of ``out``, which the algorithms write."""
    if not serves(be, out):
        raise TypeError(f"{what}: out is a {backend_for(out).name} array but the input is a {be.name} array")
    if be.dtype(out) != dtype:
        raise TypeError(f"{what}: out has dtype {dtype_name(be.dtype(out))} but the input has {dtype_name(dtype)}")
    if tuple(out.shape) != (n,):
        raise ValueError(f"{what}: out has shape {tuple(out.shape)} but this rank's result is ({n},)")
    if be.device_id(out) != be.device_id(x):
        raise ValueError(f"{what}: out is on device {be.device_id(out)} but the input on {be.device_id(x)}")
    if not be.device and not backend_input_numpy(out).flags.writeable:
        raise ValueError(f"{what}: out must be a contiguous, writeable array")
    try:
        dst = be.flat(out)  # a torch tensor's memory as the backend's buffer (a numpy or CuPy array: itself)
    except ValueError:
        raise ValueError(f"{what}: out must be a contiguous, writeable array") from None
    if be.overlaps(dst, src) if be.device else host_overlap(x, out):  # host: x may be a strided view, src its copy
        raise ValueError(f"{what}: out overlaps the input")
    return dst


def positive(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def nonneg(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    return int(v)


def in_use(what):
    return RuntimeError(
        f"ddlkernels: {what} called while another thread is inside a collective on the same Communicator; "
        "collectives on one communicator cannot overlap (the ranks could not match them): use one Communicator per "
        "thread, or ddlkernels.allreduce_async for work that overlaps (docs/reliability.md, \"Threads\")"
    )


