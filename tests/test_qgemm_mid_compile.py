"""The serving-batch weight-only GEMM (``ssmq.kernels.qgemm_mid._mid_qmm``) compiles for an H100 (sm_90) without a GPU,
in each structural variant, with its int4 bit-assembly conversion (fp16 / bf16, scaled or not) accepted by ptxas,
the products on Hopper's warp-group tensor-core instructions and the codes loaded asynchronously (pipelined)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from test_kernel_compile import _compile_sm90  # noqa: E402

# (int4, WS_MODE, bf16, SWAP, X_SPLIT, POST_SCALE, BLOCK_M, SPLIT, GPS)
VARIANTS = {
    "w4-swap": (True, 2, False, True, 2, False, 32, False, 1),
    "w4-swap-join-post-bf16": (True, 2, True, True, 0, True, 128, True, 2),
    "w4-swap-join-gps2": (True, 2, False, True, 0, False, 64, False, 2),
    "w4-strided-x": (True, 2, False, True, 1, False, 16, False, 1),
    "w4-plain": (True, 2, False, False, 2, False, 64, True, 1),
    "w8-channel-swap": (False, 1, False, True, 0, False, 128, False, 2),
    "w8-group-plain-bf16": (False, 2, True, False, 0, False, 32, False, 1),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mid_qmm_compiles_for_sm90(variant):
    from ssmq.kernels.qgemm_mid import _asm, _mid_qmm

    w4, ws_mode, bf16, swap, x_split, post, bm, split, gps = VARIANTS[variant]
    scaled = ws_mode == 2 and not post
    x = "bf16" if bf16 else "fp16"
    pointers = {"x_ptr": x, "w_ptr": "u8" if w4 else "i8", "ws_ptr": "fp32", "b_ptr": x, "out_ptr": x,
                "part_ptr": "fp32", "cnt_ptr": "i32"}
    const = dict(W4=w4, WS_MODE=ws_mode, HAS_BIAS=True, SPLIT=split, NSP=4 if split else 1, BF16=bf16,
                 ASM_LO=_asm(False, bf16, scaled) if w4 else "", ASM_HI=_asm(True, bf16, scaled) if w4 else "",
                 FAST_I8=not w4 and not bf16, POST_SCALE=post, SWAP=swap, X_SPLIT=x_split, GPS=gps, BLOCK_M=bm,
                 BLOCK_N=64, BLOCK_K=128, USE_GDC=True)
    aligned = ("x_ptr", "w_ptr", "ws_ptr", "b_ptr", "out_ptr", "part_ptr", "cnt_ptr", "M", "N", "K", "k_split",
               "s_xm", "s_wn", "s_om")
    compiled = _compile_sm90(_mid_qmm, pointers, const, aligned=aligned)
    ptx = compiled.asm["ptx"]
    # W @ x.T: the weight tile is the warp-group instruction's register operand; x @ W.T with 16-32 row tiles: mma.sync
    assert "wgmma.mma_async" in ptx if swap or bm >= 64 else "mma.sync" in ptx
    assert "cp.async" in ptx
    if w4:
        assert ptx.count("lop3.b32") >= 4 and ("fma.rn.bf16x2" if bf16 else "sub.f16x2") in ptx
