"""Fuzz of the device path: hypothesis draws short programs of device collectives, run on the stream emulator.

The fixed workloads of test_stream_emulator.py, test_ipc.py and
test_host_staged.py each hold most things still and vary one.  Here a case
is a whole program: one Communicator set up for one device algorithm, a
schedule of the emulator's late device (lazy or random, seeded per rank),
and 1 to 4 calls in a row on it, each drawn alone -- the collective, n, dtype,
op, dims, in place or out, buffers at odd element offsets (each rank its
own), memory peers cannot map, the caller's stream or ``stream=``, the input
overwritten right after the call; the emulator's arrays or torch tensors it
takes for CUDA tensors -- with every result read only at the end, through
the stream ordered after its call.  So the state one call leaves (pinned slots, peers'
mappings, scratch and pool buffers, the tuner's trials, the event of the
last call) meets the next call's different shape while its work is still
queued.

Setups: "ring-staged" and "ring-aware" (the ring, chunks staged through
pinned memory or handed to MPI as CUDA-aware MPI would get them; any
dims), "mpi-aware" (MPI's own collectives handed the device memory, where
they compute the call), "host" (pieces through the host's algorithms),
"ipc" (CUDA IPC forced), "tuned" (``ipc=None``: the tuner's trials pick
among ring, ipc and host, and "mpi" where the case makes MPI CUDA-aware),
and where the rank count has a divisor 2 <= k < p, "hier" (node
labels make nodes of k ranks, consecutive or round robin: CUDA IPC inside
each, the ring staged or CUDA-aware across them; its allreduces settled on
it where it serves them, the other collectives the tuner's); the ranks'
devices are one GPU, one each, or two dealt out round robin (CUDA IPC's schedule differs).  Calls:
allreduce, reduce_scatter then allgather of its shard, mpi4py's Allreduce,
allreduce_many of two tensors, and allreduce_many_async (the progress
thread; in place, the DDP hook's call; waited for on the current stream, or
with wait(stream=) where the call took stream=).

Every rank reports what it can see alone (an exception, its input changed
by an out-of-place call, its shard not its slice of the allgather); rank 0
checks each result against the numpy reference and every rank's bits
against its own (tests/fuzzing.py).  What this cannot show is anything of
CUDA itself: tests/gpu/run_on_device.sh runs the device tests on a GPU.

Short run by default (CI); the long run sets the number of examples:

    DDLKERNELS_DEVICE_FUZZ_EXAMPLES=300 mpirun -n 3 python -m mpi4py tests/_mpi_pytest.py tests/mpi/test_device_fuzz.py
    python bench/reliability/fuzz_long.py --test device       (every rank count 2..8)
"""

import collections
import contextlib
import math
import os

import numpy as np
import pytest
from hypothesis import strategies as st
from mpi4py import MPI

import ddlkernels
from ddlkernels._dtypes import BFLOAT16
from fuzzing import ALL_DTYPES, P, RANK, check_result, digest, dims_choices, drive, gathered, make_input
from helpers import GPU_LAYOUTS, OPS, node_size
from stream_emulator import EmuArray, emulated_device

try:
    import torch
except ImportError:  # the torch extra is not installed: the emulator's own arrays only
    torch = None

COMM = MPI.COMM_WORLD
EXAMPLES = int(os.environ.get("DDLKERNELS_DEVICE_FUZZ_EXAMPLES", "40"))
pytestmark = pytest.mark.skipif(P < 2, reason="one rank exchanges nothing: no device algorithm runs")
#: Each queued copy and kernel is a Python call in the emulator: a call is held to this many chunks or pieces.
MAX_PIECES = 48

#: ranks per made-up node of the "hier" setup: a divisor 2 <= k < P, or None (2, 3, 5, 7 ranks: no such setup)
K = node_size(P)
SETUPS = ["ring-staged", "ring-aware", "mpi-aware", "host", "ipc", "tuned"] + (["hier"] if K else [])
COLLECTIVES = ["allreduce", "rs+ag", "Allreduce", "many", "async"]
RING = ("ring-staged", "ring-aware")
#: the caller's arrays: the emulator's own, or torch tensors it claims as CUDA tensors
ARRAYS = ["emu"] + (["torch"] if torch is not None else [])
#: what the calls' last collective ran, by algorithm (this rank's count: every rank runs the same)
RAN = collections.Counter()


def edge_sizes(p):
    return sorted({0, 1, p - 1, p, p + 1, 2 * p - 1, 2 * p + 1, p * p + 1, 127, 257, 4099})


calls = st.fixed_dictionaries(
    {
        "collective": st.sampled_from(COLLECTIVES),
        "n": st.one_of(st.sampled_from(edge_sizes(P)), st.integers(0, 64), st.integers(0, 5000)),
        "dtype": st.sampled_from(range(len(ALL_DTYPES))),
        "op": st.sampled_from(OPS),
        "dims": st.sampled_from(dims_choices(P)),  # the ring setups only: dims= makes the call the ring's
        "out": st.sampled_from(["in place", "new", "given"]),
        "offset": st.integers(0, 3),  # elements into its allocation, plus the rank: each rank its own
        "mappable": st.booleans(),  # False: memory CUDA IPC cannot export, on odd ranks
        "stream": st.sampled_from(["a", "b", "stream=a"]),
        "reuse": st.booleans(),  # out of place: the input overwritten on its stream right after the call
        "data": st.sampled_from(["grid", "random"]),
        "seed": st.integers(0, 2**31 - 1),
    }
)

cases = st.fixed_dictionaries(
    {
        "setup": st.sampled_from(SETUPS),
        "arrays": st.sampled_from(ARRAYS),
        "chunk_bytes": st.sampled_from([8, 64, 1000, 4096, 1 << 20]),
        "window": st.integers(1, 4),
        "validate": st.booleans(),  # every call's arguments compared across ranks first
        "timeout": st.sampled_from([None, 300.0]),  # MPI's waits under a deadline
        "piece_bytes": st.sampled_from([16, 24, 256, 4096]),
        "fusion_bytes": st.sampled_from([32, 4096, None]),
        "policy": st.sampled_from(["lazy", "random"]),
        "nodes": st.sampled_from(["block", "round robin"]),  # "hier": the made-up nodes' ranks
        "aware": st.booleans(),  # "hier", "tuned": CUDA-aware MPI (across nodes; "mpi" a candidate), else staged
        # which GPU each rank drives (CUDA IPC: where ranks share one, its lowest rank does their part)
        "gpus": st.sampled_from(sorted(GPU_LAYOUTS)),
        "seed": st.integers(0, 2**20),
        "calls": st.lists(calls, min_size=1, max_size=4),
    }
)


def normalize(case):
    """Chunks and pieces of at least 1/MAX_PIECES of the largest call (the same on every rank)."""
    case = dict(case)
    most = max(c["n"] * np.dtype(ALL_DTYPES[c["dtype"]]).itemsize for c in case["calls"])
    case["chunk_bytes"] = max(case["chunk_bytes"], math.ceil(most / MAX_PIECES))
    case["piece_bytes"] = max(case["piece_bytes"], math.ceil(most / MAX_PIECES))
    return case


class Program:
    """One case on this rank: its Communicator, the emulated device, two caller streams, and the calls' results
    still to be read."""

    def __init__(self, be, case):
        self.be, self.case, self.setup = be, case, case["setup"]
        hier = self.setup == "hier"
        node = None
        if hier:  # this rank's made-up node: "hier" needs shm= not False, for host arrays' windows
            node = RANK // K if case["nodes"] == "block" else RANK % (P // K)
        self.c = ddlkernels.Communicator(COMM, shm=None if hier else False, chunk_bytes=case["chunk_bytes"],
                                         window=case["window"],
                                         cuda_aware=self.setup in ("ring-aware", "mpi-aware")
                                         or self.setup in ("hier", "tuned") and case["aware"],
                                         ipc={"ipc": True, "tuned": None, "hier": None}.get(self.setup, False),
                                         validate=case["validate"], timeout=case["timeout"], node=node)
        if "host" in self.c.algorithms:
            self.c.algorithms["host"].piece_bytes = case["piece_bytes"]
        self.streams = {"a": be.new_stream(), "b": be.new_stream()}
        self.pending = []  # (call, its stream, collective, results)
        self.kept = []  # (input, its stream, what it must still hold): out-of-place inputs not reused
        # Every input until the end: one dropped while its overwrite is queued on another stream than the one it
        # was allocated on would give that write to the pool's next owner (the caller's race, not the library's).
        self.inputs = []
        self.torch = case["arrays"] == "torch"
        self.errs = []

    def settle(self, call, d, kinds):
        """Make this call's collectives run the setup's algorithm (in the ring setups, dims= does it too)."""
        name = {"ring-staged": "ring", "ring-aware": "ring", "mpi-aware": "mpi", "host": "host",
                "hier": "hier"}.get(self.setup)
        if name is None or (self.setup in RING and call["dims"] is not None):
            return
        for kind in kinds:
            # "hier": allreduces it serves (not "avg" of half types, nor after CUDA IPC failed on a rank);
            # "mpi": the calls MPI computes with numpy's bits (float sums and products, integer ops).
            if name not in ("hier", "mpi") or name in self.c.candidates(d, call["op"], collective=kind):
                self.c.settle(d, name, call["op"], collective=kind)

    def dims(self, call):
        return call["dims"] if self.setup in RING else None

    def start(self, k):
        """Queue call ``k`` (the host returns before its device work has run)."""
        be, c, call = self.be, self.c, self.case["calls"][k]
        s = self.streams[call["stream"][-1]]
        x = make_input(call, RANK)
        mappable = call["mappable"] or RANK % 2 == 0
        at = (call["offset"] + RANK) % 4

        def placed(host):
            """``host`` ``at`` elements into a larger allocation, written on the call's stream (a torch tensor over
            that memory with ``arrays="torch"``)."""
            whole = be.to_device(np.zeros(host.size + at + 2, host.dtype), stream=s, shareable=mappable)
            v = whole[at:at + host.size]
            be.write(v, host, stream=s)
            return tensor(v) if self.torch else v

        def garbage(n):
            """An output holding values no result has (its old contents, written on the call's stream)."""
            return placed(np.full(n, -3, x.dtype))

        kind, op, n, dims = call["collective"], call["op"], call["n"], self.dims(call)
        d = placed(x)
        self.inputs.append(d)
        inplace, given = call["out"] == "in place", call["out"] == "given"
        arg = call["stream"].startswith("stream=")
        kw = {"stream": s} if arg else {}
        after = s  # the stream ordered after the call: its results are read there, its input overwritten there
        with be.current(be.default_stream() if arg else s):
            if kind == "allreduce":
                self.settle(call, d, ["allreduce"])
                out = d if inplace else garbage(n) if given else None
                res = [c.allreduce(d, op, out=out, dims=dims, **kw)]
                if out is not None and res[0] is not out:
                    self.errs.append(f"rank {RANK}: call {k}: allreduce did not return out")
            elif kind == "Allreduce":  # no stream=: the caller's current stream
                self.settle(call, d, ["allreduce"])
                with be.current(s):
                    recv = d if inplace else garbage(n)
                    c.Allreduce(MPI.IN_PLACE if inplace else d, recv, op)
                res = [recv]
            elif kind == "rs+ag":
                self.settle(call, d, ["reduce_scatter", "allgather"])
                lo, hi = c.shard_range(n, dims)
                shard = c.reduce_scatter(d, op, out=garbage(hi - lo) if given else None, dims=dims, **kw)
                res = [c.allgather(shard, count=n, out=garbage(n) if given else None, dims=dims, **kw), shard]
            else:
                parts = [d[:n // 3], d[n // 3:]] if n else [d]
                outs = parts if inplace else [garbage(len(q)) for q in parts] if given else None
                many = ddlkernels.allreduce_many if kind == "many" else ddlkernels.allreduce_many_async
                res = many(parts, op, comm=c, out=outs, fusion_bytes=self.case["fusion_bytes"], **kw)
                if kind == "async":  # in place: the DDP hook's call; wait() orders the current stream or stream=
                    res, after = (res.wait(stream=s), s) if arg else (res.wait(), be.current_stream())
        for r in res:
            if type(r) is not type(d) or r.dtype != d.dtype:
                self.errs.append(f"rank {RANK}: call {k}: {kind} returned {type(r).__name__} of {r.dtype} for "
                                 f"{type(d).__name__} of {d.dtype}")
        if not inplace:
            if call["reuse"]:
                be.write(memory(d), np.zeros_like(x), stream=after)  # the caller reuses its input at once
            else:
                self.kept.append((d, after, x))
        self.pending.append((call, after, kind, res))
        # the progress thread's own Communicator runs "async"; none: allreduce_many of empty arrays as a first call
        RAN["progress thread" if kind == "async" else c.last_algorithm or "none"] += 1

    def finish(self):
        """Read every result through its stream: one host array per call."""
        be, got = self.be, []
        for call, s, kind, res in self.pending:
            hosts = [read(be, r, s) for r in res]
            if kind == "rs+ag":
                whole, shard = hosts
                lo, hi = self.c.shard_range(call["n"], self.dims(call))
                if shard.shape != (hi - lo,) or not np.array_equal(shard.view(np.uint8), whole[lo:hi].view(np.uint8)):
                    self.errs.append(f"rank {RANK}: shard differs from its slice [{lo}, {hi}) of the allgather")
            got.append(np.concatenate(hosts[:1] if kind == "rs+ag" else hosts))
        for d, s, x in self.kept:
            if not np.array_equal(read(be, d, s).view(np.uint8), x.view(np.uint8)):
                self.errs.append(f"rank {RANK}: an out-of-place call modified its input")
        if be.faults:
            self.errs.append(f"rank {RANK}: {be.faults} device operations ran through a closed mapping")
        return got


def tensor(v: EmuArray):
    """A torch tensor over the emulated device memory of ``v`` (which the emulator claims as a CUDA tensor)."""
    a = v._a
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == BFLOAT16 else torch.from_numpy(a)


def memory(x):
    """What the emulator's queued writes and reads take for ``x``: the array itself, or a torch tensor's memory."""
    if isinstance(x, EmuArray):
        return x
    return x.view(torch.int16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


def read(be, x, s) -> np.ndarray:
    """``x`` on the host, flat, read after the work queued on ``s``."""
    bf16 = x.dtype == BFLOAT16 if isinstance(x, EmuArray) else x.dtype == torch.bfloat16
    a = be.to_host(memory(x), s).reshape(-1)
    return a.view(BFLOAT16) if bf16 else a


def run_case(case):
    """Run ``case`` on this rank: (complaints, one result per call, or None)."""
    with contextlib.ExitStack() as stack:
        try:
            be = stack.enter_context(emulated_device(seed=case["seed"] * 16 + RANK, policy=case["policy"],
                                                     ipc=case["setup"] in ("ipc", "tuned", "hier"),
                                                     gpu=GPU_LAYOUTS[case["gpus"]](RANK),
                                                     claim_torch=case["arrays"] == "torch"))
            why = []
        except Exception as e:
            be, why = None, [f"rank {RANK}: {type(e).__name__} entering the emulated device: {e}"]
        if not COMM.allreduce(be is not None, op=MPI.LAND):  # a rank that cannot start keeps every rank out
            return why, None
        prog = Program(be, case)
        try:
            for k in range(len(case["calls"])):
                prog.start(k)
            got = prog.finish()
        except Exception as e:  # reported, so that rank 0 fails the example instead of this rank alone
            prog.errs.append(f"rank {RANK}: {type(e).__name__}: {e}")
            got = None
        finally:
            prog.c.free()  # collective: no peer still maps this rank's memory when the block ends
    return prog.errs, got


def one_case(case):
    """Collective: every rank runs ``case``; returns the complaints (on rank 0, all of them)."""
    try:
        errs, got = run_case(case)
    except Exception as e:  # the emulator's own entry or exit: still a complaint, so the ranks stay in step
        errs, got = [f"rank {RANK}: {type(e).__name__} around the case: {e}"], None
    ncalls = len(case["calls"])
    flat = gathered(errs, [digest(y) for y in got] if got is not None else [None] * ncalls)
    if RANK == 0 and got is not None:
        for k, (call, y) in enumerate(zip(case["calls"], got)):
            inputs = [make_input(call, r) for r in range(P)]
            flat += [f"call {k}: {e}" for e in check_result(y, inputs, call["op"], ALL_DTYPES[call["dtype"]])]
    return flat


def test_fuzz_device_programs():
    drive(cases.map(normalize), one_case, EXAMPLES, "device fuzz")
    if RANK == 0:
        print("device fuzz: calls by algorithm (of each call's last collective): "
              + ", ".join(f"{k} {v}" for k, v in RAN.most_common()), flush=True)
