"""A layer's execution plan: what runs its decode step, decided once, when its state is allocated.

A mixer's ``plan(state)`` reads its taps, norm, out_proj and the state's format and returns a ``LayerPlan``; the
state keeps it (``state.plan``) and the mixer's ``step`` is one path: in_proj -> ``plan.decode`` -> out_proj.
Executors (``decode``) of the SSM mixers:
    fused   no quantizing tap, the plain gated norm, a float state written every step: conv, Δ, state update and
            gated norm as one op (``kernels.mamba2_decode_step``; Mamba-2 only)
    int8    a tap of x / B / C quantizes, or the state is int8 or checkpointed: the conv emits the taps' codes, one
            state-update kernel reads and writes the state as stored (``MambaState.step_ssm``)
    float   the rest: float conv, the taps as they are, the float state update
Attention layers' plans name the KV decode kernel that ``kernels.dispatch.QUANT_KV_DECODE`` / ``FLOAT_KV_DECODE``
select for their cache format on CUDA; a float cache's ``decode`` is ``kernels.float_kv_decode`` bound to the kernel
its device runs, ``(q, slots, kv_lens, k, v)`` -> (b, hq, e), None where the rows are read out for ``attention_ref``
(a quantized cache decodes through its state, ``QuantKVState.decode``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LayerPlan:
    """executor: the decode path's name; decode: the mixer's executor, ``decode(mixer, *in_proj outputs, state,
    slots)`` -> out_proj's input; kernels: what it launches on CUDA (the ``ssmq.ops`` references elsewhere);
    formats: the layer's state / cache and activation formats, by name; prefill: the scan a prefill runs."""

    executor: str
    decode: Callable | None
    kernels: tuple[str, ...]
    formats: dict[str, str] = field(default_factory=dict)
    prefill: str = ""

    def describe(self) -> str:
        formats = ", ".join(f"{k} {v}" for k, v in self.formats.items())
        return f"{self.executor:<6} {' + '.join(self.kernels)}" + (f"  [{formats}]" if formats else "") + \
            (f"  prefill: {self.prefill}" if self.prefill else "")
