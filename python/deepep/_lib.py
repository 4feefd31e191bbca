"""The ctypes seam to libdeepep-client: the C structs of deepep.h, defined once.

Every struct here mirrors include/deepep.h field for field;
tests/test_abi.py compiles a C program against deepep.h and compares each
struct's size and each field's offset with these, so the two cannot drift.
The library is found, in order, at $DEEPEP_CLIENT_LIB, beside this file,
then through the system loader (libdeepep-client.so.0), once per process: at
`import deepep` (buffer.py), or at the first Buffer(...) where that failed.  So
$DEEPEP_CLIENT_LIB is read when deepep is imported.
"""
from __future__ import annotations

import ctypes
import functools
import os
from ctypes import (POINTER, Structure, c_char, c_char_p, c_double, c_int, c_int32, c_uint8,
                    c_uint32, c_uint64, c_void_p)
from typing import Any, Optional, Tuple

SONAME = "libdeepep-client.so.0"
LIB_ENV = "DEEPEP_CLIENT_LIB"
SOCKET_ENV = "DEEPEPD_SOCKET"
DEFAULT_SOCKET = "/run/deepepd/deepepd.sock"

UUID_STR_LEN = 37
JOB_ID_MAX = 64
MAX_WORLD = 4096
MAX_LOCAL_RANKS = 64
#: dep_job_shape's largest topk (proto/shape.h DEP_SHAPE_MAX_TOPK).
MAX_TOPK = 16

ATTACH_ELASTIC = 0x1  # DEP_ATTACH_ELASTIC
STATUS_MASK_TEXT = 128  # DEP_STATUS_MASK_TEXT
DTYPE_BF16 = 1
DTYPE_FP8_E4M3 = 2
INDEX_I64 = 1
INDEX_I32 = 2
LL_SEND = 1  # DEP_LL_SEND
LL_RECV = 2  # DEP_LL_RECV

# The error table's codes that Python code names (deepep.h DEP_ERRNO_MAP).
ERR_INVALID = -1
ERR_NO_DAEMON = -5
ERR_UNSUPPORTED = -16
ERR_STATE = -17


class JobShape(Structure):
    """struct dep_job_shape."""
    _fields_ = [
        ("max_tokens_per_rank", c_uint32),
        ("hidden", c_uint32),
        ("num_experts", c_uint32),
        ("topk", c_uint32),
        ("dtype", c_uint32),
        ("max_ll_tokens_per_rank", c_uint32),
    ]


class _Sized(Structure):
    """A struct that begins with its size (deepep.h: structs grow): set
    to this struct's sizeof at construction; positional arguments fill the fields after it."""

    def __init__(self, *args, **kwargs):
        super().__init__(ctypes.sizeof(type(self)), *args, **kwargs)


class AttachArgs(_Sized):
    """struct dep_attach_args."""
    _fields_ = [
        ("size", c_uint32),
        ("job_id", c_char * JOB_ID_MAX),
        ("rank", c_uint32),
        ("world_size", c_uint32),
        ("local_rank", c_uint32),
        ("local_world_size", c_uint32),
        ("device_uuid", c_uint8 * 16),
        ("shape", JobShape),
        ("flags", c_uint32),
    ]


class AttachInfo(_Sized):
    """struct dep_attach_info."""
    _fields_ = [
        ("size", c_uint32),
        ("backend", c_char * 8),
        ("slab_bytes", c_uint64),
        ("local_rank", c_uint32),
        ("local_world_size", c_uint32),
        ("slabs", c_void_p * MAX_LOCAL_RANKS),
        ("ranks", c_uint32 * MAX_LOCAL_RANKS),
        ("attach_ms", c_double),
    ]


class AttachTimes(_Sized):
    """struct dep_attach_times."""
    _fields_ = [
        ("size", c_uint32),
        ("total_ms", c_double),
        ("wait_ms", c_double),
        ("map_ms", c_double),
        ("setup_ms", c_double),
        ("warmup_ms", c_double),
    ]


class StatusDevice(Structure):
    """struct dep_status_device."""
    _fields_ = [
        ("uuid", c_char * UUID_STR_LEN),
        ("name", c_char * 64),
        ("backend", c_char * 8),
        ("pool_total_bytes", c_uint64),
        ("pool_used_bytes", c_uint64),
        ("pool_cached_bytes", c_uint64),
        ("pool_held_bytes", c_uint64),
    ]


class StatusJob(Structure):
    """struct dep_status_job."""
    _fields_ = [
        ("job_id", c_char * JOB_ID_MAX),
        ("owner_uid", c_uint32),
        ("ranks_attached", c_uint32),
        ("ranks_expected", c_uint32),
        ("world_size", c_uint32),
        ("slab_bytes", c_uint64),
        ("age_ms", c_uint64),
        ("host_bytes", c_uint64),
        ("flags", c_uint32),
        ("masked", c_uint32),
        ("epoch", c_uint64),
        ("mask", c_char * STATUS_MASK_TEXT),
        ("chunk_rows", c_uint32),
    ]


class Status(Structure):
    """struct dep_status (the library's to allocate: dep_status(), below, passes these sizes)."""
    _fields_ = [
        ("size", c_uint32),
        ("device_size", c_uint32),
        ("job_size", c_uint32),
        ("version", c_char * 32),
        ("state", c_char * 16),
        ("proto_version", c_uint32),
        ("pid", c_uint32),
        ("uptime_ms", c_uint64),
        ("backend", c_char * 8),
        ("num_clients", c_uint32),
        ("num_devices", c_uint32),
        ("num_jobs", c_uint32),
        ("devices", POINTER(StatusDevice)),
        ("jobs", POINTER(StatusJob)),
    ]


class LayoutArgs(_Sized):
    """struct dep_layout_args."""
    _fields_ = [
        ("size", c_uint32),
        ("topk_idx", c_void_p),
        ("index_type", c_int),
        ("num_tokens", c_uint32),
        ("tokens_per_rank", c_void_p),
        ("tokens_per_expert", c_void_p),
        ("token_in_rank", c_void_p),
    ]


class DispatchArgs(_Sized):
    """struct dep_dispatch_args."""
    _fields_ = [
        ("size", c_uint32),
        ("x", c_void_p),
        ("topk_idx", c_void_p),
        ("index_type", c_int),
        ("topk_weights", c_void_p),
        ("num_tokens", c_uint32),
        ("recv_x", c_void_p),
        ("recv_topk_idx", c_void_p),
        ("recv_topk_weights", c_void_p),
        ("recv_count_per_expert", c_void_p),
        ("num_recv", c_void_p),
        ("use_fp8", c_int),
        ("x_scales", c_void_p),
        ("recv_x_scales", c_void_p),
        ("cached", c_int),
        ("num_worst_tokens", c_uint32),
        ("expert_alignment", c_uint32),
        ("reserved", c_uint32),
        ("recv_index_type", c_int),
        ("reserved2", c_uint32),
        ("recv_count_per_expert_host", c_void_p),
    ]


class CombineArgs(_Sized):
    """struct dep_combine_args."""
    _fields_ = [
        ("size", c_uint32),
        ("x", c_void_p),
        ("out", c_void_p),
        ("topk_weights", c_void_p),
        ("out_topk_weights", c_void_p),
        ("bias_0", c_void_p),  # appended in 0.6.0
        ("bias_1", c_void_p),
    ]


class LLDispatchArgs(_Sized):
    """struct dep_ll_dispatch_args."""
    _fields_ = [
        ("size", c_uint32),
        ("x", c_void_p),
        ("topk_idx", c_void_p),
        ("index_type", c_int),
        ("num_tokens", c_uint32),
        ("use_fp8", c_int),
        ("recv_x", c_void_p),
        ("recv_scales", c_void_p),
        ("recv_count", c_void_p),
        ("phases", c_uint32),
        ("wait_cost", c_void_p),
    ]


class LLCombineArgs(_Sized):
    """struct dep_ll_combine_args."""
    _fields_ = [
        ("size", c_uint32),
        ("x", c_void_p),
        ("topk_idx", c_void_p),
        ("index_type", c_int),
        ("topk_weights", c_void_p),
        ("out", c_void_p),
        ("phases", c_uint32),
        ("wait_cost", c_void_p),
    ]


class LLHandleInfoArgs(_Sized):
    """struct dep_ll_handle_info_args."""
    _fields_ = [
        ("size", c_uint32),
        ("src_info", c_void_p),
        ("layout_range", c_void_p),
    ]


class ShapeSizes(_Sized):
    """struct dep_shape_sizes."""
    _fields_ = [
        ("size", c_uint32),
        ("max_ll_tokens_per_rank", c_uint32),
        ("local_experts", c_uint32),
        ("scale_groups", c_uint32),
        ("recv_rows", c_uint32),
        ("ll_recv_rows", c_uint32),
        ("slab_bytes", c_uint64),
    ]


# Every struct the ABI test compares, by its C name.
STRUCTS = {
    "dep_job_shape": JobShape,
    "dep_attach_args": AttachArgs,
    "dep_attach_info": AttachInfo,
    "dep_attach_times": AttachTimes,
    "dep_status_device": StatusDevice,
    "dep_status_job": StatusJob,
    "dep_status": Status,
    "dep_layout_args": LayoutArgs,
    "dep_dispatch_args": DispatchArgs,
    "dep_combine_args": CombineArgs,
    "dep_ll_dispatch_args": LLDispatchArgs,
    "dep_ll_combine_args": LLCombineArgs,
    "dep_ll_handle_info_args": LLHandleInfoArgs,
    "dep_shape_sizes": ShapeSizes,
}

# (name, restype, argtypes) of every function the package calls.
_client_p = c_void_p
_PROTOTYPES = [
    ("dep_strerror", c_char_p, [c_int]),
    ("dep_errname", c_char_p, [c_int]),
    ("dep_client_new", c_int, [POINTER(c_void_p)]),
    ("dep_client_free", None, [_client_p]),
    ("dep_errmsg", c_char_p, [_client_p]),
    ("dep_connect", c_int, [_client_p, c_char_p]),
    ("dep_status_sized", c_int, [_client_p, POINTER(POINTER(Status)), c_uint32, c_uint32,
                                 c_uint32]),
    ("dep_status_free", None, [POINTER(Status)]),
    ("dep_attach", c_int, [_client_p, POINTER(AttachArgs)]),
    ("dep_detach", c_int, [_client_p]),
    ("dep_attach_info", c_int, [_client_p, POINTER(AttachInfo)]),
    ("dep_attach_times", c_int, [_client_p, POINTER(AttachTimes)]),
    ("dep_handle_new", c_int, [_client_p, POINTER(c_void_p)]),
    ("dep_handle_bytes", c_int, [_client_p, POINTER(ctypes.c_size_t)]),
    ("dep_handle_new_in", c_int, [_client_p, c_void_p, ctypes.c_size_t, POINTER(c_void_p)]),
    ("dep_handle_free", None, [c_void_p]),
    ("dep_handle_recv_from", c_int, [_client_p, c_void_p, POINTER(c_uint32), c_uint32]),
    ("dep_layout", c_int, [_client_p, POINTER(LayoutArgs), c_void_p]),
    ("dep_dispatch", c_int, [_client_p, POINTER(DispatchArgs), c_void_p, c_void_p]),
    ("dep_combine", c_int, [_client_p, POINTER(CombineArgs), c_void_p, c_void_p]),
    ("dep_ll_dispatch", c_int, [_client_p, POINTER(LLDispatchArgs), c_void_p, c_void_p]),
    ("dep_ll_combine", c_int, [_client_p, POINTER(LLCombineArgs), c_void_p, c_void_p]),
    ("dep_ll_handle_info", c_int, [_client_p, POINTER(LLHandleInfoArgs), c_void_p, c_void_p]),
    ("dep_mask_update", c_int, [_client_p, c_uint32, c_int]),
    ("dep_mask_clear", c_int, [_client_p]),
    ("dep_mask_query", c_int, [_client_p, POINTER(c_int32), c_uint32, POINTER(c_uint64)]),
    ("dep_handle_dropped", c_int, [_client_p, c_void_p, POINTER(c_uint64)]),
    ("dep_next_call", c_int, [_client_p, POINTER(c_uint64)]),
    ("dep_shape_sizes", c_int, [_client_p, POINTER(JobShape), c_uint32, POINTER(ShapeSizes)]),
]

_lib: Optional[ctypes.CDLL] = None


def field_type(struct: Any, field: str) -> Any:
    """The ctypes type of one field of a struct above, e.g. field_type(JobShape, "hidden")."""
    return dict(struct._fields_)[field]


@functools.lru_cache(maxsize=None)
def c_range(ctype: Any) -> Tuple[int, int]:
    """The lowest and highest value a ctypes integer type holds."""
    bits = 8 * ctypes.sizeof(ctype)
    if ctype(-1).value < 0:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def checked_int(name: str, v: object, ctype: Any, lo: Optional[int] = None,
                hi: Optional[int] = None) -> int:
    """v, checked before it crosses into a C field or argument of type ctype: ctypes keeps
    only the low bits of an int too wide for it, so Buffer(num_experts=2**32 + 4) would
    attach with 4.  The range is ctype's, narrowed to lo..hi where the library has a bound
    of its own that the binding knows.

    Raises:
        TypeError: v is not an int (a bool is not taken for one), naming `name`.
        ValueError: v is outside the range, naming `name` and the range.
    """
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name} must be an int, not {type(v).__name__}")
    clo, chi = c_range(ctype)
    lo = clo if lo is None else max(lo, clo)
    hi = chi if hi is None else min(hi, chi)
    if not lo <= v <= hi:
        raise ValueError(f"{name} is {v}; it must be in {lo}..{hi}")
    return v


def _status_call(lib: ctypes.CDLL):
    """lib.dep_status(c, byref(p)), as deepep.h's dep_status() macro: dep_status_sized with
    the sizes of these mirrors, so the library lays the result out as they read it."""
    sized = lib.dep_status_sized
    sizes = (ctypes.sizeof(Status), ctypes.sizeof(StatusDevice), ctypes.sizeof(StatusJob))

    def dep_status(c, out):
        return sized(c, out, *sizes)
    return dep_status


def _candidates() -> list:
    """Where to look for the library, in order, each as (path, how it was chosen)."""
    out = []
    env = os.environ.get(LIB_ENV)
    if env:
        out.append((env, "$" + LIB_ENV))
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), SONAME)
    if os.path.exists(here):
        out.append((here, "the package's directory"))
    out.append((SONAME, "the system loader"))
    return out


def load() -> ctypes.CDLL:
    """The loaded library with its prototypes set (loaded once per process)."""
    global _lib
    if _lib is not None:
        return _lib
    tried = []
    for path, how in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} ({how}): {e}")
            if how.startswith("$"):
                break  # an explicit choice that fails is not silently replaced
            continue
        try:
            for name, restype, argtypes in _PROTOTYPES:
                fn = getattr(lib, name)
                fn.restype = restype
                fn.argtypes = argtypes
        except AttributeError:
            # Another library, or an older libdeepep-client than this package: not one to
            # use, and no reason for `import deepep` to fail (Buffer(...) says what to do).
            tried.append(f"{path} ({how}): it has no {name}, so it is not a libdeepep-client "
                         "of this package's version (an older build, or another library)")
            if how.startswith("$"):
                break
            continue
        lib.dep_status = _status_call(lib)
        _lib = lib
        return lib
    raise OSError("deepep: cannot load libdeepep-client; tried " + "; ".join(tried) +
                  f". This Python package (like a wheel of it) carries no native library: it "
                  f"needs {SONAME}. Install the Debian package libdeepep-client0 (make deb "
                  "builds it), or run make install; ldconfig in the source tree. Build it "
                  f"(make) and set ${LIB_ENV} to build/{SONAME} to use a build in place.")


def errname(code: int) -> str:
    """The symbolic name of a DEP_ERR_* code."""
    return load().dep_errname(code).decode()


def strerror(code: int) -> str:
    """The fixed description of a DEP_ERR_* code."""
    return load().dep_strerror(code).decode()
