"""Plain PyTorch reference ops (CPU, float32-exact).

These are the contracts: every Triton kernel in ``ssmq.kernels`` has the same
signature as its reference here and is tested against it.

Glossary (used in every docstring of this package):
    b  batch            l  sequence length      d  channels (d_inner, or conv_dim)
    n  d_state          h  SSM heads            p  head dim (headdim)
    g  ngroups (B/C groups, h % g == 0)         w  conv kernel width (d_conv)
    T  SSD chunk size   c  number of chunks     s  cache slots (max batch)
"""

from ssmq.ops.attention import apply_rotary_ref, attention_ref, rope_ref, rotary_cos_sin
from ssmq.ops.conv1d import causal_conv1d_ref, causal_conv1d_update_ref
from ssmq.ops.mamba2_decode import mamba2_decode_step_ref
from ssmq.ops.quant_linear import dequantize_weight, quant_linear_act_ref, quant_linear_ref, quantize_act_ref
from ssmq.ops.norm import rms_norm_quant_ref, rms_norm_ref, rmsnorm_gated_quant_ref, rmsnorm_gated_ref
from ssmq.ops.selective_scan import selective_scan_ref
from ssmq.ops.ssd import ssd_chunk_scan_ref, ssd_sequential_ref
from ssmq.ops.state_update import selective_state_update_ref

__all__ = [
    "apply_rotary_ref",
    "attention_ref",
    "rope_ref",
    "rotary_cos_sin",
    "causal_conv1d_ref",
    "causal_conv1d_update_ref",
    "mamba2_decode_step_ref",
    "rms_norm_ref",
    "rms_norm_quant_ref",
    "dequantize_weight",
    "quant_linear_act_ref",
    "quant_linear_ref",
    "quantize_act_ref",
    "rmsnorm_gated_ref",
    "rmsnorm_gated_quant_ref",
    "selective_scan_ref",
    "ssd_chunk_scan_ref",
    "ssd_sequential_ref",
    "selective_state_update_ref",
]
