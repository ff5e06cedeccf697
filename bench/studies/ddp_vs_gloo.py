"""DDP with ddlkernels' comm hooks against DDP with torch's gloo allreduce: how far apart the parameters end.

    mpirun -n 4 python -m mpi4py bench/studies/ddp_vs_gloo.py [--steps 4]

The run of tests/mpi/test_torch_ddp.py (a 10-32-32-4 MLP, buckets of ~2 KB,
SGD with momentum on data unique to each rank), once per hook and once with
DDP's default allreduce; prints, per hook, whether the parameters are bitwise
identical on every rank and their largest absolute and relative difference
from the gloo run.  The test asserts bounds a few times these.
"""

import argparse
import os
import sys

import numpy as np
import torch
from mpi4py import MPI

import ddlkernels
import ddlkernels.torch as ddt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests", "mpi"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    import test_torch_ddp as T  # the test's model, data and training loop

    T.STEPS = args.steps
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    ddt.init_process_group("gloo")
    with ddlkernels.Communicator(comm, small_bytes=0) as dc:
        ring = ddt.HookState(dc)
        gloo = T.train()
        for name, hook, state in [("allreduce_hook, ring (small_bytes=0)", ddt.allreduce_hook, ring),
                                  ("allreduce_hook, state None (tuned)", ddt.allreduce_hook, None),
                                  ("fp16_compress_hook, ring", ddt.fp16_compress_hook, ring),
                                  ("bfloat16_compress_hook, ring", ddt.bfloat16_compress_hook, ring)]:
            ours = T.train(hook, state)
            every = comm.allgather(ours.numpy())
            same = all(np.array_equal(e, every[0]) for e in every)
            err = (ours - gloo).abs()
            rel = float((err / gloo.abs().clamp_min(1e-30)).max())
            if comm.Get_rank() == 0:
                print(f"{comm.Get_size()} ranks, {args.steps} steps, {name}: bitwise identical on all ranks: {same}; "
                      f"max |ours - gloo| {float(err.max()):.3g}, max relative {rel:.3g}", flush=True)
        ring.engine.close()
    comm.Barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
