"""``bench --launch``: one mpirun for the ordinary lines and one per forced Open MPI algorithm, merged.

Runs real (small, 1-rank) jobs through the mpirun beside this Python; the
forced algorithm is read by the child from its environment and becomes the
MPI line's name, so the merged table holds both MPI lines.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")


@pytest.mark.skipif(not os.path.exists(MPIRUN), reason="no mpirun beside this python")
@pytest.mark.skipif(any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_RANK")), reason="already under mpirun")
def test_launch_merges_forced_algorithms(tmp_path):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", MPIEXEC_TIMEOUT="120")
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "ddlkernels", "bench", "--launch", "1", "--mpi-algorithm", "ring",
                           "-b", "4K", "-e", "16K", "-f", "2", "-n", "2", "-w", "1", "--no-progress", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert [r["bytes"] for r in data["rows"]] == [4096, 8192, 16384]
    for r in data["rows"]:
        assert {"ddlkernels", "MPI_Allreduce", "MPI_Allreduce[tuned ring]", "Sendrecv link"} <= set(r["impls"])
        assert all(m["wrong"] == 0 for m in r["impls"].values())
    runs = data["meta"]["runs"]
    assert len(runs) == 2 and "OMPI_MCA_coll_tuned_allreduce_algorithm=4" in runs[1]["command"]
    assert runs[1]["start"]["env"]["OMPI_MCA_coll_tuned_use_dynamic_rules"] == "1"
    assert "MPI_Allreduce[tuned ring]" in proc.stdout


def test_launch_refuses_under_mpirun_and_forced_algorithm_needs_launch():
    from ddlkernels.tools import bench_cli as _cli_bench

    with pytest.raises(SystemExit, match="needs --launch"):
        _cli_bench.main(["--mpi-algorithm", "ring"])
