"""Every kernel compiled for real GPU targets, without a GPU.

* kernels/*.cu with NVRTC (cuda.bindings.nvrtc) and with the machine's nvcc,
  each file on its own, for the oldest architecture each compiler still
  knows (CUDA 12: sm_70; CUDA 13: sm_75), sm_80 and sm_90 -- asked of the
  compilers (``nvrtcGetSupportedArchs``, ``nvcc --list-gpu-arch``), so CUDA 12
  and 13 toolchains both pass; ``ptxas -v`` must report no spills and no
  stack frame, every kernel of the file must be there, and the reduce and
  pack kernels must move their bulk with 128-bit global loads and stores
  (the float32 reduce: ``ld.global.v4`` / ``ld.global.nc.v4``; every reduce's
  realigned path: ``ld.global.ca.v4`` and funnel shifts; the realigning fold's: ``ld.global.nc.v4``
  and funnel shifts), and the f16 / bf16 sums must add two lanes an instruction.
* every Numba kernel with ``numba.cuda.compile_ptx`` for sm_70/80/90, then
  ptxas (pip CUDA 12.9) for registers and spills.
"""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _compile_tools as C  # noqa: E402
import _kernel_ref as K  # noqa: E402

from ddlkernels.kernels import numba_cuda as N  # noqa: E402
from ddlkernels.kernels.sources import KINDS, SOURCES, kernel_dir, unit_of, units  # noqa: E402

REDUCE = {f"ddl_{kind}_{op}_{K.SUFFIX[dt]}" for kind in ("reduce", "realign", "fold", "fold_realign")
          for op in K.OPS for dt in K.DTYPES}
EXPECTED = {"reduce.cu": REDUCE, "pack.cu": {"ddl_pack", "ddl_unpack"}}
ROOT = Path(__file__).resolve().parent.parent


def _nvrtc_available():
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        return False
    return True


needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(), reason="cuda-python (cuda.bindings.nvrtc) is not installed")
needs_nvcc = pytest.mark.skipif(C.nvcc_path() is None, reason="nvcc is not on PATH")
needs_ptxas = pytest.mark.skipif(C.ptxas_path() is None, reason="ptxas (nvidia-cuda-nvcc-cu12) is not installed")


#: (source, arch) -> the nvcc compile of ``source`` for sm_``arch``, under way (``nvcc_ahead``)
_NVCC: dict = {}


@pytest.fixture(scope="module", autouse=True)
def nvcc_ahead():
    """Every nvcc compile the tests below read, started in one background thread when the module's first test
    runs: nvcc is a process of its own, so it compiles on the other core while NVRTC's tests run here."""
    if C.nvcc_path() is None:
        yield
        return
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    wanted = sorted(((s, a) for s in SOURCES for a in C.NVCC_ARCHS), key=lambda k: k != ("reduce.cu", 90))
    _NVCC.update({k: pool.submit(C.nvcc, *k, True) for k in wanted})  # first the one three tests read
    try:
        yield
    finally:
        _NVCC.clear()
        pool.shutdown(cancel_futures=True)  # a run of some tests only: the compiles none of them read


def _nvcc(source, arch):
    """The nvcc compile of ``source`` for sm_``arch``: ok, its ptxas report and its PTX (tests share it)."""
    ahead = _NVCC.get((source, arch))
    return ahead.result() if ahead is not None else C.nvcc(source, arch, ptx=True)


def _check_ptxas(log, source, target):
    info = C.parse_ptxas(log)
    assert set(info) == EXPECTED[source], f"{source} {target}: kernels seen by ptxas: {sorted(info)}"
    for name, i in info.items():
        assert i["spill_stores"] == 0 and i["spill_loads"] == 0, f"{name} spills on {target}: {i}"
        assert i["stack"] == 0, f"{name} has a stack frame on {target}: {i}"
        assert 0 < i["regs"] <= 64, f"{name} uses {i['regs']} registers on {target}"


@needs_nvrtc
@pytest.mark.parametrize("arch", C.NVRTC_ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_nvrtc(source, arch):
    ok, log, cubin, ptx = C.nvrtc(source, f"sm_{arch}", ptx=True)
    assert ok, log
    assert cubin[:4] == b"\x7fELF", "NVRTC did not return a cubin"
    _check_ptxas(log, source, f"sm_{arch} (NVRTC)")
    entries = C.ptx_entries(ptx.decode())
    assert set(entries) == EXPECTED[source]
    unvectorized = [n for n, body in entries.items() if not C.vectorized(body)]
    assert not unvectorized, f"no 128-bit global load+store in {unvectorized} (compute_{arch})"


@needs_nvcc
@pytest.mark.parametrize("arch", C.NVCC_ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_nvcc(source, arch):
    ok, log, ptx = _nvcc(source, arch)
    assert ok, log
    _check_ptxas(log, source, f"sm_{arch} (nvcc)")
    entries = C.ptx_entries(ptx)
    assert set(entries) == EXPECTED[source]
    assert all(C.vectorized(b) for b in entries.values())


@needs_nvcc
@pytest.mark.parametrize("source", SOURCES)
def test_each_cu_compiles_on_its_own(source, tmp_path):
    """The exact command of the kernel headers, from the checkout root."""
    rel = (kernel_dir() / source).relative_to(ROOT) if kernel_dir().is_relative_to(ROOT) else kernel_dir() / source
    res = subprocess.run([C.nvcc_path(), "-std=c++17", "-arch=sm_90", "-cubin", str(rel), "-o", str(tmp_path / "k.cubin")],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "k.cubin").stat().st_size > 0


@needs_nvcc
def test_f32_reduce_uses_128_bit_loads():
    ok, log, ptx = _nvcc("reduce.cu", 90)
    assert ok, log
    body = C.ptx_entries(ptx)["ddl_reduce_sum_f32"]
    assert "ld.global.v4.f32" in body or "ld.global.nc.v4" in body
    assert "ld.global.nc.v4" in body, "the read-only operand should go through the non-coherent cache"
    assert "st.global.v4" in body


@needs_nvcc
@pytest.mark.parametrize("realigning, plain, load", [("realign", "reduce", "ld.global.ca.v4"),
                                                     ("fold_realign", "fold", "ld.global.nc.v4")])
def test_every_realigning_kernel_moves_128_bit_words_and_its_plain_twin_does_not_realign(realigning, plain, load):
    """ddl_realign (an operand at another offset modulo 16 than dst) and ddl_fold_realign (operands at other
    offsets than the outputs) move 128-bit words: each realigned operand's aligned 128-bit loads (ddl_realign:
    cache-all loads of a, ``__ldca``; ddl_fold_realign: the non-coherent cache), funnel shifts of each word's
    two halves, 128-bit stores.  ddl_reduce and ddl_fold have none of that path, whose registers they would
    carry on every call."""
    ok, log, ptx = _nvcc("reduce.cu", 90)
    assert ok, log
    entries = C.ptx_entries(ptx)
    for op in K.OPS:
        for dt in K.DTYPES:
            name = f"{op}_{K.SUFFIX[dt]}"
            body = entries[f"ddl_{realigning}_{name}"]
            assert load in body and "shf.r" in body and C.vectorized(body), f"ddl_{realigning}_{name}"
            assert "shf.r" not in entries[f"ddl_{plain}_{name}"], f"ddl_{plain}_{name}"


def test_each_reduce_kernel_names_the_compile_of_its_kind():
    assert unit_of("reduce.cu", "ddl_fold_realign_avg_bf16") == ("DDL_KINDS=8",)
    assert [unit_of("reduce.cu", f"ddl_{k}_sum_f32") for k in KINDS] == units("reduce.cu")
    assert unit_of("pack.cu", "ddl_pack") == () and units("pack.cu") == [()]
    for bad in ("ddl_refold_sum_f32", "reduce_sum_f32", "ddl_pack"):
        with pytest.raises(ValueError, match="reduce.cu defines no kernel"):
            unit_of("reduce.cu", bad)


@needs_nvrtc
def test_each_kind_of_reduce_kernel_compiles_alone():
    """Each unit the backend compiles on first need (``DDL_KINDS``, one bit per kind) defines that kind's kernels,
    every op and dtype, and nothing else; the four together are the whole file's."""
    whole = set()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = {unit: pool.submit(C.nvrtc, "reduce.cu", "compute_90", False, unit) for unit in units("reduce.cu")}
    for (kind, unit) in zip(KINDS, done):
        ok, log, ptx = done[unit].result()
        assert ok, log
        names = set(C.ptx_entries(ptx.decode()))
        assert names == {f"ddl_{kind}_{op}_{K.SUFFIX[dt]}" for op in K.OPS for dt in K.DTYPES}, (kind, unit)
        whole |= names
    assert whole == REDUCE


@needs_nvcc
@pytest.mark.parametrize("arch, f16, bf16", [(80, "add.rn.f16x2", "fma.rn.bf16x2"),
                                             (90, "add.rn.f16x2", "add.rn.bf16x2")])
def test_the_half_sums_add_two_lanes_an_instruction(arch, f16, bf16):
    """The sum of f16 and bf16 words adds pairs of lanes (``__hadd2_rn``: add.rn.f16x2; bf16 add.rn.bf16x2 from
    sm_90 on, an fma by 1 before), in every kind of kernel, where widening to float took 2 conversions an
    element; avg, whose scale multiplies the float sum, and the other ops stay widened."""
    ok, log, ptx = _nvcc("reduce.cu", arch)
    assert ok, log
    entries = C.ptx_entries(ptx)
    for kind in ("reduce", "realign", "fold", "fold_realign"):
        for suf, paired in (("f16", f16), ("bf16", bf16)):
            assert paired in entries[f"ddl_{kind}_sum_{suf}"], f"ddl_{kind}_sum_{suf}"
            for op in ("prod", "max", "min"):
                assert paired not in entries[f"ddl_{kind}_{op}_{suf}"], f"ddl_{kind}_{op}_{suf}"
    # avg's pairwise kernels widen; its folds add pairs in every step but the last, which scales.
    assert f16 not in entries["ddl_reduce_avg_f16"] and f16 in entries["ddl_fold_avg_f16"]


@needs_nvcc
def test_the_half_sums_widen_where_a_study_asks(tmp_path):
    """Compiled with DDL_WIDEN_HALF_SUMS (bench/studies/half_sums.py's other variant) no kernel adds pairs: the
    sums widen to float, 128-bit words still."""
    res = subprocess.run([C.nvcc_path(), "-std=c++17", "-arch=sm_90", "-ptx", "-DDDL_WIDEN_HALF_SUMS",
                          str(kernel_dir() / "reduce.cu"), "-o", str(tmp_path / "w.ptx")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    entries = C.ptx_entries((tmp_path / "w.ptx").read_text())
    for kind in ("reduce", "realign", "fold", "fold_realign"):
        for suf in ("f16", "bf16"):
            body = entries[f"ddl_{kind}_sum_{suf}"]
            assert "add.rn.f16x2" not in body and "add.rn.bf16x2" not in body and "add.f32" in body, kind + suf
            assert C.vectorized(body), f"ddl_{kind}_sum_{suf}"


@needs_ptxas
@pytest.mark.parametrize("suf", N.SUFFIXES)
@pytest.mark.parametrize("op", N.OPS)
def test_numba_reduce_compiles(op, suf):
    for cc in C.NUMBA_ARCHS:
        ptx, entry = C.numba_ptx(N.reduce_kernel(op, suf, python=True), N.kernel_signature(suf), cc)
        assert f"ddl_reduce_{op}_{suf}" in entry
        assert f".target sm_{cc}" in ptx
        ok, log = C.ptxas(ptx, cc)
        assert ok, log
        (info,) = C.parse_ptxas(log).values()
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, f"sm_{cc}: {info}"


@needs_ptxas
@pytest.mark.parametrize("word", N.WORDS)
@pytest.mark.parametrize("which", ["pack", "unpack"])
def test_numba_pack_compiles(which, word):
    """Every word size, every target: ptxas accepts it, no spills, and each word moves in one access of its
    width (the intrinsics' load or store at an address)."""
    fn = N.pack_kernel(word, python=True) if which == "pack" else N.unpack_kernel(word, python=True)
    width = {1: "u8", 2: "u16", 4: "u32", 8: "u64"}[word]
    for cc in C.NUMBA_ARCHS:
        ptx, entry = C.numba_ptx(fn, N.pack_signature(word), cc)
        assert f"ddl_{which}_w{8 * word}" in entry
        assert re.search(rf"\b(ld|st)(\.global)?\.{width}\b", ptx), f"no {width} access"
        ok, log = C.ptxas(ptx, cc)
        assert ok, log
        (info,) = C.parse_ptxas(log).values()
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0

def test_ptx_instructions_counts_statements_only():
    """kernel_report's PTX column: statements, not directives, labels, comments or inline asm's braces; and an
    entry runs to the next one, past inline asm's own closing braces."""
    ptx = (".visible .entry k1(\n\t.param .u64 p\n)\n{\n\t.reg .b32 %r<4>;\n\tld.param.u64 %rd1, [p];\n"
           "$L__BB0_1:\n\t// begin inline asm\n\t{add.rn.f16x2 %r1,%r2,%r3;\n}\n\t// end inline asm\n"
           "\t@%p1 bra $L__BB0_1;\n\tret;\n\n}\n\t// .globl k2\n.visible .entry k2(\n)\n{\n\tret;\n}\n")
    entries = C.ptx_entries(ptx)
    assert sorted(entries) == ["k1", "k2"] and "add.rn.f16x2" in entries["k1"]
    assert C.ptx_instructions(entries["k1"]) == 4 and C.ptx_instructions(entries["k2"]) == 1
