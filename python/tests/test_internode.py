"""deep_ep's internode handle (DeepEP's internode_dispatch 10-tuple) in a job over two
daemons on 127.0.0.1, each the other's peer (one node each, as tests/nodes.c starts them):
dispatch across nodes returns it as DeepEP's does, internode_dispatch too, and both handles
index as DeepEP's test_internode.py indexes them and serve a cached dispatch and a combine;
a hooked low-latency call defers its receive across nodes as on one node (host backend)."""
import multiprocessing as mp
import os
import subprocess
import tempfile
import time
import uuid

import numpy as np
import pytest

import conftest
import ranks
from test_ops import (bf16_bits, check_ll_combine, check_ll_dispatch, expected_rows,
                      every_input, owner)

ITERS = 2
#: A ceiling for the daemons to see each other on a loaded machine, not a timing.
PEERS_UP_S = 30


def _peers_up(ctl, sock):
    """Whether the daemon at sock sees its peer up (deepepctl peers --json)."""
    r = subprocess.run([ctl, "-s", sock, "peers", "--json"], capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.count('"state":"up"') == ranks.NODES - 1


@pytest.fixture(scope="module")
def two_nodes():
    """The sockets of ranks.NODES daemons that are each other's peers, stopped at the end."""
    ctl, exe = (os.path.join(conftest.BUILD, n) for n in ("deepepctl", "deepepd"))
    d = tempfile.mkdtemp(prefix="deepep-xn.")
    key = os.path.join(d, "key")
    subprocess.run([ctl, "genkey", key], check=True, capture_output=True)
    ports = conftest.free_ports(ranks.NODES)
    procs, socks = [], []
    pool = "pool:\n  host_size: 64MiB\n  chunk_size: 2MiB\n" if conftest.BACKEND == "host" else \
        "pool:\n  size_per_device: 4GiB\n  host_size: 64MiB\n  chunk_size: 64MiB\n"
    try:
        for i, port in enumerate(ports):
            sock, conf = os.path.join(d, f"n{i}.sock"), os.path.join(d, f"n{i}.yaml")
            peers = ", ".join(f"{{host: 127.0.0.1, port: {p}}}" for p in ports if p != port)
            with open(conf, "w") as f:
                f.write(f"socket:\n  path: {sock}\n  mode: 0600\nbackend: {conftest.BACKEND}\n"
                        f"{pool}listen: {{address: 127.0.0.1, port: {port}}}\n"
                        f"peers: [{peers}]\npeer_key_file: {key}\npeer_wait_ms: 0\n")
            log = open(os.path.join(d, f"n{i}.log"), "w")
            procs.append(subprocess.Popen([exe, "--backend", conftest.BACKEND, "-s", sock,
                                           "-c", conf], stdout=log, stderr=subprocess.STDOUT))
            socks.append(sock)
        deadline = time.monotonic() + PEERS_UP_S
        while not all(_peers_up(ctl, s) for s in socks):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                logs = "".join(open(os.path.join(d, f"n{i}.log")).read()
                               for i in range(len(socks)))
                pytest.fail(f"the {ranks.NODES} daemons did not see each other up within "
                            f"{PEERS_UP_S} s; their logs:\n{logs}")
            time.sleep(0.05)
        yield tuple(socks)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        subprocess.run(["rm", "-rf", d], check=False)


@pytest.fixture(scope="module")
def internode(two_nodes, seed):
    """(world, every rank's results) of ranks.internode_rank over the two daemons."""
    W = ranks.NODES * ranks.NODE_RANKS
    return W, ranks.run_world(two_nodes, f"pyxn-{uuid.uuid4().hex[:8]}", W, seed, iters=ITERS,
                              device=conftest.DEVICE, fn=ranks.internode_rank)


NAMES = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
         "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum",
         "recv_gbl_channel_prefix_matrix", "recv_gbl_rank_prefix_sum", "recv_src_meta",
         "send_rdma_head", "send_nvl_head")


def _check_handle(members, inp, frm, W, L, C, what):
    """One rank's 10 members against what it sent (inp) and received (frm: (source, token)
    per row): DeepEP's shapes and dtypes, the known values, -1 for the rest."""
    N, R, n, rows = ranks.NODES, W, len(inp["idx"]), len(frm)
    assert len(members) == 10, what
    m = dict(zip(NAMES, members))
    want = {"is_token_in_rank": ((n, R), "torch.bool"),
            "rdma_channel_prefix_matrix": ((N, C), "torch.int32"),
            "gbl_channel_prefix_matrix": ((R, C), "torch.int32"),
            "recv_rdma_channel_prefix_matrix": ((N, C), "torch.int32"),
            "recv_rdma_rank_prefix_sum": ((N,), "torch.int32"),
            "recv_gbl_channel_prefix_matrix": ((R, C), "torch.int32"),
            "recv_gbl_rank_prefix_sum": ((R,), "torch.int32"),
            "recv_src_meta": ((rows, 8), "torch.uint8"),
            "send_rdma_head": ((n, N), "torch.int32"),
            "send_nvl_head": ((rows, 8), "torch.int32")}
    for name, (shape, dtype) in want.items():
        assert (m[name][0].shape, m[name][1]) == (shape, dtype), f"{what}: {name}"
    o = owner(inp["idx"], L)
    goes = np.array([[(o[t] == r).any() for r in range(R)] for t in range(n)], bool) \
        .reshape(n, R)
    np.testing.assert_array_equal(m["is_token_in_rank"][0], goes, err_msg=what)
    node_goes = goes.reshape(n, N, ranks.NODE_RANKS).any(2)
    # DeepEP's channels: token t in channel t // ceil(n / C); running sums per destination.
    chan = np.arange(n) // max(-(-n // C), 1)
    for name, g in (("gbl_channel_prefix_matrix", goes),
                    ("rdma_channel_prefix_matrix", node_goes)):
        sent = np.array([[int(g[chan == c, dst].sum()) for c in range(C)]
                         for dst in range(g.shape[1])], np.int64).reshape(g.shape[1], C)
        np.testing.assert_array_equal(m[name][0], sent.cumsum(1), err_msg=f"{what}: {name}")
    head = np.where(node_goes, node_goes.cumsum(0) - 1, -1)
    np.testing.assert_array_equal(m["send_rdma_head"][0], head, err_msg=what)
    for name in ("recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum",
                 "recv_gbl_channel_prefix_matrix", "send_nvl_head"):
        assert (m[name][0] == -1).all(), f"{what}: {name} is not all -1"
    per_src = np.bincount([s for s, _ in frm], minlength=R)
    np.testing.assert_array_equal(m["recv_gbl_rank_prefix_sum"][0], per_src.cumsum(),
                                  err_msg=what)
    meta = m["recv_src_meta"][0].view(np.int32).reshape(rows, 2)
    np.testing.assert_array_equal(meta[:, 0], [s // ranks.NODE_RANKS for s, _ in frm],
                                  err_msg=f"{what}: recv_src_meta's source nodes")
    assert (meta[:, 1] == -1).all(), what


def test_dispatch_across_nodes_returns_deepeps_internode_handle(internode, seed):
    """dispatch (DeepEP's: internode when the group spans nodes) and internode_dispatch both
    return the 10-tuple, with DeepEP's shapes and dtypes and what the rank knows in it."""
    W, res = internode
    L = ranks.shape(W)["num_experts"] // W
    for it in range(ITERS):
        inps = every_input(seed, W, it)
        for r in range(W):
            got = res[r][it]
            C = got["channels"]
            assert got["type"] == got["inter_type"] == "InternodeHandle"
            _, _, _, frm = expected_rows(inps, r, L)
            for key in ("handle", "inter_handle"):
                _check_handle(got[key], inps[r], frm, W, L, C, f"rank {r} it {it} {key}")
            o = owner(inps[r]["idx"], L)
            np.testing.assert_array_equal(got["rdma"], [
                sum(int(((o[t] >= 0) & (o[t] // ranks.NODE_RANKS == m)).any())
                    for t in range(len(o))) for m in range(ranks.NODES)])

def test_the_internode_handle_indexes_as_deepeps_test_internode(internode, seed):
    """As DeepEP's test_internode.py reads it: handle[-4] is recv_gbl_rank_prefix_sum, whose
    entry i ends the rows from rank i (its last the rows received); a cached dispatch through
    the handle and combine with it and internode_combine give dispatch's rows and sums."""
    W, res = internode
    L = ranks.shape(W)["num_experts"] // W
    for it in range(ITERS):
        inps = every_input(seed, W, it)
        for r in range(W):
            got = res[r][it]
            rows, _, _, frm = expected_rows(inps, r, L)
            prefix = got["handle"][-4][0]
            assert prefix[-1] == len(frm) == got["x"].shape[0]
            start = 0
            for i in range(W):
                assert all(s == i for s, _ in frm[start:prefix[i]]), f"rank {r}: rows of {i}"
                start = prefix[i]
            if frm:
                np.testing.assert_array_equal(got["x"], bf16_bits(np.stack(rows["x"])))
            np.testing.assert_array_equal(got["inter_x"], got["x"])
            np.testing.assert_array_equal(got["cached_x"], got["x"])
        for s, inp in enumerate(inps):
            o = owner(inp["idx"], L)
            factor = np.array([sum(q + 1 for q in range(W) if (o[t] == q).any())
                               for t in range(len(o))], np.float32)
            want = bf16_bits(inp["x"] * factor[:, None] + np.float32(0)) if len(o) else \
                np.zeros((0, inp["x"].shape[1]), np.int16)
            np.testing.assert_array_equal(res[s][it]["combined"], want)
            np.testing.assert_array_equal(res[s][it]["inter_combined"], want)


def test_a_hooked_low_latency_pair_across_nodes_equals_the_unhooked_one(internode):
    """The receive hook in a job that spans nodes (a split call, on either backend):
    the rows, counts and combined output are those of the same call without the hook."""
    W, res = internode
    for r in range(W):
        for it, o in enumerate(res[r]):
            (x0, c0, y0), (x1, c1, y1) = o["ll"], o["ll_hooked"]
            np.testing.assert_array_equal(c1, c0, err_msg=f"rank {r} iteration {it}: counts")
            for e in range(len(c0)):
                n = int(c0[e])
                np.testing.assert_array_equal(x1[e, :n], x0[e, :n],
                                              err_msg=f"rank {r} iteration {it} expert {e}")
            np.testing.assert_array_equal(y1, y0, err_msg=f"rank {r} iteration {it}: combined")


#: A ceiling for a rank's wait for rank 0's hooked call to return (process start-up and torch
#: import on a loaded machine included): it returns at once where the receive is deferred,
#: and never where it is not.
HOOK_WAIT_S = 60


@pytest.fixture(scope="module")
def hooked_across(two_nodes, seed):
    """ranks.hook_rank's results in a job over the two daemons: rank 0's hooked dispatch
    returns before any other rank, those on the other node included, has made its call (where
    the receive is deferred: both backends split calls across nodes; it raised or ran whole
    before), then pipelined hooked dispatches with their hooks in reverse order and a hooked
    combine."""
    if conftest.BACKEND != "host":
        pytest.skip("hook_rank runs its ranks on CPU tensors (host backend), as test_hook's")
    W = ranks.NODES * ranks.NODE_RANKS
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m, ctx.Pool(W) as pool:
        returned = m.Event()
        job = f"pyxnhook-{uuid.uuid4().hex[:8]}"
        res = pool.map_async(ranks.hook_rank, [(tuple(two_nodes), job, r, W, seed, returned,
                                                HOOK_WAIT_S) for r in range(W)])
        return W, res.get(4 * HOOK_WAIT_S)


def test_a_hooked_dispatch_across_nodes_returns_before_the_peers_call(hooked_across, seed):
    W, res = hooked_across
    check_ll_dispatch(W, res, seed)


def test_a_hooked_combine_across_nodes_combines_its_inputs_as_at_the_call(hooked_across, seed):
    W, res = hooked_across
    check_ll_combine(W, [r[:1] for r in res], seed)
