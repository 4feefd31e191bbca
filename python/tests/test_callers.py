"""DeepEP's users' call sequences (callers.py: Megatron-LM's fused_a2a autograd functions,
SGLang's DeepEP dispatcher, vLLM's DeepEP managers) through deep_ep, in a world of 4
processes started by torch.multiprocessing.spawn (gloo over a FileStore): Megatron on EP
groups of two inside the world, SGLang on groups of two across them, vLLM on the whole
world, so that the world holds two EP groups of each cut and every process is in three
groups (three jobs, plus vLLM's second Buffer).  Against test_ops' numpy references."""

import numpy as np
import pytest

import callers
import conftest
import ranks
from test_ops import (bf16_bits, check_combine, check_dispatch, check_ll_combine,
                      check_ll_dispatch, check_ll_fp8, every_input, expected_rows, owner)

#: Generous ceiling for the 4 processes' start (torch imports), their groups and jobs, and
#: 2 iterations of each caller on a loaded 2-core machine; they finish in seconds when idle.
_TIMEOUT = 300
_ITERS = 2


@pytest.fixture(scope="module")
def world(daemon, seed, tmp_path_factory):
    """Every process's pickled results (callers_rank), by world rank."""
    if conftest.BACKEND != "host":
        pytest.skip("the callers' sequences run on the host backend (CPU tensors, gloo)")
    d = tmp_path_factory.mktemp("callers")
    return conftest.spawn_ranks(callers.callers_rank, callers.WORLD, (daemon, str(d / "store"), seed, _ITERS, str(d)),
                                str(d), _TIMEOUT, "callers' ranks")


def groups_of(out, caller):
    """[(group index, seed, [results by group rank])] of a caller's groups."""
    groups = {}
    for o in out:
        i, gr, res = o[caller]
        groups.setdefault(i, {})[gr] = res
    return [(i, callers.caller_seed(pytest_seed(), caller, i), [g[r] for r in sorted(g)])
            for i, g in sorted(groups.items())]


def pytest_seed():
    return conftest.SEED


def factors(W, inp):
    """Per token, the sum of (r + 1) over the ranks that receive it."""
    o = owner(inp["idx"], ranks.shape(W)["num_experts"] // W)
    return np.array([sum(q + 1 for q in range(W) if (o[t] == q).any()) for t in range(len(o))],
                    np.float32)


def test_every_caller_ran_on_groups_of_its_own(world):
    for caller, members in (("megatron", callers.PAIRS), ("sglang", callers.CROSS),
                            ("vllm", callers.EVERY)):
        gs = groups_of(world, caller)
        assert [len(res) for _, _, res in gs] == [len(m) for m in members]


def test_megatron_forward_dispatches_and_combines(world):
    for _, seed, res in groups_of(world, "megatron"):
        check_dispatch(len(res), res, seed)
        check_combine(len(res), res, seed)


def test_megatron_backward_combines_dispatch_grads_and_dispatches_combine_grads(world):
    """combine's backward is the cached dispatch of the output's gradient (x's values), the
    experts' backward multiplies by r + 1, dispatch's backward combines it with the probs'
    gradients (r + 1 everywhere on rank r): both are x (resp. 1) times the token's factor."""
    for _, seed, res in groups_of(world, "megatron"):
        W = len(res)
        for it in range(len(res[0])):
            for s, inp in enumerate(every_input(seed, W, it)):
                f = factors(W, inp)
                got = res[s][it]
                n, k = inp["idx"].shape
                want = bf16_bits(inp["x"] * f[:, None] + np.float32(0)) if n else \
                    np.zeros((0, inp["x"].shape[1]), np.int16)
                np.testing.assert_array_equal(got["grad_x"], want)
                np.testing.assert_array_equal(got["grad_probs"],
                                              np.repeat(f[:, None], k, 1).reshape(n, k))


def test_sglang_normal_mode_moves_fp8_with_column_major_scales_and_aligns_counts(world):
    for _, seed, res in groups_of(world, "sglang"):
        W = len(res)
        L = ranks.shape(W)["num_experts"] // W
        for it in range(len(res[0])):
            inps = every_input(seed, W, it)
            for s, inp in enumerate(inps):
                inp.update(ranks.fp8_inputs(seed, s, W, it))
            for r in range(W):
                rows, ids, _, _ = expected_rows(inps, r, L, ("q", "sc"))
                got = res[r][it]
                if ids:
                    np.testing.assert_array_equal(got["fp8_q"], np.stack(rows["q"]))
                    np.testing.assert_array_equal(got["fp8_sc"], np.stack(rows["sc"]))
                    np.testing.assert_array_equal(got["fp8_idx"], np.stack(ids))
                counts = [int((np.stack(ids) == l).sum()) if ids else 0 for l in range(L)]
                assert list(got["fp8_counts"]) == [-(-c // 128) * 128 for c in counts]
            for s, inp in enumerate(inps):
                f = factors(W, inp)
                want = np.repeat(bf16_bits(f + np.float32(0))[:, None],
                                 ranks.shape(W)["hidden"], 1)
                np.testing.assert_array_equal(res[s][it]["ones_combined"], want)


def test_sglang_low_latency_mode_with_the_hook(world):
    for _, seed, res in groups_of(world, "sglang"):
        W = len(res)
        sh = ranks.shape(W)
        rows, groups = W * sh["max_ll_tokens_per_rank"], sh["hidden"] // 128
        check_ll_fp8(W, res, seed)
        for r in res:
            for it in r:
                assert tuple(it["fp8_scales_stride"]) == (groups * rows, 1, rows)
        check_ll_dispatch(W, res, seed)
        check_ll_combine(W, res, seed)


def test_vllm_high_throughput_and_low_latency_managers(world):
    for _, seed, res in groups_of(world, "vllm"):
        W = len(res)
        assert W == 4
        check_dispatch(W, res, seed)
        check_combine(W, res, seed)
        check_ll_dispatch(W, res, seed)
        check_ll_combine(W, res, seed)
