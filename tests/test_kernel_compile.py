"""The selective state-update kernel compiles for an H100 (sm_90) on a machine without a GPU: Triton's NVIDIA backend
and its bundled ptxas turn each variant (plain / checkpointed, fp16 / int8 state, Mamba-2 per-head Δ / Mamba-1
per-channel Δ) into a cubin. The interpreter tests check the arithmetic; this catches what only the compiler
refuses (types, scalar masks, atomics) before a GPU session is spent on it. The same for the KV-cache decode
kernels (kv_decode).
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

# (state, inputs, int8 state, int8 inputs, checkpointed, per-head Δ)
VARIANTS = {
    "fp16-plain": ("fp16", "fp16", False, False, False, True),
    "fp16-replay": ("fp16", "fp16", False, False, True, True),
    "int8-plain": ("i8", "i8", True, True, False, True),
    "int8-replay": ("i8", "i8", True, True, True, True),
    "int8-replay-mamba1": ("i8", "i8", True, True, True, False),
}


@pytest.mark.parametrize("ring_stages", [1, 2, 3])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_state_update_compiles_for_sm90(variant, ring_stages):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ssmq.kernels.state_update import _state_update as kernel

    if not hasattr(kernel, "arg_names"):
        pytest.skip("kernels are interpreted in this session (SSMQ_TRITON_INTERPRET=1)")
    state, inputs, q_state, q_in, replay, tie = VARIANTS[variant]
    pointers = {"state_ptr": state, "x_ptr": inputs, "dt_ptr": "fp16", "A_ptr": "fp32", "B_ptr": inputs,
                "C_ptr": inputs, "D_ptr": "fp32", "z_ptr": "fp16", "dtb_ptr": "fp32", "idx_ptr": "i32",
                "out_ptr": "fp16", "ss_ptr": "fp32", "sidx_ptr": "i64", "xs_ptr": "fp32", "Bs_ptr": "fp32",
                "Cs_ptr": "fp32", "rx_ptr": "fp32", "rdt_ptr": "fp32", "rB_ptr": "fp32", "cnt_ptr": "i32",
                "done_ptr": "i32"}
    const = dict(HAS_D=True, HAS_Z=not tie, HAS_DTB=True, HAS_IDX=True, SOFTPLUS=True, TIE_HDIM=tie, Q_STATE=q_state,
                 HAS_SIDX=q_state, Q_X=q_in, Q_B=q_in, Q_C=q_in, REPLAY=replay, RING_STAGES=ring_stages,
                 BP=32, BN=128)
    missing = set(pointers) | set(const)
    missing -= set(kernel.arg_names)
    assert not missing, f"kernel arguments renamed: {missing}"
    signature = {a: "constexpr" if a in const else "*" + pointers[a] if a in pointers else "i32"
                 for a in kernel.arg_names}
    src = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(a),): v for a, v in const.items()})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except (FileNotFoundError, RuntimeError) as e:
        if "ptxas" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise
    assert compiled.asm.get("cubin")


# kv_decode variants: (float KV, rotary dim, key / value outlier slots, sink tokens, per-token keys)
KV_VARIANTS = {
    "kvq4-rope": (False, 128, 0, 0, 1, False),
    "kvq4-rope-1%": (False, 128, 20, 10, 1, False),
    "kvq4-partial-rope-per-token": (False, 64, 2, 1, 0, True),
    "fp16": (True, 0, 0, 0, 0, False),
}


@pytest.mark.parametrize("variant", sorted(KV_VARIANTS))
def test_kv_decode_compiles_for_sm90(variant):
    """The flash-decoding kernel over a quantized (or float) KV cache, bench_kvquant's shapes (32 q / 8 kv heads
    x 128), and its combine kernel, in the shipped CFG: cubins that fit an H100 SM's shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ssmq.kernels import kv_decode as kd

    if not hasattr(kd._decode_kernel, "arg_names"):
        pytest.skip("kernels are interpreted in this session (SSMQ_TRITON_INTERPRET=1)")
    fl, r, ko, vo, sink, k_tok = KV_VARIANTS[variant]
    code, scale = ("fp16", "fp16") if fl else ("u8", "fp16")
    pointers = {"q": "fp16", "slots": "i64", "lens": "i32", "inv_freq": "fp32", "out": "fp32", "ws": "fp32",
                "kc": code, "kmid": scale if k_tok else "fp32", "khalf": scale if k_tok else "fp32", "klut": "fp32",
                "koi": "i16", "kov": "fp16", "ksink": "fp16", "vc": code, "vmid": scale, "vhalf": scale,
                "vlut": "fp32", "voi": "i16", "vov": "fp16", "vsink": "fp16"}
    block_t = kd.CFG["BLOCK_T_OUTLIERS"] if ko or vo else kd.CFG["BLOCK_T"]
    const = dict(GROUP=4, GP=16, E=128, R=r, HP=max(16, r // 2), PP=max(16, 128 - r), S=sink, SP=16, FLOAT=fl,
                 K_PER_TOKEN=k_tok, V_PER_TOKEN=not fl, KSLOTS=ko, KP=triton.next_power_of_2(max(ko, 1)), VSLOTS=vo,
                 BLOCK_T=block_t, ONE_SPLIT=False, FAST=True, DOT=kd.CFG["dot"])
    kernels = [(kd._decode_kernel, pointers, const, kd.CFG["num_warps"], kd.CFG["num_stages"]),
               (kd._combine_kernel, {"ws": "fp32", "out": "fp32"}, dict(E=128, PS=32), 4, 3)]
    for kernel, ptrs, cst, warps, stages in kernels:
        assert not set(ptrs) - set(kernel.arg_names) and not set(cst) - set(kernel.arg_names), "arguments renamed"
        signature = {a: "constexpr" if a in cst else "*" + ptrs[a] if a in ptrs else "fp32" if a == "scale"
                     else "i32" for a in kernel.arg_names}
        src = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(a),): v for a, v in cst.items()})
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": warps, "num_stages": stages})
        except (FileNotFoundError, RuntimeError) as e:
            if "ptxas" in str(e):
                pytest.skip(f"no ptxas: {e}")
            raise
        assert compiled.asm.get("cubin")
        assert compiled.metadata.shared <= 227 * 1024, "more shared memory than an H100 SM has"
