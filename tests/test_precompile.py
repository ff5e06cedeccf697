"""``python -m ddlkernels compile`` (ddlkernels.kernels.precompile): its table and its arguments.  That its table
is what the window's calls compile is checked under MPI (tests/mpi/test_shm.py); run_suite.py runs it whole."""

import subprocess
import sys

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
