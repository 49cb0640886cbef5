"""The kernel side of the cma data plane: ``process_vm_writev``/``readv`` through ctypes, iovec tables, Yama.

Who calls it: ``cma.CmaTransport`` only. The receiver's ``register`` calls ``allow_writers``; the sender's
``write`` builds its pieces with ``build_iovecs`` on the engine thread, and its I/O thread groups them with
``call_bounds`` and moves them with ``vm_call`` (ctypes releases the GIL for the syscall). A failed call's
errno becomes a ``CmaError`` that names the peer and says what to configure (``errno_error``).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os

import numpy as np
import numpy.typing as npt

from .coalesce import COUNT
from .regions import Spans

#: Most iovec entries one ``process_vm_writev`` accepts (``UIO_MAXIOV``).
IOV_MAX = 1024
_YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


class CmaError(ConnectionError):
    """A peer cannot be written to (gone, other host or namespace, no permission); names the peer."""


class Iovecs:
    """Matching local and remote ``struct iovec`` arrays (uint64 pairs: base, length) for one write."""

    def __init__(self, local: npt.NDArray[np.uint64], remote: npt.NDArray[np.uint64]) -> None:
        self.local, self.remote = local, remote

    def __len__(self) -> int:
        return len(self.local)

    def advance(self, index: int, nbytes: int) -> None:
        """Drop the first ``nbytes`` of piece ``index`` (after a partial write)."""
        for iov in (self.local, self.remote):
            iov[index, 0] += np.uint64(nbytes)
            iov[index, 1] -= np.uint64(nbytes)


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library with the prototypes we call (``use_errno``: errno is read right after each call)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for name in ("process_vm_writev", "process_vm_readv"):
        fn = getattr(libc, name)
        fn.argtypes = (
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_ulong,
        )
        fn.restype = ctypes.c_ssize_t
    libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
    libc.prctl.restype = ctypes.c_int
    return libc


def vm_call(write: bool, pid: int, iovecs: Iovecs, start: int, stop: int) -> int:
    """One ``process_vm_writev``/``readv`` over pieces ``[start, stop)``; returns bytes moved or ``-errno``."""
    fn = _libc().process_vm_writev if write else _libc().process_vm_readv
    offset = start * iovecs.local.itemsize * 2
    count = stop - start
    while True:
        done = fn(pid, iovecs.local.ctypes.data + offset, count, iovecs.remote.ctypes.data + offset, count, 0)
        if done >= 0:
            return int(done)
        code = ctypes.get_errno()
        if code != errno.EINTR:
            return -code


def build_iovecs(spans: Spans, segment_bytes: int) -> Iovecs:
    """Checked spans -> absolute iovecs, runs cut into ``segment_bytes`` pieces."""
    sizes = spans.table[:, COUNT]
    pieces = -(-sizes // segment_bytes)
    span_of = np.repeat(np.arange(len(sizes)), pieces)
    offset = (np.arange(len(span_of)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * segment_bytes
    local = np.empty((len(span_of), 2), dtype=np.uint64)
    remote = np.empty_like(local)
    local[:, 0] = spans.local_address[span_of] + offset
    remote[:, 0] = spans.remote_address[span_of] + offset
    local[:, 1] = remote[:, 1] = np.minimum(segment_bytes, sizes[span_of] - offset)
    return Iovecs(local, remote)


def call_bounds(lengths: npt.NDArray[np.uint64], segment_bytes: int) -> list[tuple[int, int, int]]:
    """Group pieces into syscalls of at most ``IOV_MAX`` pieces and ``segment_bytes`` bytes (>= 1 piece):
    ``(start, stop, nbytes)`` per call, so a complete call is recognised without touching numpy again."""
    ends = np.cumsum(lengths.astype(np.int64))
    bounds: list[tuple[int, int, int]] = []
    start, before = 0, 0
    while start < len(lengths):
        stop = int(np.searchsorted(ends, before + segment_bytes, side="right"))
        stop = max(min(stop, start + IOV_MAX), start + 1)
        end = int(ends[stop - 1])
        bounds.append((start, stop, end - before))
        start, before = stop, end
    return bounds


def allow_writers() -> None:
    """Let same-user processes write into this one under Yama (``ptrace_scope`` 1); refuse scope >= 2.

    Called by the receiver's ``register``. Without Yama (or scope 0) the kernel's normal rule applies: same
    user and a dumpable process, nothing to do.
    """
    try:
        with open(_YAMA_SCOPE) as f:
            scope = int(f.read().strip())
    except (OSError, ValueError):
        return
    if scope == 0:
        return
    if scope >= 2:
        raise CmaError(
            f"cma transport: kernel.yama.ptrace_scope is {scope}, so no ordinary process may write into this one; "
            "set it to 0 or 1 (sysctl kernel.yama.ptrace_scope=1) or use the tcp or ucx transport"
        )
    if _libc().prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise CmaError(f"cma transport: prctl(PR_SET_PTRACER, ANY) failed: {os.strerror(code)}")


def errno_error(peer_id: str, pid: int, code: int) -> CmaError:
    why = {
        errno.ESRCH: "exited",
        errno.EFAULT: "no longer has the registered memory mapped (exiting or deregistered)",
        errno.EPERM: (
            "may not be written by this process: run both as the same user, keep them dumpable and allow "
            "ptrace (kernel.yama.ptrace_scope <= 1, no seccomp/AppArmor denial), or use the tcp or ucx transport"
        ),
    }.get(code, f"failed: {os.strerror(code)}")
    return CmaError(f"cma transport: peer {peer_id} (pid {pid}) {why}")
