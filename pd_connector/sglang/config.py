"""Settings of the SGLang ``pd`` backend, read from the environment of the SGLang server process.

Who calls it: ``conn.PdKVManager``, once per scheduler process when its KV manager starts. SGLang has no
per-backend configuration object, so the backend reads ``PD_SGLANG_*`` variables (documented in
docs/configuration.md ``## SGLang backend``): one per setting both engines share
(``pd_connector.settings.ConnectorSettings``, ``PD_SGLANG_`` and the setting's name in capitals) plus the
fault injection below, parsed by ``settings.parse``. SGLang's own timeouts
(``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``, ``..._WAITING_TIMEOUT``) keep their meaning.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from pd_connector.settings import ConnectorSettings, parse


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGLangBackendConfig(ConnectorSettings):
    """``ConnectorSettings`` (transport, timeouts, lease, heartbeats, secret, peer policy), the push mode and,
    for tests, fault injection."""

    #: P: push each layer's new pages as the forward pass writes them (``layerwise.py``); False: push every layer
    #: of a chunk after its forward pass (what SGLang's own backends do; the benchmark's comparison).
    layerwise: bool = True
    #: Fault injection (negative control): for these bootstrap rooms P sends its first page's KV into every page
    #: D asked for (a complete transfer of the wrong bytes: a transfer with holes fails instead), so D decodes
    #: from KV that is not its prompt's. Empty in real use.
    wrong_kv_rooms: frozenset[int] = frozenset()
    #: Fault injection (negative control): for these bootstrap rooms P never pushes its last layer (it counts as
    #: pushed), so D's pages of that layer are never written: P's ``Done`` check finds the hole and the transfer
    #: fails. Empty in real use.
    skip_layer_rooms: frozenset[int] = frozenset()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SGLangBackendConfig:
        """Read ``PD_SGLANG_*`` (``ENV`` names each setting's variable); a malformed value raises
        ``SettingError`` naming the variable."""
        env = os.environ if env is None else env
        given = {setting: env[name] for setting, name in ENV.items() if name in env}
        return parse(cls, given, source="PD_SGLANG_* environment", text=True, names=ENV)


#: The environment variable of each setting: the one spelling ``from_env`` reads and docs/configuration.md
#: (``## SGLang backend``) documents, which tests/test_docs.py checks.
ENV = {f.name: f"PD_SGLANG_{f.name.upper()}" for f in dataclasses.fields(SGLangBackendConfig)} | {
    "wrong_kv_rooms": "PD_SGLANG_FAULT_WRONG_KV_ROOMS",
    "skip_layer_rooms": "PD_SGLANG_FAULT_SKIP_LAYER_ROOMS",
}
