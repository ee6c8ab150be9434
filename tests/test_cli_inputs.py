"""The inputs of ssmq's commands: the Quickstart checkpoint under ``ssmq info``, prompts from files and stdin,
--max-new-tokens past a model's positions, the seed rule shared with the server, strict schemas."""

from __future__ import annotations

import io
import json
import sys

import pytest

from conftest import shared_or_skip
from ssmq.cli import main, max_new_tokens
from ssmq.errors import SSMQError
from tiny_ssm import tiny_model


def cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_info_on_the_quickstart_checkpoint(tmp_path, capsys):
    """README Quickstart: ``ssmq quantize --recipe quamba2-w8a8 ... --out out/mamba2-w8a8``, then ``ssmq info``."""
    src = shared_or_skip("models", "mamba2")
    shared_or_skip("data", "train")
    out = tmp_path / "out" / "mamba2-w8a8"
    code, text, err = cli(capsys, "quantize", "--model", src, "--recipe", "quamba2-w8a8", "--calib-samples", "4",
                          "--calib-seqlen", "64", "--batch-size", "4", "--device", "cpu", "--out", out)
    assert code == 0, err[-2000:]
    assert "(weights 54.5 MB -> " in text
    code, text, err = cli(capsys, "info", "--model", out)
    assert code == 0, err[-2000:]
    for want in ("[model]", "architecture                 mamba2", "[quantization]", "recipe                       "
                 "quamba2-w8a8", "QuantLinear W int8 per_channel rtn / A int8 static per_tensor",
                 "QuantEmbedding W int8", "16-bit SSM state", "bfloat16",
                 "[files]", "weights on disk"):
        assert want in text, (want, text)


def test_prompt_file_and_stdin(tmp_path, capsys, monkeypatch):
    src = shared_or_skip("models", "mamba2")
    f = tmp_path / "p.txt"
    f.write_text("The history of\n")
    args = ["generate", "--model", src, "--device", "cpu", "--max-new-tokens", "3"]
    code, from_file, err = cli(capsys, *args, "--prompt-file", f)
    assert code == 0, err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"The history of")))
    code, from_stdin, err = cli(capsys, *args, "--prompt-file", "-")
    assert code == 0, err
    code, from_arg, err = cli(capsys, *args, "--prompt", "The history of")
    assert from_file == from_stdin == from_arg and from_arg.startswith("The history of")
    f.write_bytes(b"")
    code, _, err = cli(capsys, *args, "--prompt-file", f)
    assert code == 1 and "a prompt is empty" in err


def test_max_new_tokens_past_the_positions_is_lowered_with_a_warning(capsys):
    hybrid = tiny_model("hybrid", max_position_embeddings=16)
    assert max_new_tokens(hybrid, [10, 4], 100) == 6
    assert "warning: --max-new-tokens 100 runs past this model's context of 16 positions" in capsys.readouterr().err
    assert max_new_tokens(hybrid, [10], 6) == 6 and capsys.readouterr().err == ""
    with pytest.raises(SSMQError, match="the prompt has 16 tokens; this model's context is 16 positions"):
        max_new_tokens(hybrid, [16], 1)
    assert max_new_tokens(tiny_model("mamba2"), [10_000], 10**6) == 10**6  # no positions in an SSM


def test_seed_rule_is_shared_by_generate_and_the_server(capsys):
    from ssmq.runtime.protocol import APIError, CompletionRequest, Prompt, check

    for seed in (-1, 2**63):
        code, _, err = cli(capsys, "generate", "--seed", str(seed))
        assert code == 1 and "seed must be an integer in [0, 2**63)" in err
        with pytest.raises(APIError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
            check(CompletionRequest(prompt="x", seed=seed), [Prompt([1], "x")], 64, 32)
    check(CompletionRequest(prompt="x", seed=0), [Prompt([1], "x")], 64, 32)


@pytest.mark.parametrize("edit,needle", [
    ({"weight": {"dtype": "int8", "symmetric": "yes"}}, "weight spec field 'symmetric' must be true or false"),
    ({"weight": {"dtype": "int9"}}, "unsupported weight dtype 'int9'"),
    ({"weight": {"dtype": "int8", "damp": 2.0}}, "bad gptq settings"),
    ({"weight": {"dtype": "int8", "block_size": "128"}}, "'block_size' must be an integer"),
    ({"act": {"static": "true"}, "weight": {"dtype": "int8"}}, "'static' must be true or false"),
    ({"modules": 3, "weight": {"dtype": "int8"}}, "rule field 'modules' must be a list of strings"),
])
def test_recipe_schema_names_the_field(tmp_path, edit, needle):
    from ssmq.quant import get_recipe

    f = tmp_path / "r.json"
    f.write_text(json.dumps({"name": "r", "linears": [{"modules": ["layers.*"], **edit}]}))
    with pytest.raises(SSMQError, match="r.json: .*" + needle.replace("(", r"\(").replace("*", r"\*")):
        get_recipe(str(f))


@pytest.mark.parametrize("edit,needle", [
    ({"transforms": [{"name": "smoothquant", "params": {"alpha": "0.5"}}]}, "parameter 'alpha' must be a number"),
    ({"transforms": [{"name": "hadamard", "params": {"online": 1}}]}, "parameter 'online' must be true or false"),
    ({"calibration": {"state_windows": 0}}, "calibration field 'state_windows' must be >= 1"),
    ({"cache": {"state_bits": "8"}}, "cache field 'state_bits' must be an integer"),
    ({"supported_archs": "mamba2"}, "recipe field 'supported_archs' must be a list of strings"),
])
def test_recipe_schema_other_parts(edit, needle):
    from ssmq.quant import Recipe

    with pytest.raises(SSMQError, match=needle):
        Recipe.from_dict({"name": "r", "linears": [{"modules": ["layers.*"], "weight": {"dtype": "int8"}}], **edit})


def test_manifest_schema_names_the_field(tmp_path):
    from ssmq.quant import quantize, save_quantized
    from ssmq.quant.checkpoint import load_quantized

    out = save_quantized(quantize(tiny_model("mamba2"), "rtn-w8a16", progress=False), tmp_path / "q")
    good = json.loads((out / "quantization.json").read_text())
    for edit, needle in [({"dtype": "nonsense"}, "field 'dtype' must be one of float32"),
                         ({"modules": {"x": 3}}, "'modules' entry 'x' must be an object"),
                         ({"files": {"model.safetensors": "abc"}}, "must map a file name to a sha256"),
                         ({"model_config": {**good["model_config"], "d_model": "64"}}, "'d_model' must be an integer"),
                         ({"extra": 1}, "unknown quantization.json field"),
                         ({"recipe": {**good["recipe"], "name": 5}}, "recipe field 'name' must be a string")]:
        (out / "quantization.json").write_text(json.dumps({**good, **edit}))
        with pytest.raises(SSMQError, match=needle):
            load_quantized(out)
