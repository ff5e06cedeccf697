"""What the real-device tests run on, and the one reason they skip when there is none.

tests/gpu never runs in the Numba CUDA simulator and never fakes a device: a
machine without a CUDA device (or with the simulator switched on) skips every
test here with the reason below.  ``tests/gpu/run_on_device.sh`` runs the
suite on a GPU machine.
"""

from __future__ import annotations

import os

import pytest


def _probe():
    try:
        import cupy
    except ImportError as exc:
        return None, f"CuPy is not installed ({exc}): tests/gpu needs a CUDA device and CuPy"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device
        return None, f"no CUDA device ({type(exc).__name__}: {exc})".splitlines()[0]
    if n == 0:
        return None, "no CUDA device (getDeviceCount() == 0)"
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return None, "NUMBA_ENABLE_CUDASIM is on: tests/gpu runs on real devices only, never in the simulator"
    return cupy, None


cp, REASON = _probe()
#: Device collectives this process made in tests (printed at the end of an MPI session).
CALLS = [0]
needs_device = pytest.mark.skipif(cp is None, reason=REASON or "")


def numba_cuda():
    """numba.cuda on the real device (the simulator refused above)."""
    from numba import config, cuda

    assert not getattr(config, "ENABLE_CUDASIM", 0), "numba was imported with the CUDA simulator on"
    return cuda


def torch_cuda():
    """torch, when it has CUDA here; else the test skips with the reason."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device (a CPU-only build)")
    return torch


def device_name() -> str:
    if cp is None:
        return "none"
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)
