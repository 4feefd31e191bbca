"""Buffer's low-latency mode: DeepEP's low_latency_dispatch and low_latency_combine over
dep_ll_dispatch and dep_ll_combine, with their receive hooks, where a dispatch's rows came
from (dep_ll_handle_info), and the buffer a zero-copy combine reads (buffer.py's Buffer
takes them as the _LowLatency mixin).  Of the Buffer it uses the job's shape and argument
structs (_prepare), its checks (_checks.py), streams, events and handles."""
from __future__ import annotations

import ctypes
from typing import Any, Optional, Tuple

import torch

from . import _lib
from ._checks import _BF16, _F32, _I32, _INDEX_TYPES, _Tensor, _empty_like, _ok
from .errors import Error, Unsupported
from .event import EventOverlap
from .handle import Handle, _capturing


def _no_hook() -> None:
    """The receive hook of a call made without return_recv_hook (it has received)."""


class _LowLatency:
    """DeepEP's low-latency operations (a mixin of Buffer)."""

    def _low_latency_begin(self, op: str, async_finish: bool, return_recv_hook: bool) -> None:
        """What both low-latency calls do first: async_finish with a hook is refused (DeepEP's
        rule: the hook receives, so there is no event to wait for)."""
        if async_finish and return_recv_hook:
            raise ValueError(f"{op}: async_finish and return_recv_hook cannot both be set "
                             "(DeepEP's rule): the hook receives, so there is no event to "
                             "wait for")

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Low-latency dispatch into a fixed-shape buffer per local expert.

        On cuda it never waits on the host, so it (and its low_latency_combine) can be captured
        in a CUDA graph, as many calls in one graph as the model makes, with no call needed
        before the capture (the handle's device arrays then come from the graph's pool).

        Args:
            x: [num_tokens, hidden] bfloat16, num_tokens <= num_max_dispatch_tokens_per_rank.
            topk_idx: [num_tokens, num_topk] int64 (or int32), -1 for none.
            num_max_dispatch_tokens_per_rank: must equal the Buffer's max_ll_tokens_per_rank.
            num_experts: experts in the job.
            cumulative_local_expert_recv_stats: optional [num_local_experts] int32, to which
                the counts received are added.
            dispatch_wait_recv_cost_stats: optional [world_size] int64 (DeepEP's), to which
                each receive adds the time it waited for each source rank: nanoseconds on the
                host backend, the GPU's clock64 cycles on cuda.
            use_fp8: cast to e4m3 with one float32 scale per token and 128 channels
                (scale = max(amax, 1e-4) / 448).
            round_scale, use_ue8m0: must be False (not supported yet).
            async_finish: return an event recorded after the call (cuda).
            return_recv_hook: defer the receive to the hook the call returns (DeepEP's), so
                that the caller can compute between.  The call sends (the rows leave: the
                caller may write x and topk_idx once it returns; on cuda a kernel on the
                current stream, which returns without waiting) and hook() receives (recv_x,
                recv_count and the stats are written then; on cuda a second kernel, on the
                stream current then), so on cuda a hooked call is two kernels, both
                deepepd::ll::dispatch; the peers receive this rank's rows whether or not its
                hook has run.  At most two calls may be between send and hook, as DeepEP's
                two buffers allow (a third call raises InvalidArgument: call a hook first).
                Not with async_finish (ValueError, as DeepEP asserts).

        Returns:
            recv_x: [num_local_experts, world_size * max, hidden] bfloat16, or with use_fp8 a
                tuple (values [.., hidden] fp8_dtype, scales [.., hidden // 128] float32 in
                row-major order, unlike DeepEP's column-major scales).  Rows of each local
                expert are packed from row 0 in (source rank, source token) order.
            recv_count: [num_local_experts] int32 valid rows.
            handle: for the matching low_latency_combine (low_latency_handle_info says
                where each row came from).
            event: an EventOverlap.
            hook: with return_recv_hook, the callable that receives; else one that does
                nothing.
        """
        op = "low_latency_dispatch"
        self._low_latency_begin(op, async_finish, return_recv_hook)
        x, idx, itype = self._ll_dispatch_inputs(x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                 num_experts, round_scale, use_ue8m0)
        n = x.size(0)
        stats = self._ll_recv_stats(cumulative_local_expert_recv_stats)
        cost = self._wait_cost("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats)
        fp8 = bool(use_fp8)
        recv_x, scales, count = self._ll_outputs(fp8)
        cs = None if self._host else self._stream()
        h = Handle(self, "low_latency_dispatch", n, stream=cs)
        out_x = (recv_x, scales) if fp8 else recv_x
        if return_recv_hook:
            return out_x, count, h, EventOverlap(None), self._ll_dispatch_hooked(
                x, idx, itype, n, fp8, recv_x, scales, count, h, stats, cost)
        self._ll_dispatch_now(x, idx, itype, n, fp8, recv_x, scales, count, h, stats, cs,
                              cost=cost)
        return (out_x, count, h,
                self._event(None, async_finish) if async_finish else EventOverlap(None), _no_hook)

    def _ll_dispatch_hooked(self, x: torch.Tensor, idx: torch.Tensor, itype: int, n: int,
                            fp8: bool, recv_x: torch.Tensor, scales: Optional[torch.Tensor],
                            count: torch.Tensor, h: Handle, stats: Optional[torch.Tensor],
                            cost: Optional[int]) -> Any:
        """low_latency_dispatch with return_recv_hook: the library sends now and receives in
        the hook (DEP_LL_SEND, DEP_LL_RECV), each on the stream current then (on cuda).  The
        hook."""
        h._unreceived = True  # low_latency_handle_info waits for the hook
        self._ll_dispatch_now(x, idx, itype, n, fp8, recv_x, scales, count, h, None,
                              phases=_lib.LL_SEND)

        def receive() -> None:
            self._ll_dispatch_now(x, idx, itype, n, fp8, recv_x, scales, count, h, stats,
                                  phases=_lib.LL_RECV, cost=cost)
            h._unreceived = False

        return self._split_hook(receive)

    def _ll_dispatch_inputs(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: Any,
                            num_experts: Any, round_scale: Any, use_ue8m0: Any
                            ) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """low_latency_dispatch's arguments checked, what is not supported first, then the
        ints, the tensors (made contiguous) and their sizes against the job's shape (a first
        call gives it hidden) and the Buffer's bound: (x, topk_idx, index type)."""
        op = "low_latency_dispatch"
        if round_scale or use_ue8m0:
            raise Unsupported("low_latency_dispatch(round_scale=True / use_ue8m0=True)",
                              "scales are plain float32")
        if type(num_max_dispatch_tokens_per_rank) is not int or type(num_experts) is not int:
            for name, v in (("num_max_dispatch_tokens_per_rank",
                             num_max_dispatch_tokens_per_rank), ("num_experts", num_experts)):
                if not isinstance(v, int) or isinstance(v, bool):
                    raise TypeError(f"{name} must be an int, not {type(v).__name__}")
        dev = self.device
        itype = _INDEX_TYPES.get(topk_idx.dtype) if type(topk_idx) is _Tensor else None
        if itype is not None and type(x) is _Tensor and x.dtype is torch.bfloat16:
            xs, ks = x.shape, topk_idx.shape
            usual = len(xs) == 2 and len(ks) == 2 and ks[0] == xs[0] and x.device == dev and \
                topk_idx.device == dev
        else:
            usual = False
        if usual:
            x, idx = x.contiguous(), topk_idx.contiguous()
        else:
            x = self._input("x", x, _BF16, 2)
            idx, itype = self._topk(op, topk_idx, x.size(0))
            xs, ks = x.shape, idx.shape
        n, hx = xs
        if not self.attached or hx != self.hidden or ks[1] != self.num_topk or \
                num_experts != self.num_experts or \
                num_max_dispatch_tokens_per_rank != self.max_ll_tokens_per_rank:
            self._shape(op, hx, num_experts, ks[1], num_max_dispatch_tokens_per_rank)
        if n > self.max_ll_tokens_per_rank:
            self._tokens_fit(op, n, self.max_ll_tokens_per_rank,
                             "num_max_dispatch_tokens_per_rank")
        return x, idx, itype

    def _ll_recv_stats(self, cumulative_local_expert_recv_stats: Any
                       ) -> Optional[torch.Tensor]:
        """low_latency_dispatch's cumulative_local_expert_recv_stats checked: the counts are
        added to the caller's own tensor, so it must be that tensor (contiguous), not a copy."""
        if cumulative_local_expert_recv_stats is None:
            return None
        stats = self._input("cumulative_local_expert_recv_stats",
                            cumulative_local_expert_recv_stats, _I32, 1)
        if stats.numel() != self.num_local_experts or \
                stats.data_ptr() != cumulative_local_expert_recv_stats.data_ptr():
            raise ValueError("cumulative_local_expert_recv_stats must be a contiguous "
                             f"[{self.num_local_experts}] int32 tensor")
        return stats

    def _wait_cost(self, name: str, t: Any) -> Optional[int]:
        """A *_wait_recv_cost_stats argument checked: None, or the caller's own contiguous
        [world_size] int64 tensor on the Buffer's device (the library adds to it, so not a
        copy); its address."""
        if t is None:
            return None
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1 or \
                t.numel() != self.group_size or not t.is_contiguous() or t.device != self.device:
            raise ValueError(f"{name} must be a contiguous [{self.group_size}] int64 tensor on "
                             f"{self.device}")
        return t.data_ptr()

    def _ll_outputs(self, fp8: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor],
                                              torch.Tensor]:
        """low_latency_dispatch's outputs (recv_x, recv scales or None, recv_count), from
        prototypes kept per FP8 setting (the shapes are the job's)."""
        pr = self._ll_protos[fp8]
        if pr is None:
            pr = self._ll_prototypes(fp8)
        recv_x, count = _empty_like(pr[0]), _empty_like(pr[2])
        return recv_x, _empty_like(pr[1]) if fp8 else None, count

    def _ll_dispatch_now(self, x: torch.Tensor, idx: torch.Tensor, itype: int, n: int,
                         fp8: bool, recv_x: torch.Tensor, scales: Optional[torch.Tensor],
                         count: torch.Tensor, h: Handle, stats: Optional[torch.Tensor],
                         cs: Any = False, phases: int = 0, cost: Optional[int] = None) -> None:
        """dep_ll_dispatch of checked inputs into the outputs given, on stream cs (False: the
        current stream, looked up now, as a deferred call's hook does: the handle's arrays
        are then used on that stream, which may not be the call's, and maybe in a capture
        the call was not in, so it is noted as a combine's is); phases as the library's
        (0: the whole call; the stats count what a call that receives received); cost: the
        wait counters' address (dispatch_wait_recv_cost_stats) or None."""
        if cs is False:
            cs = None
            if not self._host:
                cs = self._stream()
                self._use(h, cs, _capturing())
        a = self._lla
        if n:
            a.x, a.topk_idx = x.data_ptr(), idx.data_ptr()
        else:
            a.x = a.topk_idx = None
        a.index_type, a.num_tokens, a.use_fp8 = itype, n, int(fp8)
        a.recv_x, a.recv_count = recv_x.data_ptr(), count.data_ptr()
        a.recv_scales = scales.data_ptr() if fp8 else None
        a.phases, a.wait_cost = phases, cost
        rc = self._fn_ll_dispatch(self._conn.ptr, self._lla_ref, h._ptr, cs)
        if rc:
            self._fail(rc, "dep_ll_dispatch")
        if stats is not None:
            stats += count

    def low_latency_handle_info(self, handle: Handle) -> Tuple[torch.Tensor, torch.Tensor]:
        """Where each row of a low_latency_dispatch came from, as DeepEP's low-latency handle
        holds it (its handle[0] and handle[1]; dep_ll_handle_info).  The rows of each local
        expert are in (source rank, source token) order, so each source's rows are one range.

        Args:
            handle: a low_latency_dispatch's handle; with return_recv_hook, once its hook ran
                (the rows are not there before: ValueError).

        Returns:
            src_info: [num_local_experts, world_size * max_ll_tokens_per_rank] int32: for
                each row, the index of its token among its source rank's tokens (that rank's
                x); -1 in the rows past recv_count.
            layout_range: [num_local_experts, world_size] int64: for each source rank,
                (begin << 32) | count, the expert's rows begin .. begin + count - 1 from it
                (DeepEP's packing; begin is where they would start when count is 0).
            New tensors on the Buffer's device, on cuda written by a kernel queued on the
            current stream (which must come after the dispatch, as for low_latency_combine);
            the handle is only read.
        """
        op = "low_latency_handle_info"
        h = self._handle(op, handle, "low_latency_dispatch")
        if getattr(h, "_unreceived", False):
            raise ValueError(f"{op}: the dispatch was made with return_recv_hook and its hook "
                             "has not run, so it has received nothing yet; call the hook first")
        src = self._new((self.num_local_experts, self._ll_rows), torch.int32)
        rng = self._new((self.num_local_experts, self.group_size), torch.int64)
        a = _lib.LLHandleInfoArgs(src.data_ptr(), rng.data_ptr())
        cs = None
        if not self._host:
            cs = self._stream()
            self._use(h, cs, _capturing())
        rc = self._conn.lib.dep_ll_handle_info(self._conn.ptr, ctypes.byref(a), h._ptr, cs)
        if rc:
            self._fail(rc, "dep_ll_handle_info")
        return src, rng

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: Handle,
                            use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """Low-latency combine: out[t] = sum_k topk_weights[t, k] * (its k-th expert's row).

        Args:
            x: [num_local_experts, world_size * max, hidden] bfloat16 expert outputs.
            topk_idx: the matching dispatch's (the library checks it is the same).
            topk_weights: [num_tokens, num_topk] float32.
            handle: the matching low_latency_dispatch's; kept by the Buffer until destroy()
                where the call is captured in a CUDA graph (as combine's).
            use_logfmt: must be False.
            combine_wait_recv_cost_stats: as low_latency_dispatch's
                dispatch_wait_recv_cost_stats, for the combine's receive.
            zero_copy: read the input from get_next_low_latency_combine_buffer's tensor
                (which the caller has written) instead of x (still checked for its shape).
            async_finish, return_recv_hook: as for low_latency_dispatch.  With the hook
                the call sends x (or the zero-copy buffer), which the caller may write once
                it returns; hook() receives and combines, reading topk_idx and topk_weights
                then (as DeepEP's receive does), and writes combined_x (on cuda: two kernels,
                both deepepd::ll::combine, each on the stream current at its call).
            out: optional [num_tokens, hidden] bfloat16 to write into.

        Returns:
            combined_x: [num_tokens, hidden] bfloat16 (out, where given).
            event: an EventOverlap.
            hook: with return_recv_hook, the callable that receives; else one that does
                nothing.
        """
        op = "low_latency_combine"
        self._low_latency_begin(op, async_finish, return_recv_hook)
        if use_logfmt:
            raise Unsupported("low_latency_combine(use_logfmt=True)")
        cost = self._wait_cost("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats)
        h = self._handle(op, handle, "low_latency_dispatch")
        nt, dev = h.num_tokens, self.device
        want = (self.num_local_experts, self._ll_rows, self.hidden)
        if zero_copy:
            # DeepEP's zero copy: the input is what the caller wrote into the combine buffer
            # (x is still checked as the call's input, as DeepEP's).
            if self._ll_combine_buf is None:
                raise ValueError(f"{op}: zero_copy=True but get_next_low_latency_combine_buffer "
                                 "was never called; write the input there first")
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
                raise ValueError(f"{op}: x has shape "
                                 f"{tuple(x.shape) if isinstance(x, torch.Tensor) else None}; "
                                 f"expected {want}")
            x = self._ll_combine_buf
        itype = _INDEX_TYPES.get(topk_idx.dtype) if type(topk_idx) is _Tensor else None
        if itype is not None and _ok(x, torch.bfloat16, 3, dev) and x.shape == want and \
                topk_idx.dim() == 2 and topk_idx.device == dev and topk_idx.size(0) == nt and \
                _ok(topk_weights, torch.float32, 2, dev):
            x, idx, w = x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous()
        else:
            x = self._input("x", x, _BF16, 3)
            if x.shape != want:
                raise ValueError(f"{op}: x has shape {tuple(x.shape)}; expected {want}")
            idx, itype = self._topk(op, topk_idx, nt)
            w = self._input("topk_weights", topk_weights, _F32, 2)
        if w.shape != idx.shape:
            raise ValueError(f"{op}: topk_weights has shape {tuple(w.shape)} but topk_idx "
                             f"{tuple(idx.shape)}")
        if out is None:
            out = self._new((nt, self.hidden), torch.bfloat16)
        else:
            o = self._input("out", out, _BF16, 2)
            if o.data_ptr() != out.data_ptr() or o.shape != (nt, self.hidden):
                raise ValueError(f"{op}: out must be a contiguous "
                                 f"[{nt}, {self.hidden}] bfloat16 tensor")
        if return_recv_hook:
            # The library sends now and receives in the hook (DEP_LL_SEND, DEP_LL_RECV).
            self._ll_combine_now(x, idx, itype, w, out, nt, h, _lib.LL_SEND)
            return out, EventOverlap(None), self._split_hook(
                lambda: self._ll_combine_now(x, idx, itype, w, out, nt, h, _lib.LL_RECV, cost))
        self._ll_combine_now(x, idx, itype, w, out, nt, h, cost=cost)
        return out, self._event(None, async_finish) if async_finish else EventOverlap(None), \
            _no_hook

    def _ll_combine_now(self, x: torch.Tensor, idx: torch.Tensor, itype: int,
                        w: torch.Tensor, out: torch.Tensor, nt: int, h: Handle,
                        phases: int = 0, cost: Optional[int] = None) -> None:
        """dep_ll_combine of checked inputs into out, on the current stream; phases as the
        library's (0: the whole call); cost: combine_wait_recv_cost_stats's address or None."""
        a = self._llca
        a.x = x.data_ptr()
        if nt:
            a.topk_idx, a.topk_weights, a.out = idx.data_ptr(), w.data_ptr(), out.data_ptr()
        else:
            a.topk_idx = a.topk_weights = a.out = None
        a.index_type, a.phases, a.wait_cost = itype, phases, cost
        cs = None
        if not self._host:
            cs = self._stream()
            self._use(h, cs, _capturing())
        rc = self._fn_ll_combine(self._conn.ptr, self._llca_ref, h._ptr, cs)
        if rc:
            self._fail(rc, "dep_ll_combine")

    def _split_hook(self, receive: Any) -> Any:
        """The hook of a call whose send the library has made: it receives once (a second
        call does nothing); after destroy() the receive is gone with the connection."""
        state = {"done": False}

        def hook() -> None:
            if state["done"]:
                return
            if self._conn is None or not self.attached:
                raise Error(-17, "this Buffer was destroyed before the hook ran; its call "
                            "never received", "hook")
            state["done"] = True
            receive()
        return hook

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """DeepEP's clean before low-latency calls that follow throughput ones: nothing to do
        here (the library keeps its state per operation), but the shape is checked."""
        self._shape("clean_low_latency_buffer", hidden, num_experts, None,
                    num_max_dispatch_tokens_per_rank)

    def get_next_low_latency_combine_buffer(self, handle: Handle) -> torch.Tensor:
        """The tensor a zero-copy low_latency_combine reads its input from (DeepEP's): write
        the experts' outputs into it, then call low_latency_combine(..., zero_copy=True).

        Args:
            handle: the low_latency_dispatch's handle whose combine comes next.

        Returns:
            [num_local_experts, world_size * max_ll_tokens_per_rank, hidden] bfloat16 on the
            Buffer's device: one tensor per Buffer, made at the first call and returned again
            at every later one (DeepEP alternates two; here the combine reads it on the
            caller's stream, so one serves as long as the caller writes it on that stream).
        """
        self._handle("get_next_low_latency_combine_buffer", handle, "low_latency_dispatch")
        buf = self._ll_combine_buf
        if buf is None:
            buf = self._ll_combine_buf = self._empty(
                (self.num_local_experts, self._ll_rows, self.hidden), torch.bfloat16)
        return buf
