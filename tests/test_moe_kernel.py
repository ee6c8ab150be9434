"""The grouped-GEMM mixture of experts (``kernels.moe``) against its reference (``ops.moe.moe_experts_ref``), and the
reference against the experts as modules.

CPU: the reference equals a loop over per-expert ``GatedMLP`` / squared-ReLU ``MLP`` modules; the kernel's block tables
cover every (token, expert) pair once, each block one expert's. ``gpu`` (or ``SSMQ_TRITON_INTERPRET=1``): the Triton
kernel equals the reference over shapes, dtypes, both activations, decode-sized and empty inputs, experts without
tokens; on CUDA a captured graph of it replays the eager result for other routings.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ssmq.ops.moe import moe_experts_ref


def _case(t, d, f, E, k, act, dtype=torch.float32, device="cpu", seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g)
    # distinct experts per token; skew: most tokens to the first experts, some experts get none
    pool = max(k, E // 3) if skew else E
    idx = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k).long()
    w = torch.rand(t, k, generator=g).softmax(-1)
    wu = torch.randn(E, f, d, generator=g) / d ** 0.5
    wd = torch.randn(E, d, f, generator=g) / f ** 0.5
    wg = torch.randn(E, f, d, generator=g) / d ** 0.5 if act == "silu" else None
    to = lambda t_: None if t_ is None else t_.to(device, dtype)  # noqa: E731
    return to(x), w.to(device), idx.to(device), to(wu), to(wd), to(wg)


@pytest.mark.parametrize("act", ["silu", "relu2"])
def test_reference_equals_the_expert_modules(act):
    x, w, idx, wu, wd, wg = _case(23, 32, 24, 6, 2, act)
    out = torch.zeros(23, 32)
    for tok in range(23):
        for j in range(2):
            e = idx[tok, j]
            up = x[tok] @ wu[e].T
            h = F.silu(x[tok] @ wg[e].T) * up if act == "silu" else F.relu(up) ** 2
            out[tok] += w[tok, j] * (h @ wd[e].T)
    torch.testing.assert_close(moe_experts_ref(x, w, idx, wu, wd, wg, act), out, atol=1e-5, rtol=1e-5)


def test_reference_refuses_a_gate_that_does_not_match_the_activation():
    x, w, idx, wu, wd, wg = _case(3, 16, 16, 4, 2, "silu")
    with pytest.raises(ValueError, match="expected silu with a gate"):
        moe_experts_ref(x, w, idx, wu, wd, None, "silu")
    with pytest.raises(ValueError, match="expected silu with a gate"):
        moe_experts_ref(x, w, idx, wu, wd, wg, "relu2")


@pytest.mark.parametrize("t, k, E", [(1, 2, 8), (5, 3, 4), (40, 6, 64), (7, 2, 16)])
def test_block_tables_cover_every_pair_once(t, k, E):
    moe = pytest.importorskip("ssmq.kernels.moe")
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(t)])
    order, be, bs, bend = moe.block_tables(idx, E)
    assert len(be) == -(-t * k // moe.BLOCK_M) + E  # the static worst case
    rows = torch.cat([torch.arange(s, e) for s, e in zip(bs.tolist(), bend.tolist())])
    assert sorted(rows.tolist()) == list(range(t * k))  # every sorted row in exactly one block
    flat = idx.reshape(-1)
    for e, s, end in zip(be.tolist(), bs.tolist(), bend.tolist()):
        assert end - s <= moe.BLOCK_M and (flat[order[s:end]] == e).all()  # one expert's pairs a block


@pytest.fixture(scope="module")
def MK():
    from test_kernels import kernel_module

    return kernel_module("moe")


def _kernel_cases():
    from test_kernels import DTYPES, INTERPRET

    shapes = [(1, 32, 24, 8, 2, False), (9, 48, 40, 6, 3, True), (33, 64, 48, 8, 2, False), (0, 32, 24, 4, 2, False)]
    if not INTERPRET:
        shapes += [(1, 1536, 512, 64, 6, False), (64, 1536, 512, 64, 6, False), (300, 2048, 768, 72, 10, True),
                   (2048, 1024, 256, 128, 6, False)]
    return [(*s, act, dt) for s in shapes for act in ("silu", "relu2") for dt in DTYPES]


@pytest.mark.gpu
@pytest.mark.parametrize("t, d, f, E, k, skew, act, dtype", _kernel_cases())
def test_kernel_matches_reference(MK, t, d, f, E, k, skew, act, dtype):
    from test_kernels import DEV, TOL, rel

    x, w, idx, wu, wd, wg = _case(t, d, f, E, k, act, dtype, DEV, skew=skew)
    out = MK.moe_experts(x, w, idx, wu, wd, wg, act)
    ref = moe_experts_ref(x, w, idx, wu, wd, wg, act)
    assert out.dtype == dtype and out.shape == (t, d)
    if t:
        assert rel(out, ref) <= TOL[dtype]


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph(MK):
    """Captured once, replayed for other routings of the same number of tokens: the eager result each time."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    x, w, idx, wu, wd, wg = _case(12, 64, 48, 8, 2, "silu", torch.float16, "cuda")
    static = [x.clone(), w.clone(), idx.clone()]
    MK.moe_experts(*static, wu, wd, wg, "silu")  # warm-up: compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = MK.moe_experts(*static, wu, wd, wg, "silu")
    for seed in (1, 2, 3):
        x2, w2, idx2, *_ = _case(12, 64, 48, 8, 2, "silu", torch.float16, "cuda", seed=seed, skew=seed == 2)
        for buf, new in zip(static, (x2, w2, idx2)):
            buf.copy_(new)
        graph.replay()
        torch.testing.assert_close(out, MK.moe_experts(x2, w2, idx2, wu, wd, wg, "silu"), atol=0, rtol=0)
