"""Keeping a PyTorch C++ error raised on a greenlet an ordinary Python exception.

distgrad runs the model's forward, backward blocks and invoke bodies in greenlets, which take
turns on one thread's stack: each switch copies stack slices to and from the heap. When a torch
operation fails (a shape mismatch in the user's body, a second backward through a freed graph),
``c10::Error``'s constructor records a C++ backtrace at once with glibc's ``backtrace()``. That
walk goes through the greenlet's frames, past its start, into stack memory that now belongs to
other frames than the ones the greenlet started above; libgcc's unwinder can read a garbage
frame there and the process dies with SIGSEGV instead of raising ``RuntimeError``. Which bytes
lie there depends on what ran before, so the crash comes and goes with unrelated changes.

``guard()`` makes glibc's ``backtrace()`` return no frames (its first bytes become
``xor eax, eax; ret``), so torch builds its errors with an empty C++ backtrace. Python
tracebacks and messages are unchanged; only the C++ part that ``TORCH_SHOW_CPP_STACKTRACES=1``
prints is lost, for the whole process. It is installed when distgrad first starts a greenlet,
only on x86-64 Linux with glibc, and never raises: where anything is unexpected the process is
left as it was. ``DISTGRAD_CPP_BACKTRACES=1`` in the environment keeps glibc's ``backtrace()``
(and the risk of the crash). nnsight guards its greenlets the same way.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

RETURN_ZERO = b"\x31\xc0\xc3"  # x86-64: xor eax, eax ; ret
_PROT_READ, _PROT_WRITE, _PROT_EXEC = 1, 2, 4
_state = {"tried": False, "guarded": False}


def guard() -> bool:
    """Make glibc's ``backtrace()`` return 0 frames, once; whether it is guarded."""
    if not _state["tried"]:
        _state["tried"] = True
        _state["guarded"] = _install()
    return _state["guarded"]


def _install() -> bool:
    if os.environ.get("DISTGRAD_CPP_BACKTRACES") == "1":
        return False
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "backtrace"):
            return False  # not glibc (musl's backtrace() walks nothing already)
        address = ctypes.cast(libc.backtrace, ctypes.c_void_p).value
        if not address:
            return False
        if ctypes.string_at(address, len(RETURN_ZERO)) == RETURN_ZERO:
            return True  # guarded already (by another library)
        mprotect = libc.mprotect
        mprotect.restype = ctypes.c_int
        mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page = os.sysconf("SC_PAGESIZE")
        start = address & ~(page - 1)
        length = (address + len(RETURN_ZERO) - start + page - 1) & ~(page - 1)
        if mprotect(start, length, _PROT_READ | _PROT_WRITE | _PROT_EXEC) != 0:
            return False  # (W^X policies refuse it: then nothing changed)
        try:
            ctypes.memmove(address, RETURN_ZERO, len(RETURN_ZERO))
        finally:
            mprotect(start, length, _PROT_READ | _PROT_EXEC)
        return ctypes.string_at(address, len(RETURN_ZERO)) == RETURN_ZERO
    except (OSError, AttributeError, ValueError):
        return False
