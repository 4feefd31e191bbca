"""deep_ep.utils.math: the arithmetic DeepEP 2.x's test scripts import from its package.

DeepEP's tests/legacy/ scripts build their inputs and check their results with these:
calc_diff (a similarity-based error), per_token_cast_to_fp8 / per_token_cast_back (DeepEP's
per-token FP8 layout: e4m3 values with one float32 scale per token and 128 channels),
hash_tensor (a checksum of the bytes), inplace_unique (the distinct ranks a token goes to) and
create_grouped_scores (node-limited routing).  Each does what DeepEP's does, on any device.

FP8 values are torch.float8_e4m3fn where torch has it, else uint8 tensors holding the e4m3
bytes, as deep_ep's own FP8 tensors are (deepep.fp8_dtype; Debian's torch 1.13 has no float8
dtype): per_token_cast_to_fp8 makes that form and per_token_cast_back reads either.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch

from deepep import fp8_dtype

from .. import _fp8

__all__ = ["align", "calc_diff", "ceil_div", "count_bytes", "create_grouped_scores",
           "hash_tensor", "hash_tensors", "inplace_unique", "per_token_cast_back",
           "per_token_cast_to_fp8"]


def ceil_div(x: int, y: int) -> int:
    """x / y rounded up, for non-negative x and positive y."""
    return -(-x // y)


def align(x: int, y: int) -> int:
    """The least multiple of y that is at least x (DeepEP pads hidden sizes to 128 with it)."""
    return ceil_div(x, y) * y


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's error measure between x and y (same shape): 1 - 2 sum(a b) / sum(a^2 + b^2)
    with a = x + 1, b = y + 1, in float64.  It is 0 for equal tensors and grows with the
    squared difference relative to the values' size; the shift by 1 keeps all-zero tensors
    finite.  DeepEP's scripts assert it below a threshold (5e-6 for a BF16 round trip)."""
    a = x.double() + 1
    b = y.double() + 1
    return float(1 - 2 * (a * b).sum() / (a * a + b * b).sum())


def _e4m3_values(q: torch.Tensor) -> torch.Tensor:
    """The float32 values of FP8 e4m3fn q: torch's float8_e4m3fn, or uint8 e4m3 bytes (a sign
    bit, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 is subnormal, m * 2**-9;
    S.1111.111 is NaN), decoded through a table of the 256 bytes."""
    if q.dtype != torch.uint8:
        return q.float()
    byte = torch.arange(256, dtype=torch.int32, device=q.device)
    exp = (byte >> 3) & 0xF
    man = (byte & 7).float()
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).float())
    value = torch.where(exp == 0, man * 2.0 ** -9, normal)
    value = torch.where((byte & 0x7F) == 0x7F, torch.full_like(value, float("nan")), value)
    value = torch.where(byte >= 0x80, -value, value)
    return value[q.long()]


def per_token_cast_to_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's per-token FP8 cast of x [tokens, hidden] (any float dtype; hidden need not be
    a multiple of 128, the last group is padded with zeros): per token and 128 channels,
    amax = max(|x|, 1e-4), values e4m3(x * (448 / amax)) (round to nearest even, saturating),
    scale amax / 448.  Returns (values [tokens, hidden] as deep_ep's FP8 dtype, scales
    [tokens, ceil(hidden / 128)] float32), the form deep_ep's dispatch takes as x."""
    if x.dim() != 2:
        raise ValueError(f"per_token_cast_to_fp8: x must be [tokens, hidden], not {x.dim()}-D")
    m, n = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, align(n, _fp8.GROUP) - n))
    groups = padded.view(m, -1, _fp8.GROUP)
    amax = groups.abs().amax(dim=2).clamp(min=_fp8._AMAX_FLOOR)
    q = _fp8.e4m3_bytes(groups * (_fp8._E4M3_MAX / amax).unsqueeze(2))
    return q.view(m, -1)[:, :n].contiguous().view(fp8_dtype), amax / _fp8._E4M3_MAX


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """x_fp8 [tokens, hidden] times its scales, as bfloat16 [tokens, hidden]: DeepEP's
    inverse of per_token_cast_to_fp8, and how its scripts read what an FP8 dispatch received.
    x_scales is [tokens, ceil(hidden / 128)] float32 (any strides: DeepEP's are column-major),
    or int32 UE8M0 exponents (use_ue8m0), four biased exponent bytes to an int, group 4 j + i
    in byte i, each byte e the scale 2**(e - 127)."""
    if x_fp8.numel() == 0:
        return torch.empty(x_fp8.shape, dtype=torch.bfloat16, device=x_fp8.device)
    if x_fp8.dim() != 2:
        raise ValueError(f"per_token_cast_back: x_fp8 must be [tokens, hidden], not "
                         f"{x_fp8.dim()}-D")
    m, n = x_fp8.shape
    if x_scales.dtype == torch.int32:
        exps = x_scales.contiguous().view(torch.uint8).to(torch.int32)
        x_scales = (exps << 23).view(torch.float32)
    groups = ceil_div(n, _fp8.GROUP)
    if x_scales.numel() != m * groups:
        raise ValueError(f"per_token_cast_back: {m} tokens of hidden {n} have {m * groups} "
                         f"scales (one per {_fp8.GROUP} channels), not {x_scales.numel()}")
    values = torch.nn.functional.pad(_e4m3_values(x_fp8), (0, groups * _fp8.GROUP - n))
    out = values.view(m, groups, _fp8.GROUP) * x_scales.float().reshape(m, groups, 1)
    return out.view(m, -1)[:, :n].to(torch.bfloat16).contiguous()


def hash_tensor(t: torch.Tensor) -> int:
    """A checksum of t's contents, as DeepEP's scripts fold into the hash they print to
    compare runs: the sum of its elements read as int32 when they are 4 bytes wide, else the
    sum of its bytes (any dtype, any strides: t is read contiguous)."""
    t = t.contiguous()
    if t.element_size() == 4:
        return int(t.view(torch.int32).sum().item())
    return int(t.view(torch.uint8).sum().item())


def hash_tensors(*tensors: Any) -> int:
    """The XOR of hash_tensor over tensors (nested tuples and lists are walked; None and
    anything that is not a tensor are skipped)."""
    value = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            value ^= hash_tensors(*t)
        elif isinstance(t, torch.Tensor):
            value ^= hash_tensor(t)
    return value


def count_bytes(*tensors: Any) -> int:
    """The bytes of tensors' elements (nested tuples and lists are walked; None skipped)."""
    total = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif t is not None:
            total += t.numel() * t.element_size()
    return total


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """Each row of x [rows, k] (integers in [0, num_slots), -1 for none) replaced in place by
    its distinct values in descending order, then -1 to the row's end; at most num_slots
    columns can hold a value.  DeepEP's scripts turn top-k experts' ranks into the set of
    ranks a token goes to with it."""
    if x.dim() != 2:
        raise ValueError(f"inplace_unique: x must be [rows, k], not {x.dim()}-D")
    if x.numel() and (int(x.max()) >= num_slots or int(x.min()) < -1):
        raise ValueError(f"inplace_unique: values must be in [-1, {num_slots}); x has "
                         f"{int(x.min())}..{int(x.max())}")
    # A presence table with one extra column, where the -1 entries land and are dropped.
    present = torch.zeros((x.size(0), num_slots + 1), dtype=torch.bool, device=x.device)
    present.scatter_(1, x.masked_fill(x < 0, num_slots).long(), True)
    slots = torch.arange(num_slots, dtype=x.dtype, device=x.device).expand(x.size(0), -1)
    distinct = slots.masked_fill(~present[:, :num_slots], -1)
    distinct = distinct.sort(dim=1, descending=True).values
    width = min(num_slots, x.size(1))
    x.fill_(-1)
    x[:, :width] = distinct[:, :width]


def create_grouped_scores(scores: torch.Tensor, group_idx: torch.Tensor,
                          num_groups: int) -> torch.Tensor:
    """scores [tokens, experts] with every expert outside the token's chosen groups zeroed:
    the experts are num_groups equal contiguous groups (DeepEP's scripts: one per node), and
    group_idx [tokens, k] names each token's chosen groups.  The scripts then take the top-k
    experts of the result, so that a token goes to at most k groups (node-limited routing)."""
    tokens, experts = scores.shape
    if experts % num_groups:
        raise ValueError(f"create_grouped_scores: {experts} experts do not split into "
                         f"{num_groups} equal groups")
    chosen = torch.zeros((tokens, num_groups), dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, group_idx.long(), True)
    grouped = scores.view(tokens, num_groups, -1).masked_fill(~chosen.unsqueeze(-1), 0)
    return grouped.view(tokens, experts)
