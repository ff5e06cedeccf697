"""Numba-CUDA kernels: the operations of kernels/reduce.cu and kernels/pack.cu, in Python.

For users who have numba-cuda but not CuPy, and because Numba kernels run in
the Numba CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), which is how the device
path is executed end to end on machines without a GPU.

Worked example -- ``reduce_kernel("max", "bf16")`` is generated from the
templates below as::

    def ddl_reduce_max_bf16(dst, a, b, arg):
        for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
            x = libdevice.int_as_float(int32(uint32(a[i]) << uint32(16)))  # bf16 bits -> f32
            y = libdevice.int_as_float(int32(uint32(b[i]) << uint32(16)))
            dst[i] = a[i] if (x > y or x != x) else b[i]

one grid-stride loop per (op, dtype), every element owned by one thread.  The
kernels are generated from source text rather than composed from
``@cuda.jit(device=True)`` helpers because numba-cuda compiles a called
device function for the *current device*, so ``cuda.compile_ptx`` of a kernel
with helpers fails on a machine without a GPU -- and compiling every kernel
for sm_70/80/90 here is part of the proof.

Semantics are those of kernels/reduce.cu and of the numpy backend (see the
header of reduce.cu): f16/bf16 combine in float32 and round once; avg is
``(a + b) * scale`` in the accumulation type (``scale`` = 1/p from the host)
or ``floor((a + b) / p)`` for integers; integer arithmetic wraps; max/min
propagate NaN and select one operand's bits (ties: ``a`` for float16, ``b``
otherwise, as numpy).

Storage: bfloat16 has no Numba type, so bfloat16 buffers are passed as their
uint16 bits (``backends._numba`` does the views); uint16 is not a dtype
ddlkernels reduces, so a uint16 buffer always means bfloat16.

Preconditions of every reduce kernel: 1-D C-contiguous arrays of one length;
``b`` does not overlap ``dst``; ``a`` is ``dst`` or does not overlap it (the
2-operand form ``dst = op(dst, src)`` is ``kernel(dst, dst, src, arg)``).
``arg`` has the accumulation type (``ARG_TYPES``); only avg reads it.

Unlike the .cu kernels these do no 128-bit vectorization (Numba has no vector
load types); they are the portable path.  The pack kernels read the table
of kernels/pack.cu (every tensor cut into 64 KiB pieces, one block each, by
device address) in words of 1, 2, 4 or 8 bytes, through two small intrinsics
that load and store a word at an address (``load_w64(addr, i)``): one launch
of two arguments packs any number of tensors.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = [
    "OPS",
    "SUFFIXES",
    "ARG_TYPES",
    "reduce_kernel",
    "reduce_source",
    "pack_kernel",
    "unpack_kernel",
    "suffix_of",
    "kernel_signature",
    "pack_signature",
    "WORDS",
    "launch_config",
    "numba_cuda_compat",
]

OPS = ("sum", "prod", "max", "min", "avg")
#: word sizes (bytes) of the pack kernels: the backend takes the widest every address, length and offset allows
WORDS = (1, 2, 4, 8)
SUFFIXES = ("f16", "bf16", "f32", "f64", "i32", "i64")
#: numpy type of the last kernel argument (the accumulation type).
ARG_TYPES = {
    "f16": np.float32,
    "bf16": np.float32,
    "f32": np.float32,
    "f64": np.float64,
    "i32": np.int32,
    "i64": np.int64,
}
_STORAGE = {
    "f16": np.float16,
    "bf16": np.uint16,
    "f32": np.float32,
    "f64": np.float64,
    "i32": np.int32,
    "i64": np.int64,
}


def suffix_of(dtype) -> str:
    """Kernel suffix for a *storage* dtype (uint16 = bfloat16 bits); asked at every launch, so remembered."""
    suf = _SUFFIX_OF.get(dtype)
    if suf is None:
        suf = _SUFFIX_OF[dtype] = _suffix_of(dtype)
    return suf


_SUFFIX_OF: dict = {}  # dtype -> suffix, for the few dtypes a process reduces


def _suffix_of(dtype) -> str:
    dt = np.dtype(dtype)
    for suf, st in _STORAGE.items():
        if dt == np.dtype(st):
            return suf
    from .._dtypes import BFLOAT16

    if BFLOAT16 is not None and dt == BFLOAT16:
        return "bf16"
    raise TypeError(f"no Numba kernel for dtype {dt}")


# --- source templates ------------------------------------------------------------
# Loads produce the accumulation values x, y; STORE turns an accumulation
# expression into the assignment to dst[i].

def _as_f32(expr: str) -> str:
    """Source of a uint32 -> float32 bit cast: libdevice's __nv_int_as_float (a
    register move in PTX) on the device; a numpy view in the simulator, which
    has no libdevice."""
    if _simulating():
        return f"_sim_as_f32({expr})"
    return f"libdevice.int_as_float(int32({expr}))"


def _as_u32(expr: str) -> str:
    if _simulating():
        return f"_sim_as_u32({expr})"
    return f"uint32(libdevice.float_as_int({expr}))"


_LOAD = {
    "f16": "x = float32(a[i])\n            y = float32(b[i])",
    "bf16": None,  # built by _load(): depends on the bit cast
    "f32": "x = a[i]\n            y = b[i]",
    "f64": "x = a[i]\n            y = b[i]",
    "i32": "x = a[i]\n            y = b[i]",
    "i64": "x = a[i]\n            y = b[i]",
}

# float32 -> bfloat16 bits, round to nearest even; a NaN stays a (quiet) NaN.
_BF16_STORE = """r = {expr}
            u = {as_u32}
            if r != r:
                dst[i] = uint16((u >> uint32(16)) | uint32(0x40))
            else:
                dst[i] = uint16((u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1))) >> uint32(16))"""


def _store(suf: str, expr: str) -> str:
    if suf == "bf16":
        return _BF16_STORE.format(expr=expr, as_u32=_as_u32("r"))
    # f16: numba rounds float32 -> float16 to nearest even on the store;
    # integers: the store truncates to the storage width, i.e. wraps.
    return f"dst[i] = {expr}"


def _body(op: str, suf: str) -> str:
    is_int = suf.startswith("i")
    tie = " or x == y" if suf == "f16" else ""  # numpy's half loop uses >= / <=
    if op in ("max", "min"):
        cmp = ">" if op == "max" else "<"
        if is_int:
            return f"dst[i] = x if x {cmp} y else y"
        return f"dst[i] = a[i] if (x {cmp} y or x != x{tie}) else b[i]"
    if op == "avg" and is_int:
        # Wrap the sum to the storage width first (the store does it), then
        # floor-divide: numba's // on integers is Python's floor division.
        return "dst[i] = x + y\n            dst[i] = dst[i] // arg"
    expr = {"sum": "x + y", "prod": "x * y", "avg": "(x + y) * arg"}[op]
    return _store(suf, expr)


_KERNEL = '''
def {name}(dst, a, b, arg):
    for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
            {load}
            {body}
'''


def reduce_source(op: str, suf: str) -> str:
    """Python source of kernel ``ddl_reduce_<op>_<suf>`` (see the module docstring)."""
    if op not in OPS or suf not in SUFFIXES:
        raise ValueError(f"no kernel for op={op!r}, dtype suffix={suf!r}")
    if suf == "bf16":
        load = f"x = {_as_f32('uint32(a[i]) << uint32(16)')}\n            y = {_as_f32('uint32(b[i]) << uint32(16)')}"
    else:
        load = _LOAD[suf]
    return _KERNEL.format(name=f"ddl_reduce_{op}_{suf}", load=load, body=_body(op, suf))


# ddl_pack_w<bits> / ddl_unpack_w<bits>: gather tensors into one fusion buffer and scatter it back (kernels/pack.cu's
# job, in words of <bits>).  ``table``: int64 rows (tensor piece's device address, words, word offset in ``buf``),
# one block per row (the grid strides over rows), its threads over the piece's words.  ``buf``: the fusion
# buffer as an array of that word.  Preconditions: every address a multiple of the word, the pieces inside
# their tensors and ``buf``, no two rows writing one word.  Used by backends/_numba.py's pack/unpack.
_PACK = '''
def ddl_pack_w{bits}(table, buf):
    for r in range(cuda.blockIdx.x, table.shape[0], cuda.gridDim.x):
        addr = table[r, 0]
        o = table[r, 2]
        for i in range(cuda.threadIdx.x, table[r, 1], cuda.blockDim.x):
            buf[o + i] = load_w{bits}(addr, i)


def ddl_unpack_w{bits}(table, buf):
    for r in range(cuda.blockIdx.x, table.shape[0], cuda.gridDim.x):
        addr = table[r, 0]
        o = table[r, 2]
        for i in range(cuda.threadIdx.x, table[r, 1], cuda.blockDim.x):
            store_w{bits}(addr, i, buf[o + i])
'''


def _word_intrinsics(bits):
    """``load_w<bits>(addr, i)`` and ``store_w<bits>(addr, i, v)``: word ``i`` at device address ``addr``
    (int64), as the word's unsigned type; compiled inline (an address cast, an offset, a load or store)."""
    try:
        from numba.cuda.extending import intrinsic
    except ImportError:  # older numba-cuda
        from numba.core.extending import intrinsic
    from numba import types

    word = getattr(types, f"uint{bits}")

    @intrinsic
    def load(typingctx, addr, i):
        def codegen(context, builder, sig, args):
            ptr = builder.inttoptr(args[0], context.get_value_type(word).as_pointer())
            return builder.load(builder.gep(ptr, [args[1]]))
        return word(types.int64, types.int64), codegen

    @intrinsic
    def store(typingctx, addr, i, v):
        def codegen(context, builder, sig, args):
            ptr = builder.inttoptr(args[0], context.get_value_type(word).as_pointer())
            builder.store(context.cast(builder, args[2], sig.args[2], word), builder.gep(ptr, [args[1]]))
            return context.get_dummy_value()
        return types.void(types.int64, types.int64, v), codegen

    return load, store


def _sim_word_access(bits):
    """The simulator's ``load_w<bits>`` and ``store_w<bits>``: its "device" memory is host memory."""
    import ctypes

    ct = {8: ctypes.c_uint8, 16: ctypes.c_uint16, 32: ctypes.c_uint32, 64: ctypes.c_uint64}[bits]
    size = bits // 8

    def load(addr, i):
        return ct.from_address(int(addr) + int(i) * size).value

    def store(addr, i, v):
        ct.from_address(int(addr) + int(i) * size).value = int(v)

    return load, store


# --- compilation -------------------------------------------------------------------
def numba_cuda_compat() -> None:
    """Let numba-cuda compile under numpy 2.5, which removed ``numpy.row_stack``.

    numba-cuda (up to 0.30.4 at least) registers an overload of ``numpy.row_stack`` when it first
    compiles a kernel, so without the name every compile fails with an AttributeError deep inside
    numba-cuda.  numpy documented ``row_stack`` as an alias of ``vstack`` until it removed it: the
    alias is restored, nothing else changes.
    """
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


def _namespace():
    numba_cuda_compat()
    from numba import cuda, float32, int32, uint16, uint32

    ns = {"cuda": cuda, "float32": float32, "int32": int32, "uint16": uint16, "uint32": uint32}
    sim = _simulating()
    for w in WORDS:
        if (sim, w) not in _ACCESS:  # made once: each intrinsic registers a typing template
            _ACCESS[(sim, w)] = (_sim_word_access if sim else _word_intrinsics)(8 * w)
        ns[f"load_w{8 * w}"], ns[f"store_w{8 * w}"] = _ACCESS[(sim, w)]
    if _simulating():
        ns["_sim_as_f32"] = lambda u: np.array([u], dtype=np.uint32).view(np.float32)[0]
        ns["_sim_as_u32"] = lambda f: np.array([f], dtype=np.float32).view(np.uint32)[0]
    else:
        from numba.cuda import libdevice

        ns["libdevice"] = libdevice
    return ns


def _simulating() -> bool:
    from numba import config

    return bool(getattr(config, "ENABLE_CUDASIM", 0))


_PY: dict = {}
_JIT: dict = {}
_ACCESS: dict = {}  # (simulating, word) -> (load, store)


def _pyfunc(name: str, source: Callable[[], str]):
    """The plain Python function ``name`` of the source ``source()`` makes (what ``cuda.jit``/``compile_ptx``
    take); the source is made only the first time: a launch asks for its kernel every time."""
    if name not in _PY:
        ns = _namespace()
        code = compile(source(), f"<ddlkernels numba kernel {name}>", "exec")
        exec(code, ns)
        _PY[name] = ns[name]
    return _PY[name]


def _jit(name: str, source: Callable[[], str]):
    if name not in _JIT:
        from numba import cuda

        _JIT[name] = cuda.jit(_pyfunc(name, source))
    return _JIT[name]


def _kernel(name, source, python):
    return _pyfunc(name, source) if python else _jit(name, source)


def reduce_kernel(op: str, suf: str, *, python: bool = False):
    """The ``cuda.jit`` kernel ``ddl_reduce_<op>_<suf>`` (``python=True``: the undecorated function)."""
    return _kernel(f"ddl_reduce_{op}_{suf}", lambda: reduce_source(op, suf), python)


def pack_kernel(word: int = 8, *, python: bool = False):
    """``ddl_pack_w<8 word>`` (``python=True``: the undecorated function)."""
    return _kernel(f"ddl_pack_w{8 * word}", lambda: _PACK.format(bits=8 * word), python)


def unpack_kernel(word: int = 8, *, python: bool = False):
    """``ddl_unpack_w<8 word>`` (``python=True``: the undecorated function)."""
    return _kernel(f"ddl_unpack_w{8 * word}", lambda: _PACK.format(bits=8 * word), python)


def kernel_signature(suf: str):
    """Numba argument types of a reduce kernel for ``suf`` (for ``cuda.compile_ptx``)."""
    from numba import types

    st = {"f16": types.float16, "bf16": types.uint16, "f32": types.float32, "f64": types.float64,
          "i32": types.int32, "i64": types.int64}[suf]
    arg = {"f16": types.float32, "bf16": types.float32, "f32": types.float32, "f64": types.float64,
           "i32": types.int32, "i64": types.int64}[suf]
    arr = types.Array(st, 1, "C")
    return (arr, arr, arr, arg)


def pack_signature(word: int = 8):
    """Numba argument types of the pack kernels for ``word``-byte words (for ``cuda.compile_ptx``)."""
    from numba import types

    return (types.Array(types.int64, 2, "C"), types.Array(getattr(types, f"uint{8 * word}"), 1, "C"))


def launch_config(n: int, threads: int = 256, max_blocks: int = 1024) -> tuple[int, int]:
    """(blocks, threads per block) for ``n`` elements: one thread per element up
    to ``max_blocks`` blocks, beyond which the grid-stride loops take over."""
    if n <= 0:
        return 1, 1
    threads = min(threads, n)
    return min(max_blocks, -(-n // threads)), threads
