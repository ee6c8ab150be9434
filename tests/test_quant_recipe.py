import json

import pytest
import torch

from _quant_tiny import tiny_calib, tiny_model
from ssmq.errors import SSMQError
from ssmq.quant.api import check, quantize
from ssmq.quant.recipe import RECIPES, Recipe, get_recipe

BASELINES = ["rtn-w8a16", "rtn-w4a16-g128", "static-w8a8", "dynamic-w8a8", "smoothquant-w8a8",
             "hadamard-w8a8", "gptq-w4a16-g128", "fp8-w8a8"]


def test_registry_and_json_roundtrip(tmp_path):
    assert set(BASELINES) <= set(RECIPES)
    for name in BASELINES:
        r = RECIPES[name]
        assert Recipe.from_json(r.to_json()).to_dict() == r.to_dict()
    f = tmp_path / "mine.json"
    d = RECIPES["rtn-w8a16"].to_dict() | {"name": "mine"}
    f.write_text(json.dumps(d))
    assert get_recipe(str(f)).name == "mine"


def _custom(**rule):
    base = {"modules": ["layers.*"], "exclude": ["*.dt_proj"], "weight": {"dtype": "int8"}}
    return {"name": "c", "rules": [base | rule]}


@pytest.mark.parametrize("d,msg", [
    (_custom(weight={"dtype": "int3"}), "unsupported weight dtype"),
    (_custom(weight={"dtype": "fp8"}, act={"dtype": "int8"}), "int8 activations need"),
    (_custom(act={"dtype": "int8", "granularity": "per_token", "static": True}), "static activation"),
    (_custom(weight={"dtype": "int8", "bits": 8}), "unknown weight spec field"),
    ({"name": "c", "rules": [], "transforms": []}, "no rules"),
    (_custom() | {"transforms": [{"name": "smoothquant", "params": {"alpha": 2}}]}, "alpha"),
    (_custom() | {"transforms": ["spin"]}, "unknown transform"),
    (_custom() | {"format": 99}, "format"),
])
def test_malformed_recipes_refused(d, msg):
    with pytest.raises(SSMQError, match=msg):
        Recipe.from_dict(d)


def test_refused_before_any_work():
    m = tiny_model("mamba1")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    mamba2_only = Recipe.from_dict(_custom() | {"supported_archs": ["mamba2"]})
    cases = [
        (mamba2_only, "supports mamba2, not mamba1"),
        (Recipe.from_dict(_custom(modules=["nothing.*"])), "matches no linear"),
        (Recipe.from_dict(_custom(weight={"dtype": "int4", "granularity": "per_group:48"})), "does not divide"),
        ("static-w8a8", "needs calibration"),
    ]
    for recipe, msg in cases:
        with pytest.raises(SSMQError, match=msg):
            quantize(m, recipe, None, progress=False)
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_mamba1_dt_proj_can_be_quantized():
    m = tiny_model("mamba1")
    quantize(m, Recipe.from_dict(_custom(exclude=[])), None, progress=False)
    assert type(m.layers[0].mixer.dt_proj).__name__ == "QuantLinear"


def test_hadamard_refused_for_unsupported_width():
    m = tiny_model("mamba2")
    m.config.d_model = 92  # pretend: no Hadamard of order 92 = 4 * 23
    with pytest.raises(SSMQError, match="no Hadamard"):
        check(get_recipe("hadamard-w8a8"), m)


@pytest.mark.parametrize("arch", ["mamba1", "mamba2", "hybrid"])
def test_every_baseline_applies(arch):
    for name in BASELINES:
        d = RECIPES[name].to_dict()
        for r in d["linears"]:  # the tiny model is 64 wide: groups of 32
            if r["weight"]["granularity"].startswith("per_group"):
                r["weight"]["granularity"] = "per_group:32"
        m = tiny_model(arch)
        ids = torch.randint(0, 256, (1, 8))
        ref = m(ids)
        quantize(m, Recipe.from_dict(d), tiny_calib(2, 16), progress=False)
        out = m(ids)
        assert torch.isfinite(out).all()
        assert ((out - ref).norm() / ref.norm()).item() < 0.5, name
