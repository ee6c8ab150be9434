"""KVQuant and the engines' KV formats: calibration of the offline part of a KV format (``calibrate``), the
weighted k-means of nuq codebooks (``kmeans``). The format itself: ``ssmq.models.kv_format``; the maths:
``ssmq.ops.kv_quant``; the state: ``ssmq.models.quant_kv``; presets: ``ssmq.models.kv_format``."""

from ssmq.models.kv_quantizer import SPEC_KIND, KVQuantizer
from ssmq.quant.checkpoint import register_module_kind
from ssmq.quant.kvquant.calibrate import attention_layers, calibrate_kv_

register_module_kind(SPEC_KIND, KVQuantizer.from_spec)

__all__ = ["attention_layers", "calibrate_kv_"]
