"""The call sequences of DeepEP's users, written from their public code (none copied), run
through deep_ep on CPU tensors: Megatron-LM's fused_a2a.py (autograd functions around
layout, dispatch and combine, with the cached dispatch in combine's backward), SGLang's
DeepEP dispatcher (normal mode with DeepGEMM's FP8 and alignment, low-latency mode with the
receive hook) and vLLM's DeepEP all-to-all managers (high-throughput and low-latency).

callers_rank is one process of a world started by torch.multiprocessing.spawn; each caller
runs on an expert-parallel group of its own (test_callers.py says which), the inputs are
ranks.inputs()'s of (group seed, group rank), and the results carry rank_ops' keys so that
test_ops' references check them.
"""
import os
import pickle
from typing import Any, Dict, List

import numpy as np
import torch

import ranks
from ranks import bits, expert_scale, fp8_inputs, inputs, shape

#: The world, and its expert-parallel groups: Megatron's EP inside DP (PAIRS), SGLang's across
#: them (CROSS), vLLM's the whole world (as a gloo CPU group of its own), so that every
#: process is in three groups, each group a job of its own.
WORLD = 4
PAIRS = ranks.PAIRS
CROSS = ranks.CROSS
EVERY = ([0, 1, 2, 3],)
#: DeepEP's configurations vLLM passes a config for (else None).
_VLLM_CONFIG_RANKS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)


def _tensors(seed: int, rank: int, world: int, it: int, ll: bool = False):
    inp = inputs(seed, rank, world, it, ll)
    return (torch.from_numpy(inp["x"]).bfloat16(), torch.from_numpy(inp["idx"]),
            torch.from_numpy(inp["w"]))


# ---- Megatron-LM: fused_a2a.py ----------------------------------------------------------

def megatron(deep_ep, group, rank: int, world: int, seed: int, iters: int) -> List[dict]:
    """Megatron's flex dispatcher with the deepep backend: Buffer.set_num_sms, a Buffer made
    by get_buffer from the configs' size hints (positional group, num_nvl_bytes,
    num_rdma_bytes; rebuilt only where the group or the sizes change), and the two autograd
    functions with async_finish and allocate_on_comm_stream, forward and backward."""
    from deep_ep import Buffer
    from deep_ep.utils import EventHandle, EventOverlap

    cache: Dict[str, Any] = {}

    def get_buffer(g, hidden_bytes: int):
        nvl = rdma = 0
        for cfg in (Buffer.get_dispatch_config(g.size()), Buffer.get_combine_config(g.size())):
            nvl = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, g.size()), nvl)
            rdma = max(cfg.get_rdma_buffer_size_hint(hidden_bytes, g.size()), rdma)
        b = cache.get("b")
        if b is None or b.group != g or b.num_nvl_bytes < nvl or b.num_rdma_bytes < rdma:
            b = cache["b"] = Buffer(g, nvl, rdma)
        return b

    def hidden_bytes(t):
        return t.size(1) * max(t.element_size(), 2)

    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, idx, probs, num_experts, g, async_finish, on_comm):
            prev = EventOverlap(EventHandle()) if async_finish else None
            b = get_buffer(g, hidden_bytes(x))
            per_rank, per_rdma, per_expert, in_rank, ev = b.get_dispatch_layout(
                idx, num_experts, previous_event=prev, async_finish=async_finish,
                allocate_on_comm_stream=on_comm)
            rx, ri, rp, counts, handle, after = b.dispatch(
                x, topk_idx=idx, topk_weights=probs, num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, previous_event=ev,
                async_finish=async_finish, allocate_on_comm_stream=on_comm)
            if async_finish:
                after.current_stream_wait()
            ctx.group, ctx.handle = g, handle
            ctx.async_finish, ctx.on_comm = async_finish, on_comm
            return rx, ri, rp, torch.tensor(counts), handle

        @staticmethod
        def backward(ctx, grad_x, _gi, grad_probs, _gc, _gh):
            b = get_buffer(ctx.group, hidden_bytes(grad_x))
            prev = EventOverlap(EventHandle()) if ctx.async_finish else None
            gx, gp, after = b.combine(grad_x.contiguous(), ctx.handle,
                                      topk_weights=grad_probs.float(), previous_event=prev,
                                      async_finish=ctx.async_finish,
                                      allocate_on_comm_stream=ctx.on_comm)
            if ctx.async_finish:
                after.current_stream_wait()
            return gx, None, gp, None, None, None, None

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, g, handle, async_finish, on_comm):
            prev = EventOverlap(EventHandle()) if async_finish else None
            b = get_buffer(g, hidden_bytes(x))
            out, _, after = b.combine(x, handle=handle, async_finish=async_finish,
                                      previous_event=prev, allocate_on_comm_stream=on_comm)
            if async_finish:
                after.current_stream_wait()
            ctx.handle, ctx.group = handle, g
            ctx.async_finish, ctx.on_comm = async_finish, on_comm
            return out, None

        @staticmethod
        def backward(ctx, grad_out, _none):
            b = get_buffer(ctx.group, hidden_bytes(grad_out))
            prev = EventOverlap(EventHandle()) if ctx.async_finish else None
            gx, _, _, _, _, after = b.dispatch(grad_out.contiguous(), handle=ctx.handle,
                                               previous_event=prev,
                                               async_finish=ctx.async_finish,
                                               allocate_on_comm_stream=ctx.on_comm)
            if ctx.async_finish:
                after.current_stream_wait()
            return gx, None, None, None, None

    Buffer.set_num_sms(20)
    s = shape(world)
    out = []
    for it in range(iters):
        x, idx, probs = _tensors(seed, rank, world, it)
        x.requires_grad_(True)
        probs.requires_grad_(True)
        rx, ri, rp, per_expert, handle = Dispatch.apply(x, idx, probs, s["num_experts"], group,
                                                        True, True)
        y = rx * (rank + 1)  # the experts
        comb, _ = Combine.apply(y, group, handle, True, True)
        g = x.detach().clone()  # the output's gradient: x's values again
        torch.autograd.backward([comb, rp], [g, torch.full_like(rp, rank + 1.0)])
        out.append(dict(recv_x=bits(rx.detach()), recv_idx=ri.numpy(),
                        recv_w=rp.detach().numpy(), counts=per_expert.numpy().astype(np.int64),
                        combined=bits(comb.detach()), grad_x=bits(x.grad),
                        grad_probs=probs.grad.numpy()))
    return out


# ---- SGLang: the DeepEP dispatcher --------------------------------------------------------

def sglang(deep_ep, group, rank: int, world: int, seed: int, iters: int) -> List[dict]:
    """SGLang's DeepEP dispatcher in auto mode, one Buffer for both modes (made from the
    larger of the hints, num_qps_per_rank the larger of num_sms and the local experts,
    allow_mnnvl=True).  Normal mode with DeepGEMM: FP8 values with column-major scales,
    Buffer.capture(), the layout and dispatch with expert_alignment=128 and the config,
    then a combine without weights (SGLang weights before combining).  Then
    clean_low_latency_buffer, and low-latency mode with the receive hook: an FP8 dispatch,
    a bf16 dispatch and its combine."""
    from deep_ep import Buffer, Config
    s = shape(world)
    E, M, H = s["num_experts"], s["max_ll_tokens_per_rank"], s["hidden"]
    n = group.size()
    cfg_d, cfg_c = Buffer.get_dispatch_config(n), Buffer.get_combine_config(n)
    cfg_d = Config(**{k: getattr(cfg_d, k) for k in (
        "num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
        "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")})
    nvl = max(c.get_nvl_buffer_size_hint(H * 2, n) for c in (cfg_d, cfg_c))
    rdma = max(max(c.get_rdma_buffer_size_hint(H * 2, n) for c in (cfg_d, cfg_c)),
               Buffer.get_low_latency_rdma_size_hint(M, H, n, E))
    b = Buffer(group, nvl, rdma, low_latency_mode=True,
               num_qps_per_rank=max(Buffer.num_sms, E // n), allow_mnnvl=True)
    assert b.group_size == n and b.low_latency_mode
    out = []
    for it in range(iters):
        r: Dict[str, Any] = {}
        x, idx, w = _tensors(seed, rank, world, it)
        f8 = fp8_inputs(seed, rank, world, it)
        # torch's e4m3 (SGLang's), or its bytes where this torch has none (Debian's 1.13).
        q = torch.from_numpy(f8["q"]).view(getattr(torch, "float8_e4m3fn", torch.uint8))
        sc = torch.from_numpy(f8["sc"]).t().contiguous().t()  # column-major, for DeepGEMM
        prev = Buffer.capture()
        per_rank, per_rdma, per_expert, in_rank, ev = b.get_dispatch_layout(
            idx, E, previous_event=prev, async_finish=True, allocate_on_comm_stream=True)
        (rq, rsc), ri, rw, counts, handle, ev = b.dispatch(
            (q, sc), topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, previous_event=ev, async_finish=True,
            allocate_on_comm_stream=True, expert_alignment=128, config=cfg_d)
        ev.current_stream_wait()
        r.update(fp8_q=rq.view(torch.uint8).numpy(), fp8_sc=rsc.numpy(), fp8_idx=ri.numpy(),
                 fp8_counts=np.array(counts, np.int64))
        y = torch.full((rq.size(0), H), rank + 1, dtype=torch.bfloat16)  # weighted outputs
        prev = Buffer.capture()
        comb, none, ev = b.combine(y, handle, async_finish=True, previous_event=prev,
                                   allocate_on_comm_stream=True, config=cfg_c)
        ev.current_stream_wait()
        assert none is None
        r["ones_combined"] = bits(comb)

        b.clean_low_latency_buffer(M, H, E)
        lx, lidx, lw = _tensors(seed, rank, world, it, ll=True)
        xn = torch.from_numpy(inputs(seed, rank, world, it, ll=True)["xn"]).bfloat16()
        (fq, fsc), fcount, _, _, hook = b.low_latency_dispatch(
            xn, lidx, M, E, use_fp8=True, async_finish=False, return_recv_hook=True)
        hook()
        r.update(fp8_x=fq.view(torch.uint8).numpy(), fp8_scales=fsc.numpy(),
                 fp8_scales_stride=np.array(fsc.stride()), fp8_count=fcount.numpy())
        recv, count, lh, _, hook = b.low_latency_dispatch(
            lx, lidx, M, E, use_fp8=False, async_finish=False, return_recv_hook=True)
        hook()
        r.update(ll_x=bits(recv), ll_count=count.numpy())
        L = E // n
        ly = (recv.float() * torch.from_numpy(
            expert_scale(n)[rank * L:(rank + 1) * L]).view(L, 1, 1)).bfloat16()
        lout, _, hook = b.low_latency_combine(ly, lidx, lw, lh, async_finish=False,
                                              return_recv_hook=True)
        hook()
        r["ll_combined"] = bits(lout)
        out.append(r)
    return out


# ---- vLLM: the DeepEP all-to-all managers -------------------------------------------------

def vllm(deep_ep, cpu_group, rank: int, world: int, seed: int, iters: int) -> List[dict]:
    """vLLM's DeepEP managers on a gloo CPU group: the high-throughput Buffer
    (low_latency_mode=False, explicitly_destroy=True) with keyword calls, layout without
    events, dispatch with the config where DeepEP has one, combine without weights; the
    low-latency Buffer (num_qps_per_rank the local experts, explicitly_destroy=True), its
    RDMA buffer zeroed as the fault-tolerance path does, a bf16 dispatch with the hook and
    a combine into out= with the hook.  Both destroyed at the end, as vLLM does."""
    Buffer = deep_ep.Buffer
    s = shape(world)
    E, M, H = s["num_experts"], s["max_ll_tokens_per_rank"], s["hidden"]
    n = cpu_group.size()
    ht = Buffer(group=cpu_group, num_nvl_bytes=1 << 20, num_rdma_bytes=0,
                low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True)
    ll = Buffer(group=cpu_group, num_nvl_bytes=0,
                num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(M, H, n, E),
                low_latency_mode=True, num_qps_per_rank=E // n,
                allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                explicitly_destroy=True)
    ll.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
    cfg_d = Buffer.get_dispatch_config(n) if n in _VLLM_CONFIG_RANKS else None
    cfg_c = Buffer.get_combine_config(n) if n in _VLLM_CONFIG_RANKS else None
    out = []
    for it in range(iters):
        r: Dict[str, Any] = {}
        x, idx, w = _tensors(seed, rank, world, it)
        per_rank, per_rdma, per_expert, in_rank, ev = ht.get_dispatch_layout(
            topk_idx=idx, num_experts=E, previous_event=None, async_finish=False,
            allocate_on_comm_stream=False)
        rx, ri, rw, counts, handle, ev = ht.dispatch(
            x=x, handle=None, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
            topk_weights=w, expert_alignment=1, config=cfg_d, previous_event=None,
            async_finish=False, allocate_on_comm_stream=False)
        r.update(recv_x=bits(rx), recv_idx=ri.numpy(), recv_w=rw.numpy(),
                 counts=np.array(counts, np.int64))
        comb, _, _ = ht.combine(x=(rx.float() * (rank + 1)).bfloat16(), handle=handle,
                                topk_weights=None, config=cfg_c, previous_event=None,
                                async_finish=False, allocate_on_comm_stream=False)
        r["combined"] = bits(comb)

        lx, lidx, lw = _tensors(seed, rank, world, it, ll=True)
        recv, count, lh, _, hook = ll.low_latency_dispatch(
            lx, lidx, M, E, use_fp8=False, round_scale=False, use_ue8m0=False,
            async_finish=False, return_recv_hook=True)
        hook()
        r.update(ll_x=bits(recv), ll_count=count.numpy())
        L = E // n
        ly = (recv.float() * torch.from_numpy(
            expert_scale(n)[rank * L:(rank + 1) * L]).view(L, 1, 1)).bfloat16()
        output = torch.empty((lx.size(0), H), dtype=torch.bfloat16)
        lout, _, hook = ll.low_latency_combine(ly, lidx, lw, lh, async_finish=False,
                                               zero_copy=False, return_recv_hook=True,
                                               out=output)
        hook()
        assert lout is output
        r["ll_combined"] = bits(output)
        out.append(r)
    ht.destroy()
    ll.destroy()
    return out


def callers_rank(rank: int, sock: str, store: str, seed: int, iters: int, outdir: str) -> None:
    """Process `rank` of a world of WORLD (torch.multiprocessing.spawn, gloo over a FileStore,
    no launcher's variables): Megatron on its PAIRS group, SGLang on its CROSS group, vLLM on
    a gloo group of the whole world; pickles {caller: (group index, group rank, results)}
    into outdir/<rank>.pkl."""
    import torch.distributed as dist
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                 "DEEPEP_JOB_ID", "SLURM_PROCID", "SLURM_JOB_ID"):
        os.environ.pop(name, None)
    os.environ.update(ranks.GROUP_ENV)
    os.environ["DEEPEPD_SOCKET"] = sock
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank,
                            world_size=WORLD)
    # Every process makes every group, in one order (torch's rule for new_group).
    groups = {"megatron": [dist.new_group(m) for m in PAIRS],
              "sglang": [dist.new_group(m) for m in CROSS],
              "vllm": [dist.new_group(m, backend="gloo") for m in EVERY]}
    deep_ep = ranks.import_compat()
    out = {}
    for caller, fn, members in (("megatron", megatron, PAIRS), ("sglang", sglang, CROSS),
                                ("vllm", vllm, EVERY)):
        i = next(i for i, m in enumerate(members) if rank in m)
        g = groups[caller][i]
        gr = dist.get_rank(g)
        out[caller] = (i, gr, fn(deep_ep, g, gr, g.size(), caller_seed(seed, caller, i), iters))
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    dist.destroy_process_group()


def caller_seed(seed: int, caller: str, index: int) -> int:
    """The inputs' seed of group `index` of a caller (each group's inputs differ)."""
    return seed * 16 + {"megatron": 0, "sglang": 4, "vllm": 8}[caller] + index
