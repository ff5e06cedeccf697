"""``torch.distributed`` on ddlkernels: ``init_process_group("ddlkernels")``, and DDP, FSDP or any code
of ``dist.*`` collectives reduces with it, unchanged.

Worked example, 2 ranks under ``mpirun``, a tensor ``t`` on each::

    import ddlkernels.torch as ddt                   # registers the backend "ddlkernels"
    ddt.init_process_group("ddlkernels")              # rank and size from MPI (or torch's own init)
    w = dist.all_reduce(t, async_op=True)             # the group's progress thread: in call order,
                                                      # ddlkernels' allreduce of t in place
    ...                                               # the caller goes on meanwhile
    w.wait()                                          # t holds the sum (CUDA: the caller's stream
                                                      # is ordered after it, as NCCL's wait)
    model = DistributedDataParallel(model)            # buckets reduced the same way, during backward

Every collective of a group is one unit of work of the group's progress thread
(``ddlkernels.asynchronous``, the engine of ``allreduce_async`` and of the DDP
hook), run in the order the ranks call them, which is the order torch
requires of every rank.  For CUDA tensors the call records an event on the
caller's current stream; on the progress thread a stream of the group's own
waits for it and the collective runs there (ddlkernels runs a torch tensor's
call on torch's current stream); the ``Work``'s future is a CUDA-aware
``torch.futures.Future``, so ``wait()`` makes the waiting stream wait for the
result instead of blocking on the device.  Messages (send, recv) take a path
of their own beside that queue (``ddlkernels.torch.p2p``).

The collectives and how they map (``shard_range`` cuts a flat buffer in
rank order for the flat ring: reduce_scatter and allgather take ``dims=(p,)``
where the Communicator's own box would cut it otherwise):

    all_reduce, all_reduce_coalesced   allreduce, allreduce_many in place
    reduce                             allreduce into a new tensor, copied on the root
    all_gather(_into_tensor, _single)  allgather into the rank-order whole (in place through a copy);
                                       any dtype: others' bytes as int64/int32 words, or MPI_Allgather
    reduce_scatter(_tensor, _single)   reduce_scatter of the rank-order whole (likewise)
    broadcast, gather, scatter,        MPI's own collective on the bytes, any dtype (through host
    all_to_all(_single)                memory for CUDA tensors): nothing to reduce, only to move
    barrier                            MPI_Barrier, after the group's earlier work
    send, recv, isend, irecv,          MPI_Isend / MPI_Irecv of the bytes, beside the queue, never
    batch_isend_irecv                  in it (``ddlkernels.torch.p2p``)

Ops: SUM, AVG, MAX, MIN, PRODUCT.  uint8, int8 and bool, which gloo reduces
and ddlkernels' kernels do not, reduce by MPI's own collectives through host
memory (on bool SUM and MAX are "or", MIN and PRODUCT "and"; no AVG).
torch's ``timeout=`` of the group bounds each collective's run: past it a
watchdog fails the collective's ``Work`` and those behind it
(``ddlkernels.CollectiveTimeout``) and the group is unusable, as NCCL's
after its watchdog (``ddlkernels.torch.watchdog``); it bounds a message's
``wait()`` without a timeout of its own too.
A group of some ranks (``dist.new_group(ranks, backend="ddlkernels")``) runs
on the MPI communicator of those ranks; a torch rank must be the process's
``MPI.COMM_WORLD`` rank (``ddt.init_process_group`` makes it so).

torch's support for a process group written in Python is the same that
torch's own tests use (``dist.ProcessGroup`` and ``dist._Work`` subclassed);
``tests/mpi/test_torch_process_group.py`` checks every collective against gloo's,
DDP trained on it against DDP on gloo, and FSDP2 against one process.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch
import torch.distributed as dist

from .._dtypes import check_dtype, normalize_op
from ..communicator import Communicator
from ..safety.deadline import abandon

__all__ = ["ProcessGroupDDL", "BACKEND", "register"]

#: The name ``init_process_group`` and ``new_group`` take.
BACKEND = "ddlkernels"


class _Work(dist._Work):
    """A collective queued on the group's progress thread; done when its future is."""

    def __init__(self, fut, finished=None, limit=None):
        super().__init__()
        self._fut = fut
        self._finished = finished  # CUDA: an event recorded after the work's last copy or kernel
        self._limit = limit  # seconds a wait() without a timeout of its own waits (None: no limit)

    def wait(self, timeout=None):
        """Until the work has run (raising its error); for CUDA, the current streams ordered after it.
        ``timeout`` (a ``timedelta``; zero or None: the work's own limit, if any): a ``RuntimeError`` once it
        has passed."""
        seconds = timeout.total_seconds() if timeout is not None else 0
        seconds = seconds if seconds > 0 else self._limit or 0
        if seconds > 0 and not self._fut.done():
            done = threading.Event()
            self._fut.add_done_callback(lambda _: done.set())
            if not done.wait(seconds):
                raise RuntimeError(f"{BACKEND}: {self._what()} did not complete within {seconds:g} s")
        self._fut.wait()
        return True

    def is_completed(self):
        """Whether the work has run, on the device too (as NCCL's: its kernels done, not only queued)."""
        return self._fut.done() and (self._finished is None or self._finished.query())

    def get_future(self):
        return self._fut

    def _what(self):
        return "a collective"


class _MessageWork(_Work):
    """A send or receive (``ddlkernels.torch.p2p``); a receive from any rank knows its sender once done."""

    def __init__(self, fut, message, limit):
        super().__init__(fut, message.finished, limit)
        self._message = message

    def wait(self, timeout=None):
        with self._message.owner.hurry():
            return super().wait(timeout)

    def _source_rank(self):
        return self._message.source

    def _what(self):
        m = self._message
        return f"a send to rank {m.peer}" if m.send else f"a recv from rank {m.peer}" if m.peer >= 0 else \
            "a recv from any rank"


class ProcessGroupDDL(dist.ProcessGroup):
    """A torch process group whose collectives are ddlkernels' (the module comment).

    ``comm``: the mpi4py ``Intracomm`` of the group's ranks, in the group's
    rank order.  ``timeout``: seconds a collective may run (torch's
    ``timeout=``; None: no limit), then its ``Work`` and those queued behind
    it fail with ``ddlkernels.CollectiveTimeout`` and the group is unusable,
    as NCCL's after its watchdog (``ddlkernels.torch.watchdog``).
    Collective: the progress thread duplicates it.
    """

    def __init__(self, comm, owns_comm=False, timeout=None):
        from .ddp import ProgressStreams
        from .p2p import Messages
        from .watchdog import Watchdog

        super().__init__(comm.Get_rank(), comm.Get_size())
        self._state = ProgressStreams(Communicator(comm))
        self._messages = Messages(comm)
        self._timeout = timeout
        self._watchdog = Watchdog(timeout, comm.Get_rank(), BACKEND)
        self._owned = comm if owns_comm else None  # a group's own communicator, freed with the group
        self._name = self._desc = ""

    def shutdown(self):
        """``destroy_process_group``: the queued collectives run, then the progress thread ends and the
        group's communicators are freed (collective, as destroying a group is)."""
        self._watchdog.close()
        self._state.engine.close()
        self._messages.close()
        if self._watchdog.broken is not None:  # a collective timed out: its messages may be in flight
            abandon(self._state.comm, self._owned)
        else:
            self._state.comm.free()
            if self._owned is not None:
                self._owned.Free()
        self._owned = None

    def getBackendName(self):
        return BACKEND

    # The name and description torch gives a group live in the C++ group's backends, which a group written
    # in Python has none of: kept here (torch's destroy_process_group(group) unregisters it by name).
    def _set_group_name(self, name):
        self._name = name

    def _set_group_desc(self, desc):
        self._desc = desc

    @property
    def group_name(self):
        return self._name

    @property
    def group_desc(self):
        return self._desc

    def getGroupName(self):
        return self._name

    def getGroupDesc(self):
        return self._desc

    @property
    def communicator(self) -> Communicator:
        """The Communicator whose progress thread runs this group's collectives."""
        return self._state.engine.comm

    # -- what every operation shares -------------------------------------------------------------
    def _submit(self, tensors, fn, result, what):
        """Queue ``fn(c)`` (``c``: the progress thread's Communicator) after the work the caller queued on
        ``tensors``' device; a ``Work`` whose future holds ``result`` once ``fn`` has run.  ``what``: the call's
        name in torch, for a timeout's message."""
        watchdog = self._watchdog
        devices = {t.device for t in tensors if t.is_cuda}
        if len(devices) > 1:
            raise ValueError(f"{BACKEND}: one collective's tensors lie on one device, got {sorted(map(str, devices))}")
        dev = next(iter(devices), None)
        fut = torch.futures.Future(devices=[dev]) if dev is not None else torch.futures.Future()
        ready = finished = None
        if dev is not None:
            ready, finished = torch.cuda.Event(), torch.cuda.Event()
            ready.record(torch.cuda.current_stream(dev))
        state = self._state
        watchdog.add(fut)

        def run(c):
            if not watchdog.begin(fut, what):  # the group timed out meanwhile: fut has failed
                return
            try:
                with contextlib.ExitStack() as stack:
                    if dev is not None:
                        side = state.stream(dev)
                        stack.enter_context(torch.cuda.stream(side))
                        side.wait_event(ready)
                        for t in tensors:  # made on the caller's stream, used on this one until its work has run
                            t.record_stream(side)
                    fn(c)
                    if finished is not None:
                        finished.record(side)
                    # on the group's stream: a CUDA future records its event there
                    watchdog.end(fut, lambda: fut.set_result(result))
            except BaseException as exc:
                watchdog.end(fut, lambda: fut.set_exception(exc))
                raise

        state.engine.submit(run)
        return _Work(fut, finished)

    @classmethod
    def _checked(cls, tensors, what, count=1):
        """``tensors`` (a list of ``count``), each contiguous and of a dtype ddlkernels reduces: checked here,
        on the caller's thread, so that a bad call raises on its rank before any message."""
        for t in cls._contiguous(tensors, what, count):
            if t.dtype not in _MPI_REDUCED:
                check_dtype(_np_dtype(t))
        return tensors

    @staticmethod
    def _op(opts, what, dtype=None):
        """The ddlkernels op of ``opts.reduceOp`` (SUM without options); for a ``dtype`` of ``_MPI_REDUCED``, the
        MPI op that reduces it as gloo does."""
        try:
            op = normalize_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{BACKEND}: {what}: {exc}") from None
        if dtype not in _MPI_REDUCED:
            return op
        from mpi4py import MPI

        ops = _MPI_REDUCED[dtype]
        if op not in ops:
            raise ValueError(f"{BACKEND}: {what} of {dtype} takes {', '.join(o.upper() for o in ops)}, not "
                             f"{op.upper()}")
        return getattr(MPI, ops[op])

    def _rank_order(self, c, count):
        """``dims`` under which ``c`` cuts ``count`` elements into equal blocks in rank order: None (the
        Communicator's own box) where it already does, else the flat ring's ``(p,)``."""
        p, block = c.size, count // c.size
        if all(c.shard_range(count, rank=q) == (q * block, (q + 1) * block) for q in range(p)):
            return None
        return (p,)

    # -- the collectives -------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        (t,) = self._checked(tensors, "all_reduce")
        op = self._op(opts, "all_reduce", t.dtype)
        if t.dtype in _MPI_REDUCED:
            return self._submit(tensors, lambda c: _mpi_allreduce(c, t, op), tensors, "all_reduce")
        return self._submit(tensors, lambda c: c.allreduce(t, op, out=t), tensors, "all_reduce")

    def allreduce_coalesced(self, tensors, opts=None):
        self._checked(tensors, "all_reduce_coalesced", len(tensors))
        ours = [t for t in tensors if t.dtype not in _MPI_REDUCED]
        op = self._op(opts, "all_reduce_coalesced")
        theirs = [(t, self._op(opts, "all_reduce_coalesced", t.dtype)) for t in tensors if t.dtype in _MPI_REDUCED]

        def fn(c):
            from ..fusion import allreduce_many

            if ours:
                allreduce_many(ours, op, comm=c, out=ours)
            for t, mpi_op in theirs:
                _mpi_allreduce(c, t, mpi_op)

        return self._submit(tensors, fn, tensors, "all_reduce_coalesced")

    def reduce(self, tensors, opts):
        (t,) = self._checked(tensors, "reduce")
        op, root = self._op(opts, "reduce", t.dtype), int(opts.rootRank)

        def fn(c):
            if t.dtype in _MPI_REDUCED:  # the sum into a copy: every rank's input left alone, as NCCL's reduce
                got = t.clone()
                _mpi_allreduce(c, got, op)
            else:
                got = c.allreduce(t, op)
            if c.rank == root:
                t.copy_(got)

        return self._submit(tensors, fn, tensors, "reduce")

    def broadcast(self, tensors, opts):
        (t,) = self._contiguous(tensors, "broadcast")
        root = int(opts.rootRank)

        def fn(c):
            raw = _bytes(t)  # t's own memory for a CPU tensor, a host copy of a CUDA one
            c.comm.Bcast(raw, root=root)
            if t.is_cuda and c.rank != root:
                _put(t, raw)

        return self._submit(tensors, fn, tensors, "broadcast")

    def allgather(self, output_tensors, input_tensors, opts=None):
        (t,) = self._contiguous(input_tensors, "all_gather")
        if len(output_tensors) != 1 or len(output_tensors[0]) != self.size():
            raise ValueError(f"{BACKEND}: all_gather takes one list of {self.size()} output tensors")
        outs = output_tensors[0]
        n = t.numel()
        for o in outs:
            if o.numel() != n or o.dtype != t.dtype or o.device != t.device:
                raise ValueError(f"{BACKEND}: all_gather's outputs must be like its input ({n} elements of "
                                 f"{t.dtype} on {t.device})")
        word, nbytes = _word(t), n * t.element_size()
        words = None if word is None else _as_words(t, word, copy=True)

        def fn(c):
            if word is None:
                whole = np.empty(nbytes * c.size, np.uint8)
                c.comm.Allgather(_bytes(t), whole)
                whole = torch.from_numpy(whole)
            else:
                m = words.numel() * c.size
                whole = c.allgather(words, count=m, dims=self._rank_order(c, m)).view(torch.uint8)
            for q, o in enumerate(outs):  # an output need not be contiguous: copied into, not viewed
                o.copy_(whole[q * nbytes:(q + 1) * nbytes].view(o.dtype).view(o.shape))

        return self._submit([t, *outs], fn, output_tensors, "all_gather")

    def _allgather_base(self, output, input, opts=None):
        self._contiguous([input, output], "all_gather_into_tensor", 2)
        n, whole = input.numel(), output.numel()
        if whole != n * self.size() or output.dtype != input.dtype:
            raise ValueError(f"{BACKEND}: all_gather_into_tensor's output holds {self.size()} x the input "
                             f"({n} elements of {input.dtype}), got {whole} of {output.dtype}")
        word = _word(input)
        src = None if word is None else _as_words(input, word, copy=True)
        dst = None if word is None else _as_words(output, word)

        def fn(c):
            if word is None:
                raw = np.empty(output.numel() * output.element_size(), np.uint8)
                c.comm.Allgather(_bytes(input), raw)
                _put(output, raw)
                return
            # FSDP gathers in place (the input is this rank's block of the output), as NCCL allows; ddlkernels
            # refuses an output over its input, so the input is copied aside first.
            m = src.numel() * c.size
            s = src.clone() if _overlap(src, output) else src
            got = c.allgather(s, count=m, out=dst, dims=self._rank_order(c, m))
            if dst is None:  # an output off the words' boundary: gathered aside, its bytes copied in
                output.reshape(-1).view(torch.uint8).copy_(got.view(torch.uint8))

        return self._submit([input, output], fn, [output], "all_gather_into_tensor")

    all_gather_single = _allgather_base  # the name torch calls it by from 2.13 on

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._coalesced(self._allgather_base, outputs, inputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _coalesced(self, one, outputs, inputs, opts):
        """``one`` for each pair: the works run in order on the progress thread, so the last one's completion
        is every one's."""
        if len(outputs) != len(inputs):
            raise ValueError(f"{BACKEND}: {len(outputs)} outputs for {len(inputs)} inputs")
        works = [one(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self._submit([], lambda c: None, outputs, "a coalesced call")

    def _reduce_scatter_base(self, output, input, opts=None):
        self._checked([output, input], "reduce_scatter_tensor", 2)
        op = self._op(opts, "reduce_scatter_tensor", output.dtype)
        n, whole = output.numel(), input.numel()
        if whole != n * self.size() or output.dtype != input.dtype:
            raise ValueError(f"{BACKEND}: reduce_scatter_tensor's input holds {self.size()} x the output "
                             f"({n} elements of {output.dtype}), got {whole} of {input.dtype}")

        def fn(c):
            if output.dtype in _MPI_REDUCED:
                return _mpi_reduce_scatter(c, input, output, op)
            dims = self._rank_order(c, whole)
            if not _overlap(output, input):
                c.reduce_scatter(input.reshape(-1), op, out=output.reshape(-1), dims=dims)
            else:  # the output is this rank's block of the input (in place, as NCCL allows): through a new one
                output.reshape(-1).copy_(c.reduce_scatter(input.reshape(-1), op, dims=dims))

        return self._submit([output, input], fn, [output], "reduce_scatter_tensor")

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        (o,) = self._checked(output_tensors, "reduce_scatter")
        if len(input_tensors) != 1 or len(input_tensors[0]) != self.size():
            raise ValueError(f"{BACKEND}: reduce_scatter takes one list of {self.size()} input tensors")
        ins = self._checked(input_tensors[0], "reduce_scatter", self.size())
        if any(i.numel() != o.numel() or i.dtype != o.dtype for i in ins):
            raise ValueError(f"{BACKEND}: reduce_scatter's inputs must be like its output")
        op = self._op(opts, "reduce_scatter", o.dtype)
        n = o.numel()

        def fn(c):
            whole = torch.cat([i.reshape(-1) for i in ins])  # on this thread's stream, after the caller's work
            if o.dtype in _MPI_REDUCED:
                return _mpi_reduce_scatter(c, whole, o, op)
            c.reduce_scatter(whole, op, out=o.reshape(-1), dims=self._rank_order(c, n * c.size))

        return self._submit([o, *ins], fn, output_tensors, "reduce_scatter")

    reduce_scatter_single = _reduce_scatter_base  # the name torch calls it by from 2.13 on

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._coalesced(self._reduce_scatter_base, outputs, inputs, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def barrier(self, opts=None):
        return self._submit([], lambda c: c.comm.Barrier(), None, "barrier")

    # -- data moved as it is, through host memory (MPI's own collectives on the bytes) -----------------
    def gather(self, output_tensors, input_tensors, opts):
        (t,) = self._contiguous(input_tensors, "gather")
        root = int(opts.rootRank)
        outs = self._like(output_tensors, t, "gather") if self.rank() == root else []

        def fn(c):
            whole = np.empty(t.numel() * t.element_size() * c.size, np.uint8) if c.rank == root else None
            c.comm.Gather(_bytes(t), whole, root=root)
            for o, raw in zip(outs, np.split(whole, c.size) if whole is not None else ()):
                _put(o, raw)

        return self._submit([t, *outs], fn, output_tensors, "gather")

    def scatter(self, output_tensors, input_tensors, opts):
        (t,) = self._contiguous(output_tensors, "scatter")
        root = int(opts.rootRank)
        ins = self._like(input_tensors, t, "scatter") if self.rank() == root else []

        def fn(c):
            whole = np.concatenate([_bytes(i) for i in ins]) if c.rank == root else None
            raw = np.empty(t.numel() * t.element_size(), np.uint8)
            c.comm.Scatter(whole, raw, root=root)
            _put(t, raw)

        return self._submit([t, *ins], fn, output_tensors, "scatter")

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        self._contiguous([output, input], "all_to_all_single", 2)
        if output.dtype != input.dtype:
            raise ValueError(f"{BACKEND}: all_to_all_single's output is {output.dtype}, its input {input.dtype}")
        send = _splits(input, input_split_sizes, self.size(), "input")
        recv = _splits(output, output_split_sizes, self.size(), "output")

        def fn(c):
            raw = np.empty(output.numel() * output.element_size(), np.uint8)
            c.comm.Alltoallv([_bytes(input), send], [raw, recv])
            _put(output, raw)

        return self._submit([output, input], fn, output, "all_to_all_single")

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        p = self.size()
        if len(output_tensors) != p or len(input_tensors) != p:
            raise ValueError(f"{BACKEND}: all_to_all takes {p} input and {p} output tensors")
        self._contiguous([*output_tensors, *input_tensors], "all_to_all", 2 * p)
        send = _counts([i.numel() * i.element_size() for i in input_tensors])
        recv = _counts([o.numel() * o.element_size() for o in output_tensors])

        def fn(c):
            raw = np.empty(sum(recv[0]), np.uint8)
            c.comm.Alltoallv([np.concatenate([_bytes(i) for i in input_tensors]), send], [raw, recv])
            for o, lo, n in zip(output_tensors, recv[1], recv[0]):
                _put(o, raw[lo:lo + n])

        return self._submit([*output_tensors, *input_tensors], fn, output_tensors, "all_to_all")

    @staticmethod
    def _contiguous(tensors, what, count=1):
        """``tensors`` (a list of ``count``), each contiguous: what a collective that moves bytes needs."""
        if len(tensors) != count:
            raise ValueError(f"{BACKEND}: {what} takes {count} tensor(s) a process, got {len(tensors)}")
        if not all(t.is_contiguous() for t in tensors):
            raise ValueError(f"{BACKEND}: {what} needs contiguous tensors (call .contiguous() first)")
        return tensors

    def _like(self, lists, t, what):
        """The one list of ``size()`` tensors like ``t`` of a gather's outputs or a scatter's inputs."""
        if len(lists) != 1 or len(lists[0]) != self.size():
            raise ValueError(f"{BACKEND}: {what} takes one list of {self.size()} tensors on the root")
        if any(x.numel() != t.numel() or x.dtype != t.dtype for x in lists[0]):
            raise ValueError(f"{BACKEND}: {what}'s list holds tensors like {t.numel()} elements of {t.dtype}")
        return self._contiguous(lists[0], what, self.size())

    # -- point-to-point: beside the collectives' queue, never in it (ddlkernels.torch.p2p) ----------------
    def _message_work(self, fut, message):
        """A message's ``Work``: its ``wait()`` without a timeout of its own waits the group's, as gloo's."""
        return _MessageWork(fut, message, self._timeout)

    def send(self, tensors, dst, tag):
        (t,) = self._contiguous(tensors, "send")
        return self._messages.post(t, dst, tag, True, self._message_work)

    def recv(self, tensors, src, tag):
        (t,) = self._contiguous(tensors, "recv")
        return self._messages.post(t, src, tag, False, self._message_work)

    def recv_anysource(self, tensors, tag):
        (t,) = self._contiguous(tensors, "recv")
        return self._messages.post(t, None, tag, False, self._message_work)


#: dtypes gloo reduces that ddlkernels does not, reduced by MPI's own collectives through host memory (flags and
#: counts, small): each one's torch ops and the MPI ops that reduce them as gloo does (on bool SUM and MAX are
#: "or", PRODUCT and MIN "and"; MPI takes only logical ops on C_BOOL).
_MPI_REDUCED = {torch.uint8: {"sum": "SUM", "max": "MAX", "min": "MIN", "prod": "PROD"},
                torch.int8: {"sum": "SUM", "max": "MAX", "min": "MIN", "prod": "PROD"},
                torch.bool: {"sum": "LOR", "max": "LOR", "min": "LAND", "prod": "LAND"}}


def _host(t):
    """Contiguous ``t`` flat as a numpy array: a CPU tensor's own memory, a host copy of a CUDA one (on the
    current stream, waited for)."""
    flat = t.detach().reshape(-1)
    return (flat.cpu() if flat.is_cuda else flat).numpy()


def _mpi_allreduce(c, t, op):
    """MPI's Allreduce of ``t`` (a dtype of ``_MPI_REDUCED``) in place."""
    from mpi4py import MPI

    arr = _host(t)
    c.comm.Allreduce(MPI.IN_PLACE, arr, op=op)
    if t.is_cuda:
        t.copy_(torch.from_numpy(arr).reshape(t.shape))


def _mpi_reduce_scatter(c, whole, out, op):
    """MPI's Reduce_scatter_block of ``whole`` into ``out`` (a dtype of ``_MPI_REDUCED``; in place too)."""
    send = _host(whole)
    got = np.empty(out.numel(), send.dtype)
    c.comm.Reduce_scatter_block(send, got, op=op)
    out.copy_(torch.from_numpy(got).reshape(out.shape))


def _np_dtype(t):
    """The numpy dtype ddlkernels reduces ``t`` as (bfloat16 as ml_dtypes' where it is installed)."""
    if t.dtype == torch.bfloat16:
        from .._dtypes import BFLOAT16

        if BFLOAT16 is None:
            raise TypeError("bfloat16 tensors need ml_dtypes: pip install ml_dtypes")
        return BFLOAT16
    try:
        return np.dtype(str(t.dtype).replace("torch.", ""))
    except TypeError:
        raise TypeError(f"{BACKEND}: tensors of {t.dtype} are not reduced (supported: float16, bfloat16, "
                        f"float32, float64, int32, int64)") from None


def _word(t):
    """The dtype ddlkernels' allgather moves contiguous ``t``'s bytes as, bit for bit: ``t``'s own where ddlkernels
    takes it, else int64 or int32 words (FSDP2 gathers parameters of mixed dtypes as uint8); None where neither
    word divides the bytes (MPI's Allgather moves them then).  From the dtype and size alone, which every rank
    shares: the ranks take the same path."""
    try:
        check_dtype(_np_dtype(t))
        return t.dtype
    except TypeError:
        pass
    nbytes = t.numel() * t.element_size()
    return next((w for w in (torch.int64, torch.int32) if nbytes % w.itemsize == 0), None)


def _as_words(t, word, copy=False):
    """Contiguous ``t`` flat as ``word`` elements: a view, or (``copy``) a copy where ``t`` does not start on a
    word's boundary; None there otherwise."""
    flat = t.detach().reshape(-1)
    if word == t.dtype:
        return flat
    raw = flat.view(torch.uint8)
    if raw.storage_offset() % word.itemsize:
        return raw.clone().view(word) if copy else None
    return raw.view(word)


def _overlap(a, b) -> bool:
    """Whether the memory of contiguous tensors ``a`` and ``b`` overlaps."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a.numel() > 0 and b.numel() > 0 and a0 < b0 + b.numel() * b.element_size() and \
        b0 < a0 + a.numel() * a.element_size()


def _bytes(t):
    """Contiguous tensor ``t``'s bytes as a numpy uint8 array (``_host``)."""
    return _host(t.detach().reshape(-1).view(torch.uint8))


def _put(t, raw):
    """The bytes ``raw`` (numpy uint8) into contiguous tensor ``t``, on the current stream."""
    t.copy_(torch.from_numpy(raw).view(t.dtype).reshape(t.shape))


def _counts(sizes):
    """(counts, displacements) of consecutive blocks of ``sizes`` bytes, for MPI's v-collectives."""
    return list(sizes), [int(d) for d in np.cumsum([0, *sizes[:-1]])] if sizes else []


def _splits(t, split_sizes, p, what):
    """all_to_all_single's (counts, displacements) in bytes of ``t`` cut by ``split_sizes`` rows (empty: ``p``
    equal parts), checked here."""
    rows = t.shape[0] if t.dim() else 1
    if not split_sizes:
        if rows % p:
            raise ValueError(f"{BACKEND}: all_to_all_single's {what} has {rows} rows, not a multiple of {p}")
        split_sizes = [rows // p] * p
    if len(split_sizes) != p or sum(split_sizes) != rows:
        raise ValueError(f"{BACKEND}: all_to_all_single's {what} splits {list(split_sizes)} do not cut {rows} rows "
                         f"into {p}")
    row = t.numel() // rows * t.element_size() if rows else 0
    return _counts([int(s) * row for s in split_sizes])


def _create(options, _backend_options=None):
    """``register_backend``'s creator (its extended form): the group's MPI communicator from the global ranks
    torch names, checked against torch's own rank numbers."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    ranks = list(options.global_ranks_in_group)
    if not ranks:  # the default group
        if (options.group_rank, options.group_size) != (world.Get_rank(), world.Get_size()):
            raise RuntimeError(f"{BACKEND}: torch's rank {options.group_rank} of {options.group_size} is MPI's "
                               f"{world.Get_rank()} of {world.Get_size()}; start with "
                               f"ddlkernels.torch.init_process_group('{BACKEND}'), which takes MPI's")
        return ProcessGroupDDL(world, timeout=_seconds(options))
    group = world.Get_group().Incl(ranks)
    try:
        comm = world.Create_group(group)  # collective over the group's ranks alone
    finally:
        group.Free()
    return ProcessGroupDDL(comm, owns_comm=True, timeout=_seconds(options))


def _seconds(options):
    """torch's ``timeout`` of a group in seconds (None where it has none)."""
    t = getattr(options, "timeout", None)
    return t.total_seconds() if t is not None and t.total_seconds() > 0 else None


def register() -> None:
    """Make ``"ddlkernels"`` a ``torch.distributed`` backend (done by ``import ddlkernels.torch``)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
