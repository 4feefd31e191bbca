"""DeepEP's FP8 scale layouts and formats, made with torch from what deepepd's kernels give.

deepepd's low-latency kernels write FP8 scales row-major, float32 [.., rows, hidden // 128],
with scale = max(amax, 1e-4) / 448 (DESIGN §6).  DeepEP's low_latency_dispatch returns them
column-major (a [local_experts, rows, groups] tensor whose rows are the fastest dimension,
as TMA loads them), and, with round_scale, rounds each scale up to a power of two and
quantises with it; with use_ue8m0 it packs those powers' exponents, four to an int32.  The
functions here make DeepEP's forms on the Buffer's device with torch ops on the current
stream (docs/python.md, says what each costs).
"""
from __future__ import annotations

import torch

#: Channels that share one scale (DeepEP's and deepepd's).
GROUP = 128
#: Scales packed into one int32 with use_ue8m0 (DeepEP's: hidden // 512 ints a row).
UE8M0_PACK = 4
#: DeepEP's floor on amax (kFP8Margin) and e4m3's largest finite value.
_AMAX_FLOOR = 1e-4
_E4M3_MAX = 448.0
#: Below this, e4m3fn is subnormal (2**-6); its subnormals are multiples of 2**-9.
_E4M3_MIN_NORMAL = 2.0 ** -6
_E4M3_SUB_STEP = 2.0 ** 9


def column_major(t: torch.Tensor) -> torch.Tensor:
    """t [E, rows, groups] as DeepEP lays it out: the same values in a tensor of the same shape
    whose storage is [E, groups, rows] (strides (groups * rows, 1, rows)): one copy."""
    e, rows, groups = t.shape
    out = torch.empty((e, groups, rows), dtype=t.dtype, device=t.device).transpose(1, 2)
    out.copy_(t)
    return out


def e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 v to e4m3fn bytes (uint8): round to nearest, ties to even, saturating at 448 as
    DeepEP's __NV_SATFINITE cast does.  Integer arithmetic on the float32 bits, so that it
    gives the same bytes on every torch, with or without torch.float8_e4m3fn."""
    sign = (v.contiguous().view(torch.int32) < 0).to(torch.int32) << 7  # -0.0 too
    a = v.abs().clamp(max=_E4M3_MAX).contiguous()
    bits = a.view(torch.int32)
    # Normal: round the float32 mantissa to 3 bits (ties to even) and rebias 127 -> 7.
    r = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF
    normal = ((((r >> 23) - 120) << 3) | ((r >> 20) & 7))
    # Subnormal: a multiple of 2**-9, rounded half to even (torch.round); 8 is 2**-6's byte.
    sub = torch.round(a * _E4M3_SUB_STEP).to(torch.int32)
    mag = torch.where(a >= _E4M3_MIN_NORMAL, normal, sub)
    return (mag | sign).to(torch.uint8)


def _ceil_log2(t: torch.Tensor) -> torch.Tensor:
    """ceil(log2(t)) of positive normal float32 t, from its bits (DeepEP's fast_log2_ceil)."""
    bits = t.contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as float32, e int32 within a normal float's exponents (DeepEP's fast_pow2)."""
    return ((e + 127) << 23).contiguous().view(torch.float32)


def quantise_rounded(x: torch.Tensor):
    """DeepEP's low-latency FP8 cast with round_scale, of bf16 x [.., hidden]: per 128
    channels amax = max(|x|, 1e-4), scale_inv = 2**ceil(log2(amax * (1 / 448))), values the
    e4m3 of x * 2**-e (exact: a power of two).  Returns (e4m3 bytes [.., hidden] uint8,
    exponents e [.., hidden // 128] int32)."""
    shape = x.shape
    if x.dim() > 2 and x.shape[0] > 1:
        # One leading slice (a local expert's rows) at a time: the cast's float32
        # temporaries are several times the bf16 input, which for a whole low-latency
        # receive buffer ([experts, world * tokens, hidden]) can be more than the GPU has
        # left beside the job (8 ranks of DeepEP's test_low_latency.py on one GPU were).
        parts = [quantise_rounded(x[i]) for i in range(x.shape[0])]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    g = x.float().reshape(*shape[:-1], shape[-1] // GROUP, GROUP)
    amax = g.abs().amax(-1).clamp(min=_AMAX_FLOOR)
    e = _ceil_log2(amax * torch.tensor(1.0 / _E4M3_MAX, dtype=torch.float32))
    q = e4m3_bytes(g * _pow2(-e).unsqueeze(-1))
    return q.reshape(shape), e


def scales_of(e: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    """The scales DeepEP returns for exponents e [.., groups]: float32 2**e, or with ue8m0 the
    biased exponents (e + 127, a byte each) packed four to an int32, group 4 j + i in byte i
    (little-endian) of int j: [.., groups // 4] int32."""
    if not ue8m0:
        return _pow2(e)
    b = (e + 127).to(torch.int64).reshape(*e.shape[:-1], e.shape[-1] // UE8M0_PACK, UE8M0_PACK)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    # Into int32's range (two's complement) before the cast, which would not wrap on every torch.
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
