"""The caller's stream for a device call, ordered after the Communicator's last device call.

Worked example, two calls on CuPy arrays from two streams ``a`` and ``b``::

    with a: comm.allreduce(x)   compute stream a; nothing to wait for; records E1 on a
    with b: comm.allreduce(y)   compute stream b; b waits for E1 (the slots, scratch and
                                fusion buffers of the first call are reused); records E2 on b

No host block: one event recorded and one waited per call, none where the call's
stream has run all it was given by the time the call ends (nothing is left to wait
for).  Each function takes the ``Communicator`` first: they are its methods.
"""

from __future__ import annotations

import contextlib

from .arguments import where

__all__ = ["device_call", "runs_now"]


def device_call(self, be, x, stream):
    """Context of one call on ``x``: for device arrays the caller's stream (``stream`` or the one of
    ``x``'s library) as this thread's compute stream, after the last device call; for host arrays
    nothing (``stream=`` is then an error)."""
    if not be.device:
        if stream is not None:
            raise ValueError("stream= orders device work; the arrays of this call are host arrays")
        return contextlib.nullcontext()
    return on_stream(self, be, runs_now(be, be.call_stream(x, stream)), be.device_id(x))


def runs_now(be, s):
    """``s``, the stream of a device call, which must run what is queued on it now: a stream capturing a CUDA
    graph is refused before any communication.  A collective exchanges its MPI messages and blocks on its
    streams when it is called; in a graph only its kernels and copies would replay, without the peers."""
    why = be.graph_capture(s)
    if why is not None:
        raise RuntimeError(f"ddlkernels cannot run inside a CUDA graph capture: {why}. A collective's "
                           "messages go when it is called, not when the graph replays; call it outside the "
                           "capture (torch.cuda.graph, cupy Stream.begin_capture)")
    return s


@contextlib.contextmanager
def on_stream(self, be, s, device):
    """``s`` on ``device`` as the compute stream, waiting for the tail of the last device call and
    leaving its own (``Communicator._tails``)."""
    with be.using(s, device):
        tail = self._tails.get(where(be))
        if tail is not None:
            be.wait(s, tail)
        try:
            yield s
        finally:
            # A call that blocked until its stream had run (CUDA IPC's schedule on a shared GPU) leaves no
            # event: a rank whose part is done then queues nothing on a GPU that switches between processes.
            if be.idle(s):
                self._tails.pop(where(be), None)
            else:
                self._tails[where(be)] = be.record(s)
