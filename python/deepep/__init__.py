"""deepep — PyTorch binding of libdeepep-client (deepepd's client library).

``deepep.Buffer`` is DeepEP's ``deep_ep.Buffer`` over deepepd: the job's
memory is lent by the node's daemon, the job's identity comes from the
process group where one is given, else from arguments or the launcher's
environment, and no process group is needed.  The library is
reached through ctypes, so one install serves every torch version.
"""
from .buffer import (DEFAULT_MAX_LL_TOKENS_PER_RANK, DEFAULT_MAX_TOKENS_PER_RANK, Buffer, Handle,
                     fp8_dtype, topk_idx_t)
from .config import Config
from .errors import Error, InvalidArgument, NoDaemon, Unsupported
from .event import EventHandle, EventOverlap
from .identity import Identity, from_environment, from_group

__version__ = "0.6.10"
__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "Error", "Handle", "Identity",
           "InvalidArgument", "NoDaemon", "Unsupported", "fp8_dtype", "from_environment",
           "from_group", "topk_idx_t", "DEFAULT_MAX_TOKENS_PER_RANK",
           "DEFAULT_MAX_LL_TOKENS_PER_RANK"]
