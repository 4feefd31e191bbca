"""Rank processes for the tests: inputs made from a seed, and the operations run on them.

The parent and the ranks build the same inputs from (seed, rank), so the
test's reference sees every rank's inputs without any being sent.  Each
rank returns its outputs as numpy arrays (bf16 as its int16 bits).  On the
cuda backend the inputs go to the GPU (every rank on GPU 0) and the outputs
come back from it.
"""
import multiprocessing as mp
from typing import Any, Dict, List

import numpy as np
import torch


def shape(world: int) -> Dict[str, int]:
    """The job shape of a world: 2 local experts per rank, 4 of them per token at most."""
    return dict(hidden=256, num_experts=2 * world, num_topk=min(4, 2 * world),
                max_tokens_per_rank=24, max_ll_tokens_per_rank=16)


def inputs(seed: int, rank: int, world: int, it: int, ll: bool = False) -> Dict[str, np.ndarray]:
    """One rank's inputs for iteration it: x on a grid exact in bf16 (so that sums are exact
    in float32), distinct experts per token with some -1, weights multiples of 1/4."""
    s = shape(world)
    rng = np.random.default_rng([seed, rank, world, it, int(ll)])
    bound = s["max_ll_tokens_per_rank"] if ll else s["max_tokens_per_rank"]
    n = int(rng.integers(0, bound + 1)) if it % 2 else bound
    e, k = s["num_experts"], s["num_topk"]
    idx = np.stack([rng.permutation(e)[:k] for _ in range(n)]).astype(np.int64) if n \
        else np.zeros((0, k), np.int64)
    idx[rng.random(idx.shape) < 0.15] = -1
    w = (rng.integers(1, 5, idx.shape) / 4).astype(np.float32)
    x = (rng.integers(-32, 33, (n, s["hidden"])) / 8).astype(np.float32)
    xn = rng.standard_normal((n, s["hidden"])).astype(np.float32) * \
        rng.choice([1e-6, 1e-2, 1.0, 300.0], size=(n, 1)).astype(np.float32)
    return dict(idx=idx, w=w, x=x, xn=xn)


def bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 tensor's bits as int16, or another tensor as it is."""
    t = t.contiguous().cpu()
    return t.view(torch.int16).numpy().copy() if t.dtype == torch.bfloat16 else t.numpy().copy()


def expert_scale(world: int) -> np.ndarray:
    """What each global expert multiplies its low-latency rows by (1, 2 or 3)."""
    return (np.arange(shape(world)["num_experts"]) % 3 + 1).astype(np.float32)


def run_rank(args) -> List[Dict[str, np.ndarray]]:
    """Rank `rank` of a job: attach, then per iteration layout, dispatch, combine (each rank's
    experts multiply what they receive by rank + 1), LL dispatch bf16, LL combine (experts
    multiply by expert_scale) and LL dispatch FP8 of xn."""
    sock, job, rank, world, seed, iters, dev = args
    import deepep
    dev = torch.device(dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    b = deepep.Buffer(job_id=job, rank=rank, world_size=world, local_rank=rank,
                      local_world_size=world, socket=sock, **shape(world))
    out = rank_ops(b, rank, world, seed, iters, dev)
    b.destroy()
    return out


def rank_ops(b, rank: int, world: int, seed: int, iters: int, dev: torch.device
             ) -> List[Dict[str, np.ndarray]]:
    """run_rank's operations on Buffer b, rank `rank` of a job of `world` ranks (b may not have
    attached yet: its first layout or dispatch then supplies the shape)."""
    import deepep
    s = shape(world)
    L = s["num_experts"] // world
    out = []
    for it in range(iters):
        r: Dict[str, np.ndarray] = {}
        inp = inputs(seed, rank, world, it)
        x = torch.from_numpy(inp["x"]).bfloat16().to(dev)
        idx = torch.from_numpy(inp["idx"]).to(dev)
        w = torch.from_numpy(inp["w"]).to(dev)
        per_rank, rdma, per_expert, in_rank, ev = b.get_dispatch_layout(idx, s["num_experts"])
        assert rdma is None and ev.event is None
        assert per_rank.device == dev and in_rank.device == dev
        r.update(per_rank=per_rank.cpu().numpy(), per_expert=per_expert.cpu().numpy(),
                 in_rank=in_rank.cpu().numpy())
        rx, ri, rw, counts, h, ev = b.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, async_finish=True)
        ev.current_stream_wait()
        assert ri.dtype == torch.int64 and rw.dtype == torch.float32 and rx.device == dev
        if isinstance(h, tuple):  # deep_ep's DeepEP-shaped handle
            r.update(h_rank_prefix=h[0].cpu().numpy(), h_chan_prefix=h[1].cpu().numpy(),
                     h_recv_chan_prefix=h[2].cpu().numpy(), h_src_idx=h[3].cpu().numpy(),
                     h_in_rank=h[4].cpu().numpy(), h_send_head=h[5].cpu().numpy(),
                     h_channels=np.int64(b.get_dispatch_config(world).num_sms // 2))
        r.update(recv_x=bits(rx), recv_idx=ri.cpu().numpy(), recv_w=rw.cpu().numpy(),
                 counts=np.array(counts, np.int64))
        y = (rx.float() * (rank + 1)).bfloat16()
        comb, comb_w, ev = b.combine(y, h)
        assert comb_w is None
        r["combined"] = bits(comb)

        li = inputs(seed, rank, world, it, ll=True)
        lx = torch.from_numpy(li["x"]).bfloat16().to(dev)
        lidx = torch.from_numpy(li["idx"]).to(dev)
        lw = torch.from_numpy(li["w"]).to(dev)
        stats = torch.zeros(L, dtype=torch.int32, device=dev)
        recv, count, lh, ev, hook = b.low_latency_dispatch(
            lx, lidx, s["max_ll_tokens_per_rank"], s["num_experts"], use_fp8=False,
            cumulative_local_expert_recv_stats=stats, return_recv_hook=True)
        hook()
        assert torch.equal(stats, count)
        r.update(ll_x=bits(recv), ll_count=count.cpu().numpy())
        scale = torch.from_numpy(expert_scale(world)[rank * L:(rank + 1) * L]).view(L, 1, 1) \
            .to(dev)
        ly = (recv.float() * scale).bfloat16()
        into = torch.empty(lx.size(0), s["hidden"], dtype=torch.bfloat16, device=dev)
        lout, ev, hook = b.low_latency_combine(ly, lidx, lw, lh, out=into)
        assert lout is into
        r["ll_combined"] = bits(lout)

        xn = torch.from_numpy(li["xn"]).bfloat16().to(dev)
        (q, sc), count, _, _, _ = b.low_latency_dispatch(
            xn, lidx, s["max_ll_tokens_per_rank"], s["num_experts"], use_fp8=True)
        assert q.dtype == deepep.fp8_dtype and sc.dtype == torch.float32
        r.update(fp8_x=q.view(torch.uint8).cpu().numpy(), fp8_scales=sc.cpu().numpy(),
                 fp8_count=count.cpu().numpy())
        out.append(r)
    return out


def run_world(sock: str, job: str, world: int, seed: int, iters: int = 2, timeout: float = 120,
              device: str = "cpu", fn=None):
    """Every rank's results, rank by rank, from `world` spawned processes running fn
    (run_rank) with (sock, job, rank, world, seed, iters, device)."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(world) as pool:
        res = pool.map_async(fn or run_rank,
                             [(sock, job, r, world, seed, iters, device) for r in range(world)])
        return res.get(timeout)


def _graph_setup(args):
    """A graph rank's Buffer on its GPU, the shape, the device, the experts E, the
    low-latency tokens M and this rank's experts' scales (as run_rank applies them)."""
    sock, job, rank, world, seed, iters, dev = args
    import deepep
    dev = torch.device(dev)
    torch.cuda.set_device(dev)
    s = shape(world)
    b = deepep.Buffer(job_id=job, rank=rank, world_size=world, local_rank=rank,
                      local_world_size=world, socket=sock, **s)
    L, E, M = s["num_experts"] // world, s["num_experts"], s["max_ll_tokens_per_rank"]
    scale = torch.from_numpy(expert_scale(world)[rank * L:(rank + 1) * L]).view(L, 1, 1).to(dev)
    return b, s, dev, E, M, scale


def graph_rank(args) -> List[Dict[str, np.ndarray]]:
    """Rank `rank` of a job on the cuda backend: one layer's low-latency pair captured in a
    CUDA graph (dispatch bf16, the experts' scaling, combine, and an FP8 dispatch of xn), then
    replayed `iters` times, each with new inputs copied into the graph's input tensors.
    Replay i uses the inputs of iteration 2 i (full batches: a graph has one token count) and
    returns what run_rank's low-latency part returns, with "it" saying the inputs."""
    sock, job, rank, world, seed, iters, dev = args
    b, s, dev, E, M, scale = _graph_setup(args)

    def load(it):
        li = inputs(seed, rank, world, it, ll=True)
        assert li["idx"].shape[0] == M
        sx.copy_(torch.from_numpy(li["x"]).bfloat16())
        sxn.copy_(torch.from_numpy(li["xn"]).bfloat16())
        sidx.copy_(torch.from_numpy(li["idx"]))
        sw.copy_(torch.from_numpy(li["w"]))

    sx = torch.empty(M, s["hidden"], dtype=torch.bfloat16, device=dev)
    sxn = torch.empty_like(sx)
    sidx = torch.empty(M, s["num_topk"], dtype=torch.int64, device=dev)
    sw = torch.empty(M, s["num_topk"], dtype=torch.float32, device=dev)
    sout = torch.empty_like(sx)

    def layer():
        recv, count, h, _, _ = b.low_latency_dispatch(sx, sidx, M, E, use_fp8=False)
        y = (recv.float() * scale).bfloat16()
        b.low_latency_combine(y, sidx, sw, h, out=sout)
        (q, sc), fcount, _, _, _ = b.low_latency_dispatch(sxn, sidx, M, E, use_fp8=True)
        return recv, count, q, sc, fcount

    # Warm up on a side stream (torch's rule before a capture); every rank makes the same
    # calls, so the job's call sequence stays in step.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        load(0)
        layer()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        recv, count, q, sc, fcount = layer()
    out = []
    for i in range(iters):
        load(2 * i)
        g.replay()
        torch.cuda.synchronize()
        out.append(dict(it=2 * i, ll_x=bits(recv), ll_count=count.cpu().numpy(),
                        ll_combined=bits(sout), fp8_x=q.view(torch.uint8).cpu().numpy(),
                        fp8_scales=sc.cpu().numpy(), fp8_count=fcount.cpu().numpy()))
    del g
    b.destroy()
    return out


#: The layers of graph_layers_rank's one graph (a decode step's MoE layers, as SGLang and
#: vLLM capture them).
GRAPH_LAYERS = 16


def graph_layers_rank(args) -> List[Dict[str, np.ndarray]]:
    """Rank `rank` of a job on the cuda backend: GRAPH_LAYERS layers, each a low-latency
    dispatch (bf16), the experts' scaling and a combine, with inputs and outputs of its own,
    captured in one CUDA graph with no deepep call before it (a handle made in a capture has
    its arrays in a torch tensor from the graph's pool: nothing made ahead), then replayed
    `iters` times, each with new inputs for every layer.  Layer l of replay i uses the inputs
    of iteration 2 (i GRAPH_LAYERS + l) (full batches: a graph has one token count); one
    result per (replay, layer), as graph_rank's low-latency part with "it" saying the
    inputs."""
    sock, job, rank, world, seed, iters, dev = args
    b, s, dev, E, M, scale = _graph_setup(args)
    sx = [torch.empty(M, s["hidden"], dtype=torch.bfloat16, device=dev)
          for _ in range(GRAPH_LAYERS)]
    sidx = [torch.empty(M, s["num_topk"], dtype=torch.int64, device=dev)
            for _ in range(GRAPH_LAYERS)]
    sw = [torch.empty(M, s["num_topk"], dtype=torch.float32, device=dev)
          for _ in range(GRAPH_LAYERS)]
    sout = [torch.empty(M, s["hidden"], dtype=torch.bfloat16, device=dev)
            for _ in range(GRAPH_LAYERS)]

    def load(i):
        for l in range(GRAPH_LAYERS):
            li = inputs(seed, rank, world, 2 * (i * GRAPH_LAYERS + l), ll=True)
            assert li["idx"].shape[0] == M
            sx[l].copy_(torch.from_numpy(li["x"]).bfloat16())
            sidx[l].copy_(torch.from_numpy(li["idx"]))
            sw[l].copy_(torch.from_numpy(li["w"]))

    # torch's own kernels once outside (torch's rule); no deepep call before the capture.
    ((torch.zeros(scale.shape[0], 1, s["hidden"], device=dev).float() * scale).bfloat16())
    load(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    layers = []
    with torch.cuda.graph(g):
        for l in range(GRAPH_LAYERS):
            recv, count, h, _, _ = b.low_latency_dispatch(sx[l], sidx[l], M, E, use_fp8=False)
            y = (recv.float() * scale).bfloat16()
            b.low_latency_combine(y, sidx[l], sw[l], h, out=sout[l])
            layers.append((recv, count))
    del h  # the Buffer keeps every captured handle (and its tensor) for the graph
    out = []
    for i in range(iters):
        load(i)
        g.replay()
        torch.cuda.synchronize()
        for l, (recv, count) in enumerate(layers):
            out.append(dict(it=2 * (i * GRAPH_LAYERS + l), ll_x=bits(recv),
                            ll_count=count.cpu().numpy(), ll_combined=bits(sout[l])))
    del g
    b.destroy()
    return out


def fp8_inputs(seed: int, rank: int, world: int, it: int) -> Dict[str, np.ndarray]:
    """An FP8 tuple for throughput dispatch: any e4m3 bytes (moved as they are) and scales."""
    s = shape(world)
    n = inputs(seed, rank, world, it)["idx"].shape[0]
    rng = np.random.default_rng([seed, rank, world, it, 7])
    return dict(q=rng.integers(0, 256, (n, s["hidden"]), dtype=np.uint8),
                sc=(rng.random((n, s["hidden"] // 128)) + 1e-3).astype(np.float32))


def ext_rank(args) -> List[Dict[str, np.ndarray]]:
    """Rank `rank` of a job, per iteration: an FP8 dispatch with expert_alignment 4, a cached
    bf16 dispatch through its handle, a combine with its recv_topk_weights, a dispatch with
    num_worst_tokens (the capacity) and the combine of its rows (experts multiply by rank + 1)."""
    sock, job, rank, world, seed, iters, dev = args
    import deepep
    dev = torch.device(dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    s = shape(world)
    b = deepep.Buffer(job_id=job, rank=rank, world_size=world, local_rank=rank,
                      local_world_size=world, socket=sock, **s)
    worst = world * s["max_tokens_per_rank"]
    assert b.sizes["recv_rows"] == worst
    out = []
    for it in range(iters):
        r: Dict[str, np.ndarray] = {}
        inp, f8 = inputs(seed, rank, world, it), fp8_inputs(seed, rank, world, it)
        x = torch.from_numpy(inp["x"]).bfloat16().to(dev)
        idx = torch.from_numpy(inp["idx"]).to(dev)
        w = torch.from_numpy(inp["w"]).to(dev)
        q = torch.from_numpy(f8["q"]).to(dev).view(deepep.fp8_dtype)
        sc = torch.from_numpy(f8["sc"]).to(dev)
        (rq, rsc), ri, rw, counts, h, _ = b.dispatch((q, sc), topk_idx=idx, topk_weights=w,
                                                     expert_alignment=4)
        assert rq.dtype == deepep.fp8_dtype and rsc.dtype == torch.float32
        r.update(fp8_q=rq.view(torch.uint8).cpu().numpy(), fp8_sc=rsc.cpu().numpy(),
                 fp8_idx=ri.cpu().numpy(), fp8_counts=np.array(counts, np.int64))
        cx, none1, none2, none3, none4, _ = b.dispatch(x, handle=h)
        assert none1 is None and none2 is None and none3 is None and none4 is None
        r["cached_x"] = bits(cx)
        comb, comb_w, _ = b.combine(cx, h, topk_weights=rw)
        r.update(cached_combined=bits(comb), combined_w=comb_w.cpu().numpy())
        wx, wi, ww, wc, wh, _ = b.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=worst)
        assert wc == [] and wx.shape[0] == worst and wi.shape[0] == worst
        r.update(worst_x=bits(wx), worst_idx=wi.cpu().numpy(), worst_w=ww.cpu().numpy())
        y = (wx.float() * (rank + 1)).bfloat16()
        r["worst_combined"] = bits(b.combine(y, wh)[0])
        out.append(r)
    b.destroy()
    return out


def bias_inputs(seed: int, rank: int, world: int, it: int) -> Dict[str, np.ndarray]:
    """combine's bias_0 and bias_1 for rank `rank`'s tokens of iteration it, on a grid exact in
    bf16 (multiples of 1/4 in [-8, 8])."""
    s = shape(world)
    n = inputs(seed, rank, world, it)["idx"].shape[0]
    rng = np.random.default_rng([seed, rank, world, it, 11])
    return dict(b0=(rng.integers(-32, 33, (n, s["hidden"])) / 4).astype(np.float32),
                b1=(rng.integers(-32, 33, (n, s["hidden"])) / 4).astype(np.float32))


def bias_rank(args) -> List[Dict[str, np.ndarray]]:
    """Rank `rank` of a job, per iteration: a dispatch (experts multiply by rank + 1), then
    combines of its rows with no bias, bias=bias_0, bias=(bias_0, bias_1) and
    bias=(None, bias_1), through deep_ep's Buffer; then internode_dispatch with DeepEP's
    positional arguments (config where dispatch has num_worst_tokens), a cached
    internode_dispatch through its handle, and internode_combine with weights and bias
    (bias_0, bias_1)."""
    sock, job, rank, world, seed, iters, dev = args
    import deepep
    dev = torch.device(dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    deep_ep = import_compat()
    b = deep_ep.Buffer(job_id=job, rank=rank, world_size=world, local_rank=rank,
                       local_world_size=world, socket=sock, explicitly_destroy=True,
                       **shape(world))
    assert isinstance(b, deepep.Buffer)
    out = []
    for it in range(iters):
        inp, bi = inputs(seed, rank, world, it), bias_inputs(seed, rank, world, it)
        x = torch.from_numpy(inp["x"]).bfloat16().to(dev)
        idx = torch.from_numpy(inp["idx"]).to(dev)
        w = torch.from_numpy(inp["w"]).to(dev)
        b0 = torch.from_numpy(bi["b0"]).bfloat16().to(dev)
        b1 = torch.from_numpy(bi["b1"]).bfloat16().to(dev)
        rx, _, _, _, h, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
        y = (rx.float() * (rank + 1)).bfloat16()
        r = {"plain": bits(b.combine(y, h)[0]),
             "bias0": bits(b.combine(y, h, bias=b0)[0]),
             "bias01": bits(b.combine(y, h, bias=(b0, b1))[0]),
             "bias_1": bits(b.combine(y, h, bias=(None, b1))[0])}
        per_rank, rdma, per_expert, in_rank, _ = b.get_dispatch_layout(idx, shape(world)[
            "num_experts"])
        ix, ii, iw, ic, ih, _ = b.internode_dispatch(x, None, per_rank, rdma, in_rank,
                                                     per_expert, idx, w, 1,
                                                     b.get_dispatch_config(world))
        r.update(inter_x=bits(ix), inter_idx=ii.cpu().numpy(), inter_w=iw.cpu().numpy(),
                 inter_counts=np.array(ic, np.int64))
        iy = (ix.float() * (rank + 1)).bfloat16()
        cached = b.internode_dispatch(x, ih)
        assert cached[1:5] == (None, None, None, None)
        r["inter_cached"] = bits(cached[0])
        comb, comb_w, _ = b.internode_combine(iy, ih, iw, (b0, b1),
                                              b.get_combine_config(world))
        r.update(inter_combined=bits(comb), inter_combined_w=comb_w.cpu().numpy())
        out.append(r)
    b.destroy()
    return out


#: The multi-node job of test_internode.py: 2 nodes (daemons) of 2 ranks.
NODES, NODE_RANKS = 2, 2


def internode_rank(args) -> List[Dict[str, Any]]:
    """Rank `rank` of a job over NODES daemons (sock: their sockets, rank r on node
    r // NODE_RANKS), per iteration, through deep_ep's Buffer: get_dispatch_layout, dispatch
    (DeepEP's arguments, which go internode across nodes), internode_dispatch, a cached
    dispatch through dispatch's handle, and combine with weights through each handle.  The
    handles' members come back as numpy arrays (and their dtypes' names)."""
    socks, job, rank, world, seed, iters, dev = args
    dev = torch.device(dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    deep_ep = import_compat()
    s = shape(world)
    b = deep_ep.Buffer(job_id=job, rank=rank, world_size=world, local_rank=rank % NODE_RANKS,
                       local_world_size=NODE_RANKS, socket=socks[rank // NODE_RANKS],
                       explicitly_destroy=True, **s)
    out = []

    def members(h):
        return [(t.cpu().numpy().copy(), str(t.dtype)) for t in h]

    for it in range(iters):
        inp = inputs(seed, rank, world, it)
        x = torch.from_numpy(inp["x"]).bfloat16().to(dev)
        idx = torch.from_numpy(inp["idx"]).to(dev)
        w = torch.from_numpy(inp["w"]).to(dev)
        per_rank, rdma, per_expert, in_rank, _ = b.get_dispatch_layout(idx, s["num_experts"])
        rx, ri, rw, counts, h, _ = b.dispatch(x, num_tokens_per_rank=per_rank,
                                              num_tokens_per_rdma_rank=rdma,
                                              is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, topk_idx=idx,
                                              topk_weights=w)
        ix, _, iw, _, ih, _ = b.internode_dispatch(x, None, per_rank, rdma, in_rank, per_expert,
                                                   idx, w, 1, b.get_dispatch_config(world))
        cx = b.dispatch(x, handle=h)[0]
        y = (rx.float() * (rank + 1)).bfloat16()
        r = {"type": type(h).__name__, "inter_type": type(ih).__name__, "rdma": bits(rdma),
             "channels": b.get_dispatch_config(world).num_sms // 2,
             "x": bits(rx), "inter_x": bits(ix), "cached_x": bits(cx),
             "handle": members(h), "inter_handle": members(ih),
             "combined": bits(b.combine(y, h, topk_weights=rw)[0]),
             "inter_combined": bits(b.internode_combine(y, ih, iw)[0])}
        # The low-latency pair with and without the receive hook (split across nodes too, on
        # either backend): the same results.
        li = inputs(seed, rank, world, it, ll=True)
        lx, lidx = torch.from_numpy(li["x"]).bfloat16().to(dev), torch.from_numpy(li["idx"]).to(dev)
        lw = torch.from_numpy(li["w"]).to(dev)
        M = s["max_ll_tokens_per_rank"]
        for hooked in (False, True):
            recv, count, lh, _, hook = b.low_latency_dispatch(lx, lidx, M, s["num_experts"],
                                                             use_fp8=False,
                                                             return_recv_hook=hooked)
            hook()
            comb, _, hook = b.low_latency_combine(recv, lidx, lw, lh, return_recv_hook=hooked)
            hook()
            r["ll_hooked" if hooked else "ll"] = (bits(recv), count.cpu().numpy().copy(),
                                                  bits(comb))
        out.append(r)
    b.destroy()
    return out


#: bf16 bits of 1 and 1 + 2^-7 (one ulp above 1): the tie case's two answers.
TIE_ONE, TIE_ONE_ULP = 0x3F80, 0x3F81


def tie_rank(args) -> Dict[str, Dict[str, np.ndarray]]:
    """Rank `rank` of a world of 2, for each binding (deepep and deep_ep, a job each): one
    token on both ranks (experts 0 and 2), rows back as 1 from rank 0 and 2^-8 from rank 1,
    combined with no bias, bias=(2^-9, 2^-9) and bias=2^-8.  Summed in float32 with the
    biases before the one rounding (DeepEP's) that is 1 + 2^-7, a bf16; the combine rounded
    first is bf16(1 + 2^-8), a tie, to even 1, and 1 + 2^-8 again once the bias is added."""
    sock, job, rank, world, seed, iters, dev = args
    import deepep
    assert world == 2
    dev = torch.device(dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    s = shape(world)
    out = {}
    for name, cls in (("deepep", deepep.Buffer), ("deep_ep", import_compat().Buffer)):
        b = cls(job_id=f"{job}-{name}", rank=rank, world_size=world, local_rank=rank,
                local_world_size=world, socket=sock, **s)
        x = torch.ones(1, s["hidden"], dtype=torch.bfloat16, device=dev)
        idx = torch.tensor([[0, 2] + [-1] * (s["num_topk"] - 2)], dtype=torch.int64, device=dev)
        w = torch.ones(1, s["num_topk"], dtype=torch.float32, device=dev)
        rx, _, _, _, h, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
        assert rx.shape[0] == 2
        y = torch.full_like(rx, 1.0 if rank == 0 else 2.0 ** -8)
        b9 = torch.full_like(x, 2.0 ** -9)
        out[name] = {"plain": bits(b.combine(y, h)[0]),
                     "pair": bits(b.combine(y, h, bias=(b9, b9))[0]),
                     "one": bits(b.combine(y, h, bias=b9 * 2)[0])}
        b.destroy()
    return out


def graph_tp_rank(args) -> List[Dict[str, np.ndarray]]:
    """Rank `rank` of a job on the cuda backend: one layer's throughput pair with
    num_worst_tokens captured in a CUDA graph (dispatch, the experts' x (rank + 1), combine),
    replayed `iters` times with the inputs of iteration 2 i (full batches) copied in."""
    sock, job, rank, world, seed, iters, dev = args
    import deepep
    dev = torch.device(dev)
    torch.cuda.set_device(dev)
    s = shape(world)
    b = deepep.Buffer(job_id=job, rank=rank, world_size=world, local_rank=rank,
                      local_world_size=world, socket=sock, **s)
    M, worst = s["max_tokens_per_rank"], world * s["max_tokens_per_rank"]
    sx = torch.empty(M, s["hidden"], dtype=torch.bfloat16, device=dev)
    sidx = torch.empty(M, s["num_topk"], dtype=torch.int64, device=dev)
    sw = torch.empty(M, s["num_topk"], dtype=torch.float32, device=dev)

    def load(it):
        inp = inputs(seed, rank, world, it)
        assert inp["idx"].shape[0] == M
        sx.copy_(torch.from_numpy(inp["x"]).bfloat16())
        sidx.copy_(torch.from_numpy(inp["idx"]))
        sw.copy_(torch.from_numpy(inp["w"]))

    def layer():
        rx, ri, rw, _, h, _ = b.dispatch(sx, topk_idx=sidx, topk_weights=sw,
                                         num_worst_tokens=worst)
        comb, _, _ = b.combine((rx.float() * (rank + 1)).bfloat16(), h)
        return rx, ri, comb

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        load(0)
        layer()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        rx, ri, comb = layer()
    out = []
    for i in range(iters):
        load(2 * i)
        g.replay()
        torch.cuda.synchronize()
        out.append(dict(it=2 * i, worst_x=bits(rx), worst_idx=ri.cpu().numpy(),
                        worst_combined=bits(comb)))
    del g
    b.destroy()
    return out


def import_compat():
    """python/deep_ep_compat imported as deep_ep, as an opt-in install lays it out."""
    import importlib.util
    import os
    import sys
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "deep_ep_compat")
    # Every deep_ep module (deep_ep.utils.math too), so that none is left bound to an older one.
    for name in [n for n in sys.modules if n == "deep_ep" or n.startswith("deep_ep.")]:
        sys.modules.pop(name, None)
    spec = importlib.util.spec_from_file_location("deep_ep", os.path.join(root, "__init__.py"),
                                                  submodule_search_locations=[root])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["deep_ep"] = mod
    spec.loader.exec_module(mod)
    return mod


#: group_rank's world and its two ways of cutting it into expert-parallel groups of two:
#: PAIRS as Megatron's EP inside DP ({0, 1}, {2, 3}), CROSS across them ({0, 2}, {1, 3}), so
#: that every process is in one group of each.
GROUP_WORLD = 4
PAIRS = ([0, 1], [2, 3])
CROSS = ([0, 2], [1, 3])
#: The token bounds group_rank's ranks take from the environment, as a launcher would set
#: them: Buffer(group, num_nvl_bytes, num_rdma_bytes) is DeepEP's call, with no shape.
GROUP_ENV = {"DEEPEP_MAX_TOKENS_PER_RANK": str(shape(2)["max_tokens_per_rank"]),
             "DEEPEP_MAX_LL_TOKENS_PER_RANK": str(shape(2)["max_ll_tokens_per_rank"])}


def group_seed(seed: int, cut: str, index: int) -> int:
    """The seed of the inputs of EP group `index` of cut "pairs" or "cross" (each group's
    inputs differ, so that a row delivered to another group's job would show)."""
    return seed * 8 + {"pairs": 0, "cross": 2}[cut] + index


def group_rank(rank: int, sock: str, store: str, seed: int, iters: int, outdir: str) -> None:
    """Process `rank` of a world of GROUP_WORLD started by torch.multiprocessing.spawn, gloo
    over a FileStore, with no launcher's variables: it builds deep_ep.Buffer(group, ...) on its
    PAIRS group and on its CROSS group (one process, two groups, two jobs), checks that
    explicit arguments disagreeing with the group are refused, runs rank_ops on each Buffer
    as the group's rank, and pickles {"pairs"/"cross": (group index, group rank, identity,
    results), "refused": messages} into outdir/<rank>.pkl."""
    import os
    import pickle
    import torch.distributed as dist
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                 "DEEPEP_JOB_ID", "SLURM_PROCID", "SLURM_JOB_ID"):
        os.environ.pop(name, None)
    os.environ.update(GROUP_ENV)
    os.environ["DEEPEPD_SOCKET"] = sock
    dist.init_process_group("gloo", store=dist.FileStore(store, GROUP_WORLD), rank=rank,
                            world_size=GROUP_WORLD)
    # Every process makes every group, in one order (torch's rule for new_group).
    groups = {"pairs": [dist.new_group(m) for m in PAIRS],
              "cross": [dist.new_group(m) for m in CROSS]}
    deep_ep = import_compat()
    out: Dict[str, object] = {"refused": []}
    pick = {cut: next(i for i, m in enumerate(ms) if rank in m)
            for cut, ms in (("pairs", PAIRS), ("cross", CROSS))}
    for kw in (dict(world_size=GROUP_WORLD), dict(rank=(dist.get_rank(groups["pairs"][
            pick["pairs"]]) + 1) % 2), dict(local_world_size=1)):
        try:
            deep_ep.Buffer(groups["pairs"][pick["pairs"]], 1 << 20, 0, **kw)
        except ValueError as e:
            out["refused"].append(str(e))
    bufs = {cut: deep_ep.Buffer(groups[cut][pick[cut]], 1 << 20, 0, explicitly_destroy=True)
            for cut in ("pairs", "cross")}
    for cut, b in bufs.items():
        g = groups[cut][pick[cut]]
        gr, gw = dist.get_rank(g), dist.get_world_size(g)
        res = rank_ops(b, gr, gw, group_seed(seed, cut, pick[cut]), iters, torch.device("cpu"))
        out[cut] = (pick[cut], gr, b.identity, res)
    for b in bufs.values():
        b.destroy()
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    dist.destroy_process_group()


def scales_shape(world: int) -> Dict[str, int]:
    """scales_rank's job shape: shape(world) with hidden 512, so that UE8M0 packs one int."""
    return dict(shape(world), hidden=512)


def scales_inputs(seed: int, rank: int, world: int, it: int) -> Dict[str, np.ndarray]:
    """scales_rank's inputs: inputs()'s top-k ids and, for 512 channels, x of mixed
    magnitudes per token (as inputs()'s xn), FP8 bytes and int32 scales for throughput."""
    s = scales_shape(world)
    inp = inputs(seed, rank, world, it, ll=True)
    rng = np.random.default_rng([seed, rank, world, it, 13])
    n = inp["idx"].shape[0]
    inp["xn"] = rng.standard_normal((n, s["hidden"])).astype(np.float32) * \
        rng.choice([1e-6, 1e-2, 1.0, 300.0], size=(n, 1)).astype(np.float32)
    inp["q"] = rng.integers(0, 256, (n, s["hidden"]), dtype=np.uint8)
    inp["sc_i32"] = rng.integers(-2 ** 31, 2 ** 31, (n, s["hidden"] // 512), dtype=np.int64) \
        .astype(np.int32)
    inp["sc_tok"] = (rng.random(n) + 0.5).astype(np.float32)
    inp["sc_f32"] = (rng.random((n, s["hidden"] // 128)) + 1e-3).astype(np.float32)
    return inp


def scales_rank(args) -> List[Dict[str, np.ndarray]]:
    """Rank `rank` of a job through deep_ep.Buffer, per iteration: low-latency FP8 dispatches
    of xn as they are, with round_scale, with round_scale and use_ue8m0, and with round_scale
    and the receive hook; then throughput FP8 dispatches with int32 (UE8M0) scales, one scale
    per token, and column-major float32 scales.  Scales are returned with their strides."""
    sock, job, rank, world, seed, iters, dev = args
    dev = torch.device(dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    deep_ep = import_compat()
    s = scales_shape(world)
    b = deep_ep.Buffer(job_id=job, rank=rank, world_size=world, local_rank=rank,
                       local_world_size=world, socket=sock, explicitly_destroy=True, **s)
    M, E = s["max_ll_tokens_per_rank"], s["num_experts"]

    def keep(r, name, pair, count):
        v, sc = pair
        r[name + "_q"] = v.view(torch.uint8).cpu().numpy()
        r[name + "_sc"] = sc.cpu().numpy()
        r[name + "_stride"] = np.array(sc.stride())
        r[name + "_dtype"] = str(sc.dtype)
        r[name + "_count"] = count.cpu().numpy()

    out = []
    for it in range(iters):
        r: Dict[str, np.ndarray] = {}
        inp = scales_inputs(seed, rank, world, it)
        x = torch.from_numpy(inp["xn"]).bfloat16().to(dev)
        idx = torch.from_numpy(inp["idx"]).to(dev)
        for name, kw in (("plain", {}), ("round", dict(round_scale=True)),
                         ("ue8m0", dict(round_scale=True, use_ue8m0=True))):
            pair, count, _, _, hook = b.low_latency_dispatch(x, idx, M, E, use_fp8=True, **kw)
            hook()
            keep(r, name, pair, count)
        pair, count, _, _, hook = b.low_latency_dispatch(x, idx, M, E, use_fp8=True,
                                                         round_scale=True, use_ue8m0=True,
                                                         return_recv_hook=True)
        hook()
        keep(r, "hooked", pair, count)
        w = torch.ones(idx.shape, dtype=torch.float32, device=dev)
        q = torch.from_numpy(inp["q"]).to(dev).view(deep_ep.fp8_dtype)
        for name, sc in (("tp_i32", torch.from_numpy(inp["sc_i32"])),
                         ("tp_tok", torch.from_numpy(inp["sc_tok"])),
                         ("tp_cm", torch.from_numpy(inp["sc_f32"]).t().contiguous().t())):
            (rq, rs), _, _, _, h, _ = b.dispatch((q, sc.to(dev)), topk_idx=idx, topk_weights=w)
            r[name + "_q"] = rq.view(torch.uint8).cpu().numpy()
            r[name + "_sc"] = rs.cpu().numpy()
            r[name + "_dtype"] = str(rs.dtype)
            (cq, cs), *_ = b.dispatch((q, sc.to(dev)), handle=h)
            r[name + "_cached_sc"] = cs.cpu().numpy()
        out.append(r)
    b.destroy()
    return out


def hook_rank(args) -> List[Dict[str, np.ndarray]]:
    """Rank `rank` of a job of `world` (sock: one daemon's socket, or a tuple of NODES
    daemons' for a job across nodes), showing that return_recv_hook defers the receive.
    Rank 0 makes a hooked low-latency dispatch, overwrites its x and topk_idx (the caller may,
    once the call returns), then sets `returned`; the other ranks wait for `returned`
    (ceiling `wait_s`) before their own call: a call that received before returning would
    wait for them, and they for it.  Then every rank makes two hooked dispatches (of
    iterations 1 and 2) and calls their hooks in reverse order, and a hooked combine of
    iteration 0's rows whose x it overwrites before the hook (its topk_idx and topk_weights
    are read at the hook, as DeepEP's receive reads them).  Results as rank_ops' (ll_x,
    ll_count, ll_combined), per iteration."""
    sock, job, rank, world, seed, returned, wait_s = args
    import deepep
    s = shape(world)
    M, E, L = s["max_ll_tokens_per_rank"], s["num_experts"], s["num_experts"] // world
    if isinstance(sock, tuple):  # a job over NODES daemons: rank r on node r // NODE_RANKS
        b = deepep.Buffer(job_id=job, rank=rank, world_size=world,
                          local_rank=rank % NODE_RANKS, local_world_size=NODE_RANKS,
                          socket=sock[rank // NODE_RANKS], **s)
    else:
        b = deepep.Buffer(job_id=job, rank=rank, world_size=world, local_rank=rank,
                          local_world_size=world, socket=sock, **s)

    def load(it):
        li = inputs(seed, rank, world, it, ll=True)
        return (torch.from_numpy(li["x"]).bfloat16(), torch.from_numpy(li["idx"]),
                torch.from_numpy(li["w"]))

    out: List[Dict[str, np.ndarray]] = [{} for _ in range(3)]
    x, idx, w = load(0)
    if rank != 0 and not returned.wait(wait_s):
        raise AssertionError(f"rank 0's hooked low_latency_dispatch did not return within "
                             f"{wait_s} s of this rank's waiting for it")
    recv, count, h, ev, hook = b.low_latency_dispatch(x, idx, M, E, use_fp8=False,
                                                      return_recv_hook=True)
    assert ev.event is None
    x.zero_()
    idx.fill_(-1)
    if rank == 0:
        returned.set()
    hook()
    hook()  # a second call does nothing
    out[0].update(ll_x=bits(recv), ll_count=count.cpu().numpy())
    calls = []
    stats = torch.zeros(L, dtype=torch.int32)
    for it in (1, 2):
        xi, ii, _ = load(it)
        calls.append((it,) + b.low_latency_dispatch(xi, ii, M, E, use_fp8=False,
                                                    cumulative_local_expert_recv_stats=stats,
                                                    return_recv_hook=True))
    assert not stats.any()  # counted when received, in the hooks
    for it, recv_i, count_i, _, _, hook_i in reversed(calls):
        hook_i()
        out[it].update(ll_x=bits(recv_i), ll_count=count_i.cpu().numpy())
    assert torch.equal(stats, calls[0][2] + calls[1][2])  # DeepEP's: cumulative
    x, idx, w = load(0)
    scale = torch.from_numpy(expert_scale(world)[rank * L:(rank + 1) * L]).view(L, 1, 1)
    y = (recv.float() * scale).bfloat16()
    comb, ev, hook = b.low_latency_combine(y, idx, w, h, return_recv_hook=True)
    y.zero_()
    hook()
    out[0]["ll_combined"] = bits(comb)
    b.destroy()
    return out


def overlap_rank(args) -> List[Dict[str, np.ndarray]]:
    """Rank `rank` of a job of 2, showing that a hooked call sends at the call: rank 0 makes
    a hooked low-latency dispatch and then waits for `received` (ceiling `wait_s`), which
    rank 1 sets once its own hooked dispatch's hook() has returned, before calling its hook.
    Rank 1's receive needs rank 0's rows, which left at rank 0's call: where the exchange
    waited for rank 0's hook, rank 1's hook would wait for rank 0, and rank 0 for rank 1
    (rank 0 raises after wait_s).  The call's dispatch_wait_recv_cost_stats is untouched by
    the send and added to by the hook (nanoseconds on the host backend).  Results as
    rank_ops' (ll_x, ll_count), one iteration."""
    sock, job, rank, world, seed, received, wait_s = args
    import deepep
    s = shape(world)
    M, E = s["max_ll_tokens_per_rank"], s["num_experts"]
    b = deepep.Buffer(job_id=job, rank=rank, world_size=world, local_rank=rank,
                      local_world_size=world, socket=sock, **s)
    li = inputs(seed, rank, world, 0, ll=True)
    x, idx = torch.from_numpy(li["x"]).bfloat16(), torch.from_numpy(li["idx"])
    base = 1 << 40
    cost = torch.full((world,), base, dtype=torch.int64)
    recv, count, h, ev, hook = b.low_latency_dispatch(x, idx, M, E, use_fp8=False,
                                                      dispatch_wait_recv_cost_stats=cost,
                                                      return_recv_hook=True)
    assert (cost == base).all(), "the send added to dispatch_wait_recv_cost_stats"
    if rank == 0:
        if not received.wait(wait_s):
            raise AssertionError(f"rank 1's hook did not return within {wait_s} s while this "
                                 "rank's hook had not run: the receive waited for this hook")
        hook()
    else:
        hook()
        received.set()
    # Each source's wait, bounded by the op timeout (a generous ceiling: 10 minutes in ns).
    assert ((cost >= base) & (cost - base < 600 * 10**9)).all(), cost
    out = [{"ll_x": bits(recv), "ll_count": count.cpu().numpy()}]
    b.destroy()
    return out


#: ll_handle_rank's world and job: DeepEP's test_low_latency.py at a size for a loaded
#: 2-core machine (its rank_offset of 128 too, so that every source's rows have their own
#: value, exact in bf16).
LL_HANDLE_WORLD = 4
LL_HANDLE_SHAPE = dict(hidden=256, num_experts=8, num_topk=3, num_tokens=16)
LL_HANDLE_OFFSET = 128


def ll_handle_rank(rank: int, sock: str, store: str, seed: int, outdir: str) -> None:
    """Process `rank` of LL_HANDLE_WORLD started by torch.multiprocessing.spawn, gloo over a
    FileStore, as DeepEP's test_low_latency.py runs its ranks: deep_ep.Buffer(group,
    num_rdma_bytes=..., low_latency_mode=True), x of value rank - LL_HANDLE_OFFSET with the
    token index in its last 128 channels, top-k from random scores with some -1, then
    low_latency_dispatch with and without the hook, bf16 and FP8, each handle indexed
    (handle[0], handle[1]) after the receive and passed back to low_latency_combine and
    get_next_low_latency_combine_buffer.  Pickles every rank's top-k and, per call, the
    handle's members, recv_count and the bf16 rows' values into outdir/<rank>.pkl; and
    whether indexing a hooked call's handle before its hook was refused."""
    import os
    import pickle
    import torch.distributed as dist
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                 "DEEPEP_JOB_ID", "SLURM_PROCID", "SLURM_JOB_ID"):
        os.environ.pop(name, None)
    os.environ["DEEPEPD_SOCKET"] = sock
    W, s = LL_HANDLE_WORLD, LL_HANDLE_SHAPE
    n, hidden, E, K = s["num_tokens"], s["hidden"], s["num_experts"], s["num_topk"]
    dist.init_process_group("gloo", store=dist.FileStore(store, W), rank=rank, world_size=W)
    group = dist.new_group(list(range(W)))
    deep_ep = import_compat()
    b = deep_ep.Buffer(group, num_rdma_bytes=1 << 20, low_latency_mode=True,
                       num_qps_per_rank=E // W, explicitly_destroy=True)
    gen = torch.Generator().manual_seed(seed * 16 + rank)
    x = torch.ones((n, hidden), dtype=torch.bfloat16) * (rank - LL_HANDLE_OFFSET)
    x[:, -128:] = torch.arange(n).to(torch.bfloat16).view(-1, 1)
    scores = torch.rand((n, E), generator=gen) + 1
    idx = torch.topk(scores, K, dim=-1, largest=True, sorted=True)[1]
    for i in range(4):
        idx[int(torch.randint(n, (1,), generator=gen)), int(torch.randint(K, (1,),
                                                                          generator=gen))] = -1
    w = torch.rand((n, K), generator=gen)
    every = [torch.empty_like(idx) for _ in range(W)]
    dist.all_gather(every, idx, group=group)
    out = {"topk": np.stack([t.numpy() for t in every]), "calls": []}
    for hooked in (False, True):
        for fp8 in (False, True):
            recv, count, handle, ev, hook = b.low_latency_dispatch(
                x, idx, n, E, use_fp8=fp8, async_finish=not hooked, return_recv_hook=hooked)
            if hooked:
                try:
                    handle[0]
                    out["early"] = "not refused"
                except ValueError as e:
                    out["early"] = str(e)
                hook()
            else:
                ev.current_stream_wait()
            src, rng, m, hid, ne = handle  # DeepEP's own low_latency_combine unpacks it so
            call = dict(hooked=hooked, fp8=fp8, tuple=isinstance(handle, tuple),
                        len=len(handle), rest=(m, hid, ne), src=handle[0].numpy().copy(),
                        range=handle[1].numpy().copy(), same=handle[0] is src,
                        count=count.numpy().copy(), src_dtype=str(src.dtype),
                        range_dtype=str(rng.dtype))
            if not fp8:
                call["recv"] = recv.float().numpy().copy()
                y = recv.clone()
                b.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
                c, _, _ = b.low_latency_combine(y, idx, w, handle, zero_copy=True)
                call["combined"] = c.float().numpy().copy()
            out["calls"].append(call)
    want = (x.float() * w.masked_fill(idx == -1, 0).sum(1, keepdim=True)).numpy()
    out["want_combined"] = want
    b.destroy()
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    dist.destroy_process_group()
