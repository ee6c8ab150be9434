"""Activation quantization fused into the op that produces an A8 linear's input (``kernels.rms_norm_quant``,
``rmsnorm_gated_quant``, ``hadamard_quant``; switch ``SSMQ_FUSED_ACT_QUANT``): the kernels compile for sm_90, and
quantized models give the same logits with the fusion as without it (bit for bit on CPU). The kernels' arithmetic:
``test_act_quant_kernels.py`` (GPU / interpreter).
"""

from __future__ import annotations

import pytest
import torch

from ssmq.ops.hadamard import hadamard_quant_ref, hadamard_transform
from ssmq.ops.quant_linear import quantize_act_ref


def test_hadamard_quant_reference_is_the_unfused_pair():
    """On CPU the reference is exactly what an unfused rotated A8 linear quantizes: the butterflies, then codes."""
    x = torch.randn(3, 5120).half()
    q, s = hadamard_quant_ref(x)
    q2, s2 = quantize_act_ref(hadamard_transform(x))
    assert torch.equal(q, q2) and torch.equal(s, s2)



# --- the kernels compile for an H100 (sm_90) without a GPU: what the interpreter cannot check ---------------------

@pytest.mark.parametrize("static,dtype", [(False, "fp16"), (True, "bf16")])
def test_norm_quant_kernels_compile_for_sm90(static, dtype):
    from test_kernel_compile import _compile_sm90

    from ssmq.kernels import norm

    _compile_sm90(norm._rms_norm, {"x_ptr": dtype, "res_ptr": "fp32", "w_ptr": dtype, "out_ptr": dtype,
                                   "res_out_ptr": "fp32", "q_ptr": "i8", "scale_ptr": "fp32"},
                  dict(HAS_RES=True, QUANT=True, STATIC=static, BLOCK=4096), floats=("eps",), num_warps=16)
    for one in (True, False):
        _compile_sm90(norm._rmsnorm_gated_quant, {"x_ptr": dtype, "z_ptr": dtype, "w_ptr": dtype, "out_ptr": dtype,
                                                  "q_ptr": "i8", "scale_ptr": "fp32"},
                      dict(HAS_Z=True, NORM_BEFORE_GATE=False, STORE_OUT=True, STATIC=static, ONE_GROUP=one,
                           BLOCK=8192 if one else 2048), floats=("eps",), num_warps=16 if one else 8)


@pytest.mark.parametrize("static,dtype,work,bt,br", [(False, "fp16", "fp16", 64, 128), (True, "bf16", "fp32", 64, 128),
                                                     (True, "fp16", "fp16", 16, 16)])
def test_hadamard_quant_compiles_for_sm90(static, dtype, work, bt, br):
    from test_kernel_compile import _compile_sm90

    from ssmq.kernels import hadamard

    _compile_sm90(hadamard._hadamard_quant, {"x_ptr": dtype, "l_ptr": work, "r_ptr": work, "q_ptr": "i8",
                                             "scale_ptr": "fp32", "y_ptr": dtype},
                  dict(STATIC=static, STORE_Y=True, PRECISION="ieee" if work == "fp32" else "tf32", BT=bt, BR=br))
