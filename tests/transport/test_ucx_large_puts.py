"""Shared-memory (cma) puts larger than one UCX segment, on huge-page-advised memory, arrive exactly, and the
UCX transport's segment setting is validated and reaches its UCX context."""

from __future__ import annotations

import numpy as np
import pytest

from pd_connector.transport import ucx
from pd_connector.transport.base import BlockCopy
from pd_connector.transport.factory import TransportConfig, create_transport
from pd_connector.transport.regions import Spans
from pd_connector.transport.ucx import UcxConfig

from .conftest import PeerProcess, local_regions

REGIONS, BLOCKS, BLOCK_BYTES = 2, 40, 256 << 10  # 10 MiB per region: more than one default 8 MiB segment


@pytest.mark.parametrize("segment", [64 << 10, UcxConfig().cma_segment_bytes], ids=["64KiB", "default"])
def test_spans_longer_than_a_segment_arrive_exactly(peer_factory: type[PeerProcess], segment: int) -> None:
    # The sender first: without the ucx extra its factory fails the test naming what is missing.
    sender = create_transport(
        TransportConfig(kind="ucx", ucx=UcxConfig(tls="sm,self", cma_segment_bytes=segment, huge_pages=True))
    )
    try:
        peer = peer_factory("ucx", "sm,self", REGIONS, BLOCKS, BLOCK_BYTES)
        src, regions = local_regions(REGIONS, BLOCKS, BLOCK_BYTES, seed=3)
        sender.register(regions)
        sender.attach("peer", peer.descriptor).result(10)
        # region 0 whole (one 10 MiB span), region 1 as odd-length runs in reverse order (unmergeable)
        copies = [BlockCopy(0, 0, 0, BLOCKS)]
        copies += [BlockCopy(1, s, BLOCKS - 3 - s, 3) for s in range(0, BLOCKS - 3, 7)]
        nbytes = sum(c.num_blocks for c in copies) * BLOCK_BYTES
        assert sender.write("peer", copies).result(30) == nbytes
        peer.mirror[0] = src[0]
        for c in copies[1:]:
            peer.mirror[1, c.dst_block : c.dst_block + 3] = src[1, c.src_block : c.src_block + 3]
        assert peer.digests() == peer.expected_digests()
        assert not np.array_equal(peer.mirror[1], np.zeros_like(peer.mirror[1]))
    finally:
        sender.close()


def test_segment_setting_reaches_the_ucx_options() -> None:
    assert UcxConfig().ucx_options()["CMA_SEG_SIZE"] == str(8 << 20)
    assert UcxConfig(cma_segment_bytes=1 << 20).ucx_options()["CMA_SEG_SIZE"] == str(1 << 20)
    assert "CMA_SEG_SIZE" not in UcxConfig(cma_segment_bytes=0).ucx_options()  # UCX default / environment
    explicit = UcxConfig(cma_segment_bytes=1 << 20, options={"CMA_SEG_SIZE": "2M"})
    assert explicit.ucx_options()["CMA_SEG_SIZE"] == "2M"  # an explicit UCX option wins
    assert UcxConfig(tls="sm,self").ucx_options()["TLS"] == "sm,self"


@pytest.mark.parametrize("bad", [-1, 1, 4095])
def test_a_too_small_segment_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="cma_segment_bytes"):
        UcxConfig(cma_segment_bytes=bad)


@pytest.mark.parametrize("small_limit", [1 << 20, 0], ids=["plain-python", "numpy"])
def test_posts_are_grouped_per_region_with_either_path(
    small_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write's spans become one ``put_many`` group per region, in order, whether the few-row path (plain
    Python) or the many-row path (numpy masks) builds them."""
    monkeypatch.setattr(ucx, "SMALL_COPIES", small_limit)
    rows = 5
    table = np.array([[r, 10 * i, 20 * i, i + 1] for r in (1, 4, 7) for i in range(rows)], dtype=np.int64)
    spans = Spans(table, int(table[:, 3].sum()), table[:, 1] + 1000, table[:, 2] + 5000)
    expected = [
        (
            r,
            [10 * i + 1000 for i in range(rows)],
            [i + 1 for i in range(rows)],
            [20 * i + 5000 for i in range(rows)],
        )
        for r in (1, 4, 7)
    ]
    assert ucx._Planned.of(spans).groups == expected
