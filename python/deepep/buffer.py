"""deepep.Buffer: DeepEP's Buffer over libdeepep-client, needing no process group.

A Buffer is one rank of one job.  Its identity (job id, ranks) comes from
the process group where one is given, else from arguments or the
launcher's environment (identity.py); its memory is the
daemon's, lent at attach for one job shape (hidden, num_experts, top-k,
token bounds).  The shape is given to the constructor, or taken from the
first operation that reveals it: the Buffer then attaches there, and every
later call must have the same shape (a Buffer serves one shape).

This module holds the Buffer: its construction and attach, its streams,
events and deferred calls, DeepEP's class-level helpers and its lifetime.
Its operations are in mixins by concern: argument checking (_checks.py,
with the dtypes and bounds), throughput mode (_throughput.py) and
low-latency mode (_low_latency.py); handles are handle.py's.
"""
from __future__ import annotations

import ctypes
import os
import time
from typing import Any, Optional, Sequence, Tuple

import torch

from . import _lib
# topk_idx_t, fp8_dtype, the DEFAULT_ bounds, Handle and _token_in_rank stay importable from
# here, where deepep/__init__.py, deep_ep's module and callers import them from.
from ._checks import (DEFAULT_MAX_LL_TOKENS_PER_RANK, DEFAULT_MAX_TOKENS_PER_RANK, _FP8_GROUP,
                      _Checks, fp8_dtype, topk_idx_t)  # noqa: F401
from ._low_latency import _LowLatency
from ._mask import _Masks
from ._throughput import _Throughput, _token_in_rank  # noqa: F401
from .config import Config
from .errors import Error, from_code
from .event import EventHandle, EventOverlap
from .handle import Handle, HandlePools
from .identity import Identity, from_environment, from_group

#: cuda: torch.cuda.Streams kept per Buffer by raw stream (_stream_of).
_STREAMS = 256
#: Prototypes kept per Buffer for _new (one per output shape and dtype seen).
_PROTOS = 1024

_clock = time.perf_counter_ns

# The caller's current stream as its raw CUstream (an int), straight from torch's C
# extension where it has it (torch 2.x): the public torch.cuda.current_stream() builds a
# Stream after its device-index parsing and lazy-init checks, microseconds a call
# (BENCHMARKS.md, Python binding overhead).  Whether it captures a CUDA graph is
# handle.py's _capturing.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# libdeepep-client is loaded here, at `import deepep`, as DeepEP loads its extension, so that
# Buffer(...) (which a restarted trainer's first call waits for) spends no time on it; where
# it cannot be loaded the import still works, and Buffer(...) raises the loader's error
# saying how to build or point to it.
try:
    _lib.load()
except OSError:
    pass


def _socket_path(socket: Any) -> str:
    """Buffer's socket argument checked, or else $DEEPEPD_SOCKET's path, or the default one."""
    if socket is not None and not isinstance(socket, str):
        raise TypeError(f"socket must be a path (str), not {type(socket).__name__}")
    if socket is not None and "\0" in socket:
        # C would read the path up to the NUL, and connect to another socket than named.
        raise ValueError(f"socket {socket!r} contains a NUL character, which no path can")
    return socket or os.environ.get(_lib.SOCKET_ENV) or _lib.DEFAULT_SOCKET


class _Conn:
    """One dep_client_t: freed once, after every handle made on it."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        p = ctypes.c_void_p()
        rc = lib.dep_client_new(ctypes.byref(p))
        if rc != 0:
            raise from_code(rc, "", "dep_client_new")
        self.ptr: Optional[int] = p.value

    def errmsg(self) -> str:
        return self.lib.dep_errmsg(self.ptr).decode(errors="replace") if self.ptr else ""

    def check(self, rc: int, call: str) -> None:
        if rc != 0:
            raise from_code(rc, self.errmsg(), call)

    def free(self) -> None:
        if self.ptr:
            self.lib.dep_client_free(self.ptr)
            self.ptr = None


#: DeepEP V1's recommended Configs (deep_ep/buffer.py, get_dispatch_config and
#: get_combine_config): rank count -> (num_max_nvl_chunked_send_tokens,
#: num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_send_tokens,
#: num_max_rdma_chunked_recv_tokens); num_sms is Buffer.num_sms.
_DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
_COMBINE_CONFIGS = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}


class Buffer(_Checks, _Throughput, _LowLatency, _Masks, HandlePools):
    """One rank's side of deepepd's dispatch and combine, with DeepEP's methods.

    Args (DeepEP's, in DeepEP's order; accepted for compatibility):
        group: a torch.distributed ProcessGroup (the expert-parallel group), or None.  Where
            given, the job's identity is the group's (identity.from_group): rank and world
            size are the group's, the local ranks its members on this node (this host and
            daemon socket), and the job id
            is agreed over the group in one collective at construction (which every member
            must make); nothing else is sent over it.  Each Buffer so made is a job of its
            own, so several groups in one world, and one process in several groups, work.
        num_nvl_bytes, num_rdma_bytes: kept as attributes; deepepd sizes memory from the
            job shape.
        low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
            use_fabric, explicitly_destroy: accepted and kept; they change nothing here.
        enable_shrink: kept; deepepd's masks (mask(), update_mask(), clear_mask(),
            dropped(): deepep.h "Masked ranks") need no opt-in here, and deep_ep's
            low_latency_*_mask_buffer methods need it, as DeepEP's; deep_ep.Buffer maps it
            to elastic (below).
        comm: an mpi4py communicator in place of group (its Get_size() is checked against
            the world size from the arguments or the environment).

    Keyword-only (deepepd's):
        job_id, rank, world_size, local_rank, local_world_size: the job's identity; each one
            not given comes from the group where one is given (one that disagrees with the
            group is a ValueError), else from the environment (torchrun, SLURM,
            $DEEPEP_JOB_ID).
        socket: the daemon's socket (else $DEEPEPD_SOCKET, else /run/deepepd/deepepd.sock);
            a path with a NUL character is refused.
        hidden, num_experts, num_topk: the job shape, each positive and at most 2**32 - 1
            (its uint32_t field of dep_job_shape; the library bounds them further); when all
            three are given the Buffer attaches at once, else at the first operation that
            supplies the rest.
        max_tokens_per_rank: the most tokens one rank dispatches in one call (else
            $DEEPEP_MAX_TOKENS_PER_RANK, else 4096).
        max_ll_tokens_per_rank: the low-latency bound, which low_latency_dispatch's
            num_max_dispatch_tokens_per_rank must equal (else
            $DEEPEP_MAX_LL_TOKENS_PER_RANK, else the first low-latency call's, else
            min(max_tokens_per_rank, 256)).
        elastic: the job survives a rank that dies or leaves (DEP_ATTACH_ELASTIC): deepepd
            masks it instead of failing the job's calls; every rank must pass the same.

    Raises:
        NoDaemon: no deepepd answers on the socket (the message says how to start one).
        ValueError, TypeError: an argument is wrong (the message names it, and the range
            of an integer outside the C field it would cross into), before anything is sent.
        Error: the daemon refused the attach (code, name and the library's message).
    """

    #: SMs for the throughput kernels (DeepEP's class attribute; the cuda kernels size their
    #: grid themselves, so it is recorded and reported, not used).
    num_sms: int = 20

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm: Any = None, *,
                 job_id: Optional[str] = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None, local_rank: Optional[int] = None,
                 local_world_size: Optional[int] = None, socket: Optional[str] = None,
                 hidden: Optional[int] = None, num_experts: Optional[int] = None,
                 num_topk: Optional[int] = None, max_tokens_per_rank: Optional[int] = None,
                 max_ll_tokens_per_rank: Optional[int] = None, elastic: bool = False):
        self._conn: Optional[_Conn] = None
        #: get_next_low_latency_combine_buffer's tensor, and get_local_buffer_tensor's
        #: buffers (use_rdma_buffer -> uint8 tensor), made at their first call.
        self._ll_combine_buf: Optional[torch.Tensor] = None
        #: The zero rows a dispatch without top-k sends its counts in (_dispatch_counts).
        self._count_rows: Optional[torch.Tensor] = None
        self._raw_buffers: dict = {}
        self._handles_init()
        self._streams: dict = {}  # raw stream -> torch.cuda.Stream, for recording events
        #: The node of each rank as a tensor on the Buffer's device (_per_node), once asked.
        self._node_index: Optional[torch.Tensor] = None
        self._num_nodes = 0
        self.attached = False
        for name, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{name} must be an int, not {type(v).__name__}")
            if v < 0:
                raise ValueError(f"{name} is {v}; it must be 0 or more")
        self.group = group
        self.comm = comm
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = bool(explicitly_destroy)
        self.elastic = bool(elastic)
        self.enable_shrink = bool(enable_shrink)
        given = dict(job_id=job_id, rank=rank, world_size=world_size, local_rank=local_rank,
                     local_world_size=local_world_size)
        self.socket = _socket_path(socket)
        if group is not None:
            self.identity: Identity = from_group(group, daemon_socket=self.socket, **given)
        else:
            self.identity = from_environment(**given)
            if comm is not None and comm.Get_size() != self.identity.world_size:
                raise ValueError(f"comm has {comm.Get_size()} ranks but world_size is "
                                 f"{self.identity.world_size}; pass the expert-parallel "
                                 "communicator")
        self.rank = self.identity.rank
        self.group_size = self.identity.world_size
        self.hidden = self._opt_int("hidden", hidden)
        self.num_experts = self._opt_int("num_experts", num_experts)
        self.num_topk = self._opt_int("num_topk", num_topk)
        self.max_tokens_per_rank = self._opt_int(
            "max_tokens_per_rank", max_tokens_per_rank, "DEEPEP_MAX_TOKENS_PER_RANK")
        self.max_ll_tokens_per_rank = self._opt_int(
            "max_ll_tokens_per_rank", max_ll_tokens_per_rank, "DEEPEP_MAX_LL_TOKENS_PER_RANK")
        self._connect()
        if None not in (self.hidden, self.num_experts, self.num_topk):
            self._attach()

    # ---- set-up -----------------------------------------------------------

    def _connect(self) -> None:
        """The constructor's connection: the library loaded, the daemon connected and asked
        its backend, and the Buffer's device chosen from it; each step timed."""
        #: Where the constructor's (and the attach's) time went, in ms: load (the library,
        #: once per process), connect, status (the daemon's backend), device, attach
        #: (dep_attach: attach_times() splits it), prepare (this binding's per-job state).
        self.init_times: dict = {}
        t = _clock()
        lib = _lib.load()
        t = self._lap("load", t)
        self._conn = _Conn(lib)
        self._conn.check(lib.dep_connect(self._conn.ptr, self.socket.encode()), "dep_connect")
        t = self._lap("connect", t)
        self.backend = self._daemon_backend()
        self._host = self.backend == "host"
        t = self._lap("status", t)
        self.device = torch.device("cpu") if self._host else \
            torch.device("cuda", torch.cuda.current_device())
        self._dev_index = self.device.index
        self._lap("device", t)

    def _lap(self, name: str, t0: int) -> int:
        t = _clock()
        self.init_times[name] = (t - t0) / 1e6
        return t

    def _daemon_backend(self) -> str:
        st = ctypes.POINTER(_lib.Status)()
        self._conn.check(self._conn.lib.dep_status(self._conn.ptr, ctypes.byref(st)), "dep_status")
        try:
            return st.contents.backend.decode()
        finally:
            self._conn.lib.dep_status_free(st)

    def _device_uuid(self) -> bytes:
        if self.backend == "host":
            return bytes(16)
        return _cuda_uuid(self.device.index)

    def _default_max_tokens(self) -> int:
        """max_tokens_per_rank where neither the constructor nor the environment gave it."""
        return max(DEFAULT_MAX_TOKENS_PER_RANK, self.max_ll_tokens_per_rank or 0)

    def _attach(self) -> None:
        if self.max_tokens_per_rank is None:
            self.max_tokens_per_rank = self._default_max_tokens()
        if self.max_ll_tokens_per_rank is None:
            self.max_ll_tokens_per_rank = min(self.max_tokens_per_rank,
                                              DEFAULT_MAX_LL_TOKENS_PER_RANK)
        if self.max_ll_tokens_per_rank > self.max_tokens_per_rank:
            raise ValueError(f"max_ll_tokens_per_rank {self.max_ll_tokens_per_rank} exceeds "
                             f"max_tokens_per_rank {self.max_tokens_per_rank}")
        if self.num_experts % self.group_size != 0:
            raise ValueError(f"num_experts {self.num_experts} is not divisible by the world "
                             f"size {self.group_size}")
        ident = self.identity
        a = _lib.AttachArgs()
        a.job_id = ident.job_id.encode()
        a.rank, a.world_size = ident.rank, ident.world_size
        a.local_rank, a.local_world_size = ident.local_rank, ident.local_world_size
        t = _clock()
        ctypes.memmove(a.device_uuid, self._device_uuid(), 16)
        t = self._lap("uuid", t)
        a.shape.max_tokens_per_rank = self.max_tokens_per_rank
        a.shape.hidden = self.hidden
        a.shape.num_experts = self.num_experts
        a.shape.topk = self.num_topk
        a.shape.dtype = _lib.DTYPE_BF16
        a.shape.max_ll_tokens_per_rank = self.max_ll_tokens_per_rank
        a.flags = _lib.ATTACH_ELASTIC if self.elastic else 0
        self._conn.check(self._conn.lib.dep_attach(self._conn.ptr, ctypes.byref(a)), "dep_attach")
        t = self._lap("attach", t)
        self.attached = True
        self.num_local_experts = self.num_experts // self.group_size
        self._prepare()
        self._lap("prepare", t)

    def _prepare(self) -> None:
        """What every call of this job shape reuses: argument structs (only pointers and
        counts change per call), their byrefs, the bound C functions, and the scratch a
        dispatch's counts land in before they are read out as a list: host memory (on cuda
        the library copies them there from a device scratch, recv_count_per_expert_host,
        behind its kernels and before the wait it makes anyway, so the list needs no copy
        and no synchronisation of its own).  The device scratch serves only dispatches that
        wait (each is done with it when it returns); one with num_worst_tokens, which may
        still be running on its stream, or be captured in a graph, gets counts of its own."""
        lib = self._conn.lib
        self._fn_layout, self._fn_dispatch = lib.dep_layout, lib.dep_dispatch
        self._fn_combine = lib.dep_combine
        self._fn_ll_dispatch, self._fn_ll_combine = lib.dep_ll_dispatch, lib.dep_ll_combine
        #: The sizes this job's outputs have, from the library (dep_shape_sizes).
        self.sizes = self._shape_sizes()
        self._rows = self.sizes["recv_rows"]
        self._ll_rows = self.sizes["ll_recv_rows"]
        self._num_recv = ctypes.c_uint32(0)
        self._la = _lib.LayoutArgs()
        self._da = _lib.DispatchArgs()
        self._da.num_recv = ctypes.addressof(self._num_recv)
        # The library writes the received ids as int64, DeepEP's topk_idx_t (no widening copy).
        self._da.recv_index_type = _lib.INDEX_I64
        self._ca = _lib.CombineArgs()
        self._lla = _lib.LLDispatchArgs()
        self._llca = _lib.LLCombineArgs()
        self._la_ref, self._da_ref, self._ca_ref = (
            ctypes.byref(self._la), ctypes.byref(self._da), ctypes.byref(self._ca))
        self._lla_ref, self._llca_ref = ctypes.byref(self._lla), ctypes.byref(self._llca)
        self._counts_host = (ctypes.c_int32 * self.num_local_experts)()
        self._counts_addr = ctypes.addressof(self._counts_host)
        self._protos: dict = {}
        self._tp_protos: dict = {}
        self._ll_protos: list = [None, None]
        self._da_mode: Any = None
        self._counts_dev = None if self._host else \
            self._empty([self.num_local_experts], torch.int32)

    def _shape_sizes(self) -> dict:
        """dep_shape_sizes of this Buffer's job shape: what the outputs are sized for."""
        sh = _lib.JobShape(self.max_tokens_per_rank, self.hidden, self.num_experts,
                           self.num_topk, _lib.DTYPE_BF16, self.max_ll_tokens_per_rank)
        out = _lib.ShapeSizes()
        self._conn.check(self._conn.lib.dep_shape_sizes(self._conn.ptr, ctypes.byref(sh),
                                                        self.group_size, ctypes.byref(out)),
                         "dep_shape_sizes")
        return {name: getattr(out, name) for name, _ in out._fields_ if name != "size"}

    # ---- tensors ----------------------------------------------------------

    def _empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def _new(self, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A fresh, uninitialised, contiguous tensor on this Buffer's device, as
        torch.empty(shape, dtype=dtype, device=...) makes: torch.empty_like of a one-element
        prototype expanded to the shape (made once per shape and dtype), which skips
        torch.empty's parsing of its shape, dtype and device arguments: about 1 us less per
        output tensor on the dev machine (bench/py_overhead.py).  (empty_like of an expanded,
        so overlapping, tensor is contiguous.)"""
        p = self._protos.get((shape, dtype))
        if p is None:
            if 0 in shape:  # nothing to expand to; rare, not cached
                return torch.empty(shape, dtype=dtype, device=self.device)
            if len(self._protos) >= _PROTOS:
                self._protos.clear()
            p = self._protos[(shape, dtype)] = \
                torch.empty((1,), dtype=dtype, device=self.device).expand(shape)
        return torch.empty_like(p)

    def _tp_prototypes(self, rows: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prototypes (as _new's) of a bf16 dispatch's recv_x, recv_topk_idx and
        recv_topk_weights of `rows` rows, kept per row count: the usual call then makes its
        outputs with three empty_like calls and no look-ups."""
        if len(self._tp_protos) >= _PROTOS:
            self._tp_protos.clear()
        k = self.num_topk
        one = lambda dtype: torch.empty((1,), dtype=dtype, device=self.device)  # noqa: E731
        pr = self._tp_protos[rows] = (one(torch.bfloat16).expand((rows, self.hidden)),
                                      one(torch.int64).expand((rows, k)),
                                      one(torch.float32).expand((rows, k)))
        return pr

    def _ll_prototypes(self, fp8: bool) -> tuple:
        """The prototypes of low_latency_dispatch's recv_x, scales (FP8; else None) and
        recv_count, made at the first call of each FP8 setting."""
        L, rows, hid = self.num_local_experts, self._ll_rows, self.hidden
        one = lambda dtype: torch.empty((1,), dtype=dtype, device=self.device)  # noqa: E731
        pr = self._ll_protos[fp8] = (
            one(fp8_dtype if fp8 else torch.bfloat16).expand((L, rows, hid)),
            one(torch.float32).expand((L, rows, hid // _FP8_GROUP)) if fp8 else None,
            one(torch.int32).expand((L,)))
        return pr

    def _stream(self) -> int:
        """cuda: the caller's current stream on this Buffer's device, as its raw CUstream;
        the first time one is seen, its torch.cuda.Stream is kept too (_stream_of)."""
        raw = _raw_stream(self._dev_index) if _raw_stream is not None else \
            torch.cuda.current_stream(self.device).cuda_stream
        if raw not in self._streams:
            if len(self._streams) >= _STREAMS:
                self._streams.clear()
            self._streams[raw] = torch.cuda.current_stream(self.device)
        return raw

    def _event(self, previous_event: Optional[EventOverlap], async_finish: bool) -> EventOverlap:
        if not async_finish:
            return EventOverlap(None)
        if self._host:
            return EventOverlap(EventHandle(cuda=False))
        # On the current stream, as EventHandle() records, given as the Stream kept for it.
        return EventOverlap(EventHandle(cuda=True, stream=self._streams[self._stream()]))

    def _fail(self, rc: int, call: str) -> None:
        raise from_code(rc, self._conn.errmsg(), call)

    def _wait(self, previous_event: Optional[EventOverlap]) -> None:
        """Make the current stream wait for previous_event (nothing on the host backend)."""
        if previous_event is None or previous_event.event is None:
            return
        ev = previous_event.event
        if not self._host and type(ev) is EventHandle and ev.event is not None:
            ev.event.wait(self._streams[self._stream()])  # current_stream_wait(), as kept
        else:
            previous_event.current_stream_wait()

    # ---- DeepEP's class-level helpers ---------------------------------------

    @classmethod
    def set_num_sms(cls, new_num_sms: int) -> None:
        """Set Buffer.num_sms (even, positive), as DeepEP's; recorded, not used by deepepd."""
        if not isinstance(new_num_sms, int) or isinstance(new_num_sms, bool):
            raise TypeError(f"new_num_sms must be an int, not {type(new_num_sms).__name__}")
        if new_num_sms <= 0 or new_num_sms % 2 != 0:
            raise ValueError(f"new_num_sms is {new_num_sms}; it must be even and positive")
        cls.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An EventOverlap on an event captured on the current stream now."""
        return EventOverlap(EventHandle())

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether kernels for sm_90 are available: the library's fatbin carries them."""
        return True

    @staticmethod
    def _num_ranks(call: str, num_ranks: int) -> None:
        if not isinstance(num_ranks, int) or isinstance(num_ranks, bool):
            raise TypeError(f"{call}: num_ranks must be an int, not {type(num_ranks).__name__}")
        if num_ranks <= 0:
            raise ValueError(f"{call}: num_ranks is {num_ranks}; it must be positive")

    @classmethod
    def _config(cls, call: str, table: dict, num_ranks: int) -> Config:
        """Config(cls.num_sms, *table's row for num_ranks): DeepEP's row where its table has
        one, else the row of the next larger rank count it lists (its largest past them):
        DeepEP asserts there, but deepepd serves any world, and its kernels do not read the
        Config (callers size buffers from its hints).  cls's num_sms, so that a subclass's
        set_num_sms (deep_ep.Buffer's) is the one its configs carry, as DeepEP's."""
        cls._num_ranks(call, num_ranks)
        n = min((k for k in table if k >= num_ranks), default=max(table))
        return Config(cls.num_sms, *table[n])

    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> Config:
        """DeepEP's recommended dispatch Config for num_ranks ranks (a positive int), with
        num_sms as set_num_sms last set it: its table's row (_DISPATCH_CONFIGS), or for a
        rank count it does not list the next larger one's.  deepepd's kernels do not read
        it; callers size buffers from its hints and pass it back."""
        return cls._config("get_dispatch_config", _DISPATCH_CONFIGS, num_ranks)

    @classmethod
    def get_combine_config(cls, num_ranks: int) -> Config:
        """DeepEP's recommended combine Config for num_ranks ranks; see get_dispatch_config."""
        return cls._config("get_combine_config", _COMBINE_CONFIGS, num_ranks)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """DeepEP's bytes of low-latency buffers for this shape (its LowLatencyLayout's
        total, rounded as DeepEP rounds it: up past the next multiple of 128): two send,
        two receive and two signalling buffers, for dispatch messages (an int4 and the
        larger of bf16 and FP8 with scales) and combine messages (bf16 with a bf16 pair per
        128 channels); independent of num_ranks, as DeepEP's.  deepepd itself sizes memory
        from the job shape."""
        for name, v in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                        ("hidden", hidden), ("num_ranks", num_ranks),
                        ("num_experts", num_experts)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, not {v!r}")
        M, E, scales = num_max_dispatch_tokens_per_rank, num_experts, hidden // _FP8_GROUP
        dispatch_msg = 16 + max(2 * hidden, hidden + scales * 4)
        combine_msg = scales * 4 + 2 * hidden
        send = max(M * dispatch_msg, E * M * combine_msg)
        recv = E * M * max(dispatch_msg, combine_msg)
        signal = (E * 4 + 127) // 128 * 128
        n = 2 * (send + recv + signal)
        return (n + 128) // 128 * 128

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> torch.Tensor:
        """DeepEP's raw buffer as a tensor, for callers that use it as scratch (vLLM zeroes
        the RDMA one).  deepepd's memory is the operations' own and is never handed out:
        this is a buffer of the Buffer's own, num_nvl_bytes (or with use_rdma_buffer
        num_rdma_bytes) bytes on the Buffer's device, made at the first call for it and the
        same memory at every later one.

        Args:
            dtype: the tensor's dtype; the buffer's bytes from `offset` elements of it on.
            size: optional torch.Size: the first size.numel() elements, viewed so.
            offset: elements of dtype to skip (0 or more).
            use_rdma_buffer: the num_rdma_bytes buffer instead of the num_nvl_bytes one.

        Returns:
            a 1-D tensor of dtype over the rest of the buffer, or of shape `size`.
        """
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"get_local_buffer_tensor: offset {offset!r} must be an int >= 0")
        nbytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        raw = self._raw_buffers.get(bool(use_rdma_buffer))
        if raw is None:
            raw = self._raw_buffers[bool(use_rdma_buffer)] = self._empty((nbytes,), torch.uint8)
        elem = torch.empty((), dtype=dtype).element_size()
        t = raw[:nbytes // elem * elem].view(dtype)[offset:]
        if size is None:
            return t
        n = torch.Size(size).numel()
        if n > t.numel():
            raise ValueError(f"get_local_buffer_tensor: size {tuple(size)} needs {n} elements; "
                             f"the {'RDMA' if use_rdma_buffer else 'NVL'} buffer has "
                             f"{t.numel()} of {dtype} past offset {offset} "
                             f"({'num_rdma_bytes' if use_rdma_buffer else 'num_nvl_bytes'} "
                             f"{nbytes})")
        return t[:n].view(size)

    def get_comm_stream(self) -> Any:
        """The stream the Buffer's operations run on: deepepd queues each on the caller's
        current stream (it has no stream of its own), so this is the current
        torch.cuda.Stream of the Buffer's device; None on the host backend, where the
        operations run on the calling thread."""
        if self._host:
            return None
        return torch.cuda.current_stream(self.device)

    def attach_times(self) -> dict:
        """Where the attach's time went, in ms (dep_attach_times: total, wait, map, setup,
        warmup); deepepd's, not DeepEP's."""
        if not self.attached:
            raise Error(-17, "this Buffer has not attached yet", "attach_times")
        t = _lib.AttachTimes()
        self._conn.check(self._conn.lib.dep_attach_times(self._conn.ptr, ctypes.byref(t)),
                         "dep_attach_times")
        return {name: getattr(t, name) for name, _ in t._fields_ if name != "size"}

    # ---- lifetime ---------------------------------------------------------

    def destroy(self) -> None:
        """Free every handle, detach and close the connection (idempotent).  A low-latency
        call whose hook has not run never receives (its hook raises)."""
        self._handles_free()
        self._streams = {}
        if self._conn is not None:
            self._conn.free()
        self.attached = False

    def __del__(self) -> None:
        try:
            self.destroy()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _cuda_uuid(ordinal: int) -> bytes:
    """The 16 bytes of a GPU's UUID: torch's device properties where torch has them (its
    ``uuid.bytes`` is bytes in some versions and a list of 16 ints in others; its str() is
    the UUID with or without "GPU-"), else the driver's cuDeviceGetUuid."""
    props = torch.cuda.get_device_properties(ordinal)
    u = getattr(props, "uuid", None)
    if u is not None:
        b = getattr(u, "bytes", None)
        if isinstance(b, (bytes, bytearray, list, tuple)) and len(b) == 16:
            return bytes(bytearray(b))
        import uuid as _uuid
        try:
            return _uuid.UUID(str(u).replace("GPU-", "").replace("MIG-", "")).bytes
        except ValueError:
            pass
    return _driver_uuid(ordinal)


def _driver_uuid(ordinal: int) -> bytes:
    """cuDeviceGetUuid of the ordinal-th visible device."""
    cuda = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    out = (ctypes.c_char * 16)()
    for call, fn in (("cuInit", lambda: cuda.cuInit(0)),
                     ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), ordinal)),
                     ("cuDeviceGetUuid", lambda: cuda.cuDeviceGetUuid(out, dev))):
        rc = fn()
        if rc != 0:
            raise Error(-13, f"{call} returned CUDA error {rc}", "device uuid")
    return bytes(out)
