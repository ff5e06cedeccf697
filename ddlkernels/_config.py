"""Defaults, and the one place environment variables are read.

Every knob is first a keyword argument (of ``Communicator`` or of a call);
the environment is only a fallback for jobs whose code cannot be changed.
The variables are documented in the README:

=============================  =================================================
``DDLKERNELS_CHUNK_BYTES``     pipeline chunk size in bytes (default 1 MiB)
``DDLKERNELS_SMALL_BYTES``     messages below this many bytes go to MPI's own
                               ``Allreduce``, larger ones to the ring (0 = always
                               the ring; unset = chosen by measurement, see
                               ``ddlkernels.select.tuner``)
``DDLKERNELS_CUDA_AWARE``      ``1``/``0`` overrides CUDA-aware MPI detection
``DDLKERNELS_SHM``             ``1`` always / ``0`` never / unset: measured --
                               the shared-memory allreduce on one node
``DDLKERNELS_IPC``             ``1`` always / ``0`` never / unset: measured --
                               the CUDA IPC allreduce of device arrays on one node
``DDLKERNELS_VALIDATE``        ``1`` checks arguments agree across ranks
``DDLKERNELS_TOPOLOGY``        link parameters for the planner: a topology file
                               written by ``python -m ddlkernels calibrate``, or
                               a preset name
``DDLKERNELS_RACK_MAP``        a file mapping host names to racks
``DDLKERNELS_CACHE_DIR``       where compiled CUDA kernels are kept (default
                               ``$XDG_CACHE_HOME/ddlkernels`` or
                               ``~/.cache/ddlkernels``; ``off``: not kept)
=============================  =================================================
"""

from __future__ import annotations

import os

__all__ = ["Defaults", "defaults"]

#: Chunk size of the pipeline.  Measured on the 2-core CI machine with the
#: shared-memory transport (bench/sweep_chunk.py): 256 KiB .. 4 MiB are within
#: noise of each other for messages >= 4 MiB; smaller chunks pay per-message
#: overhead, larger ones lose the overlap of transfer and reduction.
CHUNK_BYTES = 1 << 20
#: None: choose between MPI's own allreduce and the ring by measurement
#: (ddlkernels.select.tuner); an int is a fixed threshold.
SMALL_BYTES = None
#: Receive slots in flight per ring step (double buffering = 2).
WINDOW = 4


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw, 0)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"environment variable {name}={raw!r} must be >= 0")
    return value


def _cache_dir():
    raw = os.environ.get("DDLKERNELS_CACHE_DIR", "").strip()
    if raw.lower() in ("off", "none", "0"):
        return None
    if raw:
        return os.path.expanduser(raw)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ddlkernels")


def _tristate_env(name: str):
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name}={raw!r}: expected 1, 0 or auto")


class Defaults:
    """Snapshot of the fallbacks, taken when a ``Communicator`` is created."""

    def __init__(self):
        self.chunk_bytes = _int_env("DDLKERNELS_CHUNK_BYTES", CHUNK_BYTES) or CHUNK_BYTES
        self.small_bytes = _int_env("DDLKERNELS_SMALL_BYTES", SMALL_BYTES)
        self.cuda_aware = _tristate_env("DDLKERNELS_CUDA_AWARE")
        self.shm = _tristate_env("DDLKERNELS_SHM")
        self.ipc = _tristate_env("DDLKERNELS_IPC")
        self.validate = bool(_tristate_env("DDLKERNELS_VALIDATE"))
        self.window = WINDOW
        self.topology = os.environ.get("DDLKERNELS_TOPOLOGY") or None
        self.rack_map = os.environ.get("DDLKERNELS_RACK_MAP") or None
        self.cache_dir = _cache_dir()


def defaults() -> Defaults:
    return Defaults()
