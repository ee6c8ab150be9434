"""SSM-specific quantization pieces of the Quamba recipes (Mamba-1 and Mamba-2); the recipes themselves are data
in ``ssmq.quant.recipe`` and run through ``ssmq.quant.api.quantize`` like every other.

Glossary (every docstring of this package):
    b batch   l length   d d_inner (SSM channels)   n d_state   h heads   p headdim   g ngroups (B/C)
    m head groups, n_c channel groups of sort-and-cluster (G = m·n_c scale groups of x)
    k state groups per B/C group   s cache slots   L layers

Files, one job each:
    quantizer.py    ActQuantizer: the parametrized module that replaces a mixer tap (act_x, act_B, ...)
    cluster.py      sort-and-cluster: channel ranges -> permutation + m×n groups
    permute.py      reorder the SSM channels of a float mixer (function unchanged)
    transforms.py   the offline SSM transforms recipes name: sort_cluster, hadamard_y
    taps.py         calibrate taps and install ActQuantizers
    state_cache.py  int8 SSM state cache (mixers that read / write int8 states)
    mixed.py        the W4AX per-layer A8/A16 evolutionary search (a recipe's ``search``)
    ssdi8.py        SSDi8: the int8 SSD scan module, its calibration, γ migration, mean correction
The exact int8 references live in ``ssmq.ops.quant_ssm``.
"""

from ssmq.quant.checkpoint import register_module_kind
from ssmq.quant.ssm import state_cache as _state_cache
from ssmq.quant.ssm.quantizer import ActQuantizer
from ssmq.quant.ssm.ssdi8 import SSDi8Scan

register_module_kind("SSMActQuantizer", ActQuantizer.from_spec)
register_module_kind("SSMMixer", _state_cache.from_spec)
register_module_kind("SSMInt8StateMixer", _state_cache.from_spec)  # checkpoints written before SSMMixer
register_module_kind("SSDi8Scan", SSDi8Scan.from_spec)

__all__ = ["ActQuantizer"]
