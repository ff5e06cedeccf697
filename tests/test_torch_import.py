"""``import ddlkernels.torch`` where torch was built without ``torch.distributed`` (some platforms' wheels):
the optimizer and hooks import, the process group is left out, not an ``AttributeError`` at import."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CODE = """if True:
    import torch, torch.distributed as dist
    dist.is_available = lambda: False
    for name in ("ProcessGroup", "_Work", "Backend"):  # what such a build lacks
        delattr(dist, name)
    import ddlkernels.torch as ddt
    assert "ProcessGroupDDL" not in ddt.__all__ and not hasattr(ddt, "ProcessGroupDDL")
    assert callable(ddt.DistributedOptimizer) and callable(ddt.allreduce_hook)
    print("ok")
"""


def test_a_torch_without_distributed_still_imports_the_rest():
    pytest.importorskip("torch", reason="torch not installed (pip install -e .[torch])")
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, PYTHONPATH=path))
    assert res.returncode == 0 and res.stdout.split() == ["ok"], res.stdout + res.stderr
