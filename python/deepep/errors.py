"""The exceptions of the package.

Errors from libdeepep-client raise Error (or a subclass) carrying the
DEP_ERR_* code, its name and the library's message (dep_errmsg).  Bad
arguments caught in Python raise ValueError or TypeError naming the
argument, before any call into the library.
"""
from __future__ import annotations

from . import _lib


class Error(RuntimeError):
    """A libdeepep-client call failed.

    Attributes:
        code: the negative DEP_ERR_* code.
        name: its symbolic name, e.g. "DEP_ERR_TIMEOUT".
        message: dep_errmsg() of the handle: what failed and what to do.
        call: the C function that returned the code.
    """

    def __init__(self, code: int, message: str, call: str = ""):
        self.code = code
        self.name = _lib.errname(code)
        self.message = message
        self.call = call
        text = message or _lib.strerror(code)
        super().__init__(f"{call + ': ' if call else ''}{self.name}: {text}")


class InvalidArgument(Error, ValueError):
    """DEP_ERR_INVALID: the library refused an argument (its message names it)."""


class NoDaemon(Error, ConnectionError):
    """DEP_ERR_NO_DAEMON: no deepepd answers on the socket."""


class Unsupported(NotImplementedError):
    """An argument or mode that libdeepep-client cannot serve yet.

    Raised before anything runs; never replaced by a fallback.
    """

    def __init__(self, what: str, detail: str = ""):
        self.what = what
        super().__init__(f"deepep: {what} is not in libdeepep-client yet" +
                         (f" ({detail})" if detail else ""))


def from_code(code: int, message: str, call: str) -> Error:
    """The Error (subclass) for a DEP_ERR_* code."""
    cls = {_lib.ERR_INVALID: InvalidArgument, _lib.ERR_NO_DAEMON: NoDaemon}.get(code, Error)
    return cls(code, message, call)
