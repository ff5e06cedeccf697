"""The GPU path's plumbing, in one process and without a GPU.

* ``import ddlkernels`` (and routing a host array) imports no GPU library;
* device arrays are recognised by duck typing: a type exporting
  ``__cuda_array_interface__`` or a DLPack CUDA device goes to a device
  backend, host arrays and CPU torch tensors to numpy; a Numba device array
  goes to CuPy where CuPy is installed and imports (a zero-copy view each way,
  no stream synchronized), to Numba otherwise, the simulator's always to Numba;
* CUDA-aware detection: the override wins, an MPI 4.1 ``mpi_memory_alloc_kinds``
  containing "cuda" means aware, otherwise the vendor query decides;
* the kernel sources are found in a checkout and inside a built wheel;
* the CuPy backend's question to the driver (where an allocation starts) makes the thread's context
  first where the thread has none yet (the driver answers as it does then, a stand-in for it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ddlkernels.transport.cuda_aware import cuda_aware, gpu_info
from ddlkernels.kernels.sources import SOURCES, cuda_include_dirs, kernel_dir, read_source
from ddlkernels.backends import BackendUnavailable
from ddlkernels.backends._detect import has_module, is_cupy_array, is_foreign_cuda_array, is_numba_array

ROOT = Path(__file__).resolve().parent.parent


def test_import_needs_no_gpu_library():
    # Compared with what the interpreter had before (site hooks of the CUDA
    # wheels may import a bare "cuda" namespace at startup).
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import numpy as np, ddlkernels\n"
        "from ddlkernels.backends import backend_for, _REGISTRY\n"
        "assert backend_for(np.zeros(3)).name == 'numpy'\n"
        "assert list(_REGISTRY) == ['numpy', 'cupy', 'numba'], list(_REGISTRY)\n"
        "new = set(sys.modules) - before\n"
        "bad = sorted(m for m in new if m.split('.')[0] in ('numba', 'cupy', 'cupyx', 'torch', 'cuda'))\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr


class _CAIArray:
    """A foreign CUDA array as a library other than CuPy/Numba would export it (no memory behind it:
    only its type is inspected)."""

    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}


class _DLPackCuda:
    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0


class _DLPackCPU:
    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def test_host_arrays_are_not_device_arrays():
    torch = pytest.importorskip("torch")
    for x in (np.zeros(3), torch.zeros(3), _DLPackCPU()):
        assert not is_foreign_cuda_array(x)
        assert not is_cupy_array(x) and not is_numba_array(x)


@pytest.mark.parametrize("obj", [_CAIArray(), _DLPackCuda()], ids=["cuda_array_interface", "dlpack_cuda"])
def test_foreign_cuda_arrays_route_to_a_device_backend(obj):
    assert is_foreign_cuda_array(obj)
    # CuPy claims it if installed; Numba always, and serves it where CuPy is missing or does not import.
    assert is_cupy_array(obj) == has_module("cupy")
    assert is_numba_array(obj)


def test_backend_for_foreign_cuda_array_names_the_device_backend():
    from ddlkernels.backends import backend_for

    be = backend_for(_CAIArray())
    assert be.device and be.name in ("cupy", "numba")


class _Info:
    def __init__(self, kinds):
        self.kinds = kinds

    def Get(self, key):
        return self.kinds if key == "mpi_memory_alloc_kinds" else None

    def Free(self):
        pass


class _Comm:
    def __init__(self, kinds):
        self.kinds = kinds

    def Get_info(self):
        return _Info(self.kinds)


def test_cuda_aware_override_wins():
    assert cuda_aware(_Comm("cuda"), override=False) == (False, "set explicitly")
    assert cuda_aware(_Comm(None), override=True) == (True, "set explicitly")


def test_cuda_aware_from_mpi_memory_alloc_kinds():
    aware, why = cuda_aware(_Comm("system,mpi,cuda:device"))
    assert aware and "cuda:device" in why


def test_cuda_aware_without_alloc_kinds_asks_the_vendor():
    aware, why = cuda_aware(_Comm("system,mpi"))
    assert isinstance(aware, bool)
    assert "MPIX_" in why or "unknown" in why
    if not aware:
        assert "MPIX_Query_cuda_support() = 0" in why or "MPIX_GPU_query_support" in why or "assuming not" in why


def test_cuda_aware_on_the_real_communicator_gives_a_reason():
    from mpi4py import MPI

    aware, why = cuda_aware(MPI.COMM_WORLD)
    assert isinstance(aware, bool) and why


def test_gpu_info_is_consistent():
    info = gpu_info()
    assert set(info) >= {"backends", "device", "cuda_aware", "cuda_aware_reason", "transport"}
    assert set(info["backends"]) == {"cupy", "numba"}
    assert info["transport"] == ("cuda-aware" if info["cuda_aware"] else "staged")
    assert gpu_info(override=True)["transport"] == "cuda-aware"
    assert gpu_info(override=False)["transport"] == "staged"


def test_kernel_sources_in_the_checkout():
    d = kernel_dir()
    assert all((d / s).is_file() for s in SOURCES)
    assert "DDL_REDUCE_KERNELS" in read_source("reduce.cu") and "ddl_pack" in read_source("pack.cu")
    with pytest.raises(ValueError, match="unknown kernel source"):
        read_source("other.cu")
    assert any((Path(p) / "cuda_bf16.h").is_file() for p in cuda_include_dirs())


def test_kernel_sources_in_a_wheel(tmp_path):
    """Build a wheel from a copy of the checkout, install it elsewhere, and find the .cu files there."""
    src = tmp_path / "src"
    src.mkdir()
    for item in ("setup.py", "ddlkernels", "kernels", "README.md"):
        p = ROOT / item
        if p.is_dir():
            shutil.copytree(p, src / item, ignore=shutil.ignore_patterns("__pycache__"))
        elif p.exists():
            shutil.copy(p, src / item)
    wheels = tmp_path / "wheels"
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    (whl,) = wheels.glob("ddlkernels-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert {"ddlkernels/kernels/cuda/reduce.cu", "ddlkernels/kernels/cuda/pack.cu"} <= set(names)
    site = tmp_path / "site"
    with zipfile.ZipFile(whl) as z:
        z.extractall(site)
    code = "from ddlkernels.kernels.sources import kernel_dir, read_source; print(kernel_dir()); read_source('pack.cu')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(site)), cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()) == site / "ddlkernels" / "kernels" / "cuda"


def test_allocation_base_makes_the_context_of_a_thread_that_has_none(monkeypatch):
    """cuMemGetAddressRange answers CUDA_ERROR_INVALID_CONTEXT (201) in a thread that has made no runtime call
    yet: the runtime call given makes the context, and the question is asked again; other errors raise."""
    pytest.importorskip("cupy")
    import ctypes

    from ddlkernels.backends import _cupy

    state = {"context": False, "asked": 0}

    def driver(base, size, ptr):  # what the driver answers, with and without a current context
        state["asked"] += 1
        if not state["context"]:
            return 201
        ctypes.cast(base, ctypes.POINTER(ctypes.c_uint64))[0] = ptr.value - 4096
        return 0

    monkeypatch.setattr(_cupy, "_address_range", driver)
    assert _cupy._allocation_base(0x7F00_1000, lambda: state.update(context=True)) == 0x7F00_0000
    assert state["asked"] == 2
    state["context"] = False
    with pytest.raises(RuntimeError, match="CUresult 201"):
        _cupy._allocation_base(0x7F00_1000)  # nothing to make it with
    with pytest.raises(RuntimeError, match="CUresult 201"):
        _cupy._allocation_base(0x7F00_1000, lambda: None)  # a call that made none


def _ranges(most):
    from hypothesis import strategies as st

    # Small addresses and lengths, so that ranges often meet, nest, touch end to start and start together.
    return st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)).map(lambda t: (t[0], t[0] + t[1])),
                    min_size=1, max_size=most)


def test_fold_checks_answer_as_every_pair_compared():
    """``reduce_many`` sorts the outputs' byte ranges once instead of comparing every pair (``_disjoint``,
    ``_against``): the same answers as the pairwise definitions, for ranges that meet, nest and touch."""
    from hypothesis import given, settings

    from ddlkernels.backends._device import _against, _disjoint

    def meet(a, b):
        return a[0] < b[1] and b[0] < a[1]

    @settings(max_examples=400, deadline=None)
    @given(_ranges(9), _ranges(9))
    def check(outs, spans):
        outs = sorted(outs)
        apart = not any(meet(outs[i], outs[j]) for i in range(len(outs)) for j in range(i))
        assert _disjoint(outs) == apart
        if apart:
            exact, touch = _against(outs, spans)
            assert exact == [any(s[0] == o[0] for o in outs) for s in spans]
            assert touch == [any(meet(s, o) for o in outs) for s in spans]

    check()


def test_reduce_many_refuses_outputs_that_overlap():
    """Overlapping outputs raise before any launch; an operand that is exactly an output folds in one launch."""
    from ddlkernels.backends._device import DeviceBackend

    class Checks:  # what reduce_many asks before its launch
        def __init__(self):
            self.launched = []

        def _span(self, x):
            return x.ctypes.data, x.ctypes.data + x.nbytes

        _ptr = staticmethod(lambda x: x.ctypes.data)

        def _launch_fold(self, name, dst, srcs, n, arg, also=()):
            self.launched.append((len(srcs), len(also)))

    buf = np.zeros(64, np.float32)
    be = Checks()
    with pytest.raises(ValueError, match="overlap"):
        DeviceBackend.reduce_many(be, "sum", buf[0:16], [buf[32:48], buf[48:64]], also=[buf[8:24]])
    assert be.launched == []
    DeviceBackend.reduce_many(be, "sum", buf[0:16], [buf[0:16], buf[16:32]], also=[buf[16:32]])
    assert be.launched == [(2, 1)]


def test_reduce_launches_the_realigned_kernel_only_where_an_operand_is_at_another_offset():
    """``reduce`` picks ``ddl_reduce`` where dst, a and b share one offset modulo 16 bytes (views one element
    in, all three, included), else ``ddl_realign``; an operand that overlaps dst is copied first, and then the
    copy's offset counts."""
    from ddlkernels.backends._device import DeviceBackend

    class Launches:  # what reduce asks before its launch
        def __init__(self):
            self.names = []

        _ptr = staticmethod(lambda x: x.ctypes.data)

        def _dup(self, x):
            out = _aligned(len(x), x.dtype, 0)
            out[:] = x
            return out

        def _launch_reduce(self, name, dst, a, b, n, arg):
            self.names.append(name)

    def kinds(*cases):
        be = Launches()
        for d, a, b in cases:
            DeviceBackend.reduce(be, "sum", d, a, b)
        return [name.split("_")[1] for name in be.names]

    def at(offset):  # 10 float32 from ``offset`` elements past a 64-byte boundary
        return _aligned(10, np.float32, offset)

    assert kinds((at(0), at(0), at(0)), (at(1), at(1), at(1)), (at(3), at(7), at(11))) == ["reduce"] * 3
    assert kinds((at(0), at(1), at(1)), (at(1), at(0), at(1)), (at(2), at(2), at(0))) == ["realign"] * 3
    d = at(1)
    assert kinds((d, d, at(1)), (d, d, at(2))) == ["reduce", "realign"]
    # b overlaps dst: it is copied into a fresh (aligned) buffer first, and that copy's offset is the one compared
    whole = at(1)
    assert kinds((whole[:8], whole[:8], whole[2:10])) == ["realign"]
    whole = _aligned(12, np.float32, 0)
    assert kinds((whole[4:12], _aligned(8, np.float32, 0), whole[1:9])) == ["reduce"]


def test_the_cupy_backend_compiles_each_kind_of_reduce_kernel_on_its_first_need(monkeypatch):
    """A kernel's first launch compiles the unit that defines it (reduce.cu: its kind alone, ``unit_of``), once
    per device; the next kernel of a kind already loaded compiles nothing."""
    pytest.importorskip("cupy")
    from types import SimpleNamespace

    from ddlkernels.backends import _cupy

    compiled = []

    def compile_source(source, arch, defines=()):
        compiled.append((source, arch, defines))
        return f"sm_{arch}", (source, defines)

    class Module:
        def load(self, image):
            self.image = image

        def get_function(self, name):
            return (self.image, name)

    device = {"now": 0}
    cuda = SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: device["now"]),
                           Device=lambda d: SimpleNamespace(compute_capability="90" if d == 0 else "80"),
                           function=SimpleNamespace(Module=Module))
    monkeypatch.setattr(_cupy, "compile_source", compile_source)
    be = SimpleNamespace(_cp=SimpleNamespace(cuda=cuda), _modules={}, _functions={})
    fn = lambda name, source="reduce.cu": _cupy.CupyBackend._function(be, source, name)  # noqa: E731
    assert fn("ddl_reduce_sum_f32") == (("reduce.cu", ("DDL_KINDS=1",)), "ddl_reduce_sum_f32")
    fn("ddl_reduce_max_f64")
    assert fn("ddl_fold_avg_bf16") == (("reduce.cu", ("DDL_KINDS=4",)), "ddl_fold_avg_bf16")
    fn("ddl_pack", "pack.cu")
    fn("ddl_fold_sum_f16")
    device["now"] = 1
    fn("ddl_fold_sum_f16")
    assert compiled == [("reduce.cu", 90, ("DDL_KINDS=1",)), ("reduce.cu", 90, ("DDL_KINDS=4",)),
                        ("pack.cu", 90, ()), ("reduce.cu", 80, ("DDL_KINDS=4",))]


def _aligned(n, dtype, offset):
    """``n`` elements of ``dtype`` starting ``offset`` elements past a 64-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.zeros((n + offset) * dtype.itemsize + 64, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset * dtype.itemsize
    return raw[start:start + n * dtype.itemsize].view(dtype)


def test_host_costs_study_times_what_it_means_to():
    """``bench/studies/host_costs.py`` runs without a GPU, and exits non-zero where a call took another path
    than the one launch (or fold) it means to time."""
    pytest.importorskip("cupy")
    res = subprocess.run([sys.executable, "bench/studies/host_costs.py", "--calls", "20", "--ranks", "2,8"],
                         cwd=str(Path(__file__).resolve().parents[1]), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[1:5]] == ["p=2", "p=2", "p=8", "p=8"]
    assert [ln.split()[:2] for ln in lines[5:7]] == [["reduce", "sum"], ["reduce", "avg"]], res.stdout
    assert "reduce_kernel lookup" in lines[7] and lines[14].startswith("pack of 182 tensors"), res.stdout
    assert lines[15].startswith("CUDA IPC allreduce") and [ln.split()[0] for ln in lines[16:]] == ["p=2", "p=8"]


def test_numba_kernel_lookup_makes_its_source_once(monkeypatch):
    """Every Numba launch looks its kernel up: the source (1-3 us of formatting a launch) is made only when
    the kernel is not there yet."""
    from ddlkernels.kernels import numba_cuda

    made = []
    real = numba_cuda.reduce_source
    monkeypatch.setattr(numba_cuda, "reduce_source", lambda op, suf: made.append((op, suf)) or real(op, suf))
    monkeypatch.setattr(numba_cuda, "_PY", {})
    first = numba_cuda.reduce_kernel("max", "bf16", python=True)
    assert numba_cuda.reduce_kernel("max", "bf16", python=True) is first
    assert made == [("max", "bf16")]
    with pytest.raises(ValueError, match="no kernel"):
        numba_cuda.reduce_kernel("mean", "bf16", python=True)


def test_pack_offsets_are_the_aligned_running_sum():
    """``pack_offsets`` (numpy's running sum) gives what placing the tensors one by one at the next aligned
    byte gives, empty tensors and a last one that ends unaligned included."""
    from hypothesis import given, settings, strategies as st

    from ddlkernels.backends._device import pack_offsets

    def one_by_one(nbytes, align):
        offs, pos = [], 0
        for n in nbytes:
            pos = -(-pos // align) * align
            offs.append(pos)
            pos += n
        return offs, pos

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.integers(0, 5000), max_size=40), st.sampled_from([1, 4, 16, 256]))
    def check(nbytes, align):
        got = pack_offsets(nbytes, align)
        assert got == one_by_one(nbytes, align)
        assert all(type(v) is int for v in got[0]) and type(got[1]) is int

    check()
    assert pack_offsets([5, 20, 3]) == ([0, 16, 48], 51)  # the docstring's example


def test_pack_layout_refuses_what_does_not_fit_before_any_launch():
    from ddlkernels.backends._device import pack_layout

    tensors = [np.zeros(n, np.uint8) for n in (5, 20, 3)]
    assert pack_layout(tensors, np.zeros(51, np.uint8), None) == ((5, 20, 3), (0, 16, 48))
    with pytest.raises(ValueError, match="tensors of 51 bytes packed do not fit a 50-byte buffer"):
        pack_layout(tensors, np.zeros(50, np.uint8), None)
    assert pack_layout(tensors, np.zeros(28, np.uint8), [0, 5, 25]) == ((5, 20, 3), (0, 5, 25))
    with pytest.raises(ValueError, match="tensor of 3 bytes at offset 26 does not fit a 28-byte buffer"):
        pack_layout(tensors, np.zeros(28, np.uint8), [0, 5, 26])
    with pytest.raises(ValueError, match="tensor of 5 bytes at offset -1"):
        pack_layout(tensors, np.zeros(28, np.uint8), [-1, 5, 25])
    with pytest.raises(ValueError, match="2 offsets for 3 tensors"):
        pack_layout(tensors, np.zeros(64, np.uint8), [0, 16])


def test_numba_backend_reads_the_address_the_array_interface_gives():
    """The Numba backend's ``_ptr`` reads a device array's address where ``__cuda_array_interface__`` does,
    without building its dict; checked on a DeviceNDArray over a made-up allocation (no GPU needed)."""
    code = """if True:
        import ctypes, numpy as np
        from numba.cuda.cudadrv import devicearray
        from ddlkernels.backends._numba import NumbaBackend

        class Allocation:  # what a DeviceNDArray asks of its memory for its address
            device_ctypes_pointer = ctypes.c_size_t(0x7F0000001000)

        be = NumbaBackend()
        a = devicearray.DeviceNDArray(shape=(64,), strides=(4,), dtype=np.float32, gpu_data=Allocation())
        assert be._ptr(a) == a.__cuda_array_interface__["data"][0]
        print("ok", hex(be._ptr(a)))
    """
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"))
    if res.returncode and "numba" in res.stderr and "No module named" in res.stderr:
        pytest.skip("numba-cuda is not installed")
    assert res.returncode == 0 and res.stdout.split() == ["ok", "0x7f0000001000"], res.stdout + res.stderr


def test_numba_pack_word_ignores_what_empty_tensors_bind():
    """The Numba pack reads in the widest word dividing every address, length and offset it uses: an empty
    tensor's odd address and offset do not narrow it; any other odd value, the buffer's included, does."""
    from ddlkernels.backends._numba import _word

    ptrs, sizes, offsets = [0x2000, 0x3001, 0x4000], [16, 0, 8], [0, 3, 16]
    assert _word(0x1000, ptrs, sizes, offsets) == 8
    assert _word(0x1000, ptrs, [16, 2, 8], [0, 16, 24]) == 1  # the odd address now binds
    assert _word(0x1000, [0x2000, 0x3002, 0x4000], [16, 2, 8], [0, 16, 24]) == 2
    assert _word(0x1004, ptrs, sizes, offsets) == 4
    assert _word(0x1001, ptrs, sizes, offsets) == 1
    assert _word(0x1000, [], [], []) == 8


def _prints_ok(code, simulator):
    """Run ``code`` in a fresh interpreter (Numba's simulator on or off as ``simulator`` says, which a process
    decides once) with this checkout first on the path; it must print "ok" alone."""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, NUMBA_ENABLE_CUDASIM=simulator,
                                  PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
    assert res.returncode == 0 and res.stdout.split() == ["ok"], res.stdout + res.stderr


class _FirstMissing:
    made = 0

    def __init__(self):
        type(self).made += 1
        raise BackendUnavailable("first: not importable here")


class _Second:
    name, device = "second", True


def test_an_array_two_backends_claim_goes_to_the_first_that_can_be_made(monkeypatch):
    """CuPy installed but not importable: a Numba or torch array goes to the Numba backend, and the failed
    import is not tried again at every call; where no claimant can be made, the first one's reason."""
    import types

    import ddlkernels.backends as B

    mod = types.ModuleType("ddl_test_backends")
    mod.First, mod.Second = _FirstMissing, _Second
    monkeypatch.setitem(sys.modules, "ddl_test_backends", mod)
    monkeypatch.setattr(B, "_REGISTRY", {})
    monkeypatch.setattr(B, "_INSTANCES", {})
    monkeypatch.setattr(B, "_UNAVAILABLE", {})
    _FirstMissing.made = 0
    B.register_backend("first", "ddl_test_backends:First", lambda x: isinstance(x, (_CAIArray, _DLPackCuda)))
    B.register_backend("second", "ddl_test_backends:Second", lambda x: isinstance(x, _CAIArray))
    for _ in range(3):
        assert B.backend_for(_CAIArray()).name == "second"
    assert _FirstMissing.made == 1
    with pytest.raises(BackendUnavailable, match="first: not importable here"):
        B.backend_for(_DLPackCuda())  # claimed by "first" alone
    with pytest.raises(BackendUnavailable, match="first: not importable here"):
        B.get_backend("first")
    assert _FirstMissing.made == 1
    assert B.serves(B.get_backend("second"), _CAIArray()) and not B.serves(B.get_backend("second"), _DLPackCuda())


_NUMBA_ON_CUPY = """if True:
    import contextlib, ctypes, sys, numpy as np
    import numba.cuda.api, numba.cuda.cudadrv.devices
    from numba.cuda.cudadrv import devicearray
    from ml_dtypes import bfloat16
    from ddlkernels.backends import backend_for, get_backend, serves
    from ddlkernels.backends._cupy import CupyBackend

    class Allocation:  # a made-up allocation: only its address is read, nothing touches the device
        device_ctypes_pointer = ctypes.c_size_t(0x7F0000001000)

    def numba_array(shape, dtype):
        strides = tuple(int(s) for s in np.empty(shape, dtype).strides)
        return devicearray.DeviceNDArray(shape=shape, strides=strides, dtype=dtype, gpu_data=Allocation())

    x = numba_array((3, 5), np.float32)
    be = backend_for(x)
    assert be.name == "cupy" and serves(be, x) and serves(get_backend("numba"), x), be.name
    assert backend_for(x, "numba").name == "numba"
    # What the driver answers, stand-ins on a machine without a GPU: the device of an address, and the
    # contexts Numba makes sure of for a result and for an array of no element.
    be._device_at = lambda ptr: 0
    numba.cuda.cudadrv.devices._runtime.ensure_context = contextlib.nullcontext
    numba.cuda.api.current_context = numba.cuda.cudadrv.devices.get_context = lambda *a: None
    for shape, dtype, storage in [((3, 5), np.float32, np.float32), ((7,), bfloat16, np.uint16),
                                  ((0,), np.float16, np.float16)]:
        x = numba_array(shape, dtype)
        at = x.__cuda_array_interface__["data"][0]  # null where no element: Numba allocates none
        assert at == (0x7F0000001000 if x.size else 0)
        f = be.flat(x)
        assert f.data.ptr == at and f.shape == (x.size,) and f.dtype == storage, (f.shape, f.dtype)
        assert be.dtype(x) == np.dtype(dtype) and be.device_id(x) == 0

        # The result: a Numba array over the CuPy array's memory, keeping it alive.
        r = be.like(f, x)
        assert type(r) is type(x) and r.shape == x.shape and r.dtype == np.dtype(dtype), (r.shape, r.dtype)
        assert r.__cuda_array_interface__["data"][0] == at
        assert r.__cuda_array_interface__["stream"] is None  # bound to no stream: no later synchronization
        assert r.gpu_data.owner is not None
    # CUDA IPC: the memory of a Numba array is staged, never exported (Numba gives it back to the driver
    # while peers may hold it mapped); memory of CuPy's own is exported where it lies.  The driver's answers
    # are stand-ins.
    import cupy
    import ddlkernels.backends._cupy as cupy_backend
    cupy_backend._allocation_base = lambda ptr, make_context=None: ptr - 64
    cupy.cuda.runtime.ipcGetMemHandle = lambda base: b"handle of %x" % base
    mine = cupy.ndarray((16,), np.float32, cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(0x7F0000002040, 64, None, 0), 0))
    assert be.ipc_export(mine) == (b"handle of 7f0000002000", 64)
    numba_flat = be.flat(numba_array((3, 5), np.float32))
    assert be.ipc_export(numba_flat) is None and be.ipc_export(numba_flat[4:]) is None

    # stream=: a Numba stream's handle, a cuda.bindings CUstream in numba-cuda (no ctypes .value)
    from numba.cuda.cudadrv import driver
    be._wrap = lambda handle, device: ("wrapped", handle, device)
    for h in (0, 2, 0x5A5A000):  # the legacy default stream, the per-thread one, a stream of the user's
        assert be.stream_of(x, driver.Stream(driver.binding.CUstream(h))) == ("wrapped", h, None)
    rows = devicearray.DeviceNDArray(shape=(3, 5), strides=(40, 4), dtype=np.float32, gpu_data=Allocation())
    assert be.device_id(rows) == 0  # every other row of a 6 x 5 array
    try:
        be.flat(rows)
    except ValueError as exc:
        assert "not C-contiguous" in str(exc)
    else:
        raise AssertionError("a strided Numba array was taken")
    print("ok")
"""


def test_numba_arrays_go_to_the_cupy_backend_as_zero_copy_views():
    """Where CuPy is installed, a Numba device array goes to the CuPy backend: viewed at the address its
    interface gives, of its storage dtype, and the result given back as a Numba array over the same memory,
    neither way through the other library's import of the interface (it synchronizes streams).  A
    DeviceNDArray over a made-up allocation: no GPU needed."""
    if not (has_module("cupy") and has_module("numba")):
        pytest.skip("needs CuPy and numba-cuda installed (no GPU)")
    _prints_ok(_NUMBA_ON_CUPY, simulator="0")


def test_the_simulators_arrays_stay_on_the_numba_backend():
    code = """if True:
        import numpy as np
        from numba import cuda
        from ddlkernels.backends import backend_for
        from ddlkernels.backends._detect import is_cupy_array
        d = cuda.to_device(np.arange(5, dtype=np.float32))
        assert not is_cupy_array(d) and backend_for(d).name == "numba"
        print("ok")
    """
    _prints_ok(code, simulator="1")


def test_graph_capture_reads_cudas_capture_status():
    """``graph_capture`` of the CuPy and the Numba backend: None where the stream is not capturing, the reason
    where it captures or its capture was invalidated, and where the query fails (the legacy stream while a
    blocking stream captures).  The runtime's and the driver's answers are stand-ins: no GPU here."""
    code = """if True:
        import types
        import numba.cuda.cudadrv.driver as drv
        from cuda.bindings import driver as real
        from ddlkernels.backends._cupy import CupyBackend
        from ddlkernels.backends._numba import NumbaBackend

        class Runtime:  # CuPy's runtime module, answering ``status`` (an int, or an exception to raise)
            CUDARuntimeError = RuntimeError
            status = 0

            @classmethod
            def streamIsCapturing(cls, ptr):
                if isinstance(cls.status, Exception):
                    raise cls.status
                return cls.status

        cupy_be = CupyBackend()
        cupy_be._cp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=Runtime))
        stream = types.SimpleNamespace(ptr=0)
        numba_be = NumbaBackend()
        numba_be.simulated = False
        answer = {}
        drv.binding = types.SimpleNamespace(
            CUstream=real.CUstream, CUresult=real.CUresult, CUstreamCaptureStatus=real.CUstreamCaptureStatus,
            cuStreamIsCapturing=lambda h: answer["now"])
        R, S = real.CUresult, real.CUstreamCaptureStatus
        cases = [(0, (R.CUDA_SUCCESS, S.CU_STREAM_CAPTURE_STATUS_NONE), None),
                 (1, (R.CUDA_SUCCESS, S.CU_STREAM_CAPTURE_STATUS_ACTIVE), "the stream is capturing a CUDA graph"),
                 (2, (R.CUDA_SUCCESS, S.CU_STREAM_CAPTURE_STATUS_INVALIDATED), "capture was invalidated"),
                 (RuntimeError("cudaErrorStreamCaptureImplicit"),
                  (R.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, S.CU_STREAM_CAPTURE_STATUS_NONE),
                  "while another stream captures a CUDA graph")]
        for status, driver_answer, want in cases:
            Runtime.status, answer["now"] = status, driver_answer
            for be, s in ((cupy_be, stream), (numba_be, 0)):
                got = be.graph_capture(s)
                assert (got is None) if want is None else (want in got), (be.name, status, got)
        assert "CAPTURE_IMPLICIT" in numba_be.graph_capture(0)
        print("ok")
    """
    if not (has_module("cupy") and has_module("numba")):
        pytest.skip("needs CuPy and numba-cuda installed (no GPU)")
    _prints_ok(code, simulator="0")
