"""Every Numba kernel executed in the Numba CUDA simulator, compared with numpy.

The simulator must be enabled before numba is first imported, so the kernels
run in a child process (tests/numba_sim_worker.py) with
``NUMBA_ENABLE_CUDASIM=1``; this process keeps the real numba-cuda for the
compile tests.  Each kernel (op x dtype, pack, unpack) is one test here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _kernel_ref as K  # noqa: E402

HERE = Path(__file__).resolve().parent
KERNELS = [f"ddl_reduce_{op}_{K.SUFFIX[dt]}" for dt in K.DTYPES for op in K.OPS] + ["ddl_pack", "ddl_unpack"]


@pytest.fixture(scope="module")
def sim_results():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(HERE / "numba_sim_worker.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"simulator worker failed:\n{res.stderr[-4000:]}"
    return json.loads(res.stdout)


def test_worker_refuses_without_simulator():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    res = subprocess.run([sys.executable, str(HERE / "numba_sim_worker.py")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "NUMBA_ENABLE_CUDASIM=1" in res.stderr


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_in_simulator(sim_results, name):
    r = sim_results[name]
    assert r["cases"] > 0
    assert r["ok"], r["detail"]
    assert r["max_err"] == 0.0
