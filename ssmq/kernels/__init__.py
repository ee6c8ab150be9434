"""Fast ops: Triton kernels on CUDA tensors, the ``ssmq.ops`` references elsewhere.

Each public function here has the signature of its reference in ``ssmq.ops`` and
dispatches on the device of its first tensor argument, so model code calls one
name on CPU and GPU alike.
"""

from ssmq.kernels.dispatch import (
    causal_conv1d,
    causal_conv1d_update,
    conv1d_silu_quant,
    conv1d_update_silu_quant,
    fake_quantize,
    int8_decode_enabled,
    int8_prefill,
    linear,
    mamba2_decode_step,
    quant_kv_decode,
    quant_linear,
    quant_linear_act,
    quant_selective_scan,
    quant_ssd,
    quant_state_update,
    quantize_act,
    replay_state_update,
    rms_norm,
    rmsnorm_gated,
    selective_scan,
    selective_state_update,
    ssd_chunk_scan,
    ssd_int8,
)

__all__ = [
    "causal_conv1d",
    "causal_conv1d_update",
    "conv1d_silu_quant",
    "conv1d_update_silu_quant",
    "fake_quantize",
    "int8_decode_enabled",
    "int8_prefill",
    "linear",
    "mamba2_decode_step",
    "quant_kv_decode",
    "quant_linear",
    "quant_linear_act",
    "quant_selective_scan",
    "quant_ssd",
    "quant_state_update",
    "replay_state_update",
    "quantize_act",
    "rms_norm",
    "rmsnorm_gated",
    "selective_scan",
    "selective_state_update",
    "ssd_chunk_scan",
    "ssd_int8",
]
