"""deep_ep — DeepEP's module names over deepepd (opt-in; docs/python.md).

(setup.py recognises this module by the words "DeepEP's module names over deepepd".)

Installed only when asked (DEEPEP_INSTALL_DEEP_EP=1 at install time), and
never over a real DeepEP.  ``from deep_ep import Buffer, Config,
EventOverlap`` and ``from deep_ep.utils import EventHandle, EventOverlap``
work as with DeepEP.  docs/python.md lists each way in which
it still differs from DeepEP, with the reason.
"""
import operator
from typing import Any, Iterator, Optional, Tuple

import torch

import deepep as _deepep
from deepep import Config, EventHandle, EventOverlap, Unsupported, fp8_dtype, topk_idx_t
from deepep.buffer import _token_in_rank

from . import _fp8

__version__ = _deepep.__version__


class Buffer(_deepep.Buffer):
    """deepep.Buffer, accepting (and ignoring) the keyword arguments of DeepEP's forks."""

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm: Any = None, **kwargs: Any):
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in _DEEPEP_KWARGS}
        self.ignored_kwargs = kwargs
        self._destroyed = False
        super().__init__(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
                         num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
                         use_fabric, explicitly_destroy, enable_shrink, comm,
                         elastic=bool(enable_shrink), **own)


    def destroy(self) -> None:
        """DeepEP's destroy(): frees the Buffer's handles and ends its job's attachment, once
        (RuntimeError the second time).  DeepEP's newer versions assert explicitly_destroy
        here; its test scripts of the versions before (test_low_latency.py) call destroy() on
        a Buffer made without it, so deepepd releases either way."""
        if self._destroyed:
            raise RuntimeError("destroy() was already called on this Buffer")
        self._destroyed = True
        _deepep.Buffer.destroy(self)

    def __del__(self) -> None:
        # DeepEP warns where an explicitly destroyed Buffer is collected undestroyed (its
        # collective teardown is the caller's to run); here the release is local, so it
        # is released as well.
        if getattr(self, "explicitly_destroy", False) and not getattr(self, "_destroyed", True):
            print("WARNING: destroy() was not called before the deep_ep Buffer was "
                  "collected; it is released now", flush=True)
        try:
            _deepep.Buffer.destroy(self)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def dispatch(self, x: Any, handle: Any = None, num_tokens_per_rank: Any = None,
                 num_tokens_per_rdma_rank: Any = None, is_token_in_rank: Any = None,
                 num_tokens_per_expert: Any = None, topk_idx: Any = None,
                 topk_weights: Any = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """deepep.Buffer.dispatch (its docstring says each argument's shape and dtype), with
        DeepEP's handle: a DispatchHandle tuple, or in a job whose ranks span nodes (the
        nodes known: DeepEP goes internode there) an InternodeHandle, as DeepEP's dispatch
        returns internode_dispatch's; one passed back (cached mode) is deepepd's handle
        inside it.  An FP8 x's scales may also be DeepEP's other forms: any
        strides, int32 (UE8M0 exponents packed four to an int, [num_tokens, hidden // 512]),
        or one per token ([num_tokens]); they are moved as they are (bit for bit) and the
        received scales have their form, row-major (as DeepEP's)."""
        return self._dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                              is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                              expert_alignment, num_worst_tokens, config, previous_event,
                              async_finish, allocate_on_comm_stream, self._nodes())

    def _nodes(self) -> Optional[Tuple[int, ...]]:
        """The node of each rank where the job spans nodes and they are known (where
        get_dispatch_layout's num_tokens_per_rdma_rank is a tensor), else None."""
        ident = self.identity
        return ident.node_of() if ident.world_size != ident.local_world_size else None

    def _dispatch(self, x: Any, handle: Any, num_tokens_per_rank: Any,
                  num_tokens_per_rdma_rank: Any, is_token_in_rank: Any,
                  num_tokens_per_expert: Any, topk_idx: Any, topk_weights: Any,
                  expert_alignment: int, num_worst_tokens: int, config: Optional[Config],
                  previous_event: Optional[EventOverlap], async_finish: bool,
                  allocate_on_comm_stream: bool, nodes: Optional[Tuple[int, ...]]):
        """dispatch, whose fresh handle is an InternodeHandle over `nodes` (the node of
        each rank), or a DispatchHandle where nodes is None."""
        x, unpad = _padded_scales(x)
        if handle is None and topk_idx is None and topk_weights is None and \
                self.num_topk is None and not self.attached:
            # The widest top-k the library takes (at most one entry per expert), so that
            # _widen_topk serves every later width.
            self.num_topk = _deepep._lib.MAX_TOPK
            if isinstance(num_tokens_per_expert, torch.Tensor) and num_tokens_per_expert.numel():
                self.num_topk = min(self.num_topk, num_tokens_per_expert.numel())
        k = topk_idx.size(1) if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 \
            else None
        idx, w = self._widen_topk(topk_idx, topk_weights)
        out = super().dispatch(
            x, _unwrap(handle), num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
            num_tokens_per_expert, idx, w, expert_alignment, num_worst_tokens,
            config, previous_event, async_finish, allocate_on_comm_stream)
        if unpad is not None:
            out = (unpad(out[0]),) + tuple(out[1:])
        if handle is not None:
            return out
        recv_x, recv_idx, recv_w, counts, h, ev = out
        if idx is not topk_idx:
            recv_idx, recv_w = recv_idx[:, :k].contiguous(), recv_w[:, :k].contiguous()
        rows = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).size(0)
        made = DispatchHandle.made(self, h, topk_idx, is_token_in_rank, rows, config) \
            if nodes is None else \
            InternodeHandle.made(self, h, topk_idx, is_token_in_rank, rows, config, nodes)
        return recv_x, recv_idx, recv_w, counts, made, ev

    def _widen_topk(self, topk_idx: Any, topk_weights: Any) -> Tuple[Any, Any]:
        """A call's top-k as wide as the Buffer's num_topk: DeepEP serves any top-k width per
        call, where deepepd's job has one (docs/python.md, one job shape per Buffer), so a
        call of k < num_topk entries gets -1 (and weight 0) in the rest, which select
        nothing: the results are those of a job of width k, whose columns the callers cut
        back to k.  (A Buffer whose first call is a dispatch without top-k takes the
        library's largest width, min(16, num_experts), so that every later width fits.)
        Anything else (no top-k, the Buffer's width, a wrong argument, which the Buffer's
        checks name) is returned as it is."""
        K = self.num_topk
        if K is None or not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or \
                topk_idx.size(1) >= K:
            return topk_idx, topk_weights
        n, k = topk_idx.shape
        idx = torch.full((n, K), -1, dtype=topk_idx.dtype, device=topk_idx.device)
        idx[:, :k] = topk_idx
        w = topk_weights
        if isinstance(w, torch.Tensor) and w.dim() == 2 and tuple(w.shape) == (n, k):
            w = torch.zeros((n, K), dtype=w.dtype, device=w.device)
            w[:, :k] = topk_weights
        return idx, w

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """deepep.Buffer.get_dispatch_layout, for any top-k width up to the Buffer's
        (_widen_topk)."""
        idx, _ = self._widen_topk(topk_idx, None)
        return super().get_dispatch_layout(idx, num_experts, previous_event, async_finish,
                                           allocate_on_comm_stream)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """deepep.Buffer.low_latency_dispatch with DeepEP's handle (a LowLatencyHandle) and
        DeepEP's FP8 scales: with use_fp8, recv_x
        is (values [L, rows, hidden] fp8, scales [L, rows, hidden // 128] float32) with the
        scales column-major (their storage is [L, hidden // 128, rows], as DeepEP's); with
        round_scale each scale is 2**ceil(log2(max(amax, 1e-4) / 448)) and the values are
        quantised with it; with use_ue8m0 (which needs round_scale, and hidden a multiple of
        512) the scales are those powers' biased exponents, four to an int32 ([L, rows,
        hidden // 512], column-major).  With return_recv_hook the conversions run in the hook,
        after the receive."""
        if use_ue8m0 and not round_scale:
            raise ValueError("low_latency_dispatch: use_ue8m0=True needs round_scale=True "
                             "(UE8M0 holds powers of two only; DeepEP asserts it too)")
        hidden = x.size(-1) if isinstance(x, torch.Tensor) else None
        if use_fp8 and use_ue8m0 and hidden is not None and hidden % (_fp8.GROUP * _fp8.UE8M0_PACK):
            raise ValueError(f"low_latency_dispatch: use_ue8m0=True packs {_fp8.UE8M0_PACK} "
                             f"scales an int32, so hidden must be a multiple of "
                             f"{_fp8.GROUP * _fp8.UE8M0_PACK}; x has {hidden}")
        # With round_scale the values are quantised here, from the bf16 rows received (the
        # kernels' own FP8 cast has scales that are not powers of two, and requantising its
        # output would round twice): what a sender would have computed from the same rows.
        requant = bool(use_fp8) and bool(round_scale)
        topk_idx, _ = self._widen_topk(topk_idx, None)
        recv, count, h, ev, hook = super().low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
            use_fp8=bool(use_fp8) and not requant, async_finish=async_finish,
            return_recv_hook=return_recv_hook)
        h = LowLatencyHandle(h, num_max_dispatch_tokens_per_rank, self.hidden, num_experts)
        if not use_fp8:
            return recv, count, h, ev, hook
        ue8m0 = bool(use_ue8m0)
        if not return_recv_hook:
            out = _deepep_fp8(recv, requant, ue8m0)
            if async_finish:  # behind the conversions (cuda; nothing to wait for on the host)
                ev = self._event(None, True)
            return out, count, h, ev, hook
        # The hook receives, then converts into the tensors returned now.
        L, rows, hid = self.num_local_experts, self._ll_rows, self.hidden
        groups = hid // _fp8.GROUP // (_fp8.UE8M0_PACK if ue8m0 else 1)
        vals = torch.empty((L, rows, hid), dtype=fp8_dtype, device=self.device) if requant \
            else recv[0]
        scales = torch.empty((L, groups, rows), dtype=torch.int32 if ue8m0 else torch.float32,
                             device=self.device).transpose(1, 2)

        def fp8_hook() -> None:
            hook()
            v, s = _deepep_fp8(recv, requant, ue8m0)
            if requant:
                vals.copy_(v)
            scales.copy_(s)

        return (vals, scales), count, h, ev, fp8_hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: Any, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """deepep.Buffer.low_latency_combine, taking low_latency_dispatch's LowLatencyHandle
        (any top-k width up to the Buffer's: _widen_topk)."""
        topk_idx, topk_weights = self._widen_topk(topk_idx, topk_weights)
        return super().low_latency_combine(x, topk_idx, topk_weights, _unwrap(handle), use_logfmt,
                                           zero_copy, async_finish, return_recv_hook, out,
                                           combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle: Any) -> torch.Tensor:
        """deepep.Buffer.get_next_low_latency_combine_buffer, taking a LowLatencyHandle."""
        return super().get_next_low_latency_combine_buffer(_unwrap(handle))

    # ---- enable_shrink's mask buffer (DeepEP's names over deepep's masks) ----

    def _shrink(self, call: str) -> None:
        # DeepEP's host assert, which its binding raises as RuntimeError.
        if not self.enable_shrink:
            raise RuntimeError(f"{call}: the mask buffer needs Buffer(..., enable_shrink=True), "
                               "as DeepEP's")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """DeepEP's: mask (mask=True) or unmask rank_to_mask, so that dispatch and combine,
        in both modes here (DeepEP's in low-latency mode), neither send to it nor receive
        from it: its experts' (token, k) pairs are dropped and contribute zero.  Every rank
        must make the same updates.  Needs enable_shrink=True."""
        self._shrink("low_latency_update_mask_buffer")
        self.update_mask(rank_to_mask, bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """DeepEP's: mask_status ([num_ranks] torch.int) gets 1 for each masked rank (by
        low_latency_update_mask_buffer, or by deepepd for a gone rank of an elastic job),
        0 for the others.  Needs enable_shrink=True."""
        self._shrink("low_latency_query_mask_buffer")
        if not isinstance(mask_status, torch.Tensor):
            raise TypeError("low_latency_query_mask_buffer: mask_status must be a tensor, not "
                            f"{type(mask_status).__name__}")
        if mask_status.dim() != 1 or mask_status.size(0) != self.group_size:
            raise ValueError("low_latency_query_mask_buffer: mask_status must be [num_ranks] "
                             f"([{self.group_size}]), not {list(mask_status.shape)}")
        m, _ = self.mask()
        mask_status.copy_(m.to(mask_status.dtype))

    def low_latency_clean_mask_buffer(self) -> None:
        """DeepEP's: unmask every rank this rank masked (deepepd's live mask of a gone rank
        stays).  Needs enable_shrink=True."""
        self._shrink("low_latency_clean_mask_buffer")
        self.clear_mask()

    def dropped(self, handle: Any) -> int:
        """deepep.Buffer.dropped, taking a DispatchHandle or LowLatencyHandle."""
        return super().dropped(_unwrap(handle))

    def combine(self, x: torch.Tensor, handle: Any, topk_weights: Optional[torch.Tensor] = None,
                bias: Any = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """deepep.Buffer.combine, taking dispatch's DispatchHandle (topk_weights of any width up
        to the Buffer's: _widen_topk)."""
        k = topk_weights.size(1) if isinstance(topk_weights, torch.Tensor) and \
            topk_weights.dim() == 2 else None
        w = topk_weights
        if k is not None and self.num_topk is not None and k < self.num_topk:
            w = torch.zeros((topk_weights.size(0), self.num_topk), dtype=topk_weights.dtype,
                            device=topk_weights.device)
            w[:, :k] = topk_weights
        out, out_w, ev = super().combine(x, _unwrap(handle), w, bias, config, previous_event,
                                         async_finish, allocate_on_comm_stream)
        if w is not topk_weights:
            out_w = out_w[:, :k].contiguous()
        return out, out_w, ev

    def internode_dispatch(self, x: Any, handle: Any = None, num_tokens_per_rank: Any = None,
                           num_tokens_per_rdma_rank: Any = None, is_token_in_rank: Any = None,
                           num_tokens_per_expert: Any = None, topk_idx: Any = None,
                           topk_weights: Any = None, expert_alignment: int = 1,
                           config: Optional[Config] = None,
                           previous_event: Optional[EventOverlap] = None,
                           async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's internode_dispatch, with its signature (no num_worst_tokens; config follows
        expert_alignment): dispatch's rows (deepepd moves the blocks between nodes, whatever
        the topology) with DeepEP's internode handle, an InternodeHandle, on one node too (a
        node of every rank, as DeepEP's there).  config may be None (DeepEP asserts it is
        not).  ValueError where the node of each rank is not known (a world of uneven nodes
        from the environment: give the Buffer its group)."""
        nodes = self.identity.node_of() if handle is None else None
        if handle is None and nodes is None:
            raise ValueError("internode_dispatch: the node of each rank is not known (world "
                             f"{self.identity.world_size} is not whole nodes of "
                             f"{self.identity.local_world_size} ranks); give the Buffer its "
                             "group, whose members say their hosts")
        return self._dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                              is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                              expert_alignment, 0, config, previous_event, async_finish,
                              allocate_on_comm_stream, nodes)

    def internode_combine(self, x: torch.Tensor, handle: Any,
                          topk_weights: Optional[torch.Tensor] = None, bias: Any = None,
                          config: Optional[Config] = None,
                          previous_event: Optional[EventOverlap] = None,
                          async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's internode_combine (the same signature as combine): combine itself, taking
        the handle of dispatch or internode_dispatch (an InternodeHandle or a
        DispatchHandle)."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)


def _deepep_fp8(recv: Any, requant: bool, ue8m0: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's (values, column-major scales) from what deepepd's low-latency dispatch
    received: (values, row-major float32 scales) as they are, or bf16 rows to quantise with
    scales rounded to powers of two (requant), their exponents packed when ue8m0."""
    if not requant:
        values, scales = recv
        return values, _fp8.column_major(scales)
    q, e = _fp8.quantise_rounded(recv)
    return q.view(fp8_dtype), _fp8.column_major(_fp8.scales_of(e, ue8m0))


def _padded_scales(x: Any):
    """dispatch's x with the FP8 scales deepepd moves (float32 [num_tokens, hidden // 128]),
    and the function that gives the received scales back the caller's form, or None where x
    needs no change.  Scales of another form (int32, as DeepEP's packed UE8M0, or one per
    token) are stored bit for bit in the first columns of such a tensor (the rest zero): the
    library moves scales as bytes, so they arrive as they were sent."""
    if type(x) is torch.Tensor or not isinstance(x, (tuple, list)) or len(x) != 2:
        return x, None
    values, scales = x
    if not isinstance(values, torch.Tensor) or not isinstance(scales, torch.Tensor) or \
            values.dim() != 2 or (scales.dtype is torch.float32 and scales.dim() == 2):
        return x, None  # deepep.Buffer.dispatch takes (or names what is wrong with) these
    n, groups = values.size(0), values.size(1) // _fp8.GROUP
    if scales.dtype not in (torch.float32, torch.int32) or scales.dim() not in (1, 2):
        raise TypeError(f"dispatch: FP8 scales of dtype {scales.dtype} and {scales.dim()} "
                        "dimensions; give float32 or int32 (UE8M0), [num_tokens, groups] or "
                        "[num_tokens]")
    width = 1 if scales.dim() == 1 else scales.size(1)
    if scales.size(0) != n or width > groups:
        raise ValueError(f"dispatch: FP8 scales have shape {tuple(scales.shape)}; expected "
                         f"{n} rows of at most {groups} (hidden // {_fp8.GROUP}) scales")
    words = torch.zeros((n, groups), dtype=torch.int32, device=scales.device)
    words[:, :width] = scales.reshape(n, width).contiguous().view(torch.int32)
    dtype, one_d = scales.dtype, scales.dim() == 1

    def unpad(recv_x: Any) -> Any:
        rv, rs = recv_x
        rs = rs.view(torch.int32)[:, :width].contiguous().view(dtype)
        return rv, rs.view(-1) if one_d else rs

    return (values, words.view(torch.float32)), unpad


def _unwrap(handle: Any) -> Any:
    return handle.handle if isinstance(handle, (DispatchHandle, InternodeHandle,
                                                LowLatencyHandle)) else handle


def _channels(buf: "Buffer", n: int, config: Optional[Config]) -> Tuple[int, torch.Tensor]:
    """DeepEP's channels of a dispatch of n tokens: C = config.num_sms // 2 of them, token t
    in channel t // ceil(n / C); (C, each token's channel)."""
    C = max((config or buf.get_dispatch_config(buf.group_size)).num_sms // 2, 1)
    per = max(-(-n // C), 1)  # ceil(n / C): DeepEP's tokens per channel
    return C, torch.arange(n, device=buf.device) // per


def _sent(goes: torch.Tensor, C: int, channel: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The sender's tables of a [n, D] bool `goes` (token t goes to destination d):
    ([D, C] int32, per destination the running sum over channels of the tokens sent there;
    [n, D] int32, -1 where t does not go to d, else its place among the tokens sent to d)."""
    i32 = torch.int32
    n, D = goes.shape
    sent = torch.zeros((D, C), dtype=i32, device=goes.device)
    if n:
        sent.index_add_(1, channel, goes.t().to(i32))
    head = torch.where(goes, goes.to(i32).cumsum(0).to(i32) - 1,
                       torch.full((n, D), -1, dtype=i32, device=goes.device))
    return sent.cumsum(1).to(i32), head


def _in_rank(buf: "Buffer", topk_idx: Optional[torch.Tensor],
             is_token_in_rank: Optional[torch.Tensor]) -> torch.Tensor:
    """The dispatch's [n, R] bool token-in-rank: the argument, or computed from topk_idx."""
    if is_token_in_rank is None:
        return _token_in_rank(topk_idx.to(buf.device).long(), buf.num_experts, buf.group_size)
    return is_token_in_rank.to(buf.device, torch.bool)


class DispatchHandle(tuple):
    """DeepEP's intranode dispatch handle, (rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head), int32 tensors
    (is_token_in_rank bool) on the Buffer's device, with deepepd's deepep.Handle as
    `.handle` (what combine and cached dispatches use).  With R ranks, n tokens sent,
    `rows` received and C = config.num_sms // 2 channels (DeepEP's):

    - rank_prefix_matrix [R, R]: column `rank` is DeepEP's, the running sum over source
      ranks of the rows received from each (the rows are contiguous by source: DeepEP's
      tests read rank_prefix_matrix[i][rank] as the end of source i's rows); the other
      columns, what other ranks received, are not known here: -1.  After a dispatch with
      num_worst_tokens on cuda (whose counts stay on the device) column `rank` is -1 too.
    - channel_prefix_matrix [R, C]: DeepEP's: per destination, the running sum over channels
      of the tokens sent there, token t being in channel t // ceil(n / C).
    - recv_channel_prefix_matrix [R, C], recv_src_idx [rows]: their shapes (recv_src_idx's
      length is the rows received, as DeepEP's), values -1: which source token each row
      is, and the senders' channels, are not known on the receiving rank.
    - is_token_in_rank [n, R]: DeepEP's (the argument, or computed from topk_idx).
    - send_head [n, R]: -1 where token t does not go to rank r, else its place among the
      tokens this rank sends r (DeepEP's is a slot of its channel ring buffers).
    """

    handle: "_deepep.Handle"

    @classmethod
    def made(cls, buf: "Buffer", h: "_deepep.Handle", topk_idx: Optional[torch.Tensor],
             is_token_in_rank: Optional[torch.Tensor], rows: int,
             config: Optional[Config]) -> "DispatchHandle":
        R, dev, n = buf.group_size, buf.device, h.num_tokens
        in_rank = _in_rank(buf, topk_idx, is_token_in_rank)
        i32 = torch.int32
        prefix = torch.full((R, R), -1, dtype=i32, device=dev)
        counts = buf.recv_from(h)
        if counts is not None:
            prefix[:, buf.rank] = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(dev, i32)
        C, channel = _channels(buf, n, config)
        chan_prefix, head = _sent(in_rank, C, channel)
        t = cls((prefix, chan_prefix, torch.full((R, C), -1, dtype=i32, device=dev),
                 torch.full((rows,), -1, dtype=i32, device=dev), in_rank, head))
        t.handle = h
        return t


class InternodeHandle(tuple):
    """DeepEP's internode dispatch handle, (is_token_in_rank, rdma_channel_prefix_matrix,
    gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum,
    recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta,
    send_rdma_head, send_nvl_head), with DeepEP's shapes and dtypes on the Buffer's device,
    and deepepd's deepep.Handle as `.handle` (what combine and cached dispatches use).
    DeepEP's RDMA ranks are nodes here (Identity.node_of: the group's hosts, else node by
    node).  With R ranks on N nodes, n tokens sent, `rows` received and C channels
    (DispatchHandle's), what the receiving rank knows, and -1 for what it does not:

    - is_token_in_rank [n, R] bool: DeepEP's (the argument, or computed from topk_idx).
    - rdma_channel_prefix_matrix [N, C], gbl_channel_prefix_matrix [R, C] int32: DeepEP's,
      per destination node (rank) the running sum over channels of the tokens sent there.
    - recv_rdma_channel_prefix_matrix [N, C], recv_rdma_rank_prefix_sum [N],
      recv_gbl_channel_prefix_matrix [R, C] int32: -1.  DeepEP's count what the node's
      RDMA buffer took in and the senders' channels; deepepd moves rows from each rank
      straight to its destination, so no rank forwards another's and none is known here.
    - recv_gbl_rank_prefix_sum [R] int32: DeepEP's, the running sum over source ranks of
      the rows received from each (contiguous by source: rows recv_gbl_rank_prefix_sum[i - 1]
      .. recv_gbl_rank_prefix_sum[i] - 1 came from rank i, the last entry is `rows`); -1 after
      a dispatch with num_worst_tokens on cuda (its counts stay on the device).
    - recv_src_meta [rows, 8] uint8: DeepEP's SourceMeta per row, two int32: the source
      rank's node (DeepEP's src_rdma_rank), then -1 for its is_token_in_nvl_rank_bits (which
      other ranks of this node took the token is not known here); all -1 where the counts
      are not known (num_worst_tokens on cuda).
    - send_rdma_head [n, N] int32: -1 where token t goes to no rank of node m, else its place
      among the tokens this rank sends node m (DeepEP's is a slot of its RDMA ring buffer).
    - send_nvl_head [rows, NUM_MAX_NVL_PEERS] int32: -1 (DeepEP's is the forwarder's NVLink
      ring slots, [tokens its RDMA buffer took in, 8]; deepepd forwards nothing).
    """

    handle: "_deepep.Handle"

    @classmethod
    def made(cls, buf: "Buffer", h: "_deepep.Handle", topk_idx: Optional[torch.Tensor],
             is_token_in_rank: Optional[torch.Tensor], rows: int, config: Optional[Config],
             nodes: Tuple[int, ...]) -> "InternodeHandle":
        R, dev, n = buf.group_size, buf.device, h.num_tokens
        i32 = torch.int32
        node = torch.tensor(nodes, dtype=torch.int64, device=dev)
        N = max(nodes) + 1
        in_rank = _in_rank(buf, topk_idx, is_token_in_rank)
        in_node = torch.zeros((n, N), dtype=i32, device=dev)
        in_node.index_add_(1, node, in_rank.to(i32))
        C, channel = _channels(buf, n, config)
        rdma_prefix, rdma_head = _sent(in_node > 0, C, channel)
        gbl_prefix, _ = _sent(in_rank, C, channel)
        recv_prefix = torch.full((R,), -1, dtype=i32, device=dev)
        meta = torch.full((rows, 2), -1, dtype=i32, device=dev)
        counts = buf.recv_from(h)
        if counts is not None:
            per = torch.tensor(counts, dtype=torch.int64)
            recv_prefix = per.cumsum(0).to(dev, i32)
            meta[:, 0] = torch.repeat_interleave(node, per.to(dev))[:rows].to(i32)
        t = cls((in_rank, rdma_prefix, gbl_prefix,
                 torch.full((N, C), -1, dtype=i32, device=dev),
                 torch.full((N,), -1, dtype=i32, device=dev),
                 torch.full((R, C), -1, dtype=i32, device=dev), recv_prefix,
                 meta.view(torch.uint8), rdma_head,
                 torch.full((rows, NUM_MAX_NVL_PEERS), -1, dtype=i32, device=dev)))
        t.handle = h
        return t


#: DeepEP's ranks per node (its NUM_MAX_NVL_PEERS): send_nvl_head's width.
NUM_MAX_NVL_PEERS = 8


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle, (src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts), with deepepd's deepep.Handle as `.handle` (what
    low_latency_combine and get_next_low_latency_combine_buffer use).  With L local experts
    and R ranks:

    - src_info [L, R * num_max_dispatch_tokens_per_rank] int32: DeepEP's, the index of each
      row's token among its source rank's tokens; -1 past recv_count (DeepEP's are left
      unwritten there).
    - layout_range [L, R] int64: DeepEP's, (begin << 32) | count of each expert's rows from
      each source rank; since deepepd packs them in (source rank, source token) order, begin
      is the running sum of the counts (and where a source with none would begin).

    Both are made the first time the handle is indexed or unpacked
    (deepep.Buffer.low_latency_handle_info: on cuda a kernel on the current stream, which
    must come after the dispatch, as DeepEP's tests wait for it before they read them) and
    kept.  A caller that only passes the handle back, as a trainer or server does, so pays
    no kernel and no allocation per dispatch; with return_recv_hook, index it after the
    hook.  The tuple's own slots 0 and 1 hold None until then: read them by index or by
    unpacking, which this class serves, not through tuple's C-level methods.
    """

    handle: "_deepep.Handle"

    def __new__(cls, h: "_deepep.Handle", num_max_dispatch_tokens_per_rank: int, hidden: int,
                num_experts: int) -> "LowLatencyHandle":
        t = super().__new__(cls, (None, None, num_max_dispatch_tokens_per_rank, hidden,
                                  num_experts))
        t.handle = h
        t._info = None
        return t

    def _made(self) -> Tuple[torch.Tensor, torch.Tensor]:
        info = self._info
        if info is None:
            buf = self.handle._buffer()
            if buf is None:
                raise ValueError("low-latency handle: its Buffer was destroyed before "
                                 "src_info and layout_range were read")
            info = self._info = buf.low_latency_handle_info(self.handle)
        return info

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self)[i]
        j = operator.index(i)
        if j in (0, 1, -5, -4):
            return self._made()[j % 5]
        return tuple.__getitem__(self, j)

    def __iter__(self) -> Iterator[Any]:
        yield from self._made()
        yield from tuple.__getitem__(self, slice(2, None))

    def __getnewargs__(self) -> tuple:
        # copy.copy rebuilds a tuple subclass through __new__ with these (its state, the
        # handle and the tables if made, follows in __dict__).
        return (self.handle,) + tuple.__getitem__(self, slice(2, None))

    def __repr__(self) -> str:
        return (f"LowLatencyHandle(src_info, layout_range, {tuple.__getitem__(self, 2)}, "
                f"{tuple.__getitem__(self, 3)}, {tuple.__getitem__(self, 4)})")


_DEEPEP_KWARGS = ("job_id", "rank", "world_size", "local_rank", "local_world_size", "socket",
                  "hidden", "num_experts", "num_topk", "max_tokens_per_rank",
                  "max_ll_tokens_per_rank")

__all__ = ["Buffer", "Config", "DispatchHandle", "EventHandle", "EventOverlap",
           "InternodeHandle", "LowLatencyHandle", "Unsupported", "topk_idx_t"]
