"""SSM-specific quantization: Quamba (W8A8) and Quamba2 (W8A8, W4A8, W4A16, W4AX) for Mamba-1 and Mamba-2.

Glossary (every docstring of this package):
    b batch   l length   d d_inner (SSM channels)   n d_state   h heads   p headdim   g ngroups (B/C)
    m head groups, n_c channel groups of sort-and-cluster (G = m·n_c scale groups of x)
    k state groups per B/C group   s cache slots   L layers

Files, one job each:
    quantizer.py    ActQuantizer: the parametrized module that replaces a mixer tap (act_x, act_B, ...)
    cluster.py      sort-and-cluster: channel ranges -> permutation + m×n groups
    permute.py      reorder the SSM channels of a float mixer (function unchanged)
    transforms.py   the offline transforms recipes name: sort_cluster, hadamard_y, hadamard
    taps.py         calibrate taps and install ActQuantizers
    state_cache.py  int8 SSM state cache (mixers that read / write int8 states)
    recipe.py       SSMRecipe / TapRule (JSON) and the registry; recipes.py the named recipes
    api.py          quantize_ssm(model, recipe, calib); mixed.py the W4AX evolutionary search
    ssdi8.py        SSDi8: the int8 SSD scan module, its calibration, γ migration, mean correction
The exact int8 references live in ``ssmq.ops.quant_ssm``.
"""

from ssmq.quant.checkpoint import register_module_kind
from ssmq.quant.ssm import recipes as _recipes  # noqa: F401  (registers the named recipes)
from ssmq.quant.ssm import state_cache as _state_cache
from ssmq.quant.ssm.api import check_ssm_recipe, quantize_ssm
from ssmq.quant.ssm.quantizer import ActQuantizer
from ssmq.quant.ssm.ssdi8 import SSDi8Scan
from ssmq.quant.ssm.recipe import SSMRecipe, TapRule, get_ssm_recipe, register_ssm_recipe, ssm_recipes

register_module_kind("SSMActQuantizer", ActQuantizer.from_spec)
register_module_kind("SSMMixer", _state_cache.from_spec)
register_module_kind("SSMInt8StateMixer", _state_cache.from_spec)  # checkpoints written before SSMMixer
register_module_kind("SSDi8Scan", SSDi8Scan.from_spec)

__all__ = ["ActQuantizer", "ssm_recipes", "SSMRecipe", "TapRule", "check_ssm_recipe", "get_ssm_recipe",
           "quantize_ssm", "register_ssm_recipe"]
