"""Data-parallel training that converges like one process: an MLP on scikit-learn's digits.

    python -m ddlkernels.examples.train                                   # 1 rank
    mpirun -n 4 python -m mpi4py -m ddlkernels.examples.train             # 4 ranks, same global batch
    mpirun -n 4 python -m mpi4py -m ddlkernels.examples.train --overlap both   # alternate per step
    mpirun -n 4 python -m mpi4py -m ddlkernels.examples.train --overlap both --progress both
    mpirun -n 4 python -m mpi4py -m ddlkernels.examples.train --method ddp     # DDP + ddlkernels' hook
    mpirun -n 4 python -m mpi4py -m ddlkernels.examples.train --method group   # DDP on the "ddlkernels" group
    mpirun -n 2 python -m mpi4py -m ddlkernels.examples.train --device cuda --method both

``--method optimizer`` (default) trains with ``ddlkernels.torch.DistributedOptimizer``;
``--method ddp`` with ``torch.nn.parallel.DistributedDataParallel`` whose buckets
ddlkernels reduces (``register_comm_hook(HookState(comm), allreduce_hook)``; the
gloo process group only broadcasts the start); ``--method group`` with plain
DistributedDataParallel over the ``"ddlkernels"`` torch process group
(``ddlkernels.torch.process_group``: no hook, every collective DDP makes is
ddlkernels'); ``both`` runs optimizer and ddp one after the other.  ``--device cuda`` puts each rank on the GPU of its local rank
(``ddlkernels.torch.set_device``: one per local rank, or all on the one GPU;
docs/gpus.md has the launch lines).

What each step does, with 4 ranks and the default global batch of 32::

    the epoch's shuffled training set (same permutation on every rank, fixed seed)
    global batch k = samples [32k, 32k + 32) -> rank r takes [32k + 8r, 32k + 8r + 8)
    forward + backward on 8 samples; gradient hooks start each bucket's
    reduction (average over ranks) as soon as its gradients exist
    optimizer.step(): wait for the buckets, then the SGD update

The average of the 4 per-rank mean gradients is the mean gradient of the
global batch, so the run follows the 1-rank run with the same global batch up
to float rounding.  After every step the parameters are compared across ranks
(a digest, outside the timed region) and must be bitwise identical.

Timing, per iteration, on the ranks' maximum:

    exposed communication = time in gradient hooks (packing, starting) + time in
                            synchronize() (waiting for and unpacking the reductions)
    compute               = everything else (forward, backward, update)

Scaling efficiency by the paper's definition (Cho et al., "PowerAI DDL",
section 3.1): time per iteration of one unit / time per iteration of n units
at a fixed batch per unit.  The one-unit time is measured in the same run,
before training: rank 0 alone runs iterations with the per-rank batch while
the other ranks sleep.  Communication overhead = t_n - t_1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np


def _imports():
    try:
        import torch
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise SystemExit(f"ddlkernels.examples.train needs PyTorch and scikit-learn ({exc}): pip install ddlkernels[torch]")
    return torch, load_digits


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ddlkernels.examples.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="global batch (all ranks together); divisible by the rank count")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--hidden", type=int, default=256, help="width of the two hidden layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fusion-bytes", type=int, default=128 << 10, help="bucket size of DistributedOptimizer")
    ap.add_argument("--overlap", choices=["on", "off", "both"], default="on",
                    help="start reductions from gradient hooks during backward (on), after it (off), or "
                         "alternate step by step in one run, so both are timed under the same conditions (both)")
    ap.add_argument("--progress", choices=["auto", "thread", "hooks", "both"], default="auto",
                    help="who moves overlapped reductions forward: a background thread, MPI_Iallreduce polled from "
                         "the gradient hooks, or both (alternated step by step with --overlap)")
    ap.add_argument("--method", choices=["optimizer", "ddp", "group", "both"], default="optimizer",
                    help="DistributedOptimizer, DistributedDataParallel with ddlkernels' comm hook, DDP over the "
                         "'ddlkernels' process group, or optimizer and ddp in turn")
    ap.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu",
                    help="where to train: cuda pins each rank to its local rank's GPU; auto = cuda if torch sees one")
    ap.add_argument("--solo-iters", type=int, default=200, help="iterations of the one-rank baseline (0: skip)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (ranks share the cores)")
    ap.add_argument("--json", help="write the results of rank 0 to this file")
    return ap.parse_args(argv)


def load_data(load_digits, seed):
    """Digits 8x8 scaled to [0, 1]; a fixed 80/20 split (1437 train, 360 held out)."""
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(x))
    n_test = len(x) // 5
    te, tr = perm[:n_test], perm[n_test:]
    return x[tr], y[tr], x[te], y[te]


def build_model(torch, hidden, seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def digest(model) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.digest()


def pick_device(torch, args, comm):
    """``torch.device`` for ``--device`` (collective: the local rank comes from MPI)."""
    import ddlkernels.torch as ddt

    dev = ddt.set_device(comm) if args.device in ("cuda", "auto") else torch.device("cpu")
    if args.device == "cuda" and dev.type != "cuda":
        raise SystemExit("--device cuda: torch sees no CUDA device on this rank (torch.cuda.is_available() is False)")
    return dev


def _sync(torch, device):
    """Wait for the GPU's queued work, so that host timers measure it (nothing to do on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def solo_baseline(torch, args, comm, xtr, ytr, per_rank, device=None):
    """Seconds per iteration of rank 0 alone, per-rank batch, no communication (others sleep meanwhile)."""
    from mpi4py import MPI

    device = device or torch.device("cpu")
    result = None
    if comm.Get_rank() == 0 and args.solo_iters > 0:
        model = build_model(torch, args.hidden, args.seed).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        xs, ys = torch.from_numpy(xtr).to(device), torch.from_numpy(ytr).to(device)
        loss_fn = torch.nn.functional.cross_entropy
        times = []
        for it in range(args.solo_iters + 10):
            lo = (it * per_rank) % (len(xs) - per_rank)
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(xs[lo : lo + per_rank]), ys[lo : lo + per_rank]).backward()
            opt.step()
            _sync(torch, device)
            times.append(time.perf_counter() - t0)
        result = float(np.mean(times[10:]))  # the first iterations warm up allocators
    req = comm.Ibarrier()
    while not req.Test():  # sleep, do not spin: rank 0 must have the machine to itself
        time.sleep(0.002)
    return comm.bcast(result, root=0)


def train(torch, args, comm, data, mode: str, device=None):
    """Train with DistributedOptimizer over ``comm``; ``mode``: overlap "on", "off" or "both"."""
    import ddlkernels.torch as ddt
    from mpi4py import MPI

    device = device or torch.device("cpu")
    xtr, ytr, xte, yte = data
    p, rank = comm.Get_size(), comm.Get_rank()
    per_rank = args.batch // p
    model = build_model(torch, args.hidden, args.seed).to(device)
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    opt = ddt.DistributedOptimizer(base, model.named_parameters(), fusion_bytes=args.fusion_bytes, comm=comm,
                                   overlap=mode != "off", progress="thread" if args.progress == "both" else args.progress)
    if args.progress == "auto" and rank == 0:
        print(f"  (progress auto -> {opt.ddl_progress})", flush=True)
    # The configurations timed in this run, used in turn step by step so that
    # every one meets the same machine load; the training itself is the same
    # computation in each (same buckets, same averages).
    configs = [("on", pr) for pr in (["thread", "hooks"] if args.progress == "both" else [opt.ddl_progress])]
    if mode == "off":
        configs = [("off", None)]
    elif mode == "both":
        configs.append(("off", None))
    ddt.broadcast_parameters(model.state_dict(), root=0, comm=comm)
    xs, ys = torch.from_numpy(xtr).to(device), torch.from_numpy(ytr).to(device)
    xt, yt = torch.from_numpy(xte).to(device), torch.from_numpy(yte).to(device)
    loss_fn = torch.nn.functional.cross_entropy
    iters = len(xs) // args.batch  # drop the last partial global batch, as the 1-rank run does
    rows, per_iter, checks = [], [], 0
    for epoch in range(args.epochs):
        perm = torch.from_numpy(np.random.default_rng(args.seed * 1000 + epoch).permutation(len(xs))).to(device)
        loss_sum = 0.0
        for it in range(iters):
            idx = perm[it * args.batch + rank * per_rank : it * args.batch + (rank + 1) * per_rank]
            xb, yb = xs[idx], ys[idx]
            ov, pr = configs[(epoch * iters + it) % len(configs)]
            opt.ddl_overlap = ov == "on"
            if pr is not None:
                opt.ddl_set_progress(pr)
            label = "off" if pr is None else f"{ov}/{pr}"
            h0, s0 = opt.ddl_timing["hook_s"], opt.ddl_timing["sync_s"]
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            _sync(torch, device)
            t1 = time.perf_counter()
            comm_s = opt.ddl_timing["hook_s"] - h0 + opt.ddl_timing["sync_s"] - s0
            per_iter.append((t1 - t0, comm_s, [f"{o}/{q}" if q else o for o, q in configs].index(label)))
            loss_sum += float(loss.detach())
            # Outside the timed region: every rank must hold the very same bits.
            d = digest(model)
            every = comm.allgather(d)
            if any(e != every[0] for e in every):
                bad = [r for r, e in enumerate(every) if e != every[0]]
                raise SystemExit(f"parameters differ between ranks after epoch {epoch + 1} step {it + 1}: ranks {bad}")
            checks += 1
        epoch_loss = comm.allreduce(loss_sum, op=MPI.SUM) / (p * iters)
        with torch.no_grad():
            acc = float((model(xt).argmax(1) == yt).float().mean())
        rows.append((epoch + 1, epoch_loss, acc))
        if rank == 0:
            print(f"  {epoch + 1:5d}  {epoch_loss:10.5f}  {100 * acc:8.2f} %", flush=True)
    # Per-iteration times from the second epoch on (the first warms up); per
    # iteration the slowest rank's value: that is what the job waits for.
    arr = np.array(per_iter[iters:] if args.epochs > 1 else per_iter, dtype=np.float64)
    worst = np.empty_like(arr)
    comm.Allreduce(np.ascontiguousarray(arr), worst, op=MPI.MAX)
    info = {
        "method": "optimizer",
        "device": str(device),
        "mode": mode,
        "buckets": len(opt._ddl_buckets),
        "epochs": rows,
        "final_accuracy": rows[-1][2],
        "identical_checks": checks,
        "timing": {},
    }
    for k, (o, q) in enumerate(configs):
        sel = worst[arr[:, 2] == k]
        if len(sel):
            total, exposed = float(np.mean(sel[:, 0])), float(np.mean(sel[:, 1]))
            info["timing"][f"{o}/{q}" if q else o] = {
                "iteration_s": total, "exposed_comm_s": exposed, "compute_s": total - exposed,
                "iterations": int(len(sel)), "iteration_median_s": float(np.median(sel[:, 0])),
                "exposed_comm_median_s": float(np.median(sel[:, 1])),
            }
    return info


def train_ddp(torch, args, comm, data, device=None, group=False):
    """Train with DistributedDataParallel whose buckets ddlkernels reduces over ``comm``: through
    ``allreduce_hook``, or (``group``) as DDP's own allreduce over a ``"ddlkernels"`` process group.

    Same model, data split, optimizer and digest check as ``train``; DDP's
    process group (gloo: it also takes CUDA tensors, and lets several ranks
    share one GPU, which NCCL refuses) must hold the ranks of ``comm``.  Per
    iteration only the whole step is timed: DDP's hook overlaps backward, and
    its waiting is inside ``backward()``.
    """
    import ddlkernels.torch as ddt
    import torch.distributed as dist
    from mpi4py import MPI

    device = device or torch.device("cpu")
    xtr, ytr, xte, yte = data
    p, rank = comm.Get_size(), comm.Get_rank()
    per_rank = args.batch // p
    ddt.init_process_group("gloo", comm=comm)
    model = build_model(torch, args.hidden, args.seed).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=args.fusion_bytes / 2**20,
        process_group=dist.new_group(backend=ddt.process_group.BACKEND) if group else None)
    if not group:
        ddp.register_comm_hook(ddt.HookState(comm), ddt.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    xs, ys = torch.from_numpy(xtr).to(device), torch.from_numpy(ytr).to(device)
    xt, yt = torch.from_numpy(xte).to(device), torch.from_numpy(yte).to(device)
    loss_fn = torch.nn.functional.cross_entropy
    iters = len(xs) // args.batch
    rows, per_iter, checks = [], [], 0
    for epoch in range(args.epochs):
        perm = torch.from_numpy(np.random.default_rng(args.seed * 1000 + epoch).permutation(len(xs))).to(device)
        loss_sum = 0.0
        for it in range(iters):
            idx = perm[it * args.batch + rank * per_rank : it * args.batch + (rank + 1) * per_rank]
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(ddp(xs[idx]), ys[idx])
            loss.backward()
            opt.step()
            _sync(torch, device)
            per_iter.append(time.perf_counter() - t0)
            loss_sum += float(loss.detach())
            every = comm.allgather(digest(model))
            if any(e != every[0] for e in every):
                bad = [r for r, e in enumerate(every) if e != every[0]]
                raise SystemExit(f"parameters differ between ranks after epoch {epoch + 1} step {it + 1}: ranks {bad}")
            checks += 1
        epoch_loss = comm.allreduce(loss_sum, op=MPI.SUM) / (p * iters)
        with torch.no_grad():
            acc = float((model(xt).argmax(1) == yt).float().mean())
        rows.append((epoch + 1, epoch_loss, acc))
        if rank == 0:
            print(f"  {epoch + 1:5d}  {epoch_loss:10.5f}  {100 * acc:8.2f} %", flush=True)
    arr = np.array(per_iter[iters:] if args.epochs > 1 else per_iter, dtype=np.float64)
    worst = np.empty_like(arr)
    comm.Allreduce(arr, worst, op=MPI.MAX)
    mode = "ddp+group" if group else "ddp+hook"
    timing = {mode: {"iteration_s": float(np.mean(worst)), "iteration_median_s": float(np.median(worst)),
                     "iterations": int(len(worst))}}
    return {"method": "group" if group else "ddp", "device": str(device), "mode": mode, "epochs": rows,
            "final_accuracy": rows[-1][2], "identical_checks": checks, "timing": timing}


def main(argv=None):
    args = parse_args(argv)
    torch, load_digits = _imports()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    if args.batch % p:
        raise SystemExit(f"--batch {args.batch} is not divisible by the {p} ranks: every rank needs an equal share")
    torch.set_num_threads(args.threads)
    device = pick_device(torch, args, comm)
    data = load_data(load_digits, args.seed)
    per_rank = args.batch // p
    nparams = sum(int(np.prod(s)) for s in [(64, args.hidden), (args.hidden,), (args.hidden, args.hidden),
                                              (args.hidden,), (args.hidden, 10), (10,)])
    if rank == 0:
        print(f"ddlkernels.examples.train: {p} rank(s), global batch {args.batch} ({per_rank} per rank), "
              f"{args.epochs} epochs, MLP 64-{args.hidden}-{args.hidden}-10 ({nparams} parameters, "
              f"{4 * nparams} B of gradients), SGD lr {args.lr} momentum {args.momentum}, seed {args.seed}, "
              f"fusion {args.fusion_bytes} B, progress {args.progress}, method {args.method}, device {device}; "
              f"digits: {len(data[0])} train, {len(data[2])} held out", flush=True)
    t1 = solo_baseline(torch, args, comm, data[0], data[1], per_rank, device)
    results = []
    for method in (["optimizer", "ddp"] if args.method == "both" else [args.method]):
        if rank == 0:
            what = {"optimizer": f"overlap {args.overlap}", "ddp": "DDP + ddlkernels.torch.allreduce_hook",
                    "group": "DDP over the 'ddlkernels' process group"}[method]
            print(f"\n{what}:\n  epoch        loss  held-out acc", flush=True)
        if method == "optimizer":
            r = train(torch, args, comm, data, args.overlap, device)
        else:
            r = train_ddp(torch, args, comm, data, device, group=method == "group")
        if rank == 0:
            _report(r, p, per_rank, t1)
        results.append(r)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": p, "args": vars(args), "runs": results}, f, indent=1)
    return 0


def _report(r, p, per_rank, t1):
    buckets = f"{r['buckets']} buckets; " if "buckets" in r else ""
    print(f"  {buckets}parameters bitwise identical on all {p} ranks after every one of the "
          f"{r['identical_checks']} steps")
    for name, t in r["timing"].items():
        tn = t["iteration_s"]
        if "compute_s" in t:
            print(f"  {name}: per iteration (mean of {t['iterations']} iterations after epoch 1, slowest "
                  f"rank) {1e3 * tn:.3f} ms = compute {1e3 * t['compute_s']:.3f} ms + exposed communication "
                  f"{1e3 * t['exposed_comm_s']:.3f} ms (medians {1e3 * t['iteration_median_s']:.3f} / "
                  f"{1e3 * t['exposed_comm_median_s']:.3f} ms)")
        else:
            print(f"  {name}: per iteration (mean of {t['iterations']} iterations after epoch 1, slowest "
                  f"rank) {1e3 * tn:.3f} ms (median {1e3 * t['iteration_median_s']:.3f} ms)")
        if t1 is not None:
            t["scaling_efficiency"] = t1 / tn
            print(f"    scaling efficiency t_1/t_{p} = {100 * t1 / tn:.1f} % (t_1 = {1e3 * t1:.3f} ms: one rank "
                  f"alone, batch {per_rank}); communication overhead t_{p} - t_1 = {1e3 * (tn - t1):.3f} ms")
    if len(r["timing"]) > 1:
        parts = ", ".join(f"{name} {1e3 * t['exposed_comm_s']:.3f} ms" for name, t in r["timing"].items())
        print(f"  exposed communication per iteration, same run (overlap/progress): {parts}")
    print(f"  final held-out accuracy: {100 * r['final_accuracy']:.2f} %", flush=True)
    r["solo_iteration_s"] = t1


if __name__ == "__main__":
    sys.exit(main())
