"""Quantization core: primitives, observers, calibration, quantized modules, transforms, recipes, checkpoints.

    from ssmq.quant import quantize, load_calibration, save_quantized
    model = quantize(model, "gptq-w4a16-g128", load_calibration())
    save_quantized(model, "out/")          # ssmq.load_model("out/") loads it back
"""

from ssmq.quant.api import check, quantize
from ssmq.quant.calibration import CalibrationData, load_calibration
from ssmq.quant.checkpoint import load_model, load_quantized, register_module_kind, save_quantized
from ssmq.quant.linear import QuantEmbedding, QuantLinear
from ssmq.quant.primitives import PerChannel, PerGroup, PerTensor, PerToken
from ssmq.quant.recipe import RECIPES, Recipe, Rule, Search, TapRule, Transform, get_recipe, register_recipe
from ssmq.quant.spec import ActSpec, WeightSpec

__all__ = [
    "check", "quantize", "CalibrationData", "load_calibration", "load_model", "load_quantized", "save_quantized",
    "register_module_kind", "QuantLinear", "QuantEmbedding", "PerTensor", "PerChannel", "PerGroup", "PerToken",
    "RECIPES", "Recipe", "Rule", "Search", "TapRule", "Transform", "get_recipe", "register_recipe",
    "ActSpec", "WeightSpec",
]

# registers the SSM module kinds (ActQuantizer, int8-state mixers) for checkpoint loading
import ssmq.quant.ssm  # noqa: E402,F401
import ssmq.quant.kvquant  # noqa: E402,F401  (registers KVQuantizer)
