"""deepep.Buffer: DeepEP's Buffer over libdeepep-client, needing no process group.

A Buffer is one rank of one job.  Its identity (job id, ranks) comes from
the process group where one is given, else from arguments or the
launcher's environment (identity.py); its memory is the
daemon's, lent at attach for one job shape (hidden, num_experts, top-k,
token bounds).  The shape is given to the constructor, or taken from the
first operation that reveals it: the Buffer then attaches there, and every
later call must have the same shape (a Buffer serves one shape).
"""
from __future__ import annotations

import ctypes
import os
import time
from typing import Any, Optional, Sequence, Tuple, Union

import torch

from . import _lib
from .config import Config
from .errors import Error, InvalidArgument, Unsupported, from_code
from .event import EventHandle, EventOverlap
from .handle import Handle, HandlePools, _capturing
from .identity import Identity, from_environment, from_group

#: The dtype of top-k expert ids (DeepEP's topk_idx_t); int32 is accepted too.
topk_idx_t = torch.int64
#: FP8 e4m3 values: torch.float8_e4m3fn where torch has it, else uint8 holding the same bytes.
fp8_dtype = getattr(torch, "float8_e4m3fn", torch.uint8)

#: max_tokens_per_rank when neither the constructor nor the environment says.
DEFAULT_MAX_TOKENS_PER_RANK = 4096
#: The low-latency bound when neither the constructor, the environment nor an LL call says.
DEFAULT_MAX_LL_TOKENS_PER_RANK = 256
_FP8_GROUP = 128
#: cuda: torch.cuda.Streams kept per Buffer by raw stream (_stream_of).
_STREAMS = 256
#: Prototypes kept per Buffer for _new (one per output shape and dtype seen).
_PROTOS = 1024
_BF16 = (torch.bfloat16,)
_F32 = (torch.float32,)
_I32 = (torch.int32,)
_IDX = (torch.int64, torch.int32)


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


def _no_hook() -> None:
    """The receive hook of a call made without return_recv_hook (it has received)."""


class _Deferred:
    """A low-latency call made with return_recv_hook: its exchange, run by its hook (or by
    the Buffer's next operation, which runs every deferred one first, in call order)."""

    __slots__ = ("run", "done")

    def __init__(self, run: Any):
        self.run = run
        self.done = False


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


_Tensor = torch.Tensor
_empty_like = torch.empty_like
_INDEX_TYPES = {torch.int64: _lib.INDEX_I64, torch.int32: _lib.INDEX_I32}
# dispatch's test of the usual expert_alignment, in one comparison (_lib.checked_int says what
# is wrong where it fails); num_worst_tokens is bounded by the rows a rank can receive.
_ALIGN_MAX = _lib.c_range(_lib.field_type(_lib.DispatchArgs, "expert_alignment"))[1]


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

#: dep_job_shape's field of each shape attribute of Buffer (the others have their own names).
_SHAPE_FIELDS = {"num_topk": "topk"}


def _token_in_rank(idx: torch.Tensor, num_experts: int, world: int) -> torch.Tensor:
    """[num_tokens, world] bool: whether rank r owns one of token t's experts (int64 ids,
    -1 for none; expert e is rank e // (num_experts / world)'s), as dep_layout's
    token_in_rank."""
    owner = torch.where(idx >= 0, idx // (num_experts // world), torch.full_like(idx, -1))
    ranks = torch.arange(world, dtype=torch.int64, device=idx.device)
    return (owner.unsqueeze(2) == ranks.view(1, 1, world)).any(1)


def _shape_int(what: str, name: str, v: object) -> int:
    """v as Buffer's job shape attribute `name` (hidden, num_experts, num_topk,
    max_tokens_per_rank, max_ll_tokens_per_rank), said by `what`: positive and within its
    dep_job_shape field; the library checks the shape's own bounds."""
    return _lib.checked_int(what, v, _lib.field_type(_lib.JobShape, _SHAPE_FIELDS.get(name, name)),
                            lo=1)


def _ok(t: Any, dtype: torch.dtype, ndim: int, device: torch.device) -> bool:
    """The common case of an input check, in one test (the caller then runs the detailed
    checks, which name what is wrong, only where this fails)."""
    return type(t) is _Tensor and t.dtype is dtype and t.dim() == ndim and t.device == device


class Buffer(HandlePools):
    """One rank's side of deepepd's dispatch and combine, with DeepEP's methods.

    Args (DeepEP's, in DeepEP's order; accepted for compatibility):
        group: a torch.distributed ProcessGroup (the expert-parallel group), or None.  Where
            given, the job's identity is the group's (identity.from_group): rank and world
            size are the group's, the local ranks its members on this host, and the job id
            is agreed over the group in one collective at construction (which every member
            must make); nothing else is sent over it.  Each Buffer so made is a job of its
            own, so several groups in one world, and one process in several groups, work.
        num_nvl_bytes, num_rdma_bytes: kept as attributes; deepepd sizes memory from the
            job shape.
        low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
            use_fabric, explicitly_destroy, enable_shrink: accepted and kept; they change
            nothing here.
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
                 max_ll_tokens_per_rank: Optional[int] = None):
        self._conn: Optional[_Conn] = None
        #: Low-latency calls made with return_recv_hook whose hooks have not run yet, in
        #: call order (_defer).
        self._pending: list = []
        #: get_next_low_latency_combine_buffer's tensor, and get_local_buffer_tensor's
        #: buffers (use_rdma_buffer -> uint8 tensor), made at their first call.
        self._ll_combine_buf: Optional[torch.Tensor] = None
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
        given = dict(job_id=job_id, rank=rank, world_size=world_size, local_rank=local_rank,
                     local_world_size=local_world_size)
        if group is not None:
            self.identity: Identity = from_group(group, **given)
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
        if socket is not None and not isinstance(socket, str):
            raise TypeError(f"socket must be a path (str), not {type(socket).__name__}")
        if socket is not None and "\0" in socket:
            # C would read the path up to the NUL, and connect to another socket than named.
            raise ValueError(f"socket {socket!r} contains a NUL character, which no path can")
        self.socket = socket or os.environ.get(_lib.SOCKET_ENV) or _lib.DEFAULT_SOCKET

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
        if None not in (self.hidden, self.num_experts, self.num_topk):
            self._attach()

    # ---- set-up -----------------------------------------------------------

    def _lap(self, name: str, t0: int) -> int:
        t = _clock()
        self.init_times[name] = (t - t0) / 1e6
        return t

    @staticmethod
    def _opt_int(name: str, v: Optional[int], env: Optional[str] = None) -> Optional[int]:
        """A job shape field given to the constructor (else from $env, where one is named), or
        None: positive, and within its field of dep_job_shape (_shape_int)."""
        what = name
        if v is None and env is not None and os.environ.get(env):
            what = f"${env}"
            try:
                v = int(os.environ[env])
            except ValueError:
                raise ValueError(f"${env}={os.environ[env]!r} is not an integer") from None
        if v is None:
            return None
        return _shape_int(what, name, v)

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

    def _shape(self, op: str, hidden: Optional[int], num_experts: Optional[int],
               topk: Optional[int], ll_tokens: Optional[int] = None) -> bool:
        """Attach on the first call that completes the shape; later calls must match it.
        True once attached; False only for get_dispatch_layout on a shape that lacks just
        hidden (what it gives is recorded; the first dispatch gives hidden and attaches)."""
        if self.attached and (hidden is None or hidden == self.hidden) and \
                (num_experts is None or num_experts == self.num_experts) and \
                (topk is None or topk == self.num_topk) and \
                (ll_tokens is None or ll_tokens == self.max_ll_tokens_per_rank):
            return True
        if self._conn is None or self._conn.ptr is None:
            raise Error(-17, "this Buffer was destroyed", op)
        given = {"hidden": hidden, "num_experts": num_experts, "num_topk": topk,
                 "max_ll_tokens_per_rank": ll_tokens}
        what = {"hidden": "x.size(1)", "num_experts": "num_experts", "num_topk":
                "topk_idx.size(1)", "max_ll_tokens_per_rank": "num_max_dispatch_tokens_per_rank"}
        if op == "clean_low_latency_buffer":
            what["hidden"] = "hidden"  # an argument of its own there, not x's width
        for name, v in given.items():
            if v is not None:  # every one, before any is taken
                _shape_int(f"{op}: {what[name]}", name, v)
        for name, v in given.items():
            have = getattr(self, name)
            if v is None:
                continue
            if have is None and not self.attached:
                setattr(self, name, v)
            elif have != v:
                raise ValueError(f"{op}: {what[name]} is {v} but this Buffer's job has {name} "
                                 f"{have}; one Buffer serves one job shape (make another Buffer "
                                 "for another shape)")
        if self.attached:
            return True
        missing = [n for n in ("hidden", "num_experts", "num_topk") if getattr(self, n) is None]
        if missing == ["hidden"] and op == "get_dispatch_layout":
            return False
        if missing:
            raise ValueError(f"{op}: the job shape lacks {', '.join(missing)}, which this call "
                             f"cannot supply; give Buffer({'=..., '.join(missing)}=...)")
        self._attach()
        return True

    # ---- tensors ----------------------------------------------------------

    def _input(self, name: str, t: Any, dtypes: Sequence[torch.dtype], ndim: int) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.dtype in dtypes and t.dim() == ndim and \
                t.device == self.device:
            return t.contiguous()
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name} has dtype {t.dtype}; it must be " +
                            " or ".join(str(d) for d in dtypes))
        if t.dim() != ndim:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; it must have {ndim} dimensions")
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device}; this rank's tensors live on {self.device} "
                             f"({self.backend} backend)")
        return t.contiguous()

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

    def _topk(self, op: str, topk_idx: Any, num_tokens: Optional[int]) -> Tuple[torch.Tensor, int]:
        idx = self._input("topk_idx", topk_idx, _IDX, 2)
        if num_tokens is not None and idx.size(0) != num_tokens:
            raise ValueError(f"{op}: topk_idx has {idx.size(0)} rows but x has {num_tokens}")
        return idx, _lib.INDEX_I64 if idx.dtype == torch.int64 else _lib.INDEX_I32

    def _tokens_fit(self, op: str, n: int, bound: int, name: str) -> None:
        if n > bound:
            raise ValueError(f"{op}: {n} tokens exceed {name} {bound} of this Buffer's job")

    def _defer(self, run: Any) -> Any:
        """return_recv_hook: queue run (the call's whole exchange, with its inputs already
        copied) and return the hook that runs it.  A hook runs every call deferred before
        its own first, and every operation of the Buffer made without a hook runs them all
        before its own, so the library sees each rank's calls in the order the caller made
        them (which every rank of a job makes in one order, as DeepEP requires)."""
        d = _Deferred(run)
        self._pending.append(d)  # behind the hooked calls before it, which it does not run
        return lambda: self._complete(d)

    def _complete(self, d: Optional[_Deferred] = None) -> None:
        """Run the deferred calls up to d (all of them where d is None), in call order; a
        hook called again does nothing."""
        while self._pending and (d is None or not d.done):
            first = self._pending.pop(0)
            first.done = True
            first.run()
        if d is not None and not d.done:
            raise Error(-17, "this Buffer was destroyed before the hook ran; its call never "
                        "made its exchange", "hook")

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

    # ---- throughput mode --------------------------------------------------

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
                num_tokens_per_expert: get_dispatch_layout's results; accepted, and only their
                sizes are checked (the library derives the layout from topk_idx itself).
            topk_idx: [num_tokens, num_topk] int64 (or int32), -1 for none.
            topk_weights: [num_tokens, num_topk] float32.
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
            recv_topk_idx: [rows, num_topk] int64 local expert ids, -1 where not ours.
            recv_topk_weights: [rows, num_topk] float32, 0 where not ours.
            num_recv_tokens_per_expert_list: [num_local_experts] ints, (row, k) pairs per
                local expert (rounded up to expert_alignment).
            handle: for the matching combine (and cached dispatches).
            event: an EventOverlap.
            In cached mode: (recv_x, None, None, None, None, event).
        """
        op = "dispatch"
        if self._pending:
            self._complete()
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
        cached = handle is not None
        h = self._handle(op, handle, "dispatch") if cached else None
        if cached:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("dispatch: with handle= (cached mode) the handle routes the "
                                 "tokens; pass no topk_idx or topk_weights")
            if expert_alignment != 1:
                raise ValueError("dispatch: expert_alignment has no effect in cached mode "
                                 "(no counts are returned); leave it 1")
            num_worst_tokens = num_worst_tokens or h.worst
        elif topk_idx is None or topk_weights is None:
            raise ValueError("dispatch: topk_idx and topk_weights are required (or a handle, "
                             "for cached mode)")
        # Whether the current stream captures a CUDA graph: asked once a call (the Handle
        # takes the answer).
        capturing = False if self._host else _capturing()
        if capturing and not cached and num_worst_tokens == 0:
            raise Unsupported("dispatch inside a CUDA-graph capture without num_worst_tokens",
                              "dep_dispatch waits on the host for its row count; give "
                              "num_worst_tokens (outputs of that many rows, no wait)")
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
                # DeepEP's packed UE8M0 scales (four exponents an int): README lists them as
                # not there yet, which is Unsupported, not a wrong dtype.
                raise Unsupported("dispatch with int32 (packed UE8M0) FP8 scales",
                                  "give float32 scales, one per token and 128 channels")
            scales = self._input("x scales", scales, _F32, 2)
        if cached:
            if not fp8:
                x = self._input("x", x, _BF16, 2)
            if x.size(0) != h.num_tokens:
                raise ValueError(f"dispatch: x has {x.size(0)} tokens but the handle's dispatch "
                                 f"had {h.num_tokens}; cached mode moves the same tokens")
            itype, idx, w = _lib.INDEX_I64, None, None
        else:
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
                x, idx, w = x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous()
            else:
                if not fp8:
                    x = self._input("x", x, _BF16, 2)
                idx, itype = self._topk(op, topk_idx, x.size(0))
                w = self._input("topk_weights", topk_weights, _F32, 2)
                if w.shape != idx.shape:
                    raise ValueError(f"dispatch: topk_weights has shape {tuple(w.shape)} but "
                                     f"topk_idx {tuple(idx.shape)}")
        n, hx = x.shape
        if fp8 and tuple(scales.shape) != (n, hx // _FP8_GROUP):
            raise ValueError(f"dispatch: FP8 scales have shape {tuple(scales.shape)}; expected "
                             f"{(n, hx // _FP8_GROUP)} (float32, one per token and "
                             f"{_FP8_GROUP} channels)")
        if not cached:
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
        rows = num_worst_tokens or (h.num_recv if cached else self._rows)
        if rows is None:  # pragma: no cover - h.worst is set whenever num_recv is unknown
            raise Error(-17, "the handle's row count is unknown", op)
        k, hid = self.num_topk, self.hidden
        a = self._da
        # The fields that stay as they were while the call's mode does (set when it changes).
        mode = (fp8, cached, num_worst_tokens, expert_alignment, itype)
        if mode != self._da_mode:
            a.use_fp8, a.cached = int(fp8), int(cached)
            a.num_worst_tokens, a.expert_alignment = num_worst_tokens, expert_alignment
            a.index_type = itype
            a.x_scales = a.recv_x_scales = None
            # The counts (_prepare): none cached; on the host backend straight into the host
            # scratch; on cuda, where the call waits, the device scratch and a copy to the
            # host one; with num_worst_tokens, per call (below), none copied.
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
        # The caller's current stream, looked up once per call (None on the host backend).
        cs = None if self._host else self._stream()
        recv_s = None
        if fp8 or cached:
            # A row at least, so that the pointers are never NULL (a cached dispatch may
            # receive none), shrunk below once the call is made.
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
                counts = self._new((self.num_local_experts,), torch.int32)  # alive to return
                a.recv_count_per_expert = counts.data_ptr()
            h = Handle(self, "dispatch", n, stream=cs, capturing=capturing)
            if n:
                a.topk_idx, a.topk_weights = idx.data_ptr(), w.data_ptr()
            else:
                a.topk_idx = a.topk_weights = None
            a.recv_topk_idx, a.recv_topk_weights = recv_idx.data_ptr(), recv_w.data_ptr()
        a.num_tokens = n
        num_recv = self._num_recv
        if num_worst_tokens:
            num_recv.value = 0  # not written with num_worst_tokens
        if previous_event is not None:
            self._wait(previous_event)
        if cached and cs is not None:
            self._use(h, cs, capturing)
        rc = self._fn_dispatch(self._conn.ptr, self._da_ref, h._ptr, cs)
        if rc:
            self._fail(rc, "dep_dispatch")
        ev = self._event(previous_event, async_finish) if async_finish else EventOverlap(None)
        if rows != alloc:
            recv_x.resize_((rows, hid))
            if fp8:
                recv_s.resize_((rows, hid // _FP8_GROUP))
        out_x = (recv_x, recv_s) if fp8 else recv_x
        if cached:
            return out_x, None, None, None, None, ev
        h.worst = num_worst_tokens
        if num_worst_tokens:
            h.num_recv = num_recv.value if self._host else None
            return out_x, recv_idx, recv_w, [], h, ev
        r = h.num_recv = num_recv.value
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
                two such tensors (or None in their place), DeepEP's bias_0 and bias_1: added to
                the combined rows, after the library's combine, as
                bf16(float32(combined_x) + float32(bias_0) + float32(bias_1)).  DeepEP adds
                them to its float32 sum before its one rounding; here the sum has been rounded
                to bfloat16 first, so a result may differ from DeepEP's by that rounding.  On
                cuda the additions are torch ops queued on the caller's current stream, after
                the combine and before the returned event.
            config, previous_event, async_finish, allocate_on_comm_stream: as DeepEP's.

        Returns:
            combined_x: [num_tokens, hidden] bfloat16 of the dispatching rank, plus bias
                (not weighted: weigh the rows before combine).
            combined_topk_weights: with topk_weights, [num_tokens, num_topk] float32, the sum
                over the ranks that received each token (so the dispatch's recv_topk_weights
                combine to the original weights); else None.
            event: an EventOverlap.
        """
        if self._pending:
            self._complete()
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
        if previous_event is not None:
            self._wait(previous_event)
        cs = None
        if not self._host:
            cs = self._stream()
            self._use(h, cs, _capturing())
        rc = self._fn_combine(self._conn.ptr, self._ca_ref, h._ptr, cs)
        if rc:
            self._fail(rc, "dep_combine")
        if biases and nt:
            # On the current stream, behind the combine (cuda), as DeepEP's kernel adds them
            # before the event it records; in float32, rounded to bfloat16 once.
            acc = out.float()
            for b in biases:
                acc += b
            out.copy_(acc)
        return out, out_w, \
            self._event(previous_event, async_finish) if async_finish else EventOverlap(None)

    def _biases(self, bias: Any, num_tokens: int) -> list:
        """combine's bias (DeepEP's: a tensor, or a tuple of bias_0 and bias_1, either None)
        as the list of tensors to add, each checked to be [num_tokens, hidden] bfloat16 on
        this Buffer's device (the combine's dtype, as DeepEP requires), before the combine
        is sent (a wrong one must not leave the other ranks' combine done and this one's not)."""
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

    # ---- low-latency mode -------------------------------------------------

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
            dispatch_wait_recv_cost_stats: must be None (not supported yet).
            use_fp8: cast to e4m3 with one float32 scale per token and 128 channels
                (scale = max(amax, 1e-4) / 448).
            round_scale, use_ue8m0: must be False (not supported yet).
            async_finish: return an event recorded after the call (cuda).
            return_recv_hook: defer the receive to the hook the call returns (DeepEP's), so
                that the caller can compute between: the call checks its arguments, copies x
                and topk_idx (the caller may write them once it returns) and returns; recv_x,
                recv_count (and the stats) are written when hook() is called, which makes the
                whole exchange then (the library has no separate send and receive: nothing
                overlaps the caller's work; on cuda the kernels are queued on the stream
                current at hook()).  Hooked calls queue behind one another; a hook runs
                those before its own first, and every operation of the Buffer made without a
                hook runs them all before its own, so each rank's calls reach the library in
                call order.  Not with async_finish
                (ValueError, as DeepEP asserts).

        Returns:
            recv_x: [num_local_experts, world_size * max, hidden] bfloat16, or with use_fp8 a
                tuple (values [.., hidden] fp8_dtype, scales [.., hidden // 128] float32 in
                row-major order, unlike DeepEP's column-major scales).  Rows of each local
                expert are packed from row 0 in (source rank, source token) order.
            recv_count: [num_local_experts] int32 valid rows.
            handle: for the matching low_latency_combine.
            event: an EventOverlap.
            hook: with return_recv_hook, the callable that receives; else one that does
                nothing.
        """
        op = "low_latency_dispatch"
        if self._pending and not return_recv_hook:
            self._complete()
        if async_finish and return_recv_hook:
            raise ValueError(f"{op}: async_finish and return_recv_hook cannot both be set "
                             "(DeepEP's rule): the hook receives, so there is no event to "
                             "wait for")
        if dispatch_wait_recv_cost_stats is not None:
            raise Unsupported("low_latency_dispatch(dispatch_wait_recv_cost_stats=...)")
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
        stats = None
        if cumulative_local_expert_recv_stats is not None:
            stats = self._input("cumulative_local_expert_recv_stats",
                                cumulative_local_expert_recv_stats, _I32, 1)
            if stats.numel() != self.num_local_experts or \
                    stats.data_ptr() != cumulative_local_expert_recv_stats.data_ptr():
                raise ValueError("cumulative_local_expert_recv_stats must be a contiguous "
                                 f"[{self.num_local_experts}] int32 tensor")
        fp8 = bool(use_fp8)
        # The outputs, from prototypes kept per FP8 setting (the shapes are the job's).
        pr = self._ll_protos[fp8]
        if pr is None:
            pr = self._ll_prototypes(fp8)
        recv_x, count = _empty_like(pr[0]), _empty_like(pr[2])
        scales = _empty_like(pr[1]) if fp8 else None
        cs = None if self._host else self._stream()
        h = Handle(self, "low_latency_dispatch", n, stream=cs)
        out_x = (recv_x, scales) if fp8 else recv_x
        if return_recv_hook:
            # The exchange runs in the hook; the caller may write x and topk_idx once this
            # returns (DeepEP's send has read them by then), so it runs on copies.
            xc, ic = x.clone(), idx.clone()
            hook = self._defer(lambda: self._ll_dispatch_now(
                xc, ic, itype, n, fp8, recv_x, scales, count, h, stats))
            return out_x, count, h, EventOverlap(None), hook
        self._ll_dispatch_now(x, idx, itype, n, fp8, recv_x, scales, count, h, stats, cs)
        return (out_x, count, h,
                self._event(None, async_finish) if async_finish else EventOverlap(None), _no_hook)

    def _ll_dispatch_now(self, x: torch.Tensor, idx: torch.Tensor, itype: int, n: int,
                         fp8: bool, recv_x: torch.Tensor, scales: Optional[torch.Tensor],
                         count: torch.Tensor, h: Handle, stats: Optional[torch.Tensor],
                         cs: Any = False) -> None:
        """dep_ll_dispatch of checked inputs into the outputs given, on stream cs (False: the
        current stream, looked up now, as a deferred call's hook does: the handle's arrays
        are then used on that stream, which may not be the call's, and maybe in a capture
        the call was not in, so it is noted as a combine's is)."""
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
        rc = self._fn_ll_dispatch(self._conn.ptr, self._lla_ref, h._ptr, cs)
        if rc:
            self._fail(rc, "dep_ll_dispatch")
        if stats is not None:
            stats += count

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
            use_logfmt: must be False; combine_wait_recv_cost_stats: None.
            zero_copy: read the input from get_next_low_latency_combine_buffer's tensor
                (which the caller has written) instead of x (still checked for its shape).
            async_finish, return_recv_hook: as for low_latency_dispatch (with the hook,
                x, topk_idx and topk_weights, or the zero-copy buffer, are copied at the
                call, and combined_x is written when hook() is called).
            out: optional [num_tokens, hidden] bfloat16 to write into.

        Returns:
            combined_x: [num_tokens, hidden] bfloat16 (out, where given).
            event: an EventOverlap.
            hook: with return_recv_hook, the callable that receives; else one that does
                nothing.
        """
        op = "low_latency_combine"
        if self._pending and not return_recv_hook:
            # The matching dispatch's among them, where its hook has not run (a hooked
            # combine is queued behind it).
            self._complete()
        if async_finish and return_recv_hook:
            raise ValueError(f"{op}: async_finish and return_recv_hook cannot both be set "
                             "(DeepEP's rule): the hook receives, so there is no event to "
                             "wait for")
        if use_logfmt:
            raise Unsupported("low_latency_combine(use_logfmt=True)")
        if combine_wait_recv_cost_stats is not None:
            raise Unsupported("low_latency_combine(combine_wait_recv_cost_stats=...)")
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
            # As low_latency_dispatch's: the exchange runs in the hook, on copies of the
            # inputs (the zero-copy buffer's too), which the caller may write once this returns.
            xc, ic, wc = x.clone(), idx.clone(), w.clone()
            return out, EventOverlap(None), self._defer(
                lambda: self._ll_combine_now(xc, ic, itype, wc, out, nt, h))
        self._ll_combine_now(x, idx, itype, w, out, nt, h)
        return out, self._event(None, async_finish) if async_finish else EventOverlap(None), \
            _no_hook

    def _ll_combine_now(self, x: torch.Tensor, idx: torch.Tensor, itype: int,
                        w: torch.Tensor, out: torch.Tensor, nt: int, h: Handle) -> None:
        """dep_ll_combine of checked inputs into out, on the current stream."""
        a = self._llca
        a.x = x.data_ptr()
        if nt:
            a.topk_idx, a.topk_weights, a.out = idx.data_ptr(), w.data_ptr(), out.data_ptr()
        else:
            a.topk_idx = a.topk_weights = a.out = None
        a.index_type = itype
        cs = None
        if not self._host:
            cs = self._stream()
            self._use(h, cs, _capturing())
        rc = self._fn_ll_combine(self._conn.ptr, self._llca_ref, h._ptr, cs)
        if rc:
            self._fail(rc, "dep_ll_combine")

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
        call whose hook has not run never makes its exchange."""
        self._pending = []
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
