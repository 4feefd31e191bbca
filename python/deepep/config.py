"""DeepEP's Config: the chunking knobs of its throughput kernels, and its size hints.

deepepd sizes a job's memory from the job shape (the daemon lends it), so
nothing here changes what deepepd does: Config exists so that code which
sizes DeepEP's buffers from these hints (Megatron-LM, SGLang) runs as it
is, and the hints are deepepd's own estimate of the bytes a rank receives,
of the order of DeepEP's, not DeepEP's formula.
"""
from __future__ import annotations

_ALIGN = 128


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

    def _per_token(self, hidden_bytes: int) -> int:
        # A token's hidden state and its metadata (top-k ids, weights, scales, source).
        return hidden_bytes + 128 * 8 + 128 * 4 + 128 * 4 + 16

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes for one node's ranks' receive chunks, 128-byte aligned (deepepd ignores it)."""
        hidden_bytes = _positive_int("hidden_bytes", hidden_bytes)
        num_ranks = _positive_int("num_ranks", num_ranks)
        channels = max(self.num_sms // 2, 1)
        return _align(channels * min(num_ranks, 8) * self.num_max_nvl_chunked_recv_tokens *
                      self._per_token(hidden_bytes))

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes for the receive chunks between nodes: 0 for one node's 8 ranks or fewer."""
        hidden_bytes = _positive_int("hidden_bytes", hidden_bytes)
        num_ranks = _positive_int("num_ranks", num_ranks)
        if num_ranks <= 8:
            return 0
        channels = max(self.num_sms // 2, 1)
        return _align(2 * channels * (num_ranks // 8) * self.num_max_rdma_chunked_recv_tokens *
                      self._per_token(hidden_bytes))

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, "
                f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")
