"""The ``pair`` fixture of the transfer-engine tests: a prefill and a decode engine on one loopback fabric,
closed (and checked to have released every registration) after the test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.pd_connector.engines import Pair


@pytest.fixture
def pair() -> Iterator[Pair]:
    pr = Pair()
    yield pr
    pr.close()
