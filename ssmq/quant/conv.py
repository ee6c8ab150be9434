"""``QuantConv1d``: the SSM's depthwise causal conv with int8 weights, Quamba's and Quamba2's integer conv.

Stored (all buffers, plain data): ``weight`` int8 codes (c, 1, w), ``weight_scale`` float32 () per tensor or (c,)
per channel, ``bias`` int8 codes (c,) with ``bias_scale`` () per tensor (absmax / 127, as the papers' conv keeps
its bias), and ``act_scale`` (): the static per-tensor scale of the input codes (absmax of the conv input over the
calibration set / 127). The maths, prefill and decode: ``ssmq.ops.conv1d`` (int32 sums, one float32 rescale).
The module has ``ssmq.models.conv.CausalConv1d``'s interface (``kernel_weights``, ``conv_format``), so a mixer
runs it on the same paths; its plan names the format.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq.errors import SSMQError
from ssmq.ops.conv1d import ConvInt8
from ssmq.quant.primitives import PerChannel, PerTensor, choose_qparams, granularity_to_str, quantize

SPEC_KIND = "QuantConv1d"


class QuantConv1d(nn.Module):
    def __init__(self, channels: int, width: int, per_channel: bool, bias: bool, device=None):
        super().__init__()
        self.channels, self.per_channel = channels, per_channel
        self.kernel_size = (width,)
        kw = {"device": device}
        self.register_buffer("weight", torch.zeros(channels, 1, width, dtype=torch.int8, **kw))
        self.register_buffer("weight_scale", torch.ones(channels if per_channel else (), **kw))
        self.register_buffer("act_scale", torch.ones((), **kw))
        self.register_buffer("bias", torch.zeros(channels, dtype=torch.int8, **kw) if bias else None)
        self.register_buffer("bias_scale", torch.ones((), **kw) if bias else None)

    @property
    def granularity(self):
        return PerChannel(0) if self.per_channel else PerTensor()

    @property
    def conv_format(self) -> str:
        """The format in words, for the layer's plan and ``ssmq info``."""
        return f"int8 weights {granularity_to_str(self.granularity)}, int8 input per_tensor" + \
            (", int8 bias" if self.bias is not None else "")

    def kernel_weights(self):
        """(weight codes (c, w) int8, bias codes (c,) int8 | None, ``ConvInt8`` scales) for the conv kernels."""
        return self.weight.squeeze(1), self.bias, ConvInt8(self.weight_scale, self.act_scale, self.bias_scale)

    @classmethod
    @torch.no_grad()
    def from_float(cls, conv: nn.Conv1d, granularity: str, act_absmax: torch.Tensor) -> "QuantConv1d":
        """``conv`` (depthwise, float) -> int8 weight codes at ``granularity`` (per_tensor | per_channel), int8
        bias codes (per tensor), and the input scale ``act_absmax`` / 127."""
        if granularity not in ("per_tensor", "per_channel"):
            raise SSMQError(f"conv1d weights are int8 per_tensor or per_channel, not {granularity}")
        c, _, w = conv.weight.shape
        q = cls(c, w, granularity == "per_channel", conv.bias is not None, device=conv.weight.device)
        weight = conv.weight.detach().squeeze(1).float()
        scale, _ = choose_qparams(weight, q.granularity, "int8")
        q.weight.copy_(quantize(weight, scale, None, q.granularity, "int8").unsqueeze(1))
        q.weight_scale.copy_(scale)
        q.act_scale.copy_(choose_qparams(act_absmax.float().reshape(1), PerTensor(), "int8")[0])
        if conv.bias is not None:
            bias = conv.bias.detach().float()
            bscale, _ = choose_qparams(bias, PerTensor(), "int8")
            q.bias.copy_(quantize(bias, bscale, None, PerTensor(), "int8"))
            q.bias_scale.copy_(bscale)
        return q

    def spec(self) -> dict:
        return {"kind": SPEC_KIND, "channels": self.channels, "width": self.kernel_size[0],
                "granularity": granularity_to_str(self.granularity), "bias": self.bias is not None}

    @classmethod
    def from_spec(cls, spec: dict, dtype=None, device=None) -> "QuantConv1d":
        if spec.get("granularity") not in ("per_tensor", "per_channel"):
            raise SSMQError(f"QuantConv1d granularity must be per_tensor or per_channel, not {spec.get('granularity')}")
        return cls(int(spec["channels"]), int(spec["width"]), spec["granularity"] == "per_channel",
                   bool(spec["bias"]), device=device)

    def extra_repr(self) -> str:
        return f"{self.channels}, width={self.kernel_size[0]}, {self.conv_format}"


def quantize_convs_(model: nn.Module, granularity: str, calib, kw) -> None:
    """Every SSM mixer's conv1d -> ``QuantConv1d``: the input's absmax observed over ``calib`` (on the model as it
    is: its linears already quantized, so the conv sees what it will see), then the weights quantized."""
    from ssmq.quant.calibration import Hooks, run_calibration
    from ssmq.quant.ssm.transforms import ssm_layers

    mixers = {f"layers.{i}.mixer": model.layers[i].mixer for i in ssm_layers(model)}
    absmax = {p: torch.zeros(()) for p in mixers}

    def observe(path, out):
        mixer_path = path.rpartition(".")[0]
        x = mixers[mixer_path].conv_input(out)
        absmax[mixer_path] = torch.maximum(absmax[mixer_path], x.detach().abs().amax().float().cpu())

    hooks = Hooks(model, [f"{p}.in_proj" for p in mixers], observe, where="output")
    try:
        run_calibration(model, calib, desc="conv1d input scales", **kw)
    finally:
        hooks.remove()
    for p, mixer in mixers.items():
        mixer.conv1d = QuantConv1d.from_float(mixer.conv1d, granularity, absmax[p])
