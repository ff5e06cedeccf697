"""``DistributedOptimizer``: gradient reduction overlapped with backward, in Horovod's shape.

Worked example of one step, a 3-layer MLP, fusion buckets in reverse layer
order (backward produces the last layer's gradients first)::

    backward:  fc3.bias fc3.weight | fc2.bias fc2.weight | fc1.bias fc1.weight
    buckets:   #0 = [fc3.*] ready -> packed, reduction starts
               #1 = [fc2.*] ready -> packed, starts while fc1's gradients are computed
               #2 = [fc1.*] ready -> packed, starts
    step():    wait #0 #1 #2, copy the averages back into .grad, optimizer update

Buckets start strictly in order 0, 1, 2, ... on every rank (a bucket whose
gradients are ready waits for the ones before it), so all ranks issue their
collectives in the same order whatever order the hooks fire in.  The layout
(names, dtypes, shapes, settings) is compared across ranks once, when the
optimizer is built.  ``overlap=False`` reduces the same buckets with the same
algorithm after backward instead (the progress thread's communicator takes
the settings of ``comm``), so with a fixed ``small_bytes`` the parameters
are bitwise equal either way.  A one-rank job reduces nothing: the average
over one rank is the gradient.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from ..communicator import as_communicator
from .._dtypes import check_dtype, dtype_name, normalize_op
from ..fusion import FUSION_BYTES, pack_into, plan_buckets, reduce_packed, unpack_from
from ..safety.agreement import check_same_on_all_ranks
from ..backends import backend_for
from .compression import _compressor, _wire_dtype

__all__ = ["DistributedOptimizer", "OPTIMIZER_FUSION_BYTES"]

#: Default bucket size of DistributedOptimizer: small enough that the first
#: buckets start early in backward, large enough to amortise a collective
#: (torch DDP's default is 25 MiB).
OPTIMIZER_FUSION_BYTES = 25 << 20
assert OPTIMIZER_FUSION_BYTES <= FUSION_BYTES


def DistributedOptimizer(
    optimizer,
    named_parameters=None,
    *,
    fusion_bytes=None,
    op="avg",
    backward_passes_per_step: int = 1,
    comm=None,
    overlap: bool = True,
    progress: str = "auto",
    compression=None,
    missing_grads: str = "zeros",
):
    """Wrap ``optimizer`` so that ``step()`` applies gradients reduced over every rank.

    optimizer                 a ``torch.optim.Optimizer``; the result is an instance of
                              a subclass of its class (so LR schedulers accept it).
    named_parameters          ``model.named_parameters()``: names for the error messages
                              and the cross-rank layout check.  Default: the optimizer's
                              parameters, named by position.
    fusion_bytes              largest bucket in bytes (default 25 MiB).
    op                        "avg" (default) or "sum" over ranks.
    backward_passes_per_step  local gradient accumulation: reductions start on the
                              last of this many ``backward()`` calls before each ``step()``.
    comm                      mpi4py ``Intracomm`` or ``ddlkernels.Communicator``.
    overlap                   True: gradient hooks start each bucket's reduction during
                              backward.  False: all buckets are reduced in ``step()``.
    progress                  "hooks", "thread" or "auto" (default: "hooks" when every bucket
                              is a host float32/float64/int32/int64 buffer, else "thread";
                              see ``ddlkernels.asynchronous`` and the measurements in docs/fusion.md).
    compression               ``Compression.none`` (default), ``Compression.fp16`` or
                              ``Compression.bf16`` (floating gradients travel in 16 bits,
                              Horovod's ``Compression.fp16``), or any object with Horovod's
                              ``compress(t) -> (t16, ctx)`` and ``decompress(t16, ctx)``.
                              With a 16-bit wire and op "avg", each rank's gradient is
                              divided by the rank count before it is compressed (as torch's
                              ``fp16_compress_hook`` does), so that the sum on the wire
                              overflows float16 only where the average itself would.
    missing_grads             "zeros" (default, Horovod's behaviour): a parameter without a
                              gradient on some rank counts as zeros there, so the others'
                              gradients are averaged with those zeros, and ``.grad`` is set on
                              every rank; one that got no gradient on any rank keeps
                              ``.grad = None`` (the optimizer skips it, as in one process and
                              in DDP; Horovod would apply zeros).  "error": raise
                              ``ValueError`` on every rank instead, naming the parameters.

    Collective (all ranks must build it with the same model).  Raises
    ``ValueError`` on every rank when the ranks' parameter lists differ.
    """
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, fusion_bytes, op, backward_passes_per_step, comm, overlap,
               progress, compression, missing_grads)


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the dynamic subclass built by ``DistributedOptimizer`` (Horovod's pattern)."""

    def __init__(self, params, named_parameters, fusion_bytes, op, backward_passes_per_step, comm, overlap,
                 progress, compression, missing_grads):
        super(self.__class__, self).__init__(params)
        self._ddl_setup(named_parameters, fusion_bytes, op, backward_passes_per_step, comm, overlap, progress,
                        compression, missing_grads)

    # -- construction ------------------------------------------------------------
    def _ddl_setup(self, named_parameters, fusion_bytes, op, bpps, comm, overlap, progress, compression,
                   missing_grads):
        from ..asynchronous import PROGRESS_MODES, progress_engine

        opname = normalize_op(op)
        if opname not in ("avg", "sum"):
            raise ValueError(f"DistributedOptimizer reduces gradients with 'avg' or 'sum', got {op!r}")
        if missing_grads not in ("zeros", "error"):
            raise ValueError(f"missing_grads must be 'zeros' or 'error', got {missing_grads!r}")
        self._ddl_missing = missing_grads
        compressor = _compressor(compression)
        if isinstance(bpps, bool) or not isinstance(bpps, int) or bpps < 1:
            raise ValueError(f"backward_passes_per_step must be a positive int, got {bpps!r}")
        if progress not in PROGRESS_MODES + ("auto",):
            raise ValueError(f"progress must be one of {', '.join(PROGRESS_MODES)}, auto; got {progress!r}")
        fusion_bytes = OPTIMIZER_FUSION_BYTES if fusion_bytes is None else int(fusion_bytes)
        if fusion_bytes < 1:
            raise ValueError(f"fusion_bytes must be a positive int, got {fusion_bytes!r}")
        in_groups = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(in_groups)]
        else:
            named = list(named_parameters)
            if any(not (isinstance(t, tuple) and len(t) == 2) for t in named):
                raise ValueError("named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()")
            names = [n for n, _ in named]
            if len(set(names)) != len(names):
                dup = sorted({n for n in names if names.count(n) > 1})
                raise ValueError(f"named_parameters holds duplicate names: {dup}")
            ids = {id(p) for _, p in named}
            unnamed = [i for i, p in enumerate(in_groups) if id(p) not in ids]
            if unnamed:
                raise ValueError(
                    f"named_parameters does not name {len(unnamed)} parameter(s) of the optimizer "
                    f"(positions {unnamed[:8]} in its param_groups)"
                )
            group_ids = {id(p) for p in in_groups}
            named = [(n, p) for n, p in named if id(p) in group_ids]
        named = [(n, p) for n, p in named if p.requires_grad]
        devices = {}
        for n, p in named:
            devices.setdefault(str(p.device), n)
        if len(devices) > 1:
            (d0, n0), (d1, n1) = list(devices.items())[:2]
            raise ValueError(
                f"DistributedOptimizer: all parameters must be on one device, but {n0!r} is on {d0} and {n1!r} on {d1}"
            )
        order = named[::-1]  # backward produces the last layers' gradients first
        self._ddl_names = [n for n, _ in order]
        self._ddl_params = [p for _, p in order]
        # The dtype each gradient travels in: the compressor's output for an empty tensor of the parameter's.
        self._ddl_compression = compressor
        self._ddl_wire = [p.dtype if compressor is None else _wire_dtype(compressor, p) for p in self._ddl_params]
        self._ddl_ctx = [None] * len(self._ddl_params)
        dtypes = [check_dtype(backend_input_dtype(torch.empty(0, dtype=w))) for w in self._ddl_wire]
        self._ddl_buckets = plan_buckets([(tuple(p.shape), d) for p, d in zip(self._ddl_params, dtypes)],
                                         fusion_bytes)
        self._ddl_bucket_of = [0] * len(order)
        for k, b in enumerate(self._ddl_buckets):
            for e in b.entries:
                self._ddl_bucket_of[e.index] = k
        self._ddl_comm = as_communicator(comm)
        self._ddl_op = opname
        self._ddl_bpps = bpps
        #: True: hooks start bucket reductions during backward; False: step() reduces
        #: every bucket after backward.  May be changed between steps, on every rank alike.
        self.ddl_overlap = bool(overlap)
        host = not self._ddl_params or self._ddl_params[0].device.type == "cpu"
        mpi_adds = all(dtype_name(d) in ("float32", "float64", "int32", "int64") for d in dtypes)
        if progress == "auto":
            # Measured (docs/fusion.md): polled MPI_Iallreduce exposed less
            # communication than the progress thread in the training example;
            # the thread is the driver that handles every dtype and device.
            progress = "hooks" if host and mpi_adds else "thread"
        elif progress == "hooks" and not (host and mpi_adds):
            # Found here, not in the first backward: a compressed wire (float16) makes this easy to ask for.
            raise ValueError("progress='hooks' reduces host float32/float64/int32/int64 buckets with MPI_Iallreduce; "
                             f"these travel as {sorted({dtype_name(d) for d in dtypes})} on {self._ddl_params[0].device}"
                             "; use progress='thread' or 'auto'")
        self.ddl_progress = progress
        signature = ["DistributedOptimizer", opname, (fusion_bytes, bpps, bool(overlap), progress, missing_grads)] + [
            (f"{n} {dtype_name(d)}", tuple(p.shape)) for n, p, d in zip(self._ddl_names, self._ddl_params, dtypes)
        ]
        check_same_on_all_ranks(self._ddl_comm.comm, signature, "DistributedOptimizer")
        # Created even with overlap=False (collectively, here), so that
        # ``ddl_overlap`` can be switched between steps.
        self._ddl_engine = progress_engine(self._ddl_comm, progress)
        self._ddl_backend = backend_for(self._ddl_params[0].detach()) if self._ddl_params else None
        self._ddl_bufs = [self._ddl_backend.empty(b.count, b.dtype) for b in self._ddl_buckets]
        self._ddl_unpacked = [None] * len(self._ddl_buckets)  # device: event of each buffer's last unpack
        if self._ddl_bufs and not self._ddl_backend.device:
            for buf in self._ddl_bufs:
                buf[...] = 0
        self._ddl_hooks = [p.register_post_accumulate_grad_hook(self._ddl_make_hook(i))
                           for i, p in enumerate(self._ddl_params)]
        self._ddl_reset_step()
        self._ddl_should_sync = True
        self.ddl_reset_timing()

    def ddl_set_progress(self, progress: str) -> None:
        """Switch the progress engine ("thread" or "hooks") between steps, on every rank alike.

        Collective the first time a mode is used (its engine duplicates the
        communicator).  Raises ``RuntimeError`` while reductions are in flight.
        """
        from ..asynchronous import progress_engine

        if any(w is not None for w in self._ddl_works):
            raise RuntimeError("ddl_set_progress() called while gradient reductions are in flight")
        self._ddl_engine = progress_engine(self._ddl_comm, progress)
        self.ddl_progress = progress

    def _ddl_reset_step(self):
        self._ddl_counts = [0] * len(self._ddl_params)
        self._ddl_ready = [0] * len(self._ddl_buckets)
        self._ddl_works = [None] * len(self._ddl_buckets)
        self._ddl_next = 0  # index of the next bucket to start

    def ddl_reset_timing(self):
        """Zero ``ddl_timing``: seconds spent in gradient hooks (packing, starting) and in ``synchronize()``."""
        self.ddl_timing = {"hook_s": 0.0, "sync_s": 0.0, "steps": 0}

    # -- during backward ---------------------------------------------------------
    def _ddl_make_hook(self, i):
        def hook(param):
            t0 = time.perf_counter()
            c = self._ddl_counts[i] + 1
            if c > self._ddl_bpps:
                raise RuntimeError(
                    f"gradient of {self._ddl_names[i]!r} computed {c} times before step(), but "
                    f"backward_passes_per_step={self._ddl_bpps}; call step() after every "
                    f"{self._ddl_bpps} backward pass(es) or raise backward_passes_per_step"
                )
            self._ddl_counts[i] = c
            if c == self._ddl_bpps:
                self._ddl_ready[self._ddl_bucket_of[i]] += 1
                if self.ddl_overlap:
                    self._ddl_start_ready()
                    self._ddl_engine.poll()
            self.ddl_timing["hook_s"] += time.perf_counter() - t0

        return hook

    def _ddl_start_ready(self):
        buckets = self._ddl_buckets
        while self._ddl_next < len(buckets) and self._ddl_ready[self._ddl_next] == len(buckets[self._ddl_next].entries):
            self._ddl_start(self._ddl_next, self._ddl_grads_of(self._ddl_next))
            self._ddl_next += 1

    def _ddl_grads_of(self, k):
        grads = {}
        comp = self._ddl_compression
        for e in self._ddl_buckets[k].entries:
            i = e.index
            p = self._ddl_params[i]
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if comp is not None:
                if self._ddl_predivided(self._ddl_wire[i]):
                    g = g / self._ddl_comm.size  # divided first: the 16-bit sum overflows only where the average does
                g, self._ddl_ctx[i] = comp.compress(g)
            grads[i] = g
        return grads

    def _ddl_stream(self):
        """CUDA parameters: this thread's current torch stream as the compute stream of the block (packs,
        unpacks and the reductions' ordering run there); host parameters: nothing."""
        be = self._ddl_backend
        if be is None or not be.device:
            return contextlib.nullcontext()
        p = self._ddl_params[0]
        return be.using(be.call_stream(p), be.device_id(p))

    def _ddl_start(self, k, grads):
        if self._ddl_comm.size == 1:
            return  # the average (or sum) over one rank is the gradient itself
        b, buf, be = self._ddl_buckets[k], self._ddl_bufs[k], self._ddl_backend
        # A bucket holds one wire dtype (plan_buckets), so its entries were all divided first, or none.
        op = "sum" if self._ddl_predivided(self._ddl_wire[b.entries[0].index]) else self._ddl_op
        # In a gradient hook: the current stream is the one backward computed these gradients on.
        with self._ddl_stream():
            if self._ddl_unpacked[k] is not None:  # last step's unpack (on step()'s stream) read buf
                be.wait(be.compute_stream(), self._ddl_unpacked[k])
            pack_into(be, b, buf, grads)
            if self.ddl_overlap:
                self._ddl_works[k] = self._ddl_engine.reduce_async(buf, op, be, b.dtype)
            else:
                reduce_packed(self._ddl_comm, be, buf, b.dtype, op)

    def _ddl_predivided(self, wire) -> bool:
        """Whether gradients of this wire dtype are divided by the rank count before compression, then summed."""
        return (self._ddl_compression is not None and self._ddl_op == "avg" and wire.is_floating_point
                and wire.itemsize == 2)

    # -- step --------------------------------------------------------------------
    def synchronize(self):
        """Finish every bucket's reduction and write the results into ``.grad`` (collective).

        A parameter that did not get ``backward_passes_per_step`` gradients
        since the last step on some rank is reduced with what it has there
        (zeros for none), see ``missing_grads``; with ``missing_grads="error"``
        every rank raises ``ValueError`` instead, after the reductions already
        under way are completed, so no rank is left waiting.
        """
        t0 = time.perf_counter()
        missing = [i for i, c in enumerate(self._ddl_counts) if c != self._ddl_bpps]
        comm = self._ddl_comm.comm
        if comm.Get_size() > 1:
            flag = np.array([1 if missing else 0], dtype=np.int32)
            from mpi4py import MPI

            comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
            anyone = bool(flag[0])
        else:
            anyone = bool(missing)
        try:
            # Start what has not started (all of it when overlap is off;
            # with a missing gradient, zeros stand in so that every rank's
            # collectives still match and complete).
            while self._ddl_next < len(self._ddl_buckets):
                self._ddl_start(self._ddl_next, self._ddl_grads_of(self._ddl_next))
                self._ddl_next += 1
            with self._ddl_stream():  # device: the current stream waits for each reduction, then unpacks
                for w in self._ddl_works:
                    if w is not None:
                        w.wait()
            if anyone and self._ddl_missing == "error":
                mine = [f"{self._ddl_names[i]!r} ({self._ddl_counts[i]} of {self._ddl_bpps})" for i in missing]
                every = comm.allgather(mine) if comm.Get_size() > 1 else [mine]
                detail = "; ".join(f"rank {r}: {', '.join(m)}" for r, m in enumerate(every) if m)
                raise ValueError(
                    "DistributedOptimizer: parameters that did not receive a gradient in every backward pass "
                    f"before step(): {detail}.  Every parameter given to the optimizer must get a gradient each "
                    "pass on every rank: leave unused ones out of named_parameters and the optimizer, or set "
                    "requires_grad=False, or pass missing_grads='zeros'"
                )
            if comm.Get_size() > 1:
                with self._ddl_stream():
                    self._ddl_unpack(self._ddl_grads_anywhere(comm) if anyone else None)
        finally:
            self._ddl_reset_step()
            self.ddl_timing["sync_s"] += time.perf_counter() - t0
            self.ddl_timing["steps"] += 1

    def _ddl_grads_anywhere(self, comm):
        """Per parameter: whether some rank holds a gradient for it (collective; only after a missing one)."""
        from mpi4py import MPI

        have = np.array([p.grad is not None for p in self._ddl_params], dtype=np.int32)
        comm.Allreduce(MPI.IN_PLACE, have, op=MPI.MAX)
        return have

    def _ddl_unpack(self, have):
        """Write every bucket's reduced values into ``.grad``; ``have`` (missing gradients only): which
        parameters some rank had a gradient for -- those without one here get zeros first, those without
        one anywhere keep ``.grad = None``."""
        comp = self._ddl_compression
        for k, b in enumerate(self._ddl_buckets):
            outs = {}
            for e in b.entries:
                i = e.index
                p = self._ddl_params[i]
                if have is not None and p.grad is None:
                    if not have[i]:
                        outs[i] = torch.empty(p.shape, dtype=self._ddl_wire[i], device=p.device)  # discarded
                        continue
                    p.grad = torch.zeros_like(p)
                outs[i] = p.grad if comp is None else torch.empty(p.shape, dtype=self._ddl_wire[i], device=p.device)
            be = self._ddl_backend
            unpack_from(be, b, self._ddl_bufs[k], outs)
            if be.device:  # the next pack into this buffer waits for this read of it
                self._ddl_unpacked[k] = be.record(be.compute_stream())
            if comp is not None:
                for e in b.entries:
                    p = self._ddl_params[e.index]
                    if p.grad is not None:
                        p.grad.copy_(comp.decompress(outs[e.index], self._ddl_ctx[e.index]))

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``synchronize()``; clip gradients; ``with opt.skip_synchronize(): opt.step()`` (Horovod's idiom)."""
        self._ddl_should_sync = False
        try:
            yield
        finally:
            self._ddl_should_sync = True

    def step(self, closure=None):
        if self._ddl_should_sync:
            self.synchronize()
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if any(w is not None for w in self._ddl_works):
            raise RuntimeError(
                "zero_grad() called while gradient reductions are in flight; call step() or synchronize() first"
            )
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def backend_input_dtype(t) -> np.dtype:
    """The numpy dtype of a torch tensor's elements (bfloat16 as ml_dtypes' bfloat16)."""
    from .._dtypes import BFLOAT16

    if t.dtype == torch.bfloat16:
        return BFLOAT16
    return np.dtype(torch.empty((), dtype=t.dtype).numpy().dtype)
