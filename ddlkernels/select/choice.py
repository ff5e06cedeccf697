"""Which algorithm runs a call: a fixed rule, or the tuner's measured choice among the algorithms that serve it.

Worked example, ``allreduce`` of 1 MiB of float32 on 2 ranks of one node, default settings::

    fixed(...)            None: a host call, no dims, no shm=True, no small_bytes
    candidates(...)       ("mpi", "ring", "shm", "cma"): every enabled algorithm, in
                          registry order, whose serves() says yes (nbc: only below
                          256 KiB; shm-nt: from 8 MiB)
    run(...)              the tuner's first calls go round the four in timed blocks
                          (``SizeTuner.choose`` / ``record``), then the agreed fastest
                          runs; from 1 MiB its calls are watched (``observe``), below
                          counted (``count``), and a re-measured size forgets its
                          fast-path plans
    fast_plan(...)        once settled, a FastPlan: the algorithm's prepared call, so
                          later calls of this size skip all of the above

The fixed rules: ``dims=`` runs the ring (the only algorithm for a box);
``ipc=True`` runs "ipc" for every device allreduce it serves; ``shm=True``
runs the window for every host call; a fixed ``small_bytes`` runs MPI's own
call below it where that computes the call (device calls: where MPI is
CUDA-aware), the ring from it.  Device calls
are asked only of the algorithms that compute on device arrays (``device``:
"mpi" where MPI is CUDA-aware on every rank, the ring, the incumbent
otherwise; where the backend offers CUDA IPC, "ipc" on one node and "hier"
across nodes; "host"), and have tuners of their own, whose trials wait for the device before the clock stops (the host
returns before the device has finished) and which are counted, not watched:
a watched call would have to wait for the device every time.  Every rank
decides alike: the candidates depend on the arguments every rank passes
alike, and the tuner agrees on its winner.
"""

from __future__ import annotations

from time import perf_counter

from .tuner import SizeTuner

__all__ = ["Selector", "FastPlan", "KINDS"]

KINDS = ("allreduce", "reduce_scatter", "allgather")


class FastPlan:
    """A settled call shape's prepared call, for the fast paths of host numpy calls.

    ``algorithm``: its name; ``run(src, dst)``: the whole collective on 1-D arrays (``Algorithm.fast``);
    ``shape``: the output's shape (reduce_scatter, allgather); ``recount``: the tuner's countdown of a
    settled size below ``WATCH_FROM`` (each call ticks it), else None; ``watch``: the candidates of a
    watched size (each call is timed and passed to ``SizeTuner.observe``), else None.
    """

    __slots__ = ("algorithm", "run", "shape", "recount", "watch", "nbytes", "_selector", "_kind")

    def __init__(self, selector, kind, algorithm, run, shape, nbytes, recount, watch):
        self.algorithm, self.run, self.shape, self.nbytes = algorithm, run, shape, nbytes
        self.recount, self.watch = recount, watch
        self._selector, self._kind = selector, kind

    def expire(self) -> None:
        """The countdown ran out: the size is measured again (on every rank at this call)."""
        s = self._selector
        if s.tuners[self._kind].expire(self.recount):
            s.plans[self._kind].clear()

    def observe(self, seconds) -> None:
        """One call of a watched size took ``seconds``; the tuner may reopen it (collective, every rank alike)."""
        s = self._selector
        if s.tuners[self._kind].observe(s.comm.comm, self.nbytes, self.watch, seconds):
            s.plans[self._kind].clear()


class Selector:
    """The choice of algorithm of one Communicator's calls: its tuners and fast-path plans, per collective."""

    def __init__(self, comm, algorithms):
        self.comm, self.algorithms = comm, algorithms
        #: large settled sizes re-measured when their calls slow down, small ones after many calls
        self.tuners = {k: SizeTuner(watch=True) for k in KINDS}
        #: device calls' (see the module comment)
        self.device_tuners = {k: SizeTuner(watch=False) for k in KINDS}
        #: collective -> (call shape) -> FastPlan, or False where every call takes the full path
        self.plans = {k: {} for k in KINDS}

    def tuner(self, kind, w) -> SizeTuner:
        """The tuner of calls like ``w``: host and device calls are measured apart."""
        return (self.device_tuners if w.be.device else self.tuners)[kind]

    def fixed(self, kind, w):
        """The algorithm's name when a rule fixes it, else None (the tuner's candidates decide)."""
        if w.dims is not None:
            return "ring"
        algos, c = self.algorithms, self.comm
        if w.be.device:
            ipc = algos.by_name.get("ipc")
            if c.ipc is True and ipc is not None and ipc.serves(kind, w):
                return "ipc"
        elif algos.forced is not None:
            return algos.forced.name
        if c.small_bytes is not None:  # a fixed small_bytes measures nothing (device: MPI only where CUDA-aware)
            mpi = algos.by_name.get("mpi")
            return "mpi" if w.nbytes < c.small_bytes and mpi is not None and mpi.computes(kind, w) else "ring"
        return None

    def candidates(self, kind, w) -> tuple:
        """The algorithms that may run this call, the incumbent first; one name when the choice is fixed."""
        name = self.fixed(kind, w)
        if name is not None:
            return (name,)
        device = w.be.device
        return tuple(a.name for a in self.algorithms.order if (a.device or not device) and a.serves(kind, w))

    def run(self, kind, w, body):
        """``body(algorithm)`` with the algorithm chosen for ``w`` (a ``Work``), timed for the tuner while it
        measures or watches the size."""
        cands = self.candidates(kind, w)
        algos = self.algorithms.by_name
        if len(cands) == 1:
            return body(algos[cands[0]])
        tuner, nbytes, comm = self.tuner(kind, w), w.nbytes, self.comm.comm
        name, trial = tuner.choose(nbytes, cands)
        if trial:
            t0 = perf_counter()
            result = body(algos[name])
            if w.be.device:
                w.be.synchronize()  # the call's device work, not only its launches
            tuner.record(comm, nbytes, cands, name, perf_counter() - t0, deadline=w.deadline)
        elif tuner.watched(nbytes, cands):  # every call of a watched size is timed, here or on a fast path
            t0 = perf_counter()
            result = body(algos[name])
            if tuner.observe(comm, nbytes, cands, perf_counter() - t0, deadline=w.deadline):
                self.plans[kind].clear()  # reopened on every rank at this call: no fast path may serve it
        else:
            result = body(algos[name])
            if tuner.count(nbytes, cands):
                self.plans[kind].clear()
        return result

    def measuring(self, kind, w) -> bool:
        """Whether calls like ``w`` are still the tuner's trials, or would be those of a Communicator the chosen
        algorithm runs steps on (``Algorithm.inner_trials``): the same on every rank."""
        cands = self.candidates(kind, w)
        name = cands[0] if len(cands) == 1 else self.tuner(kind, w).decided(w.nbytes, cands)
        return name is None or self.algorithms[name].inner_trials(kind, w)

    def settle(self, kind, w, name) -> None:
        """Fix the algorithm of calls like ``w`` without measuring (every rank must do the same)."""
        cands = self.candidates(kind, w)
        if name not in cands:
            raise ValueError(f"{kind} of {w.nbytes} bytes: {name!r} is not one of its algorithms here {cands}")
        self.tuner(kind, w).settle(w.nbytes, cands, name)
        self.plans[kind].clear()

    def fast_plan(self, kind, key, w, shape=None):
        """The ``FastPlan`` of calls like ``w`` (cached under ``key``), ``False`` when they take the full path,
        None while they cannot have one yet (measured, or the algorithm's setup not made)."""
        cands = self.candidates(kind, w)
        tuner, nbytes = self.tuners[kind], w.nbytes
        name = cands[0] if len(cands) == 1 else tuner.decided(nbytes, cands)
        if name is None:
            return None
        algo = self.algorithms[name]
        run = algo.fast(kind, w)
        if run is None:
            return None
        plans = self.plans[kind]
        if len(plans) >= 4096:  # a job with ever new sizes must not grow this without bound
            plans.clear()
        if run is False:
            plans[key] = False
            return False
        watch = cands if len(cands) > 1 and tuner.watched(nbytes, cands) else None
        recount = tuner.recount(nbytes, cands) if len(cands) > 1 else None
        plan = plans[key] = FastPlan(self, kind, name, run, shape, nbytes, recount, watch)
        return plan

    def forget(self) -> None:
        """Drop every fast-path plan (their prepared calls may hold memory being freed)."""
        for plans in self.plans.values():
            plans.clear()

    def decisions(self) -> dict:
        """Per collective: ``sizes`` (size range -> settled algorithm or "measuring"), ``device_sizes`` (the
        same for device calls) and ``fast`` (the call shapes that have a fast-path plan -> its algorithm)."""
        return {k: {"sizes": self.tuners[k].decisions(), "device_sizes": self.device_tuners[k].decisions(),
                    "fast": {key: p.algorithm for key, p in self.plans[k].items() if p}} for k in KINDS}
