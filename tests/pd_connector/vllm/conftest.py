"""Fixtures of the vLLM adapter's unit tests: ``make_pair`` builds P/D worker-side pairs and closes them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from pd_connector.vllm.config import PDConnectorConfig
from tests.pd_connector.vllm.worker_pair import Pair


@pytest.fixture
def make_pair() -> Iterator[Callable[..., Pair]]:
    pairs: list[Pair] = []

    def make(
        p: PDConnectorConfig | None = None,
        d: PDConnectorConfig | None = None,
        p_kv: dict[str, torch.Tensor] | None = None,
    ) -> Pair:
        pair = Pair(p or PDConnectorConfig(lease_s=5), d or PDConnectorConfig(load_timeout_s=5), p_kv)
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        pair.close()
