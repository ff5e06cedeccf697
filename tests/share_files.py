"""Share one pytest run's test files among pytest processes started side by side (``tests/run_suite.py --jobs``).

Worked example, 2 processes started with ``--share-files DIR`` on tests a.py (slow), b.py and c.py::

    both  collect every test of a.py, b.py and c.py
    P1    reaches a.py first: creates DIR/tests__a.py (O_EXCL: exactly one creation succeeds) and runs a.py
    P2    finds DIR/tests__a.py there: passes a.py's tests over, unreported; claims b.py, runs it; claims c.py
    P1    done with a.py: finds b.py and c.py claimed, passes them over

Each file runs in exactly one process, whole (its module fixtures set up once), and every file goes to the
first process free to take it, so the processes end close together without a table of how long each file
takes.  Each process reports only the tests it ran; run_suite.py adds their counts.
"""

from __future__ import annotations

import os

import pytest

OPTION = "--share-files"

_claims: dict = {}  # a file's test path -> whether this process claimed it


def add_option(parser) -> None:
    parser.addoption(OPTION, metavar="DIR", default=None,
                     help="run only the test files this process claims first in DIR, a directory shared with "
                          "other pytest processes run side by side (tests/share_files.py)")


def claim(where: str, path: str) -> bool:
    """Whether this process is the first to claim the test file ``path`` in the directory ``where``."""
    name = os.path.join(where, path.replace(os.sep, "__").replace("/", "__"))
    try:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    where = item.config.getoption(OPTION)
    if not where:
        return None
    path = item.nodeid.split("::", 1)[0]
    if path not in _claims:
        _claims[path] = claim(where, path)
    # True: this item is dealt with (another process runs it), so pytest runs and reports nothing of it.  The
    # last item run before it was torn down towards it, another file's; whatever stays up ends with the session.
    return None if _claims[path] else True
