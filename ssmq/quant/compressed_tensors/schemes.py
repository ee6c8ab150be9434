"""ssmq's WeightSpec / ActSpec <-> compressed-tensors' QuantizationScheme, and one QuantLinear's tensors.

compressed-tensors (the ``compressed_tensors`` package) owns the format: its ``QuantizationArgs``
describe a scheme, its compressors (pack-quantized, int-quantized, float-quantized) write and
read the tensors, ``infer_module_format`` picks the format. This module only translates:

    ssmq                                   compressed-tensors (QuantizationArgs)
    int8 / int4 weight                     type int, num_bits 8 / 4
    fp8 weight                             type float, num_bits 8 (e4m3)
    per_tensor / per_channel / per_group:g strategy tensor / channel / group (group_size g)
    act int8|fp8 static per_tensor         input_activations strategy tensor, dynamic false (input_scale)
    act int8|fp8 dynamic per_token         strategy token, dynamic true
    act dynamic per_tensor                 strategy tensor, dynamic true

Scale shapes: ssmq () / (n,) / (n, k // g) float32; compressed-tensors (1,) / (n, 1) / (n, k // g).
Codes keep their values: ssmq's symmetric codes are signed ints, as compressed-tensors' are.
"""

from __future__ import annotations

import torch

from ssmq.errors import SSMQError
from ssmq.quant.linear import QuantLinear
from ssmq.quant.primitives import PerChannel, PerGroup, PerTensor, PerToken, pack_int4
from ssmq.quant.spec import ActSpec, WeightSpec, validate_pair


def require_library() -> None:
    """One clear line when the optional ``compressed-tensors`` package is missing."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise SSMQError("the compressed-tensors format needs the compressed-tensors package: "
                        "pip install 'ssmq[interop]'") from None


def _args(**kw):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(**kw)


# ----------------------------------------------------------------------------------- ssmq -> CT
def _weight_args(w: WeightSpec):
    g = w.granularity
    kw = {"num_bits": 4 if w.dtype == "int4" else 8, "type": "float" if w.dtype == "fp8" else "int",
          "symmetric": w.symmetric, "dynamic": False}
    if isinstance(g, PerGroup):
        return _args(strategy="group", group_size=g.group_size, **kw)
    return _args(strategy="tensor" if isinstance(g, PerTensor) else "channel", **kw)


def _act_args(a: ActSpec):
    return _args(num_bits=8, type="float" if a.dtype == "fp8" else "int", symmetric=a.symmetric,
                 strategy="token" if isinstance(a.granularity, PerToken) else "tensor", dynamic=not a.static)


def scheme_of(m: QuantLinear, targets: list[str]):
    """The QuantizationScheme (format filled in by compressed-tensors' own inference) of a QuantLinear."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(targets=targets, weights=_weight_args(m.wspec),
                                input_activations=None if m.act is None else _act_args(m.act))
    scheme.format = infer_module_format(torch.nn.Linear, scheme).value
    return scheme


def _ct_scale(scale: torch.Tensor, wspec: WeightSpec) -> torch.Tensor:
    if isinstance(wspec.granularity, PerTensor):
        return scale.reshape(1)
    if isinstance(wspec.granularity, PerChannel):
        return scale.reshape(-1, 1)
    return scale


def compress_linear(m: QuantLinear, scheme) -> dict[str, torch.Tensor]:
    """Local-name tensors (weight_packed / weight, weight_scale, ..., input_scale, bias) of ``m``.

    Goes through compressed-tensors' compressor: it re-quantizes the dequantized weight with the
    same scales, which gives back the same codes (x * s / s rounds to x); ``export`` checks that
    the library's decompression returns ssmq's dequantized weight bit for bit.
    """
    from compressed_tensors.compressors import BaseCompressor

    state = {"weight": m.dequantized_weight(), "weight_scale": _ct_scale(m.weight_scale, m.wspec)}
    if m.weight_zero is not None:
        state["weight_zero_point"] = _ct_scale(m.weight_zero, m.wspec).to(torch.int8)
    out = BaseCompressor.get_value_from_registry(scheme.format).compress(state, scheme)
    if m.act_scale is not None:
        out["input_scale"] = m.act_scale.reshape(1).float()
    if m.bias is not None:
        out["bias"] = m.bias.detach()
    return {k: v.contiguous() for k, v in out.items()}


def decompress_weight(tensors: dict[str, torch.Tensor], scheme) -> torch.Tensor:
    """compressed-tensors' own decompression of one module's tensors -> float weight (n, k)."""
    from compressed_tensors.compressors import BaseCompressor

    return BaseCompressor.get_value_from_registry(scheme.format).decompress(dict(tensors), scheme)["weight"]


# ----------------------------------------------------------------------------------- CT -> ssmq
def _granularity(args, what: str, where: str):
    s = args.strategy
    if s == "tensor":
        return PerTensor()
    if s == "channel":
        return PerChannel(0)
    if s == "group":
        return PerGroup(args.group_size)
    if s == "token":
        return PerToken()
    raise SSMQError(f"{where}: {what} strategy {s!r} has no ssmq QuantLinear layout "
                    "(supported: tensor, channel, group for weights; tensor, token for activations)")


def specs_of(scheme, where: str) -> tuple[WeightSpec, ActSpec | None]:
    """(WeightSpec, ActSpec | None) for a compressed-tensors scheme, or one clear line why not."""
    w, a = scheme.weights, scheme.input_activations
    if w is None:
        raise SSMQError(f"{where}: activation-only quantization (no weight scheme) is not supported")
    if scheme.output_activations is not None:
        raise SSMQError(f"{where}: output activation quantization is not supported by ssmq's QuantLinear")
    if w.strategy == "block":
        raise SSMQError(f"{where}: per-block weight scales (block_structure {w.block_structure}) are not "
                        "supported by ssmq's QuantLinear (per-tensor, per-channel, per-group only)")
    if w.type == "float":
        if w.num_bits != 8:
            raise SSMQError(f"{where}: {w.num_bits}-bit float weights (e.g. NVFP4/MXFP4) are not supported; "
                            "ssmq has fp8 (e4m3) only")
        wdtype = "fp8"
    elif w.num_bits in (4, 8):
        wdtype = f"int{w.num_bits}"
    else:
        raise SSMQError(f"{where}: {w.num_bits}-bit integer weights are not supported (ssmq has int4 and int8)")
    if w.dynamic:
        raise SSMQError(f"{where}: dynamic weight quantization is not supported")
    wspec = WeightSpec(dtype=wdtype, granularity=_granularity(w, "weight", where), symmetric=w.symmetric)
    aspec = None
    if a is not None:
        if not a.symmetric:
            raise SSMQError(f"{where}: asymmetric activation quantization is not supported "
                            "(ssmq's integer GEMM takes symmetric activations)")
        if a.num_bits != 8:
            raise SSMQError(f"{where}: {a.num_bits}-bit {a.type} activations are not supported "
                            "(ssmq has int8 and fp8 activations)")
        if a.dynamic == "local" or a.strategy not in ("tensor", "token"):
            raise SSMQError(f"{where}: activation strategy {a.strategy!r} (dynamic={a.dynamic}) is not "
                            "supported (ssmq has static per-tensor, dynamic per-tensor and per-token)")
        aspec = ActSpec(dtype="fp8" if a.type == "float" else "int8",
                        granularity=_granularity(a, "activation", where), static=not a.dynamic)
    try:
        validate_pair(wspec, aspec)
    except SSMQError as e:
        raise SSMQError(f"{where}: {e}") from None
    return wspec, aspec


def _codes(tensors: dict[str, torch.Tensor], scheme, n: int, k: int, where: str) -> torch.Tensor:
    """(n, k) signed codes straight from the stored tensors (no dequantize / re-quantize)."""
    w = scheme.weights
    if "weight_packed" in tensors:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        return unpack_from_int32(tensors["weight_packed"], w.num_bits, torch.Size((n, k)))
    codes = tensors.get("weight")
    if codes is None:
        raise SSMQError(f"{where}: neither weight_packed nor weight in the checkpoint")
    want = torch.float8_e4m3fn if w.type == "float" else torch.int8
    if codes.dtype != want:
        raise SSMQError(f"{where}: weight stored as {codes.dtype}, expected {want} for format {scheme.format}")
    return codes


def quant_linear_from(tensors: dict[str, torch.Tensor], scheme, in_features: int, out_features: int,
                      bias: bool, where: str) -> QuantLinear:
    """A QuantLinear holding one module's compressed-tensors tensors (local names), float32 scales."""
    wspec, aspec = specs_of(scheme, where)
    if "weight_g_idx" in tensors:
        g = tensors["weight_g_idx"]
        if not torch.equal(g.long(), torch.arange(in_features) // wspec.granularity.group_size):
            raise SSMQError(f"{where}: activation-ordered groups (weight_g_idx) are not supported")
    shape = tensors.get("weight_shape")
    if shape is not None and tuple(int(v) for v in shape) != (out_features, in_features):
        raise SSMQError(f"{where}: weight_shape {tuple(shape.tolist())} != ({out_features}, {in_features})")
    m = QuantLinear(in_features, out_features, bias, wspec, aspec)
    codes = _codes(tensors, scheme, out_features, in_features, where)
    if tuple(codes.shape) != (out_features, in_features):
        raise SSMQError(f"{where}: weight shape {tuple(codes.shape)} != ({out_features}, {in_features})")
    with torch.no_grad():
        m.weight_q.copy_(pack_int4(codes) if wspec.dtype == "int4" else codes)
        m.weight_scale.copy_(tensors["weight_scale"].float().reshape(m.weight_scale.shape))
        if m.weight_zero is not None:
            zp = tensors.get("weight_zero_point")
            if zp is None:
                raise SSMQError(f"{where}: asymmetric weights without weight_zero_point")
            if "weight_packed" in tensors and scheme.weights.strategy in ("group", "channel"):
                from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

                zp = unpack_from_int32(zp, scheme.weights.num_bits, torch.Size(m.weight_zero.reshape(
                    out_features, -1).shape), packed_dim=0)
            m.weight_zero.copy_(zp.reshape(m.weight_zero.shape).to(torch.int32))
        if m.act_scale is not None:
            if "input_scale" not in tensors:
                raise SSMQError(f"{where}: static activation quantization without input_scale")
            m.act_scale.copy_(tensors["input_scale"].float().reshape(()))
    return m
