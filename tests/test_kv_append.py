"""The fused quantize-and-append kernel (``ssmq.kernels.kv_append``) writes the bytes of the reference write
(``QuantSide.write``: quantize_kv_ref + pack_codes + scatters): codes, per-token scales, outlier slots and sink, for
per-channel and per-token sides, 2 / 3 / 4 bits, symmetric or not, with and without outliers, one token a row
(decode) and several (prefill), positions inside and past the sink. Under Triton's interpreter on CPU, on the GPU."""

from __future__ import annotations

import pytest
import torch
from test_kernels import DEV

from ssmq.models.kv_quantizer import KVQuantizer
from ssmq.models.quant_kv import QuantKVState
from ssmq.models.kv_format import kv_format

pytestmark = pytest.mark.gpu  # on CPU with SSMQ_TRITON_INTERPRET=1 (conftest)
HKV, E = 4, 64  # 256 entries a token: 1% is 3 value / 6 key slots


def _quantizer(name: str, seed: int = 0, spread: float = 1.0) -> KVQuantizer:
    """A quantizer of format ``name`` with calibrated-looking codebooks (sorted, in [-1, 1], ends kept) and
    per-channel ranges (a spread per channel, so that some entries of heavy-tailed data fall outside: at spread 1
    ~60 of a token's 256, more than its 6 key slots; at 5, 1-9, so tokens with fewer candidates than slots too)."""
    g = torch.Generator().manual_seed(seed)
    q = KVQuantizer(kv_format(name).spec, HKV, E)
    for x in "kv":
        book = getattr(q, f"{x}_codebook")
        if book.numel() > 2 and "nuq" in name:
            inner = torch.sort(torch.rand(book.numel() - 2, generator=g) * 2 - 1).values
            book.copy_(torch.cat([book[:1], inner, book[-1:]]))
        if hasattr(q, f"{x}_lo"):
            width = (torch.rand(HKV, E, generator=g) * 2 + 0.5) * spread
            centre = torch.randn(HKV, E, generator=g) * 0.3
            getattr(q, f"{x}_lo").copy_(centre - width)
            getattr(q, f"{x}_hi").copy_(centre + width)
    return q


def _data(b: int, l: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, HKV, E, generator=g)
    x = x * torch.where(torch.rand(x.shape, generator=g) < 0.02, 6.0, 1.0)  # heavy tails: outliers on both sides
    return x.half()


@pytest.mark.parametrize("name,spread", [("kvquant-nuq4-1%", 1.0), ("kvquant-nuq3-1%", 1.0), ("kvquant-nuq2-1%", 1.0),
                                         ("kvquant-int4", 1.0), ("kvquant-int3-1%", 1.0), ("kv-int4-pth", 1.0),
                                         ("kvquant-nuq2", 1.0), ("kvquant-nuq4-1%", 5.0), ("kvquant-nuq3-1%", 5.0)])
@pytest.mark.parametrize("l", [1, 5])
@pytest.mark.parametrize("paged", [False, True])
def test_fused_append_writes_the_reference_bytes(name, spread, l, paged, monkeypatch):
    """paged: the per-token buffers are block pools (8-token blocks, shuffled), written through the block table."""
    pytest.importorskip("triton")
    from ssmq.kernels import policy
    from ssmq.kernels.kv_append import eligible, quant_kv_append
    from ssmq.models.paged_kv import BlockTable

    # the reference state writes with the ops on CUDA too
    monkeypatch.setattr(policy, "_ACTIVE", [policy.KernelPolicy(kv_fused_append=False)])

    q = _quantizer(name, spread=spread).to(DEV)
    table = None
    if paged:
        table = BlockTable(4, 32, 8, 1 + 16, DEV)
        blocks = (1 + torch.randperm(16, generator=torch.Generator().manual_seed(1))).tolist()
        for slot in range(4):
            table.assign(slot, 0, blocks[4 * slot:4 * slot + 4])
    ref = QuantKVState(q, 4, 32, torch.float16, DEV, table=table)
    got = QuantKVState(q, 4, 32, torch.float16, DEV, table=table)
    slots = torch.tensor([2, 0, 3], device=DEV)
    for step, start in enumerate((0, 1, 9)):  # positions inside the sink (0), just past it, further on
        x = _data(3, l, step).to(DEV)
        positions = (torch.tensor([start, start + 2, start + 4], device=DEV)[:, None]
                     + torch.arange(l, device=DEV))
        for which, r, gside in (("keys", ref.k, got.k), ("values", ref.v, got.v)):
            p = q.params(which)
            assert eligible(p, r.bits)
            r.write(slots, positions, x)
            quant_kv_append(x, slots, positions, p, gside.bits, gside.codes, gside.mid, gside.half, gside.out_idx,
                            gside.out_val, gside.sink, block_table=gside.block_table)
    for which, r, gside in (("keys", ref.k, got.k), ("values", ref.v, got.v)):
        assert r.out_idx.shape[-1] == (0 if "1%" not in name else (6 if which == "keys" else 3))
        for a, b_, what in zip(r.buffers(), gside.buffers(), ("codes", "mid", "half", "out_idx", "out_val", "sink")):
            assert torch.equal(a, b_), f"{name} {which}: {what} differs"
    assert (ref.k.out_idx >= 0).any() or "1%" not in name  # the data has outliers to keep


def test_fused_append_refuses_rotated_and_8_bit_sides():
    from ssmq.kernels.kv_append import eligible

    for name in ("kv-turbo4", "kv-int8-pth"):
        q = _quantizer(name)
        st = QuantKVState(q, 1, 4, torch.float16, "cpu")
        assert not eligible(q.params("keys"), st.k.bits)


def test_quantized_cache_writes_through_the_fused_kernel_when_on(monkeypatch):
    """``KernelPolicy.kv_fused_append`` on: ``QuantKVState.append`` takes the kernel on CUDA and leaves the reference's bytes."""
    if not torch.cuda.is_available():
        pytest.skip("the fused append runs on CUDA tensors")
    from ssmq.kernels import kv_append, policy

    q = _quantizer("kvquant-nuq3-1%").cuda()
    states = [QuantKVState(q, 2, 8, torch.float16, "cuda") for _ in range(2)]
    x, slots = _data(2, 3, 7).cuda(), torch.tensor([1, 0], device="cuda")
    positions = torch.tensor([[0, 1, 2], [3, 4, 5]], device="cuda")
    calls = []
    real = kv_append.quant_kv_append
    monkeypatch.setattr(kv_append, "quant_kv_append", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for on, st in zip((False, True), states):
        monkeypatch.setattr(policy, "_ACTIVE", [policy.KernelPolicy(kv_fused_append=on)])
        st.append(slots, positions, x, x)
    assert len(calls) == 2  # keys and values, with the flag on only
    for a, b in zip(states[0].k.buffers() + states[0].v.buffers(), states[1].k.buffers() + states[1].v.buffers()):
        assert torch.equal(a, b)
