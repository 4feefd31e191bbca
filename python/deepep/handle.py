"""deepep's Handle, and the half of deepep.Buffer that keeps dep_handle_t's for reuse.

A Handle is what a dispatch leaves for its combine (and cached dispatches): a dep_handle_t
of the library, whose device arrays (on cuda) say where each row went.  Making and freeing
one per call would cost a round of allocation each (and on cuda cuMemFree waits for the
whole device), so a collected Handle's dep_handle_t goes back to its Buffer for the next
dispatch: on the host backend at once, on cuda behind the kernels still queued on the
streams it was used on.  A handle a CUDA graph may still read (made or used while the
current stream captured one) is never reused: its Buffer keeps it until destroy().

HandlePools holds that logic as methods of Buffer (which inherits them); the state they
keep is the Buffer's, set up by _handles_init and freed by _handles_free.
"""
from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING, Any, List, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover - annotations only (buffer.py imports this module)
    from .buffer import Buffer

#: dep_handle_t's of collected Handles kept per Buffer for the next dispatch.
_HANDLE_POOL = 4
#: cuda: collected handles kept for reuse (each with its stream, or events on its streams).
_CUDA_POOL = 16

# Whether the caller's current stream captures a CUDA graph: torch's C extension's own
# function where it has it (torch 2.x), as buffer.py takes the raw stream, else the public
# wrapper.  The one place the binding asks torch (buffer.py imports it).
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or \
    torch.cuda.is_current_stream_capturing


class Handle:
    """What a dispatch leaves for its combine: opaque, pass it back as it is.

    Unlike DeepEP's tuple of prefix matrices, its contents are the library's
    (a dep_handle_t); ``num_tokens`` and ``num_recv`` say the rows on each side
    (``num_recv`` is None after a dispatch with num_worst_tokens on cuda, which does not
    wait for it; ``rows`` is then num_worst_tokens).  One made inside a CUDA-graph capture
    has its device arrays in a torch tensor (dep_handle_new_in), served from the graph's
    pool as DeepEP's handle tensors are.  A handle made or used (by a combine, a cached
    dispatch or a low_latency_combine) while the current stream captures a CUDA graph is
    kept by its Buffer until destroy(), never reused for another call: the graph reads its
    device arrays at every replay, after the caller has dropped it.
    """

    #: Kept by its Buffer until destroy() (Buffer._pinned), for a graph that uses its
    #: arrays; set on the instance, so the usual handle costs nothing here.
    _pin = False

    @property
    def rows(self) -> int:
        """The rows of the dispatch's outputs: num_worst_tokens where given, else num_recv."""
        return self.worst or self.num_recv

    def __init__(self, buf: "Buffer", kind: str, num_tokens: int, num_recv: int = 0,
                 stream: Optional[int] = None, capturing: Optional[bool] = None):
        conn = self._conn = buf._conn
        self._buffer = buf._selfref
        self.kind = kind
        self.num_tokens = num_tokens
        self.num_recv = num_recv
        #: A dispatch's num_worst_tokens (0: none): its outputs' rows, which a combine's x
        #: and a cached dispatch through this handle have too.
        self.worst = 0
        self.hidden = buf.hidden
        #: cuda: the raw stream (an int) the handle's device arrays were used on, or a tuple
        #: of them once a combine used it on another.
        self._stream: Any = None
        #: cuda, made in a capture: the tensor that holds the handle's device arrays.
        self._mem: Optional[torch.Tensor] = None
        pool = buf._handle_pool
        if buf._host:
            ptr = pool.pop() if pool else None
        else:
            # The caller's current stream and capture state (the op looked them up once).
            self._stream = stream if stream is not None else buf._stream()
            if capturing if capturing is not None else _capturing():
                ptr = buf._captured_handle(self)
                buf._keep(self)  # the graph holds its arrays
            else:
                ptr = buf._cuda_handle(self._stream)
        if ptr is None:
            p = ctypes.c_void_p()
            conn.check(conn.lib.dep_handle_new(conn.ptr, ctypes.byref(p)), "dep_handle_new")
            ptr = p.value
        # A dep_handle_t is reusable; the pool holds only those of Handles already
        # collected, so none that a caller can still pass to a combine.
        self._ptr: Optional[int] = ptr
        buf._handles.add(self)

    def _free(self) -> None:
        if self._ptr:
            self._conn.lib.dep_handle_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:
        ptr = self._ptr
        if not ptr:
            return
        buf = self._buffer()
        if buf is None or buf._conn is not self._conn or not self._conn.ptr:
            self._free()
            return
        if buf._host:
            if len(buf._handle_pool) < _HANDLE_POOL:
                self._ptr = None
                buf._handle_pool.append(ptr)
            else:
                self._free()
            return
        if self._mem is not None:
            # Made in a capture (the Buffer keeps it until destroy(), so this runs only if
            # that changes): its arrays go with its tensor, so it is never pooled for reuse;
            # dep_handle_free frees only the library's host side.
            self._free()
            return
        # cuda: the kernels queued on the handle's streams may still use its device
        # arrays, and dep_handle_free (cuMemFree) would wait for the whole device.  So
        # the handle goes back to the Buffer, to be reused behind those kernels
        # (Buffer._cuda_handle).
        self._ptr = None
        buf._cuda_release(ptr, self._stream)


class HandlePools:
    """Buffer's handles: making a Handle's dep_handle_t (reused where one can be), taking
    one back when a Handle is collected, keeping those a CUDA graph uses, checking a handle
    argument, freeing them all at destroy().  Of the Buffer it uses _conn, device, _host,
    _selfref and _streams (raw stream -> torch.cuda.Stream, which Buffer._stream fills)."""

    def _handles_init(self) -> None:
        """The empty pools (first thing in Buffer.__init__: destroy() needs them)."""
        self._handles: "weakref.WeakSet[Handle]" = weakref.WeakSet()
        self._handle_pool: List[int] = []
        #: cuda: collected handles, oldest first, each [ptr, stream, events]: stream, the one
        #: raw stream it was used on (no event: a call on that stream is queued behind it),
        #: or events recorded on each of several (then stream is None).
        self._cuda_pool: List[list] = []
        self._free_events: List[Any] = []  # torch.cuda.Events of reused handles, to record again
        #: Handles kept until destroy(), never pooled: those made or used while the current
        #: stream captured a CUDA graph (Handle._pin), whose arrays the graph reads.
        self._pinned: List[Handle] = []
        self._handle_bytes = 0
        self._deferred: List[int] = []
        self._selfref = weakref.ref(self)

    def _captured_handle(self, h: Handle) -> int:
        """A dep_handle_t for Handle h made inside a CUDA-graph capture, where the library's
        cuMemAlloc is not allowed: its device arrays are a torch tensor of dep_handle_bytes
        on the Buffer's device, which torch's caching allocator serves from the graph's
        private pool (as it serves DeepEP's handle tensors), held by h (dep_handle_new_in);
        the Buffer keeps h until destroy(), since the graph may be replayed after the caller
        dropped it.  So a graph captures as many dispatches as the model makes."""
        conn = self._conn
        if not self._handle_bytes:
            n = ctypes.c_size_t()
            conn.check(conn.lib.dep_handle_bytes(conn.ptr, ctypes.byref(n)), "dep_handle_bytes")
            self._handle_bytes = n.value
        mem = torch.empty(self._handle_bytes, dtype=torch.uint8, device=self.device)
        p = ctypes.c_void_p()
        conn.check(conn.lib.dep_handle_new_in(conn.ptr, mem.data_ptr(), self._handle_bytes,
                                              ctypes.byref(p)), "dep_handle_new_in")
        h._mem = mem
        return p.value

    def _cuda_handle(self, stream: int) -> Optional[int]:
        """A dep_handle_t for a new Handle on cuda outside a capture, used on raw stream
        `stream`, or None to make one (dep_handle_new): a collected one last used on that
        stream alone (this call's kernels queue behind its), else the oldest, once the
        events on its streams have completed."""
        pool = self._cuda_pool
        if not pool:
            return None
        for i in range(len(pool)):
            if pool[i][1] == stream:
                return pool.pop(i)[0]
        ent = pool[0]
        if ent[2] is None:
            # Last used on another stream alone: an event there now comes after its kernels.
            ent[2] = [self._recorded(ent[1])]
            ent[1] = None
        events = ent[2]
        for e in events:
            if not e.query():
                return None
        pool.pop(0)
        self._free_events += events
        return ent[0]

    def _recorded(self, stream: int) -> Any:
        """A torch.cuda.Event (a reused one where there is one) recorded on raw stream now."""
        e = self._free_events.pop() if self._free_events else torch.cuda.Event()
        e.record(self._stream_of(stream))
        return e

    def _stream_of(self, raw: int) -> Any:
        """The torch.cuda.Stream of a raw stream this Buffer saw current (_stream keeps
        them), else torch's wrapper of a stream made outside it."""
        st = self._streams.get(raw)
        if st is None:
            st = torch.cuda.ExternalStream(raw, device=self.device)
        return st

    def _use(self, h: Handle, stream: int, capturing: bool) -> None:
        """cuda: an operation is about to queue work on Handle h's device arrays on raw stream
        `stream` (a combine, a cached dispatch, a low_latency_combine); `capturing` says
        whether that stream captures a CUDA graph.  Notes the stream, for reuse behind it
        once h is collected, and in a capture keeps h (_keep): the graph reads its arrays at
        every replay, so they must never be handed to a later dispatch, even though h was
        made outside the capture and the caller drops it."""
        s = h._stream
        if stream != s and (type(s) is not tuple or stream not in s):
            h._stream = s + (stream,) if type(s) is tuple else (s, stream)
        if capturing and not h._pin:
            self._keep(h)

    def _keep(self, h: Handle) -> None:
        """Keep Handle h until destroy() (never pooled): a CUDA graph made or used it."""
        h._pin = True
        self._pinned.append(h)

    def _cuda_release(self, ptr: int, streams: Any) -> None:
        """A collected Handle's dep_handle_t, back for reuse behind its streams' kernels."""
        if _capturing():
            self._deferred.append(ptr)  # no event can be recorded for after it: at destroy()
            return
        if len(self._cuda_pool) >= _CUDA_POOL:
            self._deferred.append(ptr)
            return
        if type(streams) is tuple:
            self._cuda_pool.append([ptr, None, [self._recorded(st) for st in streams]])
        else:
            self._cuda_pool.append([ptr, streams, None])

    def _handle(self, op: str, handle: Any, kind: str) -> Handle:
        """op's handle argument, checked: a live Handle of this Buffer made by a `kind`."""
        if type(handle) is Handle and handle._buffer is self._selfref and handle._ptr and \
                handle.kind == kind:
            return handle
        if not isinstance(handle, Handle):
            raise TypeError(f"{op}: handle must be the Handle a {kind} returned, not "
                            f"{type(handle).__name__}")
        if handle._buffer() is not self or handle._ptr is None:
            raise ValueError(f"{op}: handle belongs to another (or a destroyed) Buffer")
        if handle.kind != kind:
            raise ValueError(f"{op}: handle is a {handle.kind}'s; pass the matching {kind}'s")
        return handle

    def _handles_free(self) -> None:
        """Free every handle, held, pooled or kept (Buffer.destroy, before the connection
        goes)."""
        if not getattr(self, "_host", True) and (self._handles or self._cuda_pool):
            torch.cuda.synchronize(self.device)  # no kernel still uses a handle's arrays
        for h in list(self._handles):
            h._free()
        if self._conn is not None and self._conn.ptr:
            for p in self._handle_pool + [e[0] for e in self._cuda_pool] + self._deferred:
                self._conn.lib.dep_handle_free(p)
        self._handle_pool, self._cuda_pool, self._deferred = [], [], []
        self._free_events = []
        self._pinned = []  # with them the tensors of the handles made in captures
