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


def _launch_args(su, call):
    """The arguments ``call`` (a public state-update function on CPU tensors) would launch ``su._state_update`` with."""
    got = {}

    class Capture:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: got.update(args=args, kwargs=kwargs)

    real, su._state_update = su._state_update, Capture()
    try:
        call()
    finally:
        su._state_update = real
    return got["args"], got["kwargs"]


@pytest.mark.parametrize("state", ["fp16", "int8"])
@pytest.mark.parametrize("replay", [False, True])
def test_state_update_compiles_as_launched(state, replay):
    """Mamba2-2.7B's layer (h 80, p 64, n 128) with the launch settings of ``CFG`` and the JIT's specialization (unit
    strides as constants, 16-divisible ones and pointers marked): the code a GPU run compiles (vectorized loads, the
    checkpointed step's pipelined chunks), not only the generic one above."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    import torch

    from ssmq.kernels import state_update as su
    from ssmq.ops.replay_ssm import StateRing

    if not hasattr(su._state_update, "arg_names"):
        pytest.skip("kernels are interpreted in this session (SSMQ_TRITON_INTERPRET=1)")
    b, h, p, n = 4, 80, 64, 128  # 4 rows: enough programs that the tile heuristic keeps its large-batch tiles
    int8 = state == "int8"
    x, B, C = torch.randn(b, h, p), torch.randn(b, 1, n), torch.randn(b, 1, n)
    dt = torch.randn(b, h)[:, :, None].expand(b, h, p)
    A = (-torch.rand(h))[:, None, None].expand(h, p, n)
    per_head = torch.randn(h)[:, None].expand(h, p)
    if int8:
        st, table, index = torch.zeros(b, h, p, n, dtype=torch.int8), torch.rand(16, n), torch.randint(0, 16, (h * p,))
        inputs = [x.to(torch.int8), torch.rand(h, p), dt, A, B.to(torch.int8), torch.rand(1, n), C.to(torch.int8),
                  torch.rand(1, n)]
    else:
        st, table, index = torch.zeros(b, h, p, n, dtype=torch.float16), None, None
        inputs = [x.half(), None, dt[:, :, :1].half().expand(b, h, p), A, B.half(), None, C.half(), None]
    kw = dict(D=per_head, dt_bias=per_head, dt_softplus=True, state_batch_indices=torch.arange(b, dtype=torch.int32))
    if replay:
        ring = StateRing.allocate(b, 16, h, p, 1, n, per_head_dt=True, device="cpu")
        args, kwargs = _launch_args(su, lambda: su.replay_state_update(st, table, index, ring, *inputs, **kw))
    else:
        args, kwargs = _launch_args(su, lambda: su.quant_state_update(st, table, index, *inputs, **kw))
    kernel = su._state_update
    options = {k: kwargs.pop(k) for k in ("num_warps", "maxnreg") if k in kwargs}
    values = {**dict(zip(kernel.arg_names, args)), **kwargs}
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        v = values[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[(i,)] = "constexpr", v
            continue
        ty, attr = native_specialize_impl(BaseBackend, v, False, True, True)  # as the JIT's launcher does
        signature[param.name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = attr
        elif attr:
            attrs[(i,)] = BaseBackend.parse_attr(attr)
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except (FileNotFoundError, RuntimeError) as e:
        if "ptxas" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise
    assert compiled.asm.get("cubin")
    assert not replay or "cp.async" in compiled.asm["ptx"]  # the checkpoint streamed through shared memory
