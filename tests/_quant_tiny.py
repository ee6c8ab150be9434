"""Tiny random SSMLMs for the quantization tests (no files needed)."""

import torch

from ssmq.models import SSMLM, ModelConfig
from ssmq.quant.calibration import CalibrationData

CONFIGS = {
    "mamba1": dict(arch="mamba1", d_model=64, n_layer=2, vocab_size=256),
    "mamba2": dict(arch="mamba2", d_model=64, n_layer=2, vocab_size=256, d_state=16, headdim=16, chunk_size=16),
    "hybrid": dict(arch="hybrid", d_model=64, n_layer=2, vocab_size=256, d_state=16, headdim=16, chunk_size=16,
                   attn_layer_idx=(1,), attn_heads=4, attn_kv_heads=2, attn_head_dim=16, rotary_dim=8,
                   mlp_hidden=128),
}


def tiny_model(arch: str, seed: int = 0) -> SSMLM:
    torch.manual_seed(seed)
    m = SSMLM(ModelConfig(**CONFIGS[arch])).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.uniform_(0.5, 1.5)  # non-trivial norm weights, so folding is tested
    return m


def tiny_calib(n: int = 4, seqlen: int = 32) -> CalibrationData:
    return CalibrationData(torch.randint(0, 256, (n, seqlen), generator=torch.Generator().manual_seed(0)),
                           "random", 0)
