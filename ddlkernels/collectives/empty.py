"""``empty``: host memory every rank of the node can read, for collectives that skip a staging copy.

Worked example, 4 ranks of one node::

    a = comm.empty(1 << 20, "float32")   every rank: a region of the shared window, the
                                         same size on every rank (checked collectively)
    a[...] = gradients
    comm.allreduce(a, out=a)             the window's allreduce reads each peer's blocks
                                         where they lie instead of staging them first

Its function takes the ``Communicator`` first: it is its method.
"""

from __future__ import annotations

import operator

import numpy as np

from .._dtypes import check_dtype
from ..safety.agreement import check_same_on_all_ranks

__all__ = ["empty"]


def empty(self, shape, dtype="float32") -> np.ndarray:
    """An uninitialized host array that every rank of this node can read: a collective's input for free.

    Collective: every rank calls with the same ``shape`` and ``dtype``
    (checked; a mismatch raises the same ``ValueError`` on every rank).
    When every rank shares one node and the shared-memory algorithms are
    not turned off (``shm``), the array lies in an MPI shared window, and
    a large allreduce or reduce_scatter through the window whose input
    lies in such an array (or a contiguous part of it), or an allgather
    whose shard does, skips the copy that otherwise stages it for its
    peers (``ddlkernels.algorithms.shm``); ranks whose inputs are not
    shared may meet it.  Otherwise it is an ordinary ``numpy.empty``.

    ``free()`` releases its memory, unless an array of it is still
    referenced on some rank: then it stays mapped until MPI finalizes.
    """
    dt = check_dtype(np.dtype(dtype))
    shape = (operator.index(shape),) if np.ndim(shape) == 0 else tuple(operator.index(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"empty: negative dimension in shape {shape}")
    with self._exclusive("empty"):
        # Its signature layout: (call, op, settings, then one (dtype, shape) per array).
        check_same_on_all_ranks(self.comm, ("empty", "-", (), (dt.str, shape)),
                                "empty: every rank must ask for the same shape and dtype")
        shared = self.algorithms.shared_memory
        if shared is None:
            return np.empty(shape, dt)
        count = int(np.prod(shape, dtype=np.int64))
        return shared.window().empty(count * dt.itemsize).view(dt).reshape(shape)

