"""Quantized modules: ONE ``QuantLinear`` for W8A8, W4A8, W4A16, W8A16, FP8, and ``QuantEmbedding``.

Their forwards here are the exact CPU references the GPU kernels reproduce. Everything a module
holds is a plain tensor buffer (state dict = tensors), its structure is ``spec()`` (a dict), and
``from_spec(spec)`` rebuilds an empty module of the same structure for loading.

Buffers of QuantLinear (n = out_features, k = in_features):
    weight_q      int8 (n, k) for int8; uint8 (n, k // 2) for int4 (``pack_int4`` layout:
                  low nibble = even column); float8_e4m3fn (n, k) for fp8
    weight_scale  float32: () per_tensor, (n,) per_channel, (n, k // g) per_group:g
    weight_zero   int32, same shape as weight_scale (asymmetric weights only)
    act_scale     float32 () (static activation scale only)
    bias          (n,) in the model's float dtype (if the float linear had one)
Scales stay float32: move a quantized model with ``.to(device)``, not ``.to(dtype)``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq import kernels
from ssmq.errors import SSMQError
from ssmq.models.act_codes import ActCodes, CodeInput
from ssmq.quant.hadamard import hadamard_transform
from ssmq.quant.primitives import (
    FP8_MAX,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    absmax_scale,
    choose_qparams,
    dequantize,
    pack_int4,
    quantize,
    unpack_int4,
)
from ssmq.quant.spec import ActSpec, WeightSpec, validate_pair


def _scale_shape(gran, n: int, k: int) -> tuple[int, ...]:
    if isinstance(gran, PerTensor):
        return ()
    if isinstance(gran, PerChannel):
        return (n,)
    if k % gran.group_size:
        raise SSMQError(f"group size {gran.group_size} does not divide in_features {k}")
    return (n, k // gran.group_size)


def _code_buffer(dtype: str, n: int, k: int, device=None) -> torch.Tensor:
    if dtype == "int4":
        if k % 2:
            raise SSMQError(f"int4 weights need an even number of columns, got {k}")
        return torch.zeros(n, k // 2, dtype=torch.uint8, device=device)
    return torch.zeros(n, k, dtype=torch.float8_e4m3fn if dtype == "fp8" else torch.int8, device=device)


class _QuantWeight(nn.Module):
    """Shared storage of a quantized (n, k) weight matrix (QuantLinear, QuantEmbedding)."""

    def _init_weight(self, spec: WeightSpec, n: int, k: int, device=None) -> None:
        self.wspec = spec
        shape = _scale_shape(spec.granularity, n, k)
        self.register_buffer("weight_q", _code_buffer(spec.dtype, n, k, device))
        self.register_buffer("weight_scale", torch.ones(shape, dtype=torch.float32, device=device))
        if not spec.symmetric:
            self.register_buffer("weight_zero", torch.zeros(shape, dtype=torch.int32, device=device))
        else:
            self.weight_zero = None

    @torch.no_grad()
    def _set_weight(self, weight: torch.Tensor, qweight=None) -> None:
        """Quantize ``weight`` (n, k) by round to nearest, or store given (codes int8 (n, k), scale, zero)."""
        s = self.wspec
        if qweight is None:
            scale, zero = choose_qparams(weight, s.granularity, s.dtype, s.symmetric)
            codes = quantize(weight, scale, zero, s.granularity, s.dtype)
        else:
            codes, scale, zero = qweight
        self.weight_q.copy_(pack_int4(codes) if s.dtype == "int4" else codes)
        if getattr(self, "weight_words", None) is not None:  # a copy of the old codes: bound again at decode set-up
            self.weight_words = None
        self.weight_scale.copy_(scale.reshape(self.weight_scale.shape))
        if self.weight_zero is not None:
            self.weight_zero.copy_(zero.reshape(self.weight_zero.shape))

    def weight_codes(self) -> torch.Tensor:
        """(n, k) codes: int8 (int8 and int4) or float8_e4m3fn."""
        return unpack_int4(self.weight_q) if self.wspec.dtype == "int4" else self.weight_q

    def dequantized_weight(self) -> torch.Tensor:
        """(n, k) float32."""
        return dequantize(self.weight_codes(), self.weight_scale, self.weight_zero, self.wspec.granularity)


class QuantLinear(_QuantWeight):
    """y = x W.T + b with quantized W (and optionally quantized x), parametrized by specs.

    x: (..., k) float -> y: (..., n) in x's dtype.
      act None   (W8A16, W4A16, FP8 weight-only): y = F.linear(x, dequant(W) in x's dtype, b)
      act int8   (W8A8, W4A8): x_q = quantize(x) with the static ``act_scale`` or a dynamic
                 per-tensor / per-token absmax scale, then ``int_matmul_ref`` (exact int32
                 accumulation, float32 epilogue), + b
      act fp8    (FP8): float32 GEMM of the dequantized fp8 operands (e4m3 products are exact in
                 float32; accumulation order differs between kernels, so this one is not bit-exact)
    ``rotate_input``: x -> Q x (normalised Hadamard, ``hadamard_transform``) first; the weight was
    rotated offline (W Q.T), so the function is unchanged and the quantized input is the rotated one.
    Runs as ``kernels.quantize_act`` + ``kernels.quant_linear``: the exact references of
    ``ssmq.ops.quant_linear`` on CPU, the low-bit Triton kernels on CUDA (stored buffers used as is). Int8 inputs come
    quantized by their producer where it can (``code_input``, ``ssmq.models.act_codes``): x is then an ``ActCodes``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 weight: WeightSpec = WeightSpec(), act: ActSpec | None = None,
                 rotate_input: bool = False, dtype=torch.float32, device=None):
        super().__init__()
        validate_pair(weight, act)
        self.in_features, self.out_features = in_features, out_features
        self.act, self.rotate_input = act, rotate_input
        self._init_weight(weight, out_features, in_features, device)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        if act is not None and act.static:
            self.register_buffer("act_scale", torch.ones((), dtype=torch.float32, device=device))
        else:
            self.act_scale = None
        # tensor parallelism: a row-parallel shard sees part of x, so the dynamic scale of its rows comes from
        # ``scale_hook(x)`` (the full rows': ``dynamic_scale`` reduced over ranks, or of the gathered input)
        self.scale_hook = None
        # the decode GEMV's copy of the codes (``bind_decode``): not saved, rebuilt from weight_q; decode_copy False
        # where another kernel reads the codes instead of this module (the experts of a grouped MoE: their stack)
        self.register_buffer("weight_words", None, persistent=False)
        self.decode_copy = True

    @classmethod
    def from_float(cls, linear: nn.Linear, weight: WeightSpec, act: ActSpec | None = None,
                   act_scale: torch.Tensor | None = None, qweight=None) -> "QuantLinear":
        """Quantize a float linear (or ``RotatedLinear``). ``act_scale``: () for static activations.

        qweight: optional (codes int8 (n, k), scale, zero) computed elsewhere (e.g. GPTQ).
        """
        from ssmq.quant.hadamard import RotatedLinear

        w = linear.weight
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, weight, act,
                rotate_input=isinstance(linear, RotatedLinear), dtype=w.dtype, device=w.device)
        m._set_weight(w.detach(), qweight)
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias.detach())
        if m.act_scale is not None:
            if act_scale is None:
                raise SSMQError("static activation quantization needs a calibrated act_scale")
            m.act_scale.copy_(act_scale.reshape(()))
        return m

    def bind_decode(self) -> None:
        """Make the decode GEMV's copy of the codes where the device's kernel table runs decode calls on it
        (``kernels.pack_for_decode``: int4 / int8 codes repacked once, the stored ``weight_q`` kept for prefill and
        saving), else drop it (and where ``decode_copy`` is off). Called when a model's decode is set up
        (``SSMLM.allocate_cache``); a weight set after that (``_set_weight``, a tensor-parallel shard) is bound again
        by the next set-up."""
        w = self.weight_q  # inference tensors keep no version counter: their data pointer alone names them
        source = (w.device, w.data_ptr(), None if w.is_inference() else w._version)
        if self.weight_words is not None and getattr(self, "_words_of", None) == source:
            return  # bound to these codes already
        self.weight_words = None
        if self.act is None and self.decode_copy:
            self.weight_words = kernels.pack_for_decode(self.weight_q, self.weight_scale, self.weight_zero)
            self._words_of = source

    def code_input(self) -> CodeInput | None:
        """How the producer of x may hand it over as codes (``ssmq.models.act_codes``), or None: int8 or fp8
        activations with a static or a dynamic per-token scale, no tensor-parallel hook on a dynamic scale; with an
        online rotation, the codes of the rotated x (``rotate``, int8 only)."""
        a = self.act
        if a is None or a.dtype not in ("int8", "fp8") or (a.dtype == "fp8" and self.rotate_input):
            return None
        dtype = torch.int8 if a.dtype == "int8" else torch.float8_e4m3fn
        if self.act_scale is not None:
            return CodeInput(self.act_scale, self.rotate_input, dtype)
        if isinstance(a.granularity, PerToken) and self.scale_hook is None:
            return CodeInput(None, self.rotate_input, dtype)
        return None

    def forward(self, x: torch.Tensor | ActCodes) -> torch.Tensor:
        if isinstance(x, ActCodes):  # its producer quantized it as this linear would have (``code_input``)
            return kernels.quant_linear(x.q, self.weight_q, self.weight_scale, None, x.scale, self.bias, x.dtype)
        if self.rotate_input:
            x = hadamard_transform(x)
        a = self.act
        if a is None:
            return kernels.quant_linear(x, self.weight_q, self.weight_scale, self.weight_zero, None, self.bias,
                                        x.dtype, self.weight_words)
        codes = torch.int8 if a.dtype == "int8" else torch.float8_e4m3fn
        per_token = isinstance(a.granularity, PerToken)
        if self.scale_hook is not None and self.act_scale is None:
            # tensor parallelism: the full rows' dynamic scale, then one quantizing kernel given it
            x_q, scale = kernels.quantize_act(x, self.scale_hook(x), per_token, codes)
            return kernels.quant_linear(x_q, self.weight_q, self.weight_scale, None, scale, self.bias, x.dtype)
        return kernels.quant_linear_act(x, self.weight_q, self.weight_scale, self.act_scale, per_token, codes,
                                        self.bias, x.dtype)

    def dynamic_scale(self, x: torch.Tensor) -> torch.Tensor:
        """The dynamic activation scale of x (..., k): absmax / qmax per token (x.shape[:-1]) or per tensor (()),
        as the fused kernels compute it (``quantize_act_ref``); monotonic in absmax, so the max of the shards'
        scales over tensor-parallel ranks is the full rows'."""
        per_token = isinstance(self.act.granularity, PerToken)
        return absmax_scale(x.abs().amax(-1) if per_token else x.abs().amax(),
                            FP8_MAX if self.act.dtype == "fp8" else 127.0)

    def spec(self) -> dict:
        return {"kind": "QuantLinear", "in_features": self.in_features, "out_features": self.out_features,
                "bias": self.bias is not None, "weight": self.wspec.to_dict(),
                "act": None if self.act is None else self.act.to_dict(), "rotate_input": self.rotate_input}

    @classmethod
    def from_spec(cls, spec: dict, dtype=torch.float32, device=None) -> "QuantLinear":
        act = None if spec["act"] is None else ActSpec.from_dict(spec["act"])
        return cls(spec["in_features"], spec["out_features"], spec["bias"], WeightSpec.from_dict(spec["weight"]),
                   act, spec["rotate_input"], dtype=dtype, device=device)

    def extra_repr(self) -> str:
        a = "16" if self.act is None else self.act.dtype
        return (f"{self.in_features}, {self.out_features}, w={self.wspec.dtype}, a={a}, "
                f"rotate_input={self.rotate_input}")


class QuantEmbedding(_QuantWeight):
    """Embedding table (vocab, d) stored quantized (weight-only); ids (...) long -> (..., d) float.

    Rows are dequantized on lookup: per_channel = one scale per token row, per_group:g along d.
    The output dtype follows the module's float dtype (a zero-size non-persistent buffer, so
    ``.to(dtype)`` works as for nn.Embedding).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, weight: WeightSpec = WeightSpec(),
                 dtype=torch.float32, device=None):
        super().__init__()
        weight.validate()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._init_weight(weight, num_embeddings, embedding_dim, device)
        self.register_buffer("_dtype", torch.empty(0, dtype=dtype, device=device), persistent=False)

    @classmethod
    def from_float(cls, emb: nn.Embedding, weight: WeightSpec, qweight=None) -> "QuantEmbedding":
        m = cls(emb.num_embeddings, emb.embedding_dim, weight, dtype=emb.weight.dtype, device=emb.weight.device)
        m._set_weight(emb.weight.detach(), qweight)
        return m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = self.wspec
        rows = self.weight_q[ids]  # (..., d) or packed (..., d // 2)
        codes = unpack_int4(rows) if s.dtype == "int4" else rows
        if isinstance(s.granularity, PerTensor):
            scale, zero = self.weight_scale, self.weight_zero
        else:  # per-row parameters follow their rows
            scale = self.weight_scale[ids]
            zero = None if self.weight_zero is None else self.weight_zero[ids]
        # gathered per-row scales are shaped (...) over codes (..., d): the per-token layout
        gran = s.granularity if isinstance(s.granularity, (PerTensor, PerGroup)) else PerToken()
        return dequantize(codes, scale, zero, gran).to(self._dtype.dtype)

    def spec(self) -> dict:
        return {"kind": "QuantEmbedding", "num_embeddings": self.num_embeddings,
                "embedding_dim": self.embedding_dim, "weight": self.wspec.to_dict()}

    @classmethod
    def from_spec(cls, spec: dict, dtype=torch.float32, device=None) -> "QuantEmbedding":
        return cls(spec["num_embeddings"], spec["embedding_dim"], WeightSpec.from_dict(spec["weight"]),
                   dtype=dtype, device=device)
