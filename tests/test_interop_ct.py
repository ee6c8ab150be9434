"""compressed-tensors interop: ssmq export is read back exactly by the library (its own decompression)
and by transformers; ssmq loads compressed-tensors checkpoints written through the library's API (as
llm-compressor's ``oneshot`` saves them) and matches transformers + compressed-tensors; every refusal."""

import json

import pytest
import torch

pytest.importorskip("compressed_tensors")

import ssmq  # noqa: E402
from ssmq.cli import main  # noqa: E402
from ssmq.errors import SSMQError  # noqa: E402
from ssmq.quant import Recipe, quantize, save_quantized  # noqa: E402
from ssmq.quant.compressed_tensors import export_compressed_tensors  # noqa: E402
from ssmq.quant.linear import QuantLinear  # noqa: E402
from tiny_ssm import synthetic_calibration, tiny_model  # noqa: E402

IDS = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
# int4 g16 in_proj / MLP up_proj (pack-quantized) + static int8 W8A8 elsewhere (int-quantized): mixed-precision
MIXED = Recipe.from_dict({"name": "mixed", "rules": [
    {"modules": ["*.in_proj", "*.mlp.up_proj"], "weight": {"dtype": "int4", "granularity": "per_group:16"}},
    {"modules": ["layers.*"], "exclude": ["*.dt_proj"], "weight": {"dtype": "int8"},
     "act": {"dtype": "int8", "granularity": "per_tensor", "static": True}}]})
# fp8-w8a8 as the FP8 QuantLinear stores it (per-channel e4m3 weights, dynamic per-token e4m3 inputs)
FP8_DYNAMIC = Recipe.from_dict({"name": "fp8", "rules": [
    {"modules": ["layers.*"], "exclude": ["*.dt_proj"], "weight": {"dtype": "fp8", "granularity": "per_channel"},
     "act": {"dtype": "fp8", "granularity": "per_token", "static": False}}]})
# transformers' Mamba-2 gated norm spans all of d_inner and Bamba keeps the residual in the model dtype
HF_SEMANTICS = {"mamba1": {}, "mamba2": {"ngroups": 1}, "hybrid": {"ngroups": 1, "residual_in_fp32": False},
                "llama": {}}


def _ssmq_checkpoint(tmp_path, arch, recipe, **overrides):
    model = tiny_model(arch, **overrides)
    quantize(model, recipe, synthetic_calibration(model.config.vocab_size))
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"fake": "tokenizer"}')
    return save_quantized(model, tmp_path / "q", extra_files=[tok])


def _module_tensors(folder):
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    groups = {}
    for k, v in state.items():
        owner, _, local = k.rpartition(".")
        groups.setdefault(owner, {})[local] = v
    return groups


# ------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("recipe,fmt,names", [
    ("rtn-w8a16", "pack-quantized", {"weight_packed", "weight_scale", "weight_shape"}),
    ("rtn-w4a16-g128", "pack-quantized", {"weight_packed", "weight_scale", "weight_shape"}),
    ("static-w8a8", "int-quantized", {"weight", "weight_scale", "input_scale"}),
    ("dynamic-w8a8", "int-quantized", {"weight", "weight_scale"}),
    ("smoothquant-w8a8", "int-quantized", {"weight", "weight_scale", "input_scale"}),
    (FP8_DYNAMIC, "float-quantized", {"weight", "weight_scale"}),
])
def test_export_decompresses_to_ssmq_weights(tmp_path, recipe, fmt, names):
    """compressed-tensors' own compressor, fed the exported tensors, returns ssmq's dequantized weights."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    src = _ssmq_checkpoint(tmp_path, "mamba2", recipe)
    out = export_compressed_tensors(src, tmp_path / "ct")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Mamba2ForCausalLM"] and (out / "tokenizer.json").is_file()
    qc = QuantizationConfig.model_validate(raw["quantization_config"])
    # a pack-quantized Mamba out_proj is written int-quantized (transformers' init reads its .weight): two groups
    packed = fmt == "pack-quantized"
    assert qc.quant_method == "compressed-tensors" and qc.ignore == ["lm_head"]
    assert qc.format == ("mixed-precision" if packed else fmt)
    schemes = {t: s for s in qc.config_groups.values() for t in s.targets}
    tensors = _module_tensors(out)
    model = ssmq.load_model(src)
    checked = 0
    for path, m in model.named_modules():
        if isinstance(m, QuantLinear):
            local = tensors[f"backbone.{path}"]
            scheme = schemes.get(f"backbone.{path}") or schemes["Linear"]
            as_int = packed and path.endswith("out_proj")
            assert set(local) == ({"weight", "weight_scale"} if as_int else names)
            assert scheme.format == ("int-quantized" if as_int else fmt)
            weight = BaseCompressor.get_value_from_registry(scheme.format).decompress(local, scheme)["weight"]
            assert torch.equal(weight, m.dequantized_weight())
            checked += 1
    assert checked == 2 * model.config.n_layer


def _teacher_forced_logits(model, hf, ids, monkeypatch):
    """transformers' logits with each quantized linear handed ssmq's input to it, once its own input is checked to
    agree with that to float32 rounding; and ssmq's logits (its A8 linears fed float inputs, as transformers' are).

    A static int8 input scale makes a linear a step function of its input: a float32 rounding difference of 1e-6 that
    puts one value on the other side of a rounding tie (x / scale = k + 0.5) moves its code by one, and every logit
    after it by a quantization step (1% of the max logit in the tiny hybrid). Handing over the input stops that step
    from propagating; the check on transformers' own input still tests every module before the linear."""
    from ssmq.kernels import policy
    from ssmq.models.hf_layout import rename_to_hf

    # float inputs, not producer-made codes, reach them
    monkeypatch.setattr(policy, "_ACTIVE", [policy.KernelPolicy(act_quant_fusion=False)])
    inputs, handed = {}, []
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            m.register_forward_pre_hook(lambda _, args, name=name: inputs.__setitem__(name, args[0]))
    ours = model(ids)

    def hand_over(args, x):
        assert args[0].shape == x.shape and (args[0] - x).abs().max() <= 1e-4 * x.abs().max()
        handed.append(x)
        return (x,)

    for name, x in inputs.items():
        hf_name = rename_to_hf(f"{name}.weight", model.config).removesuffix(".weight")
        hf.get_submodule(hf_name).register_forward_pre_hook(lambda _, args, x=x: hand_over(args, x))
    theirs = hf(ids).logits
    assert len(handed) == len(inputs)
    return ours, theirs


@pytest.mark.parametrize("arch", ["mamba1", "mamba2", "hybrid", "llama"])
def test_export_loads_back_bit_identical_and_runs_in_transformers(tmp_path, arch, monkeypatch):
    import transformers as tf

    src = _ssmq_checkpoint(tmp_path, arch, MIXED, **HF_SEMANTICS[arch])
    out = export_compressed_tensors(src, tmp_path / "ct")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "mixed-precision"
    with torch.no_grad():
        ref = ssmq.load_model(src)(IDS)
        again = ssmq.load_model(out)
        assert torch.equal(again(IDS), ref)
        hf = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ours, theirs = _teacher_forced_logits(again, hf, IDS, monkeypatch)
    assert torch.equal(ours, ref)  # the producers' int8 codes are the linears' own, bit for bit on CPU
    assert any(isinstance(m, QuantLinear) and m.wspec.dtype == "int4" for m in again.modules())
    # transformers + compressed-tensors: decompressed weights, fake-quantized inputs; float32 rounding apart
    assert (theirs - ref).abs().max() < 1e-4 * ref.abs().max()


# ------------------------------------------------------------------------- compressed-tensors -> ssmq
def _ct_checkpoint(folder, arch, schemes, ignore=("lm_head",)):
    """A tiny transformers model quantized through compressed-tensors' API and saved as llm-compressor
    does (``ModelCompressor.compress_model`` + ``save_pretrained`` + ``update_config``)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    from hf_tiny import tiny_hf_model

    model = tiny_hf_model(arch)
    config = QuantizationConfig(config_groups=schemes, ignore=list(ignore), quantization_status="frozen")
    apply_quantization_config(model, config)
    g = torch.Generator().manual_seed(0)
    for _, mod in model.named_modules():
        scheme = getattr(mod, "quantization_scheme", None)
        if scheme is None:
            continue
        w, a = mod.weight.data, scheme.weights
        blocks = w.unflatten(-1, (-1, a.group_size)) if a.strategy == "group" else w.reshape(w.shape[0], 1, -1)
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        if a.strategy == "tensor":
            lo, hi = w.min().reshape(1), w.max().reshape(1)
        scale, zero = calculate_qparams(lo, hi, a)
        mod.weight_scale.data.copy_(scale.reshape(mod.weight_scale.shape))
        if not a.symmetric:
            mod.weight_zero_point.data.copy_(zero.reshape(mod.weight_zero_point.shape))
        if scheme.input_activations is not None and not scheme.input_activations.dynamic:
            mod.input_scale.data.fill_(0.01 + 0.02 * torch.rand((), generator=g).item())
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    return folder


def _w4_w8a8(dynamic: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    act = (QuantizationArgs(num_bits=8, strategy="token", dynamic=True) if dynamic
           else QuantizationArgs(num_bits=8, strategy="tensor", dynamic=False))
    return {"group_0": QuantizationScheme(targets=["re:.*(in_proj|mlp\\.up_proj)$"],
                                          weights=QuantizationArgs(num_bits=4, strategy="group", group_size=16)),
            "group_1": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, strategy="channel"),
                                          input_activations=act)}


def _hf_reference(folder):
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(IDS[:, :12] % 96).logits
    return hf, logits


@pytest.mark.parametrize("arch", ["mamba1", "mamba2", "hybrid", "llama"])
def test_compressed_tensors_checkpoint_matches_transformers(tmp_path, arch):
    """W4A16 g16 (pack-quantized) + static W8A8 (int-quantized): same function as transformers + compressed-tensors."""
    folder = _ct_checkpoint(tmp_path / "ct", arch, _w4_w8a8(dynamic=False), ignore=("lm_head", "re:.*dt_proj$"))
    model = ssmq.load_model(folder)
    q = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert {m.wspec.dtype for m in q} == {"int4", "int8"} and any(m.act is not None and m.act.static for m in q)
    _, theirs = _hf_reference(folder)
    with torch.no_grad():
        ours = model(IDS[:, :12] % 96)
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()
    if arch == "mamba1":  # the loaded model carries an ssmq recipe: it saves and loads as an ssmq checkpoint
        again = ssmq.load_model(save_quantized(model, tmp_path / "ssmq"))
        with torch.no_grad():
            assert torch.equal(again(IDS[:, :12] % 96), ours)


def test_dynamic_w8a8_checkpoint_loads_exact_weights(tmp_path):
    """Dynamic per-token W8A8 (llm-compressor's W8A8 preset): weights exactly the library's decompression.

    Forwards agree only up to activation rounding: compressed-tensors' reference forward divides the
    absmax by 127.5, ssmq (like vLLM's int8 kernels) by 127, so inputs round to different grids.
    """
    folder = _ct_checkpoint(tmp_path / "ct", "mamba2", _w4_w8a8(dynamic=True))
    model = ssmq.load_model(folder)
    hf, theirs = _hf_reference(folder)
    for i, layer in enumerate(model.layers):
        for name in ("in_proj", "out_proj"):
            ours = getattr(layer.mixer, name)
            assert torch.equal(ours.dequantized_weight(), getattr(hf.backbone.layers[i].mixer, name).weight)
    assert model.layers[0].mixer.out_proj.act.granularity.__class__.__name__ == "PerToken"
    with torch.no_grad():
        ours = model(IDS[:, :12] % 96)
    assert (ours - theirs).norm() < 0.05 * theirs.norm()  # measured 1.9e-2: the two rounding grids


def test_asymmetric_int4_checkpoint_loads_exact_weights(tmp_path):
    """W4A16_ASYM-style (packed int4 codes and packed zero points): the library's decompression, exactly."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    schemes = {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, strategy="group", group_size=16, symmetric=False))}
    folder = _ct_checkpoint(tmp_path / "ct", "mamba2", schemes)
    model = ssmq.load_model(folder)
    qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    (scheme,) = qc.config_groups.values()
    tensors = _module_tensors(folder)
    for i, layer in enumerate(model.layers):
        for name in ("in_proj", "out_proj"):
            local = tensors[f"backbone.layers.{i}.mixer.{name}"]
            assert "weight_zero_point" in local and getattr(layer.mixer, name).weight_zero is not None
            weight = BaseCompressor.get_value_from_registry(qc.format).decompress(local, scheme)["weight"]
            assert torch.equal(getattr(layer.mixer, name).dequantized_weight(), weight)


# ------------------------------------------------------------------------------------------- refusals
def _edit_config(folder, fn):
    f = folder / "config.json"
    raw = json.loads(f.read_text())
    fn(raw["quantization_config"])
    f.write_text(json.dumps(raw))


def _sparse(qc):
    qc["sparsity_config"] = {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}


def _asym_act(qc):
    qc["config_groups"]["group_1"]["input_activations"]["symmetric"] = False


def _fp8_block(qc):
    qc["config_groups"]["group_1"]["weights"].update(type="float", strategy="block", block_structure=[16, 16])
    qc["config_groups"]["group_1"]["format"] = "float-quantized"


def _transform(qc):
    qc["transform_config"] = {"config_groups": {"R4": {"type": "hadamard", "apply": [
        {"targets": ["re:.*out_proj$"], "location": "input"}]}}}


def _three_bit(qc):
    qc["config_groups"]["group_0"]["weights"]["num_bits"] = 3


@pytest.mark.parametrize("edit,match", [
    (_sparse, "sparse checkpoints"), (_asym_act, "asymmetric activation"), (_fp8_block, "per-block weight scales"),
    (_transform, "online transforms"), (_three_bit, "3-bit integer weights"),
])
def test_load_refuses_unsupported_schemes(tmp_path, edit, match):
    folder = _ct_checkpoint(tmp_path / "ct", "mamba2", _w4_w8a8(dynamic=False))
    _edit_config(folder, edit)
    with pytest.raises(SSMQError, match=match) as e:
        ssmq.load_model(folder)
    assert "\n" not in str(e.value)


def test_export_refuses_ssm_quantization_and_hadamard(tmp_path):
    model = quantize(tiny_model("mamba2"), "quamba2-w8a8", synthetic_calibration(64, 4, 32), progress=False)
    save_quantized(model, tmp_path / "quamba2")
    with pytest.raises(SSMQError, match=r"SSM's int8 inputs .* quantized embedding .* no representation") as e:
        export_compressed_tensors(tmp_path / "quamba2", tmp_path / "ct")
    assert "\n" not in str(e.value) and not (tmp_path / "ct").exists()

    src = _ssmq_checkpoint(tmp_path, "mamba2", "hadamard-w8a8")
    with pytest.raises(SSMQError, match="online Hadamard"):
        export_compressed_tensors(src, tmp_path / "ct")


def test_failed_export_leaves_nothing(tmp_path, monkeypatch):
    import ssmq.quant.compressed_tensors.export as export

    src = _ssmq_checkpoint(tmp_path, "mamba2", "rtn-w8a16")

    def broken(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export, "save_file", broken, raising=False)
    monkeypatch.setattr("safetensors.torch.save_file", broken)
    with pytest.raises(RuntimeError):
        export_compressed_tensors(src, tmp_path / "ct")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "tokenizer.json"]


def test_cli_export(tmp_path, capsys):
    src = _ssmq_checkpoint(tmp_path, "mamba1", "rtn-w8a16")
    assert main(["export", "--model", str(src), "--format", "compressed-tensors", "--out", str(tmp_path / "ct")]) == 0
    assert capsys.readouterr().out.count("\n") == 1 and (tmp_path / "ct" / "config.json").is_file()
    # bad input: not an ssmq checkpoint; an existing output folder
    for model, out in ((tmp_path, tmp_path / "ct2"), (src, tmp_path / "ct")):
        assert main(["export", "--model", str(model), "--format", "compressed-tensors", "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("ssmq: error:") and err.count("\n") == 1


def test_hf_layout_inverts_the_loader():
    from ssmq.models.hf_layout import SSMQ_CONFIG_KEY, config_to_hf, rename_to_hf
    from ssmq.models.loading import config_from_hf, rename_to_ssmq

    for arch in ("mamba1", "mamba2", "hybrid", "llama"):
        model = tiny_model(arch, **HF_SEMANTICS[arch])
        for name in model.state_dict():
            assert rename_to_ssmq(rename_to_hf(name, model.config)) == name
        raw = config_to_hf(model.config)
        assert raw.pop(SSMQ_CONFIG_KEY) == model.config.to_dict()
        back = config_from_hf(raw).to_dict()
        mine = model.config.to_dict()
        # what HF spells differently but means the same: the resolved dt_rank, the gate-norm group
        assert {k for k in mine if back[k] != mine[k]} <= {"dt_rank", "norm_group_size"}
