"""ssmq: post-training quantization, fast GPU inference and tensor-parallel serving for SSM language models."""

from ssmq.models import SSMLM, ModelConfig
from ssmq.quant import load_model, quantize  # load_model: float or quantized folders
from ssmq.tokenizer import load_tokenizer
from ssmq.version import __version__

__all__ = ["SSMLM", "ModelConfig", "load_model", "load_tokenizer", "quantize", "__version__"]
