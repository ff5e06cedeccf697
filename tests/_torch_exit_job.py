"""A job whose ranks exit with a receive still posted on the ``ddlkernels`` process group (tests/test_no_hang.py).

Its own exit handler, registered first, runs after every other Python exit handler (they run last in, first
out) and before MPI finalizes (mpi4py's is a C-level hook, after them all): it prints whether the group's
message poller is still alive then.  A poller left inside MPI_Test beside MPI_Finalize could crash the exit.
"""

import atexit

seen = {}


@atexit.register
def report():
    thread = seen.get("poller")
    print(f"rank {seen.get('rank')}: poller alive at exit: {thread is not None and thread.is_alive()}", flush=True)


import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ddlkernels.torch as ddt  # noqa: E402

ddt.init_process_group("ddlkernels")
rank, size = dist.get_rank(), dist.get_world_size()
dist.irecv(torch.empty(4), src=(rank + 1) % size, tag=77)  # nobody sends it
seen["rank"], seen["poller"] = rank, dist.group.WORLD._messages._thread
print(f"rank {rank}: exiting with a receive posted", flush=True)
