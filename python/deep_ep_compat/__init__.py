"""deep_ep — DeepEP's module names over deepepd (opt-in; README.md, section Python).

(setup.py recognises this module by the words "DeepEP's module names over deepepd".)

Installed only when asked (DEEPEP_INSTALL_DEEP_EP=1 at install time), and
never over a real DeepEP.  ``from deep_ep import Buffer, Config,
EventOverlap`` and ``from deep_ep.utils import EventHandle, EventOverlap``
work as with DeepEP.  Where the semantics differ:

- the low-latency receive order is deterministic: rows of each local expert
  are packed from row 0 in (source rank, source token) order;
- handles are opaque deepep.Handle objects, not DeepEP's tuples of prefix
  matrices; pass them back as they are;
- FP8 scales are row-major float32 [.., hidden // 128] (low-latency and throughput), not
  column-major; a throughput FP8 tuple's scales are made contiguous, and UE8M0 or int32
  scales are not taken;
- with num_worst_tokens, rows past those received have recv_topk_idx -1 and
  recv_topk_weights 0, and recv_x there is not written (as DeepEP);
- FP8 values are torch.float8_e4m3fn where torch has it, else uint8;
- Buffer accepts and ignores keyword arguments that forks of DeepEP add;
- get_local_buffer_tensor is a buffer of the Buffer's own (deepepd's memory is
  never handed out), get_comm_stream the caller's current stream (None on the
  host backend), get_next_low_latency_combine_buffer one tensor per Buffer;
- get_dispatch_config/get_combine_config give a rank count DeepEP's tables do not
  list the next larger one's row (DeepEP asserts).
"""
from typing import Any

import deepep as _deepep
from deepep import Config, EventHandle, EventOverlap, Unsupported, topk_idx_t

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
        super().__init__(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
                         num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
                         use_fabric, explicitly_destroy, enable_shrink, comm, **own)


_DEEPEP_KWARGS = ("job_id", "rank", "world_size", "local_rank", "local_world_size", "socket",
                  "hidden", "num_experts", "num_topk", "max_tokens_per_rank",
                  "max_ll_tokens_per_rank")

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "Unsupported", "topk_idx_t"]
