"""Point-to-point messages of the ``ddlkernels`` process group (``dist.send``, ``recv``, ``isend``, ``irecv``,
``batch_isend_irecv``), beside its collectives and never queued behind them.

Worked example, two pipeline stages that also reduce gradients, 2 ranks::

    rank 0  w = dist.isend(a, dst=1)    # queued for the poller, which posts MPI_Isend of a's bytes at
                                        # once on the group's message communicator
            dist.all_reduce(g)          # the collectives' progress thread, meanwhile
            w.wait()                    # a's bytes have left: a may be written again
    rank 1  dist.all_reduce(g)
            dist.recv(b, src=0)         # MPI_Irecv into b's bytes; the poller completes it

The collectives run one at a time in call order on the group's progress
thread (``ddlkernels.torch.process_group``); a send queued there would wait
for the receive the peer queues behind its own collectives, so messages take
a path of their own: a duplicate of the group's communicator (a message never
matches a collective's), one poller thread per group that posts them in call
order and tests them until done (MPI_THREAD_MULTIPLE, as the progress thread
needs), and a ``Work`` whose future the poller completes.  Two messages
between the same ranks on one tag match in the order they were called, MPI's
non-overtaking rule, which is what ``batch_isend_irecv`` promises.

CUDA tensors go through pinned host memory, on a stream of the group's kept
for messages (not the collectives' stream: a message must not wait behind a
collective that waits for a peer).  A send copies to host after the caller's
work so far on its stream (an event), and the poller posts it once the copy
has run; a receive lands in host memory and its copy into the tensor runs on
that stream, which ``wait()`` orders the caller's stream after, as NCCL's.

Each side says the bytes it expects: a message of another size raises on the
receiving rank (``ValueError``); a wrong peer or tag raises on the caller
before anything is posted.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import threading
import weakref

import torch

from ..safety.deadline import abandon
from .ddp import DeviceStreams

__all__ = ["Messages"]

#: The poller's sleep between tests while messages are in flight grows from the first to the second (seconds):
#: a small message completes in microseconds, a long wait should not spin a core.  While a caller blocks in a
#: message's ``wait()`` it stays at the first: that caller has nothing else to do.
_NAP = (2e-5, 1e-3)


class _Message:
    """One send or receive: its tensor, the host bytes MPI moves, its request once posted, its future."""

    def __init__(self, owner, fut, tensor, peer, tag, send, stream):
        self.owner = owner  # the group's Messages
        self.fut, self.tensor, self.peer, self.tag, self.send = fut, tensor, peer, tag, send
        self.stream = stream  # the group's message stream of the tensor's device; None for a CPU tensor
        self.copied = None  # a CUDA send: the event of its copy to host
        self.finished = None  # a CUDA receive: the event of its copy into the tensor
        self.request = None
        self.source = peer  # a receive from any rank: the sender, once known
        raw = tensor.detach().reshape(-1).view(torch.uint8)
        if stream is None:
            self.host = raw.numpy()  # MPI reads or writes the tensor's own memory
            return
        # Pinned: torch's caching host allocator keeps such a block from reuse until the copies that read it ran.
        host = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=True)
        self.host = host.numpy()
        self.pinned = host
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))
        stream.wait_event(ready)
        tensor.record_stream(stream)  # made on the caller's stream, used on this one until its work has run
        if send:
            with torch.cuda.stream(stream):
                host.copy_(raw, non_blocking=True)
                self.copied = torch.cuda.Event()
                self.copied.record(stream)
        else:
            self.finished = torch.cuda.Event()

    def postable(self) -> bool:
        """Whether MPI may take the bytes now (a CUDA send: once its copy to host has run)."""
        return self.copied is None or self.copied.query()

    def post(self, comm, mpi) -> None:
        buf = [self.host, mpi.BYTE]
        self.request = comm.Isend(buf, self.peer, self.tag) if self.send else comm.Irecv(buf, self.peer, self.tag)
        self.status = mpi.Status()

    def finish(self, mpi) -> None:
        """The message's request has completed: check what arrived, copy it to the device, complete the future."""
        if not self.send:
            self.source = self.status.Get_source()
            got = self.status.Get_count(mpi.BYTE)
            if got != self.host.size:
                raise ValueError(f"ddlkernels: recv of {self.host.size} bytes ({self.tensor.numel()} x "
                                 f"{self.tensor.dtype}) got a message of {got} bytes from rank {self.source}")
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            if self.finished is not None:
                self.tensor.view(-1).view(torch.uint8).copy_(self.pinned, non_blocking=True)
                self.finished.record(self.stream)
            self.fut.set_result([self.tensor])  # a CUDA future records its event on the message stream


class Messages:
    """A process group's point-to-point messages: its own duplicate of ``comm`` (collective: made with the group)
    and the poller thread, started at the first message."""

    def __init__(self, comm):
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm.Dup()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
        self._lock = threading.Lock()
        self._new: list = []  # messages called and not yet picked up by the poller, in call order
        self._wake = threading.Event()
        self._waiters = 0  # callers blocked in a message's wait() (``hurry``)
        self._thread = None
        self._closed = False
        self._streams = DeviceStreams()  # the group's messages' stream on each device
        _LIVE.add(self)

    def post(self, tensor, peer, tag, send, work):
        """Queue one message of ``tensor``'s bytes to (``send``) or from ``peer`` (None: any rank) on ``tag``;
        ``tensor`` contiguous; ``work(fut, message)``: the ``Work`` returned.  Checked here, before anything is
        sent."""
        what = "send" if send else "recv"
        if peer is not None and not 0 <= int(peer) < self.size:
            raise ValueError(f"ddlkernels: {what} with rank {peer} of a group of {self.size}")
        if not isinstance(tag, int) or not 0 <= tag <= self._tag_ub:
            raise ValueError(f"ddlkernels: {what}'s tag is {tag!r}; MPI takes tags 0 to {self._tag_ub}")
        if self._closed:
            raise RuntimeError(f"ddlkernels: {what} on a process group that was shut down")
        cuda = tensor.is_cuda
        fut = torch.futures.Future(devices=[tensor.device]) if cuda else torch.futures.Future()
        source = self._mpi.ANY_SOURCE if peer is None else int(peer)
        m = _Message(self, fut, tensor, source, tag, send, self._streams.stream(tensor.device) if cuda else None)
        with self._lock:
            self._new.append(m)
            if self._thread is None:
                self._thread = threading.Thread(target=self._poll, name="ddlkernels-messages", daemon=True)
                self._thread.start()
        self._wake.set()
        return work(fut, m)

    def _poll(self):
        """Post the messages in call order (a CUDA send once its copy has run), test them, complete them."""
        waiting, posted = collections.deque(), []
        nap = _NAP[0]
        while True:
            self._wake.clear()
            with self._lock:
                waiting.extend(self._new)
                self._new.clear()
                closed = self._closed
            if closed:
                return self._abandon([*waiting, *posted])
            moved = False
            while waiting:
                m = waiting[0]
                try:
                    if not m.postable():
                        break
                    m.post(self.comm, self._mpi)
                    posted.append(m)
                except Exception as exc:  # a CUDA or MPI error fails its message, not the poller
                    m.fut.set_exception(exc)
                waiting.popleft()
                moved = True
            still = []
            for m in posted:
                try:
                    if not self._test(m):
                        still.append(m)
                        continue
                    m.finish(self._mpi)
                except Exception as exc:
                    m.fut.set_exception(exc)
                moved = True
            posted = still
            if moved or self._waiters:
                nap = _NAP[0]
            elif waiting or posted:
                nap = min(2 * nap, _NAP[1])
            self._wake.wait(nap if waiting or posted else None)

    @contextlib.contextmanager
    def hurry(self):
        """Around a caller's blocking wait for a message: the poller tests at its shortest nap meanwhile."""
        with self._lock:
            self._waiters += 1
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._waiters -= 1

    def _test(self, m) -> bool:
        """Whether ``m``'s request has completed; a message longer than the receive's tensor as ``ValueError``."""
        try:
            return m.request.Test(m.status)
        except self._mpi.Exception as exc:
            if exc.Get_error_class() != self._mpi.ERR_TRUNCATE:
                raise
            raise ValueError(f"ddlkernels: recv of {m.host.size} bytes ({m.tensor.numel()} x {m.tensor.dtype}) got "
                             f"a longer message") from None

    def _abandon(self, left):
        """Shut down with messages in flight: receives cancelled, every future failed.  A send still in flight
        keeps its bytes for the process's life (``abandon``): MPI may still read them after the communicator is
        freed."""
        for m in left:
            if m.request is not None and not m.send:
                with contextlib.suppress(Exception):
                    m.request.Cancel()
                    m.request.Wait()
            elif m.request is not None:
                abandon(m)
            m.fut.set_exception(RuntimeError("ddlkernels: the process group was shut down before this "
                                             f"{'send' if m.send else 'recv'} completed"))

    def stop(self) -> None:
        """End the poller: messages still in flight fail, receives cancelled."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join()

    def close(self) -> None:
        """``stop``, and free the communicator (collective)."""
        self.stop()
        self.comm.Free()


#: Every group's messages, for the exit: a poller inside MPI_Test beside MPI_Finalize could crash it.
_LIVE: "weakref.WeakSet[Messages]" = weakref.WeakSet()


@atexit.register
def _stop_pollers():  # Python's exit handlers run before mpi4py's MPI_Finalize (a Py_AtExit hook)
    for messages in list(_LIVE):
        messages.stop()
