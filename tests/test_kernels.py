"""Triton kernels equal their ``ssmq.ops`` references (relative error ‖out − ref‖ / ‖ref‖).

All tests are ``gpu``: they skip without CUDA. ``SSMQ_TRITON_INTERPRET=1`` runs a
smaller sweep on CPU tensors through Triton's interpreter instead.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

from ssmq import ops

INTERPRET = os.environ.get("SSMQ_TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, so before their import
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter computes through numpy, which has no bfloat16
DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.gpu


def kernel_module(name: str):
    """``ssmq.kernels.<name>`` for a module fixture of the kernel tests: imported there so that collection needs no
    triton (skipped without it), with the interpreter patched when it runs the kernels."""
    pytest.importorskip("triton")
    if INTERPRET:
        _patch_interpreter_scalars()
    return importlib.import_module(name if "." in name else f"ssmq.kernels.{name}")


@pytest.fixture(scope="module")
def K():
    return {m: kernel_module(m) for m in ("conv1d", "state_update", "ssd", "scan", "norm", "gemv")} | {
        "mamba2_decode": kernel_module("ssmq.prototype.mamba2_decode")}


def _patch_interpreter_scalars():
    # triton 3.6's interpreter turns a scalar argument into int() of a 1-element array,
    # which numpy >= 2.4 refuses (`range(0, n, BK)` in a kernel); read the element instead
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_ssmq", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._ssmq = True
    interpreter._patch_lang_tensor = patched

    # it also leaves some masks (`int1 tensor & (scalar < scalar)`, the selective scan's B / C columns) int32 arrays,
    # which its load / store refuse ("mask has unsupported dtype"); a GPU reads them as predicates: make them bool
    def as_bool(mask):
        return mask if mask.data.dtype == np.bool_ else interpreter.TensorHandle(mask.data.astype(np.bool_), mask.dtype)

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store
    builder.create_masked_load = lambda self, ptrs, mask, *rest: load(self, ptrs, as_bool(mask), *rest)
    builder.create_masked_store = lambda self, ptrs, value, mask, *rest: store(self, ptrs, value, as_bool(mask), *rest)

    # its fma rounds the product before the sum (numpy a * b + c); a GPU's rounds once, and correctly rounded
    # quotients (``_common.quotient_rn``) depend on that. float32: the product is exact in float64, the sum's error
    # exact by TwoSum; rounding that sum to odd and then to float32 rounds the exact result once (53 >= 24 + 2 bits)
    fma = builder.create_fma

    def fused(self, x, y, z):
        if x.data.dtype != np.float32:
            return fma(self, x, y, z)
        p = x.data.astype(np.float64) * y.data.astype(np.float64)
        c = np.broadcast_to(z.data.astype(np.float64), p.shape)
        s = p + c
        b = s - p
        err = (p - (s - b)) + (c - b)
        even = (s.view(np.int64) & 1) == 0
        s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return interpreter.TensorHandle(s.astype(np.float32), z.dtype.scalar)

    builder.create_fma = fused


def cases(gpu, interp):
    return interp if INTERPRET else gpu


def rnd(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def rel(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(out, ref, tol):
    outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, r.shape, o.dtype, r.dtype)
        err = rel(o, r)
        assert err < tol, f"relative error {err:.3g} >= {tol:g}"  # NaN fails too


# --- causal conv1d -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,d,l,w", cases([(2, 37, 1, 4), (2, 200, 333, 4), (1, 5120 + 256, 1024, 4), (3, 64, 2, 3)],
                                          [(2, 37, 1, 4), (2, 40, 77, 4), (1, 24, 2, 3)]))
@pytest.mark.parametrize("full", [False, True])
def test_causal_conv1d(K, dtype, b, d, l, w, full):
    torch.manual_seed(0)
    x = rnd(b, l, d, dtype=dtype).transpose(1, 2)  # (b, d, l) with d contiguous, as sliced from in_proj
    weight = rnd(d, w, dtype=dtype)
    kw = dict(bias=rnd(d, dtype=dtype), initial_states=rnd(b, d, w - 1, dtype=dtype), return_final_states=True,
              activation="silu") if full else {}
    check(K["conv1d"].causal_conv1d(x, weight, **kw), ops.causal_conv1d_ref(x, weight, **kw), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,d,w", cases([(1, 1, 5120, 4), (5, 9, 333, 4), (32, 40, 1000, 3)], [(3, 7, 40, 4)]))
def test_causal_conv1d_update(K, dtype, b, s, d, w):
    torch.manual_seed(1)
    state = rnd(s, d, w - 1, dtype=dtype)
    state_k = state.clone()
    slots = torch.randperm(s, device=DEV)[:b]  # out of order, some slots untouched
    x, weight, bias = rnd(b, d, dtype=dtype), rnd(d, w, dtype=dtype), rnd(d, dtype=dtype)
    ref = ops.causal_conv1d_update_ref(x, state, weight, bias, "silu", slots)
    out = K["conv1d"].causal_conv1d_update(x, state_k, weight, bias, "silu", slots)
    check(out, ref, TOL[dtype])
    check(state_k, state, TOL[dtype])


# --- selective state update (decode) -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,h,p,n,g", cases([(1, 1, 80, 64, 128, 1), (4, 7, 8, 64, 128, 2), (3, 5, 6, 20, 24, 3)],
                                              [(3, 5, 6, 20, 24, 3)]))
@pytest.mark.parametrize("state_fp32", [False, True])
def test_selective_state_update_mamba2(K, dtype, b, s, h, p, n, g, state_fp32):
    torch.manual_seed(2)
    state = rnd(s, h, p, n, dtype=torch.float32 if state_fp32 else dtype)
    state_k = state.clone()
    slots = torch.randperm(s, device=DEV)[:b]
    x, z = rnd(b, h, p, dtype=dtype), rnd(b, h, p, dtype=dtype)
    # per-head scalars expanded over p with stride 0, as the models pass them
    dt = rnd(b, h, dtype=dtype)[..., None].expand(b, h, p)
    A = (-torch.rand(h, device=DEV) - 0.1)[:, None, None].expand(h, p, n)
    D, dt_bias = rnd(h)[:, None].expand(h, p), rnd(h)[:, None].expand(h, p)
    B, C = rnd(b, g, n, dtype=dtype), rnd(b, g, n, dtype=dtype)
    args = (x, dt, A, B, C, D, z, dt_bias, True, slots)
    ref = ops.selective_state_update_ref(state, *args)
    check(K["state_update"].selective_state_update(state_k, *args), ref, TOL[dtype])
    check(state_k, state, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,d,n", cases([(1, 1, 5120, 16), (6, 8, 333, 16), (2, 3, 64, 5)], [(3, 4, 40, 6)]))
def test_selective_state_update_mamba1(K, dtype, b, s, d, n):
    torch.manual_seed(3)
    state = rnd(s, d, n)
    state_k = state.clone()
    slots = torch.randperm(s, device=DEV)[:b]
    x, z, dt = rnd(b, d, dtype=dtype), rnd(b, d, dtype=dtype), rnd(b, d, dtype=dtype)
    A = -torch.rand(d, n, device=DEV) - 0.1
    args = (x, dt, A, rnd(b, n, dtype=dtype), rnd(b, n, dtype=dtype), rnd(d), z, rnd(d), True, slots)
    ref = ops.selective_state_update_ref(state, *args)
    check(K["state_update"].selective_state_update(state_k, *args), ref, TOL[dtype])
    check(state_k, state, TOL[dtype])


# --- SSD chunked scan (Mamba-2 prefill) ---------------------------------------------------------------------------

SSD_SHAPES = cases(
    [(1, 1024, 8, 64, 1, 128, 256), (2, 1000, 8, 64, 2, 128, 256), (2, 333, 6, 32, 3, 64, 64), (1, 7, 4, 64, 1, 128, 256),
     (3, 129, 4, 20, 2, 24, 32)],
    [(2, 37, 4, 16, 2, 16, 16), (1, 50, 2, 20, 1, 24, 32), (1, 5, 2, 16, 1, 16, 16)],
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,l,h,p,g,n,T", SSD_SHAPES)
@pytest.mark.parametrize("variant", ["plain", "full", "limit"])
def test_ssd_chunk_scan(K, dtype, b, l, h, p, g, n, T, variant):
    torch.manual_seed(4)
    # x, z as slices of one projection, like the model's in_proj output: strided over l
    proj = rnd(b, l, 2 * h * p + 7, dtype=dtype)
    x = proj[..., : h * p].unflatten(-1, (h, p))
    z = proj[..., h * p: 2 * h * p].unflatten(-1, (h, p))
    A = -torch.rand(h, device=DEV) - 0.5
    B, C = rnd(b, l, g, n, dtype=dtype), rnd(b, l, g, n, dtype=dtype)
    if variant == "plain":  # already-discretised, positive Δ
        dt, kw = (torch.rand(b, l, h, device=DEV) * 0.2).to(dtype), {}
    else:
        dt = rnd(b, l, h, dtype=dtype)
        kw = dict(dt_bias=rnd(h) - 2, dt_softplus=True, return_final_states=True)
        if variant == "full":
            kw.update(D=rnd(h), z=z, initial_states=rnd(b, h, p, n))
        else:
            kw.update(D=rnd(h, p), dt_limit=(0.01, 0.3))
    ref = ops.ssd_chunk_scan_ref(x, dt, A, B, C, T, **kw)
    check(K["ssd"].ssd_chunk_scan(x, dt, A, B, C, T, **kw), ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssd_chunk_scan_split_states(K, dtype, monkeypatch):
    """The alternative chunk-state path (parallel float32 chunk states, then the recurrence over chunks)."""
    monkeypatch.setitem(K["ssd"].CFG, "STATES", "split")
    torch.manual_seed(9)
    b, l, h, p, g, n, T = (2, 333, 6, 32, 3, 64, 64) if not INTERPRET else (2, 37, 4, 16, 2, 16, 16)
    x, z = rnd(b, l, h, p, dtype=dtype), rnd(b, l, h, p, dtype=dtype)
    dt, A = rnd(b, l, h, dtype=dtype), -torch.rand(h, device=DEV) - 0.5
    B, C = rnd(b, l, g, n, dtype=dtype), rnd(b, l, g, n, dtype=dtype)
    kw = dict(D=rnd(h), z=z, dt_bias=rnd(h) - 2, dt_softplus=True, initial_states=rnd(b, h, p, n),
              return_final_states=True)
    check(K["ssd"].ssd_chunk_scan(x, dt, A, B, C, T, **kw), ops.ssd_chunk_scan_ref(x, dt, A, B, C, T, **kw), TOL[dtype])


@pytest.mark.parametrize("states", ["fused", "split"])
@pytest.mark.parametrize("state_dtype", [torch.float16, torch.float32])
def test_ssd_chunk_scan_state_rows_in_place(K, states, state_dtype, monkeypatch):
    """``state_rows``: the kernels read the initial states from cache rows and write the final states there, as
    the reference; rows not served stay as they were, bit for bit."""
    monkeypatch.setitem(K["ssd"].CFG, "STATES", states)
    torch.manual_seed(10)
    b, l, h, p, g, n, T, s = (3, 200, 4, 32, 2, 64, 64, 7) if not INTERPRET else (2, 37, 2, 16, 1, 16, 16, 4)
    x, z = rnd(b, l, h, p, dtype=torch.float16), rnd(b, l, h, p, dtype=torch.float16)
    dt, A = rnd(b, l, h, dtype=torch.float16), -torch.rand(h, device=DEV) - 0.5
    B, C = rnd(b, l, g, n, dtype=torch.float16), rnd(b, l, g, n, dtype=torch.float16)
    kw = dict(D=rnd(h), z=z, dt_bias=rnd(h) - 2, dt_softplus=True)
    cache = rnd(s, h, p, n).to(state_dtype)
    rows = torch.tensor([s - 1, 0, 2][:b], device=DEV)
    want = cache.clone()
    y_ref = ops.ssd_chunk_scan_ref(x, dt, A, B, C, T, **kw, state_rows=(want, rows))
    got = cache.clone()
    y = K["ssd"].ssd_chunk_scan(x, dt, A, B, C, T, **kw, state_rows=(got, rows))
    check(y, y_ref, TOL[torch.float16])
    check(got[rows].float(), want[rows].float(), 2e-3)
    others = torch.ones(s, dtype=torch.bool, device=DEV)
    others[rows] = False
    assert torch.equal(got[others], cache[others])


def test_ssd_chunk_scan_equals_sequential(K):
    """The kernel against the token-by-token recurrence too, not only the chunked reference."""
    torch.manual_seed(5)
    b, l, h, p, g, n = 2, 45, 4, 16, 2, 16
    x, dt = rnd(b, l, h, p), torch.rand(b, l, h, device=DEV) * 0.3
    A, B, C = -torch.rand(h, device=DEV) - 0.5, rnd(b, l, g, n), rnd(b, l, g, n)
    init = rnd(b, h, p, n)
    ref = ops.ssd_sequential_ref(x, dt, A, B, C, initial_states=init, return_final_states=True)
    check(K["ssd"].ssd_chunk_scan(x, dt, A, B, C, 16, initial_states=init, return_final_states=True), ref, 1e-4)


# --- selective scan (Mamba-1 prefill) -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,d,l,n,g", cases([(1, 1536, 1024, 16, 1), (2, 333, 77, 16, 1), (2, 64, 130, 16, 4),
                                             (1, 40, 9, 5, 2)],
                                            [(2, 24, 19, 16, 1), (1, 20, 7, 6, 2)]))
@pytest.mark.parametrize("full", [False, True])
def test_selective_scan(K, dtype, b, d, l, n, g, full):
    torch.manual_seed(6)
    u = rnd(b, d, l, dtype=dtype)
    A = -torch.rand(d, n, device=DEV) - 0.2
    B = rnd(b, g, n, l, dtype=dtype) if g > 1 else rnd(b, n, l, dtype=dtype)
    C = torch.randn_like(B)
    if full:
        delta = rnd(b, d, l, dtype=dtype)
        kw = dict(D=rnd(d), z=rnd(b, d, l, dtype=dtype), delta_bias=rnd(d) - 2, delta_softplus=True,
                  initial_state=rnd(b, d, n), return_last_state=True)
    else:
        delta, kw = (torch.rand(b, d, l, device=DEV) * 0.2).to(dtype), {}
    ref = ops.selective_scan_ref(u, delta, A, B, C, **kw)
    check(K["scan"].selective_scan(u, delta, A, B, C, **kw), ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,d,l,n,g,nseg", cases([(2, 333, 203, 16, 1, 5), (1, 64, 130, 16, 4, 3), (1, 40, 9, 5, 2, 2)],
                                                 [(2, 24, 19, 16, 1, 3), (1, 20, 26, 6, 2, 4)]))
def test_selective_scan_segments(K, dtype, b, d, l, n, g, nseg, monkeypatch):
    """Time split into segments (end states first, then y from each segment's entering state)."""
    monkeypatch.setitem(K["scan"].CFG, "NSEG", nseg)
    torch.manual_seed(10)
    u, z, delta = rnd(b, d, l, dtype=dtype), rnd(b, d, l, dtype=dtype), rnd(b, d, l, dtype=dtype)
    A = -torch.rand(d, n, device=DEV) - 0.2
    B = rnd(b, g, n, l, dtype=dtype) if g > 1 else rnd(b, n, l, dtype=dtype)
    C = torch.randn_like(B)
    kw = dict(D=rnd(d), z=z, delta_bias=rnd(d) - 2, delta_softplus=True, initial_state=rnd(b, d, n),
              return_last_state=True)
    check(K["scan"].selective_scan(u, delta, A, B, C, **kw), ops.selective_scan_ref(u, delta, A, B, C, **kw), TOL[dtype])


# --- fused Mamba-2 decode step ------------------------------------------------------------------------------------

def _decode_inputs(b, s, h, p, g, n, dtype, state_dtype, gsize):
    conv_dim, w = h * p + 2 * g * n, 4
    return dict(
        xbc=rnd(b, conv_dim + h * p + h, dtype=dtype)[:, h * p:h * p + conv_dim],  # strided, as sliced from in_proj
        z=rnd(b, h * p, dtype=dtype), dt=rnd(b, h, dtype=dtype), conv_state=rnd(s, conv_dim, w - 1, dtype=dtype),
        conv_weight=rnd(conv_dim, w, dtype=dtype) * 0.5, conv_bias=rnd(conv_dim, dtype=dtype),
        ssm_state=rnd(s, h, p, n, dtype=state_dtype), A=-torch.rand(h, device=DEV) - 0.1, D=rnd(h),
        dt_bias=rnd(h) - 2, norm_weight=1 + 0.1 * rnd(h * p, dtype=dtype), ngroups=g,
        norm_group_size=gsize or h * p // g, eps=1e-5, slots=torch.randperm(s, device=DEV)[:b],
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,h,p,g,n,gsize", cases(
    [(1, 2, 80, 64, 1, 128, None), (3, 7, 32, 64, 8, 128, None), (32, 33, 80, 64, 1, 128, None),
     (256, 257, 32, 64, 8, 128, None), (5, 9, 12, 64, 4, 128, 384), (2, 3, 6, 20, 3, 24, None)],
    [(3, 5, 4, 16, 2, 16, None), (1, 2, 4, 16, 1, 16, 32), (2, 3, 4, 16, 4, 16, 32)]))
@pytest.mark.parametrize("variant", ["plain", "dt_limit", "state_fp32", "int8_dynamic", "int8_static"])
def test_mamba2_decode_step(K, dtype, b, s, h, p, g, n, gsize, variant, monkeypatch):
    monkeypatch.setattr(K["mamba2_decode"], "FUSED_MAX_BATCH", 1 << 30)  # the fused kernel at every batch
    torch.manual_seed(13)
    kw = _decode_inputs(b, s, h, p, g, n, dtype, torch.float32 if variant == "state_fp32" else dtype, gsize)
    if variant == "dt_limit":
        kw["dt_limit"] = (0.001, 0.1)
    if variant.startswith("int8"):
        kw["quantize"] = True
        kw["out_scale"] = torch.tensor(0.01, device=DEV) if variant == "int8_static" else None
    kk = {k: v.clone() if k in ("conv_state", "ssm_state") else v for k, v in kw.items()}
    ref = ops.mamba2_decode_step_ref(**kw)
    out = K["mamba2_decode"].mamba2_decode_step(**kk)
    if not kw.get("quantize"):
        check(out, ref, TOL[dtype])
    else:
        check(out[0], ref[0], TOL[dtype])
        check(out[2], ref[2], TOL[dtype])
        # codes: within one step where out or its scale differs by a rounding
        assert out[1].dtype == torch.int8 and (out[1].int() - ref[1].int()).abs().max() <= 1
        assert (out[1] != ref[1]).float().mean() < 0.02
    check(kk["conv_state"], kw["conv_state"], TOL[dtype])
    check(kk["ssm_state"], kw["ssm_state"], TOL[dtype])
    # twice more: the row counters were reset by the first launch, so each launch still normalises once
    for _ in range(2):
        ref = ops.mamba2_decode_step_ref(**kw)
        out = K["mamba2_decode"].mamba2_decode_step(**kk)
    check(out[0] if kw.get("quantize") else out, ref[0] if kw.get("quantize") else ref, TOL[dtype])
    check(kk["ssm_state"], kw["ssm_state"], TOL[dtype])


@pytest.mark.parametrize("quantize", [False, True])
def test_mamba2_decode_step_several_tiles_and_tail_blocks(K, quantize, monkeypatch):
    # few SMs: programs take several tiles each; a small tail block: the row is normalised in several blocks
    mod = K["mamba2_decode"]
    monkeypatch.setattr(mod, "sm_count", lambda device: 1)
    monkeypatch.setattr(mod, "FUSED_MAX_BATCH", 1 << 30)
    monkeypatch.setattr(mod, "MAX_TILES", 16)
    monkeypatch.setattr(mod, "MAX_TAIL", 32)
    torch.manual_seed(14)
    kw = _decode_inputs(3, 5, 4, 16, 2, 16, torch.float32, torch.float32, None)
    assert mod.tiles_per_program(3, 4, 2, "cpu") == 2
    kk = {k: v.clone() if k in ("conv_state", "ssm_state") else v for k, v in kw.items()}
    ref = ops.mamba2_decode_step_ref(**kw, quantize=quantize)
    out = mod.mamba2_decode_step(**kk, quantize=quantize)
    check(out[:1] + out[2:] if quantize else out, ref[:1] + ref[2:] if quantize else ref, TOL[torch.float32])
    if quantize:
        assert (out[1].int() - ref[1].int()).abs().max() <= 1
    check(kk["conv_state"], kw["conv_state"], TOL[torch.float32])
    check(kk["ssm_state"], kw["ssm_state"], TOL[torch.float32])


def test_mamba2_decode_tile_fits_norm_groups(K):
    tile = K["mamba2_decode"].tile_channels
    cpu = torch.device("cpu")  # 132 SMs assumed
    assert tile(1, 80, 64, 128, 5120, cpu) == 16 and tile(32, 80, 64, 128, 5120, cpu) == 32
    assert tile(1, 6, 20, 24, 40, cpu) == 4 and tile(1, 6, 18, 24, 36, cpu) == 0  # 0: the unfused kernels run


# --- norms ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", cases([(3, 5, 2560), (7, 333), (1, 1, 64)], [(3, 5, 40)]))
@pytest.mark.parametrize("mode", ["first", "fp32", "native"])
def test_rms_norm(K, dtype, shape, mode):
    torch.manual_seed(7)
    x, w = rnd(*shape, dtype=dtype), 1 + 0.1 * rnd(shape[-1], dtype=dtype)
    kw = {"first": {}, "fp32": dict(residual=rnd(*shape)), "native": dict(residual=rnd(*shape, dtype=dtype),
                                                                         residual_in_fp32=False)}[mode]
    check(K["norm"].rms_norm(x, w, **kw), ops.rms_norm_ref(x, w, **kw), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,group", cases([((2, 9, 5120), 5120), ((2, 9, 5120), 640), ((7, 40), 10)],
                                              [((3, 5, 40), 40), ((3, 5, 40), 8)]))
@pytest.mark.parametrize("gate", ["none", "after", "before"])
def test_rmsnorm_gated(K, dtype, shape, group, gate):
    torch.manual_seed(8)
    x, w = rnd(*shape, dtype=dtype), 1 + 0.1 * rnd(shape[-1], dtype=dtype)
    kw = {} if gate == "none" else dict(z=rnd(*shape, dtype=dtype), norm_before_gate=gate == "before")
    kw["group_size"] = group
    check(K["norm"].rmsnorm_gated(x, w, **kw), ops.rmsnorm_gated_ref(x, w, **kw), TOL[dtype])


# --- decode GEMV ------------------------------------------------------------------------------------------------

def _linear_ref(x, w, b):
    """F.linear in float64 on the same (rounded) inputs, cast back to x's dtype like the kernel's output."""
    return torch.nn.functional.linear(x.double(), w.double(), b.double() if b is not None else None).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n,k", cases([(70, 130), (300, 2560), (2560, 5120), (1000, 64)], [(70, 130), (300, 2560)]))
@pytest.mark.parametrize("bias", [False, True])
def test_gemv(K, dtype, rows, n, k, bias):
    torch.manual_seed(11)
    x, w = rnd(rows, k, dtype=dtype), rnd(n, k, dtype=dtype, scale=k ** -0.5)
    b = rnd(n, dtype=dtype) if bias else None
    check(K["gemv"].linear_decode(x, w, b), _linear_ref(x, w, b), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["fma", "dot", "split", "fma-late"])
def test_gemv_paths(K, dtype, path):
    """Each code path forced, whatever the heuristic would pick: both tile kinds at any row count,
    a K split with a ragged last split (K not a multiple of BLOCK_K), more rows than one program
    serves (several row blocks); and the first weight tile loaded after PDL's wait (EARLY_TILE off)."""
    torch.manual_seed(12)
    cfg = {"fma": dict(PATH="fma"), "dot": dict(PATH="dot"), "fma-late": dict(PATH="fma", EARLY_TILE=False),
           "split": dict(MIN_SPLIT_K=16, WAVES=10**6, BK_FMA=32, BK_DOT=32)}[path]
    for rows, n, k in [(1, 45, 200), (6, 33, 170), (19, 20, 96)]:
        x, w, b = rnd(rows, k, dtype=dtype), rnd(n, k, dtype=dtype, scale=k ** -0.5), rnd(n, dtype=dtype)
        c = K["gemv"]._config(rows, n, k, 132, {**K["gemv"].CFG, **cfg})
        assert c["split"] > 1 if path == "split" else c["DOT"] == (path == "dot")
        check(K["gemv"].linear_decode(x, w, b, cfg=cfg), _linear_ref(x, w, b), TOL[dtype])


def test_gemv_leading_dims_and_empty(K):
    torch.manual_seed(13)
    x, w, b = rnd(2, 1, 96), rnd(40, 96), rnd(40)
    check(K["gemv"].linear_decode(x, w, b), _linear_ref(x, w, b), TOL[torch.float32])
    xt = rnd(96, 3).t()  # unit stride on rows, not on K: copied
    check(K["gemv"].linear_decode(xt, w), _linear_ref(xt, w, None), TOL[torch.float32])
    xs, bs = rnd(3, 200)[:, 50:146], rnd(80)[::2]  # rows 200 apart, read in place; a strided bias
    check(K["gemv"].linear_decode(xs, w, bs), _linear_ref(xs, w, bs), TOL[torch.float32])
    assert K["gemv"].linear_decode(rnd(0, 96), w).shape == (0, 40)
    # K = 0: no products, the output is the bias alone, as in F.linear
    check(K["gemv"].linear_decode(rnd(2, 0), rnd(40, 0), b), b.expand(2, 40), 1e-7)


def test_gemv_config_heuristic():
    """Pure-Python launch sizing: few output blocks get a K split, many get none, splits cover K."""
    triton = pytest.importorskip("triton")
    from ssmq.kernels import gemv

    for m, n, k in [(1, 10576, 2560), (1, 2560, 5120), (8, 2560, 5120), (1, 50288, 2560), (8, 50288, 2560),
                    (3, 70, 130), (20, 100, 1000), (1, 1, 1)]:
        c = gemv._config(m, n, k, 132)
        assert c["k_split"] % c["BLOCK_K"] == 0 and (c["split"] - 1) * c["k_split"] < k <= c["split"] * c["k_split"]
        assert c["grid"] == (triton.cdiv(n, c["BLOCK_N"]) * triton.cdiv(m, c["BLOCK_M"]), c["split"])
    assert gemv._config(1, 50288, 2560, 132)["split"] == 1
    assert gemv._config(8, 2560, 5120, 132)["split"] > 1


# --- dispatch -------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="dispatch sends CUDA tensors to the kernels")
def test_dispatch_uses_kernels_on_cuda(K, monkeypatch):
    from ssmq.kernels import dispatch

    called = []
    monkeypatch.setattr(K["norm"], "rms_norm", lambda *a, **k: called.append(1) or ("k", None))
    assert dispatch.rms_norm(rnd(2, 8), rnd(8))[0] == "k" and called
    x = torch.randn(2, 8)
    assert torch.equal(dispatch.rms_norm(x, torch.ones(8))[0], ops.rms_norm_ref(x, torch.ones(8))[0])  # CPU: reference


@pytest.mark.skipif(not torch.cuda.is_available(), reason="dispatch sends CUDA tensors to the kernels")
def test_dispatch_linear(K, monkeypatch):
    from ssmq.kernels import dispatch

    called = []
    real = K["gemv"].linear_decode
    monkeypatch.setattr(K["gemv"], "linear_decode", lambda *a: called.append(1) or real(*a))
    w, b = rnd(64, 32, dtype=torch.float16), rnd(64, dtype=torch.float16)
    x = rnd(2, 3, 32, dtype=torch.float16)
    check(dispatch.linear(x, w, b), _linear_ref(x, w, b), TOL[torch.float16])
    assert called == [1]
    dispatch.linear(rnd(9, 32, dtype=torch.float16), w, b)  # past 8 rows: cuBLAS
    dispatch.linear(rnd(2, 32), rnd(64, 32))  # float32: cuBLAS
    assert called == [1]
