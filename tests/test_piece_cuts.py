"""How "host" (ddlkernels.algorithms.host) cuts a call into pieces: ``piece_cuts``.

The pipeline overlaps every piece's copies with the host's work on its neighbours except the first piece's
copy down and the last one's copy up, so the pieces grow from ``per // ramp`` to ``per`` and shrink back.
The MPI tests (tests/mpi/test_host_staged.py) take these cuts as the algorithm's contract and check the bits
of every piece; here, that the cuts are that contract.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from ddlkernels.algorithms.host import PIECE_BYTES, RAMP, piece_cuts

MiB = 1 << 20


def sizes(n, per, ramp=RAMP):
    return [b - a for a, b in piece_cuts(n, per, ramp)]


@settings(max_examples=400, deadline=None)
@given(n=st.integers(0, 5000), per=st.integers(-1, 300), ramp=st.integers(0, 64))
def test_pieces_cover_the_call_in_order_each_at_most_per_and_doubling_at_most(n, per, ramp):
    cuts = piece_cuts(n, per, ramp)
    assert [a for a, _ in cuts] == [0] + [b for _, b in cuts[:-1]] if cuts else n == 0  # contiguous, in order
    assert (cuts[-1][1] if cuts else 0) == n
    got = [b - a for a, b in cuts]
    assert all(1 <= m <= max(1, per) for m in got), got
    assert all(b <= 2 * a for a, b in zip(got, got[1:])), got
    first = max(1, max(1, per) // max(1, ramp))
    if first < per and n >= 4 * first:  # a ramp: mirrored, so no piece is more than twice the one after it
        assert all(b <= 2 * a for a, b in zip(got[::-1], got[-2::-1])), got


@settings(max_examples=400, deadline=None)
@given(n=st.integers(1, 100_000), per=st.integers(2, 4096), ramp=st.sampled_from([2, 4, 8, 16]))
def test_the_ends_are_short_where_the_call_has_room(n, per, ramp):
    """The first and last pieces are ``per // ramp`` once the call holds 4 of them, else the cut is even."""
    got = sizes(n, per, ramp)
    first = max(1, per // ramp)
    if first < per and n >= 4 * first:
        assert got[0] == got[-1] == first and len(got) >= 3
    else:
        assert got == [per] * (n // per) + ([n % per] if n % per else [])


def test_small_calls_and_ramp_one_by_hand():
    assert sizes(20, 8, ramp=1) == [8, 8, 4]
    assert sizes(3, 8) == [3] and sizes(0, 8) == [] and sizes(1, 8) == [1]
    assert sizes(8, 8) == [1, 2, 2, 2, 1]
    assert sizes(9, 8, ramp=2) == [8, 1]  # a ramp of 4 needs 4 + 8 + 4: the even cut


def test_64_mib_of_float32_as_the_library_cuts_it():
    """The call the staged target is measured on: 13 pieces, 1 MiB at either end, none above PIECE_BYTES."""
    got = [m * 4 / MiB for m in sizes(64 * MiB // 4, PIECE_BYTES // 4)]
    assert got[:3] == [1, 2, 4] and got[-3:] == [4, 2, 1] and len(got) == 13
    assert all(7.1 < m < 7.2 for m in got[3:-3]) and sum(got) == 64
