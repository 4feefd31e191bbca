"""Masked ranks (deepep.h "Masked ranks", DESIGN §14): the Buffer's methods over
dep_mask_update, dep_mask_clear, dep_mask_query and dep_handle_dropped, and over
dep_next_call, which an elastic job's replacement rank and its survivors line up by.

A rank is masked for a call when the daemon's live mask (an elastic job's gone ranks) or
this rank's own mask says so; every operation then sends it nothing, waits for nothing from
it and drops the (token, k) pairs whose expert is on it (their contribution is zero).  The
masks of the ranks in a call must agree, as DeepEP's must.  On cuda the kernels do not count
the pairs they drop (dropped() raises deepep.Unsupported there).
"""
from __future__ import annotations

import ctypes
from typing import Any, Tuple

import torch

from . import _lib
from .errors import Error, Unsupported
from .handle import Handle


class _Masks:
    def _mask_conn(self, call: str) -> Any:
        conn = self._conn
        if conn is None or not conn.ptr:
            raise Error(-17, "this Buffer is destroyed", call)
        return conn

    def update_mask(self, rank: int, masked: bool) -> None:
        """Mask (masked=True) or unmask rank in this rank's own mask, from the next call on.

        Args:
            rank: int, 0 <= rank < group_size.
            masked: bool.

        Raises:
            ValueError: rank out of range; deepep.Error: not attached yet (the library's
            DEP_ERR_STATE).
        """
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"update_mask: rank must be an int, not {type(rank).__name__}")
        if not 0 <= rank < self.group_size:
            raise ValueError(f"update_mask: rank is {rank}; the job has ranks 0.."
                             f"{self.group_size - 1}")
        conn = self._mask_conn("update_mask")
        conn.check(conn.lib.dep_mask_update(conn.ptr, rank, 1 if masked else 0),
                   "dep_mask_update")

    def clear_mask(self) -> None:
        """Unmask every rank in this rank's own mask (the daemon's live mask stays)."""
        conn = self._mask_conn("clear_mask")
        conn.check(conn.lib.dep_mask_clear(conn.ptr), "dep_mask_clear")

    def mask(self) -> Tuple[torch.Tensor, int]:
        """The mask the next call uses and the live mask's epoch.

        Returns:
            mask: [group_size] torch.int32 on the CPU, 1 where the rank is masked (the live
                mask or-ed with this rank's own), else 0.
            epoch: int, the live mask's epoch (0: the daemon never wrote it).
        """
        conn = self._mask_conn("mask")
        out = torch.zeros(self.group_size, dtype=torch.int32)
        epoch = ctypes.c_uint64()
        conn.check(conn.lib.dep_mask_query(conn.ptr, ctypes.cast(out.data_ptr(),
                                                                 ctypes.POINTER(ctypes.c_int32)),
                                           self.group_size, ctypes.byref(epoch)),
                   "dep_mask_query")
        return out, epoch.value

    def dropped(self, handle: Handle) -> int:
        """The (token, k) pairs the dispatch (or low_latency_dispatch) that returned handle
        dropped because their expert's rank was masked: int."""
        if not isinstance(handle, Handle):
            raise TypeError(f"dropped: handle must be the Handle a dispatch returned, not "
                            f"{type(handle).__name__}")
        h = self._handle("dropped", handle, handle.kind)
        conn = self._mask_conn("dropped")
        n = ctypes.c_uint64()
        try:
            conn.check(conn.lib.dep_handle_dropped(conn.ptr, h._ptr, ctypes.byref(n)),
                       "dep_handle_dropped")
        except Error as e:
            # The cuda kernels do not count what they drop: the refusal is deepep's Unsupported,
            # as for every other argument or mode the library cannot serve.
            if e.code == _lib.ERR_UNSUPPORTED:
                raise Unsupported("dropped() on this backend", e.message) from e
            raise
        return n.value

    def next_call(self) -> int:
        """The number of the next communicating call this rank will make (dep_next_call).

        1 after a fresh attach, one more after each dispatch, combine, low_latency_dispatch
        and low_latency_combine that ran (failed or not); a call refused before it ran, the
        layout and the mask calls are not counted.  Every rank of a job makes the same calls in
        the same order, so the ranks agree on it.  A process that took a masked rank's place
        in an elastic job (elastic=True) starts at the join call J the daemon chose: its
        next_call() is J, and its first call runs as the survivors' call J.  To bring it in,
        hand J to the survivors (the trainer's own store); each makes J - next_call() calls
        with the rank still masked (a dispatch of no tokens will do), then every rank goes on
        with the same operations.

        Returns:
            int, >= 1.

        Raises:
            deepep.Error: the Buffer is destroyed, or not attached yet (DEP_ERR_STATE: one
            made without hidden attaches at its first dispatch).
        """
        conn = self._mask_conn("next_call")
        n = ctypes.c_uint64()
        conn.check(conn.lib.dep_next_call(conn.ptr, ctypes.byref(n)), "dep_next_call")
        return n.value
