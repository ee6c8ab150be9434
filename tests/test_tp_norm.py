"""The gated norm split over tensor-parallel ranks (``ssmq.ops.norm`` *_partial / *_reduced / rstd_scale).

CPU: the rank-local references, with the all-reduce simulated by a sum, give the unsharded gated norm (two-all-reduce
path) and out_proj of it (fused path). ``gpu`` (or ``SSMQ_TRITON_INTERPRET=1``): the Triton twins equal the
references; with 2 GPUs, a tiny Mamba-2 with one norm group sharded over 2 ranks (NCCL and one-shot all-reduce,
fused and two-all-reduce norm, eager and CUDA-graph decode) gives the single-GPU logits.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ssmq.ops.norm import rmsnorm_gated_partial_ref, rmsnorm_gated_reduced_ref, rmsnorm_gated_ref, rstd_scale_ref


def _shards(t, world):
    return t.chunk(world, dim=-1)


@pytest.mark.parametrize("before", [False, True], ids=["gate-first", "norm-before-gate"])
@pytest.mark.parametrize("world,group", [(2, 256), (4, 256), (4, 128)])
def test_two_reduce_refs_compose_to_the_gated_norm(world, group, before):
    """Ranks' partial sums of squares, summed (the all-reduce), then each rank's reduced norm == the full norm (the
    gate first, or after the norm: Falcon-H1's)."""
    torch.manual_seed(0)
    d, eps = 256, 1e-5
    x, z, w = torch.randn(3, 2, d), torch.randn(3, 2, d), 1 + 0.1 * torch.randn(d)
    n_groups, d_l = d // group, d // world
    sends = []
    for r, (xr, zr, wr) in enumerate(zip(_shards(x, world), _shards(z, world), _shards(w, world))):
        ss = torch.full((3, 2, n_groups), float("nan"))  # every column is written
        assert rmsnorm_gated_partial_ref(xr, wr, zr, ss, r * d_l // group, with_out=False,
                                         norm_before_gate=before) is None
        sends.append(ss)
    red = sum(sends)
    out = torch.cat([rmsnorm_gated_reduced_ref(xr, wr, zr, red, r * d_l // group, group, eps, before)
                     for r, (xr, zr, wr) in enumerate(zip(_shards(x, world), _shards(z, world), _shards(w, world)))],
                    dim=-1)
    ref = rmsnorm_gated_ref(x, w, z, eps, group, before)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias, before", [(False, False), (True, False), (False, True)])
def test_fused_refs_compose_to_out_proj_of_the_gated_norm(bias, before):
    """Σ_ranks [out_proj_r(u_r · w_r) | ss_r], then rstd_scale == out_proj(norm(u) · w) (+ bias)."""
    torch.manual_seed(1)
    d, n, eps, world = 192, 40, 1e-6, 2
    x, z, w = torch.randn(5, d), torch.randn(5, d), 1 + 0.1 * torch.randn(d)
    W, b = torch.randn(n, d) / d ** 0.5, torch.randn(n) if bias else None
    red = 0
    for xr, zr, wr, Wr in zip(_shards(x, world), _shards(z, world), _shards(w, world), _shards(W, world)):
        part = torch.empty(5, n + 1)
        yw = rmsnorm_gated_partial_ref(xr, wr, zr, part[:, -1:], norm_before_gate=before)
        part[:, :-1] = F.linear(yw, Wr)
        red = red + part
    out = rstd_scale_ref(red, d, eps, b, torch.float32)
    ref = F.linear(rmsnorm_gated_ref(x, w, z, eps, norm_before_gate=before), W, b)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Triton kernels vs the references
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def NS():
    from test_kernels import kernel_module

    return kernel_module("norm_sharded")


def _kernel_cases():
    from test_kernels import DTYPES, INTERPRET

    shapes = [((2,), 40, 1), ((3,), 96, 3)] if INTERPRET else [((1,), 2560, 1), ((8,), 2560, 1), ((2, 3), 1280, 4),
                                                               ((64,), 4096, 2), ((1,), 40, 1)]
    return [(lead, d, k, dt) for lead, d, k in shapes for dt in DTYPES]


@pytest.mark.gpu
@pytest.mark.parametrize("before", [False, True], ids=["gate-first", "norm-before-gate"])
@pytest.mark.parametrize("lead,d,k,dtype", _kernel_cases())
def test_partial_and_reduced_kernels_match_references(NS, lead, d, k, dtype, before):
    from test_kernels import DEV, TOL, rel

    torch.manual_seed(2)
    # x and z as strided views of one in_proj-like output, as the mixer hands them over
    proj = torch.randn(*lead, 3 * d + 7, device=DEV).to(dtype)
    z, x = proj[..., :d], proj[..., d + 3:2 * d + 3]
    w = (1 + 0.1 * torch.randn(d, device=DEV)).to(dtype)
    col = k - 1
    # fused path: the sum of squares goes into the last column of the send tensor beside out_proj's outputs
    part, part_ref = (torch.full((*lead, 33), float("nan"), device=DEV) for _ in range(2))
    yw = NS.rmsnorm_gated_partial(x, w, z, part[..., -1:], 0, norm_before_gate=before)
    yw_ref = rmsnorm_gated_partial_ref(x, w, z, part_ref[..., -1:], 0, norm_before_gate=before)
    assert yw.dtype == dtype and yw.shape == x.shape
    assert rel(yw, yw_ref) <= TOL[dtype]
    assert rel(part[..., -1], part_ref[..., -1]) <= 1e-5
    assert torch.isnan(part[..., :-1]).all()  # nothing else of the row touched
    # two-all-reduce path: the whole (..., k) row, the group column and zeros
    ss, ss_ref = (torch.full((*lead, k), float("nan"), device=DEV) for _ in range(2))
    assert NS.rmsnorm_gated_partial(x, w, z, ss, col, with_out=False, norm_before_gate=before) is None
    rmsnorm_gated_partial_ref(x, w, z, ss_ref, col, with_out=False, norm_before_gate=before)
    assert rel(ss, ss_ref) <= 1e-5 and (ss[..., :col] == 0).all()
    red = ss * 2.5  # as if the other ranks had added theirs
    out = NS.rmsnorm_gated_reduced(x, w, z, red, col, 2 * d, 1e-5, before)
    ref = rmsnorm_gated_reduced_ref(x, w, z, red, col, 2 * d, 1e-5, before)
    assert out.dtype == dtype and rel(out, ref) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("lead,d,k,dtype", _kernel_cases())
def test_rstd_scale_kernel_matches_reference(NS, lead, d, k, dtype):
    from test_kernels import DEV, TOL, rel

    torch.manual_seed(3)
    red = torch.randn(*lead, d + 1, device=DEV)
    red[..., -1] = red[..., -1].abs() * d
    for bias in (None, torch.randn(d, device=DEV).to(dtype)):
        out = NS.rstd_scale(red, 2 * d, 1e-6, bias, dtype)
        ref = rstd_scale_ref(red, 2 * d, 1e-6, bias, dtype)
        assert out.dtype == dtype and out.shape == (*lead, d) and rel(out, ref) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_gemv_writes_float32_into_a_column_slice(rows):
    """``linear_decode(out=...)``: the fused path's out_proj writes its float32 sums beside the norm's column (both the
    one-pass and the K-split GEMV), leaving that column alone."""
    from test_kernels import DEV, DTYPES, INTERPRET, kernel_module, rel

    gemv = kernel_module("gemv")
    torch.manual_seed(4)
    n, k = (48, 1024) if INTERPRET else (2560, 2560)
    for dtype in DTYPES:
        x, w = torch.randn(rows, k, device=DEV).to(dtype), (torch.randn(n, k, device=DEV) / k ** 0.5).to(dtype)
        for split in (False, True):  # MAX_SPLIT 1: one pass; MIN_SPLIT_K 256: a K split
            cfg = {"MAX_SPLIT": 8, "MIN_SPLIT_K": 256, "WAVES": 64} if split else {"MAX_SPLIT": 1}
            part = torch.full((rows, n + 1), float("nan"), device=DEV)
            assert gemv.linear_decode(x, w, cfg=cfg, out=part[:, :-1]).data_ptr() == part.data_ptr()
            assert rel(part[:, :-1], F.linear(x.float(), w.float())) <= (1e-5 if dtype == torch.float32 else 2e-3)
            assert torch.isnan(part[:, -1]).all()
    with pytest.raises(ValueError, match="view"):
        gemv.linear_decode(x, w, out=torch.empty(rows, n + 1, device=DEV)[:, :-2])


def test_partial_kernel_refuses_a_send_buffer_it_cannot_write_in_place(NS):
    from test_kernels import DEV

    x = torch.randn(4, 32, device=DEV)
    with pytest.raises(ValueError, match="unit stride"):
        NS.rmsnorm_gated_partial(x, torch.ones(32, device=DEV), x, torch.zeros(3, 4, device=DEV).t(), 0)


@pytest.mark.parametrize("use_gdc", [False, True])
def test_kernels_compile_for_sm90_with_and_without_pdl(use_gdc):
    """The three kernels (and the GEMV's K-split sum with its row stride) compile for the H100/H200 at Mamba2-2.7B's
    TP=2 sizes; with USE_GDC each waits on griddepcontrol before its first load (the PDL contract of
    ssmq.kernels._common)."""
    pytest.importorskip("triton")
    from test_kernel_compile import _compile_sm90

    from ssmq.kernels import norm_sharded as ns

    if type(ns._gated_partial).__name__ == "InterpretedFunction":
        pytest.skip("kernels are interpreted in this session (SSMQ_TRITON_INTERPRET=1)")
    io = {"x_ptr": "bf16", "z_ptr": "bf16", "w_ptr": "bf16"}
    for kernel, pointers, const, floats in (
        (ns._gated_partial, {**io, "out_ptr": "bf16", "ss_ptr": "fp32"},
         {"WITH_OUT": True, "BLOCK": 4096, "BLOCK_K": 2}, ()),
        (ns._gated_partial, {**io, "out_ptr": "bf16", "ss_ptr": "fp32"},
         {"WITH_OUT": False, "BLOCK": 2048, "BLOCK_K": 4}, ()),
        (ns._gated_reduced, {**io, "ss_ptr": "fp32", "out_ptr": "bf16"}, {"BLOCK": 4096}, ("eps",)),
        (ns._rstd_scale, {"red_ptr": "fp32", "b_ptr": "bf16", "out_ptr": "bf16"}, {"HAS_BIAS": True, "BLOCK": 4096},
         ("eps",)),
    ):
        ptx = _compile_sm90(kernel, pointers, {**const, "USE_GDC": use_gdc}, floats=floats, num_warps=16).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == use_gdc
        if use_gdc:
            assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    # the GEMV's K-split sum with strided output rows (linear_into's float32 column slice)
    from ssmq.kernels import gemv

    ptx = _compile_sm90(gemv._sum_splits, {"p_ptr": "fp32", "b_ptr": "fp32", "out_ptr": "fp32"},
                        {"HAS_BIAS": False, "BLOCK": 1024, "USE_GDC": use_gdc}).asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == use_gdc


# ---------------------------------------------------------------------------------------------
# two GPUs: a sharded Mamba-2 with one norm group == one GPU
# ---------------------------------------------------------------------------------------------
def _gpu_rank(rank, world, init_file, out_dir, dtype):
    import torch.distributed as dist
    from tiny_ssm import tiny_model

    from ssmq.runtime.cuda_graph import CudaGraphDecoder
    from ssmq.runtime.tp import apply_tp
    from ssmq.runtime.tp_comm import Communicator
    from ssmq.runtime.tp_launch import init_tp

    _, _, device = init_tp(world, device="cuda", init_method=f"file://{init_file}", rank=rank, world=world)
    results = {}
    for fuse in (True, False):
        for mode in ("auto", "nccl"):  # auto: the one-shot symmetric-memory all-reduce at these sizes
            model = tiny_model("mamba2", ngroups=1).to(device=device, dtype=dtype)
            ref = _steps(CudaGraphDecoder, model, dtype)
            comm = Communicator(mode=mode, device=device)
            apply_tp(model, comm, fuse_norm=fuse)
            got = _steps(CudaGraphDecoder, model, dtype)
            results[f"fuse={fuse} {mode} copy_in={comm._symm[2] if comm._symm else None}"] = (got, ref)
    torch.save(results, Path(out_dir) / f"{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@torch.no_grad()
def _steps(decoder_cls, model, dtype, steps: int = 4) -> dict:
    """Logits (CPU, float32) of ``steps`` decode steps from empty states on fixed tokens (no argmax feedback: a
    bf16 near-tie must not send two runs down different sequences): eager ``model.step`` (b = 3, the GEMV's
    K-split path) and CUDA-graph replays (b = 2). Decode only, so no prefill kernel compiles in the GPU step."""
    out = {}
    for name, b in (("eager", 3), ("graph", 2)):
        slots, logits = torch.arange(b, device=model.device), []
        if name == "eager":
            cache = model.allocate_cache(b, 16, dtype=dtype)
            step = lambda tok: model.step(tok, cache, slots)  # noqa: E731
        else:
            dec = decoder_cls(model, max_batch=b, max_seqlen=16, buckets=(b,), dtype=dtype)
            step = lambda tok: dec(tok, slots)  # noqa: E731
        for t in range(steps):
            tok = torch.tensor([3 + t, 17 + 2 * t, 40 - t][:b], device=model.device)
            logits.append(step(tok).float().cpu())  # the graph's logits are a view of its output buffer
        out[name] = torch.stack(logits)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_sharded_norm_on_two_gpus_equals_one_gpu(dtype, tol):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_gpu_rank, args=(r, 2, os.path.join(tmp, "init"), tmp, dtype)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert codes == [0, 0], f"ranks exited with {codes}"
        per_rank = [torch.load(Path(tmp) / f"{r}.pt", weights_only=False) for r in range(2)]
    assert len(per_rank[0]) == 4
    for name, (got, ref) in per_rank[0].items():
        for key in ("eager", "graph"):
            err = ((got[key] - ref[key]).abs().max() / ref[key].abs().max().clamp(min=1)).item()
            assert err <= tol, f"{name} {key}: max |TP - single| / max |logit| = {err:.2e}"
            assert torch.equal(per_rank[1][name][0][key], got[key]), f"{name} {key}: ranks disagree"
