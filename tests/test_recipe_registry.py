"""The one recipe registry: every built-in is data that round-trips through JSON, reads back from ssmq 0.1's
format, and quantizes a tiny model whose checkpoint loads back bit-identical."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ssmq.errors import SSMQError
from ssmq.quant import RECIPES, Recipe, Search, get_recipe, load_model, quantize, save_quantized
from ssmq.quant.api import TRANSFORMS
from ssmq.quant.recipe import TRANSFORMS as TRANSFORM_PARAMS
from tiny_ssm import synthetic_calibration, tiny_model

FORMAT1 = json.loads((Path(__file__).parent / "data" / "recipes_format1.json").read_text())  # ssmq 0.1's to_dict()


def builtin_of_format1_time(name: str) -> dict:
    """The built-in recipe's dict as ssmq 0.1 wrote it: it listed the architectures it had, llama came later."""
    d = RECIPES[name].to_dict()
    d["supported_archs"] = [a for a in d["supported_archs"] if a != "llama"]
    return d


def test_every_transform_has_a_function():
    assert set(TRANSFORMS) == set(TRANSFORM_PARAMS)


@pytest.mark.parametrize("name", sorted(FORMAT1))
def test_format1_recipes_read_as_the_builtins(name):
    assert FORMAT1[name]["format"] == 1
    assert Recipe.from_dict(FORMAT1[name]).to_dict() == builtin_of_format1_time(name)


def test_every_builtin_round_trips_json_and_is_listed(tmp_path):
    assert set(FORMAT1) <= set(RECIPES)
    for name, r in RECIPES.items():
        assert Recipe.from_json(r.to_json()).to_dict() == r.to_dict(), name
        f = tmp_path / f"{name}.json"
        f.write_text(r.to_json())
        assert get_recipe(str(f)).to_dict() == r.to_dict()


def test_mixed_is_a_recipe_plus_a_search():
    mixed, a8, a16 = RECIPES["quamba2-mixed"], RECIPES["quamba2-w4a8"], RECIPES["quamba2-w4a16"]
    assert mixed.search == Search() and replace(mixed, search=None, name=a8.name, description=a8.description) == a8
    assert replace(a8.at_16bit_activations(), name=a16.name, description=a16.description) == a16
    old = FORMAT1["quamba2-mixed"] | {"mixed": {"a8": "quamba2-w4a8", "a16": "rtn-w8a16"}}
    with pytest.raises(SSMQError, match="search"):
        Recipe.from_dict(old)


@pytest.mark.parametrize("d,msg", [
    ({"format": 3, "name": "x"}, "format 3"),
    ({"name": "x", "linears": [{"modules": "*", "weight": {"dtype": "int8"}}], "cache": {"kv": "int8"}}, "unknown KV format 'int8'"),
    ({"name": "x", "linears": [{"modules": "*", "weight": {"dtype": "int8"}}], "taps": [{"taps": ["act_x"]}]},
     "SSM taps"),
    ({"name": "x", "linears": [{"modules": "*", "weight": {"dtype": "int8"}}], "colour": 1}, "unknown recipe field"),
])
def test_malformed_format2_refused(d, msg):
    with pytest.raises(SSMQError, match=msg):
        Recipe.from_dict(d)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_builtin_saves_and_loads_bit_identical(tmp_path, name):
    recipe = RECIPES[name]
    if recipe.search:  # a short search: 4 layers, one at A16
        recipe = recipe.with_changes(search=replace(recipe.search, population=2, generations=1, mutations=1,
                                                    crossovers=1))
    arch = "mamba2" if "mamba2" in recipe.supported_archs else recipe.supported_archs[0]
    calib = synthetic_calibration(64, 4, 32)
    model = quantize(tiny_model(arch), recipe, calib, progress=False)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids)
    save_quantized(model, tmp_path / "q")
    loaded = load_model(tmp_path / "q")
    assert loaded.quantization["recipe"] == recipe.to_dict()
    with torch.no_grad():
        assert torch.equal(loaded(ids), ref)
    # a checkpoint of ssmq 0.1 (format-1 recipe in quantization.json) loads, its recipe read as format 2
    if name in FORMAT1 and recipe == RECIPES[name]:
        manifest = json.loads((tmp_path / "q" / "quantization.json").read_text())
        (tmp_path / "q" / "quantization.json").write_text(json.dumps(manifest | {"recipe": FORMAT1[name]}))
        assert load_model(tmp_path / "q").quantization["recipe"] == builtin_of_format1_time(name)


def test_cli_quantize_help_lists_every_builtin():
    from ssmq.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = sub.choices["quantize"].format_help()
    assert all(f"  {name} " in text for name in RECIPES)


def test_cli_quantize_then_every_loader(tmp_path, capsys):
    from conftest import shared_or_skip
    from ssmq.cli import main
    from ssmq.models import load_model as load_float

    src = shared_or_skip("models", "mamba1")
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(src), "--recipe", "rtn-w8a16", "--out", str(out)]) == 0
    assert "rtn-w8a16" in capsys.readouterr().out
    assert type(load_model(out).layers[0].mixer.in_proj).__name__ == "QuantLinear"
    with pytest.raises(SSMQError, match="quantized checkpoint: load it with ssmq.load_model"):
        load_float(out)
    assert main(["quantize", "--model", str(src), "--recipe", "quamba2-w8a8", "--out", str(out)]) == 1  # exists
