"""The transport benchmark's memory: huge-page buffers start on a huge-page boundary, so every path, the memcpy
ceiling included, copies between memory that is huge pages end to end (as a registered KV cache of gigabytes
is, but numpy's own arrays are not at their ends)."""

from __future__ import annotations

from benchmarks import transport as bench
from pd_connector.transport.hugepages import huge_page_bytes


def test_huge_page_buffers_are_aligned_and_sized() -> None:
    page = huge_page_bytes()
    memory = bench.Memory(fill=False, huge=True)  # not filled: nothing is touched, so this is cheap
    assert memory.messages.ctypes.data % page == 0 and memory.messages.nbytes == bench.MESSAGE_BYTES
    assert memory.kv.shape == (bench.KV_REGIONS, bench.POOL_BLOCKS, bench.KV_BLOCK)
    assert memory.kv.ctypes.data % page == 0
    regions = memory.regions()
    assert len(regions) == len(bench.SIZES) + bench.KV_REGIONS
    assert all(r.address % page == 0 for r in regions)  # each KV region is a whole number of huge pages
    memory.messages[-1] = 7  # writable to the last byte
    assert memory.messages[-1] == 7


def test_small_page_buffers_have_the_same_shape() -> None:
    memory = bench.Memory(fill=False, huge=False)
    assert memory.messages.nbytes == bench.MESSAGE_BYTES
    assert memory.kv.shape == (bench.KV_REGIONS, bench.POOL_BLOCKS, bench.KV_BLOCK)
