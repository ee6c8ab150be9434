"""GPU diagnostic of the second-generation KVQuant decode kernel (issue 17; ``ssmq/kernels/kv_decode_fast.py``, shipped
for the formats it gets right and kept apart from the rest): isolates each stage in one run and prints max errors,
so one short device call says which stage is wrong.

  lookup   the codebook lookup alone (``_lut_words`` + ``_book``: packed codes -> (T, CP) float16) against a gather
           from the codebook, 4 / 3 / 2 bits, PRMT inline asm (asm=1) and the pure-Triton lookup (asm=0), several
           tile shapes and warp counts; on a mismatch prints the codes it returned for row 0 (the permutation).
  decode   the whole decode (``kv_decode_fast.decode_any``: every format, the ineligible ones too) against
           ``quant_kv_decode_ref``: no RoPE / RoPE "split" / "direct", 4 / 3 / 2 bits, without and with outliers,
           asm on / off.

Usage: python benchmarks/diag_kv_decode.py [lookup|decode|all]   (GPU; also runs under SSMQ_TRITON_INTERPRET=1
with asm=0 only, as a check of the script itself). H100, 2026-11-26 (logs ``benchmarks/results/kvquant_h100/
diag_kv_decode_s15*.log``, ``..._s17.log``): exact except where a tensor-core product was 16 wide (16-channel rotary
halves, 16-token tiles: the outlier formats' tiles then), hence the kernel's 32-wide minimum; the "bt16" case below
still forces 16-token tiles, to show whether a newer Triton fixes it."""

from __future__ import annotations

import os
import sys
import time

import torch
import triton
import triton.language as tl

from ssmq.kernels import kv_decode_fast as m
from ssmq.kernels.kv_decode_fast import _book, _lut_words


DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 3e-3


@triton.jit
def _lookup_kernel(codes, lut, out, s_row, T: tl.constexpr, E: tl.constexpr, CP: tl.constexpr,
                   LEVELS: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    w0, w1, w2, w3, w4, w5, w6, w7 = _lut_words(lut, LEVELS, BITS)
    t = tl.arange(0, T)
    tmask = t < T
    x = _book(codes + t[:, None] * s_row, 0, E, CP, tmask, lut, w0, w1, w2, w3, w4, w5, w6, w7, BITS, ASM)
    c = tl.arange(0, CP)
    tl.store(out + t[:, None] * CP + c[None, :], x)


def _report(name, got, want, extra=""):
    d = (got.float().cpu() - want.float().cpu()).abs()
    off = int((d > TOL + TOL * want.float().cpu().abs()).sum())
    print(f"{name:60s} max_abs={d.max().item():.3e} off={off}/{d.numel()} {extra}", flush=True)
    return off


def lookup(asms):
    from ssmq.ops.kv_quant import pack_codes

    gen = torch.Generator().manual_seed(0)
    for bits, levels in ((4, 16), (3, 8), (2, 4)):
        for T, E, warps in ((32, 64, 4), (16, 32, 1), (32, 128, 4), (64, 64, 8)):
            idx = torch.randint(0, levels, (T, E), generator=gen, dtype=torch.uint8)
            book = torch.sort(torch.rand(levels, generator=gen) * 2 - 1).values
            codes = pack_codes(idx, bits).contiguous().to(DEV)
            want = book[idx.long()].half()
            for asm in asms:
                out = torch.zeros(T, E, dtype=torch.float16, device=DEV)
                name = f"lookup bits={bits} T={T} E={E} warps={warps} asm={int(asm)}"
                try:
                    _lookup_kernel[(1,)](codes, book.to(DEV), out, codes.stride(0), T=T, E=E, CP=E, LEVELS=levels,
                                         BITS=bits, ASM=asm, num_warps=warps)
                except Exception as e:  # a compile error is a result too
                    print(f"{name:60s} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                if _report(name, out, want):  # which codes came back where: the permutation, if one
                    got_idx = (out.float().cpu()[..., None] - book.half().float()).abs().argmin(-1)
                    for r in (0, 1):
                        print(f"   row{r} want {idx[r, :24].tolist()}\n   row{r} got  {got_idx[r, :24].tolist()}")


def _side(s, L, hkv, e, per_token, slots, gen, levels):
    """The kernel tests' random quantized side (one sink token), on the device: tests/test_kvquant_kernels.side."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from test_kvquant_kernels import side

    return side(s, L, hkv, e, per_token, slots, 1, gen, levels)


def _to(view, dev):
    from dataclasses import fields, replace

    return replace(view, **{f.name: getattr(view, f.name).to(dev) for f in fields(view)
                            if isinstance(getattr(view, f.name), torch.Tensor)})


def decode_case(name, klev, vlev, r, rope="split", asm=True, kslots=0, vslots=0, k_per_token=False,
                b=2, hq=4, hkv=2, e=64, L=100, splits=1, stages=2, block_t=None):
    from ssmq.ops.kv_quant import quant_kv_decode_ref

    m.CFG.update(ROPE=rope, ASM=asm, num_stages=stages, BLOCK_T=block_t or 32, BLOCK_T_OUTLIERS=block_t or 32)
    gen = torch.Generator().manual_seed(0)
    s = b + 2
    K = _side(s, L, hkv, e, k_per_token, kslots, gen, klev)
    V = _side(s, L, hkv, e, True, vslots, gen, vlev)
    q = torch.randn(b, hq, e, generator=gen)
    slots = torch.randperm(s, generator=gen)[:b]
    lens = torch.full((b,), L)
    lens[1:] = L // 2 + 3
    tag = (f"decode {name} k{klev} v{vlev} r={r} rope={rope} asm={int(asm)} ko={kslots} vo={vslots} sp={splits} "
           f"st={stages} bt={block_t}")
    args = (q.to(DEV), slots.to(DEV), lens.to(DEV), _to(K, DEV), _to(V, DEV), r, 10000.0)
    try:
        got = m.decode_any(*args, splits=splits)
    except Exception as ex:
        print(f"{tag:60s} ERROR {type(ex).__name__}: {str(ex)[:300]}", flush=True)
        return
    want = quant_kv_decode_ref(*args)  # on the same device: the random side's tensors may live there
    _report(tag, got, want)


def decode(asms):
    for asm in asms:  # most informative first: plain 4-bit, no RoPE, no outliers
        decode_case("plain", 16, 16, 0, asm=asm)
    decode_case("plain", 16, 16, 0, asm=asms[0], stages=1)  # the software pipeliner (cp.async) out
    decode_case("plain", 16, 16, 0, asm=asms[0], splits=None)  # several splits + the combine kernel
    for asm in asms:
        decode_case("rope", 16, 16, 32, "split", asm)
    decode_case("rope", 16, 16, 32, "direct", asms[0])
    for lev in (4, 8):
        for asm in asms:
            decode_case("plain", lev, lev, 0, asm=asm)
    decode_case("mixed", 16, 4, 0, asm=asms[0])  # 4-bit keys, 2-bit values
    decode_case("mixed", 4, 16, 0, asm=asms[0])  # 2-bit keys, 4-bit values
    decode_case("ptok", 16, 16, 0, asm=asms[0], k_per_token=True)
    decode_case("rope e32", 16, 16, 32, "split", asms[0], e=32)  # full RoPE, 16-channel halves
    decode_case("rope3", 8, 8, 32, "split", asms[0])
    # the outliers, one thing at a time (asm only: the gathered lookup with outliers does not compile, s15):
    # 16-token tiles alone, then key outliers alone and value outliers alone, no RoPE, 4 bits
    decode_case("bt16", 16, 16, 0, asm=asms[0], block_t=16)
    decode_case("kout", 16, 16, 0, asm=asms[0], kslots=2)
    decode_case("vout", 16, 16, 0, asm=asms[0], vslots=1)
    decode_case("kout ptok", 16, 16, 0, asm=asms[0], kslots=2, k_per_token=True)
    decode_case("vout bt32", 16, 16, 0, asm=asms[0], vslots=1, block_t=32)
    decode_case("vout3", 8, 8, 0, asm=asms[0], vslots=2)
    # the failing test's case0 shape: 3-bit, partial RoPE, key + value outliers
    decode_case("case0", 8, 8, 32, "split", asms[0], kslots=2, vslots=1, b=2, hq=6, hkv=2, e=64)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    asms = (True, False) if DEV == "cuda" else (False,)
    t0 = time.time()
    if DEV == "cuda":
        print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__, flush=True)
    if what in ("lookup", "all"):
        lookup(asms)
    if what in ("decode", "all"):
        decode(asms)
    print(f"done in {time.time() - t0:.1f} s", flush=True)
