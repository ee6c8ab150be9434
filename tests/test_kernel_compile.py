"""The selective state-update kernel compiles for an H100 (sm_90) on a machine without a GPU: Triton's NVIDIA backend
and its bundled ptxas turn each variant (plain / checkpointed, fp16 / int8 state, Mamba-2 per-head Δ / Mamba-1
per-channel Δ) into a cubin. The interpreter tests check the arithmetic; this catches what only the compiler
refuses (types, scalar masks, atomics) before a GPU session is spent on it. The same for the SSDi8 and the KV-cache
decode (kv_decode) kernels.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

# (state, inputs, int8 state, int8 inputs, checkpointed, per-head Δ, dynamic row scales)
VARIANTS = {
    "fp16-plain": ("fp16", "fp16", False, False, False, True, False),
    "fp16-replay": ("fp16", "fp16", False, False, True, True, False),
    "int8-plain": ("i8", "i8", True, True, False, True, False),
    "int8-replay": ("i8", "i8", True, True, True, True, False),
    "int8-replay-mamba1": ("i8", "i8", True, True, True, False, False),
    "int8rows-plain": ("i8", "i8", True, True, False, True, True),
    "int8rows-replay": ("i8", "i8", True, True, True, True, True),
    "int8rows-plain-mamba1": ("i8", "i8", True, True, False, False, True),
}


@pytest.mark.parametrize("ring_stages", [1, 2, 4])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_state_update_compiles_for_sm90(variant, ring_stages):
    from ssmq.kernels.state_update import _state_update as kernel

    state, inputs, q_state, q_in, replay, tie, rows = VARIANTS[variant]
    pointers = {"state_ptr": state, "x_ptr": inputs, "dt_ptr": "fp16", "A_ptr": "fp32", "B_ptr": inputs,
                "C_ptr": inputs, "D_ptr": "fp32", "z_ptr": "fp16", "dtb_ptr": "fp32", "idx_ptr": "i32",
                "out_ptr": "fp16", "ss_ptr": "fp32", "ssi_ptr": "fp32", "sidx_ptr": "i64", "xs_ptr": "fp32", "Bs_ptr": "fp32",
                "Cs_ptr": "fp32", "rs_ptr": "fp32", "rx_ptr": "fp32", "rdt_ptr": "fp32", "rB_ptr": "fp32", "cnt_ptr": "i32",
                "done_ptr": "i32"}
    const = dict(HAS_D=True, HAS_Z=not tie, HAS_DTB=True, HAS_IDX=True, SOFTPLUS=True, TIE_HDIM=tie, Q_STATE=q_state,
                 ROWS=rows, HAS_SIDX=q_state and not rows, Q_X=q_in, Q_B=q_in, Q_C=q_in, REPLAY=replay, RING_STAGES=ring_stages, RP=16,
                 BNC=128 if rows else 32, FOLD_STAGES=ring_stages + 1, FAST_RCP=q_state, PTX_CODES=q_state,
                 RCP_TABLE=q_state and ring_stages != 1, EVEN=ring_stages == 2, HPG=3, BP=32, BN=128)
    _compile_sm90(kernel, pointers, const)


def _launch_args(su, call):
    """(kernel, arguments) ``call`` (a public state-update function on CPU tensors) would launch: ``su._step`` (the
    plain Mamba-2 step) or ``su._state_update``."""
    got = {}

    class Capture:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: got.update(kernel=self.kernel, args=args, kwargs=kwargs)

    real = {name: getattr(su, name) for name in ("_state_update", "_step")}
    for name, kernel in real.items():
        setattr(su, name, Capture(kernel))
    try:
        call()
    finally:
        for name, kernel in real.items():
            setattr(su, name, kernel)
    return got["kernel"], got["args"], got["kwargs"]


def test_int32_words_reads_int64_in_place():
    """An int64 index tensor is read in place as its low int32 words (the same storage, 2 words an entry); int32 as it
    is; a strided int64 view, which has no such words at a fixed stride, and other dtypes are copied to int32."""
    import torch

    from ssmq.kernels._common import int32_words

    lens = torch.tensor([1, 300, 2**31 - 1, -1])
    words, lw = int32_words(lens)
    assert lw == 2 and words.dtype == torch.int32 and words.data_ptr() == lens.data_ptr()
    assert words[::lw].tolist() == lens.tolist()
    short = lens.int()
    assert int32_words(short) == (short, 1)
    strided = torch.tensor([[5, 0], [7, 0]])[:, 0]
    words, lw = int32_words(strided)
    assert lw == 1 and words.dtype == torch.int32 and words.tolist() == [5, 7]
    assert int32_words(None) == (None, 1)


@pytest.mark.parametrize("state", ["fp16", "int8", "int8rows"])
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
    # 4 rows: enough programs that the tile heuristic keeps its large-batch tiles; the plain step at 128 rows: several
    # tiles a program (``_step``)
    b, h, p, n = (4 if replay else 128), 80, 64, 128
    int8 = state != "fp16"
    x, B, C = torch.randn(b, h, p), torch.randn(b, 1, n), torch.randn(b, 1, n)
    dt = torch.randn(b, h)[:, :, None].expand(b, h, p)
    A = (-torch.rand(h))[:, None, None].expand(h, p, n)
    per_head = torch.randn(h)[:, None].expand(h, p)
    if int8:
        st, table, index = torch.zeros(b, h, p, n, dtype=torch.int8), torch.rand(16, n), torch.randint(0, 16, (h * p,))
        inputs = [x.to(torch.int8), torch.rand(h, p), dt, A, B.to(torch.int8), torch.rand(1, n), C.to(torch.int8),
                  torch.rand(1, n)]
    if state == "int8rows":
        from ssmq.ops.quant_ssm import RowScales

        table, index = RowScales(torch.rand(b, h, p)), None
    if not int8:
        st, table, index = torch.zeros(b, h, p, n, dtype=torch.float16), None, None
        inputs = [x.half(), None, dt[:, :, :1].half().expand(b, h, p), A, B.half(), None, C.half(), None]
    kw = dict(D=per_head, dt_bias=per_head, dt_softplus=True, state_batch_indices=torch.arange(b, dtype=torch.int32))
    if replay:
        ring = StateRing.allocate(b, 16, h, p, 1, n, per_head_dt=True, device="cpu")
        kernel, args, kwargs = _launch_args(su, lambda: su.replay_state_update(st, table, index, ring, *inputs, **kw))
    else:
        kernel, args, kwargs = _launch_args(su, lambda: su.quant_state_update(st, table, index, *inputs, **kw))
    assert (kernel is su._state_update) == replay  # the plain Mamba-2 step: ``_step``
    kwargs.update(FAST_RCP=su.CFG["fast_rcp"], PTX_CODES=su.CFG["ptx_codes"])  # as launched on CUDA tensors
    options = {k: kwargs.pop(k) for k in ("num_warps", "maxnreg") if k in kwargs}
    values = {**dict(zip(kernel.arg_names, args)), **kwargs}
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        v = values[param.name] if param.name in values else param.default
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
    # the fp16 checkpoint streamed through shared memory (the int8 one is read unchunked: CFG["replay_int8"])
    assert not (replay and not int8) or "cp.async" in compiled.asm["ptx"]
    # the int8 state's codes by bit assembly, not conversions: the unpacking xor and the packing prmt
    assert not int8 or ("0x80808080" in compiled.asm["ptx"] and "0x5410" in compiled.asm["ptx"])


def _compile_sm90(kernel, pointers: dict, const: dict, floats=(), num_warps=4, num_stages=3, aligned=()):
    """``ssmq.kernels.build.compile_sm90`` (the cubin asserted), skipped where kernels are interpreted or there is no
    ptxas."""
    from ssmq.kernels.build import compile_sm90

    if not hasattr(kernel, "arg_names"):
        pytest.skip("kernels are interpreted in this session (SSMQ_TRITON_INTERPRET=1)")
    try:
        compiled = compile_sm90(kernel, pointers, const, floats, num_warps, num_stages, aligned)
    except (FileNotFoundError, RuntimeError) as e:
        if "ptxas" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise
    assert compiled.asm.get("cubin")
    return compiled


# SSDi8 (ssmq.kernels.ssdi8): each kernel with its constexpr variants, the tiles at the smallest and the tuned sizes
# (int8 tl.dot needs K >= 32 and M, N >= 16 on sm_90: the first H100 run refused a K = 16 tile)
_SCAN = dict(LUT_IN=False, DIAG=True, FACTORED=True, HAS_D=True, HAS_Z=True, DOT_PREC="tf32", F16MMA=True, BM=64,
             BP=64, BK=128, BS=64)
_SMALL = dict(BM=16, BP=16, BK=32, BS=16)
SSDI8 = {
    "chunk_state-quant_x": ("_chunk_state_q", {"x_ptr": "fp16"}, dict(QUANT_X=True, F16MMA=True, BT=128, BP=64, BN=128)),
    "chunk_state-quant_x-fp32-small": ("_chunk_state_q", {"x_ptr": "fp32"}, dict(QUANT_X=True, F16MMA=False, BT=32, BP=16, BN=16)),
    "chunk_state-codes-small": ("_chunk_state_q", {}, dict(QUANT_X=False, F16MMA=True, BT=32, BP=16, BN=16)),
    "state_passing-cs": ("_state_passing_q", {"decay_ptr": "fp32"},
                         dict(HAS_INIT=True, DECAY_CS=True, BLOCK=1024, SHIFT=7)),
    "state_passing-codes": ("_state_passing_q", {}, dict(HAS_INIT=False, DECAY_CS=False, BLOCK=256, SHIFT=7)),
    "chunk_bmm-causal": ("_chunk_bmm_q", {"out_ptr": "fp32"}, dict(CAUSAL=True, F16MMA=True, BM=64, BS=64, BK=128)),
    "chunk_bmm-causal-i8mma": ("_chunk_bmm_q", {"out_ptr": "i32"},
                               dict(CAUSAL=True, F16MMA=False, BM=64, BS=64, BK=128)),
    "chunk_bmm-small": ("_chunk_bmm_q", {"out_ptr": "i32"}, dict(CAUSAL=False, F16MMA=True, BM=16, BS=16, BK=32)),
    "chunk_scan-fp16-Dz": ("_chunk_scan_q", {"x_ptr": "fp16", "z_ptr": "fp16", "y_ptr": "fp16"}, _SCAN),
    "chunk_scan-bf16-n64-direct": ("_chunk_scan_q", {"x_ptr": "bf16", "z_ptr": "bf16", "y_ptr": "bf16"},
                                   {**_SCAN, "FACTORED": False, "BK": 64}),
    "chunk_scan-fp32": ("_chunk_scan_q", {"x_ptr": "fp32", "z_ptr": "fp32"}, {**_SCAN, "DOT_PREC": "ieee"}),
    "chunk_scan-fp16-i8mma": ("_chunk_scan_q", {"x_ptr": "fp16", "z_ptr": "fp16", "y_ptr": "fp16", "cb_ptr": "i32"},
                              {**_SCAN, "F16MMA": False}),
    "chunk_scan-fp32-small": ("_chunk_scan_q", {"x_ptr": "fp32", "z_ptr": "fp32"},
                              {**_SCAN, **_SMALL, "HAS_D": False, "HAS_Z": False, "DOT_PREC": "ieee"}),
    "chunk_scan-off-small": ("_chunk_scan_q", {"x_ptr": "fp32", "z_ptr": "fp32"},
                             {**_SCAN, **_SMALL, "LUT_IN": True, "DIAG": False, "FACTORED": False, "HAS_D": False,
                              "HAS_Z": False, "DOT_PREC": "ieee"}),
}
SSDI8_POINTERS = {"x_ptr": "i8", "B_ptr": "i8", "C_ptr": "i8", "S_ptr": "i8", "dt_ptr": "fp32", "cs_ptr": "fp32",
                  "xsc_ptr": "fp32", "mult_ptr": "fp32", "out_ptr": "i8", "chunk_ptr": "i8", "decay_ptr": "i32",
                  "init_ptr": "i8", "enter_ptr": "i8", "final_ptr": "i8", "lut_ptr": "fp32", "Cs_ptr": "fp32",
                  "Bs_ptr": "fp32", "ss_ptr": "fp32", "cb_ptr": "fp32", "D_ptr": "fp32", "z_ptr": "fp16",
                  "y_ptr": "fp32"}


@pytest.mark.parametrize("variant", sorted(SSDI8))
def test_ssdi8_compiles_for_sm90(variant):
    from ssmq.kernels import ssdi8

    name, ptrs, const = SSDI8[variant]
    kernel = getattr(ssdi8, name)
    pointers = {a: t for a, t in {**SSDI8_POINTERS, **ptrs}.items() if a in getattr(kernel, "arg_names", ())}
    _compile_sm90(kernel, pointers, const)


# The float SSD kernels (ssmq.kernels.ssd) and their int8-input variants (QUANT: x, B, C codes dequantized at load,
# quant_ssd_chunk_scan), at the tuned tiles of CFG and Mamba2-2.7B's (p 64, n 128, chunk 256); TY the output and
# tensor-core operand dtype. (kernel, x / B / C and output dtypes, constexprs)
def _ssd_cases():
    import triton.language as tl

    tys = {"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32}
    cases = {}
    for q in (False, True):
        for ty in ("fp16", "bf16", "fp32"):
            if not q and ty == "bf16":
                continue
            code = "i8" if q else ty
            prec = "ieee" if ty == "fp32" else "tf32"
            io = {"x_ptr": code, "B_ptr": code, "C_ptr": code, "st_ptr": ty, "y_ptr": ty, "z_ptr": ty}
            tag = ("quant-" if q else "float-") + ty
            cases[f"chunk_cb-{tag}"] = ("_chunk_cb", io, dict(QUANT=q, DOT_PREC="ieee" if q else prec, BM=64, BN=64,
                                                                BK=64))
            cases[f"chunk_state-{tag}"] = ("_chunk_state", {**io, "st_ptr": "fp32"},
                                           dict(QUANT=q, TY=tys[ty], DOT_PREC=prec, BP=64, BN=64, BK=64))
            cases[f"chunk_state_fused-{tag}"] = ("_chunk_state_fused", io, dict(
                HAS_INIT=True, HAS_ROWS=False, QUANT=q, TY=tys[ty], DOT_PREC=prec, BP=64, BN=64, BK=64))
            cases[f"chunk_scan-{tag}"] = ("_chunk_scan", io, dict(HAS_D=True, HAS_Z=not q, QUANT=q, TY=tys[ty],
                                                                   DOT_PREC=prec, BM=64, BP=64, BK=64, BN=128))
    # a float16 cache state continued in its rows in place (state_rows)
    rows = {"x_ptr": "fp16", "B_ptr": "fp16", "st_ptr": "fp16", "init_ptr": "fp16", "final_ptr": "fp16"}
    cases["chunk_state_fused-rows-fp16"] = ("_chunk_state_fused", rows, dict(
        HAS_INIT=True, HAS_ROWS=True, QUANT=False, TY=tys["fp16"], DOT_PREC="tf32", BP=64, BN=64, BK=64))
    for has_rows in (False, True):
        io = {"st_ptr": "fp32", "out_ptr": "fp16"} | ({"init_ptr": "fp16", "final_ptr": "fp16"} if has_rows else {})
        cases[f"state_passing-{'rows' if has_rows else 'plain'}"] = ("_state_passing", io, dict(
            HAS_INIT=True, HAS_ROWS=has_rows, BLOCK=1024))
    return cases


SSD_POINTERS = {"xs_ptr": "fp32", "Bs_ptr": "fp32", "Cs_ptr": "fp32", "cb_ptr": "fp32", "dt_ptr": "fp32",
                "cs_ptr": "fp32", "init_ptr": "fp32", "final_ptr": "fp32", "D_ptr": "fp32", "rows_ptr": "i64"}
SSD = _ssd_cases()


@pytest.mark.parametrize("variant", sorted(SSD))
def test_ssd_compiles_for_sm90(variant):
    from ssmq.kernels import ssd

    name, io, const = SSD[variant]
    kernel = getattr(ssd, name)
    pointers = {a: t for a, t in {**SSD_POINTERS, **io}.items() if a in getattr(kernel, "arg_names", ())}
    _compile_sm90(kernel, pointers, const, num_stages=2)


# The Mamba-1 selective scan (ssmq.kernels.scan) and its int8-input variant (QUANT: u, Δ, z, B, C codes with scales,
# quant_selective_scan): (QUANT, SEG_STATE, GROUPED), at Mamba-1's n 16 and the CFG tile (BD 16, 1 warp).
SCAN = {f"{'quant' if q else 'float'}-{'seg' if seg else 'y'}{'-grouped' if grp else ''}": (q, seg, grp)
        for q in (False, True) for seg in (False, True) for grp in (False, True) if not (q and grp)}


@pytest.mark.parametrize("variant", sorted(SCAN))
def test_selective_scan_compiles_for_sm90(variant):
    from ssmq.kernels import scan

    q, seg, grp = SCAN[variant]
    code = "i8" if q else "fp16"
    pointers = {"u_ptr": code, "dl_ptr": code, "A_ptr": "fp32", "B_ptr": code, "C_ptr": code, "D_ptr": "fp32",
                "z_ptr": code, "dbias_ptr": "fp32", "init_ptr": "fp32", "y_ptr": "fp16", "last_ptr": "fp32",
                "hseg_ptr": "fp32", "dsum_ptr": "fp32", "us_ptr": "fp32", "ds_ptr": "fp32", "zs_ptr": "fp32",
                "Bs_ptr": "fp32", "Cs_ptr": "fp32"}
    const = dict(HAS_D=True, HAS_Z=True, HAS_DB=True, SOFTPLUS=True, HAS_INIT=True, GROUPED=grp, SEG_STATE=seg,
                 QUANT=q, BD=16, BN=16)
    _compile_sm90(scan._selective_scan, pointers, const, num_warps=1)


# kv_decode variants: (float KV, rotary dim, key / value outlier slots, sink tokens, per-token keys, code bits)
KV_VARIANTS = {
    "kvq4-rope": (False, 128, 0, 0, 1, False, 4),
    "kvq4-rope-1%": (False, 128, 20, 10, 1, False, 4),
    "kvq4-partial-rope-per-token": (False, 64, 2, 1, 0, True, 4),
    "kvq3-rope-1%": (False, 128, 20, 10, 1, False, 3),
    "kvq3-partial-rope-per-token": (False, 64, 2, 1, 0, True, 3),
    "kvq2-rope-1%": (False, 128, 20, 10, 1, False, 2),
    "fp16": (True, 0, 0, 0, 0, False, 8),
    "fp16-paged": (True, 0, 0, 0, 0, False, 8),  # block pools read through a block table (BS = 16)
}


@pytest.mark.parametrize("variant", sorted(KV_VARIANTS))
def test_kv_decode_compiles_for_sm90(variant):
    """The flash-decoding kernel over a quantized (or float) KV cache, bench_kvquant's shapes (32 q / 8 kv heads
    x 128), and its combine kernel, in the shipped CFG: cubins that fit an H100 SM's shared memory."""
    from ssmq.kernels import kv_decode as kd

    fl, r, ko, vo, sink, k_tok, bits = KV_VARIANTS[variant]
    code, scale = ("fp16", "fp16") if fl else ("u8", "fp16")
    pointers = {"q": "fp16", "slots": "i64", "lens": "i32", "inv_freq": "fp32", "out": "fp32", "ws": "fp32",
                "table": "i64", "kc": code, "kmid": scale if k_tok else "fp32", "khalf": scale if k_tok else "fp32", "klut": "fp32",
                "koi": "i16", "kov": "fp16", "ksink": "fp16", "vc": code, "vmid": scale, "vhalf": scale,
                "vlut": "fp32", "voi": "i16", "vov": "fp16", "vsink": "fp16"}
    block_t = kd.CFG["BLOCK_T_OUTLIERS"] if ko or vo else kd.CFG["BLOCK_T"]
    const = dict(GROUP=4, GP=16, E=128, R=r, HP=max(16, r // 2), PP=max(16, 128 - r), S=sink, SP=16, FLOAT=fl,
                 K_PER_TOKEN=k_tok, V_PER_TOKEN=not fl, KSLOTS=ko, KP=triton.next_power_of_2(max(ko, 1)), VSLOTS=vo,
                 BLOCK_T=block_t, ONE_SPLIT=False, FAST=True, DOT=kd.CFG["dot"], KBITS=bits, VBITS=bits,
                 KLEVELS=2 ** min(bits, 4), VLEVELS=2 ** min(bits, 4), BS=16 if variant.endswith("paged") else 0)
    compiled = _compile_sm90(kd._decode_kernel, pointers, const, floats=("scale",), num_warps=kd.CFG["num_warps"],
                             num_stages=kd.CFG["num_stages"])
    assert compiled.metadata.shared <= 227 * 1024, "more shared memory than an H100 SM has"
    _compile_sm90(kd._combine_kernel, {"ws": "fp32", "out": "fp32"}, dict(E=128, PS=128, HB=4, EB=16, PC=32))


@pytest.mark.parametrize("use_gdc", [False, True])
def test_pdl_wait_compiles_into_decode_kernels(use_gdc):
    """With USE_GDC the decode-path kernels start with griddepcontrol.wait (the PDL contract: no load before the
    previous kernel's writes are visible) and release their dependents; without it the PTX has neither."""
    from ssmq.kernels import norm

    c = _compile_sm90(norm._rms_norm, {"x_ptr": "fp16", "res_ptr": "fp16", "w_ptr": "fp16", "out_ptr": "fp16",
                                       "res_out_ptr": "fp16", "q_ptr": "i8", "scale_ptr": "fp32"},
                      {"HAS_RES": True, "QUANT": False, "STATIC": False, "BLOCK": 2048, "USE_GDC": use_gdc},
                      floats=("eps",))
    ptx = c.asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == use_gdc and ("griddepcontrol.launch_dependents" in ptx) == use_gdc
    if use_gdc:
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("dot", [False, True])
def test_float_gemv_requests_only_its_first_weight_tile_before_the_pdl_wait(dot, early):
    """gemv._gemv under PDL: with EARLY the first weight tile is loaded before griddepcontrol.wait (x after it);
    without, nothing is; the first tile's loads stay 16 bytes wide (EVEN_K: no K mask)."""
    from ssmq.kernels import gemv

    const = dict(HAS_BIAS=False, DOT=dot, PRECISION="ieee", EVEN_K=True, BLOCK_M=16 if dot else 1,
                 BLOCK_N=32 if dot else 2, BLOCK_K=128 if dot else 1024, USE_GDC=True, EARLY=early)
    ptx = _compile_sm90(gemv._gemv, {"x_ptr": "fp16", "w_ptr": "fp16", "b_ptr": "fp16", "out_ptr": "fp16"}, const,
                        num_warps=4 if dot else 2, num_stages=1,
                        aligned=("x_ptr", "w_ptr", "out_ptr", "s_xm", "s_wn", "k_split")).asm["ptx"]
    before = ptx[:ptx.index("griddepcontrol.wait")]
    assert ("ld.global" in before) == early
    assert before.count("ld.global") == before.count("ld.global.v4"), "the early weight loads were split"
    assert ptx.count("ld.global") == ptx.count("ld.global.v4"), "a weight or x load was split"


# the word-load decode GEMV of quant_gemm (W4A16 g128 / W8A16 / W8A8 / W4A8 at 1-4 rows; see its CFG)
WORD_VARIANTS = {  # name: (x, A_MODE, W4, WS_MODE, HAS_ZERO, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    "w4a16-g128-split": ("fp16", 0, True, 2, False, True, 1, 256, 128),
    "w4a16-g128-asym-rows4": ("fp16", 0, True, 2, True, True, 4, 64, 128),
    "w8a16-bf16-channel-rows2": ("bf16", 0, False, 1, False, True, 2, 128, 64),
    "w8a16-fp32-channel-zero": ("fp32", 0, False, 1, True, False, 1, 256, 64),
    "w8a8-channel-split": ("i32", 1, False, 1, False, True, 1, 256, 64),
    "w4a8-g128-rows4": ("i32", 1, True, 2, False, False, 4, 64, 128),
    "w4a8-g128-split": ("i32", 1, True, 2, False, True, 1, 128, 128),  # GROUP_PARTS: groups added in order
    "w4a16-g128-prefetch": ("fp16", 0, True, 2, False, True, 1, 256, 128),
    "fp8-a16-channel-rows2": ("fp16", 0, False, 1, False, True, 2, 128, 64),  # fp8 weights: the e4m3 conversion
    "fp8-a8-channel-split": ("i32", 2, False, 1, False, True, 1, 128, 64),
}


@pytest.mark.parametrize("variant", sorted(WORD_VARIANTS))
def test_word_gemv_compiles_for_sm90(variant):
    """_qgemv_words with its inline PTX (dp4a, prmt) and the in-kernel K-split reduction (acq_rel counter): float x
    converts codes by bit assembly, so no int -> float conversion instruction is left; int8 x runs on dp4a."""
    from ssmq.kernels import quant_gemm as qg

    x, a_mode, w4, ws_mode, zero, split, bm, bn, bk = WORD_VARIANTS[variant]
    x16 = x in ("fp16", "bf16")
    pointers = {"x_ptr": "i32" if x16 else x, "xs_ptr": "fp32", "w_ptr": "i32", "ws_ptr": "fp32", "wz_ptr": "i32",
                "b_ptr": "fp16", "out_ptr": "fp16", "part_ptr": "i32" if a_mode == 1 and ws_mode != 2 else "fp32",
                "cnt_ptr": "i32"}
    const = dict(A_MODE=a_mode, XS_ROWS=True, W4=w4, WS_MODE=ws_mode, HAS_ZERO=zero, HAS_BIAS=True, GROUP=bk,
                 EVEN_K=True, SPLIT=split, X16=x16, XBF16=x == "bf16", PTX=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                 PREFETCH=variant.endswith("prefetch"), NSP=16 if split else 1, USE_GDC=True,
                 GROUP_PARTS=split and a_mode == 1 and ws_mode == 2, W_FP8=variant.startswith("fp8"))
    ptx = _compile_sm90(qg._qgemv_words, pointers, const, num_warps=qg.CFG["warps_w"],
                        num_stages=qg.CFG["stages_w"]).asm["ptx"]
    if variant.startswith("fp8"):  # e4m3 codes (and e4m3 x) widened by the hardware conversion, two at a time
        assert "e4m3x2" in ptx and "cvt.rn.f32.s" not in ptx
    elif a_mode == 0:  # (zero points, one a column and group, are converted: far fewer than a step's codes)
        assert ptx.count("cvt.rn.f32.s") < (bn * bk // (32 * qg.CFG["warps_w"]) if zero else 1)
    else:
        assert "dp4a.s32.s32" in ptx
    assert ("atom.global.gpu.acq_rel.add" in ptx) == split
    # PDL: only the weight's first tile (PREFETCH) is requested before waiting on the kernel before
    wait = ptx.index("griddepcontrol.wait")
    assert ("ld.global" in ptx[:wait]) == variant.endswith("prefetch")


@pytest.mark.parametrize("w4", [True, False])
def test_qmm_split_in_kernel_compiles_for_sm90(w4):
    """The tensor-core decode kernel (rows 5-16) with its K split summed by its own last program (SPLIT_IN)."""
    from ssmq.kernels import quant_gemm as qg

    pointers = {"x_ptr": "fp16", "xs_ptr": "fp32", "w_ptr": "u8" if w4 else "i8", "ws_ptr": "fp32", "wz_ptr": "i32",
                "b_ptr": "fp16", "out_ptr": "fp32", "fin_ptr": "fp16", "cnt_ptr": "i32"}
    const = dict(A_MODE=0, XS_ROWS=False, W4=w4, W_FP8=False, WS_MODE=2 if w4 else 1, HAS_ZERO=w4, HAS_BIAS=False,
                 GROUP=128 if w4 else 1, EVEN_K=True, DEQ_W=False, PRECISION="tf32", BLOCK_M=16,
                 BLOCK_N=qg.CFG["BN_DEC"], BLOCK_K=qg.CFG["BK_DEC"], FAST_CVT=not w4, QUANT_X=0, QMAX=127.0, EPS_=1e-8,
                 X_STRIDED=False, SPLIT_IN=True, FIN_BIAS=True, NSP=8, USE_GDC=True)
    ptx = _compile_sm90(qg._qmm, pointers, const, num_warps=qg.CFG["warps_dec"],
                        num_stages=qg.CFG["stages_dec"]).asm["ptx"]
    assert "atom.global.gpu.acq_rel.add" in ptx


@pytest.mark.parametrize("mode", ["dynamic", "static", "given_rows"])
@pytest.mark.parametrize("fp8", [False, True])
def test_quantize_rows_compiles_for_sm90(mode, fp8):
    """The activation quantizer, with a scale of its own, one given, or one given a row (the tensor-parallel
    max over ranks): not yet run on a GPU with given rows (the interpreter checks int8's codes)."""
    from ssmq.kernels import quant_gemm as qg

    pointers = {"x_ptr": "fp16", "s_ptr": "fp32", "q_ptr": "fp8e4nv" if fp8 else "i8", "xs_ptr": "fp32"}
    const = dict(QMAX=448.0 if fp8 else 127.0, EPS_=1e-8, STATIC=mode != "dynamic", ROW_SCALE=mode == "given_rows",
                 FP8=fp8, BLOCK=4096)
    ptx = _compile_sm90(qg._quantize_rows, pointers, const, num_warps=4).asm["ptx"]
    assert "div.rn.f32" in ptx  # IEEE division, as the reference


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("read", [False, True])
def test_state_io_compiles_for_sm90(rows, read):
    """The prefill's int8 state read / write (``ssmq.kernels.state_io``), row scales or a table with an index."""
    from ssmq.kernels import state_io

    pointers = {"f_ptr": "fp32", "q_ptr": "i8", "rs_ptr": "fp32", "ss_ptr": "fp32", "sidx_ptr": "i64", "idx_ptr": "i32"}
    _compile_sm90(state_io._state_io, pointers, dict(READ=read, ROWS=rows, HAS_SIDX=not rows, BR=32, BN=128))


@pytest.mark.parametrize("e,r,bits,slots,bs", [(128, 128, 4, 0, 0), (128, 64, 3, 0, 0), (64, 64, 2, 0, 0),
                                               (64, 0, 4, 0, 0), (64, 32, 3, 0, 0), (32, 16, 2, 0, 0), (64, 32, 3, 2, 0),
                                               (128, 128, 4, 10, 0), (128, 128, 4, 10, 16), (64, 32, 3, 0, 16)])
def test_fast_kv_decode_compiles_for_sm90(e, r, bits, slots, bs):
    """kv_decode_fast (PRMT codebook lookups, fp16 tensor-core products), its constexprs as the launcher builds them:
    the formats without outliers and with them (slots: key and value slots), over rows or block pools (bs: tokens a
    block, the serve cache)."""
    from ssmq.kernels import kv_decode_fast as kf

    pointers = kf.pointer_types()
    flags = dict(FLOAT=False, K_PER_TOKEN=False, V_PER_TOKEN=True, KSLOTS=slots, VSLOTS=slots, KBITS=bits,
                 VBITS=bits, KLEVELS=2 ** bits, VLEVELS=2 ** bits)
    const = dict(kf.constexprs(4, e, r, 1, flags, kf.CFG["BLOCK_T_OUTLIERS" if slots else "BLOCK_T"], False), BS=bs)
    cfg = kf.CFG
    compiled = _compile_sm90(kf._decode_kernel, pointers, const, floats=("scale",), num_warps=cfg["num_warps"],
                             num_stages=cfg["num_stages"])
    assert compiled.metadata.shared <= 227 * 1024, "more shared memory than an H100 SM has"
    # the scores' store for the value outliers' pass: from the registers the products left them in (``_store_as_is``)
    assert ("@p st.global.b32" in compiled.asm["ptx"]) == bool(slots)
    # per-channel key scales folded into the rotation (``_fold_tables``), or applied to pass-through channels: float16
    # multiply-adds on pairs
    assert "fma.rn.f16x2" in compiled.asm["ptx"]
    if slots:  # the outliers' own passes: key score terms before the decode, value terms before the combine
        side = dict(E=e, S=1, N=cfg["SPARSE_SLOTS"], GROUP=4, GP2=4, BS=bs)
        tp = 1 << (cfg["SPARSE_SLOTS"] // slots - 1).bit_length()  # tokens an iteration, to a power of two
        for kernel, const in ((kf._key_outlier_kernel, dict(side, HKVP=4, R=r, PER_TOKEN=False, KSLOTS=slots, TP=tp,
                                                             LEVELS=2 ** bits, FAST=True)),
                              (kf._value_outlier_kernel, dict(side, PER_TOKEN=True, VSLOTS=slots, w_h=1,
                                                              BLOCK_T=cfg["BLOCK_T_OUTLIERS"], LEVELS=2 ** bits))):
            own = {a: t for a, t in pointers.items() if a in kernel.arg_names}
            aligned = [*own, *(a for a in ("c_b", "c_k", "w_b", "w_p", "w_e") if a in kernel.arg_names)]
            ptx = _compile_sm90(kernel, own, const, floats=("scale",) if "scale" in kernel.arg_names else (),
                                aligned=aligned).asm["ptx"]
            # a slot's 4 query heads are contiguous in sc and ws (heads innermost): one vector atomic a slot (PTX
            # ``red`` or ``atom``, as the Triton version emits it), never four scalar ones
            vector = re.search(r"\b(red|atom)\.global\.gpu\.relaxed\.add\.v4\.f32", ptx)
            assert vector and not re.search(r"\b(red|atom)\.global\.gpu\.relaxed\.add\.f32", ptx)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fast_float_kv_decode_compiles_for_sm90(dtype):
    """kv_decode_fast over a float16 / bfloat16 cache (the models' float KV decode): tensor-core products in the
    cache's dtype (bf16 MMAs for a bfloat16 cache, not a float16 round trip)."""
    from ssmq.kernels import kv_decode_fast as kf

    pointers = kf.pointer_types(dtype)
    flags = dict(FLOAT=True, K_PER_TOKEN=False, V_PER_TOKEN=False, KSLOTS=0, VSLOTS=0, KBITS=8, VBITS=8, KLEVELS=1,
                 VLEVELS=1)
    const = dict(kf.constexprs(4, 128, 0, 0, flags, kf.CFG["BLOCK_T"], False), BS=0)
    ptx = _compile_sm90(kf._decode_kernel, pointers, const, floats=("scale",), num_warps=kf.CFG["num_warps"],
                        num_stages=kf.CFG["num_stages"]).asm["ptx"]
    mmas = set(re.findall(r"mma\.sync[\w.]*", ptx))
    ty = {"fp16": "f16", "bf16": "bf16"}[dtype]  # PTX's names
    assert mmas == {f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32"}


@pytest.mark.parametrize("bits,per_token,k,e", [(4, False, 20, 128), (4, True, 10, 128), (3, False, 20, 128),
                                                 (2, True, 10, 64), (3, True, 0, 64)])
def test_kv_append_compiles_for_sm90(bits, per_token, k, e):
    """The fused quantize-and-append (one program a token) as launched for a 8 x e cache side."""
    from ssmq.kernels import kv_append

    pointers = {"x": "fp16", "slots": "i64", "positions": "i64", "table": "i64", "codes": "u8", "mid": "fp16",
                "half": "fp16", "oidx": "i16", "oval": "fp16", "sink": "fp16", "book": "fp32", "lo": "fp32",
                "hi": "fp32"}
    const = dict(HKV=8, E=e, HP=8, EP=e, NB=e * bits // 8, LEVELS=2 ** bits, BITS=bits, K=k,
                 KP=max(2, triton.next_power_of_2(k)), PER_TOKEN=per_token, SYMMETRIC=False, S=1,
                 BS=16 if per_token else 0)  # the per-token cases into block pools (the serve cache)
    _compile_sm90(kv_append._append_kernel, pointers, const, num_warps=kv_append.NUM_WARPS)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("e", [64, 128])
def test_prefill_kernels_compile_for_sm90(dtype, e):
    """The prefill's attention kernel (``attention_prefill``: GQA groups of 4, e = 64 / 128) and the quantized
    cache's read (``kv_read`` and its outlier pass: paged, full RoPE, 20 outlier slots, 3- and 4-bit codes) compile
    for the H100 / H200."""
    pytest.importorskip("triton")
    from ssmq.kernels import attention_prefill as ap
    from ssmq.kernels import kv_read as kr

    io = {"q": dtype, "k": dtype, "v": dtype, "out": dtype, "lens": "i64", "slots": "i64", "table": "i64"}
    cfg = ap.CFG
    for bs in (0, 32):  # rows or cache slots; block pools
        _compile_sm90(ap._prefill_kernel, io, dict(GROUP=4, E=e, EP=e, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                                   BS=bs), floats=("scale",), num_warps=cfg["WARPS"],
                      num_stages=cfg["STAGES"])
    ptrs = {"out": dtype, "codes": "u8", "mid": "fp16", "half": "fp16", "lut": "fp32", "oidx": "i16", "oval": "fp16",
            "sink": "fp16", "slots": "i64", "lens": "i64", "table": "i64", "inv_freq": "fp32"}
    for bits in (3, 4):
        _compile_sm90(kr._read_kernel, ptrs, dict(E=e, R=e, HP=e // 2, PP=16, S=1, PER_TOKEN=False, BITS=bits,
                                                   BT=kr.CFG["BT"], BS=32, FAST=True, HAS_LENS=True),
                      num_warps=kr.CFG["WARPS"])
        no_sink = {a: t for a, t in ptrs.items() if a != "sink"}  # the outlier pass leaves the sink tokens alone
        _compile_sm90(kr._outlier_kernel, no_sink, dict(E=e, R=e, S=1, PER_TOKEN=False, SLOTS=20, P=32, BITS=bits,
                                                         BT=kr.CFG["BT_OUTLIERS"], BS=32, FAST=True, HAS_LENS=True),
                      num_warps=kr.CFG["OUTLIER_WARPS"])


def test_folded_scales_shorten_the_quantized_decode_loop(monkeypatch):
    """``sass_kv_decode.py``'s builds: with the per-channel scales folded into the rotation (FOLD) the 4-bit
    decode's loop takes paired float16 multiply-adds instead of float32 arithmetic and conversions, fewer
    instructions and fewer registers (what lets the register cap add programs an SM without many spills)."""
    from ssmq.kernels import kv_decode_fast as kf
    from ssmq.kernels.build import main_loop, registers

    if not hasattr(kf._decode_kernel, "arg_names"):
        pytest.skip("kernels are interpreted in this session (SSMQ_TRITON_INTERPRET=1)")
    import sass_kv_decode

    try:
        plain, folded = (sass_kv_decode.build(4, fold, None) for fold in (False, True))
        loops = main_loop(plain), main_loop(folded)
    except (FileNotFoundError, RuntimeError) as e:  # no ptxas / cuobjdump in this Triton
        pytest.skip(f"no NVIDIA tools: {e}")
    assert loops[0]["HFMA2"] == 0 < loops[1]["HFMA2"]
    assert loops[1]["HADD2"] + loops[1]["F2FP"] < loops[0]["HADD2"] + loops[0]["F2FP"]  # float16 <-> float32
    assert sum(loops[1].values()) < 0.9 * sum(loops[0].values())
    assert registers(folded)[0] < registers(plain)[0]


# The low-bit decode GEMV (ssmq.kernels.qgemv): each path and code type at the shipped tiles, for the launch's
# 16-byte-aligned pointers and row strides; the code words must load 16 bytes at a time (LDG.E.128)
QGEMV = {  # name: (kernel, pointers, constexprs)
    "fma-w4g128-1row": ("_qgemv_fma", {"x_ptr": "i32", "w_ptr": "i32"},
                        dict(A_MODE=0, W4=True, W_FP8=False, WS_MODE=2, BLOCK_M=1, NG=2, GW=16, XBF16=False)),
    "fma-w4g128-2rows-bf16": ("_qgemv_fma", {"x_ptr": "i32", "w_ptr": "i32"},
                              dict(A_MODE=0, W4=True, W_FP8=False, WS_MODE=2, BLOCK_M=2, NG=2, GW=16, XBF16=True)),
    "fma-w8-4rows": ("_qgemv_fma", {"x_ptr": "i32", "w_ptr": "i32"},
                     dict(A_MODE=0, W4=False, W_FP8=False, WS_MODE=1, BLOCK_M=4, NG=1, GW=64, XBF16=False)),
    "fma-fp8-fp8x": ("_qgemv_fma", {"x_ptr": "i32", "w_ptr": "i32"},
                     dict(A_MODE=2, W4=False, W_FP8=True, WS_MODE=1, BLOCK_M=1, NG=1, GW=64, XBF16=False)),
    "dot-w4g128": ("_qgemv_dot", {"x_ptr": "fp16", "w_ptr": "u8"},
                   dict(A_MODE=0, W4=True, W_FP8=False, WS_MODE=2, BLOCK_M=16, NG=1, GB=64, PTX=True)),
    "dot-w8-bf16": ("_qgemv_dot", {"x_ptr": "bf16", "w_ptr": "i8"},
                    dict(A_MODE=0, W4=False, W_FP8=False, WS_MODE=0, BLOCK_M=16, NG=1, GB=128, PTX=True)),
    "dot-fp8-fp8x": ("_qgemv_dot", {"x_ptr": "i8", "w_ptr": "i8"},
                     dict(A_MODE=2, W4=False, W_FP8=True, WS_MODE=1, BLOCK_M=16, NG=1, GB=128, PTX=True)),
}


@pytest.mark.parametrize("variant", sorted(QGEMV))
def test_qgemv_compiles_for_sm90(variant):
    from ssmq.kernels import build, qgemv

    name, ptrs, const = QGEMV[variant]
    pointers = {"xs_ptr": "fp32", "ws_ptr": "fp32", "b_ptr": "fp16", "out_ptr": "fp16", "part_ptr": "fp32",
                "cnt_ptr": "i32", **ptrs}
    early = name == "_qgemv_fma" and const["W_FP8"]  # EARLY_TILE's code types: fp8
    const = dict(const, XS_ROWS=True, HAS_BIAS=True, SPLIT=True, NSP=8, BLOCK_N=64, USE_GDC=True,
                 **({"EARLY": early} if name == "_qgemv_fma" else {}))
    aligned = ("x_ptr", "w_ptr", "out_ptr", "part_ptr", "s_xm", "s_wn")
    compiled = _compile_sm90(getattr(qgemv, name), pointers, const, aligned=aligned)
    assert "LDG.E.128" in build._cuobjdump(compiled, "-sass")
    # PDL: with EARLY the FMA path requests its first weight tile (codes and scales) before waiting on the kernel
    # before; otherwise nothing is loaded before the wait
    ptx = compiled.asm["ptx"]
    assert ("ld.global" in ptx[:ptx.index("griddepcontrol.wait")]) == early


# the grouped MoE's weight formats: (W_MODE, weight pointer type, A_FP8)
MOE_FORMATS = {"float": (0, None, False), "int8": (1, "i8", False), "int4": (2, "u8", False), "fp8": (3, "i8", False),
               "fp8-w8a8": (3, "i8", True)}


@pytest.mark.parametrize("fmt", sorted(MOE_FORMATS))
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("gated", [True, False])
def test_moe_kernels_compile_for_sm90(fmt, dtype, gated):
    """The grouped-GEMM MoE (``kernels.moe``): [gate | up] + activation and down × routing weight at every launch
    setting of its table (``configs/moe.json``) for Granite-4.0-H-Tiny's experts (d 1536, f 512, int4 in groups of
    128), with PDL's wait, in every weight format (codes converted in registers, or e4m3 products on e4m3 activation
    codes); the untimed settings spill no registers."""
    import torch

    from ssmq.kernels import build, moe

    mode, w, fp8 = MOE_FORMATS[fmt]
    w = w or dtype
    tables = {"order_ptr": "i64", "be_ptr": "i32", "bs_ptr": "i32", "bend_ptr": "i32"}
    prec = "ieee" if dtype == "fp32" else "tf32"
    x_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    groups = 12 if mode == 2 else 1
    for entry in moe.CFG[moe._key(x_dtype, mode, fp8)]:
        up = moe.launch_consts(entry["up"], x_dtype, True, mode, fp8, groups, 128 if mode == 2 else 64, 512)
        dn = moe.launch_consts(entry["down"], x_dtype, True, mode, fp8, groups // 3 or 1, 128 if mode == 2 else 64,
                               1536)
        compiled = []
        for kernel, ptrs, c, extra in (
                (moe._moe_up, {"x_ptr": dtype, "xq_ptr": "i8", "xs_ptr": "fp32", "wg_ptr": w, "wu_ptr": w,
                               "sg_ptr": "fp32", "su_ptr": "fp32", "h_ptr": dtype}, up, dict(GATED=gated)),
                (moe._moe_down, {"h_ptr": dtype, "hq_ptr": "i8", "hs_ptr": "fp32", "wd_ptr": w, "sd_ptr": "fp32",
                                 "rw_ptr": "fp32", "y_ptr": "fp32"}, dn, {})):
            const = {k: v for k, v in c.items() if k not in ("num_warps", "num_stages")}
            compiled.append(_compile_sm90(kernel, {**ptrs, **tables},
                                          dict(W_MODE=mode, A_FP8=fp8, PRECISION=prec, BLOCK_M=entry["BM"],
                                               USE_GDC=True, **const, **extra),
                                          num_warps=c["num_warps"], num_stages=c["num_stages"]))
        if fmt != "float" and not (up["CVT"] or dn["CVT"]):  # settings chosen from register use, not timed: the
            # converted tiles stay in registers (timed settings are kept for their GPU time, spills or not)
            assert all(build.registers(k)[1] == 0 for k in compiled), entry


@pytest.mark.parametrize("before", [False, True])
def test_sharded_gated_norm_kernels_compile_for_sm90(before):
    """A tensor-parallel rank's gated norm around its group's all-reduce (``kernels.norm_sharded``), the gate first or
    the norm first (Falcon-H1)."""
    from ssmq.kernels import norm_sharded as ns

    io = {"x_ptr": "bf16", "z_ptr": "bf16", "w_ptr": "bf16", "out_ptr": "bf16", "ss_ptr": "fp32"}
    _compile_sm90(ns._gated_partial, io, dict(WITH_OUT=True, BLOCK=2048, BLOCK_K=2, NORM_BEFORE_GATE=before,
                                              USE_GDC=True))
    _compile_sm90(ns._gated_reduced, io, dict(BLOCK=2048, NORM_BEFORE_GATE=before, USE_GDC=True), floats=("eps",))


# The prefill conv (ssmq.kernels.conv1d._conv1d_fwd): float out, int8 codes out (Quamba's fused conv), and the codes'
# values (fake_quant: the x, B, C taps applied in the conv), with an initial state
@pytest.mark.parametrize("out,quant,deq", [("fp16", False, False), ("i8", True, False), ("fp16", True, True)])
def test_prefill_conv_compiles_for_sm90(out, quant, deq):
    from ssmq.kernels.conv1d import _conv1d_fwd as kernel

    pointers = {"x_ptr": "fp16", "w_ptr": "fp16", "bias_ptr": "fp16", "init_ptr": "fp16", "out_ptr": out,
                "qs_ptr": "fp32", "ws_ptr": "fp32", "as_ptr": "fp32", "bs_ptr": "fp32"}
    _compile_sm90(kernel, pointers, dict(W=4, HAS_BIAS=True, HAS_INIT=True, SILU=True, QUANT=quant, BD=16, BL=128,
                                         INT8=False, INT8_BIAS=False, DEQ=deq))
