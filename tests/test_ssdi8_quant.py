"""SSDi8 recipes on tiny models: registry and checks, save -> load bit-identical, the int8 state the prefill writes
is what decode reads, and mean correction lowers the calibration error it is fitted on."""

import pytest
import torch

from _quant_tiny import tiny_calib, tiny_model
from ssmq.errors import SSMQError
from ssmq.quant.api import quantize as quantize_ssm
from ssmq.quant.recipe import RECIPES, Recipe, Transform, get_recipe as get_ssm_recipe
from ssmq.quant.ssm.ssdi8 import SSDi8Scan, gamma_migration_, mean_correction_, out_proj_means
from ssmq.quant.ssm.state_cache import allocate_cache
from ssmq.quant.rotation import rotate_model_ as hadamard_both_  # Quamba2 both-sides: QuaRot, online H


def test_recipes_registered_and_round_trip_json():
    for name in ("ssdi8-w8a8", "ssdi8-w4a8"):
        r = get_ssm_recipe(name)
        assert name in RECIPES and r.cache.state_bits == 8 and r.has("ssdi8")
        assert Recipe.from_dict(r.to_dict()).to_dict() == r.to_dict()
    assert get_ssm_recipe("ssdi8-w8a8").param("mean_correction", "eta") == 0.15


def test_listed_by_quantize_help(capsys):
    from ssmq.cli import main

    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    out = capsys.readouterr().out
    assert "ssdi8-w8a8" in out and "ssdi8-w4a8" in out


def test_checks_refuse_before_work():
    r = get_ssm_recipe("ssdi8-w8a8")
    with pytest.raises(SSMQError, match="supports mamba2, hybrid, not mamba1"):
        quantize_ssm(tiny_model("mamba1"), r, tiny_calib(), progress=False)
    bad = [r.with_changes(name="x", transforms=[Transform("mean_correction")]),
           r.with_changes(name="y", transforms=[Transform("ssdi8"), Transform("hadamard")]),
           r.with_changes(name="z", transforms=[Transform("ssdi8", {"int8_state": False})])]
    for recipe, msg in zip(bad, ["add ssdi8", "after every other transform", "int8_passing needs int8_state"]):
        m = tiny_model("mamba2")
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with pytest.raises(SSMQError, match=msg):
            quantize_ssm(m, recipe, tiny_calib(), progress=False)
        assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_save_load_bit_identical(arch, tmp_path):
    from ssmq.quant import save_quantized
    from ssmq.quant.checkpoint import load_quantized

    q = quantize_ssm(tiny_model(arch), "ssdi8-w8a8", tiny_calib(), progress=False)
    ids = tiny_calib(2, 40).input_ids
    assert isinstance(q.layers[0].mixer.ssd, SSDi8Scan)
    assert q.layers[0].mixer.out_proj.bias is not None  # the mean correction
    if arch == "hybrid":
        assert type(q.layers[1].mixer).__name__ == "Attention"
        assert not any("Quant" in type(m).__name__ for m in q.layers[1].modules())  # SSD-only: attention stays float
    save_quantized(q, tmp_path / "m")
    back = load_quantized(tmp_path / "m")
    assert isinstance(back.layers[0].mixer.ssd, SSDi8Scan)
    sd, sd2 = q.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert torch.equal(q(ids), back(ids))


def test_prefill_writes_the_int8_state_decode_reads():
    torch.manual_seed(0)
    q = quantize_ssm(tiny_model("mamba2"), "ssdi8-w8a8", tiny_calib(), progress=False)
    ids = tiny_calib(2, 49).input_ids  # chunk size 16
    one = allocate_cache(q, 2, 64, ssm_dtype=torch.int8)
    q(ids[:, :48], cache=one)
    two = allocate_cache(q, 2, 64, ssm_dtype=torch.int8)
    q(ids[:, :32], cache=two)
    q(ids[:, 32:48], cache=two)  # reads the int8 state the first prefill wrote, at the scan's own scales
    for a, b in zip(one.ssm_states, two.ssm_states):
        assert a.dtype == torch.int8 and torch.equal(a, b)
    # decode one token from the int8 state vs the same token inside a prefill
    step = q.step(ids[:, 48], one, torch.arange(2))
    full = q(ids)[:, -1]
    rel = ((step.float() - full).norm() / full.norm()).item()
    assert rel < 0.05, rel


def test_mean_correction_lowers_the_calibration_error():
    calib = tiny_calib()
    r = get_ssm_recipe("ssdi8-w8a8")
    q = quantize_ssm(tiny_model("mamba2"), r.with_changes(name="eta0", transforms=r.transforms[:3]), calib,
                     progress=False)
    ref = tiny_model("mamba2")
    gamma_migration_(ref)
    hadamard_both_(ref)  # the same function-preserving transforms: the same residual basis

    def errors(model):
        out = {}
        for i in (0, 1):
            ys = {}
            for name, m in (("ref", ref), ("q", model)):
                h = m.layers[i].mixer.out_proj.register_forward_hook(lambda mod, a, o, n=name: ys.__setitem__(n, o))
                m(calib.input_ids)
                h.remove()
            out[i] = ((ys["ref"] - ys["q"]) ** 2).mean().item()
        return out

    with torch.no_grad():
        before = errors(q)
        want = out_proj_means(ref, [0], calib)[0]
        got = out_proj_means(q, [0], calib)[0]
        added = mean_correction_(q, ref, calib, eta=1.0)
        after = errors(q)
    torch.testing.assert_close(added[0], want - got)
    assert after[0] < before[0] and sum(after.values()) < sum(before.values())
