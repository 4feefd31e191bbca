"""DeepEP's Config: the chunking knobs of its throughput kernels, and its size hints.

deepepd sizes a job's memory from the job shape (the daemon lends it), so
nothing here changes what deepepd does: Config exists so that code which
sizes DeepEP's buffers from these hints (Megatron-LM, SGLang, DeepEP's tests)
runs as it is, and the hints are DeepEP V1's formulas (csrc/config.hpp), so
that such code sizes what it would with DeepEP.
"""
from __future__ import annotations

_ALIGN = 128
#: DeepEP's ranks per node (NUM_MAX_NVL_PEERS), its bounds on top-k and scales a token
#: (kNumMaxTopK, kNumMaxScales) and its source meta bytes a token (internode SourceMeta),
#: as its size hints count them.
_NVL_PEERS = 8
_MAX_TOPK = 128
_MAX_SCALES = 128
_SOURCE_META = 8


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _positive_int(name: str, v: object, minimum: int = 1) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name} must be an int, not {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} is {v}; it must be at least {minimum}")
    return v


class Config:
    """Config(num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
    num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256), checked as
    DeepEP checks it (send < recv; the RDMA receive count rounded up to a multiple of the send
    count and at least twice it)."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        self.num_sms = _positive_int("num_sms", num_sms, 0)
        self.num_max_nvl_chunked_send_tokens = _positive_int(
            "num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens)
        self.num_max_nvl_chunked_recv_tokens = _positive_int(
            "num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens)
        send = _positive_int("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens)
        recv = _positive_int("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)
        if self.num_max_nvl_chunked_send_tokens >= self.num_max_nvl_chunked_recv_tokens:
            raise ValueError("num_max_nvl_chunked_send_tokens must be below "
                             "num_max_nvl_chunked_recv_tokens")
        recv = (recv + send - 1) // send * send
        if send > recv // 2:
            raise ValueError("num_max_rdma_chunked_send_tokens must be at most half of "
                             "num_max_rdma_chunked_recv_tokens")
        self.num_max_rdma_chunked_send_tokens = send
        self.num_max_rdma_chunked_recv_tokens = recv

    def _sizes(self, num_ranks: int) -> tuple:
        """(channels, NVLink ranks, RDMA ranks) as DeepEP counts them: num_sms // 2 channels,
        ranks in groups of _NVL_PEERS per node.  DeepEP asserts a world below _NVL_PEERS or a
        multiple of it; deepepd serves any world, so another is counted the same way."""
        return (self.num_sms // 2, min(num_ranks, _NVL_PEERS), max(num_ranks // _NVL_PEERS, 1))

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's NVLink buffer bytes for one rank: per channel and NVLink peer, the
        counters and num_max_nvl_chunked_recv_tokens tokens of hidden_bytes with their
        source meta, top-k ids, weights and scales (at most 128 each), 128-byte aligned.
        deepepd ignores it."""
        hidden_bytes = _positive_int("hidden_bytes", hidden_bytes)
        num_ranks = _positive_int("num_ranks", num_ranks)
        ch, nvl, rdma = self._sizes(num_ranks)
        per_token = hidden_bytes + _SOURCE_META + _MAX_TOPK * 8 + _MAX_TOPK * 4 + _MAX_SCALES * 4
        n = ch * nvl * (2 * rdma + 3) * 4 + ch * nvl * self.num_max_nvl_chunked_recv_tokens * \
            per_token
        return _align(n)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer bytes: 0 for one node's ranks (num_ranks <= 8); else per
        channel and RDMA rank, send and receive sides of counters and
        num_max_rdma_chunked_recv_tokens tokens (hidden, source meta, top-k ids, weights,
        scales and an int4 of metadata each), 128-byte aligned.  deepepd ignores it."""
        hidden_bytes = _positive_int("hidden_bytes", hidden_bytes)
        num_ranks = _positive_int("num_ranks", num_ranks)
        if num_ranks <= _NVL_PEERS:
            return 0
        ch, _, rdma = self._sizes(num_ranks)
        per_token = hidden_bytes + _SOURCE_META + _MAX_TOPK * 8 + _MAX_TOPK * 4 + \
            _MAX_SCALES * 4 + 16
        n = ch * rdma * (_NVL_PEERS * 2 + 2) * 2 * 4 + \
            ch * rdma * self.num_max_rdma_chunked_recv_tokens * per_token * 2
        return _align(n)

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, "
                f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")
