"""allreduce sweep: ddlkernels vs MPI's own collective vs the Sendrecv link, in one run.

    mpirun -n 2 python bench/sweeps/allreduce.py -b 4K -e 64M --json r.json --plot r.png

Options: `python bench/sweeps/allreduce.py --help` (the same as `python -m ddlkernels bench --collective allreduce`).
"""

import os
import sys

# Run from a checkout without installing: the package sits beside bench/.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from ddlkernels.tools.bench_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(collective="allreduce", prog="bench/sweeps/allreduce.py"))
