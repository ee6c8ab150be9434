"""The papers' integer path as recipes (``quamba-w8a8-int``, ``quamba2-w8a8-int``, ``quamba2-w4a8-int``): every SSM
layer's conv1d becomes a ``QuantConv1d`` (int8 weight, input and bias codes) and Mamba-1's dt_proj a static W8A8
``QuantLinear``; the layer's plan runs the int8 conv kernels; the checkpoint round-trips exactly."""

from __future__ import annotations

import pytest
import torch

from ssmq.errors import SSMQError
from ssmq.models.conv import CausalConv1d
from ssmq.quant import quantize, save_quantized
from ssmq.quant.checkpoint import load_quantized
from ssmq.quant.conv import QuantConv1d
from ssmq.quant.linear import QuantLinear
from ssmq.quant.recipe import Recipe, get_recipe
from tiny_ssm import synthetic_calibration, tiny_model

CALIB = synthetic_calibration(64, 8, 32)
IDS = synthetic_calibration(64, 2, 12, seed=5).input_ids
CASES = [("mamba1", "quamba-w8a8"), ("mamba1", "quamba2-w8a8"), ("mamba2", "quamba2-w8a8"),
         ("mamba2", "quamba2-w4a8")]
_models = {}


def quantized(arch, name):
    if (arch, name) not in _models:
        _models[arch, name] = quantize(tiny_model(arch), name, CALIB, progress=False)
    return _models[arch, name]


@pytest.mark.parametrize("arch,base", CASES)
def test_int_recipe_quantizes_conv_and_dt_proj_and_its_plan_runs_the_int8_conv(arch, base):
    model, plain = quantized(arch, f"{base}-int"), quantized(arch, base)
    for layer, plain_layer in zip(model.layers, plain.layers):
        mixer = layer.mixer
        assert isinstance(mixer.conv1d, QuantConv1d) and mixer.conv1d.weight.dtype == torch.int8
        assert type(plain_layer.mixer.conv1d) is CausalConv1d  # the named recipe keeps its meaning
        if arch == "mamba1":
            assert isinstance(mixer.dt_proj, QuantLinear) and mixer.dt_proj.act.static
            assert not isinstance(plain_layer.mixer.dt_proj, QuantLinear)
    cache, plain_cache = model.allocate_cache(2, 32), plain.allocate_cache(2, 32)
    for st, plain_st in zip(cache.states, plain_cache.states):
        assert st.plan.kernels[0].endswith("[int8]") and st.plan.formats["conv"].startswith("int8 weights per_tensor")
        assert not plain_st.plan.kernels[0].endswith("[int8]") and "conv" not in plain_st.plan.formats
    with torch.no_grad():  # prefill and decode steps both run the integer conv: the same model
        full = model(IDS)
        model(IDS[:, :8], cache, torch.arange(2))
        steps = torch.stack([model.step(IDS[:, t], cache, torch.arange(2)) for t in range(8, 12)], 1)
    assert (steps - full[:, 8:]).abs().max() <= 0.05 * full.abs().max()


@pytest.mark.parametrize("arch,name", [("mamba1", "quamba-w8a8-int"), ("mamba2", "quamba2-w8a8-int")])
def test_int_checkpoint_round_trips_exactly(tmp_path, arch, name):
    model = quantized(arch, name)
    loaded = load_quantized(save_quantized(model, tmp_path / "q"))
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    assert all(isinstance(layer.mixer.conv1d, QuantConv1d) for layer in loaded.layers)
    assert loaded.layers[0].mixer.conv1d.weight_scale.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(loaded(IDS), model(IDS))
    assert get_recipe(loaded.quantization["recipe"]["name"]).conv == "per_tensor"
    from ssmq.runtime.info import describe

    quant = describe(tmp_path / "q")["quantization"]  # ssmq info: the conv's format, one line per format
    assert quant["  QuantConv1d W int8 per_tensor / A int8 static per_tensor / bias int8 per_tensor"] == \
        f"x {len(model.layers)}"


def test_conv_field_of_the_recipe():
    r = get_recipe("quamba2-w4a8-int")
    assert r.to_dict()["conv"] == "per_tensor" and Recipe.from_dict(r.to_dict()) == r
    assert "conv" not in get_recipe("quamba2-w4a8").to_dict()  # older recipe files and manifests unchanged
    assert r.needs_calibration()
    with pytest.raises(SSMQError, match="conv is one of per_tensor, per_channel"):
        Recipe.from_dict({**r.to_dict(), "conv": "per_group:8"})
    with pytest.raises(SSMQError, match="not llama"):
        Recipe.from_dict({"name": "x", "linears": [], "taps": [], "conv": "per_channel", "supported_archs": ["llama"],
                          "cache": {"state_bits": 8, "state_scales": "dynamic"}})


def test_per_channel_conv_weights():
    recipe = get_recipe("quamba-w8a8-int").with_changes(name="q-int-pc", conv="per_channel")
    model = quantize(tiny_model("mamba2"), recipe, CALIB, progress=False)
    conv = model.layers[0].mixer.conv1d
    assert conv.weight_scale.shape == (conv.channels,) and "per_channel" in conv.conv_format
    with torch.no_grad():
        assert torch.isfinite(model(IDS)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("arch,name", [("mamba1", "quamba-w8a8-int"), ("mamba2", "quamba2-w8a8-int")])
def test_int_conv_kernels_in_the_model_equal_the_references(arch, name, monkeypatch):
    """Prefill and decode with the Triton conv kernels in place of the references (the rest as it is): the same
    logits within float32 rounding (CUDA, or SSMQ_TRITON_INTERPRET=1 on CPU)."""
    import copy

    from ssmq import kernels
    from test_kernels import DEV, INTERPRET, _patch_interpreter_scalars, rel

    pytest.importorskip("triton")
    if INTERPRET:
        _patch_interpreter_scalars()
    from ssmq.kernels import conv1d

    model, ids, slots = copy.deepcopy(quantized(arch, name)).to(DEV), IDS.to(DEV), torch.arange(2, device=DEV)

    @torch.no_grad()
    def run():
        cache = model.allocate_cache(2, 32)
        out = [model(ids[:, :8], cache, slots)[:, -1]]
        out += [model.step(ids[:, t], cache, slots) for t in range(8, 12)]
        return torch.stack(out, 1).float().cpu()

    want = run()
    for fn in ("causal_conv1d", "causal_conv1d_update", "conv1d_silu_quant", "conv1d_update_silu_quant"):
        monkeypatch.setattr(kernels, fn, getattr(conv1d, fn))
    assert rel(run(), want) < 1e-3
