"""DeepEP's own test scripts' calls on deep_ep (tests/test_intranode.py and
tests/test_low_latency.py), on the backend under test, against numpy references of DeepEP's
documented semantics; the ranks are scripts_ranks.py's."""
import uuid

import numpy as np

import conftest
import ranks
import scripts_ranks


def test_low_latency_combine_ignores_rows_past_count_and_unselected_entries(daemon, seed):
    """test_low_latency.py combines the whole packed receive buffer (its rows past recv_count
    are whatever the buffer held: NaN here) with topk_idx holding -1 entries, into
    out=torch.empty: every token is the weighted sum of its selected experts' rows, and no
    NaN.  On cuda (DEP_TEST_BACKEND=cuda) with the script's own shape and 8 ranks, where the
    script saw NaN; a NaN result says what the library reported at its next call."""
    W = 8 if conftest.BACKEND == "cuda" else 2
    res = ranks.run_world(daemon, f"pyll-{uuid.uuid4().hex[:8]}", W, seed, iters=1,
                          device=conftest.DEVICE, fn=scripts_ranks.ll_rank_checked, timeout=600)
    for r in range(W):
        for got in res[r]:
            assert got["same"]
            assert got["nan"] == 0, \
                f"rank {r}, call {got['call']}: NaN; then the library said {got['recorded']}"
            # bf16 rounds the sum once; FP8 rows are within an e4m3 step (1/16) of x.
            assert got["err"] <= (0.07 if got["fp8"] else 2 ** -7) * max(got["scale"], 1), got


def mask_rows(inps, r, key):
    """The rows rank r receives from a dispatch routed by is_token_in_rank: each source's
    tokens that go to r, in (source rank, token) order."""
    return [inp[key][t] for inp in inps for t in range(len(inp["x"])) if inp["mask"][t, r]]


def test_dispatch_without_topk_routes_by_is_token_in_rank_and_sums_the_counts(daemon, seed):
    """test_intranode.py's first dispatch has no topk_idx: rows go where is_token_in_rank
    says, recv_topk_idx and recv_topk_weights are None, and num_recv_tokens_per_expert_list
    is the sum over sources of their num_tokens_per_expert for this rank's experts (DeepEP's
    dispatch docstring).  It raised ValueError ("topk_idx and topk_weights are required").
    On a Buffer whose first call it is (its top-k width unknown there), a later top-k call
    of any width still works."""
    W = 3
    res = ranks.run_world(daemon, f"pytp-{uuid.uuid4().hex[:8]}", W, seed,
                          device=conftest.DEVICE, fn=scripts_ranks.tp_rank_checked, timeout=60)
    inps = [scripts_ranks.tp_inputs(seed, s, W) for s in range(W)]
    Le = scripts_ranks.TP["experts_per_rank"]
    for r in range(W):
        rows = mask_rows(inps, r, "x")
        want_counts = [int(sum(inp["per_expert"][r * Le + l] for inp in inps))
                       for l in range(Le)]
        from_each = np.cumsum([int(inp["mask"][:, r].sum()) for inp in inps])
        ws = np.zeros((0, scripts_ranks.TP["hidden"]), np.float32)
        for got in res[r]:
            for fp8 in (0, 1):
                m = got[f"mask{fp8}"]
                assert m["idx"] is None and m["w"] is None
                assert m["rows"] == len(rows) and got[f"cached{fp8}"] == len(rows)
                assert m["counts"] == want_counts
                np.testing.assert_array_equal(m["prefix"], from_each)
            np.testing.assert_array_equal(got["mask0"]["x"], np.stack(rows) if rows else ws)
            np.testing.assert_array_equal(got["cached_x"], np.stack(rows) if rows else ws)
            assert got["combined_w"] is None
            inp = inps[r]
            np.testing.assert_array_equal(got["combined"],
                                          inp["x"] * inp["mask"].sum(1, keepdims=True))
            assert got["aligned"] == [-(-c // 4) * 4 for c in want_counts]
            # num_worst_tokens: that many rows, no counts (DeepEP's []), the combine as before.
            rows_worst, idx_worst, counts_worst, comb_worst = got["worst"]
            assert rows_worst == W * scripts_ranks.TP["tokens"] and idx_worst is None
            assert counts_worst == []
            np.testing.assert_array_equal(comb_worst, got["combined"])
            # With top-k: DeepEP's results, whatever width the Buffer took.
            for a, want in zip(got["layout"], (inp["per_rank"], inp["per_expert"], inp["mask"])):
                np.testing.assert_array_equal(a, want)
            assert got["topk_idx"].shape == (len(rows), scripts_ranks.TP["num_topk"])
            assert got["topk_counts"] == want_counts
            np.testing.assert_array_equal(got["topk_x"], np.stack(rows) if rows else ws)
            ids = mask_rows(inps, r, "idx")
            wts = mask_rows(inps, r, "w")
            if rows:
                mine = (np.stack(ids) >= r * Le) & (np.stack(ids) < (r + 1) * Le)
                np.testing.assert_array_equal(got["topk_idx"],
                                              np.where(mine, np.stack(ids) - r * Le, -1))
                np.testing.assert_array_equal(got["topk_w"], np.where(mine, np.stack(wts), 0))
            np.testing.assert_array_equal(got["topk_combined_w"],
                                          np.where(inp["idx"] >= 0, inp["w"], 0))
        assert res[r][0]["num_topk"] == scripts_ranks.TP["num_topk"]
        assert res[r][1]["num_topk"] == min(16, Le * W)


def test_dispatch_without_topk_to_more_ranks_than_num_topk_is_refused(daemon, seed):
    """The mask routes through the Buffer's top-k width: a token that goes to more ranks than
    num_topk is a ValueError saying so, raised before anything is sent."""
    W = 3
    res = ranks.run_world(daemon, f"pynarrow-{uuid.uuid4().hex[:8]}", W, seed,
                          device=conftest.DEVICE, fn=scripts_ranks.narrow_rank, timeout=60)
    for msg in res:
        assert "goes to 3 ranks" in msg and "num_topk 2" in msg, msg
