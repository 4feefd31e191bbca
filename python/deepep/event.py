"""Events in DeepEP's shape: EventHandle and EventOverlap.

On the cuda backend an EventHandle is a torch.cuda.Event recorded on the
current stream when it is made, as DeepEP's is.  On the host backend every
operation has finished when its call returns, so an EventHandle made
without CUDA is already complete and waiting on it does nothing.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch


class EventHandle:
    """An event captured on the current stream at construction.

    Args:
        cuda: whether there is CUDA (None: whether torch has initialised it).
        stream: the current stream's torch.cuda.Stream, where the caller has it (None: look
            it up).

    Attributes:
        event: the torch.cuda.Event, or None where there is no CUDA (complete).
    """

    def __init__(self, cuda: Optional[bool] = None, stream: Optional[Any] = None):
        if cuda is None:
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.event: Optional[Any] = None
        if cuda:
            # deepep.Buffer passes the stream it keeps: current_stream() costs microseconds.
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (nothing to wait for without CUDA)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def query(self) -> bool:
        """Whether the work before the event has finished."""
        return True if self.event is None else bool(self.event.query())

    def synchronize(self) -> None:
        """Block the CPU until the event completes."""
        if self.event is not None:
            self.event.synchronize()


class EventOverlap:
    """DeepEP's wrapper of an event, for overlapping communication with compute.

    Args:
        event: an EventHandle, or None (nothing to wait for).
        extra_tensors: tensors to keep alive until the wait (DeepEP's stand-in for
            record_stream).

    Use ``event.current_stream_wait()``, or ``with event: ...`` to wait when the
    block ends.
    """

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Sequence[torch.Tensor]] = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event; it must not be None."""
        if self.event is None:
            raise ValueError("event: this EventOverlap holds no event (the call was not "
                             "async_finish)")
        self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
