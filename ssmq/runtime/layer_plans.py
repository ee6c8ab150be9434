"""``ssmq info MODEL --plan``: what runs each layer's decode step, as the model's plans say (``ssmq.models.layer_plan``).

One line a layer: its executor, the kernels it launches on CUDA (the ``ssmq.ops`` references run elsewhere), its
state or KV format, and the formats of its linears. The cache is the model's own (``model.allocate_cache()`` with
default arguments: an int8-state model's int8 state, a KV-quantized model's quantized cache), one slot, its float
buffers in the dtype the model would run in.
"""

from __future__ import annotations

import torch.nn as nn

from ssmq.kernels.dispatch import has_gluon
from ssmq.kernels.policy import active


def linear_format(m: nn.Module) -> str:
    """A linear's weight / activation format in words: float, or a ``QuantLinear``'s specs."""
    w, a = getattr(m, "wspec", None), getattr(m, "act", None)
    if w is None:
        return str(getattr(m, "weight", None).dtype).removeprefix("torch.") if hasattr(m, "weight") else type(m).__name__
    fmt = f"{w.dtype} weights" + (f" x {a.dtype} {'static' if a.static else 'dynamic'} activations" if a else "")
    return fmt + (", online Hadamard" if getattr(m, "rotate_input", False) else "")


def plan_lines(model, dtype=None) -> list[str]:
    """The header and one line a layer; ``dtype``: the activations' (conv, float state and KV buffers), default the
    model's."""
    cache = model.allocate_cache(1, 16, dtype=dtype)
    policy = active().describe() or "default"
    lines = [f"kernel policy: {policy}; kernels as launched on CUDA with Triton (Gluon: "
             f"{'yes' if has_gluon() else 'no'}), the ssmq.ops references elsewhere"]
    for i, (layer, st) in enumerate(zip(model.layers, cache.states)):
        lines.append(f"layer {i:>3} {str(layer.kind):<9} {st.plan.describe()}  linears: {_linears(layer.mixer)}")
        side = layer.side() if hasattr(layer, "side") else None
        if side is not None:  # attention beside the mixer: in parallel (Falcon-H1) or a shared block's (Zamba2)
            attn = side if side is layer.attn else side.shared_block().attn
            what = "parallel" if side is layer.attn else f"shared {side.use % model.config.shared_blocks}"
            plan = cache.states[side.layer_idx if side is layer.attn else side.state_idx].plan
            lines.append(f"      + {'attention':<9} {plan.describe()}  linears: {_linears(attn)}  ({what})")
    return lines


def _linears(module: nn.Module) -> str:
    """The formats of a mixer's projections: one for all, or each by name."""
    linears = {name: linear_format(m) for name, m in module.named_children() if name.endswith("_proj")}
    shared = set(linears.values())
    return next(iter(shared)) if len(shared) == 1 else ", ".join(f"{k} {v}" for k, v in linears.items())
