"""GGUF files (llama.cpp's format), read through transformers: the config as an HF config dict, the weights
dequantized to float with HF tensor names. ``loading`` maps both onto an SSMLM exactly as for an HF folder.

transformers undoes llama.cpp's Q/K row permutation and dequantizes every tensor (Q4_1 etc.) to float; ssmq
then owns float weights (the GGUF's own quantization is not kept). Needs the ``gguf`` and ``accelerate``
packages (``pip install -e ".[kv]"``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ssmq.errors import SSMQError


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def _transformers():
    try:
        import gguf  # noqa: F401  (transformers needs it to parse the file; fail here with the install line)
        import transformers
    except ImportError as e:
        raise SSMQError(f"reading a GGUF file needs transformers and gguf ({e.name} is missing): "
                        "pip install -e \".[kv]\"") from None
    return transformers


def read_gguf_config(path: Path) -> dict:
    """The HF config dict (``model_type``, ``hidden_size``, ...) from the GGUF metadata; tensors are not read."""
    tf = _transformers()
    try:
        return tf.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    except (ValueError, OSError, KeyError, NotImplementedError) as e:
        raise SSMQError(f"cannot read the GGUF metadata of {path}: {str(e).splitlines()[0][:200]}") from None


def read_gguf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All weights of the GGUF file, dequantized to float32, under their HF names (``model.layers.0...``)."""
    tf = _transformers()
    try:
        model = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except ImportError as e:  # accelerate, which transformers' GGUF path imports
        raise SSMQError(f"reading GGUF weights needs {e.name or 'accelerate'}: pip install -e \".[kv]\"") from None
    except (ValueError, OSError, KeyError, NotImplementedError) as e:
        raise SSMQError(f"cannot read the GGUF weights of {path}: {str(e).splitlines()[0][:200]}") from None
    return dict(model.state_dict())
