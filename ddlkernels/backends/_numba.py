"""The Numba-CUDA backend: numba device arrays (and CUDA arrays of other libraries, zero-copy).

Kernels are those of ``ddlkernels.kernels.numba_cuda``, launched on the
caller's stream (``stream_of``): Numba's default stream for Numba arrays (as
a Numba kernel launched without a stream runs), torch's current stream for
torch tensors, or the ``stream=`` given.  The staging transport's copy stream
runs beside it, ordered by events.  Runs unchanged in the Numba CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``), which is how the device path is
tested without a GPU.

A CUDA torch tensor (or any ``__cuda_array_interface__`` exporter) is viewed
through ``numba.cuda.as_cuda_array`` without a copy; ``like`` gives back a
torch tensor sharing the result's memory.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator

import numpy as np

from .._dtypes import BFLOAT16
from ..kernels.numba_cuda import launch_config, pack_kernel, reduce_kernel, unpack_kernel
from . import BackendUnavailable, torch_result
from ._device import CAPTURE_ELSEWHERE, CAPTURE_STATUS, DeviceBackend, pack_layout, storage_dtype

__all__ = ["NumbaBackend"]


def _word(buf_at, ptrs, sizes, offsets) -> int:
    """The widest unsigned word (8, 4, 2 or 1 bytes) dividing the buffer's address and every address, length
    and offset of a pack but an empty tensor's (they bind nothing): their bits or-ed in one C loop."""
    common = functools.reduce(operator.or_, itertools.chain(
        itertools.compress(ptrs, sizes), sizes, itertools.compress(offsets, sizes)), int(buf_at))
    return next(w for w in (8, 4, 2, 1) if common % w == 0)


class NumbaBackend(DeviceBackend):
    name = "numba"

    def __init__(self):
        super().__init__()
        try:
            from numba import cuda
        except ImportError as exc:  # pragma: no cover - numba is installed in CI
            raise BackendUnavailable(
                "the numba backend needs numba-cuda: pip install 'numba-cuda[cu12]' "
                "(or install CuPy: pip install cupy-cuda12x)"
            ) from exc
        self._cuda = cuda
        self.simulated = bool(getattr(__import__("numba").config, "ENABLE_CUDASIM", 0))

    # -- streams and events ----------------------------------------------------------
    def default_stream(self):
        return self._cuda.default_stream()

    def stream_of(self, x, stream=None):
        cuda = self._cuda
        if stream is None:
            if type(x).__module__.startswith("torch"):
                import torch

                return cuda.external_stream(torch.cuda.current_stream(x.device).cuda_stream)
            return cuda.default_stream()
        mod = type(stream).__module__
        if mod.startswith("numba"):
            return stream
        if mod.startswith("torch"):
            return cuda.external_stream(stream.cuda_stream)
        if mod.startswith("cupy"):
            return cuda.external_stream(stream.ptr)
        if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
            return cuda.external_stream(int(stream))
        raise TypeError(f"stream must be a Numba, torch or CuPy stream or a cudaStream_t int, got {stream!r}")

    def _on_device(self, device, stream):
        if device is None or self.simulated:
            return contextlib.nullcontext()
        return self._cuda.gpus[int(device)]

    def new_stream(self, device=None):
        with self._on_device(device, None):
            return self._cuda.stream()

    def current_device(self):
        if self.simulated:
            return 0
        return int(self._cuda.get_current_device().id)

    def record(self, stream):
        try:
            ev = self._cuda.event(timing=False)
        except TypeError:  # the simulator's Event takes no arguments
            ev = self._cuda.event()
        ev.record(stream)
        return ev

    def wait(self, stream, ev):
        ev.wait(stream)

    def sync(self, ev):
        ev.synchronize()

    def query(self, ev):
        q = getattr(ev, "query", None)
        if q is None:  # the simulator's events have no query: its work is done when queued
            return True
        return bool(q())

    def graph_capture(self, stream):
        if self.simulated:  # the simulator has no graphs
            return None
        from numba.cuda.cudadrv.driver import binding

        err, status = binding.cuStreamIsCapturing(binding.CUstream(int(stream)))
        if err != binding.CUresult.CUDA_SUCCESS:  # the legacy stream while another captures in global mode
            return CAPTURE_ELSEWHERE.format(err.name)
        return CAPTURE_STATUS.get(int(status))

    def pinned(self, nbytes):
        return self._cuda.pinned_array(int(nbytes), dtype=np.uint8)

    def d2h(self, host, dev, stream):
        dev.copy_to_host(host.view(dev.dtype), stream=stream)

    def h2d(self, dev, host, stream):
        dev.copy_to_device(host.view(dev.dtype), stream=stream)

    # -- arrays ----------------------------------------------------------------------
    def _device_array(self, x):
        t = type(x)
        if t.__module__.startswith("numba"):
            return x
        if t.__module__.startswith("torch"):
            import torch

            x = x.detach()
            if x.dtype == torch.bfloat16:  # no bf16 in the array interface: its bits
                return self._cuda.as_cuda_array(x.view(torch.int16)).view(np.uint16)
            return self._cuda.as_cuda_array(x)
        return self._cuda.as_cuda_array(x)

    def dtype(self, x):
        t = type(x)
        if t.__module__.startswith("torch"):
            import torch

            if x.dtype == torch.bfloat16:
                return BFLOAT16
            return np.dtype(str(x.dtype).replace("torch.", ""))
        return np.dtype(x.dtype)

    def device_id(self, x):
        if type(x).__module__.startswith("torch"):
            return x.device.index
        try:
            return int(x.gpu_data.context.device.id)
        except AttributeError:
            try:
                return int(self._cuda.get_current_device().id)
            except AttributeError:  # the simulator's single fake device
                return 0

    def flat(self, x):
        d = self._device_array(x)
        if not d.is_c_contiguous():
            raise ValueError("device array is not C-contiguous")
        f = d.reshape(d.size) if d.ndim != 1 else d
        if BFLOAT16 is not None and f.dtype == BFLOAT16:
            f = f.view(np.uint16)
        return f

    def empty(self, n, dtype):
        return self._cuda.device_array(int(n), dtype=storage_dtype(dtype), stream=self.compute_stream())

    def full(self, n, dtype, value):
        # From pageable memory: the copy has taken the bytes before it returns (the simulator has no memset).
        return self._cuda.to_device(np.full(int(n), value, storage_dtype(dtype)), stream=self.compute_stream())

    def like(self, flat, x, shape=None):
        shape = tuple(x.shape if shape is None else shape)
        t = type(x)
        if t.__module__.startswith("torch"):
            import torch

            if x.dtype == torch.bfloat16:
                return torch_result(torch.as_tensor(flat.view(np.int16), device=x.device).view(torch.bfloat16)
                                    .reshape(shape))
            return torch_result(torch.as_tensor(flat, device=x.device).reshape(shape))
        out = flat
        if BFLOAT16 is not None and np.dtype(x.dtype) == BFLOAT16:
            out = out.view(BFLOAT16)
        return out.reshape(shape) if shape != tuple(out.shape) else out

    def _ptr(self, buf):
        try:
            # What __cuda_array_interface__["data"] reads, without the dict it builds (a pack asks per tensor).
            return buf.device_ctypes_pointer.value or 0
        except AttributeError:  # simulator arrays wrap numpy arrays
            return int(buf.ctypes.data)

    # -- kernels ---------------------------------------------------------------------
    def copy(self, dst, src):
        if dst.shape[0] != src.shape[0]:
            raise ValueError(f"copy: lengths differ ({dst.shape[0]} vs {src.shape[0]})")
        if dst.shape[0]:
            dst.copy_to_device(src, stream=self.compute_stream())

    def _launch_reduce(self, name, dst, a, b, n, arg):
        _, op, suf = name.rsplit("_", 2)
        blocks, threads = launch_config(n)
        reduce_kernel(op, suf)[blocks, threads, self.compute_stream()](dst, a, b, arg)

    def pack(self, tensors, buf, offsets=None):
        """Copy flat device buffers ``tensors`` into ``buf`` at byte ``offsets`` (default 16-byte aligned)."""
        return self._table_copy(pack_kernel, tensors, buf, offsets)

    def unpack(self, buf, tensors, offsets):
        """Inverse of ``pack``: ``tensors[i]`` receive their bytes from ``buf``."""
        return self._table_copy(unpack_kernel, tensors, buf, offsets)

    def _table_copy(self, kernel, tensors, buf, offsets):
        sizes, offsets = pack_layout(tensors, buf, offsets)
        if any(sizes):
            s = self.compute_stream()
            ptrs = [self._ptr(t) for t in tensors]
            word = _word(self._ptr(buf), ptrs, sizes, offsets)
            nbuf = buf.shape[0] * buf.dtype.itemsize
            words = buf.view(np.uint8)[: nbuf - nbuf % word].view(np.dtype(f"u{word}"))
            table, longest = self._pack_table(s, ptrs, sizes, offsets, word)
            kernel(word)[min(table.shape[0], 65535), min(256, longest), s](table, words)
        return list(offsets)

    def _stream_id(self, stream):
        # Numba wraps the same stream in a new object on every default_stream(); the simulator's streams,
        # which run everything at once, are all 0.
        try:
            return int(stream)
        except TypeError:
            return 0

    def _upload(self, host, stream):
        return self._cuda.to_device(host, stream=stream)
