"""Execute the very kernels/*.cu files on the CPU and compare them with numpy.

g++ compiles kernels/reduce.cu and kernels/pack.cu, unmodified, after
tests/cuda_host/cuda_host.h, which defines the CUDA built-ins and runs every
(block, thread) of a launch.  Every kernel (op x dtype, ddl_reduce and
ddl_realign) is checked bitwise against the numpy backend on the 128-bit vector
path, the scalar head and tail, pointers at different offsets modulo 16 (every
combination, and no load outside an operand), the in-place
2-operand form and several grid shapes (forward and backward thread order),
with guard elements around the output to catch stray writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_host"))

import _kernel_ref as K  # noqa: E402
import harness as H  # noqa: E402

from ddlkernels.backends._device import pack_pieces  # noqa: E402

pytestmark = pytest.mark.skipif(H.gxx() is None or not (H.CUDA_INCLUDE / "cuda_fp16.h").exists(),
                                reason="needs g++ and the CUDA toolkit headers (cuda_fp16.h)")

GUARD = 5
# (grid, block, reverse): a single thread does everything; fewer threads than
# elements (grid-stride loops wrap); more threads than elements.
LAUNCHES = ((1, 1, False), (3, 32, True), (4, 128, False))
#: The fold kernels of kernels/reduce.cu: ddl_fold, and ddl_fold_realign for operands at other offsets than dst.
FOLDS = ("fold", "fold_realign")
# The two pairwise kernels of each op x dtype: ddl_reduce (pointers at one offset modulo 16) and ddl_realign
# (an operand at another); each must be right for any pointers.
KINDS = ("reduce", "realign")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return H.build(tmp_path_factory.mktemp("cuda_host"))


def aligned(n, dtype, offset_elems):
    """A view of ``n`` elements starting ``offset_elems`` past a 64-byte boundary,
    with GUARD sentinel-filled elements on each side."""
    dtype = np.dtype(dtype)
    raw = np.empty((n + 2 * GUARD + offset_elems) * dtype.itemsize + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + (offset_elems - GUARD) * dtype.itemsize
    if offset_elems < GUARD:
        start += 64 * ((GUARD * dtype.itemsize + 63) // 64)
    whole = raw[start:start + (n + 2 * GUARD) * dtype.itemsize].view(dtype)
    K.bits_view(whole)[:] = 0x5A5A5A5A5A5A5A5A & ((1 << (8 * dtype.itemsize)) - 1)
    return whole, whole[GUARD:GUARD + n]


def lengths(dtype):
    v = 16 // np.dtype(dtype).itemsize
    return sorted({0, 1, v - 1, v, v + 1, 2 * v + 3, 64, 67, 131, 257})


def test_every_kernel_is_listed(harness):
    expected = {f"ddl_{kind}_{op}_{K.SUFFIX[dt]}" for kind in KINDS for op in K.OPS for dt in K.DTYPES}
    assert set(harness.reduce_kernels()) == expected


@pytest.mark.parametrize("op", K.OPS)
@pytest.mark.parametrize("dtype", K.DTYPES, ids=lambda d: K.SUFFIX[d])
@pytest.mark.parametrize("kind", KINDS)
def test_reduce_matches_numpy(harness, kind, dtype, op):
    name = f"ddl_{kind}_{op}_{K.SUFFIX[dtype]}"
    v = 16 // dtype.itemsize
    for n in lengths(dtype):
        for p in (3, 7):
            a0, b0 = K.make_pair(dtype, n, seed=n + p, op=op)
            ref = K.reference(op, a0, b0, p)
            arg = K.kernel_arg(dtype, op, p)
            # (dst offset, a offset, b offset) in elements: vector path with no
            # head, vector path with a scalar head, and mixed alignment (all scalar)
            for offs in ((0, 0, 0), (1, 1, 1), (v - 1, v - 1, v - 1), (1, 1, 0), (0, 0, 1)):
                for grid, block, rev in LAUNCHES:
                    wd, d = aligned(n, dtype, offs[0])
                    _, a = aligned(n, dtype, offs[1])
                    _, b = aligned(n, dtype, offs[2])
                    a[:], b[:] = a0, b0
                    before = K.bits_view(wd).copy()
                    harness.reduce(name, d, a, b, arg, grid, block, rev)
                    ok, err, bad = K.compare(d, ref, op)
                    assert ok, f"{name} n={n} offs={offs} launch={grid}x{block}: first mismatch at {bad}: {d[bad]!r} vs {ref[bad]!r}"
                    gb = K.bits_view(wd)
                    assert (gb[:GUARD] == before[:GUARD]).all() and (gb[GUARD + n:] == before[GUARD + n:]).all(), "write outside [0, n)"
                    assert (K.bits_view(a) == K.bits_view(a0)).all() and (K.bits_view(b) == K.bits_view(b0)).all(), "input modified"


@pytest.mark.parametrize("op", K.OPS)
@pytest.mark.parametrize("dtype", K.DTYPES, ids=lambda d: K.SUFFIX[d])
@pytest.mark.parametrize("kind", KINDS)
def test_reduce_in_place_two_operand(harness, kind, dtype, op):
    """dst = op(dst, src): the kernel called with a == dst."""
    name = f"ddl_{kind}_{op}_{K.SUFFIX[dtype]}"
    for n in (0, 1, 67, 257, 3001):  # 3001: several vector words on every thread, then the rest
        for off in (0, 1):
            a0, b0 = K.make_pair(dtype, n, seed=11, op=op)
            ref = a0.copy()
            with np.errstate(all="ignore"):
                if op == "avg":
                    K.NumpyBackend().reduce("sum", ref, b0, avg_p=5)
                else:
                    K.NumpyBackend().reduce(op, ref, b0)
            _, d = aligned(n, dtype, off)
            _, b = aligned(n, dtype, off)
            d[:], b[:] = a0, b0
            harness.reduce(name, d, d, b, K.kernel_arg(dtype, op, 5), 2, 32, True)
            ok, _, bad = K.compare(d, ref, op)
            assert ok, f"{name} in place n={n} off={off}: first mismatch at {bad}"


@pytest.mark.parametrize("op", K.OPS)
@pytest.mark.parametrize("dtype", K.DTYPES, ids=lambda d: K.SUFFIX[d])
@pytest.mark.parametrize("kind", KINDS)
def test_reduce_grid_stride_rounds(harness, kind, dtype, op):
    """Lengths where every thread of a multi-block grid runs several rounds of the grid-stride vector loop,
    some threads one more than others: out of place, aligned and with a head."""
    name = f"ddl_{kind}_{op}_{K.SUFFIX[dtype]}"
    v = 16 // dtype.itemsize
    for grid, block, rev in ((2, 32, True), (3, 16, False)):
        stride = grid * block
        for n in (4 * stride * v, 4 * stride * v + 3 * stride * v + v - 1, 13 * stride * v + 5):
            a0, b0 = K.make_pair(dtype, n, seed=n, op=op)
            ref = K.reference(op, a0, b0, 3)
            for off in (0, 1):
                wd, d = aligned(n, dtype, off)
                _, a = aligned(n, dtype, off)
                _, b = aligned(n, dtype, off)
                a[:], b[:] = a0, b0
                before = K.bits_view(wd).copy()
                harness.reduce(name, d, a, b, K.kernel_arg(dtype, op, 3), grid, block, rev)
                ok, _, bad = K.compare(d, ref, op)
                assert ok, f"{name} n={n} off={off} launch={grid}x{block}: first mismatch at {bad}"
                gb = K.bits_view(wd)
                assert (gb[:GUARD] == before[:GUARD]).all() and (gb[GUARD + n:] == before[GUARD + n:]).all()


@pytest.mark.parametrize("dtype", K.DTYPES, ids=lambda d: K.SUFFIX[d])
@pytest.mark.parametrize("kind", KINDS)
def test_reduce_every_offset_of_dst_a_and_b(harness, kind, dtype):
    """Every (dst, a, b) offset modulo 16 bytes, lengths up to a few words (ddl_realign: each operand word cut
    from the two aligned words it straddles; ddl_reduce: 128-bit words only where all three agree), against
    numpy, dst's guards intact, and no load outside the three arrays, which the harness counts (on a GPU the
    bytes past an operand are a neighbour's, or past an allocation's end fault)."""
    v = 16 // dtype.itemsize
    for op, lengths in (("sum", range(0, 3 * v + 2)), ("max", (1, v + 1, 3 * v + 2, 67))):
        name = f"ddl_{kind}_{op}_{K.SUFFIX[dtype]}"
        for n in lengths:
            a0, b0 = K.make_pair(dtype, n, seed=n, op=op)
            ref = K.reference(op, a0, b0, 3)
            for od in range(v):
                for oa in range(v):
                    for ob in range(v):
                        wd, d = aligned(n, dtype, od)
                        _, a = aligned(n, dtype, oa)
                        _, b = aligned(n, dtype, ob)
                        a[:], b[:] = a0, b0
                        before = K.bits_view(wd).copy()
                        grid, block, rev = LAUNCHES[(od + oa + ob + n) % 3]
                        stray = harness.reads_outside((d, a, b), lambda: harness.reduce(
                            name, d, a, b, K.kernel_arg(dtype, op, 3), grid, block, rev))
                        assert stray == 0, f"{name} n={n} offs={(od, oa, ob)}: {stray} loads outside the operands"
                        ok, _, bad = K.compare(d, ref, op)
                        assert ok, f"{name} n={n} offs={(od, oa, ob)}: first mismatch at {bad}"
                        gb = K.bits_view(wd)
                        assert (gb[:GUARD] == before[:GUARD]).all() and (gb[GUARD + n:] == before[GUARD + n:]).all()


def fold_case(dtype, op, n, k):
    """k operands of n elements and what ddl_fold must give: the numpy backend's chain of k - 1 two-operand
    reductions ("avg": sums, scaled by 1/k in the last step)."""
    ops = [K.make_pair(dtype, n, seed=7 * n + j, op=op)[j % 2] for j in range(k)]
    return ops, K.chain(op, ops)


def test_every_fold_kernel_is_listed(harness):
    assert set(harness.fold_kernels()) == {f"ddl_{kind}_{op}_{K.SUFFIX[dt]}" for kind in FOLDS for op in K.OPS
                                           for dt in K.DTYPES}


@pytest.mark.parametrize("kind", FOLDS)
@pytest.mark.parametrize("op", K.OPS)
@pytest.mark.parametrize("dtype", K.DTYPES, ids=lambda d: K.SUFFIX[d])
def test_fold_is_the_chain_of_two_operand_reductions(harness, dtype, op, kind):
    """ddl_fold and ddl_fold_realign: the bits of k - 1 two-operand reductions in a row ("avg" scaling in the
    last only), for k = 2, 3, 5 and 8 operands, on the vector path (with and without a scalar head), mixed
    alignments (ddl_fold: all scalar; ddl_fold_realign: realigned words), every launch shape, dst as its own
    first operand (a fold continued), nothing written outside [0, n)."""
    name = f"ddl_{kind}_{op}_{K.SUFFIX[dtype]}"
    v = 16 // dtype.itemsize
    for n in (0, 1, v + 1, 67, 257):
        for k in (2, 3, 5, 8):
            ops, ref = fold_case(dtype, op, n, k)
            arg = K.kernel_arg(dtype, op, k)
            # all alike; operands elsewhere than dst, each at its own offset
            for offs in ((0,) * (k + 1), (1,) * (k + 1), (v - 1,) * (k + 1), (1,) * k + (0,),
                         (v - 1,) + tuple(j % v for j in range(k))):
                for grid, block, rev in LAUNCHES:
                    wd, d = aligned(n, dtype, offs[0])
                    srcs = []
                    for j in range(k):
                        _, s = aligned(n, dtype, offs[j + 1])
                        s[:] = ops[j]
                        srcs.append(s)
                    # extra destinations: none, one, 7 (the most), at dst's offset; ddl_fold's 7th one element
                    # off, which leaves the vector path for the scalar one (cuda_host.h stops on a misaligned
                    # 128-bit access, as a GPU faults; ddl_fold_realign requires them all at dst's offset)
                    m = (0, 1, 7)[(k + n) % 3]
                    off = m == 7 and kind == "fold"
                    extras = [aligned(n, dtype, offs[0] + (off and j == 6)) for j in range(m)]
                    before = [K.bits_view(w).copy() for w in [wd] + [w for w, _ in extras]]
                    harness.fold(name, d, srcs, arg, grid, block, rev, also=[e for _, e in extras])
                    for w, got, b in zip([wd] + [w for w, _ in extras], [d] + [e for _, e in extras], before):
                        ok, _, bad = K.compare(got, ref, op)
                        assert ok, f"{name} k={k} m={m} n={n} offs={offs} launch={grid}x{block}: mismatch at {bad}"
                        gb = K.bits_view(w)
                        assert (gb[:GUARD] == b[:GUARD]).all() and (gb[GUARD + n:] == b[GUARD + n:]).all()
                    assert all((K.bits_view(s) == K.bits_view(o)).all() for s, o in zip(srcs, ops)), "input modified"
            # dst as the first operand: a fold continued from a partial result.
            _, d = aligned(n, dtype, 1)
            d[:] = ops[0]
            rest = []
            for j in range(1, k):
                _, s = aligned(n, dtype, 1)
                s[:] = ops[j]
                rest.append(s)
            harness.fold(name, d, [d] + rest, arg, 2, 32, True)
            ok, _, bad = K.compare(d, ref, op)
            assert ok, f"{name} k={k} n={n} in place: first mismatch at {bad}"


@pytest.mark.parametrize("kind", FOLDS)
@pytest.mark.parametrize("dtype", K.DTYPES, ids=lambda d: K.SUFFIX[d])
def test_fold_operands_at_any_offset(harness, dtype, kind):
    """2 and 3 operands at every offset against dst's (and an extra destination's, at dst's), every length
    around a few words: the chain's bits on the vector path (all alike) and, operands elsewhere, on ddl_fold's
    element path and ddl_fold_realign's realigned words, and no load outside the arrays (a realigned word
    reads two aligned ones)."""
    v = 16 // dtype.itemsize
    name = f"ddl_{kind}_sum_{K.SUFFIX[dtype]}"
    for n in range(0, 3 * v + 2):
        for k in (2, 3):
            ops, ref = fold_case(dtype, "sum", n, k)
            for od in range(v):
                for o1 in range(v):
                    for o2 in range(v):
                        offs = (o1, o2, (o1 + 2 * o2 + od) % v)[:k]
                        srcs = []
                        for j in range(k):
                            _, x = aligned(n, dtype, offs[j])
                            x[:] = ops[j]
                            srcs.append(x)
                        _, d = aligned(n, dtype, od)
                        also = [aligned(n, dtype, od)[1]] if (o1 + o2) % 2 else []
                        stray = harness.reads_outside([d, *srcs, *also], lambda: harness.fold(
                            name, d, srcs, K.kernel_arg(dtype, "sum", k), 3, 32, n % 2 == 1, also=also))
                        assert stray == 0, f"{name} k={k} n={n} dst at {od}, operands at {offs}: {stray} stray loads"
                        for got in [d, *also]:
                            assert K.compare(got, ref, "sum")[0], f"{name} k={k} n={n} dst at {od}, operands at {offs}"


class _FoldingBackend:
    """What ``DeviceBackend.reduce_many`` asks of a device backend, with the fold kernels run by the host
    harness on numpy arrays (the CuPy backend launches the same kernels on a GPU)."""

    def __init__(self, harness):
        self.h, self.launches, self.copies = harness, [], 0

    def _launch_fold(self, name, dst, srcs, n, arg, also=()):
        self.launches.append((name, len(srcs), len(also)))
        self.h.fold(name, dst, srcs, float(arg), also=also)

    def copy(self, dst, src):
        self.copies += 1
        dst[...] = src

    def empty(self, n, dtype):
        return np.empty(n, dtype)

    def reduce_many(self, *args, **kwargs):  # the scratch path calls itself
        from ddlkernels.backends._device import DeviceBackend

        return DeviceBackend.reduce_many(self, *args, **kwargs)

    def _ptr(self, x):
        return x.ctypes.data

    def _span(self, x):
        return x.ctypes.data, x.ctypes.data + x.nbytes


@pytest.mark.parametrize("op", K.OPS)
@pytest.mark.parametrize("dtype", K.DTYPES, ids=lambda d: K.SUFFIX[d])
def test_reduce_many_launches_folds_of_8_with_the_chains_bits(harness, dtype, op):
    """``DeviceBackend.reduce_many`` over 2 to 17 operands: groups of up to 8, each after the first folding
    onto the partial result, "avg" scaling only in the last launch: the bits of the pairwise chain."""
    from ddlkernels.backends._device import DeviceBackend

    for k in (2, 8, 9, 15, 17):
        n = 37
        ops = [K.make_pair(dtype, n, seed=k + j, op=op)[j % 2] for j in range(k)]
        ref = K.chain(op, ops)
        want, left = [min(k, 8)], k - min(k, 8)  # launches: 8 operands, then the partial result and 7 more
        while left:
            want.append(1 + min(7, left))
            left -= min(7, left)
        store = (lambda a: a.view(np.uint16)) if dtype == K.BFLOAT16 else (lambda a: a)
        for m in (0, 3, 9):  # extra destinations: the last launch writes up to 7, copies the rest
            be = _FoldingBackend(harness)
            dst = np.empty_like(ops[0])
            also = [np.empty_like(ops[0]) for _ in range(m)]
            DeviceBackend.reduce_many(be, "sum" if op == "avg" else op, store(dst), [store(o) for o in ops],
                                      avg_p=k if op == "avg" else None, also=[store(e) for e in also])
            for got in [dst] + also:
                ok, _, bad = K.compare(got, ref, op)
                assert ok, f"{op} {K.SUFFIX[dtype]} k={k} m={m}: first mismatch at {bad}"
            assert [c for _, c, _ in be.launches] == want
            assert [e for _, _, e in be.launches] == [0] * (len(want) - 1) + [min(m, 7)]
            assert be.copies == max(0, m - 7)
            assert all(("avg" in name) == (op == "avg" and i == len(be.launches) - 1) for i, (name, _, _) in
                       enumerate(be.launches))


@pytest.mark.parametrize("dtype", K.DTYPES, ids=lambda d: K.SUFFIX[d])
def test_reduce_many_takes_the_realigning_fold_for_operands_off_the_outputs_offset(harness, dtype):
    """Operands one element in (a view's shards) folded into outputs at another offset: ddl_fold_realign, in
    every launch of a fold past 8 operands; ddl_fold where every operand shares dst's offset, and where an
    output of the launch does not (its element path); the chain's bits in every output."""
    from ddlkernels.backends._device import DeviceBackend

    v = 16 // dtype.itemsize
    n = 4 * v + 3
    store = (lambda a: a.view(np.uint16)) if dtype == K.BFLOAT16 else (lambda a: a)
    for k, src_at, out_at, m, want in ((2, 1, 0, 1, ["fold_realign"]), (3, 0, 0, 2, ["fold"]),
                                       (3, 1, 1, 2, ["fold"]), (11, 1, 0, 3, ["fold_realign"] * 2),
                                       (4, (0, 1), 0, 0, ["fold_realign"])):
        ops = [K.make_pair(dtype, n, seed=3 * k + j)[j % 2] for j in range(k)]
        srcs = []
        for j in range(k):
            _, x = aligned(n, dtype, src_at[j % 2] if isinstance(src_at, tuple) else src_at)
            x[:] = ops[j]
            srcs.append(x)
        dst = aligned(n, dtype, out_at)[1]
        also = [aligned(n, dtype, out_at + (want == ["fold"] and src_at == 0 and j == m - 1))[1] for j in range(m)]
        be = _FoldingBackend(harness)
        DeviceBackend.reduce_many(be, "sum", store(dst), [store(x) for x in srcs], also=[store(e) for e in also])
        assert [name.split("_sum_")[0][4:] for name, _, _ in be.launches] == want, (k, src_at, out_at, m)
        for got in [dst, *also]:
            assert K.compare(got, K.chain("sum", ops), "sum")[0], (k, src_at, out_at, m)


@pytest.mark.parametrize("op", K.OPS)
@pytest.mark.parametrize("dtype", K.DTYPES, ids=lambda d: K.SUFFIX[d])
def test_fold_into_the_buffers_it_reads(harness, dtype, op):
    """The in-place IPC allreduce: the fold's dst is one operand and its extra destinations are the others
    (each element read before it is written): the chain's bits in all of them, through one launch of the
    kernel (up to 8 operands), launches in groups of 8 where dst is among the first 8 operands, or, where the
    first launch would overwrite dst before a later one reads it, through a scratch buffer
    (``DeviceBackend.reduce_many``)."""
    from ddlkernels.backends._device import DeviceBackend

    store = (lambda a: a.view(np.uint16)) if dtype == K.BFLOAT16 else (lambda a: a)
    for k, me in ((2, 1), (3, 0), (5, 2), (8, 7), (11, 4), (11, 9), (17, 0), (17, 16)):
        for n in (37, 4 * 64 * (16 // dtype.itemsize) + 5):
            ops, ref = fold_case(dtype, op, n, k)
            bufs = [aligned(n, dtype, 1)[1] for _ in range(k)]
            for b, o in zip(bufs, ops):
                b[:] = o
            be = _FoldingBackend(harness)
            DeviceBackend.reduce_many(be, "sum" if op == "avg" else op, store(bufs[me]), [store(b) for b in bufs],
                                      avg_p=k if op == "avg" else None,
                                      also=[store(b) for j, b in enumerate(bufs) if j != me])
            for j, b in enumerate(bufs):
                ok, _, bad = K.compare(b, ref, op)
                assert ok, f"{op} {K.SUFFIX[dtype]} k={k} n={n}: buffer {j} first mismatch at {bad}"
            # Past 8 operands, dst among the first 8 is folded in place, the partial result carried on and the
            # buffers of also= past 7 copied; dst past them is folded into a scratch buffer and copied to all k.
            launches = 1 + -(-(k - 8) // 7)
            want = (1, 0) if k <= 8 else (launches, k - 8) if me < 8 else (launches, k)
            assert (len(be.launches), be.copies) == want, (be.launches, be.copies)


def _tensors(rng_seed):
    """Byte arrays of awkward lengths at awkward offsets (all alignments mod 16)."""
    lens = [0, 1, 3, 16, 17, 31, 64, 100, 255, 1000, 7, 2]
    out = []
    for k, n in enumerate(lens):
        raw = np.empty(n + 32, np.uint8)
        off = (-raw.ctypes.data) % 16 + (k * 5) % 16
        t = raw[off:off + n]
        t[:] = (np.arange(n) * 31 + k * 7 + rng_seed) % 251
        out.append(t)
    return out


def packed_layout(tensors, pad, start):
    """Offsets of ``tensors`` packed from byte ``start`` at ``pad``-byte boundaries, and a zeroed buffer (16-byte
    aligned) that holds them."""
    offsets, pos = [], start
    for t in tensors:
        pos = -(-pos // pad) * pad
        offsets.append(pos)
        pos += t.size
    raw = np.zeros(pos + 64, np.uint8)
    return offsets, raw[(-raw.ctypes.data) % 16:][:pos]


@pytest.mark.parametrize("pad", [1, 4, 16], ids=["dense", "align4", "align16"])
@pytest.mark.parametrize("grid,block,rev", [((1, 1), 1, False), ((2, 3), 32, True), ((3, 16), 64, False)])
def test_pack_unpack(harness, pad, grid, block, rev):
    tensors = _tensors(pad)
    offsets, buf = packed_layout(tensors, pad, 3 if pad == 1 else 0)  # dense packing also starts off-boundary
    pos = buf.size
    table = np.array([[t.ctypes.data, t.size, o] for t, o in zip(tensors, offsets)], dtype=np.uint64)
    harness.pack(table, buf, grid, block, rev)
    expect = np.zeros(pos, np.uint8)
    for t, o in zip(tensors, offsets):
        expect[o:o + t.size] = t
    assert (buf == expect).all()
    # unpack into fresh destinations whose surroundings hold a sentinel
    dests = _tensors(99)
    for d in dests:
        d.base[:] = 0xEE
        d[:] = 0
    table = np.array([[d.ctypes.data, d.size, o] for d, o in zip(dests, offsets)], dtype=np.uint64)
    harness.unpack(table, buf, grid, block, rev)
    for t, d in zip(tensors, dests):
        assert (d == t).all()
        start = d.ctypes.data - d.base.ctypes.data
        assert (d.base[:start] == 0xEE).all() and (d.base[start + d.size:] == 0xEE).all(), "write outside a tensor"


def test_pack_pieces_rows():
    """Every tensor is covered once, in order, by rows of at most ``piece`` bytes that keep its alignment."""
    rng = np.random.default_rng(5)
    sizes = [0, 1, 15, 16, 17, 47, 48, 49, 96, 1000, 0, 3]
    ptrs = [int(x) for x in rng.integers(1 << 20, 1 << 40, len(sizes))]
    offs = [int(x) for x in rng.integers(0, 1 << 20, len(sizes))]
    rows = pack_pieces(ptrs, sizes, offs, piece=48).view(np.int64)
    k = 0
    for p, n, o in zip(ptrs, sizes, offs):
        done = 0
        while done < n:
            assert tuple(rows[k]) == (p + done, min(48, n - done), o + done)
            done, k = done + 48, k + 1
    assert k == rows.shape[0]
    assert pack_pieces([], [], []).shape == (0, 3)
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_pieces(ptrs, sizes, offs, piece=40)


@pytest.mark.parametrize("piece", [16, 48, 1 << 16])
@pytest.mark.parametrize("grid", [(1, 1), (1, 5), (1, 4096)])
def test_pack_unpack_pieces(harness, piece, grid):
    """The backend's launch: the tensors cut into pieces (one block per row), each tensor longer than a piece
    and at every alignment, dense and 16-byte aligned packing."""
    tensors = _tensors(piece) + [_tensors(7)[9]]  # 1000 bytes: 63 pieces of 16 bytes
    for pad in (1, 16):
        offsets, buf = packed_layout(tensors, pad, 5)
        table = pack_pieces([t.ctypes.data for t in tensors], [t.size for t in tensors], offsets, piece)
        harness.pack(table, buf, grid, 64, grid[1] == 5)
        for t, o in zip(tensors, offsets):
            assert (buf[o:o + t.size] == t).all()
        dests = _tensors(99) + [_tensors(98)[9]]
        for d in dests:
            d.base[:] = 0xEE
        table = pack_pieces([d.ctypes.data for d in dests], [d.size for d in dests], offsets, piece)
        harness.unpack(table, buf, grid, 64, False)
        for t, d in zip(tensors, dests):
            assert (d == t).all()
            start = d.ctypes.data - d.base.ctypes.data
            assert (d.base[:start] == 0xEE).all() and (d.base[start + d.size:] == 0xEE).all()
