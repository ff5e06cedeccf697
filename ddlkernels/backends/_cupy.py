"""The CuPy backend: CuPy arrays, and CUDA arrays of other libraries (torch, Numba), zero-copy.

Kernels are kernels/reduce.cu and kernels/pack.cu, compiled by NVRTC with
our own options (``ddlkernels.kernels.sources.compile_source``: CuPy's
``RawModule`` would append ``-ftz=true`` and flush subnormals), loaded once
per device, their functions looked up once.

Streams: a call runs on the caller's stream (``stream_of``): CuPy's current
stream for CuPy arrays, torch's current stream for torch tensors, Numba's
default stream for Numba arrays (as a Numba kernel launched without a stream
runs; both wrapped as CuPy streams), or the ``stream=`` given.  ``using`` makes
it CuPy's current stream too, so CuPy's own copies and allocations of the
call are ordered on it.  The staging transport copies on a separate
non-blocking stream and orders itself against the compute stream with events.

A CUDA torch tensor becomes a CuPy array with ``cupy.from_dlpack`` (bfloat16
through its int16 bits: CuPy has no bfloat16) and ``like`` returns a torch
tensor sharing the result's memory (``torch.from_dlpack``).  A Numba device
array is viewed at the address its ``__cuda_array_interface__`` gives, and
``like`` returns a Numba array over the result's memory, both made without
importing the other's interface: that import synchronizes the stream an
array is bound to, and a call never blocks the host on the device.

CUDA IPC (``ipc``, for ``ddlkernels.algorithms.ipc``): an array is exported
as the handle of the cudaMalloc allocation it lies in (CuPy's pool and
torch's caching allocator hand out pieces of larger allocations:
``cuMemGetAddressRange`` finds the allocation) and its offset there; a
peer's allocation is opened with lazy peer access, so ranks on different
GPUs of a node read each other's memory directly.  Memory that legacy IPC
cannot export (cudaMallocAsync pools, managed or VMM memory) is not
exported: the algorithm stages it.  Nor is a Numba array's: Numba hands an
array's memory back to the driver (cuMemFree) soon after the array dies,
which CUDA leaves undefined while a peer still has it mapped, where CuPy's
and torch's pools keep theirs until asked (``Communicator.close_peer_memory``
first).
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np

from .._dtypes import BFLOAT16
from ..kernels.sources import compile_source, unit_of
from . import BackendUnavailable, torch_result
from ._device import CAPTURE_ELSEWHERE, CAPTURE_STATUS, DeviceBackend, pack_layout, storage_dtype

__all__ = ["CupyBackend"]

_THREADS = 256


def _blocks(n, itemsize):
    """Blocks of ``_THREADS`` for ``n`` elements, one 128-bit word a thread (the kernels' loops stride over the
    grid, so any count is correct; CUDA allows 2^31 - 1)."""
    return max(1, min(-(-n // (_THREADS * (16 // itemsize))), 2**31 - 1))


_address_range = None  # the driver's cuMemGetAddressRange_v2, loaded on first use


#: CUDA_ERROR_INVALID_CONTEXT: the calling thread has no current context.
_NO_CONTEXT = 201


def _allocation_base(ptr: int, make_context=None) -> int:
    """The start of the allocation holding device address ``ptr`` (in the current context).

    A driver call needs a current context, which the runtime makes current in a thread only at that
    thread's first runtime call: where there is none yet, ``make_context()`` (a runtime call) makes it,
    as CuPy's own allocator does, and the question is asked again."""
    global _address_range
    if _address_range is None:
        fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        fn.restype = ctypes.c_int
        _address_range = fn
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = _address_range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc == _NO_CONTEXT and make_context is not None:
        make_context()
        rc = _address_range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise RuntimeError(f"cuMemGetAddressRange({ptr:#x}) failed: CUresult {rc}")
    return int(base.value)


class _PeerEvent:
    """A peer's interprocess event opened here (a raw ``cudaEvent_t``; the peer owns it)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = int(ptr)


class _StreamHandle:
    """A raw ``cudaStream_t`` as the CUDA stream protocol presents one (``__cuda_stream__``)."""

    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = int(handle)

    def __cuda_stream__(self):
        return (0, self.handle)


class CupyBackend(DeviceBackend):
    name = "cupy"
    ipc = True

    def __init__(self):
        super().__init__()
        try:
            import cupy
        except ImportError as exc:
            raise BackendUnavailable(
                "the cupy backend needs CuPy: pip install cupy-cuda12x (or use numba-cuda: "
                "pip install 'numba-cuda[cu12]' and backend='numba')"
            ) from exc
        self._cp = cupy
        self._modules: dict = {}  # (device, source, its unit's macros) -> loaded cupy.cuda.function.Module
        self._functions: dict = {}  # (device, kernel name) -> cupy.cuda.function.Function
        self._external: dict = {}  # (stream handle, device) -> cupy.cuda.ExternalStream
        self._numba_stream = None  # the handle of Numba's default stream, once a Numba array asked for it
        # The memory of a Numba array's view (``_numba_view``), which ``ipc_export`` refuses (the module comment).
        self._NumbaMemory = type("NumbaMemory", (cupy.cuda.UnownedMemory,), {})
        # CuPy's own stream classes: one base class, public before CuPy 14 and private since.
        st = cupy.cuda.stream
        self._streams = getattr(st, "BaseStream", None) or getattr(st, "_BaseStream", None) or cupy.cuda.Stream

    # -- kernels' modules -------------------------------------------------------------
    def _function(self, source, name):
        dev = self._cp.cuda.runtime.getDevice()
        fn = self._functions.get((dev, name))
        if fn is None:
            unit = unit_of(source, name)  # reduce.cu: the kernel's kind alone, compiled on its first need
            mod = self._modules.get((dev, source, unit))
            if mod is None:
                arch = int(self._cp.cuda.Device(dev).compute_capability)
                _, image = compile_source(source, arch, defines=unit)
                mod = self._cp.cuda.function.Module()
                mod.load(image)  # cuModuleLoadData: a cubin, or PTX the driver compiles
                self._modules[(dev, source, unit)] = mod
            fn = self._functions[(dev, name)] = mod.get_function(name)
        return fn

    # -- streams and events ----------------------------------------------------------
    def default_stream(self):
        return self._cp.cuda.get_current_stream()

    def compute_stream(self):
        # ``using`` made the call's stream CuPy's current one; outside it, CuPy's current stream is the caller's.
        return self._cp.cuda.get_current_stream()

    def _on_device(self, device, stream):
        stack = contextlib.ExitStack()
        if device is not None:
            stack.enter_context(self._cp.cuda.Device(device))
        if stream is not None:
            stack.enter_context(stream)
        return stack

    def stream_of(self, x, stream=None):
        cp = self._cp
        if stream is None:
            if type(x).__module__.startswith("torch"):
                import torch

                return self._wrap(torch.cuda.current_stream(x.device).cuda_stream, x.device.index)
            if type(x).__module__.startswith("numba"):
                return self._wrap(self._numba_default_stream(), self.device_id(x))
            return cp.cuda.get_current_stream()
        if isinstance(stream, self._streams):
            return stream
        mod = type(stream).__module__
        if mod.startswith("torch"):
            return self._wrap(stream.cuda_stream, stream.device.index)
        if mod.startswith("numba"):
            return self._wrap(int(stream), None)  # the handle's int, ctypes or cuda.bindings alike
        if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
            return self._wrap(int(stream), None)
        raise TypeError(f"stream must be a CuPy, torch or Numba stream or a cudaStream_t int, got {stream!r}")

    def _numba_default_stream(self):
        """The handle of Numba's default stream: 0, the legacy one, or the per-thread one where Numba is
        configured so (``NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM``); asked once."""
        if self._numba_stream is None:
            from numba import cuda

            self._numba_stream = int(cuda.default_stream())
        return self._numba_stream

    def _wrap(self, handle, device):
        """A CuPy stream for the raw ``cudaStream_t`` ``handle`` of ``device`` (cached: made once per stream)."""
        cp = self._cp
        dev = cp.cuda.runtime.getDevice() if device is None else int(device)
        s = self._external.get((handle, dev))
        if s is None:
            with cp.cuda.Device(dev):
                if handle == 0:  # the legacy default stream (torch's default stream)
                    s = cp.cuda.Stream.null
                elif hasattr(cp.cuda.Stream, "from_external"):  # CuPy 14: the CUDA stream protocol
                    s = cp.cuda.Stream.from_external(_StreamHandle(handle))
                else:
                    s = cp.cuda.ExternalStream(int(handle), dev)
            self._external[(handle, dev)] = s
        return s

    def new_stream(self, device=None):
        with self._cp.cuda.Device(device):
            return self._cp.cuda.Stream(non_blocking=True)

    def current_device(self):
        return self._cp.cuda.runtime.getDevice()

    def record(self, stream):
        ev = self._cp.cuda.Event(disable_timing=True)
        ev.record(stream)
        return ev

    def wait(self, stream, ev):
        if ev.__class__ is _PeerEvent:
            self._cp.cuda.runtime.streamWaitEvent(stream.ptr, ev.ptr, 0)
        else:
            stream.wait_event(ev)

    def sync(self, ev):
        ev.synchronize()

    def sync_stream(self, stream):
        stream.synchronize()  # no event recorded: nothing queued on the GPU for this

    def query(self, ev):
        return ev.done

    def idle(self, stream):
        return stream.done  # cudaStreamQuery

    def graph_capture(self, stream):
        rt = self._cp.cuda.runtime
        try:
            return CAPTURE_STATUS.get(int(rt.streamIsCapturing(stream.ptr)))
        except rt.CUDARuntimeError as exc:  # the legacy stream while another captures in global mode
            return CAPTURE_ELSEWHERE.format(exc)

    def pinned(self, nbytes):
        import cupyx

        return cupyx.empty_pinned((int(nbytes),), dtype=np.uint8)

    def d2h(self, host, dev, stream):
        dev.get(stream=stream, out=host.view(dev.dtype), blocking=False)

    def h2d(self, dev, host, stream):
        dev.set(host.view(dev.dtype), stream=stream)

    # -- CUDA IPC (the module comment) -------------------------------------------------
    def ipc_export(self, buf):
        nbytes = buf.shape[0] * buf.dtype.itemsize
        if nbytes == 0 or isinstance(buf.data.mem, self._NumbaMemory):  # Numba frees to the driver: staged
            return None
        ptr = self._ptr(buf)
        try:
            base = _allocation_base(ptr, lambda: self._cp.cuda.runtime.free(0))  # cudaFree(0): the context
            key = self._cp.cuda.runtime.ipcGetMemHandle(base)
        except Exception:  # noqa: BLE001 -- memory legacy IPC cannot export: the caller stages it
            return None
        return key, ptr - base

    def ipc_open(self, key):
        return self._cp.cuda.runtime.ipcOpenMemHandle(key)  # cudaIpcMemLazyEnablePeerAccess

    def ipc_view(self, mapping, offset, count, dtype):
        cp, dt = self._cp, np.dtype(dtype)
        mem = cp.cuda.UnownedMemory(int(mapping) + int(offset), int(count) * dt.itemsize, self,
                                    self.current_device())
        return cp.ndarray((int(count),), dt, cp.cuda.MemoryPointer(mem, 0))

    def ipc_close(self, mapping):
        self._cp.cuda.runtime.ipcCloseMemHandle(int(mapping))

    def ipc_alloc(self, nbytes):
        cp = self._cp
        mem = cp.cuda.Memory(int(nbytes))  # its own cudaMalloc, not the pool's: exportable by itself
        return cp.ndarray((int(nbytes),), np.uint8, cp.cuda.MemoryPointer(mem, 0))

    def gpu_ident(self):
        return self._cp.cuda.Device().pci_bus_id.encode()

    def ipc_event(self):
        ev = self._cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
        return ev, self._cp.cuda.runtime.ipcGetEventHandle(ev.ptr)

    def ipc_open_event(self, key):
        return _PeerEvent(self._cp.cuda.runtime.ipcOpenEventHandle(key))

    def record_on(self, stream, ev):
        self._cp.cuda.runtime.eventRecord(ev.ptr, stream.ptr)

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
        if type(x).__module__.startswith("numba"):
            return self._numba_view(x)
        if hasattr(type(x), "__dlpack__"):
            return cp.from_dlpack(x)
        return cp.asarray(x)  # __cuda_array_interface__: zero-copy

    def _numba_view(self, x):
        """A CuPy array over Numba device array ``x``'s memory, of its storage dtype (bfloat16 as uint16),
        marked as Numba's for ``ipc_export``.  Not ``cupy.asarray(x)``: it synchronizes the stream ``x`` is
        bound to."""
        cp = self._cp
        if not x.is_c_contiguous():
            raise ValueError("device array is not C-contiguous")
        dtype = storage_dtype(np.dtype(x.dtype))
        ptr = x.__cuda_array_interface__["data"][0]
        mem = self._NumbaMemory(ptr, x.size * dtype.itemsize, x, self._device_at(ptr))
        return cp.ndarray(tuple(x.shape), dtype, cp.cuda.MemoryPointer(mem, 0))

    def _device_at(self, ptr):
        """The device of device memory at ``ptr``; a null pointer (an array of no element) has none: the
        current device."""
        rt = self._cp.cuda.runtime
        return rt.pointerGetAttributes(ptr).device if ptr else rt.getDevice()

    def dtype(self, x):
        if type(x).__module__.startswith("torch"):
            import torch

            if x.dtype == torch.bfloat16:
                return BFLOAT16
            return np.dtype(str(x.dtype).replace("torch.", ""))
        return np.dtype(x.dtype)

    def device_id(self, x):
        mod = type(x).__module__
        if mod.startswith("torch"):
            return x.device.index
        if mod.startswith("numba"):  # a strided array too, which has no view here
            return self._device_at(x.__cuda_array_interface__["data"][0])
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

    def full(self, n, dtype, value):
        # Filled as unsigned words of the value's bits: CuPy's fill of a value equal to 0 is a memset, which
        # would turn -0 into +0.  On CuPy's current stream: the compute one.
        out = self._cp.empty(int(n), dtype=storage_dtype(dtype))
        bits = np.asarray(value, out.dtype).reshape(1).view(f"u{out.dtype.itemsize}")[0]
        out.view(bits.dtype).fill(bits)
        return out

    def like(self, flat, x, shape=None):
        shape = x.shape if shape is None else shape
        if type(x).__module__.startswith("torch"):
            import torch

            if x.dtype == torch.bfloat16:
                return torch_result(torch.from_dlpack(flat.view(np.int16)).view(torch.bfloat16).reshape(shape))
            return torch_result(torch.from_dlpack(flat).reshape(shape))
        if type(x).__module__.startswith("numba"):
            return self._numba_result(flat.reshape(shape), x.dtype)
        return flat.reshape(shape)

    def _numba_result(self, a, dtype):
        """A Numba device array over CuPy array ``a``'s memory (keeping ``a`` alive), of ``dtype`` (``a``'s
        bits: bfloat16 over uint16).  Not ``numba.cuda.as_cuda_array(a)``: it synchronizes CuPy's stream."""
        from numba import cuda

        desc = {"shape": a.shape, "strides": None, "data": (a.data.ptr, False), "typestr": a.dtype.str,
                "version": 3, "stream": None}
        r = cuda.from_cuda_array_interface(desc, owner=a, sync=False)
        return r if r.dtype == dtype else r.view(dtype)

    def _ptr(self, buf):
        return buf.data.ptr  # an int already: int() of it would double the cost of a pack's addresses

    # -- kernels ---------------------------------------------------------------------
    def copy(self, dst, src):
        if dst.shape[0] != src.shape[0]:
            raise ValueError(f"copy: lengths differ ({dst.shape[0]} vs {src.shape[0]})")
        if dst.shape[0]:
            self._cp.copyto(dst, src)

    def _launch_reduce(self, name, dst, a, b, n, arg):
        # One 128-bit word a thread, no grid-stride rounds: on an H200 that ran within 2% of torch.add, 4096 blocks
        # of rounds 2-7% slower than it (bench/results/reduce_launch_h200.txt).
        blocks = _blocks(n, dst.dtype.itemsize)
        self._function("reduce.cu", name)((blocks,), (_THREADS,), (dst, a, b, np.uint64(n), arg),
                                           stream=self._cp.cuda.get_current_stream())

    def _launch_fold(self, name, dst, srcs, n, arg, also=()):
        # At most 4096 blocks: with one word a thread, 4 shards folded into 4 outputs took 0.188 ms on the H200
        # against 0.154 ms (bench/results/device_kernels_h200{,_first}.txt): each thread's setup checks 15 pointers.
        blocks = min(_blocks(n, dst.dtype.itemsize), 4096)
        ptrs = list(srcs) + [srcs[0]] * (8 - len(srcs))
        extra = list(also) + [dst] * (7 - len(also))  # past m: never written
        self._function("reduce.cu", name)((blocks,), (_THREADS,),
                                           (dst, np.uint64(n), arg, np.int32(len(srcs)), np.int32(len(also)),
                                            *ptrs, *extra),
                                           stream=self._cp.cuda.get_current_stream())

    def pack(self, tensors, buf, offsets=None):
        """Copy flat device buffers ``tensors`` into ``buf`` at byte ``offsets`` (default 16-byte aligned), one launch."""
        return self._table_copy("ddl_pack", tensors, buf, offsets)

    def unpack(self, buf, tensors, offsets):
        """Inverse of ``pack``, one launch."""
        return self._table_copy("ddl_unpack", tensors, buf, offsets)

    def _table_copy(self, name, tensors, buf, offsets):
        sizes, offsets = pack_layout(tensors, buf, offsets)
        if any(sizes):
            stream = self._cp.cuda.get_current_stream()
            table, _ = self._pack_table(stream, tuple([t.data.ptr for t in tensors]), sizes, offsets)  # _ptr inlined
            rows = table.shape[0]  # one block per piece (PIECE_BYTES); gridDim.y past 65535 wraps in the kernel
            self._function("pack.cu", name)((1, min(rows, 65535)), (_THREADS,),
                                            (table, np.int32(rows), buf), stream=stream)
        return list(offsets)

    def _upload(self, host, stream):
        table = self._cp.empty(host.shape, dtype=host.dtype)
        table.set(host, stream=stream)  # from pageable memory: no device-wide sync, unlike the synchronous copy
        return table
