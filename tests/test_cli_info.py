"""``python -m ddlkernels info`` under mpirun: every line it promises, on every rank count it is run with."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")


@pytest.mark.skipif(not os.path.exists(MPIRUN), reason="no mpirun beside this python")
@pytest.mark.skipif(any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_RANK")), reason="already under mpirun")
@pytest.mark.parametrize("ranks,shm_env,shm_line", [
    (1, "", "no"),
    (2, "", "yes: measured"),
    (2, "0", "no"),
    (2, "1", "yes: forced"),
])
def test_info_reports_mpi_cuda_awareness_backends_topology_and_shared_memory(ranks, shm_env, shm_line):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", MPIEXEC_TIMEOUT="120", DDLKERNELS_SHM=shm_env)
    proc = subprocess.run([MPIRUN, "-n", str(ranks), sys.executable, "-m", "ddlkernels", "info"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "\0" not in out
    lines = {line[:15].strip(): line[15:] for line in out.splitlines()}  # the key column is 15 wide
    assert lines["ranks"] == str(ranks)
    assert lines["MPI library"] and lines["CUDA-aware MPI"].startswith(("yes", "no"))
    assert lines["backend"]  # one line per backend; numpy is always there
    assert "numpy  ok" in out
    assert lines["topology"].startswith(f"{ranks} ranks")
    assert lines["shared memory"].startswith(shm_line), out


@pytest.mark.skipif(not os.path.exists(MPIRUN), reason="no mpirun beside this python")
@pytest.mark.skipif(any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_RANK")), reason="already under mpirun")
def test_window_creation_leaves_stderr_clean():
    """Open MPI's "OSC UCX component ..." noise at every window creation is filtered (ddlkernels.algorithms.shm)."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", MPIEXEC_TIMEOUT="120")
    code = ("import numpy as np, ddlkernels; from mpi4py import MPI; c = ddlkernels.Communicator(shm=True); "
            "y = c.allreduce(np.ones(1000)); assert c.last_algorithm == 'shm' and (y == 2).all(); "
            "import sys; sys.stderr.write('kept\\n'); c.free(); print('ok')")
    proc = subprocess.run([MPIRUN, "-n", "2", sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["ok", "ok"]
    assert "OSC UCX component" not in proc.stderr and proc.stderr.count("kept") == 2, proc.stderr
