"""The host backend's kernels: numpy's semantics, bit for bit, including the bfloat16 fast path."""

import numpy as np
import pytest

from ddlkernels.kernels import half as _half
from ddlkernels._dtypes import BFLOAT16, SUPPORTED_DTYPES, acc_dtype, dtype_name
from ddlkernels.backends import get_backend

BE = get_backend("numpy")
UF = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def sample(n, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        return rng.integers(-1000, 1000, n).astype(dt)
    x = (rng.standard_normal(n) * 50).astype(dt)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, 65504.0, -3.0]).astype(dt)
    k = min(n, len(specials))
    x[:k] = specials[:k]
    return x


def bits(x):
    return np.ascontiguousarray(x).view(np.uint8)


@pytest.fixture(params=["compiled", "numpy"])
def half_path(request, monkeypatch):
    """float16/bfloat16 through ddlkernels.kernels.half's kernels, or through the numpy code used without Numba."""
    if request.param == "numpy":
        monkeypatch.setitem(_half._STATE, "ok", False)
    else:
        assert _half.available()
    return request.param


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=[dtype_name(d) for d in SUPPORTED_DTYPES])
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("n", [0, 1, 7, (1 << 16) + 3, 200_001])
def test_reduce_matches_numpy_ufunc_bitwise(dtype, op, n, half_path):
    a, b = sample(n, dtype, 1), sample(n, dtype, 2)
    a[8::2], b[9::2] = b[8::2], a[9::2]  # NaNs and infinities meet both operand orders
    with np.errstate(all="ignore"):
        expect = UF[op](a, b)
        dst = np.empty_like(a)
        BE.reduce(op, dst, a, b)
        assert np.array_equal(bits(dst), bits(expect))
        inplace = a.copy()
        BE.reduce(op, inplace, b)
        assert np.array_equal(bits(inplace), bits(expect))


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=[dtype_name(d) for d in SUPPORTED_DTYPES])
@pytest.mark.parametrize("p", [1, 2, 3, 7])
def test_fused_avg_is_one_rounding_of_sum_times_reciprocal(dtype, p, half_path):
    a, b = sample(70_001, dtype, 3), sample(70_001, dtype, 4)
    dst = np.empty_like(a)
    with np.errstate(all="ignore"):
        BE.reduce("sum", dst, a, b, avg_p=p)
        if np.dtype(dtype).kind in "iu":
            expect = (a + b) // p
        else:
            acc = acc_dtype(dtype)
            s = (a.astype(acc) + b.astype(acc)).astype(acc)
            expect = (s * acc.type(1.0 / p)).astype(dtype)
    assert np.array_equal(bits(dst), bits(expect))


def test_wire_views_share_memory():
    for dt in (np.float16, BFLOAT16):
        x = np.zeros(5, dt)
        w = BE.wire(x)
        assert w.dtype == np.uint16 and np.shares_memory(w, x)
    x = np.zeros(5, np.float32)
    assert BE.wire(x) is x


def test_half_kernels_are_used_here():
    """Numba is a dependency: a machine of this project must not fall back to numpy's float16 loops silently."""
    assert _half.available(), "ddlkernels.kernels.half could not compile its kernels (is numba installed?)"


HALF = [np.dtype(np.float16), BFLOAT16]


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "avg"])
def test_half_kernels_every_bit_pattern(dtype, op):
    """Every 16-bit pattern as a, against random patterns as b and as the first operand: NaN payloads,
    signalling NaNs, subnormals, signed zeros and overflow all give numpy's (ml_dtypes') bits."""
    rng = np.random.default_rng(7)
    every = np.arange(1 << 16, dtype=np.uint16)
    # And every pair of specials: +-0 (a tie whose bits differ), +-inf, quiet and signalling NaNs of both
    # signs, the largest finite value, the smallest subnormal.
    sp = np.array([0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7BFF, 0x0001, 0x7F80, 0xFF80,
                   0x7FC0, 0x7F81, 0xFFC1, 0x7F7F], np.uint16)
    a = np.concatenate([every, rng.integers(0, 1 << 16, 1 << 16, dtype=np.uint16), np.repeat(sp, sp.size)])
    b = np.concatenate([rng.integers(0, 1 << 16, 1 << 16, dtype=np.uint16), every, np.tile(sp, sp.size)])
    a, b = a.view(dtype), b.view(dtype)
    with np.errstate(all="ignore"):
        if op == "avg":  # the backend's definition: float32 (a + b) * float32(1/3), rounded once
            expect = ((a.astype(np.float32) + b.astype(np.float32)) * np.float32(1 / 3)).astype(dtype)
        else:
            expect = UF[op](a, b)
    scale = 1 / 3 if op == "avg" else None
    for form in ("apart", "into a", "into b"):  # three compiled loops (ddlkernels.kernels.half_loops)
        x, y = a.copy(), b.copy()
        dst = {"apart": np.empty_like(a), "into a": x, "into b": y}[form]
        assert _half.reduce(op, dst, x, y, scale)
        bad = np.flatnonzero(dst.view(np.uint16) != expect.view(np.uint16))
        assert bad.size == 0, (form, [(hex(a.view(np.uint16)[i]), hex(b.view(np.uint16)[i]),
                                       hex(dst.view(np.uint16)[i]), hex(expect.view(np.uint16)[i])) for i in bad[:5]])


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_half_kernels_views_and_overlap(dtype):
    """dst the same memory as an operand through another view object; dst overlapping an operand in part
    (numpy's answer: as if the operands were read before dst is written)."""
    a, b = sample(10_001, dtype, 5), sample(10_001, dtype, 6)
    with np.errstate(all="ignore"):
        expect = np.add(a, b)
        x = a.copy()
        assert _half.reduce("sum", x[:], x[:], b)
        assert np.array_equal(bits(x), bits(expect))
        buf = np.concatenate([a, b[-1:]])
        want = np.add(buf[:-1], b)
        assert _half.reduce("sum", buf[1:], buf[:-1], b)
        assert np.array_equal(bits(buf[1:]), bits(want))


def test_half_reduce_declines_other_dtypes():
    x = np.ones(4, np.float32)
    assert not _half.reduce("sum", x, x, x)
    assert np.array_equal(x, np.ones(4, np.float32))


def test_half_kernels_load_from_numba_cache_in_the_next_process(tmp_path):
    """A second process finds the compiled loops in Numba's on-disk cache instead of compiling them again."""
    import importlib.util
    import os

    pytest.importorskip("numba")
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "kernels", "half_compile.py")
    spec = importlib.util.spec_from_file_location("half_compile", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    first, second = mod.measure(2, str(tmp_path))
    assert first["ok"] and second["ok"]
    assert first["misses"] == 3 and first["hits"] == 0, first      # apart, into_a, into_b compiled
    assert second["misses"] == 0 and second["hits"] == 3, second   # and all three loaded


WIDE = [np.float32, np.float64, np.int32, np.int64]


@pytest.fixture(params=["compiled", "numpy"])
def wide_path(request, monkeypatch):
    """float32/float64/int32/int64 sum and prod through ddlkernels.kernels.host_loops, or numpy's ufunc (no Numba)."""
    from ddlkernels.backends import _numpy as nb

    if request.param == "numpy":
        monkeypatch.setattr(nb, "_LOOP", [None])
    else:
        assert nb._host_loop() is not None
    return request.param


#: The (dtype, op) pairs that also run on strided and reversed views.  Strides are handled by the same
#: dtype-independent code for every pair, but each pair compiles four more loops (one per mix of contiguous and
#: strided operands, ~3.5 s each on the 2-core VM); a float and an integer pair, 4 and 8 bytes wide, cover it.
STRIDED = {("float32", "sum"), ("int64", "prod")}


def _views(n, dtype, seed, strided):
    """(name, a, b, dst) for every layout the backend may meet: operands at different offsets within a
    64-byte line, and with ``strided`` every other element and reversed; dst apart, or the very same elements
    as a or as b."""
    base = [sample(2 * n + 64, dtype, seed + k) for k in range(3)]
    for off_a, off_b, off_d in ((0, 0, 0), (0, 0, 1), (1, 3, 2), (3, 0, 5)):
        a, b, d = base[0][off_a:off_a + n], base[1][off_b:off_b + n], base[2][off_d:off_d + n]
        yield f"offsets {off_a},{off_b},{off_d}", a, b, d
    if not strided:
        return
    yield "strided", base[0][: 2 * n: 2], base[1][1: 2 * n + 1: 2], base[2][: 2 * n: 2]
    yield "reversed", base[0][n - 1:: -1] if n else base[0][:0], base[1][:n], base[2][2 * n - 1: n - 1: -1]


@pytest.mark.parametrize("dtype", WIDE, ids=[np.dtype(d).name for d in WIDE])
@pytest.mark.parametrize("op", ["sum", "prod"])
@pytest.mark.parametrize("n", [0, 1, 7, 64, (1 << 16) + 3])
def test_wide_reduce_every_layout_and_alias_matches_numpy_bitwise(dtype, op, n, wide_path):
    with np.errstate(all="ignore"):
        strided = wide_path == "numpy" or (np.dtype(dtype).name, op) in STRIDED  # numpy's loop compiles nothing
        for name, a, b, d in _views(n, dtype, 5, strided):
            want = UF[op](a.copy(), b.copy())
            a0, b0 = a.copy(), b.copy()
            BE.reduce(op, d, a, b)
            assert np.array_equal(bits(d), bits(want)), name
            assert np.array_equal(bits(a), bits(a0)) and np.array_equal(bits(b), bits(b0)), name
            x = a.copy()
            BE.reduce(op, x, x, b)  # into a
            assert np.array_equal(bits(x), bits(want)), name + " into a"
            y = b.copy()
            BE.reduce(op, y, a, y)  # into b: a op b, a first
            assert np.array_equal(bits(y), bits(want)), name + " into b"


@pytest.mark.parametrize("dtype", WIDE, ids=[np.dtype(d).name for d in WIDE])
@pytest.mark.parametrize("op", ["sum", "prod"])
@pytest.mark.parametrize("n", [1, 7, 64, 4095, 4097, (1 << 16) + 3])
def test_streamed_loop_writes_numpys_bits_and_nothing_around_dst(dtype, op, n):
    """``stream_from=0``: every out-of-place dst written with non-temporal stores in 16 KiB blocks (whole 64-byte
    lines; memcpy before the first line boundary and after the last), at every offset and length."""
    from ddlkernels.kernels.host_loops import reduce as loop

    code = {"sum": 0, "prod": 1}[op]
    with np.errstate(all="ignore"):
        for name, a, b, d in _views(n, dtype, 11, (np.dtype(dtype).name, op) in STRIDED):
            want = UF[op](a.copy(), b.copy())
            around = d.base.copy() if d.base is not None else None
            assert loop[code](d, a, b, 0) is True, name
            assert np.array_equal(bits(d), bits(want)), name
            if around is not None:  # every element of the base array outside d as it was
                outside = np.ones(d.base.shape[0], bool)
                start = (d.ctypes.data - d.base.ctypes.data) // d.itemsize
                outside[start : start + n * (d.strides[0] // d.itemsize) : d.strides[0] // d.itemsize] = False
                if d.strides[0] > 0:
                    assert np.array_equal(bits(d.base[outside]), bits(around[outside])), name
            x = a.copy()
            assert loop[code](x, x, b, 0) is True  # in place never streams; still a op b
            assert np.array_equal(bits(x), bits(want)), name + " into a"


def test_backend_streams_from_the_threshold_with_the_same_bits():
    """Through ``NumpyBackend.reduce`` at ``STREAM_FROM`` bytes (where it streams) and just below it."""
    from ddlkernels.kernels.host_loops import STREAM_FROM

    for n in (STREAM_FROM // 4, STREAM_FROM // 4 - 3):
        a, b = sample(n, np.float32, 1), sample(n, np.float32, 2)
        d = np.empty(n + 16, np.float32)[3 : 3 + n]
        BE.reduce("sum", d, a, b)
        assert np.array_equal(bits(d), bits(a + b))


@pytest.mark.parametrize("dtype", WIDE, ids=[np.dtype(d).name for d in WIDE])
def test_wide_reduce_partial_overlap_is_numpys_result(dtype, wide_path):
    """dst overlapping an operand but not the same elements: the compiled loop declines, numpy's ufunc (which
    buffers) computes it."""
    from ddlkernels.kernels.host_loops import reduce as loop

    b = sample(1001, dtype, 7)
    for shift in (1, -1, 3):
        buf = sample(1010, dtype, 8)
        a, d = (buf[:1001], buf[shift:shift + 1001]) if shift > 0 else (buf[-shift:-shift + 1001], buf[:1001])
        with np.errstate(all="ignore"):
            want = np.add(a.copy(), b)
            if wide_path == "compiled":
                before = buf.copy()
                assert loop[0](d, a, b, 1 << 62) is False  # declined, having written nothing
                assert np.array_equal(bits(buf), bits(before))
            BE.reduce("sum", d, a, b)
        assert np.array_equal(bits(d), bits(want)), shift


def test_wide_loop_declines_mismatched_lengths_without_writing():
    from ddlkernels.kernels.host_loops import reduce as loop

    a, b, d = np.ones(8, np.float32), np.ones(7, np.float32), np.zeros(8, np.float32)
    assert loop[0](d, a, b, 1 << 62) is False and not d.any()
    assert loop[0](d, a, a, 1 << 62) is True and (d == 2).all()


def test_wide_reduce_of_what_the_loop_cannot_type_is_numpys():
    """A 0-d operand (Numba's loop indexes it) is reduced by numpy's ufunc, broadcast as numpy does; a read-only
    output raises numpy's own error."""
    a = np.arange(5, dtype=np.float32)
    d = np.empty_like(a)
    BE.reduce("sum", d, a, np.array(2, np.float32))
    assert np.array_equal(d, a + 2)
    ro = np.zeros(5, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        BE.reduce("sum", ro, a, a)
