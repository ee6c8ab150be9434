"""Causal GQA attention of a chunk of new queries over a float key/value prefix (prefill and chunked prefill of
hybrid and Llama models, the full forward of perplexity runs): the Triton twin of ``ssmq.ops.attention_ref``.

Glossary: b rows, lq new queries a row, lk keys, hq query heads, hkv kv heads, g = hq / hkv, e head dim, n a
row's length (its keys, the new ones included; query i sits at position n - lq + i and sees keys 0 .. its own).

One program per (BLOCK_M (query, head) pairs, row, kv head): a kv head's g query heads are folded into the rows of
its tensor-core products (pair m = query m // g, head m mod g), so each key tile is read once for the g heads, as
the decode kernels do; an online softmax over BLOCK_N-key tiles (flash attention), causal tiles past the program's
last query skipped. Products take q / k / v in their dtype (float16 or bfloat16) and accumulate in float32; the
reference is float32 throughout (tests: rtol = atol = 2e-2 in bfloat16, 2e-3 in float16). A query that sees no key
(a row shorter than the chunk) gives 0 where the reference gives NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels import configs
from ssmq.kernels._common import cdiv, next_pow2
from ssmq.kernels.dispatch import PREFILL_ATTENTION, prefill_launch, serves
from ssmq.kernels.kv_decode import _page, paging

CFG = configs.load("attention_prefill")  # launch settings (configs/attention_prefill.json)


@triton.jit
def _prefill_kernel(q, k, v, out, lens, slots, table, s_tab, lq, scale, s_qb, s_ql, s_qh, s_k0, s_k1, s_kh, s_v0,
                    s_v1, s_vh, s_ob, s_ol, s_oh, GROUP: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr):
    """Key t of row i at k + first·s_k0 + second·s_k1, (first, second) = ``kv_decode._page``'s: (slots[i], t) in
    rows or cache slots, (block, t mod BS) in block pools (BS > 0) through ``table`` (slots, M)."""
    pid_m, i, hk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(lens + i).to(tl.int32)
    slot = tl.load(slots + i).to(tl.int64)
    pairs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = pairs // GROUP
    h = hk * GROUP + pairs % GROUP
    rmask = qi < lq
    pos = n - lq + qi  # each query's position: it sees keys 0 .. pos
    e = tl.arange(0, EP)
    emask = e < E
    qt = tl.load(q + i.to(tl.int64) * s_qb + qi[:, None] * s_ql + h[:, None] * s_qh + e[None, :],
                 mask=rmask[:, None] & emask[None, :], other=0.0)
    kbase = k + hk * s_kh
    vbase = v + hk * s_vh
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, EP), tl.float32)
    qscale = scale * 1.4426950408889634  # log2 units: exp2
    # the program's last query (pairs are query-major) bounds its causal keys
    hi = tl.minimum(n, n - lq + tl.minimum(lq - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP) + 1)
    for start in range(0, hi, BLOCK_N):
        kk = start + tl.arange(0, BLOCK_N)
        kmask = kk < hi
        pb, pt = _page(table, s_tab, slot, kk, kmask, BS)
        kt = tl.load(kbase + (pb * s_k0 + pt * s_k1)[None, :] + e[:, None], mask=emask[:, None] & kmask[None, :],
                     other=0.0)
        s = tl.dot(qt, kt) * qscale
        s = tl.where((kk[None, :] <= pos[:, None]) & kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: no NaN from -inf - -inf
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m - m_ref)
        l = l * alpha + tl.sum(p, 1)
        vt = tl.load(vbase + (pb * s_v0 + pt * s_v1)[:, None] + e[None, :], mask=kmask[:, None] & emask[None, :],
                     other=0.0)
        acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])
        m = m_new
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out + i.to(tl.int64) * s_ob + qi[:, None] * s_ol + h[:, None] * s_oh + e[None, :],
             o.to(out.dtype.element_ty), mask=rmask[:, None] & emask[None, :])


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The inputs this kernel serves: its row of ``dispatch.PREFILL_ATTENTION``."""
    return serves(PREFILL_ATTENTION, "attention_prefill", prefill_launch(q, k, v))


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: torch.Tensor | None = None,
                      softmax_scale: float | None = None, slots: torch.Tensor | None = None,
                      block_table: torch.Tensor | None = None, cfg: dict | None = None) -> torch.Tensor:
    """``attention_ref`` for ``eligible`` inputs: q (b, lq, hq, e), k, v (b, lk, hkv, e), kv_lens (b,) (all lk when
    None) → (b, lq, hq, e) in q's dtype. ``slots`` (b,): k, v are a cache (s, L, hkv, e) whose slots hold the rows;
    with ``block_table`` (s, M) too, block pools (N, B, hkv, e) (``ssmq.models.paged_kv``), read in place. Keys past
    a row's length are never read, so a cache's capacity costs nothing. ``cfg`` overrides the launch settings."""
    cfg = {**CFG, **(cfg or {})}
    b, lq, hq, e = q.shape
    hkv = k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    rows = torch.arange(b, device=q.device) if slots is None else slots
    pages, bs, capacity = paging(block_table, rows, k)
    lens = torch.full((b,), capacity, device=q.device, dtype=torch.int32) if kv_lens is None else kv_lens
    out = torch.empty_like(q)
    group = hq // hkv
    scale = e ** -0.5 if softmax_scale is None else softmax_scale
    grid = (cdiv(lq * group, cfg["BLOCK_M"]), b, hkv)
    _prefill_kernel[grid](q, k, v, out, lens, rows, *pages, lq, scale, *q.stride()[:3], *k.stride()[:3],
                          *v.stride()[:3], *out.stride()[:3], GROUP=group, E=e, EP=max(16, next_pow2(e)),
                          BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BS=bs, num_warps=cfg["WARPS"],
                          num_stages=cfg["STAGES"])
    return out
