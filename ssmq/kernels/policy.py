"""``KernelPolicy``: which kernels the dispatch may choose, one frozen value set once at the edge.

The dispatch (``ssmq.kernels.dispatch``) reads the active policy; nothing in ``kernels/`` or ``models/`` reads the
environment. The CLI builds the policy once at start (``ssmq.runtime.kernel_policy.policy_from_env``); a Python
caller sets one with ``set_policy`` or, for a block of code, ``using``. The layer plans of a cache are decided
under the policy active when it is allocated (``ssmq.models.layer_plan``): set the policy first.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

KV_DECODE_KERNELS = ("kv_decode_warp", "kv_decode_fast", "kv_decode")  # preference order of the selection table


@dataclass(frozen=True)
class KernelPolicy:
    """reference_ops: the ``ssmq.ops`` references on every device (accuracy baselines on a GPU).
    pdl: Programmatic Dependent Launch on sm_90+ (a kernel's launch overlaps the tail of the one before it).
    act_quant_fusion: the producer of an A8 linear's input (block norm, gated norm) emits its int8 codes.
    kv_fused_append: a quantized KV cache's new tokens are written by the fused quantize-and-append kernel.
    kv_decode: the KV decode kernels the selection table may pick, a subset of ``KV_DECODE_KERNELS``
    (``kv_decode``, the float32-exact first kernel, serves every format and is always allowed).
    repacked_decode: int4 linears keep a second copy of their codes in ``packed_gemv``'s layout for the rows its
    table routes there (batch 1): a few percent faster decode for the int4 codes' bytes again in GPU memory, so
    off unless asked for."""

    reference_ops: bool = False
    pdl: bool = True
    act_quant_fusion: bool = True
    kv_fused_append: bool = True
    kv_decode: tuple[str, ...] = KV_DECODE_KERNELS
    repacked_decode: bool = False

    def with_changes(self, **changes) -> KernelPolicy:
        return replace(self, **changes)

    def describe(self) -> str:
        """The fields that differ from the default, ``name=value`` (empty: the default policy)."""
        default = KernelPolicy()
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                         if getattr(self, f.name) != getattr(default, f.name))


_ACTIVE = [KernelPolicy()]


def active() -> KernelPolicy:
    return _ACTIVE[0]


def set_policy(policy: KernelPolicy) -> None:
    _ACTIVE[0] = policy


@contextmanager
def using(policy: KernelPolicy):
    """The policy for the block of code (tests, benchmarks' A/B runs), the previous one after."""
    before = _ACTIVE[0]
    _ACTIVE[0] = policy
    try:
        yield policy
    finally:
        _ACTIVE[0] = before
