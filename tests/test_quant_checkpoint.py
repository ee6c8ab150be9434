import json

import pytest
import torch

from _quant_tiny import tiny_calib, tiny_model
from ssmq.errors import SSMQError
from ssmq.quant import checkpoint
from ssmq.quant.api import quantize
from ssmq.quant.checkpoint import load_quantized, save_quantized
from ssmq.quant.recipe import RECIPES, Recipe


def _recipe(name):
    d = RECIPES[name].to_dict()
    for r in d["linears"]:
        if r["weight"]["granularity"].startswith("per_group"):
            r["weight"]["granularity"] = "per_group:32"
    return Recipe.from_dict(d)


@pytest.mark.parametrize("arch,name", [("mamba1", "static-w8a8"), ("mamba2", "gptq-w4a16-g128"),
                                       ("hybrid", "hadamard-w8a8"), ("mamba2", "smoothquant-w8a8")])
def test_save_load_bit_identical(tmp_path, arch, name):
    m = quantize(tiny_model(arch), _recipe(name), tiny_calib(), progress=False)
    ids = torch.randint(0, 256, (2, 12))
    ref = m(ids)
    save_quantized(m, tmp_path / "q")
    manifest = json.loads((tmp_path / "q" / "quantization.json").read_text())
    assert manifest["calibration"]["seed"] == 0 and manifest["recipe"]["name"] == name
    assert set(manifest["files"]) == {"model.safetensors"}
    loaded = load_quantized(tmp_path / "q")
    assert torch.equal(loaded(ids), ref)
    import ssmq
    assert torch.equal(ssmq.load_model(tmp_path / "q")(ids), ref)  # the generic loader dispatches here


def test_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    m = quantize(tiny_model("mamba2"), "rtn-w8a16", progress=False)
    import safetensors.torch

    def boom(tensors, path, metadata=None):
        open(path, "wb").write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        save_quantized(m, tmp_path / "q")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SSMQError):
        load_quantized(tmp_path / "q")


def test_checksum_and_version_mismatch_refused(tmp_path):
    m = quantize(tiny_model("mamba1"), "rtn-w8a16", progress=False)
    out = save_quantized(m, tmp_path / "q")
    f = out / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(SSMQError, match="checksum mismatch for model.safetensors"):
        load_quantized(out)
    out2 = save_quantized(m, tmp_path / "q2")
    man = json.loads((out2 / "quantization.json").read_text())
    man["format_version"] = checkpoint.FORMAT_VERSION + 1
    (out2 / "quantization.json").write_text(json.dumps(man))
    with pytest.raises(SSMQError, match="format version"):
        load_quantized(out2)
    with pytest.raises(SSMQError, match="already exists"):
        save_quantized(m, out2)
