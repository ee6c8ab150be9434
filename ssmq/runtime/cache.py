"""The slot-indexed cache lives in ``ssmq.models.cache`` (per-layer states in ``ssmq.models.state``);
re-exported here so ``from ssmq.runtime.cache import InferenceCache`` keeps working."""

from ssmq.models.cache import InferenceCache
from ssmq.models.state import Int8StateScales, KVState, MambaState, StateFormat

__all__ = ["InferenceCache", "Int8StateScales", "KVState", "MambaState", "StateFormat"]
