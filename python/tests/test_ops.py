"""Every operation of deepep.Buffer, in worlds of 1, 2 and 4 rank processes, against an
independent numpy reference of DESIGN §6 on random inputs (the seed is printed)."""
import uuid

import numpy as np
import pytest
import torch

import conftest
import ranks

# 8 on cuda too: the ranks of one H200 under MPS, as a node's 8 GPUs' ranks would be.
WORLDS = [1, 2, 4, 8] if conftest.BACKEND == "cuda" else [1, 2, 4]
_results = {}


def world_once(cache: dict, prefix: str, w: int, daemon, seed, **kw):
    """(w, every rank's results) of one job of w rank processes (ranks.run_world with kw), run
    once per world size and kept in cache for the module's other tests."""
    if w not in cache:
        cache[w] = ranks.run_world(daemon, f"{prefix}-{w}-{uuid.uuid4().hex[:8]}", w, seed,
                                   device=conftest.DEVICE, **kw)
    return w, cache[w]


@pytest.fixture(params=WORLDS, ids=lambda w: f"world{w}")
def world(request, daemon, seed):
    """(world size, every rank's results) for one job of that many rank processes."""
    return world_once(_results, "pytest", request.param, daemon, seed)


def bf16_bits(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).bfloat16() \
        .view(torch.int16).numpy()


def bf16_round(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).bfloat16().float().numpy()


def owner(idx: np.ndarray, L: int) -> np.ndarray:
    return np.where(idx >= 0, idx // L, -1)


def every_input(seed, W, it, ll=False):
    return [ranks.inputs(seed, s, W, it, ll) for s in range(W)]


def test_layout_counts_tokens_per_rank_and_expert(world, seed):
    check_layout(*world, seed)


def check_layout(W, res, seed):
    sh = ranks.shape(W)
    L = sh["num_experts"] // W
    for it in range(len(res[0])):
        for r, inp in enumerate(every_input(seed, W, it)):
            o = owner(inp["idx"], L)
            in_rank = np.stack([(o == q).any(1) for q in range(W)], 1) if len(o) \
                else np.zeros((0, W), bool)
            got = res[r][it]
            np.testing.assert_array_equal(got["in_rank"], in_rank)
            np.testing.assert_array_equal(got["per_rank"], in_rank.sum(0))
            want = np.bincount(inp["idx"][inp["idx"] >= 0], minlength=sh["num_experts"])
            np.testing.assert_array_equal(got["per_expert"], want)


def test_dispatch_delivers_each_token_once_per_rank_in_source_order(world, seed):
    check_dispatch(*world, seed)


def check_dispatch(W, res, seed):
    sh = ranks.shape(W)
    L = sh["num_experts"] // W
    for it in range(len(res[0])):
        inps = every_input(seed, W, it)
        for r in range(W):
            xs, ids, ws = [], [], []
            for inp in inps:
                o = owner(inp["idx"], L)
                for t in range(len(o)):
                    if (o[t] == r).any():
                        xs.append(inp["x"][t])
                        ids.append(np.where(o[t] == r, inp["idx"][t] - r * L, -1))
                        ws.append(np.where(o[t] == r, inp["w"][t], 0))
            got = res[r][it]
            n = len(xs)
            assert got["recv_x"].shape == (n, sh["hidden"])
            if n:
                np.testing.assert_array_equal(got["recv_x"], bf16_bits(np.stack(xs)))
                np.testing.assert_array_equal(got["recv_idx"], np.stack(ids))
                np.testing.assert_array_equal(got["recv_w"], np.stack(ws).astype(np.float32))
            want = [int((np.stack(ids) == l).sum()) if n else 0 for l in range(L)]
            assert list(got["counts"]) == want


def test_combine_sums_every_receivers_row_in_float32(world, seed):
    check_combine(*world, seed)


def check_combine(W, res, seed):
    L = ranks.shape(W)["num_experts"] // W
    for it in range(len(res[0])):
        for s, inp in enumerate(every_input(seed, W, it)):
            o = owner(inp["idx"], L)
            # Rank r's experts returned x * (r + 1): the origin gets x * sum of (r + 1).
            factor = np.array([sum(q + 1 for q in range(W) if (o[t] == q).any())
                               for t in range(len(o))], np.float32)
            # A float32 sum starts at +0: a token no rank received is +0, not x * 0.
            want = bf16_bits(inp["x"] * factor[:, None] + np.float32(0)) if len(o) else \
                np.zeros((0, inp["x"].shape[1]), np.int16)
            np.testing.assert_array_equal(res[s][it]["combined"], want)


def ll_rows(inps, e, key="x"):
    """The rows expert e receives, in (source rank, source token) order."""
    return [inp[key][t] for inp in inps for t in range(len(inp["idx"]))
            if (inp["idx"][t] == e).any()]


def iterations(res):
    """(index in the results, inputs' iteration) of each result: a result says its inputs'
    iteration as "it" (the CUDA-graph test's), else it is its index."""
    return [(i, int(r.get("it", i))) for i, r in enumerate(res[0])]


def test_low_latency_dispatch_packs_rows_per_expert_in_source_order(world, seed):
    check_ll_dispatch(*world, seed)


def check_ll_dispatch(W, res, seed):
    sh = ranks.shape(W)
    L = sh["num_experts"] // W
    rows = W * sh["max_ll_tokens_per_rank"]
    for i, it in iterations(res):
        inps = every_input(seed, W, it, ll=True)
        for r in range(W):
            got = res[r][i]
            assert got["ll_x"].shape == (L, rows, sh["hidden"])
            for l in range(L):
                want = ll_rows(inps, r * L + l)
                assert got["ll_count"][l] == len(want)
                if want:
                    np.testing.assert_array_equal(got["ll_x"][l, :len(want)],
                                                  bf16_bits(np.stack(want)))


def test_low_latency_combine_weights_each_experts_row(world, seed):
    check_ll_combine(*world, seed)


def check_ll_combine(W, res, seed):
    scale = ranks.expert_scale(W)
    for i, it in iterations(res):
        for s, inp in enumerate(every_input(seed, W, it, ll=True)):
            x, idx, w = inp["x"], inp["idx"], inp["w"]
            acc = np.zeros_like(x)
            for k in range(idx.shape[1]):
                sel = idx[:, k] >= 0
                y = bf16_round(x * scale[np.maximum(idx[:, k], 0)][:, None])
                acc += np.where(sel[:, None], w[:, k:k + 1] * y, 0).astype(np.float32)
            np.testing.assert_array_equal(res[s][i]["ll_combined"], bf16_bits(acc))


def e4m3_reference(v: np.ndarray) -> np.ndarray:
    """float32 to e4m3fn bytes: round to nearest, ties to even, saturating at 448."""
    codes = np.arange(127)
    e, m = codes >> 3, codes & 7
    vals = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7))
    a = np.minimum(np.abs(v.astype(np.float64)), 448.0)
    hi = np.clip(np.searchsorted(vals, a, side="left"), 0, 126)
    lo = np.maximum(hi - 1, 0)
    dlo, dhi = a - vals[lo], vals[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (pick | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def quantize_reference(x: np.ndarray):
    """DESIGN §6: per token and 128 channels, scale = max(amax, 1e-4) / 448 in float32."""
    g = x.reshape(x.shape[0], -1, 128).astype(np.float32)
    amax = np.abs(g).max(2)
    scale = (np.maximum(amax, np.float32(1e-4)) / np.float32(448)).astype(np.float32)
    q = e4m3_reference((g / scale[:, :, None]).astype(np.float32))
    return q.reshape(x.shape), scale


def test_low_latency_fp8_quantises_per_token_and_128_channels(world, seed):
    check_ll_fp8(*world, seed)


def check_ll_fp8(W, res, seed):
    sh = ranks.shape(W)
    L = sh["num_experts"] // W
    for i, it in iterations(res):
        inps = every_input(seed, W, it, ll=True)
        for inp in inps:
            inp["xb"] = bf16_round(inp["xn"])
        for r in range(W):
            got = res[r][i]
            assert got["fp8_scales"].shape == (L, W * sh["max_ll_tokens_per_rank"],
                                               sh["hidden"] // 128)
            for l in range(L):
                want = ll_rows(inps, r * L + l, "xb")
                assert got["fp8_count"][l] == len(want)
                if want:
                    q, sc = quantize_reference(np.stack(want))
                    np.testing.assert_array_equal(got["fp8_scales"][l, :len(want)], sc)
                    np.testing.assert_array_equal(got["fp8_x"][l, :len(want)], q)


def test_e4m3_reference_agrees_with_torch_where_torch_has_float8():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    v = np.linspace(-500, 500, 100001, dtype=np.float32)
    t = torch.from_numpy(np.clip(v, -448, 448)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(e4m3_reference(v), t)


# ---- throughput extensions: FP8 tuples, cached mode, num_worst_tokens, alignment, weights ----

_ext = {}


@pytest.fixture(params=WORLDS, ids=lambda w: f"world{w}")
def ext_world(request, daemon, seed):
    """(world size, every rank's results) of ranks.ext_rank in one job of that many ranks."""
    return world_once(_ext, "pyext", request.param, daemon, seed, fn=ranks.ext_rank)


def expected_rows(inps, r, L, keys=("x",)):
    """What rank r receives from a throughput dispatch, in (source, token) order: each key's
    rows, the remapped ids, the weights (0 elsewhere) and (source, token) of each row."""
    got = {k: [] for k in keys}
    ids, ws, frm = [], [], []
    for s, inp in enumerate(inps):
        o = owner(inp["idx"], L)
        for t in range(len(o)):
            if (o[t] == r).any():
                for k in keys:
                    got[k].append(inp[k][t])
                ids.append(np.where(o[t] == r, inp["idx"][t] - r * L, -1))
                ws.append(np.where(o[t] == r, inp["w"][t], 0).astype(np.float32))
                frm.append((s, t))
    return got, ids, ws, frm


def test_fp8_dispatch_moves_bytes_and_scales_and_aligns_counts(ext_world, seed):
    W, res = ext_world
    sh = ranks.shape(W)
    L = sh["num_experts"] // W
    for it in range(len(res[0])):
        inps = every_input(seed, W, it)
        for s, inp in enumerate(inps):
            inp.update(ranks.fp8_inputs(seed, s, W, it))
        for r in range(W):
            rows, ids, _, _ = expected_rows(inps, r, L, ("q", "sc"))
            got = res[r][it]
            n = len(ids)
            assert got["fp8_q"].shape == (n, sh["hidden"])
            assert got["fp8_sc"].shape == (n, sh["hidden"] // 128)
            if n:
                np.testing.assert_array_equal(got["fp8_q"], np.stack(rows["q"]))
                np.testing.assert_array_equal(got["fp8_sc"], np.stack(rows["sc"]))
                np.testing.assert_array_equal(got["fp8_idx"], np.stack(ids))
            exact = [int((np.stack(ids) == l).sum()) if n else 0 for l in range(L)]
            assert list(got["fp8_counts"]) == [(c + 3) // 4 * 4 for c in exact]


def test_cached_dispatch_routes_as_its_handle_and_combines_the_weights_back(ext_world, seed):
    W, res = ext_world
    L = ranks.shape(W)["num_experts"] // W
    for it in range(len(res[0])):
        inps = every_input(seed, W, it)
        for r in range(W):
            rows, _, _, _ = expected_rows(inps, r, L)
            got = res[r][it]["cached_x"]
            assert got.shape[0] == len(rows["x"])
            if rows["x"]:
                np.testing.assert_array_equal(got, bf16_bits(np.stack(rows["x"])))
        for s, inp in enumerate(inps):
            o = owner(inp["idx"], L)
            # Each rank sent back its recv_topk_weights: their sum is the weights of the ids
            # that name an expert (each (t, k) is one rank's), 0 for -1.
            np.testing.assert_array_equal(res[s][it]["combined_w"],
                                          np.where(inp["idx"] >= 0, inp["w"], 0).astype(np.float32))
            # The cached rows came back unchanged from every rank that received them.
            hits = np.array([sum(1 for q in range(W) if (o[t] == q).any())
                             for t in range(len(o))], np.float32)
            want = bf16_bits(inp["x"] * hits[:, None] + np.float32(0)) if len(o) else \
                np.zeros((0, inp["x"].shape[1]), np.int16)
            np.testing.assert_array_equal(res[s][it]["cached_combined"], want)


def test_num_worst_tokens_pads_rows_as_deepep_and_combines_only_those_received(ext_world, seed):
    check_worst(*ext_world, seed)


def check_worst(W, res, seed):
    sh = ranks.shape(W)
    L, worst = sh["num_experts"] // W, W * sh["max_tokens_per_rank"]
    for i, it in iterations(res):
        inps = every_input(seed, W, it)
        for r in range(W):
            rows, ids, _, _ = expected_rows(inps, r, L)
            got, n = res[r][i], len(ids)
            assert got["worst_x"].shape == (worst, sh["hidden"])
            assert got["worst_idx"].shape == (worst, sh["num_topk"])
            if n:
                np.testing.assert_array_equal(got["worst_x"][:n], bf16_bits(np.stack(rows["x"])))
                np.testing.assert_array_equal(got["worst_idx"][:n], np.stack(ids))
            assert (got["worst_idx"][n:] == -1).all()
            if "worst_w" in got:
                assert (got["worst_w"][n:] == 0).all()
        for s, inp in enumerate(inps):
            o = owner(inp["idx"], L)
            factor = np.array([sum(q + 1 for q in range(W) if (o[t] == q).any())
                               for t in range(len(o))], np.float32)
            want = bf16_bits(inp["x"] * factor[:, None] + np.float32(0)) if len(o) else \
                np.zeros((0, inp["x"].shape[1]), np.int16)
            np.testing.assert_array_equal(res[s][i]["worst_combined"], want)


# ---- combine's bias, and deep_ep's internode_dispatch / internode_combine ----

_bias = {}


@pytest.fixture(params=WORLDS, ids=lambda w: f"world{w}")
def bias_world(request, daemon, seed):
    """(world size, every rank's results) of ranks.bias_rank in one job of that many ranks."""
    return world_once(_bias, "pybias", request.param, daemon, seed, fn=ranks.bias_rank)


def combined_reference(inp, W, L):
    """The float32 sum, before its rounding, of run_rank's experts' rows (rank r multiplies by
    r + 1): exact, as the inputs' grid makes every term and partial sum."""
    o = owner(inp["idx"], L)
    factor = np.array([sum(q + 1 for q in range(W) if (o[t] == q).any())
                       for t in range(len(o))], np.float32)
    return inp["x"] * factor[:, None] + np.float32(0) if len(o) else \
        np.zeros((0, inp["x"].shape[1]), np.float32)


def test_combine_adds_bias_0_and_bias_1_to_each_combined_token(bias_world, seed):
    """DeepEP's combine(bias=t | (t0, t1)): bf16(t0 + t1 + the rows' sum), in float32 rounded
    once (exact here, so in any order)."""
    W, res = bias_world
    L = ranks.shape(W)["num_experts"] // W
    for it in range(len(res[0])):
        for s, inp in enumerate(every_input(seed, W, it)):
            c = combined_reference(inp, W, L)
            bi = ranks.bias_inputs(seed, s, W, it)
            got = res[s][it]
            np.testing.assert_array_equal(got["plain"], bf16_bits(c))
            np.testing.assert_array_equal(got["bias0"], bf16_bits(c + bi["b0"]))
            np.testing.assert_array_equal(got["bias01"], bf16_bits(c + bi["b0"] + bi["b1"]))
            np.testing.assert_array_equal(got["bias_1"], bf16_bits(c + bi["b1"]))
            if len(c):  # the bias changed something (the grid makes it exact, not absent)
                assert (got["bias01"] != got["plain"]).any()


def test_internode_dispatch_and_combine_are_dispatch_and_combine_with_deepeps_signature(
        bias_world, seed):
    """deep_ep's internode_dispatch (DeepEP's positional arguments: config where dispatch has
    num_worst_tokens), cached through its handle, and internode_combine with weights and bias:
    dispatch's rows and combine's sums, as the references of those say."""
    W, res = bias_world
    L = ranks.shape(W)["num_experts"] // W
    for it in range(len(res[0])):
        inps = every_input(seed, W, it)
        for r in range(W):
            rows, ids, ws, _ = expected_rows(inps, r, L)
            got, n = res[r][it], len(ids)
            assert got["inter_x"].shape[0] == n and got["inter_cached"].shape[0] == n
            if n:
                np.testing.assert_array_equal(got["inter_x"], bf16_bits(np.stack(rows["x"])))
                np.testing.assert_array_equal(got["inter_cached"], got["inter_x"])
                np.testing.assert_array_equal(got["inter_idx"], np.stack(ids))
                np.testing.assert_array_equal(got["inter_w"], np.stack(ws))
            assert list(got["inter_counts"]) == \
                [int((np.stack(ids) == l).sum()) if n else 0 for l in range(L)]
        for s, inp in enumerate(inps):
            c = combined_reference(inp, W, L)
            bi = ranks.bias_inputs(seed, s, W, it)
            np.testing.assert_array_equal(res[s][it]["inter_combined"],
                                          bf16_bits(c + bi["b0"] + bi["b1"]))
            np.testing.assert_array_equal(res[s][it]["inter_combined_w"],
                                          np.where(inp["idx"] >= 0, inp["w"], 0)
                                          .astype(np.float32))


def test_combine_adds_the_bias_before_its_one_rounding_in_both_bindings(daemon, seed):
    """A case where the two roundings part (ranks.tie_rank): deepep's and deep_ep's combine
    with a bias give DeepEP's 1 + 2^-7, not the 1 of a bias added to the rounded sum."""
    res = ranks.run_world(daemon, f"pytie-{uuid.uuid4().hex[:8]}", 2, seed,
                          device=conftest.DEVICE, fn=ranks.tie_rank)
    for rank, per in enumerate(res):
        for name, got in per.items():
            what = f"rank {rank}, {name}"
            assert (got["plain"] & 0xFFFF == ranks.TIE_ONE).all(), what
            for bias in ("pair", "one"):
                assert (got[bias] & 0xFFFF == ranks.TIE_ONE_ULP).all(), \
                    f"{what}, bias {bias}: {got[bias][0, :4] & 0xFFFF} (0x3f80 is the bias " \
                    "added after the rounding)"
