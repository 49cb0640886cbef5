"""Engine-agnostic per-request KV transfer engine (both sides), used by the vLLM and SGLang adapters."""

from pd_connector.transfer.engine import TransferEngine
from pd_connector.transfer.types import TransferConfig, TransferCounters, TransferResult, TransferState

__all__ = ["TransferConfig", "TransferCounters", "TransferEngine", "TransferResult", "TransferState"]
