"""deepep.Buffer on the cuda backend: the GPU's UUID, the caller's current stream, real CUDA
events, device tensors, one layer's low-latency pair captured in a CUDA graph and replayed
with new inputs, sixteen layers' pairs in one graph, a hooked pair (send and receive) in one
graph, handles made before a capture and used in it kept for the graph, and a low-latency
handle's read-back captured with its dispatch.
Each test skips, saying so, unless DEP_TEST_BACKEND=cuda (conftest.py)."""
import gc
import uuid

import pytest
import torch

import conftest
import deepep
import ranks
import test_ops
from deepep.buffer import _cuda_uuid, _driver_uuid

pytestmark = pytest.mark.usefixtures("cuda_only")

SHAPE = dict(hidden=256, num_experts=4, num_topk=2, max_tokens_per_rank=16,
             max_ll_tokens_per_rank=16)
#: GPU cycles of torch.cuda._sleep that keep a stream busy well past a Python call (~25 ms).
SLEEP = 50_000_000


def one_rank(sock, **kw):
    args = dict(job_id="c-" + uuid.uuid4().hex[:10], rank=0, world_size=1, socket=sock)
    args.update(SHAPE)
    args.update(kw)
    return deepep.Buffer(**args)


def tokens(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(-32, 33, (n, SHAPE["hidden"]), generator=g) / 8).bfloat16().cuda()
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(n)]).cuda()
    w = (torch.randint(1, 5, (n, 2), generator=g) / 4).float().cuda()
    return x, idx, w


def ll_reference(x, idx, w):
    """One rank: each expert returns its rows unchanged, so out = sum_k w[t, k] * x[t] over
    the token's experts (-1 excluded), in float32, rounded to bf16."""
    wk = torch.where(idx >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)
    return (x.float() * wk).bfloat16()


def daemon_uuids(sock):
    out = conftest.daemon_status(sock, lambda st: [st.devices[i].uuid.decode().lower()
                                                   .replace("gpu-", "")
                                                   for i in range(st.num_devices)])
    assert out is not None, f"dep_status of the daemon at {sock} failed"
    return out


def test_the_gpus_uuid_is_torchs_the_drivers_and_one_the_daemon_lends(daemon):
    t, d = _cuda_uuid(0), _driver_uuid(0)
    assert t == d and t != bytes(16)
    assert str(uuid.UUID(bytes=t)) in daemon_uuids(daemon)
    b = one_rank(daemon)
    assert b.backend == "cuda" and b.device == torch.device("cuda", 0) and b.attached
    b.destroy()


def test_tensors_elsewhere_than_the_ranks_gpu_are_refused_naming_them(daemon):
    b = one_rank(daemon)
    x, idx, w = tokens()
    with pytest.raises(ValueError, match="x is on cpu; this rank's tensors live on cuda:0"):
        b.low_latency_dispatch(x.cpu(), idx, 16, 4)
    with pytest.raises(ValueError, match="topk_idx is on cpu"):
        b.dispatch(x, topk_idx=idx.cpu(), topk_weights=w)
    with pytest.raises(ValueError, match="topk_weights is on cpu"):
        b.dispatch(x, topk_idx=idx, topk_weights=w.cpu())
    b.destroy()


def test_operations_run_in_order_on_the_callers_current_stream(daemon):
    """On a busy side stream: the input written there after a long kernel is what the
    operations read (they are queued behind it), and the low-latency pair returns before the
    stream has run it (no host wait, no device-wide sync from handles)."""
    b = one_rank(daemon)
    x, idx, w = tokens()
    s = torch.cuda.Stream()
    for _ in range(3):  # the first calls, and handles reused from the pool
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLEEP)
            x3 = x * 3  # on s, after the sleep
            recv, count, h, _, _ = b.low_latency_dispatch(x3, idx, 16, 4, use_fp8=False)
            out, _, _ = b.low_latency_combine(recv, idx, w, h)
            busy = not s.query()
        assert busy, "the low-latency pair waited for its stream"
        s.synchronize()
        torch.testing.assert_close(out, ll_reference(x3, idx, w), rtol=0, atol=0)
        assert count.tolist() == torch.bincount(idx.flatten().cpu(), minlength=4).tolist()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP)
        x5 = x * 5
        rx, _, _, counts, h, _ = b.dispatch(x5, topk_idx=idx, topk_weights=w)
        torch.cuda._sleep(SLEEP)
        y = rx * 2
        comb, _, _ = b.combine(y, h)  # queued behind the sleep and y
    s.synchronize()
    torch.testing.assert_close(rx, x5, rtol=0, atol=0)  # one rank: every token once, in order
    torch.testing.assert_close(comb, x5 * 2, rtol=0, atol=0)
    b.destroy()


def test_a_collected_handle_is_reused_behind_the_kernels_of_every_stream_it_was_used_on(
        daemon):
    """Handle reuse (Buffer._cuda_handle): a handle used on one stream alone is reused at
    once by the next dispatch on that stream, even while the stream still runs its combine
    (stream order puts the new dispatch behind it), and the combine's result is intact; one
    used on a second stream (a combine there), or on another stream alone, is not reused
    while that stream is still busy, and is once it is past; the counts are the host copy's
    (recv_count_per_expert_host) on every call."""
    b = one_rank(daemon)
    x, idx, w = tokens()
    want = torch.bincount(idx.flatten().cpu(), minlength=4).tolist()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        b.dispatch(x, topk_idx=idx, topk_weights=w)  # the pool's first handle, collected
        rx, _, _, counts, h, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
        torch.cuda._sleep(SLEEP)
        comb, _, _ = b.combine(rx * 2, h)  # queued behind the sleep
        p = h._ptr
        del h
        assert not s1.query()
        rx3, _, _, counts3, h3, _ = b.dispatch(x * 3, topk_idx=idx, topk_weights=w)
        assert h3._ptr == p, "a handle of this stream alone was not reused at once"
    s1.synchronize()
    torch.testing.assert_close(comb, x * 2, rtol=0, atol=0)
    torch.testing.assert_close(rx3, x * 3, rtol=0, atol=0)
    assert counts == counts3 == want
    # Used on s1 (its dispatch) and s2 (its combine, behind a sleep there): not reused
    # while s2 is busy.
    with torch.cuda.stream(s2):
        torch.cuda._sleep(SLEEP)
        comb2, _, _ = b.combine(rx3 * 2, h3)
    p3 = h3._ptr
    del h3
    with torch.cuda.stream(s1):
        rx4, _, _, _, h4, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
        assert not s2.query() and h4._ptr != p3, "reused before the other stream was past it"
    s2.synchronize()
    torch.testing.assert_close(comb2, x * 6, rtol=0, atol=0)
    with torch.cuda.stream(s1):
        rx5, _, _, _, h5, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
        assert h5._ptr == p3, "not reused once both streams were past it"
    # Used on s2 alone, collected while s2 is busy: not reused on s1 until s2 is past it.
    with torch.cuda.stream(s2):
        torch.cuda._sleep(SLEEP)
        rx6, _, _, _, h6, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
        torch.cuda._sleep(SLEEP)
        comb6, _, _ = b.combine(rx6, h6)
    p6 = h6._ptr
    del h6, h4
    with torch.cuda.stream(s1):
        _, _, _, _, h7, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
        # h4's (s1's alone) is taken; h6's waits for s2.
        assert not s2.query() and h7._ptr != p6
        _, _, _, _, h8, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
        assert h8._ptr != p6
    s2.synchronize()
    torch.testing.assert_close(comb6, x, rtol=0, atol=0)
    with torch.cuda.stream(s1):
        _, _, _, counts9, h9, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
        assert h9._ptr == p6 and counts9 == want
    torch.testing.assert_close(rx5, x, rtol=0, atol=0)
    b.destroy()


def test_async_finish_and_previous_event_are_real_cuda_events(daemon):
    b = one_rank(daemon)
    x, idx, w = tokens()
    s, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP)
        x3 = x * 3
        # Not with return_recv_hook: the hook receives, so there is no event (ValueError).
        recv, count, h, ev, _ = b.low_latency_dispatch(x3, idx, 16, 4, use_fp8=False,
                                                       async_finish=True)
    assert isinstance(ev.event.event, torch.cuda.Event) and not ev.event.query()
    with torch.cuda.stream(s2):
        ev.current_stream_wait()  # s2 waits for the dispatch on s
        got = recv.clone()
        # A previous_event made on s2 (after the clone) that the combine, on s, waits for.
        before = deepep.Buffer.capture()
        torch.cuda._sleep(SLEEP)
        recv.mul_(2)
        after_mul = deepep.Buffer.capture()
    with torch.cuda.stream(s):
        with after_mul:
            pass  # `with event:` makes s wait at the block's end
        out, ev2, _ = b.low_latency_combine(recv, idx, w, h, async_finish=True)
    ev2.event.synchronize()
    assert before.event.query()
    for e in range(4):  # one rank: expert e's rows are its tokens, in order
        rows = x3[(idx == e).any(1)]
        assert count[e].item() == rows.size(0)
        torch.testing.assert_close(got[e, :rows.size(0)], rows, rtol=0, atol=0)
    torch.testing.assert_close(out, ll_reference(x3 * 2, idx, w), rtol=0, atol=0)
    # Throughput mode: previous_event is waited for on the current stream.
    with torch.cuda.stream(s2):
        torch.cuda._sleep(SLEEP)
        x7 = x * 7
        ready = deepep.Buffer.capture()
    per_rank, _, per_expert, in_rank, lev = b.get_dispatch_layout(idx, 4, previous_event=ready,
                                                                  async_finish=True)
    rx, _, _, counts, h, dev = b.dispatch(x7, topk_idx=idx, topk_weights=w,
                                          previous_event=lev, async_finish=True)
    dev.current_stream_wait()
    torch.testing.assert_close(rx, x7, rtol=0, atol=0)
    assert per_rank.tolist() == [8] and counts == per_expert.tolist()
    b.destroy()


@pytest.mark.parametrize("world", [1, 2, 8])
def test_low_latency_pair_in_a_cuda_graph_replayed_100_times_with_new_inputs(daemon, seed,
                                                                              world):
    res = ranks.run_world(daemon, f"graph-{world}-{uuid.uuid4().hex[:8]}", world, seed,
                          iters=100, device=conftest.DEVICE, fn=ranks.graph_rank, timeout=240)
    assert [len(r) for r in res] == [100] * world
    assert len({r["it"] for r in res[0]}) == 100
    test_ops.check_ll_dispatch(world, res, seed)
    test_ops.check_ll_combine(world, res, seed)
    test_ops.check_ll_fp8(world, res, seed)


@pytest.mark.parametrize("world", [1, 2, 8])
def test_sixteen_layers_low_latency_pairs_in_one_cuda_graph_replayed_with_new_inputs(
        daemon, seed, world):
    """A decode step as SGLang and vLLM capture it: one low_latency_dispatch and
    low_latency_combine per MoE layer, 16 layers in one graph (no limit on the dispatches a
    graph captures, nothing made ahead), each layer checked on every replay."""
    iters = 10
    res = ranks.run_world(daemon, f"graph16-{world}-{uuid.uuid4().hex[:8]}", world, seed,
                          iters=iters, device=conftest.DEVICE, fn=ranks.graph_layers_rank,
                          timeout=240)
    assert [len(r) for r in res] == [iters * ranks.GRAPH_LAYERS] * world
    assert len({r["it"] for r in res[0]}) == iters * ranks.GRAPH_LAYERS
    test_ops.check_ll_dispatch(world, res, seed)
    test_ops.check_ll_combine(world, res, seed)


@pytest.mark.parametrize("world", [1, 2, 8])
def test_worst_case_throughput_pair_in_a_cuda_graph_replayed_100_times(daemon, seed, world):
    res = ranks.run_world(daemon, f"graphtp-{world}-{uuid.uuid4().hex[:8]}", world, seed,
                          iters=100, device=conftest.DEVICE, fn=ranks.graph_tp_rank,
                          timeout=240)
    assert [len(r) for r in res] == [100] * world
    test_ops.check_worst(world, res, seed)


def other_calls(b, rnd, ptr, held):
    """Dispatches (throughput and low-latency) of other routings and token counts, some of
    whose handles are held (so that the pool empties and new ones are made) and the rest
    dropped at once (so that they are reused among themselves): none may get the handle
    `ptr` whose arrays a graph reads, and each one's results are its own."""
    for i in range(deepep.handle._CUDA_POOL + 2):
        n = 3 + (i + rnd) % 6
        x, idx, w = tokens(n, seed=100 * rnd + i)
        idx[i % n] = -1  # one token sent nowhere: another routing than the graph's
        sent = (idx >= 0).any(1)
        rx, _, _, _, h, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
        recv, count, lh, _, _ = b.low_latency_dispatch(x, idx, 16, 4, use_fp8=False)
        assert ptr not in (h._ptr, lh._ptr), "a later dispatch got the graph's handle"
        torch.testing.assert_close(rx, x[sent], rtol=0, atol=0)
        assert count.tolist() == torch.bincount(idx[idx >= 0].cpu(), minlength=4).tolist()
        if i % 3 == 0:
            held.append((h, lh))


@pytest.mark.parametrize("op", ["combine", "cached_dispatch", "low_latency_combine"])
def test_a_handle_made_before_a_capture_and_used_in_it_is_kept_for_the_graph(daemon, op):
    """A dispatch outside a capture, the op that takes its handle captured in a CUDA graph,
    the handle then dropped: the Buffer keeps it (Buffer._use), so dispatches after it, of
    other routings, never get its arrays (which the graph reads at every replay), and each
    replay with new inputs gives the reference result, rounds of such dispatches between
    replays.  Without the keep, the dropped handle went back to the pool and the next
    dispatch rewrote its arrays under the graph."""
    b = one_rank(daemon)
    x, idx, w = tokens()
    if op == "low_latency_combine":
        recv, _, h, _, _ = b.low_latency_dispatch(x, idx, 16, 4, use_fp8=False)
        sin, sw = recv.clone(), w.clone()  # the graph's inputs

        def run(h):
            return b.low_latency_combine(sin, idx, sw, h)[0]

        def load(k, wk):
            sin.copy_(recv * k)
            sw.copy_(wk)
            return ll_reference(x * k, idx, wk)
    else:
        rx, _, _, _, h, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
        assert torch.equal(rx, x)  # one rank: every token once, in order
        sin = rx.clone()

        def run(h):
            if op == "combine":
                return b.combine(sin, h)[0]
            return b.dispatch(sin, handle=h)[0]

        def load(k, wk):
            sin.copy_(x * k)
            return x * k  # combine and cached dispatch alike give the rows back in order
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(h)  # torch's rule: each captured call once outside first, on a side stream
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run(h)
    ptr = h._ptr
    del h
    gc.collect()
    torch.cuda.synchronize()  # every stream it was used on is past it: reusable, were it pooled
    held = []
    for rnd in range(3):
        other_calls(b, rnd, ptr, held)
        _, _, wk = tokens(seed=50 + rnd)
        want = load(rnd + 2, wk)
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert len(b._pinned) == 1 and b._pinned[0]._ptr == ptr
    del g
    b.destroy()


def test_dispatch_without_worst_case_rows_in_a_capture_is_refused_before_anything_is_queued(
        daemon):
    b = one_rank(daemon)
    x, idx, w = tokens()
    b.low_latency_dispatch(x, idx, 16, 4)  # warm
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(deepep.Unsupported, match="CUDA-graph capture without num_worst_tokens"):
        with torch.cuda.graph(g):
            b.dispatch(x, topk_idx=idx, topk_weights=w)
    rx, _, _, _, h, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)  # and it goes on
    torch.testing.assert_close(b.combine(rx, h)[0], x, rtol=0, atol=0)
    b.destroy()


def test_a_hooked_low_latency_pair_runs_on_the_stream_current_at_its_hook(daemon):
    """return_recv_hook: the call queues the send on the current stream and the hook the
    receive on the stream current then: the handle notes that stream (as a combine's use
    does), the outputs are the unhooked pair's, and the inputs may be overwritten between
    call and hook."""
    b = one_rank(daemon)
    x, idx, w = tokens()
    want = ll_reference(x, idx, w)
    side = torch.cuda.Stream()
    xi = x.clone()
    recv, count, h, ev, hook = b.low_latency_dispatch(xi, idx, 16, 4, use_fp8=False,
                                                      return_recv_hook=True)
    assert ev.event is None
    xi.zero_()  # the caller's to reuse once the call returns
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        hook()
        out, _, hook2 = b.low_latency_combine(recv, idx, w, h, return_recv_hook=True)
        hook2()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert type(h._stream) is tuple and side.cuda_stream in h._stream
    assert torch.equal(out, want)
    b.destroy()


def test_a_hooked_low_latency_call_is_two_kernels_the_send_at_the_call(daemon):
    """DeepEP's bench_kineto (num_kernels_per_period=2) times a hooked call as a send kernel
    and a receive kernel: here two launches of deepepd::ll::dispatch (::combine), the first
    made by the call itself, before hook().  Before, the cuda path launched nothing at the
    call and one whole kernel at hook()."""
    b = one_rank(daemon)
    x, idx, w = tokens()
    kinds = (torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA)

    def launched(prof, name):
        return sum(1 for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and name in e.name)

    for op in ("dispatch", "combine"):
        recv, _, h, _, hook = b.low_latency_dispatch(x, idx, 16, 4, use_fp8=False,
                                                     return_recv_hook=op == "combine")
        if op == "combine":
            hook()
        with torch.profiler.profile(activities=kinds) as before:
            if op == "dispatch":
                recv, _, h, _, hook = b.low_latency_dispatch(x, idx, 16, 4, use_fp8=False,
                                                             return_recv_hook=True)
            else:
                out, _, hook = b.low_latency_combine(recv, idx, w, h, return_recv_hook=True)
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=kinds) as after:
            hook()
            torch.cuda.synchronize()
        name = f"deepepd::ll::{op}"
        assert (launched(before, name), launched(after, name)) == (1, 1), op
    assert torch.equal(out, ll_reference(x, idx, w))
    b.destroy()


def test_a_hooked_low_latency_pair_captured_in_a_cuda_graph_replays_with_new_inputs(daemon):
    """On cuda a hooked call is two kernels, the send at the call and the receive at hook(),
    neither waiting on the host, so a call and its hook capture in one CUDA graph; each
    replay with new inputs gives the unhooked pair's outputs, though x is overwritten between
    the send and the receive (the receive does not read it).  Before, the cuda path copied
    the inputs at the call and ran the whole exchange at hook()."""
    b = one_rank(daemon)
    x, idx, w = tokens()
    sx = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # torch's warm-up rule before a capture
        recv, _, h, _, hook = b.low_latency_dispatch(sx, idx, 16, 4, use_fp8=False,
                                                     return_recv_hook=True)
        hook()
        b.low_latency_combine(recv, idx, w, h)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        recv, _, h, _, hook = b.low_latency_dispatch(sx, idx, 16, 4, use_fp8=False,
                                                     return_recv_hook=True)
        sx.fill_(7)  # the caller's work between send and receive
        hook()
        out, _, hook2 = b.low_latency_combine(recv, idx, w, h, return_recv_hook=True)
        hook2()
    for seed in range(2, 6):
        nx, _, _ = tokens(seed=seed)
        sx.copy_(nx)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ll_reference(nx, idx, w))
    del g
    b.destroy()


def check_ll_tables(src, rng, count, idx):
    """One rank's low_latency_handle_info against its own top-k: expert e's rows are the
    tokens that selected it, ascending; -1 past the count; one source, beginning at 0."""
    src, rng, count, idx = src.cpu(), rng.cpu(), count.cpu(), idx.cpu()
    for e in range(SHAPE["num_experts"]):
        want = [t for t in range(idx.size(0)) if e in idx[t].tolist()]
        c = len(want)
        assert int(count[e]) == c
        assert src[e, :c].tolist() == want and (src[e, c:] == -1).all()
        assert rng[e].tolist() == [c]  # begin 0 in the high half, count in the low


def test_low_latency_handle_info_in_a_cuda_graph_follows_each_replay(daemon):
    """dep__k_ll_info never waits on the host: a low-latency dispatch and the read-back of its
    handle captured in one CUDA graph give, at each replay with new top-k ids, that replay's
    src_info and layout_range; outside a graph, a kernel on the current stream behind the
    dispatch."""
    b = one_rank(daemon)
    M, E = SHAPE["max_ll_tokens_per_rank"], SHAPE["num_experts"]
    x, idx, _ = tokens(n=M)
    _, count, h, _, _ = b.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    src, rng = b.low_latency_handle_info(h)
    torch.cuda.synchronize()
    check_ll_tables(src, rng, count, idx)
    sidx = idx.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # torch's warm-up rule before a capture
        _, _, hw, _, _ = b.low_latency_dispatch(x, sidx, M, E, use_fp8=False)
        b.low_latency_handle_info(hw)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _, gcount, gh, _, _ = b.low_latency_dispatch(x, sidx, M, E, use_fp8=False)
        gsrc, grng = b.low_latency_handle_info(gh)
    for seed in range(2, 6):
        _, new, _ = tokens(n=M, seed=seed)
        sidx.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        check_ll_tables(gsrc, grng, gcount, new)
    del g
    b.destroy()
