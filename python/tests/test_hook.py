"""return_recv_hook defers the receive: a hooked low-latency call sends and returns before any
other rank has made its call, the hook receives (the inputs a send read as they were at the
call), hooks may be called in any order, a peer receives a rank's rows before that rank's hook
has run (the host backend splits the call), and the results are the numpy reference's."""
import multiprocessing as mp
import uuid

import pytest

import conftest
import ranks
from test_ops import check_ll_combine, check_ll_dispatch

_WORLD = 2
#: Generous ceiling for a rank's wait for rank 0's hooked call to return (start-up of the
#: other rank's process and torch import on a loaded 2-core machine included); it returns
#: at once where the receive is deferred, and never where it is not.
_WAIT_S = 60


@pytest.fixture(scope="module")
def hooked(daemon, seed):
    if conftest.BACKEND != "host":
        pytest.skip("the hook test runs its ranks on CPU tensors (host backend)")
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m, ctx.Pool(_WORLD) as pool:
        returned = m.Event()
        job = f"pyhook-{uuid.uuid4().hex[:8]}"
        res = pool.map_async(ranks.hook_rank, [(daemon, job, r, _WORLD, seed, returned, _WAIT_S)
                                               for r in range(_WORLD)])
        return res.get(4 * _WAIT_S)


def test_a_hooked_dispatch_returns_before_the_peers_call_and_receives_in_the_hook(hooked, seed):
    check_ll_dispatch(_WORLD, hooked, seed)


def test_a_hooked_combine_combines_its_inputs_as_they_were_at_the_call(hooked, seed):
    check_ll_combine(_WORLD, [r[:1] for r in hooked], seed)


@pytest.fixture(scope="module")
def overlapped(daemon, seed):
    if conftest.BACKEND != "host":
        pytest.skip("the overlap test runs its ranks on CPU tensors (host backend)")
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m, ctx.Pool(_WORLD) as pool:
        received = m.Event()
        job = f"pyoverlap-{uuid.uuid4().hex[:8]}"
        res = pool.map_async(ranks.overlap_rank, [(daemon, job, r, _WORLD, seed, received,
                                                   _WAIT_S) for r in range(_WORLD)])
        # Where the receive waited for rank 0's hook (the exchange made at hook()), rank 0
        # waits _WAIT_S for rank 1, which waits for rank 0: this ceiling bounds that deadlock.
        return res.get(4 * _WAIT_S)


def test_a_peer_receives_a_ranks_rows_before_that_ranks_hook_runs(overlapped, seed):
    check_ll_dispatch(_WORLD, overlapped, seed)
