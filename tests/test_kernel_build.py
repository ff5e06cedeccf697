"""How the .cu kernels are compiled at run time, checked without a GPU: no flush to zero, the right target,
the disk cache, the headers of the right CUDA, and numba-cuda under a numpy without ``row_stack``.

CuPy appends ``-ftz=true`` to every NVRTC compile it makes (after the caller's options), and on an H100
every float32 and bfloat16 kernel then flushed subnormals (1e-40 + 0 gave 0).  The kernels are therefore
compiled by ``ddlkernels.kernels.sources.compile_source`` with our own options; the PTX it produces must
contain no ``.ftz`` instruction, while the same source compiled with CuPy's appended flag does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddlkernels.kernels import sources as KS

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy (its NVRTC binding) is not installed")
ROOT = Path(__file__).resolve().parent.parent


def _ptx(extra=()):
    major, _ = nvrtc.getVersion()
    return KS._nvrtc_compile(nvrtc, KS.read_source("reduce.cu"), "reduce.cu",
                             KS.nvrtc_options("compute_80", extra, major=major)).decode()


def test_our_compile_keeps_subnormals_and_cupys_flag_would_flush_them():
    ours = _ptx()
    assert ".ftz" not in ours, "a flush-to-zero instruction in the kernels compiled with our options"
    # The check can fail: the flag CuPy appends turns the f32 adds and compares into their .ftz forms.
    flushed = _ptx(("-ftz=true",))
    assert "add.ftz.f32" in flushed or "add.rn.ftz.f32" in flushed
    assert "setp" in flushed and ".ftz." in flushed


def test_compile_source_states_the_numerics(monkeypatch, tmp_path):
    seen = {}

    def fake(nv, source, name, options):
        seen["options"] = options
        return b"image"

    monkeypatch.setattr(KS, "_nvrtc_compile", fake)
    KS.compile_source("pack.cu", 90, cache_dir=tmp_path)
    assert set(KS.NUMERIC_OPTIONS) <= set(seen["options"]) and "-ftz=false" in seen["options"]
    assert not any(o == "-ftz=true" for o in seen["options"])


def test_compile_source_targets_the_device_or_the_newest_older_ptx(tmp_path):
    supported = nvrtc.getSupportedArchs()
    target, image = KS.compile_source("pack.cu", 80, cache_dir=tmp_path)
    assert target == "sm_80" and image[:4] == b"\x7fELF"  # a cubin for the device's own architecture
    newer = max(supported) + 1  # a GPU newer than this NVRTC: PTX of the newest it knows, for the driver
    target, image = KS.compile_source("pack.cu", newer, cache_dir=tmp_path)
    assert target == f"compute_{max(supported)}" and b".entry ddl_pack" in image and image.endswith(b"\0")


def test_pick_target():
    assert KS.pick_target(90, (75, 80, 90, 100)) == "sm_90"
    assert KS.pick_target(90, (75, 80, 87, 89)) == "compute_89"
    with pytest.raises(RuntimeError, match="none of them at or below"):
        KS.pick_target(70, (75, 80))


def test_compiled_images_are_cached_on_disk(monkeypatch, tmp_path):
    calls = []
    real = KS._nvrtc_compile

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(KS, "_nvrtc_compile", counted)
    first = KS.compile_source("pack.cu", 90, cache_dir=tmp_path)
    second = KS.compile_source("pack.cu", 90, cache_dir=tmp_path)
    assert first == second and len(calls) == 1
    assert [p.suffix for p in tmp_path.iterdir()] == [".cubin"]
    KS.compile_source("pack.cu", 80, cache_dir=tmp_path)  # another target: another entry
    assert len(calls) == 2


def test_include_dirs_prefer_the_headers_of_the_nvrtc_in_use(monkeypatch, tmp_path):
    """CUDA 13 wheels keep their headers in nvidia/cu13/include, CUDA 12's in nvidia/cuda_runtime/include."""
    for sub in ("cu13", "cuda_runtime"):
        (tmp_path / "nvidia" / sub / "include").mkdir(parents=True)
        (tmp_path / "nvidia" / sub / "include" / "cuda_fp16.h").write_text("")

    class Spec:
        submodule_search_locations = [str(tmp_path / "nvidia")]

    monkeypatch.setattr(KS.importlib.util, "find_spec", lambda name: Spec() if name == "nvidia" else None)
    assert KS.cuda_include_dirs(13)[0] == str(tmp_path / "nvidia" / "cu13" / "include")
    assert KS.cuda_include_dirs(12)[0] == str(tmp_path / "nvidia" / "cuda_runtime" / "include")


def test_cache_dir_setting(monkeypatch, tmp_path):
    from ddlkernels import _config

    monkeypatch.setenv("DDLKERNELS_CACHE_DIR", str(tmp_path / "k"))
    assert _config.defaults().cache_dir == str(tmp_path / "k")
    monkeypatch.setenv("DDLKERNELS_CACHE_DIR", "off")
    assert _config.defaults().cache_dir is None
    monkeypatch.delenv("DDLKERNELS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _config.defaults().cache_dir == str(tmp_path / "ddlkernels")


_WITHOUT_ROW_STACK = """
import numpy
del numpy.row_stack  # numpy 2.5 removed it
from numba import cuda, float32
{body}
"""


def _run(body):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return subprocess.run([sys.executable, "-c", _WITHOUT_ROW_STACK.format(body=body)], capture_output=True,
                          text=True, env=env, timeout=300)


def test_numba_cuda_compiles_under_a_numpy_without_row_stack():
    """numba-cuda 0.30 overloads numpy.row_stack on its first compile: without the name every kernel fails
    deep inside it.  The plain compile shows the failure; ddlkernels' kernels compile."""
    plain = _run("def k(a):\n    a[0] = 1\ncuda.compile_ptx(k, (float32[:],), cc=(8, 0))")
    if plain.returncode == 0:
        pytest.skip("this numba-cuda compiles without numpy.row_stack: there is nothing to guard against")
    assert "row_stack" in plain.stderr, plain.stderr[-3000:]
    ours = _run("from ddlkernels.kernels import numba_cuda as N\n"
                "ptx, _ = cuda.compile_ptx(N.reduce_kernel('sum', 'f32', python=True), N.kernel_signature('f32'),"
                " cc=(8, 0))\nassert 'ddl_reduce_sum_f32' in ptx")
    assert ours.returncode == 0, ours.stderr[-3000:]
