"""Buffer's throughput mode: DeepEP's get_dispatch_layout, dispatch and combine over
dep_layout, dep_dispatch and dep_combine (buffer.py's Buffer takes them as the
_Throughput mixin).  Of the Buffer it uses the job's shape and argument structs
(_prepare), its checks (_checks.py), streams, events and handles."""
from __future__ import annotations

import ctypes
from typing import Any, Optional, Tuple, Union

import torch

from . import _lib
from ._checks import (_ALIGN_MAX, _BF16, _F32, _FP8_GROUP, _INDEX_TYPES, _Tensor, _empty_like,
                      _ok, fp8_dtype)
from .config import Config
from .errors import Error, InvalidArgument, Unsupported
from .event import EventOverlap
from .handle import Handle, _capturing


def _token_in_rank(idx: torch.Tensor, num_experts: int, world: int) -> torch.Tensor:
    """[num_tokens, world] bool: whether rank r owns one of token t's experts (int64 ids,
    -1 for none; expert e is rank e // (num_experts / world)'s), as dep_layout's
    token_in_rank."""
    owner = torch.where(idx >= 0, idx // (num_experts // world), torch.full_like(idx, -1))
    ranks = torch.arange(world, dtype=torch.int64, device=idx.device)
    return (owner.unsqueeze(2) == ranks.view(1, 1, world)).any(1)


class _Throughput:
    """DeepEP's throughput-mode operations (a mixin of Buffer)."""

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[torch.Tensor, None, torch.Tensor, torch.Tensor,
                                       EventOverlap]:
        """Where each token goes.

        Args:
            topk_idx: [num_tokens, num_topk] int64 (or int32) expert ids, -1 for none.
            num_experts: experts in the job (a multiple of the world size).
            previous_event, async_finish, allocate_on_comm_stream: as DeepEP's (the host
                backend is synchronous; on cuda the work runs on the current stream).

        On a Buffer that has not attached (its shape lacks hidden, which the first dispatch
        gives) the layout is computed with torch, with the library's checks and results.

        Returns:
            num_tokens_per_rank: [world_size] int32, tokens that go to each rank.
            num_tokens_per_rdma_rank: in a job across nodes (world_size > local_world_size),
                [nodes] int32, the tokens that go to at least one rank of each node (DeepEP's
                RDMA ranks), the node of each rank being Identity.node_of's (a group's hosts,
                else node by node); None in a job on one node, as DeepEP's, and where the node
                of each rank is not known (a world of uneven nodes from the environment).
            num_tokens_per_expert: [num_experts] int32, (token, k) pairs naming each expert.
            is_token_in_rank: [num_tokens, world_size] bool.
            event: an EventOverlap (its event is None unless async_finish).
        """
        if not isinstance(num_experts, int) or isinstance(num_experts, bool):
            raise TypeError(f"num_experts must be an int, not {type(num_experts).__name__}")
        dev = self.device
        itype = _INDEX_TYPES.get(topk_idx.dtype) if type(topk_idx) is _Tensor else None
        if itype is not None and topk_idx.dim() == 2 and topk_idx.device == dev:
            idx = topk_idx.contiguous()
        else:
            idx, itype = self._topk("get_dispatch_layout", topk_idx, None)
        n, k = idx.shape
        if not self._shape("get_dispatch_layout", None, num_experts, k):
            if previous_event is not None:
                self._wait(previous_event)
            return self._layout_unattached(idx) + \
                (self._event(previous_event, async_finish) if async_finish else EventOverlap(None),)
        if n > self.max_tokens_per_rank:
            self._tokens_fit("get_dispatch_layout", n, self.max_tokens_per_rank,
                             "max_tokens_per_rank")
        new = self._new
        per_rank = new((self.group_size,), torch.int32)
        per_expert = new((self.num_experts,), torch.int32)
        in_rank = new((n, self.group_size), torch.bool)
        a = self._la
        a.topk_idx = idx.data_ptr() if n else None
        a.index_type, a.num_tokens = itype, n
        a.tokens_per_rank, a.tokens_per_expert = per_rank.data_ptr(), per_expert.data_ptr()
        a.token_in_rank = in_rank.data_ptr() if n else None
        if previous_event is not None:
            self._wait(previous_event)
        rc = self._fn_layout(self._conn.ptr, self._la_ref, None if self._host else self._stream())
        if rc:
            self._fail(rc, "dep_layout")
        return per_rank, self._per_node(in_rank), per_expert, in_rank, \
            self._event(previous_event, async_finish) if async_finish else EventOverlap(None)

    def _layout_unattached(self, idx: torch.Tensor) -> Tuple[torch.Tensor, None, torch.Tensor,
                                                             torch.Tensor]:
        """get_dispatch_layout's results where the Buffer has not attached yet (its shape
        lacks hidden, which the first dispatch gives: Megatron asks for the layout first).
        The layout needs no other rank and no daemon memory, so it is computed here with
        torch, as DESIGN §6 defines it and dep_layout computes it (the tests compare the two):
        expert e is rank e // (num_experts / world_size)'s; -1 selects nothing."""
        W, E = self.group_size, self.num_experts
        if E % W != 0:
            raise ValueError(f"num_experts {E} is not divisible by the world size {W}")
        n = idx.size(0)
        bound = self.max_tokens_per_rank or self._default_max_tokens()
        if n > bound:
            self._tokens_fit("get_dispatch_layout", n, bound, "max_tokens_per_rank")
        bad = (idx < -1) | (idx >= E)
        if bool(bad.any()):
            v = int(idx[bad][0])
            raise InvalidArgument(_lib.ERR_INVALID, f"topk_idx holds expert {v}; ids are -1 "
                                  f"(none) or 0..{E - 1}", "get_dispatch_layout")
        idx = idx.long()
        chosen = idx >= 0
        in_rank = _token_in_rank(idx, E, W)
        per_rank = in_rank.sum(0).to(torch.int32)
        per_expert = torch.bincount(idx[chosen], minlength=E).to(torch.int32)
        return per_rank, self._per_node(in_rank), per_expert, in_rank

    def _per_node(self, in_rank: torch.Tensor) -> Optional[torch.Tensor]:
        """get_dispatch_layout's num_tokens_per_rdma_rank: per node, the tokens that go to at
        least one of its ranks ([nodes] int32, torch ops on the current stream), or None for a
        job on one node (DeepEP's) or one whose ranks' nodes are unknown."""
        ident = self.identity
        if ident.world_size == ident.local_world_size:
            return None
        node = self._node_index
        if node is None:
            nodes = ident.node_of()
            if nodes is None:
                return None
            node = self._node_index = torch.tensor(nodes, dtype=torch.int64, device=self.device)
            self._num_nodes = max(nodes) + 1
        n = in_rank.size(0)
        hits = torch.zeros((n, self._num_nodes), dtype=torch.int32, device=self.device)
        hits.index_add_(1, node, in_rank.to(torch.int32))
        return (hits > 0).sum(0, dtype=torch.int32)

    def recv_from(self, handle: Handle) -> Optional[list]:
        """The rows a dispatch's handle received from each source rank, in rank order (they
        are contiguous by source): [world_size] ints; None where the library does not know
        them on the host (a dispatch with num_worst_tokens on cuda, which never waits)."""
        h = self._handle("recv_from", handle, "dispatch")
        out = (ctypes.c_uint32 * self.group_size)()
        rc = self._conn.lib.dep_handle_recv_from(self._conn.ptr, h._ptr, out, self.group_size)
        if rc == _lib.ERR_STATE and h.worst and not self._host:
            return None
        if rc:
            self._fail(rc, "dep_handle_recv_from")
        return list(out)

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Handle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Throughput-mode dispatch: every token once to each rank owning one of its experts.

        Args:
            x: [num_tokens, hidden] bfloat16, or an FP8 tuple (values [num_tokens, hidden]
                fp8_dtype (uint8 accepted), scales [num_tokens, hidden // 128] float32, one
                per token and 128 channels), moved as they are.
            handle: a dispatch's Handle for DeepEP's cached mode: the tokens go where that
                dispatch sent them (x must hold as many); pass no topk_idx or topk_weights.
                Used inside a CUDA-graph capture, it is kept by the Buffer until destroy()
                (as combine's).
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                num_tokens_per_expert: get_dispatch_layout's results; with topk_idx only their
                sizes are checked (the library derives the layout from topk_idx itself).
            topk_idx, topk_weights: [num_tokens, num_topk] int64 (or int32), -1 for none, and
                float32; or neither (is_token_in_rank routes the tokens: _dispatch_by_mask).
            expert_alignment: each of num_recv_tokens_per_expert_list rounded up to a
                multiple of it (DeepEP's; the rows themselves are not padded).
            num_worst_tokens: 0, or the rows of the outputs (at most world_size *
                max_tokens_per_rank): no wait for the row count, so the call can be captured
                in a CUDA graph; rows past those received have recv_topk_idx -1 and
                recv_topk_weights 0 (recv_x there is not written), and
                num_recv_tokens_per_expert_list is [] (as DeepEP's).  A cached dispatch
                through such a handle has as many rows.
            config, previous_event, async_finish, allocate_on_comm_stream: as DeepEP's.

        Returns:
            recv_x: [rows, hidden] bfloat16, or the tuple (values, scales) for FP8, in
                (source rank, source token) order; rows = num_recv, or num_worst_tokens.
            recv_topk_idx: [rows, num_topk] int64 local expert ids, -1 where not ours
                (None without topk_idx, as recv_topk_weights).
            recv_topk_weights: [rows, num_topk] float32, 0 where not ours.
            num_recv_tokens_per_expert_list: [num_local_experts] ints, (row, k) pairs per
                local expert (rounded up to expert_alignment).
            handle: for the matching combine (and cached dispatches).
            event: an EventOverlap.
            In cached mode: (recv_x, None, None, None, None, event).
        """
        x, scales = self._dispatch_scalars(x, expert_alignment, num_worst_tokens)
        h = None
        if handle is not None:
            h = self._dispatch_cached(handle, topk_idx, topk_weights, expert_alignment)
            num_worst_tokens = num_worst_tokens or h.worst
        elif topk_idx is None or topk_weights is None:
            return self._dispatch_by_mask(
                x, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                num_tokens_per_expert, expert_alignment, num_worst_tokens, config,
                previous_event, async_finish)
        cached = h is not None
        capturing = self._dispatch_capturing(cached, num_worst_tokens)
        x, scales, idx, w, itype = self._dispatch_inputs(x, scales, h, topk_idx, topk_weights)
        rows = self._dispatch_rows(x, scales, h, idx, num_worst_tokens, num_tokens_per_expert,
                                   num_tokens_per_rank, is_token_in_rank)
        fp8 = scales is not None
        mode = (fp8, cached, num_worst_tokens, expert_alignment, itype)
        if mode != self._da_mode:
            self._dispatch_mode(mode)
        # The caller's current stream, looked up once per call (None on the host backend).
        cs = None if self._host else self._stream()
        n = x.size(0)
        recv_x, recv_s, recv_idx, recv_w, counts, alloc = \
            self._dispatch_outputs(x, scales, idx, w, rows, num_worst_tokens)
        if not cached:
            h = Handle(self, "dispatch", n, stream=cs, capturing=capturing)
        self._da.num_tokens = n
        if num_worst_tokens:
            self._num_recv.value = 0  # not written with num_worst_tokens
        if previous_event is not None:
            self._wait(previous_event)
        if cached and cs is not None:
            self._use(h, cs, capturing)
        rc = self._fn_dispatch(self._conn.ptr, self._da_ref, h._ptr, cs)
        if rc:
            self._fail(rc, "dep_dispatch")
        ev = self._event(previous_event, async_finish) if async_finish else EventOverlap(None)
        del counts  # kept alive through the call, which writes it; not returned
        return self._dispatch_results(h, rows, alloc, recv_x, recv_s, recv_idx, recv_w, cached,
                                      num_worst_tokens, ev)

    def _dispatch_by_mask(self, x: Any, scales: Any, topk_idx: Any, topk_weights: Any,
                          num_tokens_per_rank: Any, is_token_in_rank: Any,
                          num_tokens_per_expert: Any, expert_alignment: int,
                          num_worst_tokens: int, config: Any,
                          previous_event: Optional[EventOverlap], async_finish: bool) -> tuple:
        """DeepEP's dispatch without top-k: token t goes to every rank r with
        is_token_in_rank[t, r], and each rank's num_recv_tokens_per_expert_list is the sum over
        the source ranks of their num_tokens_per_expert for its experts (rounded up to
        expert_alignment; [] with num_worst_tokens, as DeepEP's).

        Made of the library's own dispatch, exactly: the tokens travel in one dispatch whose
        top-k names, for each rank the token goes to, that rank's first expert (so each token
        reaches exactly the ranks of its mask, once each, in the order DeepEP's rows have);
        the counts in a second dispatch of world_size * ceil(L / num_topk) rows of zeros
        (L = local experts), each going to one rank and carrying, as its top-k weights, the
        counts of num_topk of that rank's experts (integers below 2**24, exact in float32),
        which the receiver adds up by local expert.  No torch collective is used (DESIGN
        §12).  The mask routes through the top-k width, so a token may go to at most
        num_topk ranks (ValueError otherwise; a Buffer with num_topk >= world_size always
        fits)."""
        op = "dispatch"
        if topk_idx is not None or topk_weights is not None:
            raise ValueError("dispatch: topk_idx and topk_weights go together; give both, or "
                             "neither (is_token_in_rank routes the tokens then)")
        if is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError("dispatch without topk_idx needs is_token_in_rank and "
                             "num_tokens_per_expert (get_dispatch_layout's), as DeepEP's")
        fp8 = scales is not None
        xv = x
        if fp8 and isinstance(x, torch.Tensor):
            xv = self._input("x", x, (x.dtype,), 2)
        elif not fp8:
            xv = self._input("x", x, _BF16, 2)
        if not isinstance(xv, torch.Tensor):
            raise TypeError(f"dispatch: x must be a torch.Tensor, not {type(xv).__name__}")
        mask = self._input("is_token_in_rank", is_token_in_rank, (torch.bool,), 2)
        per_expert = self._input("num_tokens_per_expert", num_tokens_per_expert,
                                 (torch.int32, torch.int64), 1)
        n, W = xv.size(0), self.group_size
        if tuple(mask.shape) != (n, W):
            raise ValueError(f"dispatch: is_token_in_rank has shape {tuple(mask.shape)}; "
                             f"expected {(n, W)}")
        # The shape: hidden from x and num_experts from the counts; the top-k width is the
        # Buffer's (a Buffer that lacks it cannot learn it from this call).
        self._shape(op, xv.size(1), per_expert.numel(), None)
        K, L = self.num_topk, self.num_local_experts
        need = int(mask.sum(1).max()) if K < W and n else 0  # a sync only where it can fail
        if need > K:
            raise ValueError(f"dispatch: a token of is_token_in_rank goes to {need} ranks, but "
                             f"this Buffer's dispatches route through num_topk {K} entries a "
                             f"token; make the Buffer with num_topk >= {need} (at most "
                             f"{_lib.MAX_TOPK})")
        # Column c of token t: the c-th rank it goes to (ascending), as that rank's expert 0;
        # the unused columns -1 (column K takes nothing: it absorbs the unset places).
        dev = self.device
        ranks = torch.arange(W, dtype=torch.int64, device=dev)
        place = torch.where(mask, mask.long().cumsum(1) - 1,
                            torch.full_like(ranks, K).expand(n, W))
        idx = torch.full((n, K + 1), -1, dtype=torch.int64, device=dev)
        idx.scatter_(1, place, torch.where(mask, ranks * L, torch.full_like(ranks, -1)))
        idx = idx[:, :K].contiguous()
        w = torch.zeros((n, K), dtype=torch.float32, device=dev)
        out = _Throughput.dispatch(
            self, (xv, scales) if fp8 else xv, None, num_tokens_per_rank, None, None, None,
            idx, w, 1, num_worst_tokens, config, previous_event, async_finish)
        recv_x, h, ev = out[0], out[4], out[5]
        counts: list = []
        if not num_worst_tokens:
            counts = self._dispatch_counts(per_expert, expert_alignment)
        return recv_x, None, None, counts, h, ev

    def _dispatch_counts(self, per_expert: torch.Tensor, expert_alignment: int) -> list:
        """_dispatch_by_mask's counts: each rank's num_tokens_per_expert for rank d's experts,
        to d, as the top-k weights of ceil(L / num_topk) rows to d, each naming num_topk of
        d's experts; what arrives, added up by local expert, is the sum over sources."""
        K, L, W, dev = self.num_topk, self.num_local_experts, self.group_size, self.device
        m = -(-L // K)  # rows to each rank
        if W * m > self.max_tokens_per_rank:
            raise ValueError(f"dispatch without top-k: its counts need {W * m} rows a rank "
                             f"(world_size * ceil(local experts / num_topk)), more than "
                             f"max_tokens_per_rank {self.max_tokens_per_rank}")
        slot = torch.arange(m * K, dtype=torch.int64, device=dev).view(1, m, K)  # local expert
        d = torch.arange(W, dtype=torch.int64, device=dev).view(W, 1, 1)
        ok = slot < L
        ids = torch.where(ok, d * L + slot, torch.full_like(slot, -1)).reshape(W * m, K)
        vals = per_expert.to(torch.float32)
        wts = torch.where(ok, vals[(d * L + slot).clamp(max=vals.numel() - 1)],
                          torch.zeros((), dtype=torch.float32, device=dev)).reshape(W * m, K)
        zeros = self._count_rows
        if zeros is None or zeros.size(0) != W * m:
            zeros = self._count_rows = torch.zeros((W * m, self.hidden), dtype=torch.bfloat16,
                                                   device=dev)
        # Every rank sends each rank exactly m rows, so W * m rows arrive: num_worst_tokens
        # says so, and the call does not wait for its row count.
        _, r_idx, r_w, _, _, _ = _Throughput.dispatch(self, zeros, None, None, None, None,
                                                      None, ids, wts, 1, W * m)
        sel = r_idx >= 0
        got = torch.zeros((L,), dtype=torch.int64, device=dev)
        got.index_add_(0, r_idx[sel], r_w[sel].to(torch.int64))
        if expert_alignment > 1:
            got = (got + expert_alignment - 1) // expert_alignment * expert_alignment
        return got.tolist()

    def _dispatch_scalars(self, x: Any, expert_alignment: Any, num_worst_tokens: Any
                          ) -> Tuple[Any, Any]:
        """dispatch's first step: x split into (values, scales) when it is an FP8 tuple
        (scales None otherwise), and the two int arguments checked, before any tensor is
        looked at, so a wrong call fails on what the caller wrote first."""
        scales = None
        if type(x) is not _Tensor and isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ValueError("dispatch: an FP8 x is a tuple (values, scales), not "
                                 f"{len(x)} items")
            x, scales = x
        if type(expert_alignment) is not int or type(num_worst_tokens) is not int:
            for name, v in (("expert_alignment", expert_alignment),
                            ("num_worst_tokens", num_worst_tokens)):
                if type(v) is not int:
                    raise TypeError(f"dispatch: {name} must be an int, not {type(v).__name__}")
        if not 1 <= expert_alignment <= _ALIGN_MAX:
            _lib.checked_int("dispatch: expert_alignment", expert_alignment,
                             _lib.field_type(_lib.DispatchArgs, "expert_alignment"), lo=1)
        if num_worst_tokens < 0:
            raise ValueError(f"dispatch: num_worst_tokens is {num_worst_tokens}; give 0 or "
                             "the rows the outputs should have")
        return x, scales

    def _dispatch_cached(self, handle: Any, topk_idx: Any, topk_weights: Any,
                         expert_alignment: int) -> Handle:
        """A cached dispatch's Handle, checked, and the arguments that mode forbids refused:
        the handle routes the tokens and no counts are returned."""
        h = self._handle("dispatch", handle, "dispatch")
        if topk_idx is not None or topk_weights is not None:
            raise ValueError("dispatch: with handle= (cached mode) the handle routes the "
                             "tokens; pass no topk_idx or topk_weights")
        if expert_alignment != 1:
            raise ValueError("dispatch: expert_alignment has no effect in cached mode "
                             "(no counts are returned); leave it 1")
        return h

    def _dispatch_capturing(self, cached: bool, num_worst_tokens: int) -> bool:
        """Whether the current stream captures a CUDA graph: asked once a call (the Handle
        takes the answer), and a capture refused where the call would wait on the host."""
        capturing = False if self._host else _capturing()
        if capturing and not cached and num_worst_tokens == 0:
            raise Unsupported("dispatch inside a CUDA-graph capture without num_worst_tokens",
                              "dep_dispatch waits on the host for its row count; give "
                              "num_worst_tokens (outputs of that many rows, no wait)")
        return capturing

    def _dispatch_inputs(self, x: Any, scales: Any, h: Optional[Handle], topk_idx: Any,
                         topk_weights: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor],
                                                     Optional[torch.Tensor],
                                                     Optional[torch.Tensor], int]:
        """dispatch's tensors checked (types, dtypes, ranks, devices) and made contiguous:
        (x, scales, topk_idx, topk_weights, index type); the topk pair None in cached mode
        (h given), whose x must have the handle's token count."""
        dev = self.device
        fp8 = scales is not None
        if fp8:
            if not isinstance(x, torch.Tensor) or x.dtype not in (fp8_dtype, torch.uint8):
                raise TypeError("dispatch: FP8 values must be a torch.Tensor of " +
                                " or ".join(sorted({str(fp8_dtype), str(torch.uint8)})) +
                                (f", not {x.dtype}" if isinstance(x, torch.Tensor) else
                                 f", not {type(x).__name__}"))
            x = self._input("x", x, (x.dtype,), 2)
            if isinstance(scales, torch.Tensor) and scales.dtype == torch.int32:
                # DeepEP's packed UE8M0 scales (four exponents an int): docs/python.md lists them as
                # not there yet, which is Unsupported, not a wrong dtype.
                raise Unsupported("dispatch with int32 (packed UE8M0) FP8 scales",
                                  "give float32 scales, one per token and 128 channels")
            scales = self._input("x scales", scales, _F32, 2)
        if h is not None:
            if not fp8:
                x = self._input("x", x, _BF16, 2)
            if x.size(0) != h.num_tokens:
                raise ValueError(f"dispatch: x has {x.size(0)} tokens but the handle's dispatch "
                                 f"had {h.num_tokens}; cached mode moves the same tokens")
            return x, scales, None, None, _lib.INDEX_I64
        itype = _INDEX_TYPES.get(topk_idx.dtype) if type(topk_idx) is _Tensor else None
        # The usual inputs in one test (types, dtypes, shapes, devices; torch.Size
        # compares as a tuple), the checks that name what is wrong only where it fails.
        if itype is not None and type(x) is _Tensor and type(topk_weights) is _Tensor and \
                (fp8 or x.dtype is torch.bfloat16) and topk_weights.dtype is torch.float32:
            ks, xs = topk_idx.shape, x.shape
            usual = len(ks) == 2 and ks == topk_weights.shape and len(xs) == 2 and \
                ks[0] == xs[0] and x.device == dev and topk_idx.device == dev and \
                topk_weights.device == dev
        else:
            usual = False
        if usual:
            return x.contiguous(), scales, topk_idx.contiguous(), topk_weights.contiguous(), \
                itype
        if not fp8:
            x = self._input("x", x, _BF16, 2)
        idx, itype = self._topk("dispatch", topk_idx, x.size(0))
        w = self._input("topk_weights", topk_weights, _F32, 2)
        if w.shape != idx.shape:
            raise ValueError(f"dispatch: topk_weights has shape {tuple(w.shape)} but "
                             f"topk_idx {tuple(idx.shape)}")
        return x, scales, idx, w, itype

    def _dispatch_rows(self, x: torch.Tensor, scales: Optional[torch.Tensor],
                       h: Optional[Handle], idx: Optional[torch.Tensor], num_worst_tokens: int,
                       num_tokens_per_expert: Any, num_tokens_per_rank: Any,
                       is_token_in_rank: Any) -> int:
        """The checked inputs' sizes against the job's shape (a first dispatch gives the
        shape its hidden) and the Buffer's bounds; returns the rows of the outputs."""
        op = "dispatch"
        n, hx = x.shape
        if scales is not None and tuple(scales.shape) != (n, hx // _FP8_GROUP):
            raise ValueError(f"dispatch: FP8 scales have shape {tuple(scales.shape)}; expected "
                             f"{(n, hx // _FP8_GROUP)} (float32, one per token and "
                             f"{_FP8_GROUP} channels)")
        if h is None:
            ne = None
            if num_tokens_per_expert is not None:
                ne = self._input("num_tokens_per_expert", num_tokens_per_expert,
                                 (torch.int32, torch.int64), 1).numel()
            if ne is not None or not self.attached or hx != self.hidden or \
                    idx.shape[1] != self.num_topk:
                self._shape(op, hx, ne, idx.size(1))
            if num_tokens_per_rank is not None or is_token_in_rank is not None:
                for name, t, want in (("num_tokens_per_rank", num_tokens_per_rank,
                                       (self.group_size,)),
                                      ("is_token_in_rank", is_token_in_rank,
                                       (n, self.group_size))):
                    if t is not None and tuple(t.shape) != want:
                        raise ValueError(f"dispatch: {name} has shape {tuple(t.shape)}; "
                                         f"expected {want}")
        elif hx != self.hidden:
            raise ValueError(f"dispatch: x has {hx} channels; this Buffer's job has "
                             f"hidden {self.hidden}")
        if n > self.max_tokens_per_rank:
            self._tokens_fit(op, n, self.max_tokens_per_rank, "max_tokens_per_rank")
        if num_worst_tokens > self._rows:
            raise ValueError(f"dispatch: num_worst_tokens {num_worst_tokens} exceeds the "
                             f"{self._rows} rows a rank can receive (world_size * "
                             "max_tokens_per_rank)")
        rows = num_worst_tokens or (h.num_recv if h is not None else self._rows)
        if rows is None:  # pragma: no cover - h.worst is set whenever num_recv is unknown
            raise Error(-17, "the handle's row count is unknown", op)
        return rows

    def _dispatch_mode(self, mode: Tuple[bool, bool, int, int, int]) -> None:
        """The fields of the dispatch arguments that stay as they were while the call's mode
        (fp8, cached, num_worst_tokens, expert_alignment, index type) does: set when it
        changes, so the usual call repeating the last one's mode sets none of them."""
        fp8, cached, num_worst_tokens, expert_alignment, itype = mode
        a = self._da
        a.use_fp8, a.cached = int(fp8), int(cached)
        a.num_worst_tokens, a.expert_alignment = num_worst_tokens, expert_alignment
        a.index_type = itype
        a.x_scales = a.recv_x_scales = None
        # The counts (_prepare): none cached; on the host backend straight into the host
        # scratch; on cuda, where the call waits, the device scratch and a copy to the
        # host one; with num_worst_tokens, per call (_dispatch_outputs), none copied.
        a.recv_count_per_expert_host = None
        if cached:
            a.topk_idx = a.topk_weights = a.recv_topk_idx = a.recv_topk_weights = None
            a.recv_count_per_expert = None
        elif self._host:
            a.recv_count_per_expert = self._counts_addr
        elif not num_worst_tokens:
            a.recv_count_per_expert = self._counts_dev.data_ptr()
            a.recv_count_per_expert_host = self._counts_addr
        self._da_mode = mode

    def _dispatch_outputs(self, x: torch.Tensor, scales: Optional[torch.Tensor],
                          idx: Optional[torch.Tensor], w: Optional[torch.Tensor], rows: int,
                          num_worst_tokens: int) -> tuple:
        """dispatch's outputs allocated and their addresses (and the inputs') set in the
        arguments: (recv_x, recv_scales, recv_topk_idx, recv_topk_weights, counts, rows
        allocated); recv_scales None unless FP8, the topk pair None in cached mode (idx
        None), counts the per-call counts (with num_worst_tokens on cuda; else None), which
        the caller keeps alive through the call."""
        a = self._da
        n = x.size(0)
        k, hid = self.num_topk, self.hidden
        fp8, cached = scales is not None, idx is None
        recv_s = recv_idx = recv_w = counts = None
        if fp8 or cached:
            # A row at least, so that the pointers are never NULL (a cached dispatch may
            # receive none), shrunk (_dispatch_results) once the call is made.
            alloc = rows or 1
            recv_x = self._new((alloc, hid), x.dtype if fp8 else torch.bfloat16)
            if fp8:
                recv_s = self._new((alloc, hid // _FP8_GROUP), torch.float32)
                a.x_scales = scales.data_ptr() if n else None
                a.recv_x_scales = recv_s.data_ptr()
        else:
            # The usual call's three outputs, from prototypes kept per row count.
            alloc = rows
            pr = self._tp_protos.get(rows)
            if pr is None:
                pr = self._tp_prototypes(rows)
            recv_x, recv_idx, recv_w = _empty_like(pr[0]), _empty_like(pr[1]), \
                _empty_like(pr[2])
        a.x = x.data_ptr() if n else None
        a.recv_x = recv_x.data_ptr()
        if not cached:
            if fp8:
                recv_idx = self._new((rows, k), torch.int64)
                recv_w = self._new((rows, k), torch.float32)
            if num_worst_tokens and not self._host:
                counts = self._new((self.num_local_experts,), torch.int32)
                a.recv_count_per_expert = counts.data_ptr()
            if n:
                a.topk_idx, a.topk_weights = idx.data_ptr(), w.data_ptr()
            else:
                a.topk_idx = a.topk_weights = None
            a.recv_topk_idx, a.recv_topk_weights = recv_idx.data_ptr(), recv_w.data_ptr()
        return recv_x, recv_s, recv_idx, recv_w, counts, alloc

    def _dispatch_results(self, h: Handle, rows: int, alloc: int, recv_x: torch.Tensor,
                          recv_s: Optional[torch.Tensor], recv_idx: Optional[torch.Tensor],
                          recv_w: Optional[torch.Tensor], cached: bool, num_worst_tokens: int,
                          ev: EventOverlap) -> tuple:
        """dispatch's return value once the call is made: the outputs shrunk to the rows
        received and the handle told its row count."""
        fp8 = recv_s is not None
        hid, k = self.hidden, self.num_topk
        if rows != alloc:
            recv_x.resize_((rows, hid))
            if fp8:
                recv_s.resize_((rows, hid // _FP8_GROUP))
        out_x = (recv_x, recv_s) if fp8 else recv_x
        if cached:
            return out_x, None, None, None, None, ev
        h.worst = num_worst_tokens
        if num_worst_tokens:
            h.num_recv = self._num_recv.value if self._host else None
            return out_x, recv_idx, recv_w, [], h, ev
        r = h.num_recv = self._num_recv.value
        if r != rows:
            # Shrunk in place (the storage keeps its capacity, as a slice's would): cheaper
            # than a view.
            recv_x.resize_((r, hid))
            if fp8:
                recv_s.resize_((r, hid // _FP8_GROUP))
            recv_idx.resize_((r, k))
            recv_w.resize_((r, k))
        return (out_x, recv_idx, recv_w, self._counts_host[:], h, ev)

    def combine(self, x: torch.Tensor, handle: Handle,
                topk_weights: Optional[torch.Tensor] = None, bias: Any = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Throughput-mode combine: each received row back to its origin, summed in float32.

        Args:
            x: [rows, hidden] bfloat16, one row per row the dispatch delivered (rows: its
                num_recv, or its num_worst_tokens; the padding rows are not read).
            handle: the matching dispatch's.  Used inside a CUDA-graph capture, it is kept
                by the Buffer until destroy() (never reused for another dispatch), since the
                graph reads its arrays at every replay.
            topk_weights: optional [rows, num_topk] float32 (DeepEP's): summed back too.
            bias: None, a [num_tokens, hidden] bfloat16 tensor, or a tuple (or list) of up to
                two such tensors (or None in their place), DeepEP's bias_0 and bias_1: added by
                the library's combine as DeepEP's kernel adds them, to the float32 sum before
                its one rounding (float32(bias_0) + float32(bias_1) first, then each rank's
                row, ranks ascending; deepep.h dep_combine_args).
            config, previous_event, async_finish, allocate_on_comm_stream: as DeepEP's.

        Returns:
            combined_x: [num_tokens, hidden] bfloat16 of the dispatching rank, plus bias
                (not weighted: weigh the rows before combine).
            combined_topk_weights: with topk_weights, [num_tokens, num_topk] float32, the sum
                over the ranks that received each token (so the dispatch's recv_topk_weights
                combine to the original weights); else None.
            event: an EventOverlap.
        """
        h = self._handle("combine", handle, "dispatch")
        biases = None if bias is None else self._biases(bias, h.num_tokens)
        x = x.contiguous() if _ok(x, torch.bfloat16, 2, self.device) else \
            self._input("x", x, _BF16, 2)
        rows = h.rows
        if x.shape != (rows, self.hidden):
            raise ValueError(f"combine: x has shape {tuple(x.shape)}; the dispatch delivered "
                             f"{(rows, self.hidden)}")
        nt = h.num_tokens
        out = self._new((nt, self.hidden), torch.bfloat16)
        a = self._ca
        a.x = x.data_ptr() if rows else None
        a.out = out.data_ptr() if nt else None
        out_w = None
        if topk_weights is not None:
            w = self._input("topk_weights", topk_weights, _F32, 2)
            if w.shape != (rows, self.num_topk):
                raise ValueError(f"combine: topk_weights has shape {tuple(w.shape)}; expected "
                                 f"{(rows, self.num_topk)}, one row per row dispatched here")
            # A row at least, so that the pointer that says "weighted" is never NULL (every
            # rank of the call must say the same), then shrunk to num_tokens.
            out_w = self._new((max(nt, 1), self.num_topk), torch.float32)
            a.topk_weights = w.data_ptr() if rows else None
            a.out_topk_weights = out_w.data_ptr()
            if nt == 0:
                out_w.resize_((0, self.num_topk))
        else:
            a.topk_weights = a.out_topk_weights = None
        # Kept contiguous (and referenced) until the call returns: the library reads them.
        biases = [None if b is None or not nt else b.contiguous() for b in biases or []]
        biases += [None] * (2 - len(biases))
        a.bias_0, a.bias_1 = (None if b is None else b.data_ptr() for b in biases)
        if previous_event is not None:
            self._wait(previous_event)
        cs = None
        if not self._host:
            cs = self._stream()
            self._use(h, cs, _capturing())
        rc = self._fn_combine(self._conn.ptr, self._ca_ref, h._ptr, cs)
        if rc:
            self._fail(rc, "dep_combine")
        return out, out_w, \
            self._event(previous_event, async_finish) if async_finish else EventOverlap(None)

    def _biases(self, bias: Any, num_tokens: int) -> list:
        """combine's bias (DeepEP's: a tensor, or a tuple of bias_0 and bias_1, either None)
        as [bias_0, bias_1] (None where not given), each checked to be [num_tokens, hidden]
        bfloat16 on this Buffer's device (the combine's dtype, as DeepEP requires), before
        the combine is sent (a wrong one must not leave the other ranks' combine done and
        this one's not)."""
        if isinstance(bias, (tuple, list)):
            if not 1 <= len(bias) <= 2:
                raise ValueError(f"combine: bias is a {type(bias).__name__} of {len(bias)} "
                                 "items; give a tensor or (bias_0, bias_1)")
            items = list(bias)
        else:
            items = [bias]
        want = (num_tokens, self.hidden)
        out = []
        for i, b in enumerate(items):
            name = "bias" if len(items) == 1 and not isinstance(bias, (tuple, list)) \
                else f"bias[{i}]"
            if b is None:
                out.append(None)
                continue
            if not isinstance(b, torch.Tensor):
                raise TypeError(f"combine: {name} must be a torch.Tensor or None, not "
                                f"{type(b).__name__}")
            if b.dtype is not torch.bfloat16:
                raise TypeError(f"combine: {name} has dtype {b.dtype}; it must be "
                                "torch.bfloat16 (the combine's dtype)")
            if tuple(b.shape) != want:
                raise ValueError(f"combine: {name} has shape {tuple(b.shape)}; expected "
                                 f"{want} (the dispatching rank's tokens, hidden)")
            if b.device != self.device:
                raise ValueError(f"combine: {name} is on {b.device}; this rank's tensors live "
                                 f"on {self.device} ({self.backend} backend)")
            out.append(b)
        return out
