"""deepep.Buffer's events, Config and class helpers, and the per-call state the binding
reuses (handles, outputs, arguments of every mode in any order)."""
import ctypes
import gc
import weakref

import pytest
import torch

import conftest
import deepep
from onerank import DEV, SHAPE, one_rank, tokens


# ---- events, config, class helpers ----------------------------------------------

def test_event_overlap_has_deepeps_surface():
    e = deepep.Buffer.capture()
    assert isinstance(e.event, deepep.EventHandle) and e.event.query()
    e.current_stream_wait()
    with e:
        pass
    with pytest.raises(ValueError, match="event"):
        deepep.EventOverlap(None).current_stream_wait()


def test_config_and_size_hints():
    c = deepep.Buffer.get_dispatch_config(8)
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) % 128 == 0
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) > 0 and c.get_rdma_buffer_size_hint(14336, 8) == 0
    assert deepep.Buffer.get_combine_config(16).get_rdma_buffer_size_hint(14336, 16) > 0
    assert deepep.Config(num_sms=24, num_max_rdma_chunked_send_tokens=6,
                         num_max_rdma_chunked_recv_tokens=100).num_max_rdma_chunked_recv_tokens == 102
    with pytest.raises(ValueError, match="num_max_nvl_chunked_send_tokens"):
        deepep.Config(20, 256, 256)
    hint = deepep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288)
    assert hint % 128 == 0 and hint == deepep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 16, 288)


def fields(c):
    return (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens)


def test_configs_are_deepeps_tables_and_the_next_larger_row_for_other_rank_counts():
    """DeepEP V1's get_dispatch_config/get_combine_config tables (their values as DeepEP's
    buffer.py lists them), with Buffer.num_sms; a rank count DeepEP does not list (it
    asserts) gets the next larger one's row.  They were one row for every count before.
    (Config rounds the RDMA receive count up to a multiple of the send count, as DeepEP's.)"""
    B = deepep.Buffer
    old = B.num_sms
    try:
        assert fields(B.get_dispatch_config(2)) == fields(deepep.Config(old, 24, 256, 6, 128))
        assert fields(B.get_dispatch_config(16)) == fields(deepep.Config(old, 36, 288, 20, 128))
        assert fields(B.get_dispatch_config(96)) == fields(deepep.Config(old, 20, 480, 12, 128))
        assert fields(B.get_combine_config(4)) == fields(deepep.Config(old, 9, 256, 6, 128))
        assert fields(B.get_combine_config(8)) == fields(deepep.Config(old, 4, 256, 6, 128))
        assert fields(B.get_combine_config(144)) == fields(deepep.Config(old, 2, 720, 8, 128))
        B.set_num_sms(24)
        assert fields(B.get_dispatch_config(8)) == fields(deepep.Config(24, 6, 256, 6, 128))
        assert fields(B.get_combine_config(1)) == fields(B.get_combine_config(2))
        assert fields(B.get_dispatch_config(40)) == fields(B.get_dispatch_config(48))
        assert fields(B.get_dispatch_config(1000)) == fields(B.get_dispatch_config(160))
    finally:
        B.num_sms = old


def test_a_zero_copy_low_latency_combine_reads_the_next_combine_buffer(buf):
    """DeepEP's zero copy: the caller writes the experts' outputs into
    get_next_low_latency_combine_buffer(handle), then combines with zero_copy=True (x is
    not read).  It raised Unsupported, and the method did not exist."""
    x, idx, w = tokens()
    x = x * torch.arange(1, 5, device=DEV).view(4, 1).bfloat16()
    recv, count, h, _, _ = buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
    want, _, _ = buf.low_latency_combine(recv * 2, idx, w, h)
    nxt = buf.get_next_low_latency_combine_buffer(h)
    assert nxt.shape == recv.shape and nxt.dtype == torch.bfloat16 and nxt.device == DEV
    nxt[:, :, :] = recv * 2
    got, _, _ = buf.low_latency_combine(torch.zeros_like(recv), idx, w, h, zero_copy=True)
    assert torch.equal(got, want) and not torch.equal(got, torch.zeros_like(got))
    assert buf.get_next_low_latency_combine_buffer(h).data_ptr() == nxt.data_ptr()
    _, _, _, _, th, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    with pytest.raises(ValueError, match="low_latency_dispatch"):
        buf.get_next_low_latency_combine_buffer(th)
    with pytest.raises(ValueError, match="expected"):
        buf.low_latency_combine(recv[:1], idx, w, h, zero_copy=True)


def test_zero_copy_without_the_combine_buffer_says_to_write_it_first(daemon):
    b = one_rank(daemon, **SHAPE)
    x, idx, w = tokens()
    recv, _, h, _, _ = b.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
    with pytest.raises(ValueError, match="get_next_low_latency_combine_buffer was never"):
        b.low_latency_combine(recv, idx, w, h, zero_copy=True)
    b.destroy()


def test_local_buffer_tensor_is_the_buffers_own_memory_of_the_bytes_asked_for(daemon):
    """vLLM zeroes get_local_buffer_tensor(torch.int8, use_rdma_buffer=True); deepepd's memory
    is never handed out, so it is a buffer of the Buffer's own, of the bytes asked for."""
    b = one_rank(daemon, num_nvl_bytes=1024, num_rdma_bytes=256, **SHAPE)
    rdma = b.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)
    assert rdma.shape == (256,) and rdma.dtype == torch.int8 and rdma.device == DEV
    rdma.zero_()
    nvl = b.get_local_buffer_tensor(torch.float32, torch.Size([4, 8]), offset=2)
    assert nvl.shape == (4, 8) and nvl.dtype == torch.float32
    whole = b.get_local_buffer_tensor(torch.float32)
    assert whole.numel() == 256 and nvl.data_ptr() == whole.data_ptr() + 8
    nvl.fill_(3)  # the same memory at every call
    assert (b.get_local_buffer_tensor(torch.float32)[2:34] == 3).all()
    assert b.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).data_ptr() == \
        rdma.data_ptr()
    with pytest.raises(ValueError, match="num_nvl_bytes 1024"):
        b.get_local_buffer_tensor(torch.float32, torch.Size([300]))
    with pytest.raises(ValueError, match="offset"):
        b.get_local_buffer_tensor(torch.float32, offset=-1)
    b.destroy()


def test_the_comm_stream_is_the_one_operations_run_on(buf):
    """deepepd queues every operation on the caller's current stream: get_comm_stream is
    that stream on cuda (test_cuda.py), None on the host backend (no stream)."""
    if conftest.BACKEND == "host":
        assert buf.get_comm_stream() is None
    else:
        assert buf.get_comm_stream() == torch.cuda.current_stream(DEV)


def test_set_num_sms_checks_and_sets():
    old = deepep.Buffer.num_sms
    try:
        deepep.Buffer.set_num_sms(24)
        assert deepep.Buffer.num_sms == 24
        with pytest.raises(ValueError, match="even"):
            deepep.Buffer.set_num_sms(23)
    finally:
        deepep.Buffer.num_sms = old



# ---- per-call state reused by the binding --------------------------------------

def test_recv_from_counts_rows_per_source_and_refuses_other_handles(buf):
    """dep_handle_recv_from: a throughput dispatch's rows from each source; an empty or
    low-latency handle, or too short an array, is DEP_ERR_INVALID naming it."""
    from deepep import _lib
    x, idx, w = tokens()
    _, _, _, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    assert buf.recv_from(h) == [4]
    lib, c = _lib.load(), buf._conn.ptr
    out = (ctypes.c_uint32 * 1)()
    assert lib.dep_handle_recv_from(c, h._ptr, out, 0) == _lib.ERR_INVALID
    assert "n is 0; the job has 1 ranks" in buf._conn.errmsg()
    _, _, lh, _, _ = buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
    assert lib.dep_handle_recv_from(c, lh._ptr, out, 1) == _lib.ERR_INVALID
    assert "a low-latency dispatch" in buf._conn.errmsg()
    p = ctypes.c_void_p()
    assert lib.dep_handle_new(c, ctypes.byref(p)) == 0
    assert lib.dep_handle_recv_from(c, p, out, 1) == _lib.ERR_INVALID
    assert "holds no dispatch" in buf._conn.errmsg()
    lib.dep_handle_free(p)
    assert lib.dep_handle_recv_from(c, h._ptr, None, 1) == _lib.ERR_INVALID
    with pytest.raises(ValueError, match="low_latency_dispatch's"):
        buf.recv_from(lh)


def test_handles_held_stay_valid_while_dropped_ones_are_reused(buf):
    """Dropped handles' dep_handle_t's are reused; one the caller holds is never."""
    x, idx, w = tokens()
    held = []
    for i in range(6):
        xi = x * (i + 1)
        recv, _, _, _, h, _ = buf.dispatch(xi, topk_idx=idx, topk_weights=w)
        held.append((xi, recv.clone(), h))
        for _ in range(3):  # handles made and dropped at once go back to the pool
            buf.dispatch(x, topk_idx=idx, topk_weights=w)
            buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
    assert len({h._ptr for _, _, h in held}) == len(held)
    for xi, recv, h in held:
        out, _, _ = buf.combine(recv, h)
        torch.testing.assert_close(out, xi)  # each token was received once by the one rank


def test_a_handle_used_while_a_graph_captures_is_kept_until_destroy_and_never_reused(daemon):
    """The decision Buffer._use makes for a combine, a cached dispatch or a
    low_latency_combine on cuda, each of which asks torch once whether the current stream
    captures a CUDA graph and passes the answer: a handle used in a capture is kept by the
    Buffer once the caller drops it, so no later dispatch gets its dep_handle_t (whose arrays
    the graph reads at every replay), and it stays usable; one used outside a capture goes
    back to the pool and is reused.  Driven here with the capture state given, on either
    backend (the host backend never captures); test_cuda checks that the operations pass
    torch's answer, in a real capture."""
    b = one_rank(daemon, **SHAPE)
    x, idx, w = tokens()
    cs = None if b._host else b._stream()  # the stream the operations pass
    later = deepep.handle._CUDA_POOL + 1  # held dispatches that take all either pool has

    def dispatch():
        rx, _, _, _, h, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
        return h, lambda h: b.combine(rx, h)[0]  # given the handle: this holds none

    def ll_dispatch():
        recv, _, h, _, _ = b.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
        return h, lambda h: b.low_latency_combine(recv, idx, w, h)[0]

    def ptrs(make):
        return {h._ptr for h, _ in [make() for _ in range(later)]}

    for make in (dispatch, ll_dispatch):
        h = make()[0]
        ptr = h._ptr
        b._use(h, cs, False)
        del h
        gc.collect()
        assert ptr in ptrs(make), "a handle used outside a capture was not reused"
        h, combine = make()
        kept, ref = h._ptr, weakref.ref(h)
        b._use(h, cs, True)
        b._use(h, cs, True)  # kept once, however often a graph uses it
        del h
        gc.collect()
        assert ref() is not None and b._pinned.count(ref()) == 1
        assert kept not in ptrs(make), "a later dispatch got the graph's handle"
        assert kept not in ptrs(make)  # nor once those were dropped in turn
        torch.testing.assert_close(combine(ref()), x)  # one rank: each token back once, weighed 1
        if make is dispatch:
            torch.testing.assert_close(b.dispatch(x * 3, handle=ref())[0], x * 3)
    kept = list(b._pinned)
    assert len(kept) == 2
    b.destroy()
    assert b._pinned == [] and all(h._ptr is None for h in kept)  # freed at destroy()


def test_calls_of_every_mode_in_any_order_each_get_their_own_arguments(buf):
    """The binding keeps dispatch's argument struct between calls and sets the fields of a
    mode (bf16 or FP8, fresh or cached, num_worst_tokens, expert_alignment, index type) only
    when the mode changes: calls of each mode, interleaved, each get exactly their own
    (one rank: every token comes back once, in order, its ids unchanged)."""
    x, idx, w = tokens()
    idx2 = torch.tensor([[3, 2], [2, 3], [3, 2], [1, 0]], dtype=torch.int32, device=DEV)
    g = torch.Generator().manual_seed(7)
    x8 = torch.randint(0, 256, (4, 128), dtype=torch.uint8, generator=g).to(DEV)
    sc = torch.rand(4, 1, generator=g).to(DEV)
    for _ in range(2):
        rx, ri, rw, counts, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w)
        assert torch.equal(rx, x) and torch.equal(ri, idx) and torch.equal(rw, w)
        assert counts == [2, 2, 2, 2]
        assert torch.equal(buf.dispatch(x * 2, handle=h)[0], x * 2)
        (q, qs), ri, rw, counts, h8, _ = buf.dispatch((x8, sc), topk_idx=idx, topk_weights=w,
                                                      num_worst_tokens=6, expert_alignment=4)
        assert torch.equal(q.view(torch.uint8)[:4], x8) and torch.equal(qs[:4], sc)
        assert ri.shape == (6, 2) and torch.equal(ri[:4], idx) and bool((ri[4:] == -1).all())
        assert torch.equal(rw[:4], w) and bool((rw[4:] == 0).all()) and counts == []
        (q, qs), *rest = buf.dispatch((x8, sc), handle=h8)
        assert q.shape == (6, 128) and torch.equal(q.view(torch.uint8)[:4], x8)
        assert rest[:3] == [None, None, None]
        assert buf.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=4)[3] == \
            [4, 4, 4, 4]
        rx, ri, rw, counts, h, _ = buf.dispatch(x * 3, topk_idx=idx2, topk_weights=w)
        assert torch.equal(rx, x * 3) and torch.equal(ri, idx2.long()) and counts == [1, 1, 3, 3]
        torch.testing.assert_close(buf.combine(rx, h)[0], x * 3)


def test_outputs_are_fresh_per_call(buf):
    """Outputs are the caller's: a later call does not write into an earlier call's."""
    x, idx, w = tokens()
    r1 = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    first = [t.clone() for t in r1[:3]]
    counts = list(r1[3])
    idx2 = torch.tensor([[3, 2], [2, 3], [3, 2], [2, 3]], dtype=torch.int64, device=DEV)
    r2 = buf.dispatch(x * 3, topk_idx=idx2, topk_weights=torch.full((4, 2), 0.25, device=DEV))
    for a, b in zip(r1[:3], first):
        torch.testing.assert_close(a, b)
    assert r1[3] == counts and r2[3] != counts
    assert r1[0].shape == (4, 128) and r1[1].dtype == torch.int64 and r1[2].shape == (4, 2)
    l1 = buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
    c1 = l1[1].clone()
    l2 = buf.low_latency_dispatch(x, idx2, 8, 4, use_fp8=False)
    assert l1[0].data_ptr() != l2[0].data_ptr() and torch.equal(l1[1], c1)
    o1 = buf.low_latency_combine(l1[0], idx, w, l1[2])[0]
    o2 = buf.low_latency_combine(l2[0], idx2, w, l2[2])[0]
    assert o1.data_ptr() != o2.data_ptr()
