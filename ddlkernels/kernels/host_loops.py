"""The host backend's compiled sum and product for float32, float64, int32 and int64 (``NumpyBackend.reduce``).

Purpose: ``dst = a + b`` (or ``a * b``) over 1-D arrays, the ring's inner
step per chunk, at the speed of the memory whatever the arrays' alignment.
numpy's own loop (AVX-512 on the Intel VM of bench/results) runs at half
speed when its operands sit at different offsets within a 64-byte line,
because then every vector load of one of them splits across two lines;
which offsets a caller's arrays have is up to its allocator (glibc puts a
large ``malloc`` 16 bytes past a page, a small one anywhere 16-aligned).
LLVM's loop here does not care, and a call costs about what numpy's does
(measured: bench/results/constants.md, the host sum's compiled loop).  From
``STREAM_FROM`` bytes an out-of-place ``dst`` is written with non-temporal
stores, which skip the read of every line a normal store makes first.

Preconditions, checked here, else ``reduce`` returns False and the caller
uses numpy: the three arrays 1-D of one length (the backend checks that
they have one dtype), and ``dst`` either exactly ``a``, exactly ``b`` or
disjoint from both (numpy defines partial overlap by buffering; this loop
would read elements it had already written).  Operands in order: ``a op b``
for every element, as numpy's ufunc computes it, and the same bits.

Why a module of its own: Numba's on-disk cache finds a function again in
the next process only if it is defined at module level, and it notices a
change only to the file that defines it; these loops inline nothing from
other files.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.arrayobj import make_array

#: op codes of ``reduce``.
SUM, PROD = 0, 1

#: Bytes per array from which ``reduce`` writes an out-of-place ``dst`` with non-temporal stores: they skip the read
#: of every line a normal store makes first, but a caller that reads ``dst`` soon no longer finds it in the cache, so
#: only far past the 2 MiB L2, where streaming was faster (bench/results/constants.md, STREAM_FROM of host_loops.py).
STREAM_FROM = 32 << 20
#: Elements of ``dst`` computed per block before they are streamed out: a block (16 KiB) stays in L1.
_BLOCK_BYTES = 16 << 10


@njit(inline="always")
def _extent(x):
    # [lo, hi) bytes of a 1-D array, whatever the sign of its stride.
    lo = x.ctypes.data
    span = (x.shape[0] - 1) * x.strides[0]
    if span < 0:
        return lo + span, lo + x.itemsize
    return lo, lo + span + x.itemsize


@njit(inline="always")
def _same(x, y):
    return x.ctypes.data == y.ctypes.data and x.strides[0] == y.strides[0]


@njit(inline="always")
def _overlap(x, y):
    xl, xh = _extent(x)
    yl, yh = _extent(y)
    return xl < yh and yl < xh


@njit(inline="always")
def _add(u, v):
    return u + v


@njit(inline="always")
def _mul(u, v):
    return u * v


# ddlkernels.kernels.node_primitives._stream_memcpy without its fence (one fence per call here, not per block), copied
# rather than imported for the reason in the module comment.
@intrinsic
def _stream_lines(typingctx, dst, src):
    """``dst[:len(src)] = src`` (C-contiguous 1-D arrays of one dtype), the destination's whole aligned 64-byte
    lines with non-temporal stores and the bytes before and after them with memcpy; no fence (``_fence``)."""
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and dst.ndim == src.ndim == 1
            and dst.layout == src.layout == "C" and dst.dtype == src.dtype):
        return None

    def codegen(context, builder, sig, args):
        darr = make_array(sig.args[0])(context, builder, args[0])
        sarr = make_array(sig.args[1])(context, builder, args[1])
        i64 = ir.IntType(64)
        itemsize = context.get_abi_sizeof(context.get_data_type(sig.args[1].dtype))
        nbytes = builder.mul(builder.extract_value(sarr.shape, 0), i64(itemsize))
        dst_addr = builder.ptrtoint(darr.data, i64)
        src_addr = builder.ptrtoint(sarr.data, i64)
        head = builder.and_(builder.neg(dst_addr), i64(63))  # bytes before dst's first line boundary
        head = builder.select(builder.icmp_unsigned("<", nbytes, head), nbytes, head)
        lines = builder.lshr(builder.sub(nbytes, head), i64(6))
        body = builder.shl(lines, i64(6))
        byte_ptr = ir.IntType(8).as_pointer()

        def copy(offset, count):
            cgutils.raw_memcpy(builder, builder.inttoptr(builder.add(dst_addr, offset), byte_ptr),
                               builder.inttoptr(builder.add(src_addr, offset), byte_ptr), count, i64(1))

        copy(i64(0), head)
        line = ir.VectorType(i64, 8).as_pointer()
        nontemporal = builder.module.add_metadata([ir.IntType(32)(1)])
        with cgutils.for_range(builder, lines) as loop:
            offset = builder.add(head, builder.shl(loop.index, i64(6)))
            value = builder.load(builder.inttoptr(builder.add(src_addr, offset), line), align=1)
            store = builder.store(value, builder.inttoptr(builder.add(dst_addr, offset), line), align=64)
            store.set_metadata("nontemporal", nontemporal)
        copy(builder.add(head, body), builder.sub(builder.sub(nbytes, head), body))
        return context.get_dummy_value()

    return types.void(dst, src), codegen


@intrinsic
def _fence(typingctx):
    """A full fence: non-temporal stores are weakly ordered, so a streamed ``dst`` is fenced before ``reduce``
    returns and its caller hands ``dst`` on (to MPI, or to a peer through a barrier's release store)."""

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


def _disjoint(d, a, b, combine, stream):
    """``d[i] = a[i] op b[i]`` for ``d`` apart from both operands; ``stream``: ``d`` written with non-temporal
    stores, a block at a time (when ``d`` is C-contiguous)."""


@overload(_disjoint, inline="always")
def _disjoint_impl(d, a, b, combine, stream):
    def plain(d, a, b, combine, stream):
        for i in range(d.shape[0]):
            d[i] = combine(a[i], b[i])

    if d.layout != "C":
        return plain

    def blocks(d, a, b, combine, stream):
        n = d.shape[0]
        if not stream:
            for i in range(n):
                d[i] = combine(a[i], b[i])
            return
        t = np.empty(min(n, max(1, _BLOCK_BYTES // d.itemsize)), d.dtype)
        m = t.shape[0]
        for lo in range(0, n, m):
            hi = min(n, lo + m)
            x, y, u = a[lo:hi], b[lo:hi], t[: hi - lo]
            for i in range(hi - lo):
                u[i] = combine(x[i], y[i])
            _stream_lines(d[lo:hi], u)
        _fence()

    return blocks


# Each shape of loop reads and writes through as few arrays as it can: LLVM vectorizes a loop over arrays it
# cannot prove disjoint only behind a run-time overlap check, and dst = dst + b written as dst[i] = a[i] + b[i]
# with a is dst fails that check and runs scalar.
@njit(inline="always")
def _reduce(d, a, b, combine, stream):
    n = d.shape[0]
    if _same(d, a):
        for i in range(n):
            d[i] = combine(d[i], b[i])
    elif _same(d, b):
        for i in range(n):
            d[i] = combine(a[i], d[i])
    elif _overlap(d, a) or _overlap(d, b):
        return False
    else:
        _disjoint(d, a, b, combine, stream)
    return True


@njit(inline="always")
def _checked(d, a, b, combine, stream_from):
    n = d.shape[0]
    if a.shape[0] != n or b.shape[0] != n:
        return False
    if n == 0:
        return True
    return _reduce(d, a, b, combine, n * d.itemsize >= stream_from)


# One compiled function per op, as the shared-memory loops (``ddlkernels.kernels.window_loops``): a process compiles
# only the ops it calls (bench/results/constants.md, one compiled function per op).  ``stream_from`` has no
# default: Numba compiles a call that omits an argument apart from one that passes it (~3 s each, per dtype).
@njit(cache=True, nogil=True)
def reduce_sum(d, a, b, stream_from):
    """``d = a + b`` (``reduce_prod``: ``a * b``; ``reduce[op]`` for op ``SUM`` or ``PROD``); False, having
    written nothing, where the preconditions fail.  From ``stream_from`` bytes a C-contiguous ``d`` apart from
    both operands is written with non-temporal stores (``STREAM_FROM``); the bits are the same either way."""
    return _checked(d, a, b, _add, stream_from)


@njit(cache=True, nogil=True)
def reduce_prod(d, a, b, stream_from):
    return _checked(d, a, b, _mul, stream_from)


#: ``reduce[op]``: the compiled loop for op ``SUM`` or ``PROD``.
reduce = (reduce_sum, reduce_prod)
