"""The fused Mamba-2 decode step's reference equals the unfused path it replaces (CPU, exact in float32).

The kernel is compared with this reference on the GPU in test_kernels.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_ssm import tiny_model

from ssmq import ops
from ssmq.quant.primitives import PerToken, choose_qparams, quantize


def _decode(model, ids, fused: bool):
    """Prefill ids[:, :6], then decode the rest (the Mamba-2 layers on the fused executor, or on the float one asked
    for explicitly); returns (logits of the decoded tokens, cache)."""
    with torch.no_grad():
        cache = model.allocate_cache(max_batch=5, max_seqlen=32)
        for layer, st in zip(model.layers, cache.states):
            if layer.kind == "mamba2":
                st.plan = layer.mixer.plan(st, "fused" if fused else "float")
        slots = torch.tensor([3, 0, 4])  # out of order, slots 1 and 2 untouched
        model(ids[:, :6], cache, slots)
        steps = [model.step(ids[:, t], cache, slots) for t in range(6, ids.shape[1])]
    return torch.stack(steps, 1), cache


@pytest.mark.parametrize("arch,over", [
    ("mamba2", {}), ("mamba2", dict(ngroups=1)), ("mamba2", dict(dt_limit=(0.01, 0.05))),
    ("mamba2", dict(norm_group_size=64)), ("hybrid", {}),
])
def test_fused_step_equals_unfused_step(arch, over):
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(0))
    fused, cf = _decode(tiny_model(arch, **over), ids, True)
    unfused, cu = _decode(tiny_model(arch, **over), ids, False)
    assert torch.equal(fused, unfused)
    for a, b in zip(cf.conv_states + cf.ssm_states, cu.conv_states + cu.ssm_states):
        assert (a is None and b is None) or torch.equal(a, b)


def test_quantized_tap_or_int8_state_keeps_the_unfused_path():
    model = tiny_model("mamba2")
    mixer = model.layers[0].mixer
    state = model.allocate_cache(max_batch=2, max_seqlen=8).states[0]
    assert state.plan.executor == "fused" and mixer.plan(state).executor == "fused"
    from ssmq.models.state import Int8StateScales

    scales = Int8StateScales(torch.ones(1, state.ssm.shape[-1]))
    state_int8 = type(state)(state.conv, state.ssm.to(torch.int8), scales=scales)  # any int8 state
    assert mixer.plan(state_int8).executor == "int8"
    mixer.act_x = torch.nn.ReLU()  # any module on a tap between in_proj and the norm
    assert mixer.plan(state).executor == "float"


def _inputs(b=3, s=5, h=4, p=8, g=2, n=16, w=4, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    conv_dim = h * p + 2 * g * n
    return dict(
        xbc=r(b, conv_dim), z=r(b, h * p), dt=r(b, h), conv_state=r(s, conv_dim, w - 1), conv_weight=r(conv_dim, w),
        conv_bias=r(conv_dim), ssm_state=r(s, h, p, n), A=-torch.rand(h, generator=gen) - 0.1, D=torch.randn(h, generator=gen),
        dt_bias=torch.randn(h, generator=gen), norm_weight=r(h * p), ngroups=g, norm_group_size=h * p // g, eps=1e-5,
        slots=torch.tensor([4, 1, 2])[:b],
    )


@pytest.mark.parametrize("static", [False, True])
def test_quantized_output_uses_the_primitives_rounding(static):
    kw = _inputs()
    out_scale = torch.tensor(0.02) if static else None
    out, q, scale = ops.mamba2_decode_step_ref(**kw, quantize=True, out_scale=out_scale)
    if static:
        ref_scale = out_scale
    else:
        ref_scale, _ = choose_qparams(out, PerToken(), "int8")
    assert torch.equal(scale, ref_scale.float())
    assert torch.equal(q, quantize(out, ref_scale.expand(out.shape[:-1]), None, PerToken(), "int8"))
    assert q.abs().max() >= (127 if not static else 1)


def test_decode_step_updates_only_the_served_slots():
    kw = _inputs()
    conv0, ssm0 = kw["conv_state"].clone(), kw["ssm_state"].clone()
    ops.mamba2_decode_step_ref(**kw, dt_limit=(0.0, math.inf))
    untouched = torch.tensor([0, 3])
    assert torch.equal(kw["conv_state"][untouched], conv0[untouched])
    assert torch.equal(kw["ssm_state"][untouched], ssm0[untouched])
    assert not torch.equal(kw["ssm_state"][kw["slots"]], ssm0[kw["slots"]])
