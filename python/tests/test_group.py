"""deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes) as DeepEP's callers build it: the
job's identity from the process group.  A world of 4 processes started by
torch.multiprocessing.spawn (no launcher's variables), gloo over a FileStore, cut into
expert-parallel groups of two in two ways, so that there are two EP groups per cut and every
process is in two groups; each group's ranks run the operations of test_ops against its numpy
reference, and dispatch's handle is DeepEP's tuple."""
import time

import numpy as np
import pytest
import torch.multiprocessing as tmp

import conftest
import identity_ranks
import ranks
from test_ops import (check_combine, check_dispatch, check_layout, check_ll_combine,
                      check_ll_dispatch, check_ll_fp8, every_input, owner)

#: Generous ceiling for the 4 processes' start (torch imports), construction and 2
#: iterations on a loaded 2-core machine; the ranks finish in seconds when it is idle.
_TIMEOUT = 300
_ITERS = 2


@pytest.fixture(scope="module")
def spawned(daemon, seed, tmp_path_factory):
    """Every process's pickled results (group_rank), by world rank."""
    if conftest.BACKEND != "host":
        pytest.skip("the group tests run on the host backend (CPU tensors, gloo)")
    d = tmp_path_factory.mktemp("group")
    return conftest.spawn_ranks(ranks.group_rank, ranks.GROUP_WORLD, (daemon, str(d / "store"), seed, _ITERS, str(d)),
                                str(d), _TIMEOUT, "group ranks")


def members(out, cut):
    """{group index: [(group rank, identity, results) in group rank order]}."""
    groups = {}
    for o in out:
        i, gr, ident, res = o[cut]
        groups.setdefault(i, []).append((gr, ident, res))
    return {i: sorted(m, key=lambda e: e[0]) for i, m in groups.items()}


def test_the_identity_is_the_groups_and_each_group_is_a_job_of_its_own(spawned):
    jobs = set()
    for cut, ms in (("pairs", ranks.PAIRS), ("cross", ranks.CROSS)):
        groups = members(spawned, cut)
        assert sorted(groups) == list(range(len(ms)))
        for i, group in groups.items():
            assert [gr for gr, _, _ in group] == [0, 1]
            idents = [ident for _, ident, _ in group]
            # One host: every member is local, in group rank order.
            assert [(x.rank, x.world_size, x.local_rank, x.local_world_size)
                    for x in idents] == [(0, 2, 0, 2), (1, 2, 1, 2)]
            assert all(x.nodes == (0, 0) for x in idents)  # the hosts the members said
            assert len({x.job_id for x in idents}) == 1
            jobs.add(idents[0].job_id)
    # Two groups per cut, every process in one of each: four jobs, none shared.
    assert len(jobs) == 4


def test_a_group_that_disagrees_with_explicit_arguments_is_a_value_error(spawned):
    for o in spawned:
        msgs = o["refused"]
        assert len(msgs) == 3, msgs
        assert "world_size 4 was given but the group says 2" in msgs[0]
        assert "rank" in msgs[1] and "but the group says" in msgs[1]
        assert "local_world_size 1 was given but the group has 2 on this node" in msgs[2]


@pytest.mark.parametrize("cut", ["pairs", "cross"])
@pytest.mark.parametrize("check", [check_layout, check_dispatch, check_combine,
                                   check_ll_dispatch, check_ll_combine, check_ll_fp8],
                         ids=lambda f: f.__name__)
def test_each_groups_ranks_dispatch_and_combine_among_themselves(spawned, seed, cut, check):
    for i, group in members(spawned, cut).items():
        check(2, [res for _, _, res in group], ranks.group_seed(seed, cut, i))


def check_handle(W, res, seed):
    """deep_ep's dispatch handle against the reference: DeepEP's rank prefix matrix column of
    the receiving rank (its tests' check_data reads it), its channel prefix matrix, the token
    mask, send_head's places, and recv_src_idx's length (the rows received)."""
    L = ranks.shape(W)["num_experts"] // W
    for it in range(len(res[0])):
        inps = every_input(seed, W, it)
        in_rank = []
        for inp in inps:
            o = owner(inp["idx"], L)
            in_rank.append(np.stack([(o == q).any(1) for q in range(W)], 1) if len(o)
                           else np.zeros((0, W), bool))
        for r in range(W):
            got = res[r][it]
            from_src = [int(m[:, r].sum()) for m in in_rank]
            np.testing.assert_array_equal(got["h_rank_prefix"][:, r], np.cumsum(from_src))
            assert (np.delete(got["h_rank_prefix"], r, axis=1) == -1).all()
            assert got["h_src_idx"].shape == (sum(from_src),)
            m = in_rank[r]
            np.testing.assert_array_equal(got["h_in_rank"], m)
            n, C = len(m), int(got["h_channels"])
            per = -(-n // C)
            sent = np.zeros((W, C), np.int64)
            for t in range(n):
                sent[:, t // per] += m[t]
            np.testing.assert_array_equal(got["h_chan_prefix"], np.cumsum(sent, 1))
            assert got["h_recv_chan_prefix"].shape == (W, C)
            head = np.where(m, np.cumsum(m, 0) - 1, -1)
            np.testing.assert_array_equal(got["h_send_head"], head)


@pytest.mark.parametrize("cut", ["pairs", "cross"])
def test_dispatch_handles_are_deepeps_tuples(spawned, seed, cut):
    for i, group in members(spawned, cut).items():
        check_handle(2, [res for _, _, res in group], ranks.group_seed(seed, cut, i))


def test_the_agreed_job_id_follows_the_launchers_run_id_and_fits(daemon, tmp_path):
    """Each Buffer of a group is a job of its own, named after the launcher's run id where
    there is one (cut to fit DEP_JOB_ID_MAX with the agreed part), or the caller's job_id.
    (group=None in from_group is torch's default group, the world of one here.)"""
    import pickle
    import re
    from deepep import _lib
    ctx = tmp.spawn(identity_ranks.job_id_rank,
                    args=(daemon, str(tmp_path / "store"), str(tmp_path)),
                    nprocs=1, join=False)
    deadline = time.monotonic() + _TIMEOUT
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            ctx.processes[0].kill()
            pytest.fail(f"the process did not finish within {_TIMEOUT} s")
    with open(tmp_path / "ids.pkl", "rb") as f:
        ids = pickle.load(f)
    a, b = ids["none"]
    assert re.fullmatch(r"ep-[0-9a-f]{16}", a) and a != b
    assert ids["given"] == "mine"
    t = ids["torchrun"]
    assert re.fullmatch(r"r+-[0-9a-f]{16}", t) and len(t) == _lib.JOB_ID_MAX - 1
    assert re.fullmatch(r"fixed-[0-9a-f]{16}", ids["deepep"])


def _sockets(d, n):
    """n Unix sockets bound in d (files as a daemon's), their paths; the binders stay open."""
    import socket
    out = []
    for i in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(d / f"n{i}.sock"))
        out.append(s)
    return out


@pytest.mark.parametrize("how", ["two daemons", "one daemon by two paths"])
def test_a_node_is_a_daemon_members_of_other_daemons_on_this_host_are_other_nodes(tmp_path,
                                                                                 how):
    """Four processes of one host in one group: with two daemons' sockets (ranks 0-1 on one,
    2-3 on the other, as a test of two nodes on one machine runs them) the group is two
    nodes of two local ranks; with one socket named by two paths (a symbolic link, as a
    bind mount in a container) it is one node of four.  Before, every member of the host
    was local, whatever daemon it used: such a job never met at its daemons' rendezvous."""
    import pickle
    if conftest.BACKEND != "host":
        pytest.skip("the group tests run on the host backend (CPU tensors, gloo)")
    held = _sockets(tmp_path, 2)
    if how == "two daemons":
        socks = [str(tmp_path / f"n{r // 2}.sock") for r in range(4)]
        want = [(r, 4, r % 2, 2) for r in range(4)], (0, 0, 1, 1)
    else:
        (tmp_path / "link.sock").symlink_to(tmp_path / "n0.sock")
        socks = [str(tmp_path / ("n0.sock" if r % 2 else "link.sock")) for r in range(4)]
        want = [(r, 4, r, 4) for r in range(4)], (0, 0, 0, 0)
    out = conftest.spawn_ranks(identity_ranks.node_key_rank, 4, (socks, str(tmp_path / "store"),
                                                        str(tmp_path)),
                               str(tmp_path), _TIMEOUT, "processes")
    for s in held:
        s.close()
    for r in range(4):
        for ident in out[r]:
            assert (ident.rank, ident.world_size, ident.local_rank,
                    ident.local_world_size) == want[0][r]
            assert ident.nodes == want[1]
