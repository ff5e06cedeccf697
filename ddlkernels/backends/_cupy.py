"""The CuPy backend: CuPy arrays, and CUDA arrays of other libraries through DLPack, zero-copy.

Kernels are kernels/reduce.cu and kernels/pack.cu, compiled by CuPy's
``RawModule`` (NVRTC) once per device and cached by CuPy; they run on CuPy's
*current* stream, so they are ordered after whatever the user queued there.
The staging transport copies on a separate non-blocking stream and orders
itself against the current stream with events.

A CUDA torch tensor becomes a CuPy array with ``cupy.from_dlpack`` (bfloat16
through its int16 bits: CuPy has no bfloat16) and ``like`` returns a torch
tensor sharing the result's memory (``torch.from_dlpack``).
"""

from __future__ import annotations

import numpy as np

from .._dtypes import BFLOAT16
from .._kernel_sources import nvrtc_options, read_source
from . import BackendUnavailable
from ._device import DeviceBackend, pack_offsets, storage_dtype

__all__ = ["CupyBackend"]

_THREADS = 256


class CupyBackend(DeviceBackend):
    name = "cupy"

    def __init__(self):
        try:
            import cupy
        except ImportError as exc:
            raise BackendUnavailable(
                "the cupy backend needs CuPy: pip install cupy-cuda12x (or use numba-cuda: "
                "pip install 'numba-cuda[cu12]' and backend='numba')"
            ) from exc
        self._cp = cupy
        self._modules: dict = {}

    # -- kernels' modules -------------------------------------------------------------
    def _module(self, source):
        mod = self._modules.get(source)
        if mod is None:
            cp = self._cp
            opts = list(nvrtc_options())
            try:
                inc = cp.cuda.get_cuda_path()
                if inc:
                    opts.append(f"-I{inc}/include")
            except Exception:  # no toolkit path known to CuPy: ours suffice
                pass
            mod = cp.RawModule(code=read_source(source), options=tuple(opts), backend="nvrtc")
            self._modules[source] = mod
        return mod

    # -- streams and events ----------------------------------------------------------
    def compute_stream(self):
        return self._cp.cuda.get_current_stream()

    def new_stream(self):
        return self._cp.cuda.Stream(non_blocking=True)

    def record(self, stream):
        ev = self._cp.cuda.Event(disable_timing=True)
        ev.record(stream)
        return ev

    def wait(self, stream, ev):
        stream.wait_event(ev)

    def sync(self, ev):
        ev.synchronize()

    def synchronize(self):
        self._cp.cuda.get_current_stream().synchronize()

    def pinned(self, nbytes):
        import cupyx

        return cupyx.empty_pinned((int(nbytes),), dtype=np.uint8)

    def d2h(self, host, dev, stream):
        # Ordered on ``stream``; the staging transport syncs on an event of
        # that stream right after, whatever CuPy's blocking default is.
        dev.get(stream=stream, out=host.view(dev.dtype))

    def h2d(self, dev, host, stream):
        dev.set(host.view(dev.dtype), stream=stream)

    # -- arrays ----------------------------------------------------------------------
    def _as_cupy(self, x):
        cp = self._cp
        if isinstance(x, cp.ndarray):
            return x
        if type(x).__module__.startswith("torch"):
            import torch

            x = x.detach()
            if x.dtype == torch.bfloat16:
                return cp.from_dlpack(x.view(torch.int16)).view(np.uint16)
            return cp.from_dlpack(x)
        if hasattr(type(x), "__dlpack__"):
            return cp.from_dlpack(x)
        return cp.asarray(x)  # __cuda_array_interface__: zero-copy

    def dtype(self, x):
        if type(x).__module__.startswith("torch"):
            import torch

            if x.dtype == torch.bfloat16:
                return BFLOAT16
            return np.dtype(str(x.dtype).replace("torch.", ""))
        return np.dtype(x.dtype)

    def device_id(self, x):
        if type(x).__module__.startswith("torch"):
            return x.device.index
        return int(self._as_cupy(x).device.id)

    def flat(self, x):
        a = self._as_cupy(x)
        if not a.flags.c_contiguous:
            raise ValueError("device array is not C-contiguous")
        f = a.reshape(-1)
        if BFLOAT16 is not None and f.dtype == BFLOAT16:
            f = f.view(np.uint16)
        return f

    def empty(self, n, dtype):
        return self._cp.empty(int(n), dtype=storage_dtype(dtype))

    def like(self, flat, x):
        if type(x).__module__.startswith("torch"):
            import torch

            if x.dtype == torch.bfloat16:
                return torch.from_dlpack(flat.view(np.int16)).view(torch.bfloat16).reshape(x.shape)
            return torch.from_dlpack(flat).reshape(x.shape)
        return flat.reshape(x.shape)

    def _ptr(self, buf):
        return int(buf.data.ptr)

    # -- kernels ---------------------------------------------------------------------
    def copy(self, dst, src):
        if dst.shape[0] != src.shape[0]:
            raise ValueError(f"copy: lengths differ ({dst.shape[0]} vs {src.shape[0]})")
        if dst.shape[0]:
            self._cp.copyto(dst, src)

    def _launch_reduce(self, name, dst, a, b, n, arg):
        vec = 16 // dst.dtype.itemsize  # elements per 128-bit word
        blocks = max(1, min(-(-n // (_THREADS * vec)), 4096))
        kern = self._module("reduce.cu").get_function(name)
        kern((blocks,), (_THREADS,), (dst, a, b, np.uint64(n), arg))

    def pack(self, tensors, buf, offsets=None):
        """Copy flat device buffers ``tensors`` into ``buf`` at byte ``offsets`` (default 16-byte aligned), one launch."""
        return self._table_copy("ddl_pack", tensors, buf, offsets)

    def unpack(self, buf, tensors, offsets):
        """Inverse of ``pack``, one launch."""
        return self._table_copy("ddl_unpack", tensors, buf, offsets)

    def _table_copy(self, name, tensors, buf, offsets):
        sizes = [t.shape[0] * t.dtype.itemsize for t in tensors]
        if offsets is None:
            offsets, _ = pack_offsets(sizes)
        nbuf = buf.shape[0] * buf.dtype.itemsize
        for n, o in zip(sizes, offsets):
            if o < 0 or o + n > nbuf:
                raise ValueError(f"tensor of {n} bytes at offset {o} does not fit a {nbuf}-byte buffer")
        if tensors:
            table = np.array([[self._ptr(t), n, o] for t, n, o in zip(tensors, sizes, offsets)], dtype=np.uint64)
            # A synchronous copy: the host table is a temporary, and an
            # asynchronous H2D copy could read it after it is freed.
            d_table = self._cp.empty(table.shape, dtype=np.uint64)
            d_table.set(table)
            blocks = max(1, min(-(-max(sizes) // (_THREADS * 16)), 64))
            kern = self._module("pack.cu").get_function(name)
            kern((blocks, min(len(tensors), 65535)), (_THREADS,), (d_table, np.int32(len(tensors)), buf))
        return list(offsets)
