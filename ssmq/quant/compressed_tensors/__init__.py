"""Interoperability with the compressed-tensors format (vLLM, llm-compressor, transformers).

    from ssmq.quant.compressed_tensors import export_compressed_tensors, load_compressed_tensors
    export_compressed_tensors("out/w4", "out/w4-ct")      # ssmq checkpoint -> HF compressed-tensors folder
    model = ssmq.load_model("llmcompressor-out/")         # detected; QuantLinears on ssmq's kernels

The ``compressed_tensors`` package (extra ``interop``) defines the format and does the packing.
"""

from ssmq.quant.compressed_tensors.export import export_compressed_tensors
from ssmq.quant.compressed_tensors.load import is_compressed_tensors, load_compressed_tensors

__all__ = ["export_compressed_tensors", "is_compressed_tensors", "load_compressed_tensors"]
