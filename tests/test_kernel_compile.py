"""The selective state-update kernel compiles for an H100 (sm_90) on a machine without a GPU: Triton's NVIDIA backend
and its bundled ptxas turn each variant (plain / checkpointed, fp16 / int8 state, Mamba-2 per-head Δ / Mamba-1
per-channel Δ) into a cubin. The interpreter tests check the arithmetic; this catches what only the compiler
refuses (types, scalar masks, atomics) before a GPU session is spent on it.
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


@pytest.mark.parametrize("ring_stages", [1, 2, 4])
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
                 HAS_SIDX=q_state, Q_X=q_in, Q_B=q_in, Q_C=q_in, REPLAY=replay, RING_STAGES=ring_stages, RP=16,
                 BNC=32, FOLD_STAGES=ring_stages + 1, BP=32, BN=128)
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
