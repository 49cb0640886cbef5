"""``hugepages``: only the aligned interior of a region is advised, contents survive the collapse, and a region
without a whole huge page is left alone."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from pd_connector.transport.hugepages import advise_huge_pages, aligned_interior, huge_page_bytes

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_aligned_interior() -> None:
    page = 2 << 20
    assert aligned_interior(0, 8 * page, page) == (0, 8 * page)
    assert aligned_interior(1, 8 * page, page) == (page, 7 * page)  # head and tail partial pages left out
    assert aligned_interior(page - 1, 2 * page, page) == (page, page)
    assert aligned_interior(1, page, page) == (page, 0)  # no whole huge page inside
    assert aligned_interior(page, 0, page) == (page, 0)


def _vm_flags(address: int) -> list[str]:
    """VmFlags of the mapping of this process that contains ``address`` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping contains {address:#x}")


@pytest.mark.skipif(
    not THP_ENABLED.exists() or "[never]" in THP_ENABLED.read_text(),
    reason="this kernel has no transparent huge pages (or they are switched off)",
)
def test_interior_is_advised_and_contents_survive() -> None:
    page = huge_page_bytes()
    area = mmap.mmap(-1, 8 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_NOHUGEPAGE)  # start from 4 KiB pages whatever the system default
    buf = np.frombuffer(area, dtype=np.uint8)
    buf[:] = np.random.default_rng(5).integers(0, 256, buf.shape, dtype=np.uint8)
    before = buf.copy()
    base = buf.ctypes.data
    # a region that starts 4 KiB into the mapping and ends 4 KiB before its end
    address, length = base + 4096, 8 * page - 2 * 4096
    start, expected = aligned_interior(address, length, page)
    assert advise_huge_pages(address, length) == expected > 0
    assert "hg" in _vm_flags(start)
    assert "hg" in _vm_flags(start + expected - 1)
    assert start > base and "hg" not in _vm_flags(base)  # the partial head page is not the region's
    np.testing.assert_array_equal(buf, before)
    del buf
    area.close()


def test_a_region_without_a_whole_huge_page_is_left_alone() -> None:
    page = huge_page_bytes()
    area = mmap.mmap(-1, 2 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(area, dtype=np.uint8)
    base = buf.ctypes.data
    offset = (-base) % page + 4096  # 4 KiB past a huge-page boundary: no whole huge page fits below
    length = min(page - 8192, len(buf) - offset)
    assert advise_huge_pages(base + offset, length) == 0
    assert "hg" not in _vm_flags(base + offset)
    del buf
    area.close()
