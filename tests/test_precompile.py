"""``python -m ddlkernels compile`` (ddlkernels.kernels.precompile): its table, its arguments and the CUDA kernels'
images.  That its table is what the window's calls compile is checked under MPI (tests/mpi/test_shm.py);
run_suite.py runs it whole."""

import os
import subprocess
import sys

import pytest

from ddlkernels.kernels import precompile, window_loops


def test_the_table_has_one_signature_per_dtype_for_each_dtype_loop_and_one_for_the_others():
    one, two = precompile.signatures(("float32",)), precompile.signatures(("float32", "int64"))
    assert one.keys() == two.keys()
    window = [fn for fn in one if fn.py_func.__module__ == window_loops.__name__]
    assert len(window) == 14  # small_fold, pieces_allreduce, pieces_reduce_scatter x 4 ops; 2 allgathers
    for fn in window:
        assert len(one[fn]) == 1 and len(two[fn]) == 2, fn
        assert sorted(str(s[0].dtype) for s in two[fn]) == ["float32", "int64"], fn
    # The host loop is compiled for the dtypes it serves only (float and int of 4 or 8 bytes).
    host = [fn for fn in precompile.signatures(("uint8", "float64")) if fn.py_func.__name__ == "reduce_sum"]
    assert [str(s[0].dtype) for s in precompile.signatures(("uint8", "float64"))[host[0]]] == ["float64"]


def test_a_bad_dtype_name_is_refused_before_anything_compiles():
    res = subprocess.run([sys.executable, "-m", "ddlkernels", "compile", "--dtypes", "float32,nosuch"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "'nosuch' is not a numpy dtype name" in res.stderr
    assert "signature" not in res.stdout  # nothing compiled first


def test_a_bad_cuda_argument_is_refused_before_anything_compiles():
    res = subprocess.run([sys.executable, "-m", "ddlkernels", "compile", "--cuda", "sm_90"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "--cuda takes auto, none or compute capabilities such as 80,90, got 'sm_90'" in res.stderr
    assert "signature" not in res.stdout


def test_cuda_archs_spelled_as_compute_capabilities_or_auto_or_none(monkeypatch):
    assert precompile.cuda_archs("90, 80,90") == (80, 90) and precompile.cuda_archs("none") == ()
    monkeypatch.setattr(precompile, "visible_archs", lambda: (86,))
    assert precompile.cuda_archs(" Auto ") == (86,)


@pytest.fixture
def nvrtc():
    """CuPy's NVRTC binding, as ``compile_source`` uses it (skips where it cannot be loaded)."""
    pytest.importorskip("cupy")
    from cupy_backends.cuda.libs import nvrtc

    try:
        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"CuPy's NVRTC is not loadable here: {exc}")
    return nvrtc


def test_cuda_kernels_compiled_ahead_are_what_a_first_device_call_finds(tmp_path, nvrtc):
    """``compile_cuda`` for a compute capability, without a GPU, fills the image cache; ``compile_source`` as a
    first device call on such a GPU makes it (same NVRTC, same options) then finds each image there and
    compiles nothing.  The images are readable by other users (a cache an image build shares)."""
    from ddlkernels.kernels.sources import SOURCES, compile_source, units

    lines = []
    made = [(name, unit) for name in SOURCES for unit in units(name)]  # reduce.cu: one unit per kind of kernel
    assert precompile.compile_cuda([80], jobs=1, report=lines.append, cache_dir=tmp_path) == len(made) == 5
    assert sorted(line.split(" for ")[0] for line in lines) == sorted(" ".join([n, *u]) for n, u in made)
    assert all("sm_80" in x for x in lines)
    images = sorted(tmp_path.iterdir())
    assert len(images) == len(made) and all(p.suffix == ".cubin" and p.stat().st_mode & 0o044 == 0o044
                                            for p in images)

    class NoCompile:  # NVRTC as the first call sees it, but compiling fails the test
        getVersion, getSupportedArchs = staticmethod(nvrtc.getVersion), staticmethod(nvrtc.getSupportedArchs)

        def __getattr__(self, name):
            raise AssertionError(f"compiled again: nvrtc.{name}")

    for name, unit in made:
        target, image = compile_source(name, 80, nvrtc=NoCompile(), cache_dir=tmp_path, defines=unit)
        assert target == "sm_80" and image in {p.read_bytes() for p in images}


def test_cuda_kernels_with_their_cache_off_are_refused_before_anything_compiles():
    env = dict(os.environ, DDLKERNELS_CACHE_DIR="off")
    res = subprocess.run([sys.executable, "-m", "ddlkernels", "compile", "--cuda", "90"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode != 0 and "DDLKERNELS_CACHE_DIR is off" in res.stderr
    assert "signature" not in res.stdout


def test_an_image_compiled_with_defines_is_kept_apart(tmp_path, nvrtc):
    """``compile_source(defines=)`` (a study's variant of a kernel, bench/studies/half_sums.py) passes each macro
    to NVRTC and keeps its image under a key of its own: the library's first call never finds a variant."""
    from ddlkernels.kernels.sources import compile_source

    seen = []

    class Recording:  # CuPy's NVRTC, noting the options of each compile
        def __getattr__(self, name):
            return getattr(nvrtc, name)

        def compileProgram(self, prog, options):
            seen.append(list(options))
            return nvrtc.compileProgram(prog, options)

    plain = compile_source("pack.cu", 80, nvrtc=Recording(), cache_dir=tmp_path)
    variant = compile_source("pack.cu", 80, nvrtc=Recording(), cache_dir=tmp_path, defines=("DDL_STUDY=1",))
    assert plain[0] == variant[0] == "sm_80" and len(list(tmp_path.iterdir())) == 2
    assert "-DDDL_STUDY=1" not in seen[0] and "-DDDL_STUDY=1" in seen[1]
