"""The ``KernelPolicy`` from the environment: the one place the kernel variables are read (the CLI, at start).

    SSMQ_REF_OPS=1            the ``ssmq.ops`` references on every device (accuracy baselines on a GPU)
    SSMQ_PDL=0                launch every kernel without Programmatic Dependent Launch
    SSMQ_FUSED_ACT_QUANT=0    A8 linears quantize their own inputs (no codes from the norms)
    SSMQ_KV_FUSED_APPEND=0    a quantized KV cache is written by the reference ops
    SSMQ_KV_FAST=0            every KV cache decodes on ``kv_decode`` (A/B timing)
    SSMQ_KV_WARP=0            the formats ``kv_decode_warp`` serves decode on ``kv_decode_fast`` (A/B timing)
    SSMQ_REPACKED_DECODE=1    int4 linears also hold their codes repacked for the batch-1 decode GEMV
A Python caller builds the policy itself (``ssmq.kernels.policy``); nothing below the runtime reads these.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ssmq.errors import SSMQError
from ssmq.kernels.policy import KV_DECODE_KERNELS, KernelPolicy

# variable -> the policy field it sets (a boolean: "1" on, "0" off)
FLAGS = {"SSMQ_REF_OPS": "reference_ops", "SSMQ_PDL": "pdl", "SSMQ_FUSED_ACT_QUANT": "act_quant_fusion",
         "SSMQ_KV_FUSED_APPEND": "kv_fused_append", "SSMQ_REPACKED_DECODE": "repacked_decode"}
# variable -> the KV decode kernels it leaves out when "0"
KV_OFF = {"SSMQ_KV_FAST": ("kv_decode_fast", "kv_decode_warp"), "SSMQ_KV_WARP": ("kv_decode_warp",)}


def policy_from_env(environ: Mapping[str, str] = os.environ) -> KernelPolicy:
    """The policy the variables above ask for (the default for those unset)."""
    changes, off = {}, set()
    for name in (*FLAGS, *KV_OFF):
        value = environ.get(name)
        if value is None:
            continue
        if value not in ("0", "1"):
            raise SSMQError(f"{name}={value!r}: expected 0 or 1")
        if name in FLAGS:
            changes[FLAGS[name]] = value == "1"
        elif value == "0":
            off.update(KV_OFF[name])
    return KernelPolicy(**changes, kv_decode=tuple(k for k in KV_DECODE_KERNELS if k not in off))
