"""deep_ep's low-latency handle as DeepEP's tests read it: (src_info, layout_range,
num_max_dispatch_tokens_per_rank, hidden, num_experts), in a world of processes started by
torch.multiprocessing.spawn with the Buffer built from the group (ranks.ll_handle_rank), held
to what DeepEP's test_low_latency.py checks of it and to deepepd's order (rows of each local
expert in (source rank, source token) order); and deepep.Buffer.low_latency_handle_info's
refusals."""
import numpy as np
import pytest
import torch

import conftest
import ranks
from test_buffer import SHAPE, one_rank, tokens

#: Generous ceiling for the 4 processes' start (torch imports), construction and 4 calls on a
#: loaded 2-core machine; the ranks finish in seconds when it is idle.
_TIMEOUT = 300


@pytest.fixture
def buf(daemon):
    """One rank of test_buffer's SHAPE (4 local experts, 8 low-latency tokens)."""
    b = one_rank(daemon, **SHAPE)
    yield b
    b.destroy()


@pytest.fixture(scope="module")
def spawned(daemon, seed, tmp_path_factory):
    """Every process's pickled results (ll_handle_rank), by rank."""
    if conftest.BACKEND != "host":
        pytest.skip("the spawned-world tests run on the host backend (CPU tensors, gloo)")
    d = tmp_path_factory.mktemp("llhandle")
    return conftest.spawn_ranks(ranks.ll_handle_rank, ranks.LL_HANDLE_WORLD,
                                (daemon, str(d / "store"), seed, str(d)), str(d), _TIMEOUT,
                                "low-latency handle ranks")


def test_the_handle_is_deepeps_tuple(spawned):
    s = ranks.LL_HANDLE_SHAPE
    W, L = ranks.LL_HANDLE_WORLD, s["num_experts"] // ranks.LL_HANDLE_WORLD
    for out in spawned:
        for call in out["calls"]:
            assert call["tuple"] and call["len"] == 5 and call["same"]
            assert call["rest"] == (s["num_tokens"], s["hidden"], s["num_experts"])
            assert call["src"].shape == (L, W * s["num_tokens"])
            assert call["range"].shape == (L, W)
            assert (call["src_dtype"], call["range_dtype"]) == ("torch.int32", "torch.int64")


def test_src_info_and_layout_range_pass_deepeps_checks(spawned):
    """test_low_latency.py's checks of handle[0] and handle[1] (and deepepd's order): the
    counts in layout_range's low half sum to recv_count, which is the number of selections
    of the expert over every rank's topk_idx; each source's rows begin .. begin + count are
    that source's (their value is its rank - offset) and tile the expert's rows in source
    order; each row's src_info is a token of that source which selected the expert, in
    ascending order, and equals the token index the row carries in its last 128 channels;
    rows past the count have src_info -1."""
    s = ranks.LL_HANDLE_SHAPE
    W, L, n = ranks.LL_HANDLE_WORLD, s["num_experts"] // ranks.LL_HANDLE_WORLD, s["num_tokens"]
    mask = (1 << 32) - 1
    for r, out in enumerate(spawned):
        topk = out["topk"]
        for call in out["calls"]:
            for i in range(L):
                e = r * L + i
                count, src, rng = int(call["count"][i]), call["src"][i], call["range"][i]
                assert count == int((rng & mask).sum()) == int((topk == e).sum())
                assert (src[count:] == -1).all()
                begin = 0
                for j in range(W):
                    b, c = int(rng[j] >> 32), int(rng[j] & mask)
                    want = [t for t in range(n) if e in topk[j][t]]
                    assert (b, c) == (begin, len(want)), (r, i, j)
                    assert src[b:b + c].tolist() == want
                    if "recv" in call:
                        rows = call["recv"][i, b:b + c]
                        assert (rows[:, :-128] == j - ranks.LL_HANDLE_OFFSET).all()
                        assert (rows[:, -128:] == src[b:b + c, None] % n).all()
                    begin += c


def test_a_hooked_dispatch_is_read_after_its_hook_and_the_handle_goes_back(spawned):
    """Indexing a hooked dispatch's handle before the hook is a ValueError saying so (DeepEP
    gives rows not yet received); after it, the handle is the same as an unhooked call's,
    and low_latency_combine (zero copy) takes it back and sums the tokens' weighted rows."""
    for out in spawned:
        assert "call the hook first" in out["early"]
        by = {(c["hooked"], c["fp8"]): c for c in out["calls"]}
        for fp8 in (False, True):
            np.testing.assert_array_equal(by[(True, fp8)]["src"], by[(False, fp8)]["src"])
            np.testing.assert_array_equal(by[(True, fp8)]["range"], by[(False, fp8)]["range"])
        for hooked in (False, True):
            got, want = by[(hooked, False)]["combined"], out["want_combined"]
            np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)


def test_low_latency_handle_info_refuses_what_is_not_a_received_low_latency_handle(buf):
    """deepep.Buffer.low_latency_handle_info: a throughput handle or another object is
    refused naming it; one low-latency rank's tables as DeepEP's (world of one)."""
    x, idx, w = tokens()
    _, _, _, _, th, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    with pytest.raises(ValueError, match="pass the matching low_latency_dispatch's"):
        buf.low_latency_handle_info(th)
    with pytest.raises(TypeError, match="handle must be the Handle"):
        buf.low_latency_handle_info((None, None))
    _, count, lh, _, hook = buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False,
                                                     return_recv_hook=True)
    with pytest.raises(ValueError, match="call the hook first"):
        buf.low_latency_handle_info(lh)
    hook()
    src, rng = buf.low_latency_handle_info(lh)
    assert src.dtype == torch.int32 and rng.dtype == torch.int64
    assert rng.shape == (4, 1) and (rng >> 32).eq(0).all()
    assert torch.equal(rng & 0xffffffff, count.long().view(4, 1))
    for e in range(4):
        c = int(count[e])
        want = [t for t in range(idx.size(0)) if e in idx[t].tolist()]
        assert src[e, :c].tolist() == want and (src[e, c:] == -1).all()


def test_a_low_latency_handle_unpacks_indexes_and_copies_as_a_tuple(buf):
    """deep_ep.LowLatencyHandle on one rank: index (negative too), slice, unpack, copy; the
    tables made once (deep_ep's Buffer passing it back is the spawned test's)."""
    import copy
    compat = ranks.import_compat()
    x, idx, _ = tokens()
    _, count, h, _, _ = buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
    lh = compat.LowLatencyHandle(h, 8, 128, 4)
    assert isinstance(lh, tuple) and len(lh) == 5 and lh.handle is h
    src, rng, m, hid, ne = lh
    assert (m, hid, ne) == (8, 128, 4) and lh[-1] == 4 and lh[2:] == (8, 128, 4)
    assert lh[0] is src and lh[-5] is src and lh[1] is rng and lh[-4] is rng
    assert torch.equal(rng & 0xffffffff, count.long().view(4, 1))
    with pytest.raises(IndexError):
        lh[5]
    c = copy.copy(lh)
    assert type(c) is type(lh) and c.handle is h and c[0] is src and c[2:] == lh[2:]
    assert "LowLatencyHandle(src_info, layout_range, 8, 128, 4)" == repr(lh)
