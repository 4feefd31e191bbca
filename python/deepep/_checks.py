"""Buffer's argument checking: the dtypes and bounds its operations take, and the checks
every call's tensors and job shape go through, naming what is wrong before anything is
sent (buffer.py's Buffer takes them as the _Checks mixin).  Of the Buffer it uses
attached, _conn (whether it was destroyed), device, backend, the job shape's attributes
and _attach."""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Tuple

import torch

from . import _lib
from .errors import Error

#: The dtype of top-k expert ids (DeepEP's topk_idx_t); int32 is accepted too.
topk_idx_t = torch.int64
#: FP8 e4m3 values: torch.float8_e4m3fn where torch has it, else uint8 holding the same bytes.
fp8_dtype = getattr(torch, "float8_e4m3fn", torch.uint8)

#: max_tokens_per_rank when neither the constructor nor the environment says.
DEFAULT_MAX_TOKENS_PER_RANK = 4096
#: The low-latency bound when neither the constructor, the environment nor an LL call says.
DEFAULT_MAX_LL_TOKENS_PER_RANK = 256
_FP8_GROUP = 128

_BF16 = (torch.bfloat16,)
_F32 = (torch.float32,)
_I32 = (torch.int32,)
_IDX = (torch.int64, torch.int32)

_Tensor = torch.Tensor
_empty_like = torch.empty_like
_INDEX_TYPES = {torch.int64: _lib.INDEX_I64, torch.int32: _lib.INDEX_I32}
# dispatch's test of the usual expert_alignment, in one comparison (_lib.checked_int says what
# is wrong where it fails); num_worst_tokens is bounded by the rows a rank can receive.
_ALIGN_MAX = _lib.c_range(_lib.field_type(_lib.DispatchArgs, "expert_alignment"))[1]

#: dep_job_shape's field of each shape attribute of Buffer (the others have their own names).
_SHAPE_FIELDS = {"num_topk": "topk"}


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


class _Checks:
    """The argument checks of Buffer's operations (a mixin of Buffer)."""

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

    def _topk(self, op: str, topk_idx: Any, num_tokens: Optional[int]) -> Tuple[torch.Tensor, int]:
        idx = self._input("topk_idx", topk_idx, _IDX, 2)
        if num_tokens is not None and idx.size(0) != num_tokens:
            raise ValueError(f"{op}: topk_idx has {idx.size(0)} rows but x has {num_tokens}")
        return idx, _lib.INDEX_I64 if idx.dtype == torch.int64 else _lib.INDEX_I32

    def _tokens_fit(self, op: str, n: int, bound: int, name: str) -> None:
        if n > bound:
            raise ValueError(f"{op}: {n} tokens exceed {name} {bound} of this Buffer's job")
