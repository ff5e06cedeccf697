"""The host backend: numpy arrays (and PyTorch CPU tensors, through zero-copy views).

Every kernel writes into caller-owned memory, so a ring step allocates
nothing: for the sum and product of float32, float64, int32 and int64 one
compiled loop of ``ddlkernels.kernels.host_loops`` (numpy's own runs at half speed
on operands at different offsets within a cache line), numpy's ufuncs for
max, min and the other integers, one compiled pass of ``ddlkernels.kernels.half``
for float16 and bfloat16 (numpy's own loops for them run at a few percent
of memory bandwidth).  Without Numba, numpy's ufuncs and the numpy code
below compute the same bits.
"""

from __future__ import annotations

import threading

import numpy as np

from ..kernels import half as _half
from .._dtypes import BFLOAT16, acc_dtype, is_half, scale_inplace
from . import Backend, torch_result

_UFUNC = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
#: (op, dtype) -> ufunc for the sums and products whose reduction is numpy's own loop with nothing
#: around it (not float16/bfloat16, which go through ddlkernels.kernels.half), looked up first by ``reduce``
#: and called with ``out`` positionally: numpy parses a keyword ``out=`` for ~0.2 us per call, which shows on the
#: in-cache chunks of the ring and the window (bench/results/constants.md, _DIRECT).  Not max/min: numpy 2
#: deprecates their positional ``out``.
_DIRECT = {(op, np.dtype(t)): _UFUNC[op] for op in ("sum", "prod")
           for t in (np.float32, np.float64, np.int32, np.int64)}
#: _DIRECT's ops -> index into ``ddlkernels.kernels.host_loops.reduce`` (its SUM, PROD), the compiled loop tried
#: first for those pairs on 1-D arrays (numpy's loop halves its speed on operands at different offsets
#: within a cache line).
_COMPILED = {"sum": 0, "prod": 1}
#: ``[reduce]`` of ``ddlkernels.kernels.host_loops`` once imported, ``[None]`` where Numba cannot be (numpy then).
_LOOP: list = []


#: ``[STREAM_FROM]`` of ``ddlkernels.kernels.host_loops``, beside ``_LOOP``.
_STREAM_FROM: list = []


def _host_loop():
    if not _LOOP:
        try:
            from ..kernels.host_loops import STREAM_FROM, reduce as loop
        except Exception:  # noqa: BLE001 - no Numba here: numpy's loop computes the same bits
            loop, STREAM_FROM = None, None
        _STREAM_FROM.append(STREAM_FROM)
        _LOOP.append(loop)
    return _LOOP[0]


# Without Numba, bfloat16 is reduced through float32 scratch in blocks of
# this many elements: ml_dtypes' casts are vectorised but its arithmetic loops
# are not, so widen-compute-narrow is ~2x faster than np.add on bfloat16,
# with the same bits (one rounding to nearest even, as ml_dtypes' own add).
# Blocks of 64 Ki elements keep the two scratch arrays (512 KiB) in L2.
_HALF_BLOCK = 1 << 16


class NumpyBackend(Backend):
    name = "numpy"
    device = False

    def __init__(self):
        # Per-thread scratch: the asynchronous API may reduce on a helper thread.
        self._tls = threading.local()

    def _scratch32(self):
        s = getattr(self._tls, "f32", None)
        if s is None:
            s = self._tls.f32 = (np.empty(_HALF_BLOCK, np.float32), np.empty(_HALF_BLOCK, np.float32))
        return s

    def _as_numpy(self, x):
        if isinstance(x, np.ndarray):
            return x
        if type(x).__module__.startswith("torch"):
            # .numpy() shares memory with the tensor; detach() drops autograd
            # bookkeeping without copying.  numpy has no bfloat16: reinterpret
            # the bits as ml_dtypes' bfloat16.
            import torch

            t = x.detach()
            if t.dtype == torch.bfloat16:
                return t.view(torch.int16).numpy().view(BFLOAT16)
            return t.numpy()
        return np.asarray(x)

    def dtype(self, x):
        return self._as_numpy(x).dtype

    def flat(self, x):
        a = self._as_numpy(x)
        if not a.flags.c_contiguous:
            raise ValueError("array is not C-contiguous")
        return a.reshape(-1)

    def empty(self, n, dtype):
        return np.empty(n, dtype=dtype)

    def like(self, flat, x, shape=None):
        a = flat.reshape(np.shape(x) if shape is None else shape)
        if isinstance(x, np.ndarray):
            return a
        if type(x).__module__.startswith("torch"):
            import torch

            if a.dtype == BFLOAT16:
                return torch_result(torch.from_numpy(a.view(np.int16)).view(torch.bfloat16))
            return torch_result(torch.from_numpy(a))
        return a

    def wire(self, buf):
        return buf.view(np.uint16) if is_half(buf.dtype) else buf

    def copy(self, dst, src):
        np.copyto(dst, src)

    def scale(self, dst, p):
        scale_inplace(dst, p)

    def reduce(self, op, dst, a, b=None, *, avg_p=None):
        if b is None:
            a, b = dst, a
        if avg_p is None:  # the common case first: the compiled loop, else numpy's, out positionally (_DIRECT)
            ufunc = _DIRECT.get((op, dst.dtype))
            if ufunc is not None:
                loop = _LOOP[0] if _LOOP else _host_loop()
                if loop is not None and dst.ndim == 1 and a.dtype == dst.dtype and b.dtype == dst.dtype:
                    try:
                        if loop[_COMPILED[op]](dst, a, b, _STREAM_FROM[0]):
                            return
                    except Exception:  # noqa: BLE001 - what Numba cannot type (0-d, read-only out): numpy's
                        pass           # ufunc computes it, or raises numpy's own error
                ufunc(a, b, dst)
                return
        if avg_p is not None and op != "sum":
            raise ValueError("avg_p is only defined for the sum")
        # float16/bfloat16: one compiled pass (ddlkernels.kernels.half); numpy below
        # only where Numba is missing.
        if is_half(dst.dtype):
            if _half.reduce(op if avg_p is None else "avg", dst, a, b, None if avg_p is None else 1.0 / avg_p):
                return
        ufunc = _UFUNC[op]
        if dst.dtype == BFLOAT16:
            self._reduce_bf16(ufunc, dst, a, b, None if avg_p is None else np.float32(1.0 / avg_p), op)
            return
        if avg_p is None:
            ufunc(a, b, out=dst)
            return
        if dst.dtype.kind in "iu":
            ufunc(a, b, out=dst)
            np.floor_divide(dst, dst.dtype.type(avg_p), out=dst)
            return
        acc = acc_dtype(dst.dtype)
        scale = acc.type(1.0 / avg_p)
        if acc == dst.dtype:
            ufunc(a, b, out=dst)
            np.multiply(dst, scale, out=dst)
        else:
            # Half types: one rounding at the end, as the GPU kernels do.
            t = a.astype(acc)
            t += b
            t *= scale
            dst[...] = t

    def _reduce_bf16(self, ufunc, dst, a, b, scale, op):
        if scale is not None and op != "sum":
            raise ValueError("avg_p is only defined for the sum")
        ta, tb = self._scratch32()
        n = dst.shape[0]
        for s in range(0, n, _HALF_BLOCK):
            e = min(s + _HALF_BLOCK, n)
            x, y = ta[: e - s], tb[: e - s]
            np.copyto(x, a[s:e], casting="unsafe")  # widening is exact
            np.copyto(y, b[s:e], casting="unsafe")
            ufunc(x, y, out=x)
            if scale is not None:
                np.multiply(x, scale, out=x)
            np.copyto(dst[s:e], x, casting="unsafe")  # the one rounding
