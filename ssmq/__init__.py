"""ssmq: post-training quantization, fast GPU inference and tensor-parallel serving for SSM language models."""

__version__ = "0.1.0"

from ssmq.models import SSMLM, ModelConfig, load_model  # noqa: E402
from ssmq.tokenizer import load_tokenizer  # noqa: E402
from ssmq.quant import quantize  # noqa: E402

__all__ = ["SSMLM", "ModelConfig", "load_model", "load_tokenizer", "quantize", "__version__"]
