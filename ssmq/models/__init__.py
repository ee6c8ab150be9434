"""Models: one config dataclass, one file per family, one LM shell, and the checkpoint loaders."""

from ssmq.models.config import ModelConfig
from ssmq.models.lm import SSMLM
from ssmq.models.loading import load_model

__all__ = ["ModelConfig", "SSMLM", "load_model"]
