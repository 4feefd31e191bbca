"""Masked ranks through the binding and a real daemon (deepep.h "Masked ranks"):
deep_ep.Buffer(enable_shrink=True)'s low_latency_update/query/clean_mask_buffer with DeepEP's
signatures, in a world of processes started by torch.multiprocessing.spawn, every call held to
numpy's answer with the masked rank's experts removed from every top-k (maskranks.mask_rank);
deepep.Buffer's own mask(), update_mask(), clear_mask() and dropped() on one rank; next_call(),
the call count an elastic job's replacement and survivors line up by; and the refusals."""
import pytest
import torch

import conftest
import deepep
import maskranks
import onerank
import ranks

#: Generous ceiling for the 4 processes' start (torch imports), construction and a dozen
#: calls on a loaded 2-core machine; they finish in seconds when it is idle.
_TIMEOUT = 300


@pytest.fixture(scope="module")
def spawned(daemon, seed, tmp_path_factory):
    if conftest.BACKEND != "host":
        pytest.skip("the spawned worlds run on the host backend (CPU tensors, gloo); the GPU "
                    "suite cuda_ops/masks holds the kernels")
    d = tmp_path_factory.mktemp("masks")
    out = conftest.spawn_ranks(maskranks.mask_rank, maskranks.MASK_WORLD,
                               (daemon, str(d / "store"), seed, str(d)), str(d), _TIMEOUT,
                               "mask ranks")
    for r, o in enumerate(out):
        assert "error" not in o, f"rank {r}: {o['error']}"
    return out


def test_the_query_says_which_rank_is_masked_and_clean_unmasks_it(spawned):
    for o in spawned:
        assert o["status_before"] == [0] * maskranks.MASK_WORLD
        assert o["status_masked"] == [int(r == maskranks.MASKED)
                                      for r in range(maskranks.MASK_WORLD)]
        assert o["status_clean"] == [0] * maskranks.MASK_WORLD
        assert o["mask_epoch"] == 0  # no daemon wrote a live mask: the masks are the ranks'


def test_a_masked_rank_gets_nothing_and_contributes_zero_in_low_latency(spawned):
    for r, o in enumerate(spawned):
        for name in ("before", "masked_ll", "after"):
            c = o[name]
            assert (c["count"] == c["want_count"]).all(), (r, name, c["count"], c["want_count"])
            assert abs(c["combined"] - c["want_combined"]).max() <= 0.02 * abs(
                c["want_combined"]).max() + 1e-6, (r, name)
            assert c["dropped"] == c["want_dropped"], (r, name)
        assert spawned[r]["masked_ll"]["dropped"] > 0 or r != maskranks.MASKED


def test_a_masked_rank_gets_nothing_and_contributes_zero_in_throughput(spawned):
    for r, o in enumerate(spawned):
        c = o["masked_tp"]
        assert c["sources"] == c["want_sources"], (r, c["sources"], c["want_sources"])
        assert abs(c["combined"] - c["want_combined"]).max() <= 0.02 * abs(
            c["want_combined"]).max() + 1e-6, r


def test_deepep_buffer_masks_on_one_rank(daemon):
    if conftest.BACKEND != "host":
        pytest.skip("dropped() is the host backend's; the GPU suite cuda_ops/masks holds the "
                    "kernels")
    b = onerank.one_rank(daemon, **onerank.SHAPE)
    try:
        x, idx, w = onerank.tokens()
        recv, count, handle, _, _ = b.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
        assert int(count.sum()) == 8 and b.dropped(handle) == 0
        m, epoch = b.mask()
        assert m.tolist() == [0] and m.dtype == torch.int32 and epoch == 0
        b.update_mask(0, True)
        assert b.mask()[0].tolist() == [1]
        # Masked itself, the rank talks to no one: nothing received, every pair dropped.
        recv, count, handle, _, _ = b.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
        assert int(count.sum()) == 0 and b.dropped(handle) == 8
        out, _, _ = b.low_latency_combine(recv, idx, w, handle)
        assert float(out.abs().sum()) == 0.0
        b.clear_mask()
        assert b.mask()[0].tolist() == [0]
        with pytest.raises(ValueError, match="rank is 1"):
            b.update_mask(1, True)
        with pytest.raises(TypeError, match="handle"):
            b.dropped(object())
    finally:
        b.destroy()


def test_next_call_is_one_then_counts_each_communicating_call(daemon):
    # Both backends: on cuda the library counts the calls it launches.
    b = onerank.one_rank(daemon, **onerank.SHAPE)
    try:
        assert b.next_call() == 1
        x, idx, w = onerank.tokens()
        recv, count, handle, _, _ = b.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
        assert b.next_call() == 2
        b.low_latency_combine(recv, idx, w, handle)
        assert b.next_call() == 3
        b.update_mask(0, False)  # local: not a call of the job's sequence
        b.mask()
        assert b.next_call() == 3
    finally:
        b.destroy()
    with pytest.raises(deepep.Error, match="destroyed"):
        b.next_call()


def test_the_mask_buffer_needs_enable_shrink_as_deepeps(daemon):
    if conftest.BACKEND != "host":
        pytest.skip("dropped() is the host backend's; the GPU suite cuda_ops/masks holds the "
                    "kernels")
    deep_ep = ranks.import_compat()
    args = dict(onerank.SHAPE, job_id=onerank.one_rank.__name__ + "-shrink", rank=0,
                world_size=1, socket=daemon)
    b = deep_ep.Buffer(None, explicitly_destroy=True, **args)
    try:
        for call, a in (("low_latency_update_mask_buffer", (0, True)),
                        ("low_latency_query_mask_buffer", (torch.zeros(1, dtype=torch.int32),)),
                        ("low_latency_clean_mask_buffer", ())):
            with pytest.raises(RuntimeError, match="enable_shrink=True"):
                getattr(b, call)(*a)
    finally:
        b.destroy()
