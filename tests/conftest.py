"""Every test in this folder is a unit test: marked ``unit`` here, by directory, so no file can be left out.

``make unit`` selects ``-m unit``; a marker written by hand in each file was once missing from one, which
``make unit`` then skipped silently. ``integration_tests/conftest.py`` marks its own folder ``integration``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # pytest calls this hook with every collected item, not only this folder's: filter by path.
    for item in items:
        if Path(str(item.fspath)).is_relative_to(HERE):
            item.add_marker(pytest.mark.unit)
