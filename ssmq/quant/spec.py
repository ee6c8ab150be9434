"""What a quantized tensor looks like: ``WeightSpec`` and ``ActSpec``, plain dataclasses <-> JSON.

Recipes are written with them, quantized modules are parametrized by them, checkpoints store
them (as dicts). ``validate_pair`` is the one place that says which combinations exist:

    weight int8 / int4 (+ act None)   W8A16, W4A16 (weights may be asymmetric; dequantize + float GEMM)
    weight int8 / int4 + act int8     W8A8, W4A8 (symmetric; exact integer GEMM, ``int_matmul_ref``)
    weight fp8 + act fp8 or None      FP8 (e4m3, symmetric)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ssmq.errors import SSMQError, check_field_types
from ssmq.quant.observers import OBSERVERS
from ssmq.quant.primitives import (
    QTYPES,
    Granularity,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    granularity_from_str,
    granularity_to_str,
)


def _from_dict(cls, d: dict, what: str):
    if not isinstance(d, dict):
        raise SSMQError(f"a {what} is a JSON object, not {type(d).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise SSMQError(f"unknown {what} field(s) {sorted(unknown)}; known: {sorted(known)}")
    check_field_types(cls, d, what)
    d = dict(d)
    if "granularity" in d:
        if not isinstance(d["granularity"], str):
            raise SSMQError(f"{what} field 'granularity' must be a string (per_tensor, per_channel, per_token, "
                            f"per_group:G), got {d['granularity']!r}")
        d["granularity"] = granularity_from_str(d["granularity"])
    return cls(**d)


def _to_dict(obj) -> dict:
    d = asdict(obj)
    d["granularity"] = granularity_to_str(obj.granularity)
    return d


@dataclass(frozen=True)
class WeightSpec:
    """How a weight (n_out, k) is quantized.

    dtype: "int8" | "int4" | "fp8". granularity: PerTensor(), PerChannel(0) (one scale per output
    row) or PerGroup(g) (groups of g along k). method: "rtn" (round to nearest) or "gptq" (then
    block_size, damp = fraction of mean(diag H), act_order are used).
    """

    dtype: str = "int8"
    granularity: Granularity = field(default_factory=lambda: PerChannel(0))
    symmetric: bool = True
    method: str = "rtn"
    block_size: int = 128
    damp: float = 0.01
    act_order: bool = False

    def validate(self) -> "WeightSpec":
        if self.dtype not in QTYPES:
            raise SSMQError(f"unsupported weight dtype {self.dtype!r} (e.g. 3-bit); supported: {', '.join(QTYPES)}")
        if not isinstance(self.granularity, (PerTensor, PerGroup)) and self.granularity != PerChannel(0):
            raise SSMQError(f"weight granularity must be per_tensor, per_channel or per_group:G, "
                            f"not {granularity_to_str(self.granularity)}")
        if self.dtype == "fp8" and not self.symmetric:
            raise SSMQError("fp8 weights are symmetric only")
        if self.method not in ("rtn", "gptq"):
            raise SSMQError(f"unknown weight method {self.method!r}; known: rtn, gptq")
        if self.method == "gptq" and self.dtype == "fp8":
            raise SSMQError("gptq is implemented for int8/int4 weights, not fp8")
        if self.block_size < 1 or not 0.0 <= self.damp < 1.0:
            raise SSMQError(f"bad gptq settings: block_size {self.block_size}, damp {self.damp}")
        return self

    def to_dict(self) -> dict:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "WeightSpec":
        return _from_dict(cls, d, "weight spec").validate()


@dataclass(frozen=True)
class ActSpec:
    """How the input activation (..., k) of a module is quantized.

    dtype: "int8" | "fp8". granularity: PerTensor() or PerToken(). static: one scale fixed at
    calibration (needs per_tensor) from ``observer`` ("absmax", "percentile" (at ``percentile``),
    "histogram", "mse"); dynamic: absmax of each tensor / token at run time.
    """

    dtype: str = "int8"
    granularity: Granularity = field(default_factory=PerTensor)
    static: bool = True
    observer: str = "absmax"
    percentile: float = 99.999
    symmetric: bool = True

    def validate(self) -> "ActSpec":
        if self.dtype not in ("int8", "fp8"):
            raise SSMQError(f"unsupported activation dtype {self.dtype!r}; supported: int8, fp8 (or null for 16-bit)")
        if not isinstance(self.granularity, (PerTensor, PerToken)):
            raise SSMQError(f"activation granularity must be per_tensor or per_token, "
                            f"not {granularity_to_str(self.granularity)}")
        if self.static and not isinstance(self.granularity, PerTensor):
            raise SSMQError("static activation scales are per_tensor (per_token scales are dynamic)")
        if self.observer not in OBSERVERS:
            raise SSMQError(f"unknown observer {self.observer!r}; known: {', '.join(OBSERVERS)}")
        if not 0.0 < self.percentile <= 100.0:
            raise SSMQError(f"percentile must be in (0, 100], got {self.percentile}")
        if not self.symmetric and self.dtype == "fp8":
            raise SSMQError("fp8 activations are symmetric only")
        return self

    def to_dict(self) -> dict:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ActSpec":
        return _from_dict(cls, d, "activation spec").validate()


def validate_pair(weight: WeightSpec, act: ActSpec | None) -> None:
    """Refuse weight/activation combinations no QuantLinear forward exists for."""
    weight.validate()
    if act is None:
        return
    act.validate()
    if act.dtype == "int8":
        if weight.dtype == "fp8":
            raise SSMQError("int8 activations need int8 or int4 weights, not fp8")
        if not (weight.symmetric and act.symmetric):
            raise SSMQError("the integer GEMM (W8A8/W4A8) needs symmetric weights and activations")
    if act.dtype == "fp8" and weight.dtype != "fp8":
        raise SSMQError(f"fp8 activations need fp8 weights, not {weight.dtype}")
