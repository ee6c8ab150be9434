"""``ActQuantizer``: the one module that replaces an activation tap (``act_x``, ``act_B``, ...) of a mixer.

Glossary: d channels of the tapped tensor (its last dim), G scale groups.

It fake-quantizes x (..., d) with static symmetric int8 scales, one per group of channels:
    scale  (G,) float32           G = 1 per-tensor; g·k for per-state-group B/C; m·n for clustered x
    index  (d,) long              channel -> group (absent when G = 1)
so every layout the Quamba papers use is the same module with a different ``index``. Its output is
dequantize(quantize(x)), which is what the int8 references in ``ssmq.ops.quant_ssm`` consume
(``codes`` / ``channel_scale`` give the int8 view; tests check the two agree).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq import kernels
from ssmq.errors import SSMQError
from ssmq.ops.quant_ssm import quantize_ref

SUPPORTED_BITS = (8,)


def group_index(layout: str, d: int, *, d_state: int = 0, state_groups: int = 1,
                cluster: torch.Tensor | None = None) -> torch.Tensor | None:
    """(d,) channel -> group map of a layout, or None for one group.

    per_tensor: None. state_group: B/C (..., g·n): group j·k + i for the i-th of k state chunks of
    B/C group j. cluster: the map found by sort-and-cluster (``cluster`` argument).
    """
    if layout == "per_tensor":
        return None
    if layout == "state_group":
        if d_state <= 0 or d % d_state or d_state % state_groups:
            raise SSMQError(f"state_group layout: d_state {d_state} must divide {d} and be a multiple of "
                            f"state_groups {state_groups}")
        return torch.arange(d) // (d_state // state_groups)
    if layout == "cluster":
        if cluster is None:
            raise SSMQError("the cluster layout needs the sort_cluster transform first")
        return cluster.clone()
    raise SSMQError(f"unknown activation layout {layout!r}; known: per_tensor, state_group, cluster")


class ActQuantizer(nn.Module):
    """x (..., d) -> dequantize(quantize(x)) with per-group static scales; shape and dtype kept."""

    def __init__(self, d: int, n_groups: int = 1, bits: int = 8, index: torch.Tensor | None = None):
        super().__init__()
        if bits not in SUPPORTED_BITS:
            raise SSMQError(f"SSM activations quantize to {SUPPORTED_BITS} bits (or stay 16-bit), not {bits}")
        self.d, self.n_groups, self.bits = d, n_groups, bits
        self.register_buffer("scale", torch.ones(n_groups, dtype=torch.float32))
        if n_groups > 1:
            self.register_buffer("index", torch.zeros(d, dtype=torch.long) if index is None else index.long())
        else:
            self.index = None

    def channel_scale(self) -> torch.Tensor:
        """(d,) scale of each channel, or () for one group."""
        return self.scale.reshape(()) if self.index is None else self.scale[self.index]

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., d) -> int8 codes (..., d)."""
        return quantize_ref(x.float(), self.channel_scale())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one Triton pass on CUDA (torch would run eight elementwise kernels), the reference elsewhere: same values
        return kernels.fake_quantize(x, self.channel_scale())

    @torch.no_grad()
    def set_range(self, clip: torch.Tensor) -> None:
        """clip (G,) largest magnitude to represent per group -> scale = clip / 127."""
        self.scale.copy_((clip.float() / 127.0).clamp(min=1e-8))

    def spec(self) -> dict:
        return {"kind": "SSMActQuantizer", "d": self.d, "n_groups": self.n_groups, "bits": self.bits}

    @classmethod
    def from_spec(cls, spec: dict, dtype=None, device=None) -> "ActQuantizer":
        return cls(spec["d"], spec["n_groups"], spec["bits"])

    def extra_repr(self) -> str:
        return f"d={self.d}, groups={self.n_groups}, bits={self.bits}"
