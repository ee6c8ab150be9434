"""RoPE as one Triton kernel: the twin of ``ssmq.ops.attention.rope_ref`` (same signature and numbers).

Why a kernel: the reference builds the cos / sin tables and rotates with about a dozen elementwise launches (cat,
chunk, products, casts). At a decode step (one token a row) each is a launch of a few microseconds, twice a layer
(queries, and keys post-RoPE for a float cache): on SmolLM2-135M's 30 layers they were a sixth of a CUDA-graph step
at 128K tokens (H200). One program here rotates HB heads of one token.

Glossary: b rows, l tokens a row, H heads, e head dim, r rotary dim (the first r channels of each head are rotated,
NeoX halves: channel c < r / 2 pairs with c + r / 2 at frequency inv_freq[c]).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ssmq.errors import SSMQError
from ssmq.kernels._common import cdiv, next_pow2
from ssmq.ops.attention import rotary_inv_freq


@functools.lru_cache(maxsize=16)
def inv_freq_on(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """(r / 2,) float32 frequencies on ``device``, computed there as the reference does (so the angles are its
    bits). Cached: the first call of a shape is eager (CUDA-graph runners warm up before they capture)."""
    return rotary_inv_freq(rotary_dim, theta, device)


@triton.jit
def _rope_kernel(x, pos, inv_freq, out, H, L, s_xb, s_xl, s_xh, s_pb, s_pl, s_ob, s_ol, s_oh,
                 E: tl.constexpr, R: tl.constexpr, EP: tl.constexpr, HB: tl.constexpr):
    """Program (b · L + l, head block): x[b, l, heads, :] rotated at pos[b, l] into out (float32 math, one
    rounding to out's dtype; precise libdevice cos / sin, as torch's)."""
    tok = tl.program_id(0)
    b, l = tok // L, tok % L
    h = tl.program_id(1) * HB + tl.arange(0, HB)[:, None]  # (HB, 1)
    c = tl.arange(0, EP)[None, :]  # (1, EP)
    m = (h < H) & (c < E)
    src = x + b.to(tl.int64) * s_xb + l.to(tl.int64) * s_xl + h * s_xh
    xv = tl.load(src + c, mask=m, other=0.0).to(tl.float32)
    HALF: tl.constexpr = R // 2
    rot = c < R
    first = c < HALF
    j = tl.where(first, c, c - HALF)  # the pair's frequency
    a = tl.load(pos + b * s_pb + l * s_pl).to(tl.float32) * tl.load(inv_freq + j, mask=rot, other=0.0)
    partner = tl.load(src + tl.where(first, c + HALF, c - HALF), mask=m & rot, other=0.0).to(tl.float32)
    # the reference's x · cos + cat(-x2, x1) · sin
    y = tl.where(rot, xv * tl.cos(a) + tl.where(first, -partner, partner) * tl.sin(a), xv)
    tl.store(out + b.to(tl.int64) * s_ob + l.to(tl.int64) * s_ol + h * s_oh + c, y.to(out.dtype.element_ty), mask=m)


def rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """``ops.attention.rope_ref`` on the GPU: x (b, l, heads, e) rotated at ``positions`` (b, l) int; a new tensor
    (x itself when r = 0). Any strides but a unit one on e."""
    if not rotary_dim:
        return x
    b, l, heads, e = x.shape
    if rotary_dim % 2 or rotary_dim > e:
        raise SSMQError(f"rotary dim {rotary_dim} must be even and at most the head dim {e}")
    if positions.shape != (b, l):
        raise SSMQError(f"positions {tuple(positions.shape)} do not match x's (rows, tokens) {(b, l)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((b, l, heads, e), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    ep = next_pow2(e)
    hb = min(next_pow2(heads), max(1, 2048 // ep))  # ~2K elements a program
    _rope_kernel[(b * l, cdiv(heads, hb))](
        x, positions, inv_freq_on(rotary_dim, float(base), x.device), out, heads, l, x.stride(0), x.stride(1),
        x.stride(2), positions.stride(0), positions.stride(1), out.stride(0), out.stride(1), out.stride(2),
        E=e, R=rotary_dim, EP=ep, HB=hb, num_warps=4 if hb * ep >= 1024 else 1)
    return out
