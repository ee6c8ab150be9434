"""Attention references for the hybrid models: rotary embeddings and GQA attention over a KV cache.

Glossary: hq query heads, hkv key/value heads (hq % hkv == 0), e head dim,
r rotary dim (partial RoPE rotates the first r channels of each head).
"""

from __future__ import annotations

import torch

from ssmq.errors import SSMQError


def capturing(t: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured on t's device: shapes must then be static and no device value may be
    read on the host (a cache reads its capacity instead of its rows' lengths, and skips its host-side checks)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_fits(positions: torch.Tensor, capacity: int) -> None:
    """A KV cache's bound check before a write at ``positions``: it reads the last position on the host, so it is
    skipped while a CUDA graph is being captured (the graph runner's caller keeps the lengths within the cache)."""
    if not capturing(positions) and int(positions.max()) >= capacity:
        raise SSMQError(f"sequence longer than the cache ({capacity} tokens); allocate a larger cache")


def read_extent(kv_lens: torch.Tensor, capacity: int) -> int:
    """Tokens a KV read covers: the longest of ``kv_lens`` (a host read), or the whole capacity while a CUDA graph is
    being captured (static shapes; the rows' lengths mask the rest)."""
    return capacity if capturing(kv_lens) else int(kv_lens.max())


def rotary_inv_freq(rotary_dim: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """(r/2,) float32 RoPE frequencies base^(-2j/r)."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float = 10000.0):
    """cos, sin tables for NeoX-style (half-split) RoPE.

    positions: (b, l) int. Returns cos, sin: (b, l, r) float32.
    """
    freqs = positions.float().unsqueeze(-1) * rotary_inv_freq(rotary_dim, base, positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first r channels of each head. x: (b, l, heads, e); cos, sin: (b, l, r)."""
    r = cos.shape[-1]
    xr, xpass = x[..., :r].float(), x[..., r:]
    x1, x2 = xr.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = xr * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)
    return torch.cat([out.to(x.dtype), xpass], dim=-1)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """x (b, l, heads, e) rotated at ``positions`` (b, l) int: the first r = ``rotary_dim`` channels of each head by
    NeoX RoPE (halves), the rest as they are; x itself when r = 0. Angles, products and sums in float32, the result
    rounded once to x's dtype."""
    if not rotary_dim:
        return x
    return apply_rotary_ref(x, *rotary_cos_sin(positions, rotary_dim, base))


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_lens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Causal GQA attention of new queries over a (cached) key/value prefix.

    q: (b, lq, hq, e) — the last lq tokens of each sequence; k, v: (b, lk, hkv, e).
    kv_lens: (b,) number of valid keys per row (all lk when None); query i of row
    j sits at position kv_lens[j] - lq + i and sees keys at positions <= its own.
    Returns (b, lq, hq, e) in q's dtype; softmax in float32.
    """
    b, lq, hq, e = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    scale = e**-0.5 if softmax_scale is None else softmax_scale
    lens = torch.full((b,), lk, device=q.device) if kv_lens is None else kv_lens.to(q.device)
    kf = k.float().repeat_interleave(hq // hkv, dim=2)
    vf = v.float().repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bihe,bjhe->bhij", q.float(), kf) * scale
    q_pos = lens[:, None] - lq + torch.arange(lq, device=q.device)  # (b, lq)
    k_pos = torch.arange(lk, device=q.device)
    visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < lens[:, None, None])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    out = torch.einsum("bhij,bjhe->bihe", scores.softmax(dim=-1), vf)
    return out.to(q.dtype)
