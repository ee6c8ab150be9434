"""Layout facts (ssmq.ops.layout): segment offsets, the heads-per-group check, Δ discretization, layer kinds."""

import math

import pytest
import torch

from ssmq.models import ModelConfig, SSMLM
from ssmq.ops import layout
from ssmq.ops.layout import LayerKind


def test_mamba2_in_proj_segments_offsets_and_fuse():
    seg = layout.mamba2_in_proj_segments(d_inner=8, ngroups=2, d_state=3, nheads=4)
    assert seg.names == ("z", "x", "B", "C", "dt") and seg.total == 8 + 8 + 6 + 6 + 4
    assert [seg.offset(n) for n in seg.names] == [0, 8, 16, 22, 28]
    assert seg.slice("C") == slice(22, 28)
    coarse = seg.fuse(("x", "B", "C"), "xBC")
    assert coarse.names == ("z", "xBC", "dt") and coarse.sizes == (8, 20, 4)
    t = torch.arange(seg.total)
    z, x, B, C, dt = seg.split(t)
    assert torch.equal(torch.cat([x, B, C]), coarse.split(t)[1]) and dt.tolist() == [28, 29, 30, 31]
    with pytest.raises(ValueError, match="cannot split 31"):
        seg.split(torch.zeros(31))
    with pytest.raises(ValueError, match="not adjacent"):
        seg.fuse(("z", "B"), "zB")


def test_mamba1_segments():
    assert layout.mamba1_in_proj_segments(6).slices() == {"x": slice(0, 6), "z": slice(6, 12)}
    assert layout.mamba1_x_proj_segments(2, 4).slices() == {"dt": slice(0, 2), "B": slice(2, 6), "C": slice(6, 10)}
    assert layout.mamba1_conv_segments(6).total == 6


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_model_projections_have_the_layout_sizes(arch):
    cfg = ModelConfig(arch=arch, d_model=16, n_layer=1, vocab_size=32, d_state=4, headdim=8, ngroups=2)
    mixer = SSMLM(cfg).layers[0].mixer
    assert mixer.in_proj.out_features == cfg.in_proj_segments().total
    assert mixer.conv1d.in_channels == cfg.conv_segments().total == cfg.conv_dim
    if arch == "mamba1":
        assert mixer.x_proj.out_features == cfg.x_proj_segments().total
    else:
        assert cfg.in_proj_segments().size("dt") == cfg.nheads == 4 and cfg.heads_per_group == 2


def test_heads_per_group_is_the_one_check():
    assert layout.heads_per_group(8, 2) == 4
    with pytest.raises(ValueError, match="nheads 5 is not a multiple of ngroups 2"):
        layout.heads_per_group(5, 2)
    with pytest.raises(ValueError, match="not a multiple of ngroups"):
        ModelConfig(arch="mamba2", d_model=20, n_layer=1, vocab_size=8, headdim=8, ngroups=2)  # 5 heads
    with pytest.raises(ValueError, match="not a multiple of ngroups"):
        from ssmq import ops
        ops.selective_state_update_ref(torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2), torch.zeros(1, 3, 2),
                                       torch.zeros(3, 2, 4), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))


def test_norm_group_size():
    assert layout.norm_group_size(16, 2) == 8 and layout.norm_group_size(16, 2, 16) == 16
    with pytest.raises(ValueError, match="does not divide"):
        layout.norm_group_size(16, 1, 5)


def test_discretize_dt_matches_the_formula():
    g = torch.Generator().manual_seed(0)
    dt, bias = torch.randn(2, 5, 3, generator=g) * 4, torch.randn(3, generator=g)
    expect = torch.log1p(torch.exp(dt.double() + bias.double())).float()  # softplus, independently
    assert torch.allclose(layout.discretize_dt(dt, bias), expect, atol=1e-6)
    clamped = layout.discretize_dt(dt, bias, True, (0.05, 0.5))
    assert torch.allclose(clamped, expect.clamp(0.05, 0.5), atol=1e-6) and clamped.max() <= 0.5
    assert torch.equal(layout.discretize_dt(dt.half(), None, False), dt.half().float())
    assert not layout.has_dt_limit((0.0, math.inf)) and layout.has_dt_limit((0.0, 1.0))


def test_layer_kinds_are_strings_too():
    cfg = ModelConfig(arch="hybrid", d_model=16, n_layer=3, vocab_size=8, headdim=8, d_state=4,
                      attn_layer_idx=(1,), attn_heads=2, attn_kv_heads=1, attn_head_dim=8)
    assert [cfg.layer_kind(i) for i in range(3)] == [LayerKind.MAMBA2, LayerKind.ATTENTION, LayerKind.MAMBA2]
    assert cfg.ssm_layers() == [0, 2] and cfg.attention_layers() == [1]
    assert cfg.layer_kind(1) == "attention" and {"mamba2": 1}[cfg.layer_kind(0)] == 1
    assert ModelConfig(arch="mamba1", d_model=8, n_layer=2, vocab_size=8).ssm_layers() == [0, 1]
