"""Creating a shared-memory window filters Open MPI's known noise out of stderr, and nothing else: what other
threads write meanwhile reaches stderr while the creation is still running, not after it."""

import os
import select
import threading
import time

from ddlkernels.algorithms.window import _quiet_window

NOISE = b"[vm:123] /ompi/mca/osc/ucx/osc_ucx_component.c:375  Error: OSC UCX component priority set inside " \
        b"component query failed \n \n"


def _read_until(fd, want, seconds):
    got, end = b"", time.monotonic() + seconds
    while want not in got and time.monotonic() < end:
        if select.select([fd], [], [], 0.05)[0]:
            got += os.read(fd, 65536)
    return got


def test_stderr_is_passed_through_during_a_window_creation_and_only_the_noise_is_dropped():
    r, w = os.pipe()  # stands for the process's real stderr
    saved = os.dup(2)
    os.dup2(w, 2)
    os.close(w)
    try:
        def creation():  # what MPI_Win_allocate_shared does to fd 2, while another thread logs
            os.write(2, NOISE)
            writer = threading.Thread(target=lambda: os.write(2, b"another thread's line\n \n"))
            writer.start()
            writer.join()
            # Still inside the creation: the line must already have come out.
            return _read_until(r, b"another thread's line\n", 3.0)

        during = _quiet_window(creation)
        os.write(2, b"after\n")
        after = _read_until(r, b"after\n", 3.0)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(r)
    # (Other threads of this process may write too: passed through as well.)
    assert b"another thread's line\n \n" in during, during  # its blank line kept: only the noise's own dropped
    assert b"OSC UCX" not in during + after, during + after
    assert b"after\n" in after, after
