"""Back registered host memory with transparent huge pages (THP), best effort.

Why: a shared-memory (cma) put is a ``process_vm_writev`` that walks and pins the peer's pages and copies from
ours; with 4 KiB pages that per-page work halves its throughput (measured in docs/configuration.md
``## transport``), while 2 MiB pages make it close to an in-process memcpy. KV caches allocated by torch use
4 KiB pages unless told otherwise, and they are already written (zeroed) when the connector registers them,
so advising alone would only help pages faulted later: ``MADV_COLLAPSE`` (Linux >= 6.1) turns the pages
already there into huge pages synchronously, keeping their contents.

Called by ``UcxTransport.register`` and ``CmaTransport.register`` on the registering engine thread, before UCX maps the memory (pinning
transports must see the final pages). Only the 2 MiB-aligned interior of a region is advised, so memory
outside the region keeps its settings. Nothing here is required for correctness: callers log failures and
go on.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Sequence

from .base import MemoryRegion

log = logging.getLogger(__name__)

#: Advice values of ``madvise(2)`` (asm-generic, the same on x86-64 and arm64).
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25

_PMD_SIZE_FILE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
_DEFAULT_HUGE_PAGE = 2 << 20


def huge_page_bytes() -> int:
    """Size of a transparent huge page on this kernel (2 MiB on x86-64 with 4 KiB base pages)."""
    try:
        with open(_PMD_SIZE_FILE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return _DEFAULT_HUGE_PAGE


def aligned_interior(address: int, length: int, page: int) -> tuple[int, int]:
    """``(start, nbytes)`` of the largest ``page``-aligned window inside ``[address, address + length)``;
    ``nbytes`` is 0 when the region holds no whole huge page."""
    start = -(-address // page) * page
    end = (address + length) // page * page
    return start, max(end - start, 0)


def _madvise(address: int, length: int, advice: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    if libc.madvise(address, length, advice) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"madvise(advice={advice}): {os.strerror(code)}")


def advise_huge_pages(address: int, length: int) -> int:
    """Mark the region's aligned interior ``MADV_HUGEPAGE`` and collapse its present pages into huge pages.

    Returns the bytes advised (0 if the region holds no whole huge page). Raises ``OSError`` when the kernel
    refuses the advice (no THP support). A collapse that cannot complete (kernel < 6.1, no free huge pages,
    pages not yet faulted in) is not an error: the advice alone still gives later faults huge pages.
    """
    start, nbytes = aligned_interior(address, length, huge_page_bytes())
    if nbytes == 0:
        return 0
    _madvise(start, nbytes, MADV_HUGEPAGE)
    try:
        _madvise(start, nbytes, MADV_COLLAPSE)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EAGAIN, errno.ENOMEM, errno.EBUSY):
            raise
    return nbytes


def advise_regions(regions: Sequence[MemoryRegion], transport: str) -> None:
    """``advise_huge_pages`` for every region a transport registers, best effort: a failure is logged once
    and registration goes on. Called on the registering engine thread (collapsing GBs takes seconds)."""
    advised = 0
    for region in regions:
        try:
            advised += advise_huge_pages(region.address, region.length)
        except OSError as exc:
            log.warning(
                "%s transport: transparent huge pages not available for registered memory: %s", transport, exc
            )
            return
    total = sum(r.length for r in regions)
    log.info("%s transport: %d of %d registered bytes advised to huge pages", transport, advised, total)
