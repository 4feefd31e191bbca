"""Rank processes that make DeepEP's own test scripts' calls (tests/test_intranode.py and
tests/test_low_latency.py, public) on deep_ep, with their inputs: test_scripts.py's."""
import random
from typing import Dict, List

import numpy as np
import torch

import ranks

#: The job of the low-latency script's calls on the host backend: its defaults, smaller (288
#: experts of hidden 7168 on 8 ranks there: 36 local experts, more than a warp's lanes).
LL = dict(hidden=512, num_experts=36 * 2, num_topk=8, tokens=16)
#: ... and on cuda (DEP_TEST_BACKEND=cuda, 8 ranks): the script's defaults themselves.
LL_CUDA = dict(hidden=7168, num_experts=288, num_topk=8, tokens=128)


def _e4m3_value(q: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 values as float32, from torch's float8_e4m3fn or (a torch without it) their
    bytes as uint8."""
    if q.dtype != torch.uint8:
        return q.float()
    b = torch.arange(256)
    e, m = (b >> 3) & 15, (b & 7).float()
    v = torch.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * torch.pow(2.0, (e - 7).float()))
    v = torch.where((b & 0x7f) == 0x7f, torch.full_like(v, float("nan")), v)
    v = torch.where(b >= 128, -v, v)
    return v.to(q.device)[q.long()]


def cast_back(q, s):
    """DeepEP's tests' per_token_cast_back: FP8 values [n, hidden] times their scales (float32
    [n, hidden // 128], or UE8M0 exponents packed in int32) as bf16."""
    if s.dtype == torch.int32:
        s = (s.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    x = _e4m3_value(q).view(q.size(0), -1, 128)
    return (x * s.view(q.size(0), -1, 1)).view(q.shape).bfloat16()


def _as_the_scripts(dev: torch.device) -> None:
    """The defaults DeepEP's tests' init_dist sets before any call: bfloat16 floats, and the
    GPU as the default device (where torch has set_default_device), so that a tensor the
    binding makes without naming its dtype or device would show it."""
    torch.set_default_dtype(torch.bfloat16)
    if dev.type == "cuda" and hasattr(torch, "set_default_device"):
        torch.set_default_device(dev)


def _recorded(b, num_experts: int) -> str:
    """What the library reports at its next call (on cuda, a failure the kernels recorded in
    an earlier call surfaces there): a layout of no tokens, which sends nothing."""
    try:
        b.get_dispatch_layout(torch.zeros((0, b.num_topk), dtype=torch.int64,
                                          device=b.device), num_experts)
    except Exception as e:  # what it says is the test's diagnostic
        return f"{type(e).__name__}: {e}"
    return "nothing"


def ll_rank(args) -> List[Dict[str, np.ndarray]]:
    """test_low_latency.py's loop of checks: x a clone of the WHOLE packed receive buffer
    (rows past recv_count as the buffer held them, and NaN here as a reused one may),
    topk_idx with -1 entries, out=torch.empty (NaN here)."""
    sock, job, rank, world, seed, iters, dev = args
    deep_ep = ranks.import_compat()
    dev = torch.device(dev)
    sh = LL_CUDA if dev.type == "cuda" else LL
    M, hid, E, K = sh["tokens"], sh["hidden"], sh["num_experts"], sh["num_topk"]
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    out = []
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    rnd = random.Random(seed * 1000 + rank)
    x = (torch.randint(-32, 33, (M, hid), generator=g).float() / 8).bfloat16().to(dev)
    scores = torch.rand((M, E), generator=g, dtype=torch.float32) + 1
    idx = torch.topk(scores, K, dim=-1, largest=True, sorted=True)[1].to(dev)
    for _ in range(4):
        idx[rnd.randrange(M), rnd.randrange(K)] = -1
    w = (torch.randint(1, 5, (M, K), generator=g).float() / 4).to(dev)
    _as_the_scripts(dev)
    b = deep_ep.Buffer(None, 0, 1 << 20, low_latency_mode=True, job_id=job, rank=rank,
                       world_size=world, local_rank=rank, local_world_size=world, socket=sock,
                       max_tokens_per_rank=M)
    n = 0
    for hook in (False, True):
        for fp8 in (False, True):
            for rs in ((False, True) if fp8 else (False,)):
                for ue in ((False, True) if rs else (False,)):
                    n += 1
                    for _ in range(n % 2 + 1):
                        recv, count, h, ev, hk = b.low_latency_dispatch(
                            x, idx, M, E, use_fp8=fp8, round_scale=rs, use_ue8m0=ue,
                            async_finish=not hook, return_recv_hook=hook)
                        hk() if hook else ev.current_stream_wait()
                    if fp8:
                        q, s = recv[0], recv[1].contiguous()
                        sim = cast_back(q.view(-1, hid), s.view(-1, hid // 128)).view(q.shape)
                    else:
                        sim = recv.clone()
                    for l in range(sim.size(0)):
                        sim[l, int(count[l]):] = float("nan")
                    h[0], h[1]
                    for zero_copy in (False, True):
                        if zero_copy:
                            b.get_next_low_latency_combine_buffer(h)[:, :, :] = sim
                        o = torch.full((M, hid), float("nan"), dtype=torch.bfloat16, device=dev)
                        combined, ev, hk = b.low_latency_combine(
                            sim, idx, w, h, async_finish=not hook, zero_copy=zero_copy,
                            return_recv_hook=hook, out=o)
                        hk() if hook else ev.current_stream_wait()
                        # The script's check: x times the sum of the selected weights.
                        want = x.float() * w.masked_fill(idx == -1, 0).sum(1, keepdim=True)
                        got = combined.float()
                        nan = int(torch.isnan(got).sum())
                        out.append(dict(nan=nan, err=float((got - want).abs().max()),
                                        scale=float(want.abs().max()), fp8=fp8,
                                        same=combined.data_ptr() == o.data_ptr(),
                                        call=(n, hook, fp8, rs, ue, zero_copy),
                                        recorded=_recorded(b, E) if nan else ""))
    return out


def ll_rank_checked(args) -> List[Dict[str, np.ndarray]]:
    """ll_rank, with what it raises reraised as a RuntimeError with its traceback."""
    try:
        return ll_rank(args)
    except Exception:
        import traceback
        raise RuntimeError(traceback.format_exc()) from None


#: The job of the intranode script's calls (4096 tokens of hidden 7168, 256 experts, top-8 on
#: 8 ranks there).
TP = dict(hidden=256, experts_per_rank=3, num_topk=4, tokens=12)


def tp_inputs(seed: int, rank: int, world: int) -> Dict[str, np.ndarray]:
    """One rank's tokens (a grid exact in bf16), top-k (distinct experts, some -1) and weights,
    and the layout test_intranode.py derives from them."""
    rng = np.random.default_rng([seed, rank, world, 26])
    E, K, n = TP["experts_per_rank"] * world, TP["num_topk"], TP["tokens"]
    idx = np.stack([rng.permutation(E)[:K] for _ in range(n)]).astype(np.int64)
    idx[rng.random(idx.shape) < 0.2] = -1
    x = (rng.integers(-32, 33, (n, TP["hidden"])) / 8).astype(np.float32)
    w = (rng.integers(1, 5, idx.shape) / 4).astype(np.float32)
    owner = np.where(idx >= 0, idx // TP["experts_per_rank"], -1)
    mask = (owner[:, :, None] == np.arange(world)[None, None, :]).any(1)
    per_expert = np.bincount(idx[idx >= 0], minlength=E).astype(np.int32)
    return dict(idx=idx, x=x, w=w, mask=mask, per_expert=per_expert,
                per_rank=mask.sum(0).astype(np.int32))


def _tp_call(b, x, inp, dev, **kw):
    return b.dispatch(x, num_tokens_per_rank=torch.from_numpy(inp["per_rank"]).to(dev),
                      is_token_in_rank=torch.from_numpy(inp["mask"]).to(dev),
                      num_tokens_per_expert=torch.from_numpy(inp["per_expert"]).to(dev), **kw)


def tp_rank(args) -> List[Dict[str, object]]:
    """test_intranode.py's calls: on a Buffer made without a shape, get_dispatch_layout, then
    dispatch without top-k (bf16 and FP8), its cached dispatch and combine, then with top-k
    and a weighted combine; and on a second Buffer whose first call is a dispatch without
    top-k (so its top-k width is not known there), a later dispatch and combine with top-k."""
    sock, job, rank, world, seed, iters, dev = args
    deep_ep = ranks.import_compat()
    dev = torch.device(dev)
    inp = tp_inputs(seed, rank, world)
    _as_the_scripts(dev)
    E = TP["experts_per_rank"] * world
    x = torch.from_numpy(inp["x"]).bfloat16().to(dev)
    idx = torch.from_numpy(inp["idx"]).to(dev)
    w = torch.from_numpy(inp["w"]).to(dev)
    out: List[Dict[str, object]] = []
    for first in ("layout", "no-topk"):
        b = deep_ep.Buffer(None, int(1e9), 0, job_id=f"{job}-{first}", rank=rank,
                           world_size=world, local_rank=rank, local_world_size=world,
                           socket=sock)
        r: Dict[str, object] = {"first": first}
        if first == "layout":
            b.get_dispatch_layout(idx, E)
        cfg = deep_ep.Config(24, 8, 256)
        for fp8 in (False, True):
            xs = x
            if fp8:
                sc = torch.ones((x.size(0), TP["hidden"] // 128), dtype=torch.float32,
                                device=dev)
                xs = (x.float().to(deep_ep.fp8_dtype) if deep_ep.fp8_dtype != torch.uint8
                      else torch.zeros(x.shape, dtype=torch.uint8, device=dev), sc)
            rx, ridx, rw, counts, h, ev = _tp_call(b, xs, inp, dev, config=cfg,
                                                   previous_event=b.capture(),
                                                   async_finish=True)
            ev.current_stream_wait()
            r[f"mask{int(fp8)}"] = dict(
                x=(rx[0] if fp8 else rx).float().cpu().numpy() if not fp8 else None,
                rows=(rx[0] if fp8 else rx).size(0), idx=ridx, w=rw, counts=counts,
                prefix=h[0][:, rank].cpu().numpy())
            cx, _, _, _, _, _ = b.dispatch(xs, handle=h, config=cfg)
            r[f"cached{int(fp8)}"] = (cx[0] if fp8 else cx).size(0)
            if not fp8:
                r["cached_x"] = cx.float().cpu().numpy()
                comb, cw, _ = b.combine(rx, h, config=cfg)
                r["combined"] = comb.float().cpu().numpy()
                r["combined_w"] = cw
        _, ridx, _, counts, _, _ = _tp_call(b, x, inp, dev, expert_alignment=4)
        r["aligned"] = counts
        worst = world * TP["tokens"]
        rx, ridx, _, counts, h, _ = _tp_call(b, x, inp, dev, num_worst_tokens=worst)
        r["worst"] = (rx.size(0), ridx, counts, b.combine(rx, h)[0].float().cpu().numpy())
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(idx, E)
        r.update(layout=(per_rank.cpu().numpy(), per_expert.cpu().numpy(),
                         in_rank.cpu().numpy()))
        rx, ridx, rw, counts, h, _ = _tp_call(b, x, inp, dev, topk_idx=idx, topk_weights=w,
                                              config=cfg)
        comb, cw, _ = b.combine(rx, h, topk_weights=rw, config=cfg)
        r.update(topk_x=rx.float().cpu().numpy(), topk_idx=ridx.cpu().numpy(),
                 topk_w=rw.cpu().numpy(), topk_counts=counts,
                 topk_combined=comb.float().cpu().numpy(), topk_combined_w=cw.cpu().numpy(),
                 num_topk=b.num_topk)
        out.append(r)
    return out


def tp_rank_checked(args) -> List[Dict[str, object]]:
    """tp_rank, with what it raises reraised as a RuntimeError with its traceback (a
    deepep.Error does not pickle back to the parent)."""
    try:
        return tp_rank(args)
    except Exception:
        import traceback
        raise RuntimeError(traceback.format_exc()) from None


def narrow_rank(args) -> str:
    """A dispatch without top-k on a Buffer of num_topk 2 in a world of 3, whose tokens go to
    every rank: what it raises (before anything is sent, so every rank raises alike)."""
    sock, job, rank, world, seed, iters, dev = args
    deep_ep = ranks.import_compat()
    dev = torch.device(dev)
    b = deep_ep.Buffer(None, 0, 0, job_id=job, rank=rank, world_size=world, local_rank=rank,
                       local_world_size=world, socket=sock, hidden=256,
                       num_experts=2 * world, num_topk=2)
    n = 4
    try:
        b.dispatch(torch.zeros((n, 256), dtype=torch.bfloat16, device=dev),
                   num_tokens_per_rank=torch.full((world,), n, dtype=torch.int32, device=dev),
                   is_token_in_rank=torch.ones((n, world), dtype=torch.bool, device=dev),
                   num_tokens_per_expert=torch.full((2 * world,), n, dtype=torch.int32,
                                                    device=dev))
    except ValueError as e:
        return str(e)
    return "no error"
